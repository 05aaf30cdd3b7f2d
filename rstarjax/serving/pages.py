"""Host-side page accounting for a paged KV pool (the pool itself lives on the device): the
allocator (``PagePool``) and, beside it, each slot's pages (``SlotTable``), as vLLM keeps its
block tables beside its block allocator.

``PagePool`` hands out page ids, counts references (a page shared by several rows, e.g. the
full pages of a prompt that 2G samples start from, is freed when its last row lets go) and
keeps a registry of prompt prefixes: the full pages holding a prompt's first
``k * page_size`` tokens, findable by those tokens while any row still holds them. Pages are
immutable once full and shared: a row only ever writes at positions past its own length, and
the engine copies a shared prompt's last, partial page instead of sharing it.

What the registry promises, and the engine must keep: a registered page already holds its
tokens' K/V (register only after the feed that writes it ran), computed under the weights of
the version it is registered with (a lookup names the version it serves: pages of earlier
weights are never handed out, even while rows still hold them).

``SlotTable`` is the engine's host mirror of its slots: per live slot its pages, tokens in the
cache, pending token, RNG counter, remaining budget and sampling; and the page table (one row
per slot, ``NO_PAGE`` past its pages) that the device programs read.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from rstarjax.models.kv_cache import NO_PAGE, pages_for
from rstarjax.serving.sampling import SamplingParams


class OutOfPages(RuntimeError):
    """Raised by ``alloc`` when fewer pages are free than asked for."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, "
                             f"{page_size}")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self._refs = np.zeros(self.num_pages, np.int32)
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() hands out low ids first
        # (weights version, full-page tokens) -> pages holding their K/V under those weights
        self._prefixes: dict[tuple[int, tuple[int, ...]], tuple[int, ...]] = {}
        self._prefix_of_page: dict[int, tuple[int, tuple[int, ...]]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def reset(self) -> None:
        self.__init__(self.num_pages, self.page_size)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.pop() for _ in range(n)]
        self._refs[pages] = 1
        return pages

    def share(self, pages: Sequence[int]) -> None:
        """One more holder for each of ``pages`` (all must be live)."""
        for p in pages:
            if self._refs[p] < 1:
                raise ValueError(f"page {p} is not allocated")
            self._refs[p] += 1

    def release(self, pages: Sequence[int]) -> None:
        """One holder fewer; a page nobody holds returns to the free list."""
        for p in pages:
            if self._refs[p] < 1:
                raise ValueError(f"page {p} released more often than held")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                key = self._prefix_of_page.pop(p, None)
                if key is not None:
                    self._forget(key)

    def refcount(self, page: int) -> int:
        return int(self._refs[page])

    # ---- prompt-prefix registry -----------------------------------------------------------
    def full_prefix_key(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """The part of ``tokens`` that fills whole pages (the shareable part)."""
        n = (len(tokens) // self.page_size) * self.page_size
        return tuple(int(t) for t in tokens[:n])

    def register_prefix(self, tokens: Sequence[int], pages: Sequence[int], *, version: int
                        ) -> None:
        """``pages`` hold the full-page part of ``tokens`` (extra pages are ignored), written
        under weights ``version``. Call it once the K/V are in the pages, not before."""
        tokens_key = self.full_prefix_key(tokens)
        key = (int(version), tokens_key)
        if not tokens_key or key in self._prefixes:
            return
        held = tuple(int(p) for p in pages[: len(tokens_key) // self.page_size])
        if len(held) < len(tokens_key) // self.page_size:
            raise ValueError(f"{len(held)} pages cannot hold the {len(tokens_key)} full-page "
                             f"tokens of a prefix (page size {self.page_size})")
        for p in held:
            if self._refs[p] < 1:
                raise ValueError(f"page {p} is not allocated: a free page cannot hold a prefix")
        self._prefixes[key] = held
        for p in held:
            old = self._prefix_of_page.get(p)
            if old is not None and old != key:
                self._forget(old)
            self._prefix_of_page[p] = key

    def lookup_prefix(self, tokens: Sequence[int], *, version: int) -> tuple[int, ...]:
        """Live pages holding the full-page part of ``tokens`` written under weights
        ``version`` (empty when none are registered)."""
        return self._prefixes.get((int(version), self.full_prefix_key(tokens)), ())

    def _forget(self, key: tuple[int, tuple[int, ...]]) -> None:
        for p in self._prefixes.pop(key, ()):
            if self._prefix_of_page.get(p) == key:
                del self._prefix_of_page[p]


@dataclasses.dataclass
class SlotInfo:
    """Host mirror of a live slot."""

    pages: list[int]
    length: int  # tokens in the slot's cache
    pending: int  # sampled token not yet fed to the cache
    counter: int  # tokens the request sampled so far (RNG stream index)
    budget: int  # tokens it may still sample
    sampling: SamplingParams
    active: bool  # decoding (not done, not waiting on a tool)


class SlotTable:
    """Which pages each of ``num_slots`` slots holds (taken from and returned to ``pool``), and
    the ``[num_slots, width]`` page table the device programs read. Slots hold at most
    ``max_len`` tokens."""

    def __init__(self, pool: PagePool, num_slots: int, width: int, max_len: int):
        self.pool = pool
        self.num_slots = int(num_slots)
        self.max_len = int(max_len)
        self.table = np.full((self.num_slots, int(width)), NO_PAGE, np.int32)
        self._slots: list[SlotInfo | None] = [None] * self.num_slots

    def reset(self, keep: Sequence[int] = ()) -> None:
        """Every slot free and every page of the pool returned, except the slots in ``keep``
        (with their pages)."""
        if keep:
            for slot in set(range(self.num_slots)) - set(keep):
                self.free(slot)
            return
        self.pool.reset()
        self.table[:] = NO_PAGE
        self._slots = [None] * self.num_slots

    def __getitem__(self, slot: int) -> SlotInfo | None:
        return self._slots[slot]

    def __iter__(self):
        return iter(self._slots)

    def check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.num_slots})")

    def bind(self, slot: int, pages: Sequence[int], length: int, pending: int, counter: int,
             budget: int, sampling: SamplingParams, active: bool) -> None:
        """Give a free ``slot`` its request: ``pages`` (already held for it) and its state."""
        self.check(slot)
        if self._slots[slot] is not None:
            raise ValueError(f"slot {slot} holds a request")
        self._slots[slot] = SlotInfo(list(pages), length, pending, counter, budget, sampling,
                                     active)
        self.table[slot] = NO_PAGE
        self.table[slot, : len(pages)] = pages

    def pages_to_grow(self, slot: int, num_tokens: int) -> int:
        """Pages ``slot`` must take to hold ``num_tokens`` more tokens (capped at max_len)."""
        info = self._slots[slot]
        target = min(info.length + int(num_tokens), self.max_len)
        return max(0, pages_for(target, self.pool.page_size) - len(info.pages))

    def grow(self, slot: int, num_tokens: int) -> None:
        """Take the pages ``slot`` needs for ``num_tokens`` more tokens (``OutOfPages``)."""
        info = self._slots[slot]
        extra = self.pool.alloc(self.pages_to_grow(slot, num_tokens))
        self.table[slot, len(info.pages): len(info.pages) + len(extra)] = extra
        info.pages.extend(extra)

    def free(self, slot: int) -> None:
        """Release ``slot`` and its pages (a free slot stays free)."""
        self.check(slot)
        info = self._slots[slot]
        if info is not None:
            self.pool.release(info.pages)
        self._slots[slot] = None
        self.table[slot] = NO_PAGE

    def live(self) -> list[int]:
        return [i for i, info in enumerate(self._slots) if info is not None]

    def free_slots(self) -> list[int]:
        return [i for i, info in enumerate(self._slots) if info is None]

    def decoding(self) -> list[int]:
        return [i for i, info in enumerate(self._slots) if info is not None and info.active]
