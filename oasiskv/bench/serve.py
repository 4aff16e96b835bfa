"""`oasiskv bench serve`: online load against an OpenAI-compatible server, with vLLM's flags and
the lines vLLM prints (so numbers compare directly), plus what moved for sparse requests.

Prompts are random token ids sent as the completion `prompt` (a list of ints), so a model with
dummy weights and no tokenizer works; or, with `--dataset-name text`, windows of real text
(Python's standard library sources and a license, tokenized by the server's /tokenize), so a
real model decodes what it would in use and its lookahead has something to predict. Every
request streams; one SSE chunk carries one token, so chunk arrival times give TTFT and the
inter-token latencies (ITL), and the final usage chunk gives the token count. TPOT excludes the first token: (E2EL - TTFT) / (tokens - 1).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import numpy as np

from oasiskv.entrypoints.openai.server_process import start_server, stop_server


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 "
                   "(default: from --host and --port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name to send; default: the server's (/v1/models)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--dataset-name", choices=["random", "text"], default="random",
                   help="random: random token ids; text: windows of real text as long as the random "
                        "dataset's prompts, at random offsets (tokenized by the server's /tokenize)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf = all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [len * (1 - r), len * (1 + r)]")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly the output length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", action="store_true", help="write the result as JSON")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--server-args", default=None,
                   help="start `oasiskv serve ARGS` on --host/--port first, and stop it afterwards")
    p.add_argument("--server-timeout", type=float, default=600.0, help="seconds to wait for /health")


# ---- one request ----------------------------------------------------------------------------
@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache (usage)
    error: str = ""


async def send_request(session, url: str, model: str, prompt: list[int], max_tokens: int,
                       ignore_eos: bool) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
    result = RequestResult(prompt_len=len(prompt))
    start = last = time.perf_counter()
    tokens = 0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    result.success = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    break
                now = time.perf_counter()
                if chunk.get("choices"):
                    if tokens == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    tokens, last = tokens + 1, now
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                    result.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    except Exception as e:  # a dropped connection counts as a failed request, not a crash
        result.error = repr(e)
    result.latency = time.perf_counter() - start
    result.output_tokens = tokens
    return result


# ---- the load ---------------------------------------------------------------------------------
def random_requests(args, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(args.seed)
    r = args.random_range_ratio

    def lengths(n: int) -> np.ndarray:
        return rng.integers(max(1, int(n * (1 - r))), int(n * (1 + r)) + 1, size=args.num_prompts)

    ins, outs = lengths(args.random_input_len), lengths(args.random_output_len)
    return [(rng.integers(0, vocab_size, size=int(i)).tolist(), int(o)) for i, o in zip(ins, outs)]


TEXT_MODULES = ("typing", "argparse", "shutil", "calendar", "inspect", "subprocess")


def text_requests(args, base_url: str, model: str) -> list[tuple[list[int], int]]:
    """`--num-prompts` windows of real text: the modules' sources and a license, tokenized by the
    server, one stream of tokens; each window starts at a random offset of it."""
    from oasiskv.eval.texts import module_source, text_path

    with open(text_path("prose"), encoding="utf-8", errors="replace") as f:
        texts = [module_source(m) for m in TEXT_MODULES] + [f.read()]
    stream: list[int] = []
    for text in texts:
        body = json.dumps({"model": model, "prompt": text, "add_special_tokens": False}).encode()
        req = urllib.request.Request(base_url + "/tokenize", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            stream += json.loads(r.read())["tokens"]
    rng = np.random.default_rng(args.seed)
    requests = []
    for ids, out_len in random_requests(args, 2):  # the random dataset's input and output lengths
        n = len(ids)
        if n > len(stream):
            raise ValueError(f"--random-input-len {n} is longer than the text ({len(stream)} tokens)")
        start = int(rng.integers(0, len(stream) - n + 1))
        requests.append((stream[start:start + n], out_len))
    return requests


async def run_load(args, base_url: str, model: str, requests: list[tuple[list[int], int]]):
    import aiohttp

    url = base_url + args.endpoint
    rng = np.random.default_rng(args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(prompt, max_tokens):
            if limit is None:
                return await send_request(session, url, model, prompt, max_tokens, args.ignore_eos)
            async with limit:
                return await send_request(session, url, model, prompt, max_tokens, args.ignore_eos)

        tasks = []
        start = time.perf_counter()
        for prompt, max_tokens in requests:
            tasks.append(asyncio.create_task(one(prompt, max_tokens)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


async def check_server(args, base_url: str, model: str, prompt: list[int]) -> None:
    """One short request first, as vLLM does: fail fast on a wrong URL or model name."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        first = await send_request(session, base_url + args.endpoint, model, prompt, 2, True)
    if not first.success:
        raise RuntimeError(f"the test request failed: {first.error}")


def scrape_metrics(base_url: str) -> dict[str, float]:
    """Our counters from /metrics, summed over labels."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
    return values


def summarize(args, results: list[RequestResult], duration: float, before: dict, after: dict) -> dict:
    ok = [r for r in results if r.success]
    ms = lambda xs: [1000 * x for x in xs] or [0.0]  # noqa: E731
    ttft = ms([r.ttft for r in ok])
    tpot = ms([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1])
    itl = ms([x for r in ok for x in r.itl])
    e2el = ms([r.latency for r in ok])
    n_in, n_out = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    out = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
           "num_prompts": len(results),
           "request_rate": "inf" if args.request_rate == float("inf") else args.request_rate,  # strict JSON
           "max_concurrency": args.max_concurrency, "total_input_tokens": n_in, "total_output_tokens": n_out,
           "request_throughput": len(ok) / duration, "output_throughput": n_out / duration,
           "total_token_throughput": (n_in + n_out) / duration}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        out[f"mean_{name}_ms"] = float(np.mean(xs))
        out[f"median_{name}_ms"] = float(np.median(xs))
        out[f"std_{name}_ms"] = float(np.std(xs))
        out[f"p99_{name}_ms"] = float(np.percentile(xs, 99))
    delta = lambda k: after.get(k, 0.0) - before.get(k, 0.0)  # noqa: E731
    predicted = delta("oasiskv:sparse_lookahead_predicted_blocks_total")
    out["sparse_requests"] = int(delta("oasiskv:sparse_requests_total"))
    out["sparse_host_to_gpu_bytes"] = delta("oasiskv:sparse_host_to_gpu_bytes_total")
    out["sparse_lookahead_hit_rate"] = (delta("oasiskv:sparse_lookahead_hit_blocks_total") / predicted
                                        if predicted else None)
    out["sparse_pipeline_stall_s"] = delta("oasiskv:sparse_pipeline_stall_seconds_total")
    drafts = delta("oasiskv:sparse_draft_tokens_total")
    out["sparse_draft_acceptance"] = delta("oasiskv:sparse_draft_accepted_tokens_total") / drafts if drafts else None
    # Every sparse step's figures (overlapped steps too), from the server's per-step counters.
    step = {k: delta(f"oasiskv:sparse_step_{k}_total") for k in
            ("stall_seconds", "foreground_seconds", "host_to_gpu_bytes", "budget_bytes", "hit_blocks",
             "predicted_blocks")}
    out["sparse_decode_steps"] = int(delta("oasiskv:sparse_decode_steps_total"))
    out["sparse_step_stall_s"] = step["stall_seconds"]
    busy = step["stall_seconds"] + step["foreground_seconds"]
    out["sparse_step_stall_frac"] = step["stall_seconds"] / busy if busy else None
    out["sparse_step_bytes"] = step["host_to_gpu_bytes"]
    out["sparse_step_gb_per_request"] = step["host_to_gpu_bytes"] / 1e9 / len(ok) if ok else None
    out["sparse_step_budget_use"] = (step["host_to_gpu_bytes"] / step["budget_bytes"]
                                     if step["budget_bytes"] else None)
    out["sparse_step_hit_rate"] = (step["hit_blocks"] / step["predicted_blocks"]
                                   if step["predicted_blocks"] else None)
    out["sparse_conversions"] = int(delta("oasiskv:sparse_conversions_total"))
    out["num_preemptions"] = int(delta("oasiskv:num_preemptions_total"))
    queries = delta("oasiskv:prefix_cache_queries_total")
    out["prefix_cache_hit_rate"] = delta("oasiskv:prefix_cache_hits_total") / queries if queries else None
    host_queries = delta("oasiskv:prefix_cache_queries_host_total")
    out["prefix_cache_host_hit_rate"] = (delta("oasiskv:prefix_cache_hits_host_total") / host_queries
                                         if host_queries else None)
    out["prefix_cache_host_hit_tokens"] = int(delta("oasiskv:prefix_cache_hits_host_total"))
    out["prefill_computed_tokens"] = int(delta("oasiskv:prefill_computed_tokens_total"))
    out["total_cached_tokens"] = sum(r.cached_tokens for r in ok)
    out["cached_tokens"] = [r.cached_tokens for r in results]
    out["input_lens"] = [r.prompt_len for r in results]
    out["output_lens"] = [r.output_tokens for r in results]
    out["ttfts"] = [r.ttft for r in results]
    out["errors"] = [r.error for r in results]
    return out


def print_result(res: dict) -> None:
    line = lambda label, value, fmt="": print(f"{label:<40} {value:{fmt}}")  # noqa: E731
    print("{:=^50}".format(" Serving Benchmark Result "))
    line("Successful requests:", res["completed"])
    if res["failed"]:
        line("Failed requests:", res["failed"])
    if res["max_concurrency"]:
        line("Maximum request concurrency:", res["max_concurrency"])
    line("Benchmark duration (s):", res["duration"], ".2f")
    line("Total input tokens:", res["total_input_tokens"])
    line("Total generated tokens:", res["total_output_tokens"])
    line("Request throughput (req/s):", res["request_throughput"], ".2f")
    line("Output token throughput (tok/s):", res["output_throughput"], ".2f")
    line("Total Token throughput (tok/s):", res["total_token_throughput"], ".2f")
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print("{:-^50}".format(title))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            line(f"{label} {key.upper()} (ms):", res[f"{stat}_{key}_ms"], ".2f")
    if res["sparse_requests"]:
        print("{:-^50}".format("Sparse decode (KV beyond GPU)"))
        line("Sparse requests:", res["sparse_requests"])
        line("Host->GPU bytes per sparse request (MiB):",
             res["sparse_host_to_gpu_bytes"] / res["sparse_requests"] / 2**20, ".2f")
        line("Lookahead hit rate (%):", 100 * (res["sparse_lookahead_hit_rate"] or 0.0), ".1f")
        if res.get("sparse_draft_acceptance") is not None:
            line("Draft acceptance (%):", 100 * res["sparse_draft_acceptance"], ".1f")
        line("Pipeline stall (s):", res["sparse_pipeline_stall_s"], ".3f")
    if res.get("sparse_decode_steps"):
        print("{:-^50}".format("Sparse steps (every step)"))
        line("Sparse decode steps:", res["sparse_decode_steps"])
        line("Pipeline stall, all steps (s):", res["sparse_step_stall_s"], ".3f")
        line("Stall / sparse step time (%):", 100 * (res["sparse_step_stall_frac"] or 0.0), ".2f")
        line("Host->GPU per request (GB):", res["sparse_step_gb_per_request"] or 0.0, ".2f")
        if res["sparse_step_budget_use"] is not None:
            line("Transfer budget used (%):", 100 * res["sparse_step_budget_use"], ".1f")
        line("Hit rate, all steps (%):", 100 * (res["sparse_step_hit_rate"] or 0.0), ".1f")
        line("Conversions to sparse:", res["sparse_conversions"])
    if res.get("prefix_cache_hit_rate") is not None:
        line("Prefix cache hit rate, GPU tier (%):", 100 * res["prefix_cache_hit_rate"], ".1f")
        line("Prompt tokens from the cache:", res["total_cached_tokens"])
    if res.get("prefix_cache_host_hit_rate") is not None:
        line("Host tier hit rate (%):", 100 * res["prefix_cache_host_hit_rate"], ".1f")
        line("Prompt tokens from the host tier:", res["prefix_cache_host_hit_tokens"])
        line("Prefill tokens computed:", res["prefill_computed_tokens"])
    line("Preemptions:", res.get("num_preemptions", 0))
    print("=" * 50)


def run_bench_serve(args) -> int:
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    server = None
    if args.server_args is not None:
        print(f"starting `oasiskv serve {args.server_args}` on {base_url}", flush=True)
        server = start_server(shlex.split(args.server_args), args.host, args.port, args.server_timeout)
    try:
        with urllib.request.urlopen(base_url + "/v1/models", timeout=10) as r:
            card = json.loads(r.read())["data"][0]
        model = args.model or card["id"]
        if args.dataset_name == "text":
            requests = text_requests(args, base_url, model)
        else:
            requests = random_requests(args, card.get("vocab_size", 1000))
        asyncio.run(check_server(args, base_url, model, requests[0][0]))
        before = scrape_metrics(base_url)  # after the test request, so it counts only the load
        results, duration = asyncio.run(run_load(args, base_url, model, requests))
        after = scrape_metrics(base_url)
    finally:
        if server is not None:
            stop_server(server)
    result = summarize(args, results, duration, before, after)
    result.update(model=model, endpoint=args.endpoint, dataset_name=args.dataset_name,
                  random_input_len=args.random_input_len,
                  random_output_len=args.random_output_len, ignore_eos=args.ignore_eos)
    print_result(result)
    if result["failed"]:
        print(f"first error: {next(e for e in result['errors'] if e)}", file=sys.stderr)
    if args.save_result or args.result_filename:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        name = args.result_filename or f"bench-serve-{model.replace('/', '_')}-{stamp}.json"
        path = os.path.join(args.result_dir, name)
        os.makedirs(args.result_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {path}")
    return 0 if not result["failed"] else 1
