"""`oasiskv proxy`: the OpenAI API in front of prefill and decode servers (docs/disaggregation.md).

    oasiskv proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000

Each completion or chat request goes to the next prefill server (round robin) with `max_tokens`
1, not streamed, and `kv_transfer_params` = {"do_remote_decode": true}; the `kv_transfer_params`
it answers with (its `remote_url` set to the prefill's address as this proxy reaches it) go with
the original request to the next decode server, whose answer (JSON or server-sent events) is
passed on as it comes. Several prompts or choices go as single requests, merged back
(`proxy_fanout`). GET /metrics is the first decode server's. An error of either server is passed on with its status; a server that
cannot be reached is a 502, as is a decode stream that breaks off (then as an error event).

With --api-key the /v1 routes need `Authorization: Bearer <key>`. Every call to a role server
carries the inter-role secret (--disagg-secret, `disagg_trust`) and the client's Authorization
header. GET /health is 503 while a prefill or decode server does not answer its own /health.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import os

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from oasiskv.entrypoints.disagg_trust import disagg_secret, secret_headers
from oasiskv.entrypoints.openai.protocol import MAX_N, error_body
from oasiskv.entrypoints.proxy_fanout import broke_off, merge, merged_events, split

log = logging.getLogger("oasiskv.proxy")
CONNECT_TIMEOUT_S = 5.0


def bad_gateway(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, "server_error", code="bad_gateway"), status_code=502)


def prefill_body(body: dict) -> dict:
    """The request as the prefill server gets it: one token, whole, to be handed over."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "max_completion_tokens",
                                                        "min_tokens")}
    out["max_tokens"] = 1
    out["kv_transfer_params"] = {**(body.get("kv_transfer_params") or {}), "do_remote_decode": True}
    return out


def malformed(body: dict) -> tuple[str, str] | None:
    """(field, why) for a field the proxy reads that a role server would refuse, else None."""
    if body.get("kv_transfer_params") is not None and not isinstance(body["kv_transfer_params"], dict):
        return "kv_transfer_params", "`kv_transfer_params` must be an object"
    for name in ("n", "best_of", "seed", "max_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            return name, f"`{name}` must be an integer"
    for name in ("n", "best_of"):
        if not 1 <= (body.get(name) or 1) <= MAX_N:
            return name, f"`{name}` must be between 1 and {MAX_N}"
    if body.get("stream") and body.get("echo"):  # as a plain server answers
        return "echo", "`echo` is not supported with `stream`"
    if body.get("stream") and (body.get("best_of") or 1) > (body.get("n") or 1):
        return "best_of", "`best_of` > `n` cannot be streamed"
    return None


def with_prompt(answer: dict, prefilled: dict) -> dict:
    """A completion decoded without echo, given the prompt's text and logprobs from the prefill
    server's echo (its choice: the prompt, then its one token, which decode's first token is)."""
    if not answer.get("choices") or not prefilled.get("choices"):
        return answer
    pre, dec = prefilled["choices"][0], answer["choices"][0]
    plp, dlp = pre.get("logprobs"), dec.get("logprobs")
    if plp is None or dlp is None:
        return answer
    keep = len(plp["tokens"]) - 1  # the prompt's entries; the last is the token decode repeats
    prompt_text = pre["text"][:plp["text_offset"][keep]]
    shift = len(prompt_text)
    merged = {
        "tokens": plp["tokens"][:keep] + dlp["tokens"],
        "token_logprobs": plp["token_logprobs"][:keep] + dlp["token_logprobs"],
        "top_logprobs": ((plp.get("top_logprobs") or [None] * len(plp["tokens"]))[:keep]
                         + (dlp.get("top_logprobs") or [None] * len(dlp["tokens"]))),
        "text_offset": plp["text_offset"][:keep] + [o + shift for o in dlp["text_offset"]],
    }
    return {**answer, "choices": [{**dec, "text": prompt_text + dec["text"], "logprobs": merged}]}


def build_proxy(prefill: list[str], decode: list[str], api_key: str | None = None,
                secret: str | None = None) -> FastAPI:
    prefill = [u.rstrip("/") for u in prefill]
    decode = [u.rstrip("/") for u in decode]
    next_prefill, next_decode = itertools.cycle(prefill), itertools.cycle(decode)
    state = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        state["session"] = aiohttp.ClientSession(timeout=timeout)
        yield
        await state["session"].close()

    app = FastAPI(title="OasisKV proxy", lifespan=lifespan)

    async def relay(response: aiohttp.ClientResponse):
        """The decode server's events as they come; a stream that breaks off ends with an error event."""
        try:
            async for chunk in response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            yield f"data: {json.dumps(broke_off(e))}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:  # the client went away or the stream ended: the decode server sees the close
            response.close()

    def unauthorized(raw: Request) -> JSONResponse | None:
        given = raw.headers.get("authorization", "")
        if api_key is None or hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            return None
        return JSONResponse(error_body("missing or wrong API key: send `Authorization: Bearer <key>`",
                                       "authentication_error", code="invalid_api_key"), status_code=401,
                            headers={"www-authenticate": "Bearer"})

    def role_headers(raw: Request) -> dict[str, str]:
        """What a call to a role server carries: the inter-role secret, the client's key."""
        out = secret_headers(secret)
        if "authorization" in raw.headers:
            out["Authorization"] = raw.headers["authorization"]
        return out

    async def generate(path: str, raw: Request):
        denied = unauthorized(raw)
        if denied is not None:
            return denied
        try:
            body = await raw.json()
        except ValueError:
            return JSONResponse(error_body("the body is not valid JSON", code="invalid_json"), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(error_body("the body must be a JSON object"), status_code=400)
        wrong = malformed(body)
        if wrong is not None:  # the fields the proxy itself reads; the servers check the rest
            return JSONResponse(error_body(wrong[1], param=wrong[0]), status_code=400)
        if body.get("echo") and body.get("max_tokens") == 0:  # the prompt's logprobs alone: one server
            return await forward(raw, "POST", path, next(next_prefill), body)
        parts = split(body)
        if len(parts) == 1:
            return await one(path, raw, body)
        groups = [group for _, group in parts]
        if not body.get("stream"):
            answers = await asyncio.gather(*(one(path, raw, part) for part, _ in parts))
            return merge(answers, groups)
        started = await asyncio.gather(*(hand_over(path, raw, part) for part, _ in parts))
        failed = next((s for s in started if isinstance(s, JSONResponse)), None)
        if failed is not None:
            for s in started:
                if not isinstance(s, JSONResponse):
                    s[0].close()
            return failed
        return StreamingResponse(merged_events([r for r, _ in started], groups), media_type="text/event-stream")

    async def one(path: str, raw: Request, body: dict):
        """One prompt, one choice: its decode server's answer, whole or as it streams."""
        started = await hand_over(path, raw, body)
        if isinstance(started, JSONResponse):
            return started
        response, prefilled = started
        if not body.get("stream"):
            try:
                answer = await response.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                return bad_gateway(f"the decode server failed ({type(e).__name__}: {e})")
            finally:
                response.release()
            if body.get("echo"):
                answer = with_prompt(answer, prefilled)
            return JSONResponse(answer)
        return StreamingResponse(relay(response), media_type="text/event-stream")

    async def hand_over(path: str, raw: Request, body: dict):
        """Prefill (hand-over), then the decode request started: (its 200 response, the prefill's
        answer), or the error response to give the client."""
        session: aiohttp.ClientSession = state["session"]
        p_url, d_url = next(next_prefill), next(next_decode)
        try:
            async with session.post(p_url + path, json=prefill_body(body), headers=role_headers(raw)) as r:
                prefilled, status = await r.json(content_type=None), r.status
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            return bad_gateway(f"the prefill server {p_url} failed ({type(e).__name__}: {e})")
        if status != 200:
            return JSONResponse(prefilled, status_code=status)
        transfer = prefilled.get("kv_transfer_params") if isinstance(prefilled, dict) else None
        if not transfer:
            return bad_gateway(f"the prefill server {p_url} handed nothing over (is it started with --role prefill?)")
        transfer = {**transfer, "remote_url": p_url}
        echo = bool(body.get("echo"))  # the prompt and its logprobs are the prefill's: decode without echo
        decode_body = {**body, "kv_transfer_params": transfer, **({"echo": False} if echo else {})}
        try:
            response = await session.post(d_url + path, json=decode_body, headers=role_headers(raw))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return bad_gateway(f"the decode server {d_url} cannot be reached ({type(e).__name__}: {e})")
        if response.status == 200:
            return response, prefilled
        try:
            return JSONResponse(await response.json(content_type=None), status_code=response.status)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            return bad_gateway(f"the decode server {d_url} failed ({type(e).__name__}: {e})")
        finally:
            response.release()

    async def forward(raw: Request, method: str, path: str, base: str, body: dict | None = None):
        """The request as it came, to one role server, its answer as it is."""
        try:
            async with state["session"].request(method, base + path, json=body, headers=role_headers(raw)) as r:
                return Response(await r.read(), status_code=r.status, media_type=r.content_type)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return bad_gateway(f"the server {base} failed ({type(e).__name__})")

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await generate("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat(raw: Request):
        return await generate("/v1/chat/completions", raw)

    @app.get("/v1/models")
    async def models(raw: Request):
        denied = unauthorized(raw)
        if denied is not None:
            return denied
        try:
            async with state["session"].get(decode[0] + "/v1/models", headers=role_headers(raw)) as r:
                return JSONResponse(await r.json(content_type=None), status_code=r.status)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            return bad_gateway(f"the decode server {decode[0]} failed ({type(e).__name__})")

    async def forward_body(raw: Request, path: str):
        try:
            body = await raw.json()
        except ValueError:
            return JSONResponse(error_body("the body is not valid JSON", code="invalid_json"), status_code=400)
        return await forward(raw, "POST", path, decode[0], body)

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        return await forward_body(raw, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        return await forward_body(raw, "/detokenize")

    @app.get("/tokenizer_info")
    async def tokenizer_info(raw: Request):
        return await forward(raw, "GET", "/tokenizer_info", decode[0])

    @app.get("/version")
    async def version(raw: Request):
        return await forward(raw, "GET", "/version", decode[0])

    @app.get("/metrics")
    async def decode_metrics():
        """The first decode server's, so `bench serve` through the proxy reports its figures."""
        try:
            async with state["session"].get(decode[0] + "/metrics") as r:
                return Response(await r.read(), status_code=r.status, media_type=r.content_type)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return bad_gateway(f"the decode server {decode[0]} failed ({type(e).__name__})")

    @app.get("/health")
    async def health():
        """503 unless every prefill and decode server answers its /health."""
        async def up(url: str) -> bool:
            try:
                async with state["session"].get(url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as r:
                    return r.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return False
        servers = prefill + decode
        status = dict(zip(servers, await asyncio.gather(*(up(u) for u in servers))))
        body = {"prefill": {u: status[u] for u in prefill}, "decode": {u: status[u] for u in decode}}
        return JSONResponse(body, status_code=200 if all(status.values()) else 503)

    return app


def run_proxy(args: argparse.Namespace) -> int:
    import uvicorn
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get("OASISKV_API_KEY") or None
    app = build_proxy(args.prefill, args.decode, api_key, disagg_secret(args.disagg_secret))
    uvicorn.run(app, host=args.host, port=args.port,
                log_level=args.log_level, access_log=False)
    return 0
