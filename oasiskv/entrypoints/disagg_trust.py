"""Who may drive disaggregation (docs/disaggregation.md, "Security").

The proxy and the role servers share a secret (`--disagg-secret`, or the OASISKV_DISAGG_SECRET
environment variable), sent in the `X-OasisKV-Disagg-Secret` header on every call between them.
A role server takes `kv_transfer_params` and serves its `/v1/disagg/` routes only with it, so a
client can neither start a hand-over nor point a decode server at a host; and a decode server
reads KV only from the prefill servers it was given (`--prefill-peers`).
"""
from __future__ import annotations

import hmac
import os

SECRET_HEADER = "X-OasisKV-Disagg-Secret"
SECRET_ENV = "OASISKV_DISAGG_SECRET"


def disagg_secret(given: str | None) -> str | None:
    """The inter-role secret: the flag's, else the environment's, else none."""
    return given or os.environ.get(SECRET_ENV) or None


def secret_headers(secret: str | None) -> dict[str, str]:
    return {SECRET_HEADER: secret} if secret else {}


def carries_secret(headers: dict[bytes, bytes], secret: str | None) -> bool:
    """An ASGI request's headers (lower-case names) carry the secret (constant-time compare)."""
    if not secret:
        return False
    return hmac.compare_digest(headers.get(SECRET_HEADER.lower().encode(), b""), secret.encode())


def peer_url(url: str) -> str:
    """A prefill server's address as peers compare it."""
    return url.strip().rstrip("/")
