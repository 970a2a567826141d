"""Prefix caching: full prompt pages kept by content, so that a request whose prompt starts with a
cached prefix reuses its KV pages instead of prefilling it again.

A page is named by a chain hash of its tokens and its parent page's hash, so one hash stands for
the whole prefix up to the page's end (K/V at a position depend on every token before it). The
target's K/V and the draft's context K/V live in the same pages at the same positions, so a hit
reuses both: DFlash keeps its draft context and its acceptance. Each cached page counts the
requests that reference it; a page nobody references stays cached, least recently used first,
until a fresh page is needed and none is free: then it is evicted (its hash dropped). A
referenced page is never evicted.

Host bookkeeping only: which pages to reuse, never their contents. A hybrid target (Gated
DeltaNet layers) keeps a recurrent state per sequence that no page holds and that cannot be
restored at a cached prefix's end, so prefix caching is refused for it
(``prefix_caching_unsupported``)."""

from __future__ import annotations

import array
import collections
import hashlib
from collections.abc import Sequence

from dflash_jax.model.config import ModelConfig

PageHash = bytes   # a chain hash: the prefix through a full page


def page_hashes(prompt_ids: Sequence[int], page_size: int) -> list[PageHash]:
    """The chain hash of each full page of ``prompt_ids`` (SHA-256 of the parent's hash and the
    page's tokens: a collision, which would reuse another prefix's K/V, is out of reach)."""
    hashes, parent = [], b""
    for start in range(0, len(prompt_ids) - page_size + 1, page_size):
        parent = hashlib.sha256(parent + array.array("q", prompt_ids[start:start + page_size]).tobytes()).digest()
        hashes.append(parent)
    return hashes


def prefix_caching_unsupported(target: ModelConfig, draft: ModelConfig | None = None) -> str | None:
    """Why the models' cache cannot be restored at a cached prefix's end (a Gated DeltaNet layer's
    recurrent state: Qwen3.5 / Qwen3-Next hybrids), or None when prefix caching works."""
    for role, config in (("target", target), ("draft", draft)):
        if config is not None and config.recurrent_layers:
            return (f"the {role} ({config.family}) is a hybrid: its Gated DeltaNet layers "
                    f"({len(config.recurrent_layers)} of {config.num_layers}) keep a recurrent state per sequence, "
                    "which no KV page holds and which cannot be restored at a cached prefix's end")
    return None


class PrefixCache:
    """Cached pages by chain hash, their reference counts, and the unreferenced ones in least
    recently used order. Pages are the pool's page indices; the scheduler owns the rest."""

    def __init__(self):
        self._page_of: dict[PageHash, int] = {}
        self._hash_of: dict[int, PageHash] = {}
        self._references: dict[int, int] = {}
        self._unreferenced: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self.evictions = 0   # pages evicted so far

    def __len__(self) -> int:
        return len(self._hash_of)

    def __contains__(self, page: int) -> bool:
        return page in self._hash_of

    @property
    def pages(self) -> set[int]:
        return set(self._hash_of)

    @property
    def evictable(self) -> int:
        """Cached pages no request references (a fresh page may take one)."""
        return len(self._unreferenced)

    def references(self, page: int) -> int:
        """Requests referencing a cached page."""
        return self._references[page]

    def hash_of(self, page: int) -> PageHash | None:
        return self._hash_of.get(page)

    def match(self, hashes: Sequence[PageHash]) -> list[int]:
        """The cached pages of the longest cached prefix of ``hashes`` (not referenced yet)."""
        pages = []
        for page_hash in hashes:
            page = self._page_of.get(page_hash)
            if page is None:
                break
            pages.append(page)
        return pages

    def acquire(self, pages: Sequence[int]) -> None:
        """One more reference to each cached page (an evictable one no longer is)."""
        for page in pages:
            if self._references[page] == 0:
                del self._unreferenced[page]
            self._references[page] += 1

    def release(self, page: int) -> bool:
        """One reference fewer to ``page`` when it is cached (True); at none it becomes the most
        recently used evictable page. False for a page the cache does not hold (the caller frees
        it)."""
        if page not in self._hash_of:
            return False
        self._references[page] -= 1
        if self._references[page] == 0:
            self._unreferenced[page] = None
        return True

    def insert(self, page: int, page_hash: PageHash) -> bool:
        """Cache a page that its one referencing request has just had written (True). False when
        the hash is cached already: the cached page stays, and ``page`` stays its request's own."""
        if page_hash in self._page_of:
            return False
        if page in self._hash_of:
            raise ValueError(f"page {page} is cached already")
        self._page_of[page_hash], self._hash_of[page], self._references[page] = page, page_hash, 1
        return True

    def evict(self) -> int | None:
        """The least recently used unreferenced page, dropped from the cache (None when every
        cached page is referenced)."""
        if not self._unreferenced:
            return None
        page, _ = self._unreferenced.popitem(last=False)
        del self._page_of[self._hash_of.pop(page)], self._references[page]
        self.evictions += 1
        return page

    def clear(self) -> list[int]:
        """Drop every page (their contents are gone: the pool was rebuilt) and return them; none
        may be referenced."""
        referenced = [page for page, count in self._references.items() if count]
        if referenced:
            raise RuntimeError(f"cannot clear the prefix cache: pages {referenced} are referenced")
        pages = list(self._hash_of)
        self._page_of.clear()
        self._hash_of.clear()
        self._references.clear()
        self._unreferenced.clear()
        return pages

    def check(self) -> None:
        """AssertionError when the tables disagree (tests): one page per hash and back, counts
        never negative, the evictable pages exactly those of no reference."""
        assert len(self._page_of) == len(self._hash_of) == len(self._references)
        assert all(self._hash_of[page] == page_hash for page_hash, page in self._page_of.items())
        assert all(count >= 0 for count in self._references.values())
        assert set(self._unreferenced) == {page for page, count in self._references.items() if count == 0}
