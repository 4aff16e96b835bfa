"""Disaggregated serving end to end: `oasiskv proxy` + `oasiskv serve --role prefill` + `oasiskv
serve --role decode --rpf-strict` as subprocesses on the default model, a 4K-token prompt (1.5K for the
faults), K = 32; on the socket transport, then the prefill server's death again on NIXL (skipped where it
does not import).

- Strict RPF through the proxy decodes the greedy tokens of colocated sparse decode (the same
  request sent to the decode server without transfer parameters: it converts after its prefill);
  so do short prompts, strict and default (a second decode server and proxy, without --rpf-strict).
- The proxies take client keys (--api-key); the OpenAI surface and lm-eval through them answer
  as the decode server colocated.
- Structured output and tool calls through the proxy: the prefill samples the first token under
  the request's grammar, the decode side starts the same grammar past it, so the whole output
  validates (JSON schema, a choice, a forced tool call, streamed and not).
- Full transfer reads the whole KV over the transport at admission (its admission bytes count
  those reads) and decodes the same tokens. RPF's admission is at most a quarter of full
  transfer's, and the decode side's host memory for the request
  (`oasiskv:disagg_request_host_bytes`) is smaller; both pools go back to zero.
- The prefill server killed mid-decode: the client's stream ends with an error event within 5 s;
  the decode server frees the request and serves the next one.
One set of servers per transport; the kill comes last."""
from __future__ import annotations

import argparse
import json
import os
import signal
import time
import urllib.request

import jsonschema
import pytest

from oasiskv.disagg.nixl_transport import nixl_available
from oasiskv.entrypoints.disagg_trust import SECRET_ENV, SECRET_HEADER
from oasiskv.entrypoints.openai.server_process import start_server, stop_server, wait_for_health
from server_client import call, free_port, metrics, start_proxy, stream_events

pytestmark = [pytest.mark.slow, pytest.mark.server]

PROMPT_TOKENS, NEW_TOKENS = 4000, 8
FAULT_PROMPT = 1500  # the fault tests' prompt: handed over sparse as any is, at a fraction of the 4K prefill
ENGINE = ["--max-model-len", "4200", "--sparse", "--top-k-blocks", "32", "--sparse-threshold", "2048",
          "--host-kv-gb", "0.5", "--kv-cache-gb", "0.5", "--disable-log-stats"]
HOST = "127.0.0.1"
KEY = "tests-proxy-key"
AUTH = {"Authorization": f"Bearer {KEY}"}  # the proxies' client key; role servers take the secret


def prompt_ids(base: str) -> list[int]:
    status, out = call(base, "/tokenize", {"prompt": open(argparse.__file__).read(), "add_special_tokens": False})
    assert status == 200, out
    return out["tokens"][:PROMPT_TOKENS]


@pytest.fixture(scope="module", params=["socket", "nixl"])
def servers(request):
    transport = request.param
    if transport == "nixl" and nixl_available() is not None:
        pytest.skip(nixl_available())
    engine = [*ENGINE, "--kv-transport", transport]
    ports = {name: free_port() for name in ("prefill", "decode", "proxy", "decode_default", "proxy_default")}
    url = {name: f"http://{HOST}:{port}" for name, port in ports.items()}
    os.environ.setdefault(SECRET_ENV, "tests-disagg-secret")  # the servers and the proxies share it

    def proxy(decode: str):
        return start_proxy(url["prefill"], url[decode], ports[f"proxy{decode[6:]}"], "--api-key", KEY)
    decode = [*engine, "--role", "decode", "--prefill-peers", url["prefill"]]
    procs = {
        "prefill": start_server([*engine, "--role", "prefill", "--kv-lease-ttl", "3"], HOST, ports["prefill"],
                                wait=False),
        "decode": start_server([*decode, "--rpf-strict"], HOST, ports["decode"], wait=False),
        "decode_default": start_server(decode, HOST, ports["decode_default"], wait=False),
        "proxy": proxy("decode"),
        "proxy_default": proxy("decode_default"),
    }
    try:
        for name, proc in procs.items():
            wait_for_health(url[name], 600, proc)
        yield {"url": url, "procs": procs, "ids": prompt_ids(url["decode"]), "transport": transport}
    finally:
        for proc in procs.values():
            stop_server(proc, timeout=30)


def complete(base: str, ids: list[int], transfer: dict | None = None, max_tokens: int = NEW_TOKENS):
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    if transfer is not None:
        body["kv_transfer_params"] = transfer
    status, out = call(base, "/v1/completions", body, timeout=600, headers=AUTH)
    assert status == 200, out
    return out["choices"][0]


def decode_figures(url: dict, finished: int) -> dict:
    """The decode server's figures once `finished` admitted requests are counted (a request's
    answer may leave before the engine thread has recorded it)."""
    deadline = time.monotonic() + 10
    while True:
        m = metrics(url["decode"])
        if m["oasiskv:disagg_request_host_bytes_count"] >= finished or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return {"admission": m["oasiskv:disagg_admission_bytes_total"],
            "transport": m["oasiskv:disagg_admission_transport_bytes_total"],
            "host": m["oasiskv:disagg_request_host_bytes_sum"], "remote": m["oasiskv:disagg_remote_read_bytes_total"]}


def pools_drain(url: dict, timeout: float = 10.0) -> tuple[float, float, float]:
    """(prefill host pool bytes, prefill leases, decode arena bytes) once all are zero, or at the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        p, d = metrics(url["prefill"]), metrics(url["decode"])
        got = (p["oasiskv:host_pool_bytes_used"], p["oasiskv:disagg_leases_held"],
               d["oasiskv:disagg_host_bytes_used"])
        if not any(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


@pytest.fixture(scope="module")
def runs(servers):
    """The colocated reference, then strict RPF and full transfer through the proxy (socket
    transport: NIXL's runs take the faults alone, to keep the module short)."""
    if servers["transport"] != "socket":
        pytest.skip("RPF against colocated and full is measured on the socket transport")
    url, ids = servers["url"], servers["ids"]
    colocated = complete(url["decode"], ids)
    figures = {"start": decode_figures(url, 0)}
    rpf = complete(url["proxy"], ids)
    figures["rpf"] = decode_figures(url, 1)
    drained_rpf = pools_drain(url)
    full = complete(url["proxy"], ids, {"transfer_mode": "full"})
    figures["full"] = decode_figures(url, 2)
    return dict(colocated=colocated, rpf=rpf, full=full, figures=figures, drained_rpf=drained_rpf,
                drained_full=pools_drain(url))
def test_strict_rpf_equals_colocated_sparse_decode(runs):
    colocated, rpf, full = runs["colocated"], runs["rpf"], runs["full"]
    assert len(colocated["logprobs"]["tokens"]) == NEW_TOKENS
    assert rpf["logprobs"]["tokens"] == colocated["logprobs"]["tokens"] and rpf["text"] == colocated["text"]
    assert full["logprobs"]["tokens"] == colocated["logprobs"]["tokens"]


def test_rpf_admission_and_decode_host_memory_below_full(runs):
    f = runs["figures"]
    rpf = {k: f["rpf"][k] - f["start"][k] for k in f["start"]}
    full = {k: f["full"][k] - f["rpf"][k] for k in f["start"]}
    print(f"admission bytes: rpf {rpf['admission']:.0f} full {full['admission']:.0f} "
          f"({rpf['admission'] / full['admission']:.3f}); decode-side host bytes of the request: rpf "
          f"{rpf['host']:.0f} full {full['host']:.0f} ({rpf['host'] / full['host']:.3f}); remote reads: rpf "
          f"{rpf['remote']:.0f} B, full {full['remote']:.0f} B; full's admission read over the transport: "
          f"{full['transport']:.0f} B")
    assert 0 < rpf["admission"] <= full["admission"] / 4
    assert 0 < rpf["host"] < full["host"]
    assert rpf["remote"] > 0 and full["remote"] == 0
    # full's KV crossed over the transport at admission (as much as its host memory holds of the
    # prompt); its admission body is small
    assert rpf["transport"] == 0 and 0 < full["transport"] <= full["host"]
    assert full["admission"] - full["transport"] <= rpf["admission"]
    assert runs["drained_rpf"] == (0, 0, 0) and runs["drained_full"] == (0, 0, 0)


def proxy_surface_once(servers) -> None:
    """The proxy's HTTP surface does not depend on the KV transport: tested on the socket one."""
    if servers["transport"] != "socket":
        pytest.skip("the proxy's surface is tested once, on the socket transport")


def test_chat_through_the_proxy_whole_and_streamed(servers):
    """A short chat request is handed over too (converted whatever its length): its working set
    then holds every block, so decode equals the decode server's own dense answer."""
    proxy_surface_once(servers)
    url = servers["url"]
    body = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}
    status, local = call(url["decode"], "/v1/chat/completions", body)
    assert status == 200, local
    status, whole = call(url["proxy"], "/v1/chat/completions", body, headers=AUTH)
    assert status == 200, whole
    text = whole["choices"][0]["message"]["content"]
    assert text == local["choices"][0]["message"]["content"] and whole["usage"]["completion_tokens"] == 6
    events = stream_events(url["proxy"], "/v1/chat/completions", body, headers=AUTH)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]) == text


def stream_until(url: str, body: dict, stop_after: int):
    """Open a streamed completion and return it after `stop_after` token events (still open)."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", **AUTH})
    r = urllib.request.urlopen(req, timeout=600)
    events = 0
    for line in r:
        if line.startswith(b"data: {") and b'"error"' not in line:
            events += 1
            if events == stop_after:
                return r
    raise AssertionError("the stream ended early")
def test_client_gone_mid_decode_frees_both_sides(servers):
    """The client closes its stream after two tokens: the decode server aborts the request and
    releases its lease at once, so both sides' pools drain to zero."""
    if servers["transport"] != "socket":
        pytest.skip("an abort releases its lease over HTTP whatever the transport: run on the socket one")
    url, ids = servers["url"], servers["ids"]
    r = stream_until(url["proxy"], {"prompt": ids[:FAULT_PROMPT], "max_tokens": 200, "temperature": 0,
                                    "ignore_eos": True}, 2)
    r.close()
    assert pools_drain(url) == (0, 0, 0)


# Every length to just past one block, then around the next block boundaries (the engine's
# paths: run on the socket transport; NIXL moves the same items).
SHORT_LENGTHS = list(range(1, 18)) + [31, 32, 33, 47, 48, 49, 63, 64, 65, 127, 128, 129, 199, 200]


def test_every_short_prompt_length_equals_colocated(servers):
    """Prompts shorter than a block (the partial block is a sink) and around block boundaries:
    through either proxy (strict RPF, default RPF) the greedy tokens equal the decode server's
    colocated run."""
    if servers["transport"] != "socket":
        pytest.skip("the short prompts' paths are the engine's: run on the socket transport")
    url, ids = servers["url"], servers["ids"]
    lengths = SHORT_LENGTHS
    body = {"prompt": [ids[:n] for n in lengths], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}  # one request of every length: each server batches them
    status, local = call(url["decode"], "/v1/completions", body, timeout=600)
    assert status == 200, local
    bad = []
    for proxy in ("proxy", "proxy_default"):
        status, proxied = call(url[proxy], "/v1/completions", body, timeout=600, headers=AUTH)
        assert status == 200, proxied
        for n, a, b in zip(lengths, local["choices"], proxied["choices"]):
            if a["text"] != b["text"] or a["logprobs"]["tokens"] != b["logprobs"]["tokens"]:
                bad.append((proxy, n))
    assert not bad, f"prompt lengths whose proxied tokens differ from colocated: {bad}"
def test_proxy_speaks_the_openai_surface(servers):
    """n > 1, prompt lists, echo with logprobs (with and without new tokens) and the tokenizer
    and version routes through the proxy answer as the decode server does colocated."""
    proxy_surface_once(servers)
    url, ids = servers["url"], servers["ids"]
    base = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    cases = [{"prompt": ids[:40], "n": 2}, {"prompt": [ids[:30], ids[30:75]]},
             {"prompt": ids[:50], "echo": True, "logprobs": 1}, {"prompt": ids[:50], "echo": True, "logprobs": 1,
                                                                  "max_tokens": 0}]
    for case in cases:
        body = {**base, **case}
        s1, local = call(url["decode"], "/v1/completions", body, timeout=600)
        s2, proxied = call(url["proxy"], "/v1/completions", body, timeout=600, headers=AUTH)
        assert s1 == s2 == 200, (case, local, proxied)
        assert [c["text"] for c in proxied["choices"]] == [c["text"] for c in local["choices"]], case
        if case.get("logprobs") is not None:
            a, b = local["choices"][0]["logprobs"], proxied["choices"][0]["logprobs"]
            assert a["tokens"] == b["tokens"] and a["text_offset"] == b["text_offset"]
            for x, y in zip(a["token_logprobs"], b["token_logprobs"]):
                assert (x is None) == (y is None) and (x is None or abs(x - y) < 1e-3)
        assert proxied["usage"]["prompt_tokens"] == local["usage"]["prompt_tokens"]
    for path, body in (("/tokenize", {"prompt": "hello there"}), ("/detokenize", {"tokens": ids[:5]})):
        assert call(url["proxy"], path, body) == call(url["decode"], path, body)
    assert call(url["proxy"], "/version") == call(url["decode"], "/version")
    refused = {"prompt": ids[:10], "stream": True, "echo": True}, {"prompt": ids[:10], "stream": True, "best_of": 2}
    for body in refused:
        s1, local = call(url["decode"], "/v1/completions", body)
        s2, proxied = call(url["proxy"], "/v1/completions", body, headers=AUTH)
        assert s1 == s2 == 400 and local["error"]["param"] == proxied["error"]["param"], (body, local, proxied)


def streamed_choices(events: list, chat: bool) -> tuple[dict[int, str], dict | None]:
    """({choice index: its text}, the final usage's counts) of a stream's events."""
    texts, usage = {}, None
    for e in events[:-1]:
        if e.get("usage"):
            usage = {k: e["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        for c in e["choices"]:
            piece = c["delta"].get("content", "") if chat else c["text"]
            texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
    return texts, usage
def test_proxy_streams_many_choices_and_prompts(servers):
    """Streamed n > 1 and prompt lists through the proxy: one stream whose choices (by index),
    final usage and [DONE] are the decode server's colocated stream's."""
    proxy_surface_once(servers)
    url, ids = servers["url"], servers["ids"]
    usage = {"stream_options": {"include_usage": True}}
    cases = [("/v1/completions", {"prompt": ids[:40], "n": 2, **usage}),
             ("/v1/completions", {"prompt": [ids[:30], ids[30:75]], "n": 2, **usage}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Count to five."}], "n": 2})]
    for path, case in cases:
        body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, **case}
        local = stream_events(url["decode"], path, body, timeout=600)
        proxied = stream_events(url["proxy"], path, body, timeout=600, headers=AUTH)
        assert proxied[-1] == "[DONE]" and len({e["id"] for e in proxied[:-1]}) == 1
        chat = path.endswith("chat/completions")
        assert streamed_choices(proxied, chat) == streamed_choices(local, chat), case


def test_openai_client_through_the_keyed_proxy(servers):
    """The official client with the proxy's key: completions (whole, streamed, n = 2, echo with
    logprobs) and chat (streamed) answer as the decode server colocated; a wrong key is a 401."""
    proxy_surface_once(servers)
    from openai import AuthenticationError, OpenAI
    url, ids = servers["url"], servers["ids"]
    model = "SmolLM2-135M-Instruct"
    proxied, local = OpenAI(base_url=url["proxy"] + "/v1", api_key=KEY), OpenAI(base_url=url["decode"] + "/v1",
                                                                                   api_key="unused")
    greedy = dict(model=model, max_tokens=6, temperature=0)
    for kw in (dict(prompt=ids[:40]), dict(prompt=ids[:40], n=2), dict(prompt=ids[:40], echo=True, logprobs=1)):
        a, b = local.completions.create(**greedy, **kw), proxied.completions.create(**greedy, **kw)
        assert [c.text for c in a.choices] == [c.text for c in b.choices], kw
        if kw.get("logprobs"):
            assert a.choices[0].logprobs.tokens == b.choices[0].logprobs.tokens
    texts = []
    for client in (local, proxied):
        stream = client.completions.create(**greedy, prompt=ids[:40], n=2, stream=True)
        by_index: dict[int, str] = {}
        for chunk in stream:
            for c in chunk.choices:
                by_index[c.index] = by_index.get(c.index, "") + c.text
        chat = client.chat.completions.create(**greedy, stream=True,
                                              messages=[{"role": "user", "content": "Name a colour."}])
        texts.append((by_index, "".join(c.choices[0].delta.content or "" for c in chat if c.choices)))
    assert texts[0] == texts[1]
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=url["proxy"] + "/v1", api_key="wrong").completions.create(**greedy, prompt=ids[:5])
def test_lm_eval_through_the_proxy_equals_colocated(servers, tmp_path):
    """lm-eval's local-completions loglikelihoods (prompt logprobs, echoed) through the keyed
    proxy give the numbers they give against the decode server colocated. (Its generate_until
    requests are plain completions, which the proxy forwards as it does the surface tests'.)"""
    if servers["transport"] != "socket":
        pytest.skip("run once, on the socket transport")
    from lm_eval_client import evaluate
    url = servers["url"]
    for task in ("oasiskv_tiny_mc",):
        local = evaluate(url["decode"], tmp_path, task)
        proxied = evaluate(url["proxy"], tmp_path, task, api_key=KEY)
        assert len(local) == len(proxied) > 0
        for a, b in zip(local, proxied):
            assert a["doc"] == b["doc"]
            if task.endswith("mc"):
                for (x, greedy_x), (y, greedy_y) in zip(a["filtered_resps"], b["filtered_resps"]):
                    assert abs(float(x) - float(y)) < 1e-3 and greedy_x == greedy_y, (a["doc"], x, y)
            else:
                assert a["filtered_resps"] == b["filtered_resps"], a["doc"]
FRUIT = {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 12},
                                          "color": {"enum": ["yellow", "red", "green"]}},
         "required": ["fruit", "color"], "additionalProperties": False}
WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"],
    "additionalProperties": False}}}]


def test_json_schema_choice_and_a_forced_tool_call_through_the_proxy(servers):
    proxy_surface_once(servers)
    from openai import OpenAI

    proxy = servers["url"]["proxy_default"]
    client = OpenAI(base_url=proxy + "/v1", api_key=KEY)
    fmt = {"type": "json_schema", "json_schema": {"name": "fruit", "schema": FRUIT, "strict": True}}
    ask = [{"role": "user", "content": "Name a fruit that is yellow, as JSON."}]
    r = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=ask, max_tokens=40, temperature=0,
                                       response_format=fmt)
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), FRUIT)
    status, out = call(proxy, "/v1/completions", {"prompt": "Is a lemon yellow? Answer:", "max_tokens": 5,
                                                  "temperature": 0, "guided_choice": ["yes", "no"]}, headers=AUTH)
    assert status == 200 and out["choices"][0]["text"] in ("yes", "no"), out

    weather = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model="SmolLM2-135M-Instruct", messages=weather, tools=WEATHER_TOOLS, max_tokens=40, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    call_ = r.choices[0].message.tool_calls[0]
    assert r.choices[0].finish_reason == "tool_calls" and call_.function.name == "get_weather"
    jsonschema.validate(json.loads(call_.function.arguments), WEATHER_TOOLS[0]["function"]["parameters"])
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [tc.function.arguments for tc in streamed] == [call_.function.arguments]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_fuzz_role_servers_and_proxy(servers):
    """Malformed and hostile requests to the proxy and both role servers (bounded: a few hundred,
    seconds): every answer a 4xx, the servers healthy after, nothing held (socket transport)."""
    if servers["transport"] != "socket":
        pytest.skip("fuzzed once, on the socket transport")
    import random
    url, ids = servers["url"], servers["ids"]
    rng = random.Random(7)
    secret = {SECRET_HEADER: os.environ[SECRET_ENV]}
    values = [None, -1, 0, 1.5, 10**12, "x", "", [], {}, [1, "a"], {"a": 1}, True, float("nan"), "\udcff"]
    fields = ["prompt", "n", "best_of", "echo", "logprobs", "stream", "temperature", "messages",
              "kv_transfer_params", "seed", "stop"]
    bodies = [b"", b"{", b"[]", b"null", b"\xff\xfe", json.dumps({"prompt": ids[:5]}).encode()[:-1]]
    for _ in range(120):
        body = {"prompt": ids[:rng.randint(1, 30)], "max_tokens": 2}
        for f in rng.sample(fields, rng.randint(1, 3)):
            body[f] = rng.choice(values)
        bodies.append(json.dumps(body, allow_nan=True).encode())
    transfers = [{"do_remote_prefill": True, "remote_url": "http://127.0.0.1:9", "remote_request_id": "x"},
                 {"do_remote_decode": True, "transfer_mode": "nope"}, {"remote_url": 5}, "str", [1]]
    for t in transfers:
        bodies.append(json.dumps({"prompt": ids[:8], "max_tokens": 2, "kv_transfer_params": t}).encode())
    statuses = []
    for i, raw in enumerate(bodies):
        for base in (url["proxy"], url["prefill"], url["decode"]):
            headers = {**AUTH, **(secret if i % 2 else {})}
            for path in ("/v1/completions", "/v1/chat/completions"):
                try:
                    status = call(base, path, raw, timeout=30, headers=headers)[0]
                except OSError as e:  # a timeout: recorded as a failure with the request
                    status = f"{type(e).__name__}"
                statuses.append((base, path, raw[:200], headers != {}, status))
    for base in (url["proxy"], url["prefill"], url["decode"]):
        for path in ("/v1/disagg/admissions/x", "/v1/disagg/heartbeat", "/v1/disagg/release", "/tokenize"):
            statuses.append((base, path, b"GET", False, call(base, path, timeout=30)[0]))
            statuses.append((base, path, b"POST junk", True, call(base, path, b"{junk", timeout=30, headers=secret)[0]))
    bad = [s for s in statuses if not isinstance(s[4], int) or s[4] >= 500 or s[4] < 200]
    assert not bad, bad[:5]
    for name in ("prefill", "decode"):
        assert call(url[name], "/health")[0] == 200
    assert pools_drain(url) == (0, 0, 0)
    for name in ("prefill", "decode"):
        m = metrics(url[name])
        assert m["oasiskv:num_requests_running"] == 0 and m["oasiskv:num_requests_waiting"] == 0


# Last: it kills the prefill server the module shares.
def test_prefill_killed_mid_decode(servers):
    """After two streamed tokens the prefill server is killed: an error event within 5 s, the
    request's memory freed on the decode side, which then serves a request of its own."""
    url, ids = servers["url"], servers["ids"]
    body = {"prompt": ids[:FAULT_PROMPT], "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(url["proxy"] + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **AUTH})
    events, killed, error_after = 0, None, None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                break
            event = json.loads(payload)
            if "error" in event:
                error_after = time.monotonic() - killed
                message = event["error"]["message"]
                continue
            events += 1
            if events == 2:
                os.killpg(servers["procs"]["prefill"].pid, signal.SIGKILL)
                killed = time.monotonic()
    print(f"prefill killed after 2 token events ({events} in all); the client's error {error_after:.2f} s later")
    assert error_after is not None and error_after < 5.0 and "prefill" in message
    assert call(url["decode"], "/health")[0] == 200
    after = complete(url["decode"], ids[:200], max_tokens=4)
    assert len(after["logprobs"]["tokens"]) == 4
    d = metrics(url["decode"])
    assert d["oasiskv:disagg_host_bytes_used"] == 0 and d["oasiskv:disagg_failed_requests_total"] == 1
    assert d["oasiskv:disagg_leases_held"] == 0
    status, out = call(url["proxy"], "/v1/completions", {"prompt": ids[:100], "max_tokens": 2}, headers=AUTH)
    assert status == 502 and "prefill" in out["error"]["message"]  # no prefill server left
