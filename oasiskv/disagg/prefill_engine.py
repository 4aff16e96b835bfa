"""The engine of `oasiskv serve --role prefill` (docs/disaggregation.md, "Server roles").

A request marked for hand-over (`expect_hand_over`, before it is added) is prefilled and
converted to sparse whatever its length (`Sequence.hand_over`); right after its conversion it
is handed over: its admission is built and kept until a decode instance fetches it, its host
extent passes to a lease, and the request finishes with its first token. Everything else the
engine serves as usual. The host pool is registered with the transport once, at start.

Leases are freed only here, on the engine thread (`reap`, after every step and from a timer
while idle); the HTTP side only fetches admissions and marks leases (`LeaseTable`).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch

from oasiskv.config import EngineConfig
from oasiskv.disagg.admission import TRANSFER_MODES
from oasiskv.disagg.leases import DEFAULT_TTL_S, LeaseTable
from oasiskv.disagg.prefill_side import hand_over
from oasiskv.disagg.transport import Transport
from oasiskv.engine.llm_engine import LLMEngine, RequestOutput
from oasiskv.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class PrefillEngine(LLMEngine):
    def __init__(self, config: EngineConfig, transport: Transport, mode: str = "rpf",
                 lease_ttl_s: float = DEFAULT_TTL_S, url: str = ""):
        if mode not in TRANSFER_MODES:
            raise ValueError(f"--kv-transfer-mode must be one of {', '.join(TRANSFER_MODES)}, got {mode!r}")
        super().__init__(config)
        self.sparse = self.runner.sparse
        if self.sparse is None:
            raise ValueError("the prefill role needs sparse decode (--sparse)")
        self.mode, self.url = mode, url  # url: this server's address, for the decode side
        self.transport = transport
        transport.register(self.sparse.host.items)
        transport.serve()
        self.peer_metadata = transport.metadata().decode()
        self.leases = LeaseTable(self._free_extent, ttl_s=lease_ttl_s)
        self._lock = threading.Lock()  # guards the dicts below (the HTTP side reads them)
        self._expected: dict[str, str] = {}  # request id -> transfer mode, before it is added
        self._handing: dict[str, str] = {}  # added, not handed over yet: request id -> mode
        self._admissions: dict[str, bytes] = {}  # handed over, until fetched or the lease ends
        self.results: dict[str, dict] = {}  # request id -> its response's kv_transfer_params
        self.totals = {"admissions": 0, "admission_bytes": 0, "admissions_fetched": 0}

    # ---- intake (any thread) ------------------------------------------------------------
    def expect_hand_over(self, request_id: str, mode: str | None = None) -> None:
        mode = mode or self.mode
        if mode not in TRANSFER_MODES:
            raise ValueError(f"transfer_mode must be one of {', '.join(TRANSFER_MODES)}, got {mode!r}")
        with self._lock:
            self._expected[request_id] = mode

    def discard_hand_over(self, request_id: str) -> None:
        """The HTTP side gave up on the request before it was added."""
        with self._lock:
            self._expected.pop(request_id, None)

    def take_admission(self, request_id: str, peer: str) -> bytes | None:
        """The admission, once, to the decode instance `peer`, which takes the lease from now on;
        None if there is none (never handed over, fetched already, or its lease ended)."""
        with self._lock:
            data = self._admissions.pop(request_id, None)
        if data is None or not self.leases.claim(request_id, peer):
            return None
        self.totals["admissions_fetched"] += 1
        return data

    def take_result(self, request_id: str) -> dict | None:
        """The hand-over's kv_transfer_params for the response (once)."""
        with self._lock:
            return self.results.pop(request_id, None)

    # ---- the engine thread --------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        with self._lock:
            mode = self._expected.pop(request_id, None) if request_id is not None else None
        if mode is None:
            return super().add_request(prompt, params, request_id)
        # It must not finish at its first token (it converts after the step that samples it);
        # it is ended here right after the hand-over.
        params = dataclasses.replace(params or SamplingParams(), max_tokens=2, min_tokens=0, ignore_eos=True,
                                     stop_token_ids=[], stop=None)
        rid = super().add_request(prompt, params, request_id)
        self.seqs[rid].hand_over = True
        self._handing[rid] = mode
        return rid

    def _finish_reason(self, seq, tok: int) -> str | None:
        """A request to hand over ends at its hand-over, never at its first token: not even when
        that token completes its grammar (the decode side then ends it at admission)."""
        return None if seq.hand_over else super()._finish_reason(seq, tok)

    def step(self) -> list[RequestOutput]:
        outputs = super().step()
        done = self._hand_over_converted()
        if done:
            outputs = [o for o in outputs if o.request_id not in done] + list(done.values())
        self.leases.reap()
        return outputs

    def _hand_over_converted(self) -> dict[str, RequestOutput]:
        """Hand over the requests that converted in this step; fail those that sampled their
        first token without converting (no GPU pages for a working set)."""
        done, now = {}, time.perf_counter()
        for rid, mode in list(self._handing.items()):
            seq = self.seqs.get(rid)
            if seq is None or seq.is_finished:  # aborted
                del self._handing[rid]
                continue
            if seq.sparse is None:
                if seq.output_token_ids:
                    del self._handing[rid]
                    seq.error = "the prefill instance had no GPU pages to convert the request for its hand-over"
                    done[rid] = self._fail(seq, now)
                continue
            del self._handing[rid]
            if self.runner.device.type == "cuda":  # the conversion's host copies are asynchronous
                torch.cuda.synchronize()
            try:
                adm = hand_over(self.sparse, seq, self.leases, "", mode, self.peer_metadata)
            except Exception as e:  # noqa: BLE001 - fails this request only; its extent is still the engine's
                log.exception("hand-over of %s failed", rid)
                seq.error = f"the hand-over failed: {type(e).__name__}: {e}"
                done[rid] = self._fail(seq, now)
                continue
            adm.first_logprobs = seq.logprobs[0] if seq.logprobs else None
            data = adm.to_bytes()
            with self._lock:
                self._admissions[rid] = data
                self.results[rid] = {"do_remote_prefill": True, "remote_request_id": rid,
                                     "remote_url": self.url, "transfer_mode": adm.mode,
                                     "admission_bytes": len(data), "lease_ttl_s": adm.lease_ttl_s}
            self.totals["admissions"] += 1
            self.totals["admission_bytes"] += len(data)
            seq.finish_reason, seq.finish_time = "length", now
            self.scheduler.finish(seq)
            self.seqs.pop(rid, None)
            done[rid] = self.make_output(seq)
        return done

    def reap(self) -> None:
        """Free the extents whose leases ended (for `AsyncEngine.call_soon` while idle)."""
        self.leases.reap()

    def _free_extent(self, request_id: str) -> None:
        with self._lock:
            self._admissions.pop(request_id, None)
            self.results.pop(request_id, None)
        if self.sparse.host.extent(request_id) is not None:
            self.sparse.host.free(request_id)

    def disagg_stats(self) -> dict:
        """What /metrics shows of this side (entrypoints/metrics.py)."""
        return {"role": "prefill", "admission_bytes": self.totals["admission_bytes"],
                "admissions": self.totals["admissions"], "leases_held": self.leases.held(),
                "lease_expiries": self.leases.expired_total}

    def close(self) -> None:
        self.transport.close()
