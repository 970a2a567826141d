"""Scheduling on the host: the waiting queue, the slots, and the KV pages of the pool.

A request is admitted (first come, first served) only when its whole worst case fits, so
nothing runs out of pages mid-run; it is handed pages as it grows and gives them back when it
ends. With prefix caching (``prefix_cache``) a request starts on the cached pages of its
prompt's longest cached prefix, and the full prompt pages it writes are cached once the prefill
call that writes them is dispatched (device calls run in order, so every later call reads them).

Page accounting: a page is free, cached (referenced by any number of running requests, or by none:
evictable), or a running request's own. ``available`` = free + evictable pages; ``reserved`` =
pages promised to running requests and not handed out yet. ``reserved <= available`` always
holds, so every promised page can be handed out (a free one first, else the least recently used
evictable one is evicted): a request is admitted when ``reserved`` + its fresh pages (its worst
case less its cached ones) fit ``available`` less its cached pages that are evictable now
(admitting it pins them)."""

from __future__ import annotations

import collections
import math

from dflash_jax.runtime.engine.prefix_cache import PrefixCache, page_hashes
from dflash_jax.runtime.engine.request import Request


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full (or it is shutting down): try again later."""


class Scheduler:
    """The queue of ``max_waiting`` requests, ``slots`` slots, and ``num_pages`` pages of
    ``page_size`` tokens (a request's scratch for its last block: ``block_size`` tokens);
    ``prefix_caching``: full prompt pages are cached and reused (``PrefixCache``)."""

    def __init__(self, *, slots: int, num_pages: int, page_size: int, block_size: int, max_waiting: int,
                 prefix_caching: bool):
        self.slots, self.num_pages, self.page_size = slots, num_pages, page_size
        self.block_size, self.max_waiting = block_size, max_waiting
        self.waiting: collections.deque[Request] = collections.deque()
        self.owners: list[Request | None] = [None] * slots
        self.free_pages = list(range(num_pages))
        self.prefix_cache = PrefixCache() if prefix_caching else None

    def pages_for(self, prompt_len: int, max_tokens: int) -> int:
        """Pages a request may touch: its prompt, its tokens and the last block's scratch."""
        return math.ceil((prompt_len + max_tokens + self.block_size) / self.page_size)

    def enqueue(self, request: Request) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"the queue is full ({self.max_waiting} waiting requests)")
        self.waiting.append(request)

    @property
    def running(self) -> list[Request]:
        """The requests holding slots."""
        return [r for r in self.owners if r is not None]

    @property
    def cached_pages(self) -> int:
        """Pages in the prefix cache, referenced or not."""
        return 0 if self.prefix_cache is None else len(self.prefix_cache)

    @property
    def available(self) -> int:
        """Pages a request could be handed: the free ones and the cached ones nobody references."""
        return len(self.free_pages) + (0 if self.prefix_cache is None else self.prefix_cache.evictable)

    @property
    def reserved(self) -> int:
        """Pages promised to the requests holding slots and not handed out yet."""
        return sum(r.promised_pages - len(r.pages) for r in self.running)

    @property
    def pages_in_use(self) -> int:
        """Pages some request references (a cached page nobody references is not in use)."""
        return self.num_pages - self.available

    def take_cancelled(self) -> list[Request]:
        """The cancelled requests: the waiting ones, taken off the queue, then those holding
        slots (finishing them releases their slots)."""
        waiting = [r for r in self.waiting if r.cancelled]
        for request in waiting:
            self.waiting.remove(request)
        return waiting + [r for r in self.running if r.cancelled]

    def admit(self) -> list[Request]:
        """Waiting requests into free slots, first come first served, while their worst case fits
        (the module's page accounting); each starts on its prompt's cached pages (its
        ``cached_tokens`` and ``prefilled``) and gets the pages of the rest. Returns them."""
        free = [s for s, owner in enumerate(self.owners) if owner is None]
        admitted, reserved = [], self.reserved     # kept up to date below: a burst admits in linear time
        while self.waiting and free:
            request = self.waiting[0]
            need = self.pages_for(len(request.prompt_ids), request.params.max_tokens)
            cached = self._cached_prefix(request)
            pinned = sum(1 for page in cached if self.prefix_cache.references(page) == 0)
            if reserved + need - len(cached) > self.available - pinned:
                break
            reserved += need - len(cached)
            self.waiting.popleft()
            if cached:
                self.prefix_cache.acquire(cached)
            request.slot, request.promised_pages, request.pages = free.pop(0), need, cached
            request.cached_tokens = request.prefilled = len(cached) * self.page_size
            request.offered_pages = len(cached)
            self.owners[request.slot] = request
            admitted.append(request)
        self.grow(admitted, {r: len(r.prompt_ids) for r in admitted})
        return admitted

    def _cached_prefix(self, request: Request) -> list[int]:
        """The cached pages of the request's prompt's longest cached prefix, short of its last token
        (which prefill must run: it gives the first token)."""
        if self.prefix_cache is None:
            return []
        if request.page_hashes is None:
            request.page_hashes = page_hashes(request.prompt_ids, self.page_size)
        usable = (len(request.prompt_ids) - 1) // self.page_size
        return self.prefix_cache.match(request.page_hashes[:usable])

    def cache_prefilled(self, requests: list[Request]) -> None:
        """Cache the full prompt pages of ``requests`` that the prefill call just dispatched has
        written (their ``prefilled`` counts advanced); a page whose prefix is cached already stays
        its request's own."""
        if self.prefix_cache is None:
            return
        for request in requests:
            written = request.prefilled // self.page_size
            for index in range(request.offered_pages, written):
                self.prefix_cache.insert(request.pages[index], request.page_hashes[index])
            request.offered_pages = max(request.offered_pages, written)

    def prefilling(self, rows: int) -> list[Request]:
        """Up to ``rows`` requests holding slots whose prompts are not all run yet."""
        return [r for r in self.running if not r.decoding][:rows]

    def decoding(self) -> list[Request | None]:
        """Each slot's request when it is decoding, else None."""
        return [r if r is not None and r.decoding else None for r in self.owners]

    def grow(self, requests: list[Request], positions: dict[Request, int]) -> list[Request]:
        """Give each request pages for ``positions[request]`` positions (capped by its promise);
        return those that got new pages."""
        grown = []
        for request in requests:
            want = min(math.ceil(positions[request] / self.page_size), request.promised_pages)
            if want > len(request.pages):
                request.pages += [self._fresh_page() for _ in range(want - len(request.pages))]
                grown.append(request)
        return grown

    def _fresh_page(self) -> int:
        """A free page, else the least recently used cached page nobody references (evicted)."""
        if self.free_pages:
            return self.free_pages.pop()
        page = None if self.prefix_cache is None else self.prefix_cache.evict()
        if page is None:
            raise RuntimeError("no page to hand out: more pages were promised than the pool has")
        return page

    def release(self, request: Request) -> int | None:
        """Take back the request's slot, pages and promise; returns the slot (None when it held
        none). Its cached pages stay cached, the deepest first in eviction order (a prefix is
        evicted from its end, its parents kept while they may still match)."""
        slot = request.slot
        if slot is not None:
            self.owners[slot] = None
            for page in reversed(request.pages):
                if self.prefix_cache is None or not self.prefix_cache.release(page):
                    self.free_pages.append(page)
            request.pages, request.promised_pages, request.slot = [], 0, None
        return slot

    def drop_prefix_cache(self) -> None:
        """Forget every cached page, which become free (the device's pool was rebuilt zeroed);
        no request may hold a slot."""
        if self.prefix_cache is not None:
            self.free_pages += self.prefix_cache.clear()

    def check_invariants(self) -> None:
        """AssertionError when the page accounting is broken (tests call it after each step):
        every page exactly one of free, cached or one request's own; a cached page's reference
        count the requests holding it, and its hash the prefix each of them has there (a
        referenced page is never evicted and handed out again); ``reserved <= available``."""
        holders = collections.Counter(page for request in self.running for page in request.pages)
        cached = set() if self.prefix_cache is None else self.prefix_cache.pages
        free = set(self.free_pages)
        assert len(free) == len(self.free_pages), "a page is free twice"
        assert not free & (cached | set(holders)), "a free page is cached or held"
        assert free | cached | set(holders) == set(range(self.num_pages)), "a page is lost"
        for page in cached:
            assert self.prefix_cache.references(page) == holders[page], f"page {page}: wrong reference count"
        assert all(count == 1 for page, count in holders.items() if page not in cached), "a page held twice"
        for request in self.running:
            assert len(request.pages) <= request.promised_pages, f"{request.id} holds more than its promise"
            hashes = request.page_hashes or []
            for index, page in enumerate(request.pages):
                held = None if self.prefix_cache is None else self.prefix_cache.hash_of(page)
                expected = hashes[index] if index < len(hashes) else None
                assert held in (None, expected), f"{request.id}'s page {index} is cached as another prefix"
                assert held is not None or index >= request.cached_tokens // self.page_size, \
                    f"{request.id}'s cached page {index} was evicted"
        assert self.reserved <= self.available, "more pages promised than can be handed out"
        if self.prefix_cache is not None:
            self.prefix_cache.check()
