"""Flags of `oasiskv serve` (kept apart from the server so the CLI parses without FastAPI)."""
from __future__ import annotations

import argparse


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send and see; default: --model, or SmolLM2-135M-Instruct")
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer <key>` on every /v1 route (default: env OASISKV_API_KEY)")
    g.add_argument("--max-request-bytes", type=int, default=4 << 20,
                   help="larger request bodies get 413 before they are read (default 4 MiB)")
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's headers before it is closed")
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive before a 408")
    g.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="seconds an idle kept-alive connection stays open")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM; then their streams end "
                        "with an error event")
    g.add_argument("--log-stats-interval", type=float, default=10.0,
                   help="seconds between two lines of engine statistics in the log (throughput, "
                        "running and waiting requests, KV usage, decode step time, sparse stall)")
    g.add_argument("--disable-log-stats", action="store_true", help="no engine statistics in the log")
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="how tool calls are written and parsed; default: from the chat template (Llama 3's "
                        "headers: llama3_json, otherwise hermes)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def served_model_name(args: argparse.Namespace) -> str:
    return args.served_model_name or args.model or "SmolLM2-135M-Instruct"
