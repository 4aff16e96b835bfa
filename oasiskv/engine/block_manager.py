"""GPU page pool: hands out pages (each holds `block_size` tokens of every KV head of every layer)."""
from __future__ import annotations

from collections import deque

from oasiskv.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_pages: int, block_size: int):
        if num_pages < 1:
            raise ValueError(f"the KV cache has room for no page of {block_size} tokens; give it more memory")
        self.num_pages = num_pages
        self.block_size = block_size
        self.free_pages: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self.free_pages)

    def pages_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra pages `seq` needs so that its first `num_tokens` tokens have a place."""
        want = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, want - len(seq.pages))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.pages_needed(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.pages_needed(seq, num_tokens)
        if need > self.num_free:
            raise RuntimeError(f"out of KV pages: need {need}, {self.num_free} free")
        seq.pages.extend(self.free_pages.popleft() for _ in range(need))

    def take(self, n: int) -> list[int] | None:
        """n pages outside any page table (a sparse working set), or None if too few are free."""
        if n > self.num_free:
            return None
        return [self.free_pages.popleft() for _ in range(n)]

    def give_back(self, pages: list[int]) -> None:
        self.free_pages.extend(pages)

    def free(self, seq: Sequence) -> None:
        self.free_pages.extend(seq.pages)
        seq.pages = []
        seq.num_cached_tokens = 0
