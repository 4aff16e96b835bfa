"""The engine of `oasiskv serve --role decode` (docs/disaggregation.md, "Server roles").

A request that carries a prefill's transfer parameters arrives with its admission, fetched by
the HTTP side (`expect_admission`, before the request is added); adding it admits it
(`decode_side.admit`): its working set goes to the GPU and it decodes at once, reading the other
blocks it needs from the prefill peer over the transport (`RemoteSource`, `RemoteReads`). A
request without them is served as usual (colocated). One host arena (`LocalItems`, the model runner's
`remote_items`: pinned and mapped on CUDA), registered with the transport once, holds the items
of every admitted request. The requests decode batched through the pipeline (its
disaggregated rows, `RemoteRows`); with --rpf-strict its steps run eager and in order, each
layer's selection waiting for its reads (`RemoteSource.read_layer`).

A `full` admission carries no KV: the request waits while its whole KV is read over the
transport (`FullTransfer`, advanced between steps, so running requests keep decoding), then
starts as an RPF request would, with every block local.

Lifetimes: the prefill's lease on a request is renewed by `LeaseHeartbeats` while the request
runs and released when it finishes or is aborted (`full` admissions once their transfer is
done: they need nothing more from the prefill). A failed read, or a peer that stops answering heartbeats, fails the
peer's requests with an error output (`PREFILL_FAILED`) and drops the peer; their pages and items
go back.
"""
from __future__ import annotations

import dataclasses
import time
import uuid

from oasiskv.config import EngineConfig
from oasiskv.disagg.admission import Admission
from oasiskv.disagg.decode_side import PREFILL_FAILED, RemoteSource, admit, fail_requests, request_max_blocks
from oasiskv.disagg.full_transfer import DEFAULT_MAX_READ_BYTES, FullTransfer
from oasiskv.disagg.heartbeats import LeaseHeartbeats
from oasiskv.disagg.local_items import LocalItems
from oasiskv.disagg.remote_reads import RemoteReads
from oasiskv.disagg.transport import DEFAULT_READ_TIMEOUT_S, PeerDisconnected, Transport, TransportError
from oasiskv.engine.llm_engine import LLMEngine, RequestOutput
from oasiskv.sampling_params import SamplingParams


class DecodeEngine(LLMEngine):
    def __init__(self, config: EngineConfig, transport: Transport, remote_kv_gb: float | None = None,
                 strict: bool = False, link_gbps: float | None = None,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, max_read_bytes: int = DEFAULT_MAX_READ_BYTES,
                 peer_headers: dict[str, str] | None = None):
        """remote_kv_gb: the arena for admitted requests' items (default: --host-kv-gb);
        peer_headers: sent with every lease call to a prefill peer (the inter-role secret);
        link_gbps: the remote reads' byte budget per step is what this link carries during
        the previous decode step (None: no budget); max_read_bytes: the size of a full
        transfer's reads."""
        if not config.sparse.enabled:
            raise ValueError("the decode role needs sparse decode (--sparse)")
        gb = remote_kv_gb if remote_kv_gb is not None else config.sparse.host_kv_gb
        super().__init__(dataclasses.replace(config, remote_kv_gb=gb))
        m = self.runner.sparse
        self.store = LocalItems.over(self.runner.remote_items)  # the arena the pipeline reads
        self.transport = transport
        transport.register(self.store.items)
        # Every read and placement happens between the pipeline's steps: the arena may evict.
        self.reads = RemoteReads(transport, self.store, read_timeout_s, evict=True)
        m.remote = RemoteSource(self.reads, m.L, strict=strict)
        self.link_bytes_per_s = None if link_gbps is None else link_gbps * 1e9 / 8
        self.max_read_bytes = max_read_bytes
        self._transfers: dict[str, FullTransfer] = {}  # request id -> its full transfer, until admitted
        self.name = f"decode-{uuid.uuid4().hex[:12]}"
        self.heartbeats = LeaseHeartbeats(self.name, headers=peer_headers)
        self._incoming: dict[str, tuple[Admission, str]] = {}  # request id -> (admission, prefill url)
        self._waiting: list[tuple[Admission, str, str, SamplingParams]] = []  # no room yet
        self._peers: dict[str, str] = {}  # transport metadata -> transport peer name
        self._peer_urls: dict[str, str] = {}  # prefill url -> transport peer name
        self.tracked: dict[str, tuple[str, str]] = {}  # request id -> (prefill url, its id there)
        self._ready: list[RequestOutput] = []  # requests finished at admission
        self._last_step_s = 0.0
        # admission_bytes: the admissions' HTTP bodies and the full transfers' reads;
        # admission_transport_bytes: those reads alone.
        self.totals = {"admissions": 0, "admission_bytes": 0, "admission_transport_bytes": 0}
        self.lease_failures = 0  # requests failed because their lease ended
        self.transfer_failures = 0  # full admissions failed because a read of their KV failed

    # ---- intake ---------------------------------------------------------------------------
    def expect_admission(self, request_id: str, adm: Admission, url: str, nbytes: int) -> None:
        """From the HTTP side, before the request is added (a dict store and a queued op: safe
        across threads). The lease the fetch claimed is renewed from now on, not from when the
        engine thread gets to the request: a busy engine must not let it lapse."""
        self.totals["admission_bytes"] += nbytes
        self._incoming[request_id] = (adm, url)
        self.heartbeats.hold(url, adm.request_id, adm.lease_ttl_s)

    def discard_admission(self, request_id: str) -> None:
        """The HTTP side gave up on a request between its admission's fetch and its start."""
        incoming = self._incoming.pop(request_id, None)
        if incoming is not None:
            self.heartbeats.release(incoming[1], incoming[0].request_id)

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        incoming = self._incoming.pop(request_id, None) if request_id is not None else None
        if incoming is None:
            return super().add_request(prompt, params, request_id)
        adm, url = incoming
        params = params or SamplingParams()
        prefill_id = adm.request_id
        try:
            self._check(adm, self.tokenize(prompt), params)
            if params.structured is not None:  # a spec that does not compile is the caller's ValueError
                self.grammars.check(params.structured)
            if request_id in self.seqs:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._peer_of(adm.peer_metadata, url)  # a prefill that cannot be reached fails it now
        except Exception:
            self.heartbeats.release(url, prefill_id)  # its lease, claimed by the fetch, goes at once
            raise
        adm.request_id = request_id
        self.tracked[request_id] = (url, prefill_id)  # full: until its transfer is done
        self.totals["admissions"] += 1
        self._waiting.append((adm, url, request_id, params))
        self._admit_waiting()
        return request_id

    def _check(self, adm: Admission, ids: list[int], params: SamplingParams) -> None:
        m = self.runner.sparse
        if list(adm.prompt_token_ids) != ids:
            raise ValueError("the prompt differs from the one the prefill instance prefilled")
        if adm.block_size != m.block_size:
            raise ValueError(f"the prefill's block size {adm.block_size} differs from this server's {m.block_size}")
        L, H, P = adm.tensors["blocks"].shape
        if (L, H, P) != (m.L, m.Hkv, m.cfg.working_set_blocks):
            raise ValueError(f"the prefill's working set [{L}, {H}, {P}] differs from this server's "
                             f"[{m.L}, {m.Hkv}, {m.cfg.working_set_blocks}]: start both with the same model, "
                             "--top-k-blocks, --sink-blocks and --window-blocks")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"the request needs {len(ids) + params.max_tokens} tokens, more than the maximum "
                             f"model length {self.max_model_len}")

    def _peer_of(self, metadata: str, url: str) -> str:
        peer = self._peers.get(metadata)
        try:
            self.transport.peer_size(peer or "")
        except PeerDisconnected:  # never added, or dropped after a failure: connect afresh
            peer = self.transport.add_peer(metadata.encode())
            self._peers[metadata] = peer
        self._peer_urls[url] = peer
        return peer

    def _admit_waiting(self) -> None:
        still = []
        for adm, url, rid, params in self._waiting:
            peer = self._peer_urls.get(url, "")
            transfer = None
            if adm.mode == "full":
                try:
                    transfer = self._advance_transfer(adm, rid, peer, params)
                except TransportError as e:  # only this request fails; its items went back
                    self._transfers.pop(rid, None)
                    self.transfer_failures += 1
                    self._ready.append(self._failed_output(rid, adm, params, f"{PREFILL_FAILED}: {e}"))
                    continue
                if transfer is None or not transfer.done:
                    still.append((adm, url, rid, params))
                    continue
            seq = admit(self, adm, peer, params, transfer)
            if seq is None:
                still.append((adm, url, rid, params))
                continue
            if transfer is not None:  # the whole KV is here: the prefill's lease goes at once
                del self._transfers[rid]
                self.totals["admission_bytes"] += transfer.bytes_read
                self.totals["admission_transport_bytes"] += transfer.bytes_read
                self.heartbeats.release(*self.tracked.pop(rid))
            if params.structured is not None:
                self._start_grammar(seq, adm.first_token)
            now = time.perf_counter()
            seq.first_scheduled_time = seq.first_token_time = now
            if params.logprobs is not None:  # the first token's, as the prefill sampled it
                first = adm.first_logprobs or {adm.first_token: float("nan")}
                seq.logprobs.append(first)
                seq.cumulative_logprob += first[adm.first_token]
            reason = self._finish_reason(seq, adm.first_token)  # the prefill's token may end it
            if reason:
                seq.finish_reason, seq.finish_time = reason, now
                self.scheduler.finish(seq)
                self.seqs.pop(rid, None)
                self._ready.append(self.make_output(seq))
        self._waiting = still

    def _start_grammar(self, seq, first_token: int) -> None:
        """The request's matcher, advanced by the first token (the prefill sampled it under the
        same grammar); a token it refuses fails the request at the next step."""
        seq.grammar = self.grammars.matcher(seq.params.structured)
        try:
            seq.grammar.accept(first_token)
        except ValueError as e:
            seq.grammar, seq.error = None, f"the prefill's first token does not fit the grammar: {e}"

    def _advance_transfer(self, adm: Admission, rid: str, peer: str,
                          params: SamplingParams) -> FullTransfer | None:
        """The full admission's transfer, started (None: no room in the arena yet) and advanced."""
        transfer = self._transfers.get(rid)
        if transfer is None:
            transfer = FullTransfer.start(self.reads, adm, peer, request_max_blocks(self, adm, params),
                                          self.max_read_bytes)
            if transfer is None:
                return None
            self._transfers[rid] = transfer
        transfer.advance()
        return transfer

    def _drop_transfer(self, rid: str) -> None:
        transfer = self._transfers.pop(rid, None)
        if transfer is not None:
            transfer.abandon()

    def _failed_output(self, rid: str, adm: Admission, params: SamplingParams, error: str) -> RequestOutput:
        """The error output of a request that failed before it started (it holds nothing)."""
        return RequestOutput(rid, None, list(adm.prompt_token_ids), "", [], "error", True, error=error)

    # ---- the loop -------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self._waiting) or bool(self._ready)

    def step(self) -> list[RequestOutput]:
        outputs, self._ready = self._ready, []
        self._admit_waiting()
        source = self.runner.sparse.remote
        if self.link_bytes_per_s is not None:  # what the link carries in about one step
            source.budget_bytes = int(self.link_bytes_per_s * max(self._last_step_s, 1e-3))
        t0 = time.perf_counter()
        outputs += super().step()
        self._last_step_s = time.perf_counter() - t0
        outputs += self._fail_lost_leases()
        self.reads.poll()
        outputs += fail_requests(self, self.reads)
        self._release_finished()
        if not super().has_unfinished() and self._waiting:
            time.sleep(0.01)  # admissions wait for room that frees only as requests end
        return outputs

    def abort(self, request_id: str) -> None:
        self._waiting = [w for w in self._waiting if w[2] != request_id]  # only a full transfer holds items
        self._drop_transfer(request_id)
        super().abort(request_id)
        self._release_finished()

    def _fail_lost_leases(self) -> list[RequestOutput]:
        """Requests whose prefill lease is gone fail; an unreachable prefill is dropped."""
        outputs, now = [], time.perf_counter()
        by_prefill = {v: k for k, v in self.tracked.items()}
        for lost in self.heartbeats.lost():
            rid = by_prefill.get((lost.url, lost.request_id))
            peer = self._peer_urls.get(lost.url)
            if lost.unreachable and peer is not None:
                self.reads.fail_peer(peer, PeerDisconnected(peer, f"{lost.url} does not answer heartbeats"))
                continue
            if rid is None:
                continue
            # The prefill may reuse the extent now: the request must never read it again.
            error = f"{PREFILL_FAILED}: its lease at {lost.url} ended"
            self.lease_failures += 1
            waiting = [w for w in self._waiting if w[2] == rid]
            if waiting:
                self._waiting.remove(waiting[0])
                self._drop_transfer(rid)
                outputs.append(self._failed_output(rid, waiting[0][0], waiting[0][3], error))
                continue
            seq = self.seqs.get(rid)
            if seq is not None and not seq.is_finished:
                seq.error = error
                outputs.append(self._fail(seq, now))
        return outputs

    def _release_finished(self) -> None:
        for rid, (url, prefill_id) in list(self.tracked.items()):
            if rid in self.seqs or any(w[2] == rid for w in self._waiting):
                continue
            del self.tracked[rid]
            self.heartbeats.release(url, prefill_id)

    def make_output(self, seq) -> RequestOutput:
        out = super().make_output(seq)
        remote = getattr(seq.sparse, "remote", None)
        if remote is not None:  # what this request cost the decode side
            out.stats = {**out.stats, "disagg_host_bytes": remote.items_peak * self.store.item_bytes,
                         "disagg_remote_bytes": remote.bytes_read}
        return out

    def disagg_stats(self) -> dict:
        """What /metrics shows of this side (entrypoints/metrics.py)."""
        return {"role": "decode", "admission_bytes": self.totals["admission_bytes"],
                "admission_transport_bytes": self.totals["admission_transport_bytes"],
                "admissions": self.totals["admissions"], "remote_bytes": self.reads.totals.bytes_read,
                "remote_reads": self.reads.totals.reads, "items_no_room": self.reads.totals.items_no_room,
                "items_evicted": self.reads.totals.items_evicted,
                "reads_in_flight": self.reads.reads_in_flight
                + sum(len(t.pending) for t in list(self._transfers.values())),
                "leases_held": self.heartbeats.held(), "host_bytes_used": self.store.bytes_used,
                "host_bytes_peak": self.store.peak_items * self.store.item_bytes,
                "host_bytes_total": self.store.num_items * self.store.item_bytes,
                "failed_requests": self.reads.totals.failed_requests + self.lease_failures
                                   + self.transfer_failures}

    def close(self) -> None:
        self.heartbeats.close()
        self.transport.close()
