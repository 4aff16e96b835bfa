"""`oasiskv proxy`'s flags, apart from the proxy (which needs fastapi and aiohttp), so that every
other command's parser builds without them."""
from __future__ import annotations

import argparse


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="append", required=True, metavar="URL",
                   help="a prefill server (oasiskv serve --role prefill); repeat for several")
    p.add_argument("--decode", action="append", required=True, metavar="URL",
                   help="a decode server (oasiskv serve --role decode); repeat for several")
    p.add_argument("--api-key", default=None,
                   help="clients send `Authorization: Bearer <key>` (default: $OASISKV_API_KEY; none: open)")
    p.add_argument("--disagg-secret", default=None, metavar="SECRET",
                   help="the secret the proxy and the role servers share (default: $OASISKV_DISAGG_SECRET)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
