"""`oasiskv serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

Routes: /v1/completions, /v1/chat/completions, /v1/models[/{id}], /tokenize, /detokenize,
/tokenizer_info, /version, /health, /metrics. Every error, our own or the framework's (bad JSON,
a missing field, an unknown route), leaves as OpenAI's `{"error": {"message", "type", "param",
"code"}}`; an unexpected exception is a 500 "internal error" (the traceback goes to the log).

Shutdown (SIGTERM, Ctrl-C): new requests get 503, running ones have --shutdown-timeout seconds
to finish; then every stream still open gets an error event and `data: [DONE]`, and the engine
stops. A fault of the engine itself stops it for good: /health answers 503 and the process
exits with status 1, so a supervisor restarts it.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

import oasiskv
from oasiskv.engine.async_engine import AsyncEngine
from oasiskv.engine.structured_output import backend as structured_output_backend
from oasiskv.engine.stat_logger import StatLogger
from oasiskv.entrypoints.metrics import ServerMetrics
from oasiskv.entrypoints.openai.choice import ServerStopping
from oasiskv.entrypoints.openai.cli_args import served_model_name
from oasiskv.entrypoints.disagg_trust import disagg_secret
from oasiskv.entrypoints.openai.disagg_serving import add_prefill_routes, disagg_role, start_reaper
from oasiskv.entrypoints.openai.guard import Draining, RequestGuard
from oasiskv.entrypoints.openai.protocol import (APIError, ChatCompletionRequest, CompletionRequest,
                                                 DetokenizeRequest, TokenizeRequest, error_body)
from oasiskv.entrypoints.openai.serving import OpenAIServing, error_response
from oasiskv.entrypoints.openai.serving_chat import create_chat_completion
from oasiskv.entrypoints.openai.serving_completions import create_completion
from oasiskv.entrypoints.openai.tool_parsers import PARSERS

log = logging.getLogger("oasiskv.server")


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 becomes OpenAI's 400, naming the first bad field."""
    first = exc.errors()[0] if exc.errors() else {}
    # The field's path, without pydantic's tags for union members and validators ("list[int]", ...).
    loc = [str(x) for x in first.get("loc", ()) if x != "body" and (isinstance(x, int) or x.isidentifier())
           and x not in ("str", "int", "float", "bool")]
    if first.get("type") == "json_invalid":
        return APIError(400, "the body is not valid JSON", code="invalid_json")
    param = loc[0] if loc else None
    where = f"`{'.'.join(loc)}`: " if loc else ""
    kind = first.get("type")
    code = {"missing": "missing_required_parameter", "extra_forbidden": "unknown_parameter"}.get(kind, "invalid_value")
    message = "unknown field (this server rejects fields it does not know)" if kind == "extra_forbidden" \
        else first.get("msg", "invalid request").removeprefix("Value error, ")
    return APIError(400, f"{where}{message}", param=param, code=code)


def build_app(engine: AsyncEngine, metrics: ServerMetrics, model_name: str, *, api_key: str | None = None,
              max_request_bytes: int = 4 << 20, body_timeout: float = 30.0,
              draining: Draining | None = None, role: str = "both", disagg_secret: str | None = None,
              prefill_peers: list[str] | None = None, tool_call_parser: str | None = None) -> FastAPI:
    serving = OpenAIServing(engine, model_name, disagg_role(role, engine, disagg_secret, prefill_peers),
                            tool_call_parser)
    draining = draining or Draining()
    engine.engine.detokenize = False  # text and stop strings are the front end's (choice.py)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.loop = asyncio.get_running_loop()  # for signal handlers and the engine thread
        engine.start()
        yield
        engine.shutdown()  # after uvicorn has drained the connections

    app = FastAPI(title="OasisKV", lifespan=lifespan)
    app.state.serving, app.state.draining = serving, draining
    app.add_middleware(RequestGuard, max_request_bytes=max_request_bytes, body_timeout=body_timeout,
                       api_key=api_key, draining=draining, disagg_secret=disagg_secret, role=role)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return error_response(_validation_error(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.exception("unhandled error in %s", request.url.path)
        return JSONResponse(error_body("internal error", "server_error"), status_code=500)

    if role == "prefill":
        add_prefill_routes(app, engine)

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return JSONResponse(error_body("the engine is not running", "service_unavailable"), status_code=503)
        if draining.stopping:  # a load balancer takes the replica out while it drains
            return JSONResponse(error_body("the server is shutting down", "service_unavailable"), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/version")
    async def version():
        return {"version": oasiskv.__version__}

    created = int(time.time())

    def card() -> dict:
        e = engine.engine
        return {"id": model_name, "object": "model", "created": created, "owned_by": "oasiskv",
                "root": e.config.model or model_name, "max_model_len": e.max_model_len,
                "vocab_size": serving.vocab_size,  # max_model_len, vocab_size: for clients sending ids
                # What this server parses and constrains (clients of the OpenAI API ignore it).
                "tool_call_parser": serving.tool_parser.name, "tool_call_parsers": sorted(PARSERS),
                "structured_output_backend": structured_output_backend()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        serving.check_model(model_id)
        return card()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await create_completion(serving, req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(serving, req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of `prompt` and `messages`", param="prompt")
        if req.messages is not None:
            text = await serving.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                                             req.chat_template_kwargs)
            ids = await serving.encode(text, "messages", must_fit=False, utility=True)  # the template holds the specials
        else:  # clients such as lm-eval tokenize long texts and truncate them themselves
            ids = await serving.encode(req.prompt, "prompt", req.add_special_tokens, must_fit=False, utility=True)
        strs = [serving.tokenizer.convert_ids_to_tokens(t) for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        serving.check_model(req.model)
        return {"prompt": await serving.decode(req.tokens, utility=True)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        tok = serving.tokenizer
        if tok is None:
            raise APIError(404, "this model has no tokenizer (dummy weights)", type="not_found_error")
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "unk_token": tok.unk_token, "chat_template": tok.chat_template,
                "model_max_length": serving.max_model_len, "vocab_size": serving.vocab_size,
                "add_bos_token": getattr(tok, "add_bos_token", None)}

    return app


def begin_shutdown(app: FastAPI, timeout: float) -> None:
    """On the event loop, at SIGTERM: refuse new requests; after `timeout`, end the rest."""
    draining: Draining = app.state.draining
    if draining.stopping:
        return
    draining.stopping = True

    def deadline():
        app.state.serving.interrupt_all(ServerStopping(
            f"the server is shutting down and this request did not finish within {timeout:g} s"))

    asyncio.get_running_loop().call_later(timeout, deadline)


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from oasiskv.entrypoints.args import engine_config
    from oasiskv.entrypoints.disagg_args import make_engine
    from oasiskv.entrypoints.openai.http_protocol import header_timeout_protocol

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = served_model_name(args)
    log.info("loading %s", name)
    metrics = ServerMetrics(name)
    server: uvicorn.Server | None = None

    def on_engine_death():  # from the engine thread: stop serving; run_server then returns 1
        if server is not None:
            server.should_exit = True

    stats = None if args.disable_log_stats else StatLogger(args.log_stats_interval)
    role = getattr(args, "role", "both")
    url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '::') else args.host}:{args.port}"
    secret = disagg_secret(getattr(args, "disagg_secret", None))
    engine = AsyncEngine(make_engine(args, engine_config(args), url, secret), metrics, on_death=on_engine_death,
                         stat_logger=stats)
    if role == "prefill":
        start_reaper(engine)
    api_key = args.api_key or os.environ.get("OASISKV_API_KEY") or None
    app = build_app(engine, metrics, name, api_key=api_key, max_request_bytes=args.max_request_bytes,
                    body_timeout=args.body_timeout, role=role, disagg_secret=secret,
                    prefill_peers=getattr(args, "prefill_peers", None),
                    tool_call_parser=getattr(args, "tool_call_parser", None))

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            super().handle_exit(sig, frame)
            loop = getattr(app.state, "loop", None)
            if loop is not None:
                loop.call_soon_threadsafe(begin_shutdown, app, args.shutdown_timeout)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            http=header_timeout_protocol(args.header_timeout),
                            timeout_keep_alive=args.timeout_keep_alive, h11_max_incomplete_event_size=16 << 10,
                            # the streams get their error events at --shutdown-timeout; this is the backstop
                            timeout_graceful_shutdown=args.shutdown_timeout + 10)
    server = Server(config)
    server.run()  # handles SIGINT / SIGTERM: drain, then the lifespan's shutdown
    engine.shutdown()  # in case the lifespan never ran (the port was taken)
    if hasattr(engine.engine, "close"):  # a role server's transport and heartbeats
        engine.engine.close()
    if engine.error is not None:
        log.error("exiting with status 1: the engine stopped after an internal error")
        return 1
    return 0
