"""Who may drive disaggregation (oasiskv/entrypoints/disagg_trust.py): the inter-role secret on
the role servers' disaggregation routes and on any request with `kv_transfer_params`, a decode
server that contacts only its configured prefill peers, and the proxy's own API key and health."""
from __future__ import annotations

import asyncio
import json
import socket
import time
from types import SimpleNamespace

import pytest

from oasiskv.entrypoints.disagg_trust import SECRET_HEADER
from oasiskv.entrypoints.openai.disagg_serving import DecodeRole
from oasiskv.entrypoints.openai.guard import Draining, RequestGuard
from oasiskv.entrypoints.openai.protocol import APIError
from server_client import call, free_port, start_proxy

pytestmark = pytest.mark.server


async def ok_app(scope, receive, send):
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def asgi(app, method: str, path: str, body: dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
    """One request through an ASGI app: (status, JSON body)."""
    raw = json.dumps(body).encode() if body is not None else b""
    hdrs = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    hdrs.append((b"content-length", str(len(raw)).encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": hdrs}
    out = {}

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
        else:
            out["body"] = json.loads(message.get("body") or b"{}")
    asyncio.run(app(scope, receive, send))
    return out["status"], out["body"]


TRANSFER = {"prompt": [1, 2], "kv_transfer_params": {"remote_url": "http://198.51.100.7:1", "remote_request_id": "x"}}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_role_server_takes_transfers_and_internal_routes_only_with_the_secret(role):
    guard = RequestGuard(ok_app, 1 << 20, 5.0, api_key="client-key", draining=Draining(), disagg_secret="s3",
                         role=role)
    client = {"Authorization": "Bearer client-key"}
    status, body = asgi(guard, "POST", "/v1/completions", TRANSFER, client)
    assert status == 401 and body["error"]["code"] == "invalid_disagg_secret"
    assert asgi(guard, "POST", "/v1/completions", TRANSFER, {**client, SECRET_HEADER: "wrong"})[0] == 401
    assert asgi(guard, "POST", "/v1/completions", TRANSFER, {SECRET_HEADER: "s3"})[0] == 200  # the proxy: no key
    assert asgi(guard, "POST", "/v1/completions", {"prompt": [1]}, client)[0] == 200
    assert asgi(guard, "POST", "/v1/completions", {"prompt": [1]})[0] == 401  # the API key still holds
    assert asgi(guard, "POST", "/v1/completions", {"prompt": [1], "kv_transfer_params": None}, client)[0] == 200
    assert asgi(guard, "GET", "/v1/disagg/admissions/x", None, client)[0] == 401
    assert asgi(guard, "POST", "/v1/disagg/release", {"peer": "p", "request_ids": []}, client)[0] == 401
    assert asgi(guard, "GET", "/v1/disagg/admissions/x", None, {SECRET_HEADER: "s3"})[0] == 200


def test_role_server_without_a_secret_is_closed_to_transfers():
    guard = RequestGuard(ok_app, 1 << 20, 5.0, api_key=None, draining=Draining(), role="decode")
    status, body = asgi(guard, "POST", "/v1/completions", TRANSFER, {SECRET_HEADER: ""})
    assert status == 403 and body["error"]["code"] == "disaggregation_closed"
    assert asgi(guard, "GET", "/v1/disagg/heartbeat")[0] == 403
    assert asgi(guard, "POST", "/v1/completions", {"prompt": [1]})[0] == 200


def test_decode_server_never_contacts_a_host_it_was_not_given():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    engine = SimpleNamespace(name="decode-test")
    role = DecodeRole(SimpleNamespace(engine=engine), "s3", ["http://127.0.0.1:1/"])
    params = {"remote_url": f"http://127.0.0.1:{port}", "remote_request_id": "abc"}
    with pytest.raises(APIError) as e:
        asyncio.run(role.prepare("r1", params, False))
    assert e.value.status == 403 and "prefill peers" in str(e.value)
    with pytest.raises(socket.timeout):
        listener.accept()  # nobody called
    listener.close()
    with pytest.raises(APIError) as e:  # no peers configured: none at all
        asyncio.run(DecodeRole(SimpleNamespace(engine=engine)).prepare("r2", params, False))
    assert e.value.status == 403


def test_proxy_checks_its_key_and_reports_dead_role_servers():
    port, dead = free_port(), f"http://127.0.0.1:{free_port()}"
    proc = start_proxy(dead, dead, port, "--api-key", "pk")
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                status, body = call(base, "/health", timeout=5)
                break
            except OSError:
                time.sleep(0.1)
        assert status == 503 and body["prefill"] == {dead: False}
        assert call(base, "/v1/completions", {"prompt": "hi", "max_tokens": 1})[0] == 401
        assert call(base, "/v1/models")[0] == 401
        status, body = call(base, "/v1/completions", {"prompt": "hi", "max_tokens": 1},
                            headers={"Authorization": "Bearer pk"})
        assert status == 502  # past the key: the prefill server does not answer
    finally:
        proc.terminate()
        proc.wait(10)
