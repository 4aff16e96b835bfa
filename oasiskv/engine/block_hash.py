"""Names of full KV blocks for the prefix cache: a chained hash, so a block's name stands for its
own tokens and every token before it (docs/prefix_caching.md).

    name(block b) = sha256(name(block b-1) || token ids of block b)

Block 0's parent is the engine's salt, a hash of everything else that changes a block's K/V
(the model, its weights' source, the KV dtype, the block size): two engines that would write
different K/V for the same tokens never share names. sha256 rather than Python's `hash`, so a
collision, which would hand a request another prompt's K/V, is out of reach.
"""
from __future__ import annotations

import hashlib
from array import array

from oasiskv.engine.sequence import Sequence


def engine_salt(*identity: str | int | dict | None) -> bytes:
    """The root of every chain: a hash of what, besides the tokens, decides the K/V."""
    return hashlib.sha256(repr(identity).encode()).digest()


def block_name(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def extend_block_names(seq: Sequence, salt: bytes, block_size: int, num_blocks: int) -> list[bytes]:
    """`seq.block_names` computed up to its first `num_blocks` full blocks (kept on the request:
    its tokens never change, so a name is computed once however often it is looked up)."""
    names = seq.block_names
    for b in range(len(names), num_blocks):
        parent = names[-1] if names else salt
        names.append(block_name(parent, seq.token_slice(b * block_size, (b + 1) * block_size)))
    return names
