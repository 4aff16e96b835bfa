"""The OpenAI server on the real default model (CPU): answers equal the engine's own greedy output,
bad requests get OpenAI error bodies, 200 concurrent streams complete exactly once, and clients
that go away leave no GPU page and no host extent behind.

One server process for the whole module, started while the test process loads the reference
engine with the same flags. The flags make requests that may outgrow 128 tokens reserve a host
extent (and go sparse), so the disconnect test covers the host pool too.
"""
from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest
from server_client import call, free_port, metrics, stream_events

from oasiskv import LLM, SamplingParams
from oasiskv.entrypoints.openai.server_process import start_server, stop_server, wait_for_health

ENGINE = dict(max_model_len=512, max_num_batched_tokens=64, sparse=True, sparse_threshold=128,
              top_k_blocks=4, host_kv_gb=0.05)
FLAGS = ["--max-model-len", "512", "--max-num-batched-tokens", "64", "--sparse", "--sparse-threshold", "128",
         "--top-k-blocks", "4", "--host-kv-gb", "0.05", "--log-level", "warning"]
PROMPT = "The three primary colors are"
MESSAGES = [{"role": "user", "content": "Name a fruit that is yellow."}]
GREEDY = SamplingParams(temperature=0, max_tokens=5)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    proc = start_server(FLAGS, "127.0.0.1", port, wait=False, stdout=log, stderr=log)
    yield proc, f"http://127.0.0.1:{port}", log
    assert stop_server(proc) in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM once it has drained
    log.close()


@pytest.fixture(scope="module")
def llm(server):
    llm = LLM(**ENGINE)  # loads while the server process loads the same model
    proc, base, log = server
    try:
        wait_for_health(base, 300, proc)
    except Exception:
        log.seek(0)
        raise RuntimeError("server did not start:\n" + log.read()[-3000:])
    return llm


@pytest.fixture(scope="module")
def base(server, llm):
    return server[1]


# ---- answers equal the engine's ----------------------------------------------------------------
@pytest.mark.parametrize("prompt", [PROMPT, [1, 504, 3117, 1789, 5262, 359]], ids=["text", "token-ids"])
def test_completion_equals_engine(base, llm, prompt):
    want = llm.generate(prompt, GREEDY)[0]
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 5, "temperature": 0}
    status, got = call(base, "/v1/completions", body)
    assert status == 200, got
    assert got["object"] == "text_completion"
    choice = got["choices"][0]
    assert choice["text"] == want.text and choice["finish_reason"] == want.finish_reason
    assert got["usage"] == {"prompt_tokens": len(want.prompt_token_ids), "completion_tokens": 5,
                            "total_tokens": len(want.prompt_token_ids) + 5}

    events = stream_events(base, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events[:-1] if e["choices"]]
    assert len(chunks) == 5  # one chunk per token
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert events[-2]["usage"]["completion_tokens"] == 5


def test_chat_equals_engine(base, llm):
    want = llm.chat(MESSAGES, GREEDY)
    body = {"model": "SmolLM2-135M-Instruct", "messages": MESSAGES, "max_tokens": 5, "temperature": 0}
    status, got = call(base, "/v1/chat/completions", body)
    assert status == 200, got
    assert got["object"] == "chat.completion"
    assert got["choices"][0]["message"] == {"role": "assistant", "content": want.text}
    assert got["choices"][0]["finish_reason"] == want.finish_reason

    events = stream_events(base, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want.text
    assert chunks[-1]["choices"][0]["finish_reason"] == want.finish_reason


def test_stop_string_streamed_equals_whole(base):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    text = call(base, "/v1/completions", body)[1]["choices"][0]["text"]
    stop = text[4:7]  # a piece of what it will write, so it stops early
    status, whole = call(base, "/v1/completions", {**body, "stop": [stop]})
    assert status == 200 and whole["choices"][0]["finish_reason"] == "stop"
    events = stream_events(base, "/v1/completions", {**body, "stop": [stop]})
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert streamed == whole["choices"][0]["text"] and stop not in streamed


def test_models_health_metrics(base):
    status, models = call(base, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == ["SmolLM2-135M-Instruct"]
    assert models["data"][0]["max_model_len"] == 512
    assert call(base, "/health")[0] == 200
    m = metrics(base)
    for name in ("oasiskv:num_requests_running", "oasiskv:num_requests_waiting", "oasiskv:gpu_cache_usage_perc",
                 "oasiskv:host_pool_usage_perc", "oasiskv:prompt_tokens_total", "oasiskv:generation_tokens_total",
                 "oasiskv:time_to_first_token_seconds_count", "oasiskv:time_per_output_token_seconds_count",
                 "oasiskv:e2e_request_latency_seconds_count", "oasiskv:sparse_host_to_gpu_bytes_total",
                 "oasiskv:sparse_lookahead_hit_rate", "oasiskv:sparse_pipeline_stall_seconds_total"):
        assert name in m, name
    assert m["oasiskv:generation_tokens_total"] > 0 and m["oasiskv:host_pool_bytes_total"] > 0


# ---- bad requests: a 4xx with OpenAI's error body, and the server keeps serving ---------------------
BAD = [
    ("malformed-json", "/v1/completions", b'{"prompt": "hi", "max_tokens": ', 400, None),
    ("missing-prompt", "/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("missing-messages", "/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("max-tokens-zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-negative", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": -3}, 400, "max_tokens"),
    ("negative-temperature", "/v1/completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("over-long-prompt", "/v1/completions", {"prompt": [7] * 600, "max_tokens": 4}, 400, "prompt"),
    ("bad-token-id", "/v1/completions", {"prompt": [10**9], "max_tokens": 4}, 400, "prompt"),
    ("unknown-model", "/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
    ("unknown-model-chat", "/v1/chat/completions", {"model": "gpt-4", "messages": MESSAGES}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_gets_openai_error(base, path, body, status, param):
    got_status, got = call(base, path, body)
    assert got_status == status, got
    assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}
    assert got["error"]["message"] and got["error"]["param"] == param
    # ... and the server still serves.
    assert call(base, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1})[0] == 200


# ---- abort frees pages and the host extent, wherever the request is --------------------------------
def test_engine_abort_frees_everything(llm):
    """Aborted while waiting, mid-prefill, and after going sparse (working set + host extent)."""
    e = llm.engine
    bm, host = e.block_manager, e.runner.sparse.host
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    e.add_request(list(range(1000, 1140)), params, "sparse")  # 140 > 128 tokens: an extent, then sparse
    e.add_request([5] * 8, params, "waiting")
    e.step()  # 64 prompt tokens of "sparse"; the token budget is spent, so "waiting" waits
    assert [s.request_id for s in e.scheduler.waiting] == ["waiting"] and host.bytes_used > 0
    e.abort("waiting")
    assert not e.scheduler.waiting

    e.add_request([6] * 70, params, "mid-prefill")
    e.step()  # "sparse" takes the whole budget again
    e.step()  # "sparse" finishes its prompt (12) and converts; "mid-prefill" gets 52 of 70
    assert e.seqs["sparse"].sparse is not None
    assert e.seqs["mid-prefill"].in_prefill and e.seqs["mid-prefill"].pages
    pages_of_sparse = len(e.seqs["sparse"].pages)
    e.abort("mid-prefill")
    assert bm.num_pages - bm.num_free == pages_of_sparse  # only the working set is left
    e.abort("sparse")
    assert bm.num_free == bm.num_pages and host.bytes_used == 0 and not e.has_unfinished()


# ---- load ---------------------------------------------------------------------------------------
async def _stream(session, base: str, body: dict, stop_after: int | None = None, wait: float = 60.0) -> dict:
    """One streamed completion; with `stop_after`, hang up after that many tokens (or `wait` s)."""
    got = {"tokens": 0, "done": 0, "finish": [], "usage": None}

    async def read(resp):
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                got["done"] += 1
                continue
            chunk = json.loads(data)
            if chunk["choices"]:
                got["tokens"] += 1
                got["finish"].append(chunk["choices"][0]["finish_reason"])
            else:
                got["usage"] = chunk["usage"]
            if stop_after is not None and got["tokens"] >= stop_after:
                return

    async with session.post(base + "/v1/completions", json={**body, "stream": True}) as resp:
        got["status"] = resp.status
        try:
            await asyncio.wait_for(read(resp), wait)
        except asyncio.TimeoutError:
            pass
        resp.close()  # drops the connection if the stream is not over
    return got


def test_200_concurrent_streams_complete_once(base):
    import aiohttp

    async def run():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            bodies = [{"prompt": [100 + i, 200 + i, 300 + i, 400 + i], "max_tokens": 3, "ignore_eos": True,
                       "temperature": 0, "stream_options": {"include_usage": True}} for i in range(200)]
            return await asyncio.gather(*(_stream(session, base, b, wait=120) for b in bodies))

    results = asyncio.run(run())
    for r in results:
        assert r["status"] == 200
        assert r["tokens"] == 3 and r["done"] == 1 and r["finish"] == [None, None, "length"]
        assert r["usage"]["completion_tokens"] == 3
    m = metrics(base)
    assert m["oasiskv:num_requests_running"] == 0 and m["oasiskv:gpu_pages_used"] == 0


def test_disconnects_free_pages_and_host_extents(base):
    """50 streaming clients hang up mid-stream (running, waiting for host-pool room, or sparse),
    3 non-streaming clients time out: nothing stays allocated."""
    import aiohttp

    aborted_before = metrics(base).get('oasiskv:request_success_total{finished_reason="abort"}', 0)

    async def impatient(session, body):
        try:
            async with session.post(base + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=1)):
                pass
        except asyncio.TimeoutError:
            pass

    async def run():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            # 16 + 200 tokens may pass 128: each reserves a host extent; the pool holds ~5, the rest wait.
            bodies = [{"prompt": [50 + i] * 16, "max_tokens": 200, "ignore_eos": True} for i in range(49)]
            bodies.append({"prompt": list(range(1000, 1140)), "max_tokens": 200, "ignore_eos": True})  # sparse
            bodies.append({"prompt": [9] * 8, "max_tokens": 100, "ignore_eos": True})  # 108 <= 128: no extent
            streams = [_stream(session, base, b, stop_after=2, wait=4.0) for b in bodies[:50]]
            whole = [impatient(session, {**b, "stream": False}) for b in bodies[48:]]
            return await asyncio.gather(*streams, *whole)

    asyncio.run(run())
    deadline = time.monotonic() + 30
    while True:
        m = metrics(base)
        idle = (m["oasiskv:num_requests_running"] == 0 and m["oasiskv:num_requests_waiting"] == 0
                and m["oasiskv:gpu_pages_used"] == 0 and m["oasiskv:host_pool_bytes_used"] == 0)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, {k: v for k, v in m.items() if "num_requests" in k or "used" in k}
    assert m['oasiskv:request_success_total{finished_reason="abort"}'] - aborted_before == 53
    assert call(base, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1})[0] == 200
