"""`oasiskv serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics. Every error, our
own or the framework's (bad JSON, a missing field, an unknown route), leaves as OpenAI's
`{"error": {"message", "type", "param", "code"}}`. On SIGTERM uvicorn stops accepting, lets
in-flight responses finish (up to --shutdown-timeout, then cancels them, which aborts their
requests), and only then is the engine thread stopped.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from oasiskv.engine.async_engine import AsyncEngine
from oasiskv.entrypoints.metrics import ServerMetrics
from oasiskv.entrypoints.openai.cli_args import served_model_name
from oasiskv.entrypoints.openai.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body
from oasiskv.entrypoints.openai.serving import OpenAIServing, error_response

log = logging.getLogger("oasiskv.server")


def _validation_error(exc: RequestValidationError) -> APIError:
    """FastAPI's 422 becomes OpenAI's 400, naming the first bad field."""
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "),
                        code="invalid_json")
    param = ".".join(loc) or None
    where = f"`{param}`: " if param else ""
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_value"
    return APIError(400, f"{where}{first.get('msg', 'invalid request')}", param=param, code=code)


def build_app(engine: AsyncEngine, metrics: ServerMetrics, model_name: str) -> FastAPI:
    serving = OpenAIServing(engine, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()  # after uvicorn has drained the connections

    app = FastAPI(title="OasisKV", lifespan=lifespan)

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
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {exc!r}", "server_error"), status_code=500)

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return JSONResponse(error_body(f"the engine is not running ({engine.error!r})",
                                           "service_unavailable"), status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    created = int(time.time())

    @app.get("/v1/models")
    async def models():
        e = engine.engine
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "oasiskv",
                "root": e.config.model or model_name, "max_model_len": e.max_model_len,
                "vocab_size": e.runner.model_config.vocab_size}  # the last two: for clients sending ids
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    return app


def run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from oasiskv.engine.llm_engine import LLMEngine
    from oasiskv.entrypoints.args import engine_config

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = served_model_name(args)
    log.info("loading %s", name)
    metrics = ServerMetrics()
    engine = AsyncEngine(LLMEngine(engine_config(args)), metrics)
    app = build_app(engine, metrics, name)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout, access_log=False)
    uvicorn.Server(config).run()  # handles SIGINT / SIGTERM: drain, then the lifespan's shutdown
    engine.shutdown()  # in case the lifespan never ran (the port was taken)
    return 0
