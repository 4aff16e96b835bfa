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
import urllib.request

import pytest
from server_client import call, free_port, metrics, stream_events, wait_idle, wait_started

from oasiskv import LLM, SamplingParams
from oasiskv.engine.llm_engine import RequestOutput
from oasiskv.entrypoints.openai.server_process import start_server, stop_server

pytestmark = [pytest.mark.slow, pytest.mark.server]

ENGINE = dict(max_model_len=512, max_num_batched_tokens=64, sparse=True, sparse_threshold=128,
              top_k_blocks=4, host_kv_gb=0.05)
LIMIT = 200_000  # --max-request-bytes
FLAGS = ["--max-model-len", "512", "--max-num-batched-tokens", "64", "--sparse", "--sparse-threshold", "128",
         "--top-k-blocks", "4", "--host-kv-gb", "0.05", "--log-level", "warning",
         "--max-request-bytes", str(LIMIT), "--header-timeout", "1", "--body-timeout", "2"]
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
    wait_started(base, proc, log)
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
    cached = got["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert got["usage"] == {"prompt_tokens": len(want.prompt_token_ids), "completion_tokens": 5,
                            "total_tokens": len(want.prompt_token_ids) + 5}
    assert 0 <= cached < len(want.prompt_token_ids)

    events = stream_events(base, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [e for e in events[:-1] if e["choices"]]
    assert len(chunks) == 5  # one chunk per token
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert events[-2]["usage"]["completion_tokens"] == 5
    # The same prompt again: its full blocks come from the prefix cache (16 tokens each).
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == (len(want.prompt_token_ids) - 1) // 16 * 16


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


def test_chat_template_options(base, llm):
    """vLLM's continue_final_message and chat_template_kwargs: the prompt is the template's
    rendering with them, as /v1/completions would complete it."""
    conversation = MESSAGES + [{"role": "assistant", "content": "A banana is"}]
    rendered = llm.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False,
                                                 continue_final_message=True)
    assert rendered.endswith("A banana is")
    want = call(base, "/v1/completions", {"prompt": rendered, "max_tokens": 5, "temperature": 0})[1]
    body = {"messages": conversation, "max_tokens": 5, "temperature": 0, "add_generation_prompt": False,
            "continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}}
    status, got = call(base, "/v1/chat/completions", body)
    assert status == 200, got
    assert got["choices"][0]["message"]["content"] == want["choices"][0]["text"]
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    template = {k: body[k] for k in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")}
    counted = call(base, "/tokenize", {"messages": conversation, **template})[1]
    assert counted["count"] == got["usage"]["prompt_tokens"]
    for bad, param in [({"add_generation_prompt": True}, "continue_final_message"),
                       ({"messages": MESSAGES}, "continue_final_message"),
                       ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
                       ({"chat_template_kwargs": {"chat_template": "{{ 7 }}"}}, "chat_template_kwargs")]:
        status, err = call(base, "/v1/chat/completions", {**body, **bad})
        assert status == 400 and err["error"]["param"] == param, err


def test_a_repeated_prompt_reports_its_cached_tokens(base):
    """The second time, the prompt's full blocks (2 of 16 tokens) come from the prefix cache: usage
    and /metrics say so, and the answer is the same."""
    body = {"prompt": [(11 * j) % 900 + 30 for j in range(40)], "max_tokens": 3, "temperature": 0}
    hits = lambda: metrics(base).get("oasiskv:prefix_cache_hits_total", 0.0)  # noqa: E731
    before = hits()
    first, second = call(base, "/v1/completions", body)[1], call(base, "/v1/completions", body)[1]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert second["choices"] == first["choices"]
    assert hits() - before == 32


def test_stop_string_streamed_equals_whole(base):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    text = call(base, "/v1/completions", body)[1]["choices"][0]["text"]
    stop = text[4:7]  # a piece of what it will write, so it stops early
    status, whole = call(base, "/v1/completions", {**body, "stop": [stop]})
    assert status == 200 and whole["choices"][0]["finish_reason"] == "stop"
    events = stream_events(base, "/v1/completions", {**body, "stop": [stop]})
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert streamed == whole["choices"][0]["text"] and stop not in streamed
def test_vllm_text_fields(base):
    """include_stop_str_in_output keeps the stop string, skip_special_tokens false writes special
    tokens out, min_p 1 is greedy: whole and streamed alike."""
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    text = call(base, "/v1/completions", body)[1]["choices"][0]["text"]
    stop = text[4:7]
    kept = {**body, "stop": [stop], "include_stop_str_in_output": True}
    whole = call(base, "/v1/completions", kept)[1]["choices"][0]
    assert whole["finish_reason"] == "stop" and whole["text"] == text[:text.index(stop) + len(stop)]
    assert "".join(e["choices"][0]["text"] for e in stream_events(base, "/v1/completions", kept)[:-1]) == whole["text"]

    forced = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {"2": 100}}
    assert call(base, "/v1/completions", forced)[1]["choices"][0]["text"] == ""  # <|im_end|> is special
    raw = {**forced, "skip_special_tokens": False}
    assert call(base, "/v1/completions", raw)[1]["choices"][0]["text"] == "<|im_end|>" * 3
    assert "".join(e["choices"][0]["text"] for e in stream_events(base, "/v1/completions", raw)[:-1]) == "<|im_end|>" * 3

    for path, req in [("/v1/completions", body), ("/v1/chat/completions", {**body, "prompt": None, "messages": MESSAGES})]:
        req = {k: v for k, v in req.items() if v is not None}
        opts = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        chunks = stream_events(base, path, {**req, **opts})[:-1]
        done = [c["usage"]["completion_tokens"] for c in chunks]
        assert done == sorted(done) and done[-1] == chunks[-1]["usage"]["total_tokens"] - chunks[-1]["usage"]["prompt_tokens"]
        assert chunks[-1]["choices"] == [] and 0 < done[-1] <= 12 and len(set(done)) > 1

    sampled = call(base, "/v1/completions", {**body, "temperature": 1.0, "min_p": 1.0, "seed": 5})[1]
    assert sampled["choices"][0]["text"] == text
    assert call(base, "/v1/completions", {**body, "min_p": 1.5})[0] == 400


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
    # Values that once stopped the engine or leaked an exception's text.
    ("top-k-overflow", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "top_k": 10**20, "temperature": 1},
     400, "top_k"),
    ("top-k-above-vocab", "/v1/completions", {"prompt": "hi", "top_k": 49153}, 400, "top_k"),
    ("seed-2^64", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2**64}, 400, "seed"),
    ("seed-negative", "/v1/completions", {"prompt": "hi", "seed": -1}, 400, "seed"),
    ("lone-surrogate", "/v1/completions", b'{"prompt": "x \\ud83d y", "max_tokens": 2}', 400, "prompt"),
    ("lone-surrogate-chat", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "a \\udc00"}]}', 400, "messages"),
    ("tiny-temperature", "/v1/completions", {"prompt": "hi", "temperature": 1e-45}, 400, "temperature"),
    ("max-tokens-past-model", "/v1/completions", {"prompt": "hi", "max_tokens": 600}, 400, "max_tokens"),
    ("chat-past-model", "/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 600}, 400,
     "max_tokens"),
    # Strict types: no string for a number or a bool.
    ("string-max-tokens", "/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("string-stream", "/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("bool-top-k", "/v1/completions", {"prompt": "hi", "top_k": True}, 400, "top_k"),
    ("nan-top-p", "/v1/completions", b'{"prompt": "hi", "top_p": NaN}', 400, "top_p"),
    ("n-too-many", "/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n"),
    ("best-of-below-n", "/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    ("min-tokens-above-max", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400,
     "min_tokens"),
    ("max-tokens-0-without-echo", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("bad-logit-bias", "/v1/completions", {"prompt": "hi", "logit_bias": {"99999999": 5}}, 400, "logit_bias"),
    ("bad-stop-token", "/v1/completions", {"prompt": "hi", "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    # Unknown fields and fields this server does not implement: refused by name, never ignored.
    ("unknown-field", "/v1/completions", {"prompt": "hi", "max_token": 5}, 400, "max_token"),
    ("suffix", "/v1/completions", {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
    ("tools", "/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "tools"),
    ("tool-choice-without-tools", "/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "auto"}, 400,
     "tool_choice"),
    # Structured output: a malformed or invalid spec is a 400 naming the field.
    ("response-format", "/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "xml"}},
     400, "response_format"),
    ("bad-json-schema", "/v1/chat/completions", {"messages": MESSAGES, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, 400, "response_format"),
    ("bad-guided-regex", "/v1/completions", {"prompt": "hi", "guided_regex": "a(b"}, 400, "guided_regex"),
    ("two-constraints", "/v1/completions", {"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}, 400,
     "guided_choice"),
    ("transfer-on-a-plain-server", "/v1/completions", {"prompt": "hi", "guided_choice": ["a"],
                                                       "kv_transfer_params": {}}, 400, "kv_transfer_params"),
    # Tools: a malformed tool, an unsupported tool type or tool_choice form, an unknown function.
    ("tool-without-function", "/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}],
                                                       "tool_choice": "none"}, 400, "tools"),
    ("tool-not-a-function", "/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "code_interpreter"}]},
     400, "tools"),
    ("tool-choice-unknown-function", "/v1/chat/completions", {
        "messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("tool-choice-allowed-tools", "/v1/chat/completions", {
        "messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "allowed_tools", "allowed_tools": {}}}, 400, "tool_choice"),
    ("tool-parameters-invalid", "/v1/chat/completions", {
        "messages": MESSAGES, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, 400, "tools"),
    ("tool-call-arguments-not-json", "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     400, "messages"),
    ("tools-on-completions", "/v1/completions", {"prompt": "hi", "tools": []}, 400, "tools"),
    ("echo-stream", "/v1/completions", {"prompt": "hi", "echo": True, "stream": True}, 400, "echo"),
]
@pytest.mark.parametrize("path,body,status,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request_gets_openai_error(base, path, body, status, param):
    got_status, got = call(base, path, body)
    assert got_status == status, got
    assert set(got) == {"error"} and set(got["error"]) == {"message", "type", "param", "code"}
    assert got["error"]["message"] and got["error"]["param"] == param
    assert "Error(" not in got["error"]["message"]  # a message, never an exception's repr
    # ... and the server still serves.
    assert call(base, "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1})[0] == 200
    assert call(base, "/health")[0] == 200


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
def test_disconnects_free_pages_and_host_extents(base, server):
    """50 streaming clients hang up mid-stream (running, waiting for host-pool room, or sparse),
    3 non-streaming clients time out: nothing stays allocated, and the server logs no error."""
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
    with open(server[2].name) as f:
        log = f.read()
    assert "unhandled error" not in log and "never retrieved" not in log, log[-3000:]


# ---- the request guard: size limit and slow clients ----------------------------------------------
def _raw(base: str, data: bytes, read_timeout: float = 10.0) -> bytes:
    """Send raw bytes on a fresh connection; everything the server answers before closing."""
    import socket
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=read_timeout) as sock:
        sock.sendall(data)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
                if b"\r\n\r\n" in got and b'"error"' in got:
                    break
        except TimeoutError:
            pass
        return got


def test_body_over_the_limit_is_413_before_it_is_read(base):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {50 * 2**20}\r\n\r\n").encode()
    t0 = time.monotonic()
    got = _raw(base, head + b'{"prompt": "')  # 50 MB announced, a few bytes sent
    assert got.startswith(b"HTTP/1.1 413") and b"max-request-bytes" in got
    assert time.monotonic() - t0 < 2
    # Chunked (no Content-Length): refused once the bytes received pass the limit.
    chunk = b"x" * 65536
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(LIMIT // len(chunk) + 2))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert _raw(base, head + body).startswith(b"HTTP/1.1 413")
    # Just under the limit is read (and then judged on its content).
    status, _ = call(base, "/v1/completions", {"prompt": "hi", "user": "u" * (LIMIT - 100)})
    assert status == 200
    assert call(base, "/health")[0] == 200
def test_slow_headers_and_bodies_are_cut(base):
    t0 = time.monotonic()
    assert _raw(base, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n") == b""  # closed after --header-timeout 1
    assert time.monotonic() - t0 < 5
    got = _raw(base, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
    assert got.startswith(b"HTTP/1.1 408")  # --body-timeout 2
    assert call(base, "/v1/completions", {"prompt": "hi", "max_tokens": 1})[0] == 200


# ---- what real tools send ----------------------------------------------------------------------------
def test_openai_client(base, llm):
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused")
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0].text
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text == want and r.usage.completion_tokens == 8
    streamed = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == want
    stop = want[3:6]
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8, temperature=0,
                                  stop=[stop])
    assert r.choices[0].text == want[:want.index(stop)] and r.choices[0].finish_reason == "stop"
    # n=2 with a seed: choice i is sampled with seed + i, so a repeat gives the same pair.
    pair = [client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=6, n=2,
                                      seed=7, temperature=1.0) for _ in range(2)]
    assert [c.index for c in pair[0].choices] == [0, 1]
    assert [c.text for c in pair[0].choices] == [c.text for c in pair[1].choices]
    assert 2 <= pair[0].usage.completion_tokens <= 12

    chat_want = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8)).text
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.content == chat_want
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES,
                                       max_completion_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in r) == chat_want
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=5, n=2,
                                       seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1]


def test_batched_prompts_are_prompt_major(base, llm):
    prompts = [[1, 504, 3117], [1, 504, 3117, 1789, 5262], "The capital of France is"]
    status, got = call(base, "/v1/completions", {"prompt": prompts[:2], "max_tokens": 4, "temperature": 0, "n": 2})
    assert status == 200, got
    assert [c["index"] for c in got["choices"]] == [0, 1, 2, 3]
    for i, p in enumerate(prompts[:2]):
        want = llm.generate(p, SamplingParams(temperature=0, max_tokens=4))[0].text
        assert [c["text"] for c in got["choices"][2 * i:2 * i + 2]] == [want, want]
    assert got["usage"]["prompt_tokens"] == 8 and got["usage"]["completion_tokens"] == 16
    status, got = call(base, "/v1/completions", {"prompt": [prompts[2], "Hello"], "max_tokens": 3, "temperature": 0})
    assert status == 200 and got["choices"][0]["text"] == llm.generate(prompts[2], SamplingParams(
        temperature=0, max_tokens=3))[0].text


def test_tokenizer_routes(base, llm):
    tok = llm.engine.tokenizer
    status, got = call(base, "/tokenize", {"prompt": "hello world", "add_special_tokens": False})
    assert status == 200 and got["tokens"] == tok.encode("hello world", add_special_tokens=False)
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 512
    status, got = call(base, "/tokenize", {"messages": MESSAGES})
    assert got["tokens"] == tok.encode(tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                                       add_special_tokens=False)
    assert call(base, "/detokenize", {"tokens": [28120, 905]})[1] == {"prompt": tok.decode([28120, 905])}
    status, info = call(base, "/tokenizer_info")
    assert status == 200 and info["eos_token"] == tok.eos_token and info["chat_template"] == tok.chat_template
    assert call(base, "/version")[1]["version"]
    assert call(base, "/v1/models/SmolLM2-135M-Instruct")[1]["id"] == "SmolLM2-135M-Instruct"
    assert call(base, "/v1/models/gpt-4")[0] == 404


def test_operator_metrics(base):
    call(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    m = metrics(base)
    for name in ("oasiskv:kv_cache_usage_perc", "oasiskv:num_preemptions_total",
                 "oasiskv:request_queue_time_seconds_count", "oasiskv:request_prefill_time_seconds_count",
                 "oasiskv:request_decode_time_seconds_count", "oasiskv:inter_token_latency_seconds_count",
                 "oasiskv:request_prompt_tokens_count", "oasiskv:request_generation_tokens_count"):
        assert name in m, name
    assert m["oasiskv:engine_alive"] == 1 and m["oasiskv:request_queue_time_seconds_count"] > 0
    with urllib.request.urlopen(base + "/metrics") as r:
        samples = [line for line in r.read().decode().splitlines() if line.startswith("oasiskv:")]
    assert samples and all('model_name="SmolLM2-135M-Instruct"' in line for line in samples)
def test_bench_serve_on_real_text(base, tmp_path):
    """`bench serve --dataset-name text`: windows of real text tokenized by the server, long
    enough to go sparse here, with the lookahead's hit rate and draft acceptance reported."""
    from oasiskv.entrypoints.cli import main

    port = int(base.rsplit(":", 1)[1])
    wait_idle(base)  # the server's counters are its own: no other request may finish during the bench
    rc = main(["bench", "serve", "--port", str(port), "--dataset-name", "text", "--num-prompts", "3",
               "--random-input-len", "200", "--random-output-len", "12", "--ignore-eos",
               "--result-dir", str(tmp_path), "--result-filename", "bench.json"])
    assert rc == 0
    res = json.loads((tmp_path / "bench.json").read_text())
    assert res["completed"] == 3 and res["input_lens"] == [200] * 3 and res["dataset_name"] == "text"
    assert res["sparse_requests"] == 3 and 0 <= res["sparse_draft_acceptance"] <= 1


# ---- logprobs and echo against HF transformers (need the engine's logprobs fields) --------------------
needs_logprobs = pytest.mark.skipif(not hasattr(RequestOutput, "logprobs"),
                                    reason="the engine does not return logprobs yet")


@pytest.fixture(scope="module")
def hf_log_softmax(hf_default):
    """token ids -> log_softmax of HF transformers' logits at every position, float32."""
    import torch

    model = hf_default[0]

    def log_softmax(ids: list[int]):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    return log_softmax
@needs_logprobs
def test_completion_logprobs_and_echo_equal_hf(base, llm, hf_log_softmax):
    ids = [1, 504, 3117, 1789, 5262, 359]
    gen = llm.generate(ids, SamplingParams(temperature=0, max_tokens=4))[0].token_ids
    ref = hf_log_softmax(ids + gen)
    status, got = call(base, "/v1/completions", {"prompt": ids, "max_tokens": 4, "temperature": 0, "logprobs": 3,
                                                 "echo": True})
    assert status == 200, got
    choice, tok = got["choices"][0], llm.engine.tokenizer
    lp, all_ids = choice["logprobs"], ids + gen
    assert choice["text"] == tok.decode(ids, skip_special_tokens=True) + tok.decode(gen, skip_special_tokens=True)
    assert lp["tokens"] == [tok.decode([t]) for t in all_ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(all_ids)):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, all_ids[i]].item()) < 1e-3, i
        top3 = sorted(lp["top_logprobs"][i].values(), reverse=True)[:3]
        assert max(abs(a - b) for a, b in zip(top3, ref[i - 1].topk(3).values.tolist())) < 1e-3, i
    assert lp["text_offset"] == [sum(len(s) for s in lp["tokens"][:i]) for i in range(len(all_ids))]

    # lm-eval's loglikelihood request: a batch of token-id prompts, echo, max_tokens 0 or 1.
    batch = [ids, ids[:3]]
    for max_tokens in (0, 1):
        status, got = call(base, "/v1/completions", {"prompt": batch, "max_tokens": max_tokens, "logprobs": 1,
                                                     "echo": True, "temperature": 0, "seed": 1234})
        assert status == 200, got
        for p, c in zip(batch, got["choices"]):
            assert len(c["logprobs"]["token_logprobs"]) == len(p) + max_tokens
            want = hf_log_softmax(p)
            for i in range(1, len(p)):
                assert abs(c["logprobs"]["token_logprobs"][i] - want[i - 1, p[i]].item()) < 1e-3
    assert got["usage"]["completion_tokens"] == 2


@needs_logprobs
def test_chat_logprobs_equal_hf(base, llm, hf_log_softmax):
    tok = llm.engine.tokenizer
    ids = tok.encode(tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False)
    status, got = call(base, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "temperature": 0,
                                                      "logprobs": True, "top_logprobs": 2})
    assert status == 200, got
    gen = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=4)).token_ids
    assert got["choices"][0]["message"]["content"] == tok.decode(gen, skip_special_tokens=True)
    ref = hf_log_softmax(ids + gen)
    content = got["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [tok.decode([t]) for t in gen]
    for i, c in enumerate(content):
        assert abs(c["logprob"] - ref[len(ids) + i - 1, gen[i]].item()) < 1e-3
        assert c["bytes"] == list(c["token"].encode())
        assert len(c["top_logprobs"]) == 2 and c["top_logprobs"][0]["logprob"] >= c["top_logprobs"][1]["logprob"]
        assert abs(c["top_logprobs"][0]["logprob"] - ref[len(ids) + i - 1].max().item()) < 1e-3


@needs_logprobs
def test_best_of_and_penalties(base):
    body = {"prompt": PROMPT, "max_tokens": 4, "n": 2, "best_of": 4, "seed": 11, "logprobs": 0}
    status, got = call(base, "/v1/completions", body)
    assert status == 200 and len(got["choices"]) == 2
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in got["choices"]]
    assert sums[0] >= sums[1]  # the best first
    status, got = call(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                 "presence_penalty": 1.5, "frequency_penalty": 0.5,
                                                 "repetition_penalty": 1.2, "min_tokens": 2,
                                                 "logit_bias": {"28120": 5.0}})
    assert status == 200, got


@needs_logprobs
def test_openai_client_logprobs(base, llm):
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="unused")
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=4, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text and all(x <= 0 for x in lp.token_logprobs)
    streamed = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=4,
                                         temperature=0, logprobs=2, stream=True)
    assert [t for c in streamed for t in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    streamed = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES, max_tokens=4,
                                              temperature=0, logprobs=True, top_logprobs=2, stream=True)
    got = [c.logprob for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
           for c in chunk.choices[0].logprobs.content]
    assert got == [c.logprob for c in content]


def test_stream_closed_before_its_first_byte_is_aborted(base):
    """A client that hangs up right after sending, before reading a byte: both of its engine
    requests are aborted."""
    import socket

    aborted_before = metrics(base).get('oasiskv:request_success_total{finished_reason="abort"}', 0)
    body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True, "n": 2}).encode()
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = metrics(base)
        if m.get('oasiskv:request_success_total{finished_reason="abort"}', 0) - aborted_before == 2 \
                and m["oasiskv:num_requests_running"] == 0 and m["oasiskv:gpu_pages_used"] == 0:
            break
        time.sleep(0.2)
    assert m['oasiskv:request_success_total{finished_reason="abort"}'] - aborted_before == 2
    assert m["oasiskv:num_requests_running"] == 0 and m["oasiskv:gpu_pages_used"] == 0


def test_prompt_too_long_to_fit_is_refused_before_tokenizing(base):
    """180K characters cannot fit 512 tokens (no token stands for more than 81 characters): a 400
    from the text's length, not from its token count; /tokenize still takes long texts."""
    status, got = call(base, "/v1/completions", {"prompt": "x " * 90_000, "max_tokens": 2})
    assert status == 400 and got["error"]["code"] == "context_length_exceeded" and got["error"]["param"] == "prompt"
    assert "180000 characters" in got["error"]["message"]
    status, got = call(base, "/tokenize", {"prompt": "a b " * 20_000})
    assert status == 200 and got["count"] > 512
