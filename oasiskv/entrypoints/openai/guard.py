"""What every request passes before a route sees it (a plain ASGI middleware):

- during shutdown, a 503 for anything but /health and /metrics;
- with an API key, a 401 for a /v1 route without `Authorization: Bearer <key>` (vLLM protects
  exactly /v1; the key is compared in constant time);
- a body larger than --max-request-bytes is a 413 at once: a Content-Length over the limit is
  refused before a byte of the body is read, and a chunked body as soon as it passes the limit;
- a body that takes longer than --body-timeout to arrive is a 408 (a slow client cannot hold a
  connection and a request slot);
- on a prefill or decode server (`disagg_trust`): the /v1/disagg/ routes and any request with
  `kv_transfer_params` need the inter-role secret (401 without it, 403 where the server has
  none); a request that carries it needs no API key (the proxy authenticates its clients).
The body, once read in full, is replayed to the route; later `receive` calls (the disconnect
watch of the generation routes) go to the connection.
"""
from __future__ import annotations

import asyncio
import hmac
import json

from oasiskv.entrypoints.disagg_trust import SECRET_HEADER, carries_secret
from oasiskv.entrypoints.openai.protocol import error_body

OPEN_PATHS = ("/health", "/metrics")


class Draining:
    """Shutdown state: `stopping` from SIGTERM on (api_server.begin_shutdown)."""

    def __init__(self):
        self.stopping = False


async def send_error(send, status: int, message: str, type: str, code: str | None = None,
                     headers: list | None = None) -> None:
    body = json.dumps(error_body(message, type, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    def __init__(self, app, max_request_bytes: int, body_timeout: float, api_key: str | None, draining: Draining,
                 disagg_secret: str | None = None, role: str = "both"):
        self.app, self.max_bytes, self.body_timeout = app, max_request_bytes, body_timeout
        self.api_key = api_key.encode() if api_key else None
        self.draining = draining
        self.secret, self.role_server = disagg_secret, role != "both"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = dict(scope["headers"])
        if self.draining.stopping and path not in OPEN_PATHS:
            return await send_error(send, 503, "the server is shutting down", "service_unavailable")
        peer = carries_secret(headers, self.secret)
        if path.startswith("/v1/disagg/") and not peer:
            return await self._not_a_peer(send)
        if self.api_key is not None and path.startswith("/v1") and not peer and not self._authorized(headers):
            return await send_error(send, 401, "missing or wrong API key: send `Authorization: Bearer <key>`",
                                    "authentication_error", "invalid_api_key",
                                    [(b"www-authenticate", b"Bearer")])
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await send_error(send, 400, "the Content-Length header is not a number", "invalid_request_error")
            if int(length) > self.max_bytes:
                return await send_error(send, 413, self._too_large(), "invalid_request_error", "request_too_large")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        try:
            body = await asyncio.wait_for(self._read_body(receive), self.body_timeout)
        except asyncio.TimeoutError:
            return await send_error(send, 408, f"the request body did not arrive within {self.body_timeout:g} s",
                                    "invalid_request_error", "request_timeout")
        if body is None:
            return await send_error(send, 413, self._too_large(), "invalid_request_error", "request_too_large")
        if self.role_server and not peer and b"kv_transfer_params" in body and self._transfer_params(body):
            return await self._not_a_peer(send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _not_a_peer(self, send) -> None:
        if self.secret is None:
            return await send_error(send, 403, "this server was started without --disagg-secret: it takes no "
                                    "kv_transfer_params and serves no /v1/disagg/ route", "permission_error",
                                    "disaggregation_closed")
        return await send_error(send, 401, f"kv_transfer_params and the /v1/disagg/ routes are for the proxy and the "
                                f"role servers: missing or wrong {SECRET_HEADER}", "authentication_error",
                                "invalid_disagg_secret")

    @staticmethod
    def _transfer_params(body: bytes) -> bool:
        """The body is a JSON object with `kv_transfer_params` set (a bad body is the route's 400)."""
        try:
            parsed = json.loads(body)
        except ValueError:
            return False
        return isinstance(parsed, dict) and parsed.get("kv_transfer_params") is not None

    def _too_large(self) -> str:
        return f"the request body is larger than the server's limit of {self.max_bytes} bytes (--max-request-bytes)"

    def _authorized(self, headers: dict) -> bool:
        given = headers.get(b"authorization", b"")
        return hmac.compare_digest(given, b"Bearer " + self.api_key)

    async def _read_body(self, receive) -> bytes | None:
        """The whole body, or None once it passes the limit (the rest is never read)."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
