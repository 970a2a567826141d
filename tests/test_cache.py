"""Paged KV cache: the host-side page allocator, cache construction, and page reads/writes under
permuted page tables."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.model.cache import OutOfPagesError, PagedKVCache, allocate_pages, init_cache
from dflash_jax.model.config import uniform_config
from pallas_kernels import gather_pages, write_pages

TARGET = uniform_config(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=4)
DRAFT = uniform_config(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                    num_kv_heads=1, head_dim=8)


def test_allocate_exact_pages_in_order():
    table, num_pages = allocate_pages([5, 16, 1, 17], page_size=8)
    assert num_pages == 1 + 2 + 1 + 3
    assert table.dtype == np.int32 and table.shape == (4, 3)
    assert table.tolist() == [[0, 7, 7], [1, 2, 7], [3, 7, 7], [4, 5, 6]]   # unused -> num_pages


def test_allocate_zero_tokens_still_gets_a_page_and_spare_pages_stay_free():
    table, num_pages = allocate_pages([0, 3], page_size=4, num_pages=10)
    assert num_pages == 10
    assert table.tolist() == [[0], [1]]


def test_allocate_permuted_pages():
    needs = [13, 4, 30, 9]
    table, num_pages = allocate_pages(needs, page_size=4, num_pages=20, rng=np.random.default_rng(0))
    used = [table[b, :-(-n // 4)].tolist() for b, n in enumerate(needs)]
    flat = [p for row in used for p in row]
    assert len(flat) == len(set(flat)) == sum(-(-n // 4) for n in needs)       # distinct pages
    assert all(0 <= p < num_pages for p in flat)
    assert flat != sorted(flat)                                                 # really permuted
    for b, n in enumerate(needs):
        assert (table[b, -(-n // 4):] == num_pages).all()
    again, _ = allocate_pages(needs, page_size=4, num_pages=20, rng=np.random.default_rng(0))
    assert (again == table).all()                                               # reproducible


def test_out_of_pages_raises_before_allocating():
    """One page short is already too few."""
    with pytest.raises(OutOfPagesError, match="need 6 pages") as info:
        allocate_pages([8, 9, 1], page_size=4, num_pages=5)
    assert "cache has 5" in str(info.value)
    assert issubclass(OutOfPagesError, RuntimeError)
    # exactly enough is fine
    table, num_pages = allocate_pages([8, 9, 1], page_size=4, num_pages=6)
    assert num_pages == 6 and table.shape == (3, 3)


def test_allocate_no_sequences_is_a_clear_error():
    """An empty batch is refused in words, not with max()'s 'empty sequence' error."""
    with pytest.raises(ValueError, match="at least one sequence"):
        allocate_pages([], page_size=4)


def test_init_cache_groups_shapes_fill_and_properties():
    table, num_pages = allocate_pages([10, 20], page_size=8, num_pages=9, rng=np.random.default_rng(1))
    cache = init_cache(TARGET, DRAFT, table, num_pages, 8,
                       jnp.bfloat16, fill=float("nan"))
    assert isinstance(cache, PagedKVCache)
    assert len(cache.k) == len(cache.v) == 5 and cache.num_target_layers == 3
    for i in range(3):
        assert cache.k[i].shape == (9, 8, 2, 4) and cache.k[i].dtype == jnp.bfloat16
    for i in range(3, 5):
        assert cache.v[i].shape == (9, 8, 1, 8)
    assert all(bool(jnp.isnan(x).all()) for x in cache.k + cache.v)
    assert cache.page_table.dtype == jnp.int32 and (np.asarray(cache.page_table) == table).all()
    assert np.asarray(cache.lengths).tolist() == [0, 0]
    assert (cache.page_size, cache.num_pages, cache.capacity) == (8, 9, 3 * 8)
    # replace_layer is functional
    k, v = cache.layer(4)
    updated = cache.replace_layer(4, jnp.zeros_like(k), v)
    assert bool(jnp.isnan(cache.k[4]).all()) and not bool(jnp.isnan(updated.k[4]).any())
    assert updated.k[0] is cache.k[0]
    # a pytree whose static part survives jit
    out = jax.jit(lambda c: c.replace(lengths=c.lengths + 3))(cache)
    assert out.num_target_layers == 3 and np.asarray(out.lengths).tolist() == [3, 3]


def _values(batch, tokens, heads=2, dim=4, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((batch, tokens, heads, dim)), jnp.float32)


def test_write_then_gather_round_trip_with_permuted_table():
    page, needs = 4, [11, 6, 16]
    table, num_pages = allocate_pages(needs, page, num_pages=12, rng=np.random.default_rng(2))
    pages = jnp.full((num_pages, page, 2, 4), jnp.nan, jnp.float32)
    width = table.shape[1] * page
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (3, width))
    values = _values(3, width)
    pages = write_pages(pages, jnp.asarray(table), positions, values)
    view = np.asarray(gather_pages(pages, jnp.asarray(table)))
    for b, n in enumerate(needs):
        owned = -(-n // page) * page
        np.testing.assert_array_equal(view[b, :owned], np.asarray(values)[b, :owned])
    # pages nobody owns were never written
    owned_pages = {int(p) for b, n in enumerate(needs) for p in table[b, :-(-n // page)]}
    for p in set(range(num_pages)) - owned_pages:
        assert bool(jnp.isnan(pages[p]).all())


def test_write_pages_drops_out_of_range_positions():
    page = 4
    table, num_pages = allocate_pages([8, 4], page, num_pages=5, rng=np.random.default_rng(3))
    # row 1 owns one page: its second table entry is the sentinel num_pages
    assert table[1, 1] == num_pages
    pages = jnp.zeros((num_pages, page, 2, 4), jnp.float32)
    positions = jnp.asarray([[-1, 3, 8, 100], [2, 4, 7, -5]], jnp.int32)
    values = jnp.ones((2, 4, 2, 4), jnp.float32) * jnp.arange(1, 9, dtype=jnp.float32).reshape(2, 4, 1, 1)
    out = np.asarray(write_pages(pages, jnp.asarray(table), positions, values))
    written = np.argwhere(out[..., 0, 0] != 0)
    # only row 0 position 3 (value 2) and row 1 position 2 (value 5) land anywhere
    assert sorted(map(tuple, written.tolist())) == sorted([(table[0, 0], 3), (table[1, 0], 2)])
    assert out[table[0, 0], 3, 0, 0] == 2 and out[table[1, 0], 2, 0, 0] == 5
