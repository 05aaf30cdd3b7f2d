"""Host-side page accounting for a paged KV pool (the pool itself lives on the device).

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
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


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
