"""Flags of `oasiskv serve` for prefill/decode disaggregation, and the engine each role runs
(docs/disaggregation.md, "Server roles")."""
from __future__ import annotations

import argparse
import dataclasses

from oasiskv.config import EngineConfig
from oasiskv.entrypoints.disagg_trust import secret_headers

ROLES = ("both", "prefill", "decode")


def add_disagg_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("disaggregation (prefill and decode on separate servers)")
    g.add_argument("--role", default="both", choices=ROLES,
                   help="both: prefill and decode here (default); prefill: hand requests that carry "
                        "kv_transfer_params over to a decode server; decode: admit them from their "
                        "prefill server (both roles imply --sparse)")
    g.add_argument("--kv-transfer-mode", default="rpf", choices=["rpf", "full"],
                   help="prefill role: what a decode server receives at admission: rpf (summaries and "
                        "the first working set; the rest is read on demand) or full (the whole KV, "
                        "what vLLM's and SGLang's connectors move)")
    g.add_argument("--kv-transport", default="auto", choices=["auto", "nixl", "socket"],
                   help="how the decode server reads blocks from the prefill's host pool (auto: NIXL "
                        "where it imports, else the socket block server)")
    g.add_argument("--rpf-strict", action="store_true",
                   help="decode role: every step waits for the remote blocks it predicts (the tokens "
                        "then equal colocated sparse decode; for tests)")
    g.add_argument("--rpf-link-gbps", type=float, default=None,
                   help="decode role: remote reads per step at most what a link of this rate (Gbit/s) "
                        "carries during one decode step (default: no budget)")
    g.add_argument("--rpf-want-per-head", type=int, default=None,
                   help="decode role: remote blocks a step asks for per layer and KV head, its best-ranked "
                        "misses (default: the fetch cap C, what the selection admits a step; 0: every "
                        "predicted block)")
    g.add_argument("--remote-kv-gb", type=float, default=None,
                   help="decode role: host memory for admitted requests' blocks (default: --host-kv-gb)")
    g.add_argument("--disagg-secret", default=None, metavar="SECRET",
                   help="the secret the proxy and the role servers share (default: $OASISKV_DISAGG_SECRET); "
                        "without it a role server takes no kv_transfer_params (docs/disaggregation.md, Security)")
    g.add_argument("--prefill-peers", default=None, type=lambda s: [u for u in s.split(",") if u.strip()],
                   metavar="URL[,URL...]", help="decode role: the prefill servers it may read KV from, as the "
                   "proxy names them (its --prefill URLs); no other host is ever contacted")
    g.add_argument("--kv-lease-ttl", type=float, default=10.0,
                   help="prefill role: seconds a handed-over request's KV stays without a heartbeat "
                        "from its decode server")


def role_config(config: EngineConfig, role: str, strict: bool = False) -> EngineConfig:
    """A role server decodes sparse, one step at a time (the host reads each step's wanted
    blocks before the next); a prefill server hands its requests over right after their
    conversion (they never decode there). With --rpf-strict a decode server's steps run eager
    and their stages in order, each layer's selection waiting for its reads
    (`RemoteSource.read_layer`)."""
    if role == "both":
        return config
    if config.tensor_parallel_size != 1:
        raise ValueError("--role prefill|decode runs with --tensor-parallel-size 1")
    config = dataclasses.replace(config.with_sparse(enabled=True), async_scheduling="off")
    if role == "decode" and strict:
        in_order = dataclasses.replace(config.pipeline_tuning, background=False)
        config = dataclasses.replace(config, pipeline_tuning=in_order, enforce_eager=True)
    return config


def make_transport(kind: str, host: str):
    if kind in ("auto", "nixl"):
        from oasiskv.disagg.nixl_transport import NixlTransport, nixl_available
        why = nixl_available()
        if why is None:
            return NixlTransport()
        if kind == "nixl":
            raise ValueError(why)
    from oasiskv.disagg.socket_transport import SocketTransport
    return SocketTransport(host=host)


def make_engine(args: argparse.Namespace, config: EngineConfig, url: str, secret: str | None = None):
    """The LLMEngine of the server's role."""
    from oasiskv.engine.llm_engine import LLMEngine
    role = getattr(args, "role", "both")
    config = role_config(config, role, getattr(args, "rpf_strict", False))
    if role == "both":
        return LLMEngine(config)
    transport = make_transport(args.kv_transport, "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host)
    if role == "prefill":
        from oasiskv.disagg.prefill_engine import PrefillEngine
        return PrefillEngine(config, transport, args.kv_transfer_mode, args.kv_lease_ttl, url)
    from oasiskv.disagg.decode_engine import DecodeEngine
    config = dataclasses.replace(config, rpf_want_per_head=getattr(args, "rpf_want_per_head", None))
    config.want_per_head()  # a bad value fails here, before the model loads
    return DecodeEngine(config, transport, args.remote_kv_gb, args.rpf_strict, args.rpf_link_gbps,
                        peer_headers=secret_headers(secret))
