"""The prefill instance's side of disaggregation (docs/disaggregation.md): a request it has
prefilled and converted is handed over: its admission is built, and its host extent passes
from the engine to a lease, so the engine's release of the finished request leaves the extent
where decode peers read it until the lease is released or expires (`leases.py`)."""
from __future__ import annotations

from oasiskv.disagg.admission import Admission, full_admission, rpf_admission
from oasiskv.disagg.leases import LeaseTable


def hand_over(sparse, seq, leases: LeaseTable, peer: str, mode: str = "rpf",
              peer_metadata: str = "") -> Admission:
    """The admission of `seq`, just converted by `sparse` (its SparseManager),
    for the decode instance `peer`; its extent is leased to that peer from now on."""
    if mode == "rpf":
        adm = rpf_admission(seq.request_id, seq, sparse)
    else:
        adm = full_admission(seq.request_id, seq, sparse)
    adm.peer_metadata = peer_metadata
    adm.lease_ttl_s = leases.grant(seq.request_id, peer)
    seq.host_extent = None  # the engine's release leaves the extent to the lease
    return adm
