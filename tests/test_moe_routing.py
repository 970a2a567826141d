"""Benchmarks' independent MoE routing (``MoESpec.routing``): each token's experts drawn apart from
every other token's, deterministic per router-input row, weights still the router's softmax; a
target routed so stays lossless under DFlash."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.model.config import ConfigError
from dflash_jax.model.nn import moe
from dflash_jax.model.nn.moe import IndependentRouting, MoESpec
from pallas_kernels import rms_norm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import expected_experts, inclusion_probabilities, with_routing  # noqa: E402

E, K, H = 16, 4, 32


def _spec(skew: float = 0.0, norm: bool = True) -> MoESpec:
    return MoESpec(num_experts=E, top_k=K, intermediate_size=8, norm_topk_prob=norm,
                   routing=IndependentRouting(skew))


def _rows(n: int, seed: int = 0, dtype=jnp.bfloat16) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (n, H), dtype)


def _router(dtype=jnp.bfloat16) -> jax.Array:
    # with BIAS, a router that sends every row to experts 0..K-1: the override must not follow it
    return jnp.zeros((H, E), dtype)


BIAS = jnp.zeros(E, jnp.bfloat16).at[:K].set(10.0)


def route(rows, router, spec, bias=None):
    """(experts, weights) of the MoE layer's routing of ``rows`` (an RMSNorm of unit weight first)."""
    return moe.route(rows, jnp.ones(rows.shape[1], rows.dtype), 1e-6, router, spec, bias)[1:]


def test_independent_routing_draws_distinct_experts_as_often_as_uniform_draws():
    """Groups of 8 random rows route to as many distinct experts as 8 independent uniform draws of
    top 4 of 16 (E(1-(1-k/E)^8) = 14.40) on average, though the router sends them all alike; each
    row's experts are distinct; the weights are the softmax at them, renormalised to 1."""
    groups, n = 600, 8
    experts, weights = jax.jit(lambda h: route(h, _router(), _spec(), BIAS))(_rows(groups * n))
    experts = np.asarray(experts)
    assert experts.shape == (groups * n, K) and experts.dtype == np.int32
    assert all(len(set(row)) == K for row in experts.tolist())
    distinct = [len(np.unique(g)) for g in experts.reshape(groups, n * K)]
    # the mean of 600 groups: its standard error is about 0.04 experts
    assert np.mean(distinct) == pytest.approx(expected_experts(E, K, n), abs=0.15)
    assert expected_experts(E, K, n) == pytest.approx(E * (1 - (1 - K / E) ** n))
    np.testing.assert_allclose(np.sum(np.asarray(weights, np.float32), axis=-1), 1.0, atol=1e-2)
    # unnormalised: the router's softmax at the chosen experts, as they are
    h = _rows(64, seed=3, dtype=jnp.float32)
    router = jax.random.normal(jax.random.key(4), (H, E))
    experts, weights = route(h, router, _spec(norm=False))
    probs = jax.nn.softmax(rms_norm(h, jnp.ones(H), 1e-6) @ router, axis=-1)
    np.testing.assert_allclose(weights, np.take_along_axis(np.asarray(probs), np.asarray(experts), -1), rtol=1e-6)


def test_independent_routing_is_a_function_of_the_row_bits():
    """Equal rows get equal experts wherever they stand in the batch; changing one element of a row
    redraws its experts; the model's router (routing None) is the plain top k."""
    rows = _rows(5)
    batch = jnp.concatenate([rows, rows[::-1], rows[2:3]])
    experts = np.asarray(route(batch, _router(), _spec(), BIAS)[0])
    np.testing.assert_array_equal(experts[:5], experts[5:10][::-1])
    np.testing.assert_array_equal(experts[10], experts[2])
    redrawn = 0
    for i in range(20):
        moved = rows.at[0, i].set(rows[0, i] + 1)
        again = np.asarray(route(moved, _router(), _spec(), BIAS)[0][0])
        redrawn += not np.array_equal(np.sort(again), np.sort(experts[0]))
    assert redrawn >= 17  # an unrelated draw equals it with probability 1 / C(16, 4)
    plain = dataclasses.replace(_spec(), routing=None)
    assert set(np.asarray(route(rows, _router(), plain, BIAS)[0]).ravel().tolist()) == set(range(K))


def test_skewed_routing_picks_popular_experts_more_often():
    """With skew, expert e is drawn in proportion to 1/(e+1)^skew: the lower ids are picked more
    often, in order, at the rates the benchmarks' Monte Carlo gives."""
    rows = 8000
    experts = np.asarray(jax.jit(lambda h: route(h, _router(), _spec(skew=1.0), BIAS)[0])(_rows(rows, seed=1)))
    counts = np.bincount(experts.ravel(), minlength=E)
    assert counts[0] > counts[1] > counts[3] > counts[7] > counts[15]
    np.testing.assert_allclose(counts / rows, inclusion_probabilities(E, K, 1.0), atol=0.025)
    # fewer distinct experts than uniform draws, as the report expects
    distinct = np.mean([len(np.unique(g)) for g in experts.reshape(-1, 8 * K)])
    assert distinct == pytest.approx(expected_experts(E, K, 8, 1.0), abs=0.15)
    assert expected_experts(E, K, 8, 1.0) < expected_experts(E, K, 8) - 0.5


def test_independent_routing_refuses_a_negative_skew():
    with pytest.raises(ConfigError, match="skew must be a finite number >= 0"):
        IndependentRouting(-1.0)


@pytest.mark.parametrize("family_pair", ["qwen3_moe"], indirect=True)
def test_dflash_on_an_independently_routed_moe_target_is_lossless(family_pair):
    """Greedy DFlash on the MoE copy pair's target, every layer's experts drawn independently per
    token (skew 1), equals that target's own greedy output; the routing is in force (the output
    differs from the model-routed target's)."""
    from dflash_jax.runtime.generation import generate

    pair = family_pair
    target = dataclasses.replace(pair.target, config=with_routing(pair.target.config, IndependentRouting(1.0)))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 127, n).tolist() for n in (7, 11)]
    plain = generate(target, prompts, max_new_tokens=24, impl="reference")
    ours = generate(target, prompts, draft=pair.draft, max_new_tokens=24, block_size=8, impl="reference")
    assert ours.tokens == plain.tokens
    assert max(n for seq in ours.stats.accept_lengths for n in seq) >= 3
    model_routed = generate(pair.target, prompts, max_new_tokens=24, impl="reference")
    assert model_routed.tokens != plain.tokens
