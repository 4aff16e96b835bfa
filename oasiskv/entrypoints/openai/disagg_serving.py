"""The HTTP side of a prefill or decode server (docs/disaggregation.md, "Server roles").

A request's `kv_transfer_params` (vLLM's field) says what to do with it:
  prefill role, `{"do_remote_decode": true}` (optional "transfer_mode": rpf | full): prefill it,
    hand it over, answer with its first token and `kv_transfer_params` = {"do_remote_prefill":
    true, "remote_request_id", "remote_url", "transfer_mode", "admission_bytes", "lease_ttl_s"};
  decode role, those parameters: fetch the admission from `remote_url`, admit it, decode.
Either role serves a request without them as a colocated server does.

Every call between the roles carries the inter-role secret, which the request guard checks
(`disagg_trust`); a decode server fetches only from its `--prefill-peers`.
The prefill's routes for its decode peers: GET /v1/disagg/admissions/{id}?peer=NAME (the
admission, once, as safetensors bytes; the peer takes the lease), POST /v1/disagg/heartbeat and
POST /v1/disagg/release (`{"peer", "request_ids"}`).
"""
from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel

from oasiskv.disagg.admission import Admission
from oasiskv.entrypoints.disagg_trust import peer_url, secret_headers
from oasiskv.entrypoints.openai.protocol import APIError

ADMISSION_TIMEOUT_S = 600.0  # an RPF admission of a long request holds its working set's KV
REAP_INTERVAL_S = 0.5


class PrefillRole:
    def __init__(self, async_engine):
        self.async_engine = async_engine
        self.engine = async_engine.engine  # PrefillEngine

    async def prepare(self, request_id: str, params: dict, stream: bool) -> None:
        if not params.get("do_remote_decode"):
            raise APIError(400, "a prefill server takes `kv_transfer_params` = {\"do_remote_decode\": true}",
                           param="kv_transfer_params")
        if stream:
            raise APIError(400, "a request handed over to a decode server is not streamed", param="stream")
        try:
            self.engine.expect_hand_over(request_id, params.get("transfer_mode"))
        except ValueError as e:
            raise APIError(400, str(e), param="kv_transfer_params") from None

    def result(self, request_id: str) -> dict | None:
        return self.engine.take_result(request_id)

    def discard(self, request_id: str) -> None:
        self.engine.discard_hand_over(request_id)


class DecodeRole:
    def __init__(self, async_engine, secret: str | None = None, prefill_peers: list[str] | None = None):
        """prefill_peers: the prefill servers it may read from (`--prefill-peers`); none, none."""
        self.async_engine = async_engine
        self.engine = async_engine.engine  # DecodeEngine
        self.secret = secret
        self.peers = {peer_url(u) for u in prefill_peers or ()}

    async def prepare(self, request_id: str, params: dict, stream: bool) -> None:
        url, remote_id = params.get("remote_url"), params.get("remote_request_id")
        if not isinstance(url, str) or not isinstance(remote_id, str):
            raise APIError(400, "a decode server takes the `kv_transfer_params` a prefill server answered with "
                                "(remote_url, remote_request_id)", param="kv_transfer_params")
        url = peer_url(url)
        if url not in self.peers:  # never contacted: peers are configured, not requested
            raise APIError(403, f"{url} is not one of this decode server's prefill peers (--prefill-peers)",
                           type="permission_error", param="kv_transfer_params")
        try:
            timeout = aiohttp.ClientTimeout(total=ADMISSION_TIMEOUT_S, sock_connect=5)
            async with aiohttp.ClientSession(timeout=timeout, headers=secret_headers(self.secret)) as session:
                async with session.get(f"{url}/v1/disagg/admissions/{remote_id}",
                                       params={"peer": self.engine.name}) as r:
                    data = await r.read()
                    if r.status != 200:
                        raise APIError(502, f"the prefill server {url} has no admission for request {remote_id} "
                                            f"(HTTP {r.status}: it finished, expired or was never handed over)",
                                       type="server_error")
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise APIError(502, f"the prefill server {url} cannot be reached ({type(e).__name__}: {e})",
                           type="server_error") from None
        try:
            adm = await asyncio.get_running_loop().run_in_executor(None, Admission.from_bytes, data)
        except Exception as e:
            raise APIError(502, f"the prefill server's admission does not load ({e})", type="server_error") from None
        self.engine.expect_admission(request_id, adm, url, len(data))

    def result(self, request_id: str) -> dict | None:
        return None

    def discard(self, request_id: str) -> None:
        self.engine.discard_admission(request_id)


class Peers(BaseModel):
    peer: str
    request_ids: list[str]


def add_prefill_routes(app: FastAPI, async_engine) -> None:
    engine = async_engine.engine

    @app.get("/v1/disagg/admissions/{request_id}")
    async def admission(request_id: str, peer: str):
        data = engine.take_admission(request_id, peer)
        if data is None:
            raise APIError(404, f"no admission for request {request_id!r} (never handed over, fetched already, "
                                "or its lease ended)", type="not_found_error")
        return Response(data, media_type="application/octet-stream")

    @app.post("/v1/disagg/heartbeat")
    async def heartbeat(body: Peers):
        return {"lost": engine.leases.heartbeat(body.peer, body.request_ids)}

    @app.post("/v1/disagg/release")
    async def release(body: Peers):
        n = sum(engine.leases.release(rid) for rid in body.request_ids)
        async_engine.call_soon(lambda e: e.reap())  # frees the extents on the engine thread
        return {"released": n}


def start_reaper(async_engine, interval_s: float = REAP_INTERVAL_S) -> None:
    """Expired leases are freed even while the engine is idle (it then waits for commands)."""
    def loop():
        while True:
            time.sleep(interval_s)
            if async_engine.is_running:
                async_engine.call_soon(lambda e: e.reap())

    threading.Thread(target=loop, name="lease-reaper", daemon=True).start()


def disagg_role(role: str, async_engine, secret: str | None = None, prefill_peers: list[str] | None = None):
    """The serving side of a role server (None for `both`)."""
    if role == "prefill":
        return PrefillRole(async_engine)
    return DecodeRole(async_engine, secret, prefill_peers) if role == "decode" else None
