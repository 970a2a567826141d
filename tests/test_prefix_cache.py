"""The prefix cache's host tables (dflash_jax.runtime.engine.prefix_cache): chain hashes, reference
counts, least-recently-used eviction that never takes a referenced page; and the scheduler's page
accounting over it, without a model."""

import pytest

from dflash_jax.runtime.engine.prefix_cache import PrefixCache, page_hashes
from dflash_jax.runtime.engine.request import Request, RequestParams
from dflash_jax.runtime.engine.scheduler import Scheduler


def test_a_page_hash_names_the_whole_prefix_through_its_page():
    a = page_hashes(list(range(20)), 4)
    assert len(a) == 5 and len(set(a)) == 5
    assert page_hashes(list(range(19)), 4) == a[:4]                       # only full pages
    assert page_hashes(list(range(12)) + [99] * 8, 4)[:3] == a[:3]        # the same prefix, the same hashes
    changed = page_hashes([7] + list(range(1, 20)), 4)
    assert all(x != y for x, y in zip(changed, a))                        # an early token changes every later hash
    assert page_hashes(list(range(4, 8)), 4)[0] != a[1]                   # same tokens, another parent
    assert page_hashes([], 4) == [] and page_hashes([1, 2, 3], 4) == []


def test_references_pin_pages_and_eviction_takes_the_least_recently_used_unreferenced():
    cache = PrefixCache()
    hashes = page_hashes(list(range(16)), 4)
    for page, page_hash in zip((10, 11, 12, 13), hashes):
        assert cache.insert(page, page_hash)                      # its writer references it
    assert not cache.insert(20, hashes[1])                        # cached already: page 20 stays the caller's
    assert cache.match(hashes) == [10, 11, 12, 13] and cache.match(hashes[:2]) == [10, 11]
    assert cache.match(page_hashes([1] + list(range(1, 16)), 4)) == []
    assert cache.evictable == 0 and cache.evict() is None        # every page referenced: nothing to evict
    cache.acquire([10, 11])                                       # a second request on the first two
    for page in (13, 12, 11, 10):                                 # the writer ends (its deepest page first)
        assert cache.release(page)
    assert not cache.release(20)                                  # not cached: the caller frees it
    assert cache.evictable == 2 and [cache.references(p) for p in (10, 11, 12, 13)] == [1, 1, 0, 0]
    assert cache.evict() == 13 and cache.evict() == 12 and cache.evict() is None   # 10, 11 are referenced
    assert cache.match(hashes) == [10, 11] and 13 not in cache and cache.evictions == 2
    cache.release(11)
    cache.release(10)                                             # 10 now the most recently used
    cache.acquire([11])
    cache.release(11)                                             # ... until 11 is used again
    assert cache.evict() == 10 and cache.evict() == 11 and len(cache) == 0
    cache.check()


def test_clear_drops_every_page_and_refuses_while_one_is_referenced():
    cache = PrefixCache()
    for page, page_hash in enumerate(page_hashes(list(range(8)), 4)):
        cache.insert(page, page_hash)
    with pytest.raises(RuntimeError, match=r"pages \[0, 1\] are referenced"):
        cache.clear()
    cache.release(0)
    cache.release(1)
    assert sorted(cache.clear()) == [0, 1] and len(cache) == 0 and cache.evictable == 0


def _request(number: int, prompt: list[int], max_tokens: int) -> Request:
    return Request(id=f"r{number}", number=number, prompt_ids=prompt, params=RequestParams(max_tokens=max_tokens),
                   on_output=lambda output: None)


def test_admission_counts_cached_pages_once_and_pins_the_evictable_ones():
    """Pool of 10 pages of 4 tokens, block 4. A 12-token prompt with 4 new tokens (5 pages at
    worst) leaves its 3 prompt pages cached; the same prompt again starts on 2 of them (its last
    token must run), with 3 fresh pages promised; a request of 6 pages then waits: 2 are reserved
    and 7 available (its 2 cached pages no longer evictable), and it is admitted once the second
    ends, on free pages before any cached one is evicted."""
    scheduler = Scheduler(slots=3, num_pages=10, page_size=4, block_size=4, max_waiting=8, prefix_caching=True)
    prompt = list(range(12))
    first = _request(0, prompt, 4)
    scheduler.enqueue(first)
    assert scheduler.admit() == [first] and len(first.pages) == 3 and first.cached_tokens == 0
    first.prefilled = 12
    scheduler.cache_prefilled([first])
    assert scheduler.cached_pages == 3 and scheduler.reserved == 2
    first_pages = list(first.pages)
    scheduler.release(first)
    assert scheduler.pages_in_use == 0 and scheduler.available == 10 and scheduler.prefix_cache.evictable == 3
    second, third = _request(1, prompt, 4), _request(2, list(range(50, 63)), 7)
    scheduler.enqueue(second)
    scheduler.enqueue(third)
    assert scheduler.admit() == [second]
    assert second.cached_tokens == second.prefilled == 8 and second.pages[:2] == first_pages[:2]
    assert scheduler.pages_in_use == 3 and scheduler.reserved == 2 and scheduler.available == 7
    scheduler.check_invariants()
    scheduler.release(second)
    assert scheduler.admit() == [third] and len(third.pages) == 4 and scheduler.prefix_cache.evictions == 0
    assert scheduler.cached_pages == 3
    scheduler.check_invariants()


def test_a_fresh_page_evicts_only_when_no_page_is_free_and_a_prefix_from_its_end():
    """One page free, three cached and unreferenced (one prompt's): a request of 3 fresh pages
    takes the free one, then evicts that prompt's deepest pages, keeping its first (which still
    matches a prompt that starts the same)."""
    scheduler = Scheduler(slots=1, num_pages=4, page_size=4, block_size=1, max_waiting=8, prefix_caching=True)
    writer = _request(0, list(range(12)), 1)
    scheduler.enqueue(writer)
    scheduler.admit()
    writer.prefilled = 12
    scheduler.cache_prefilled([writer])
    root = writer.pages[0]
    scheduler.release(writer)
    assert len(scheduler.free_pages) == 1 and scheduler.prefix_cache.evictable == 3
    reader = _request(1, list(range(100, 110)), 1)                 # no shared prefix: 3 fresh pages
    scheduler.enqueue(reader)
    assert scheduler.admit() == [reader] and scheduler.prefix_cache.evictions == 2
    assert scheduler.prefix_cache.match(page_hashes(list(range(12)), 4)) == [root]
    scheduler.check_invariants()
