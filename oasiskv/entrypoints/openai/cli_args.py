"""Flags of `oasiskv serve` (kept apart from the server so the CLI parses without FastAPI)."""
from __future__ import annotations

import argparse


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send and see; default: --model, or SmolLM2-135M-Instruct")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def served_model_name(args: argparse.Namespace) -> str:
    return args.served_model_name or args.model or "SmolLM2-135M-Instruct"
