"""Scheduling on the host: the waiting queue, the slots, and the KV pages of the pool.

A request is admitted (first come, first served) only when its whole worst case fits the pages
not promised yet, so nothing runs out of pages mid-run; it is handed pages as it grows and gives
them back when it ends."""

from __future__ import annotations

import collections
import math

from dflash_jax.runtime.engine.request import Request


class QueueFullError(RuntimeError):
    """The engine's waiting queue is full (or it is shutting down): try again later."""


class Scheduler:
    """The queue of ``max_waiting`` requests, ``slots`` slots, and ``num_pages`` pages of
    ``page_size`` tokens (a request's scratch for its last block: ``block_size`` tokens)."""

    def __init__(self, *, slots: int, num_pages: int, page_size: int, block_size: int, max_waiting: int):
        self.slots, self.num_pages, self.page_size = slots, num_pages, page_size
        self.block_size, self.max_waiting = block_size, max_waiting
        self.waiting: collections.deque[Request] = collections.deque()
        self.owners: list[Request | None] = [None] * slots
        self.free_pages = list(range(num_pages))
        self.promised = 0               # pages promised to the requests holding slots

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
    def pages_in_use(self) -> int:
        return self.num_pages - len(self.free_pages)

    def take_cancelled(self) -> list[Request]:
        """The cancelled requests: the waiting ones, taken off the queue, then those holding
        slots (finishing them releases their slots)."""
        waiting = [r for r in self.waiting if r.cancelled]
        for request in waiting:
            self.waiting.remove(request)
        return waiting + [r for r in self.running if r.cancelled]

    def admit(self) -> list[Request]:
        """Waiting requests into free slots, first come first served, while their worst case
        fits the pages not promised yet; each gets the pages of its prompt. Returns them."""
        free = [s for s, owner in enumerate(self.owners) if owner is None]
        admitted = []
        while self.waiting and free:
            request = self.waiting[0]
            need = self.pages_for(len(request.prompt_ids), request.params.max_tokens)
            if self.promised + need > self.num_pages:
                break
            self.waiting.popleft()
            request.slot, request.promised_pages = free.pop(0), need
            self.promised += need
            self.owners[request.slot] = request
            admitted.append(request)
        self.grow(admitted, {r: len(r.prompt_ids) for r in admitted})
        return admitted

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
                request.pages += [self.free_pages.pop() for _ in range(want - len(request.pages))]
                grown.append(request)
        return grown

    def release(self, request: Request) -> int | None:
        """Take back the request's slot, pages and promise; returns the slot (None when it held
        none)."""
        slot = request.slot
        if slot is not None:
            self.owners[slot] = None
            self.free_pages += request.pages
            self.promised -= request.promised_pages
            request.pages, request.promised_pages, request.slot = [], 0, None
        return slot
