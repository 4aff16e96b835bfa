"""GPU page pool: hands out pages (each holds `block_size` tokens of every KV head of every layer),
with automatic prefix caching (docs/prefix_caching.md).

Every page has a reference count: the requests whose page table (or working set) holds it. A
full block whose K/V is computed is *named* (`block_hash.block_name`: a chained hash of its
tokens), so a later request whose leading blocks have the same names shares those pages instead
of prefilling them. A page whose count drops to zero joins `free_pages`, an LRU list: it keeps
its K/V and its name until it is handed out again, and only then is its name dropped. A request
only ever writes into pages it holds alone and that have no name: hits cover whole blocks before
the first token it computes, and the caller asks `take_own` before reusing a page of its own.

Below the pages, a sparse engine keeps a host tier (`sparse/host_cache.py`): finished sparse
requests' full KV in the host pool, under the same names. A request's leading blocks past its
GPU hits that the host tier holds are loaded into new pages of its own instead of prefilled.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from oasiskv.engine.block_hash import extend_block_names
from oasiskv.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_pages: int, block_size: int, enable_caching: bool = False, salt: bytes = b""):
        if num_pages < 1:
            raise ValueError(f"the KV cache has room for no page of {block_size} tokens; give it more memory")
        self.num_pages = num_pages
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.salt = salt  # block_hash.engine_salt of the engine's model and KV dtype
        self.ref_counts = [0] * num_pages
        self.free_pages: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))  # LRU first
        self.page_name: list[bytes | None] = [None] * num_pages
        self.named: dict[bytes, int] = {}  # block name -> the page holding that block's K/V
        # vLLM's prefix_cache_queries / prefix_cache_hits: prompt tokens looked up at admission
        # and those found cached.
        self.queries = 0
        self.hits = 0
        self.host_tier = None  # HostPrefixCache of a sparse engine (the engine sets it)

    @property
    def num_free(self) -> int:
        """Pages no request holds (cached ones included: they are handed out when needed)."""
        return len(self.free_pages)

    @property
    def num_cached_free(self) -> int:
        return sum(self.page_name[p] is not None for p in self.free_pages)

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
        seq.pages.extend(self._allocate() for _ in range(need))

    def take(self, n: int) -> list[int] | None:
        """n pages outside any page table (a sparse working set), or None if too few are free."""
        if n > self.num_free:
            return None
        return [self._allocate() for _ in range(n)]

    def take_run(self, n: int, own: Iterable[int] = ()) -> list[int] | None:
        """n consecutive pages (a sparse request's summaries, `summary_arena`), the highest such
        run among the free pages and `own` (pages the caller holds alone and gives up: they are
        kept held, their names dropped); None if no run is that long."""
        if n <= 0:
            return []
        own = set(own)
        candidates = sorted(own.union(self.free_pages))
        end = length = 0
        for i in range(len(candidates) - 1, -1, -1):  # from the top: dense pages come from the bottom
            length = length + 1 if length and candidates[i] == candidates[i + 1] - 1 else 1
            if length == n:
                end = candidates[i] + n
                break
        else:
            return None
        run = list(range(end - n, end))
        for p in run:
            if p not in own:
                del self.free_pages[p]
                self.ref_counts[p] = 1
            self._drop_name(p)
        return run

    def give_back(self, pages: Iterable[int]) -> None:
        """Pages from `take` / `take_run` that were not used after all."""
        self.release(pages)

    def _drop_name(self, page: int) -> None:
        name = self.page_name[page]
        if name is not None:  # evicted from the cache: its K/V is about to be overwritten
            del self.named[name]
            self.page_name[page] = None

    def _allocate(self) -> int:
        page, _ = self.free_pages.popitem(last=False)  # the least recently freed
        self._drop_name(page)
        self.ref_counts[page] = 1
        return page

    def release(self, pages: Iterable[int]) -> None:
        """Drop one reference to each page; a page nobody holds goes to the end of the LRU list."""
        for p in pages:
            self.ref_counts[p] -= 1
            if self.ref_counts[p] < 0:
                raise RuntimeError(f"page {p} released more often than it was held")
            if self.ref_counts[p] == 0:
                self.free_pages[p] = None

    def free(self, seq: Sequence) -> None:
        # Last block first, so the LRU list evicts a request's tail before the prefix it shares.
        self.release(reversed(seq.pages))
        if seq.host_load is not None:  # admitted on a host hit that was never loaded
            self.host_tier.unpin(seq.host_load.entry)
            seq.host_load = None
        seq.pages = []
        seq.num_cached_tokens = 0
        seq.num_named_blocks = 0

    # ---- prefix caching -----------------------------------------------------------------
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Pages holding `seq`'s leading full blocks, as far as they are cached. At least its last
        token is left out, so the step that computes it gives logits to sample from. A request
        that asks for prompt logprobs gets none (their logits come from computing the prompt)."""
        if not self.enable_caching or seq.params.prompt_logprobs is not None:
            return []
        names = extend_block_names(seq, self.salt, self.block_size, (seq.num_tokens - 1) // self.block_size)
        pages = []
        for name in names:
            page = self.named.get(name)
            if page is None:
                break
            pages.append(page)
        return pages

    def names_computed(self, seq: Sequence, num_tokens: int) -> list[bytes]:
        """Names of the full blocks a step computes when it takes `seq`'s next `num_tokens` tokens."""
        if not self.enable_caching:
            return []
        start, end = seq.num_cached_tokens // self.block_size, (seq.num_cached_tokens + num_tokens) // self.block_size
        return extend_block_names(seq, self.salt, self.block_size, end)[start:end]

    def next_block_name(self, seq: Sequence, hits: list[int]) -> bytes | None:
        """The name of `seq`'s first block after its cached prefix, if that block is full."""
        names = seq.block_names
        return names[len(hits)] if self.enable_caching and len(hits) < len(names) else None

    def host_prefix(self, seq: Sequence, hits: list[int]):
        """`seq`'s leading blocks after its GPU hits `hits` that the host tier holds (a
        `HostHit`, or None); `cached_prefix` computed the names it looks up."""
        if self.host_tier is None or not self.enable_caching or seq.params.prompt_logprobs is not None:
            return None
        return self.host_tier.lookup(seq.block_names, len(hits))

    def can_admit(self, seq: Sequence, hits: list[int], num_tokens: int) -> bool:
        """Room for `seq`'s first `num_tokens` tokens when it shares the pages `hits`: new pages,
        plus the hits nobody holds now (they leave the free list)."""
        want = (num_tokens + self.block_size - 1) // self.block_size
        idle = sum(self.ref_counts[p] == 0 for p in hits)
        return want - len(hits) + idle <= self.num_free

    def admit(self, seq: Sequence, hits: list[int], host_hit=None) -> None:
        """`seq` (holding no page) shares `hits`; its prefill starts after them, and after the
        blocks of `host_hit` (from `host_prefix`), which the next step loads into the pages
        `grow` gives it (the entry is pinned until then)."""
        assert not seq.pages, "a request is admitted with an empty page table"
        for p in hits:
            if self.ref_counts[p] == 0:
                del self.free_pages[p]
            self.ref_counts[p] += 1
        seq.pages = list(hits)
        gpu_tokens = len(hits) * self.block_size
        host_tokens = host_hit.num_tokens if host_hit is not None else 0
        seq.num_cached_tokens = gpu_tokens + host_tokens
        seq.num_named_blocks = len(hits)
        if host_hit is not None:
            self.host_tier.pin(host_hit.entry)
            seq.host_load = host_hit
        if self.enable_caching and seq.params.prompt_logprobs is None:
            self.queries += seq.num_tokens
            self.hits += gpu_tokens
            if self.host_tier is not None:
                self.host_tier.queries += seq.num_tokens
                self.host_tier.hits += host_tokens
        if seq.prefix_hit_tokens is None:
            seq.prefix_hit_tokens = seq.num_cached_tokens
            seq.host_hit_tokens = host_tokens

    def name_full_blocks(self, seq: Sequence) -> None:
        """After a step: name `seq`'s blocks that are now full and computed, so later requests find
        them. A block whose name another page already holds keeps no name (one page per name)."""
        if not self.enable_caching:
            return
        full = seq.num_cached_tokens // self.block_size
        if full <= seq.num_named_blocks:
            return
        names = extend_block_names(seq, self.salt, self.block_size, full)
        for b in range(seq.num_named_blocks, full):
            page = seq.pages[b]
            if names[b] not in self.named and self.page_name[page] is None:
                self.named[names[b]] = page
                self.page_name[page] = names[b]
        seq.num_named_blocks = full

    def num_shared(self, seq: Sequence) -> int:
        """Pages of `seq` that other requests hold too: releasing them frees nothing."""
        return sum(self.ref_counts[p] > 1 for p in seq.pages)

    def take_own(self, seq: Sequence, n: int) -> list[int] | None:
        """n pages of `seq`'s page table that it holds alone (its tail first), their names dropped
        so that they can be overwritten (a conversion's working set, when the pool is full); None
        unless it holds more than n alone, so that the conversion still frees a page."""
        own = [p for p in reversed(seq.pages) if self.ref_counts[p] == 1]
        if len(own) <= n:
            return None
        for p in own[:n]:
            name = self.page_name[p]
            if name is not None:
                del self.named[name]
                self.page_name[p] = None
        return own[:n]

    def reset_prefix_cache(self) -> None:
        """Forget every name, in both tiers (vLLM's reset_prefix_cache): later requests prefill
        from scratch."""
        self.named.clear()
        self.page_name = [None] * self.num_pages
        if self.host_tier is not None:
            self.host_tier.clear()
