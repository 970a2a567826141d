"""Sampling: the temperature/top-k/top-p transform against the z-lab reference, the rejection
sampler on hand-made distributions, and exactness in distribution of speculative sampling.

Exactness: a tiny target (vocabulary 16) and a tiny draft that disagrees with it; thousands of
copies of one prompt run as one batch (each row its own random stream), and the joint
distribution of the first three generated tokens plus the marginal of the fourth must match the
target's exact sampling distribution (enumerated with transformers + the reference transform)
under a chi-square test. Negative controls (accept every draft; sample at another temperature)
must be rejected, so the test has power. The same holds for the serving engine's adaptive
verification (a step verifies a prefix of the block), and under a grammar (structured output)
against the target's distribution with the forbidden tokens' logits at -inf.
"""

from __future__ import annotations

import contextlib
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats

from builders import as_dflash2, make_target, make_zlab_draft, save_draft, save_target
from dflash_jax.runtime.generation import generate
from dflash_jax.loading.models import load_draft, load_target
from dflash_jax.runtime.sampling import (SamplingConfig, SamplingRows, accept_greedy, accept_sampling, choose, sample_probs,
                                 sampling_probs, split_keys)


def _reference_probs(logits: np.ndarray, temperature, top_p, top_k) -> np.ndarray:
    import dflash.model as dm

    return dm._sampling_probs(torch.from_numpy(logits), temperature, top_p, top_k).numpy()


# ---------------------------------------------------------------------------------------------
# The transform


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_sampling_probs_matches_reference(temperature):
    vocab = 50
    logits = (3.0 * np.random.default_rng(int(temperature * 10)).standard_normal((4, 7, vocab))).astype(np.float32)
    for top_k, top_p in itertools.product([0, 1, 3, vocab - 1, vocab, vocab + 5], [1.0, 0.95, 0.5, 0.01]):
        config = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        ours = np.asarray(sampling_probs(jnp.asarray(logits), config))
        ref = _reference_probs(logits, temperature, top_p, top_k)
        np.testing.assert_allclose(ours, ref, atol=1e-6, rtol=1e-5, err_msg=f"top_k={top_k} top_p={top_p}")
        np.testing.assert_allclose(ours.sum(-1), 1.0, atol=1e-5)
        support = (ours > 0).sum(-1)
        if 0 < top_k < vocab:
            assert (support <= top_k).all()
        if top_p == 0.01:
            assert (support == 1).all()


def test_tiny_temperature_is_argmax_not_nan():
    # logits up to ~50 over a temperature of 1e-37: unshifted, 50 / 1e-37 overflows to inf and
    # the softmax reads inf - inf
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((3, 11)) * 20, jnp.float32)
    for temperature in (1e-30, 1e-37):
        probs = np.asarray(sampling_probs(logits, SamplingConfig(temperature=temperature).as_arrays()))
        assert np.isfinite(probs).all()
        np.testing.assert_array_equal(probs, np.eye(11)[np.argmax(np.asarray(logits), -1)])


def test_sampling_config_validation_and_greedy():
    for bad in (dict(temperature=-0.1), dict(temperature=float("nan")), dict(temperature=float("inf")),
                dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                # outside float32's normal range: 0 or its inverse 0 in float32, NaN probabilities
                dict(temperature=1e-40), dict(temperature=1e38), dict(top_p=1e-40)):
        with pytest.raises(ValueError):
            SamplingConfig(**bad)
    logits = jnp.asarray([[1.0, 3.0, 2.0, -jnp.inf]])  # -inf: a reduced-vocabulary draft's
    for edge in (dict(temperature=1.2e-38), dict(temperature=8e37), dict(temperature=1.0, top_p=1.2e-38)):
        assert np.isfinite(np.asarray(sampling_probs(logits, SamplingConfig(**edge).as_arrays()))).all()
    assert SamplingConfig().greedy and not SamplingConfig(temperature=0.5).greedy
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5, 11)), jnp.float32)
    picked = choose(jax.random.key(0), logits, SamplingConfig())
    assert (np.asarray(picked) == np.argmax(np.asarray(logits), -1)).all()


# ---------------------------------------------------------------------------------------------
# Acceptance rules on hand-made distributions


def test_accept_greedy_prefix_and_bonus():
    vocab = 6
    posterior = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [5, 0, 0, 0], [1, 2, 3, 4]])   # argmax per position
    logits = jax.nn.one_hot(jnp.asarray(posterior), vocab) * 3.0
    drafts = jnp.asarray([[1, 2, 0], [1, 2, 3], [4, 0, 0], [1, 2, 3]])
    block_lens = jnp.asarray([4, 4, 4, 3])   # the last row may only use 2 drafts
    accepted, bonus = accept_greedy(drafts, logits, block_lens)
    assert np.asarray(accepted).tolist() == [2, 3, 0, 2]
    assert np.asarray(bonus).tolist() == [3, 4, 5, 3]
    # exact ties break to the first maximum, as the draft's and plain decoding's greedy choice do:
    # a verify that broke them otherwise would make speculative output differ from plain output
    tied = jnp.asarray([[[0.0, 5.0, 5.0], [5.0, 5.0, 0.0]]])
    plain = np.asarray(choose(jax.random.key(0), tied, SamplingConfig())).tolist()
    accepted, bonus = accept_greedy(jnp.asarray([[plain[0][0]]]), tied, jnp.asarray([2]))
    assert plain == [[1, 0]] and (int(accepted[0]), int(bonus[0])) == (1, 0)


def _gof(observed, probs) -> float:
    """Chi-square p-value of counts against probabilities (renormalized in float64)."""
    observed = np.asarray(observed, np.float64)
    probs = np.asarray(probs, np.float64)
    return float(stats.chisquare(observed, probs / probs.sum() * observed.sum()).pvalue)


def _run_accept(p, q, drafts, block_lens, trials=4000, seed=0):
    keys = jax.random.split(jax.random.key(seed), trials)
    fn = jax.jit(jax.vmap(lambda k: accept_sampling(k, drafts, q, p, block_lens)))
    accepted, bonus = fn(keys)
    return np.asarray(accepted), np.asarray(bonus)


def test_accept_sampling_equal_distributions_always_accept():
    vocab, block = 8, 4
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(vocab), size=(3, block)).astype(np.float32)
    q = p[:, :-1]
    drafts = jnp.asarray(np.stack([[rng.choice(vocab, p=q[b, i] / q[b, i].sum()) for i in range(block - 1)]
                                   for b in range(3)]))
    block_lens = jnp.asarray([4, 3, 2])
    accepted, bonus = _run_accept(jnp.asarray(p), jnp.asarray(q), drafts, block_lens)
    assert (accepted == np.array([3, 2, 1])[None]).all()
    # bonus drawn from p at position block_len - 1
    for b, pos in enumerate([3, 2, 1]):
        observed = np.bincount(bonus[:, b], minlength=vocab)
        assert _gof(observed, p[b, pos]) > 1e-3


def test_accept_sampling_bonus_after_a_shortened_block():
    """A block cut to 2 slots (block_lens) whose one draft is accepted: the bonus is drawn from
    the target's distribution at the next slot (p[1]: tokens 2 and 3, half each), not from a
    residual at a slot past the block (q and p differ there)."""
    q = np.zeros((1, 2, 4), np.float32)
    q[0, 0, 0] = q[0, 1, 2] = 1.0
    p = np.zeros((1, 3, 4), np.float32)
    p[0, 0, 0] = 1.0
    p[0, 1, 2:] = 0.5
    p[0, 2, 1] = 1.0
    keys = jax.random.split(jax.random.key(0), 4000)
    accepted, bonus = jax.vmap(lambda key: accept_sampling(key, jnp.asarray([[0, 2]]), jnp.asarray(q), jnp.asarray(p),
                                                           jnp.asarray([2])))(keys)
    assert (np.asarray(accepted) == 1).all()
    assert set(np.asarray(bonus).ravel().tolist()) == {2, 3}
    assert stats.binomtest(int((np.asarray(bonus) == 2).sum()), 4000, 0.5).pvalue > 1e-3


def test_accept_sampling_disjoint_support_samples_residual():
    vocab = 6
    q = np.zeros((1, 2, vocab), np.float32)
    q[..., 0], q[..., 1] = 0.7, 0.3
    p = np.zeros((1, 3, vocab), np.float32)
    p[0, :, 2], p[0, :, 3], p[0, :, 4] = 0.5, 0.3, 0.2
    accepted, bonus = _run_accept(jnp.asarray(p), jnp.asarray(q), jnp.asarray([[0, 1]]), jnp.asarray([3]))
    assert (accepted == 0).all()
    assert set(np.unique(bonus)) <= {2, 3, 4}
    observed = np.bincount(bonus[:, 0], minlength=vocab)[2:5]
    assert _gof(observed, [0.5, 0.3, 0.2]) > 1e-3


def test_accept_sampling_partial_overlap_is_exact():
    """p = [.5, .5], q = [1, 0], draft 0: accept w.p. .5, else the residual gives token 1 -> the
    first emitted token is distributed as p, and the second (after an acceptance) as p[1]."""
    vocab = 4
    q = np.zeros((1, 1, vocab), np.float32)
    q[0, 0, 0] = 1.0
    p = np.zeros((1, 2, vocab), np.float32)
    p[0, 0, :2] = 0.5
    p[0, 1, 2:] = [0.25, 0.75]
    accepted, bonus = _run_accept(jnp.asarray(p), jnp.asarray(q), jnp.asarray([[0]]), jnp.asarray([2]))
    rate = accepted.mean()
    assert abs(rate - 0.5) < 4 * np.sqrt(0.25 / len(accepted))
    assert (bonus[accepted[:, 0] == 0, 0] == 1).all()           # rejected: residual is token 1 only
    after = bonus[accepted[:, 0] == 1, 0]                         # accepted: bonus from p[1]
    assert set(np.unique(after)) <= {2, 3}
    assert _gof(np.bincount(after, minlength=vocab)[2:], [0.25, 0.75]) > 1e-3


def test_accept_sampling_residual_at_a_later_rejection():
    """Three drafts, the first always accepted: a rejection at draft 1 or 2 samples the residual
    of that position's p and q (one token each time here), and full acceptance the bonus from p."""
    vocab = 4
    q = np.zeros((1, 3, vocab), np.float32)
    q[0, 0, 0], q[0, 1, 1], q[0, 2, 3] = 1.0, 1.0, 1.0
    p = np.zeros((1, 4, vocab), np.float32)
    p[0, 0, 0] = 1.0
    p[0, 1, 1:3] = [0.5, 0.5]            # accept draft 1 w.p. .5, else the residual is token 2
    p[0, 2, [0, 3]] = [0.25, 0.75]       # accept draft 2 w.p. .75, else the residual is token 0
    p[0, 3, 2:] = [0.4, 0.6]             # the bonus after all three
    accepted, bonus = _run_accept(jnp.asarray(p), jnp.asarray(q), jnp.asarray([[0, 1, 3]]), jnp.asarray([4]),
                                  trials=8000)
    accepted, bonus = accepted[:, 0], bonus[:, 0]
    assert _gof(np.bincount(accepted, minlength=4)[1:], [0.5, 0.125, 0.375]) > 1e-3 and (accepted >= 1).all()
    assert (bonus[accepted == 1] == 2).all() and (bonus[accepted == 2] == 0).all()
    assert _gof(np.bincount(bonus[accepted == 3], minlength=vocab)[2:], [0.4, 0.6]) > 1e-3


def test_sample_probs_never_picks_zero_probability():
    probs = jnp.asarray([[0.0, 0.2, 0.0, 0.8]] * 4096, jnp.float32)
    picked = np.asarray(sample_probs(jax.random.key(3), probs))
    assert set(np.unique(picked)) == {1, 3}


# ---------------------------------------------------------------------------------------------
# Exactness in distribution of speculative sampling

VOCAB = 16
PROMPT = [2, 7, 1, 8, 2]
NEW = 4                    # t1 from prefill, t2..t4 from the speculative steps (block 4)
SAMPLES = 8192


TINY = dict(target_seed=5, draft_seed=4, prior=2.0, context=0.2)   # first draft accepted ~35-60%


def tiny_models(target_seed, draft_seed, prior, context, **family):
    """Tiny target (V 16, 2 layers; ``family`` picks another than Qwen3) and 1-layer block-4
    draft. Target and draft share a "unigram prior" (a constant hidden dim that only the LM
    head's column ``prior`` reads) on top of context-dependent logits scaled by ``context``, so
    drafts are accepted part of the time: both the accept path and the residual path carry
    weight in the tested distribution."""
    hf_target = make_target(seed=target_seed, std=0.35, embed_std=1.0, vocab=VOCAB, hidden=32, layers=2, heads=4,
                            kv_heads=2, head_dim=8, rope_theta=1e4, **family)
    hf_draft = make_zlab_draft(hf_target, layers=1, block_size=4, mask_token_id=VOCAB - 1, target_layer_ids=(0, 1),
                               heads=4, kv_heads=2, head_dim=8, seed=draft_seed, std=0.35)
    with torch.no_grad():
        hf_target.model.embed_tokens.weight[:, 0] = 2.0
        for layer in hf_target.model.layers:
            mixer = layer.self_attn.o_proj if hasattr(layer, "self_attn") else layer.linear_attn.out_proj
            mixer.weight[0].zero_()
            if hasattr(layer.mlp, "experts"):   # every expert's output row 0
                layer.mlp.experts.down_proj[:, 0].zero_()
            else:
                layer.mlp.down_proj.weight[0].zero_()
        head = hf_target.lm_head.weight
        head[:, 1:] *= context
        head[:, 0] = torch.tensor(prior * np.random.default_rng(target_seed + 2).standard_normal(VOCAB),
                                  dtype=torch.float32)
    return hf_target, hf_draft


def target_logits_after(hf_target, prompt):
    """Target logits [V^(NEW-1), NEW, V] for the prompt followed by every prefix of NEW-1 tokens."""
    prefixes = np.array(list(itertools.product(range(VOCAB), repeat=NEW - 1)))
    ids = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1)
    with torch.no_grad():
        logits = hf_target(torch.from_numpy(ids)).logits[:, len(prompt) - 1:].numpy()
    return prefixes, logits


def _tiny_fixture(root, dflash2: bool = False, **family):
    hf_target, hf_draft = tiny_models(**TINY, **family)
    if dflash2:
        hf_draft = as_dflash2(hf_draft, group_size=8, rank=4, top_k=5, selector_std=0.5)
    target = load_target(save_target(hf_target, root / "target"), "float32")
    draft = load_draft(save_draft(hf_draft, root / "draft"), target, "float32")
    prefixes, logits = target_logits_after(hf_target, PROMPT)
    return target, draft, prefixes, logits, hf_target, hf_draft


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny_fixture(tmp_path_factory.mktemp("tiny_sampling"))


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """The same on a Qwen3-MoE target: 4 experts, top 2, every layer."""
    return _tiny_fixture(tmp_path_factory.mktemp("tiny_moe_sampling"), family="qwen3_moe", experts=4, top_k=2,
                         expert_width=16)


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory):
    """The same on a Qwen3.5 hybrid target: a Gated DeltaNet layer, then gated attention."""
    return _tiny_fixture(tmp_path_factory.mktemp("tiny_hybrid_sampling"), family="qwen3_5",
                         layer_types=("linear_attention", "full_attention"))


@pytest.fixture(scope="module")
def tiny_dflash2(tmp_path_factory):
    """The same pair, its draft DFlash2: q is the selector's tempered k-way distribution."""
    return _tiny_fixture(tmp_path_factory.mktemp("tiny_dflash2_sampling"), dflash2=True)


def _exact(logits, prefixes, temperature, top_p, top_k):
    """Exact joint P(t1, t2, t3) [V, V, V] and marginal P(t4) [V] of target sampling."""
    probs = _reference_probs(logits, temperature, top_p, top_k)                         # [V^3, NEW, V]
    index = prefixes
    joint3 = probs[0, 0][index[:, 0]] * probs[:, 1][np.arange(len(index)), index[:, 1]] \
        * probs[:, 2][np.arange(len(index)), index[:, 2]]                              # P(t1, t2, t3)
    t4 = (joint3[:, None] * probs[:, 3]).sum(0)
    # validity: in every reachable context the top-p cut is not within float noise of the
    # threshold (else our logits, ~1e-6 off HF's, could legitimately keep a different token set)
    if top_p < 1.0:
        ordered = -np.sort(-_reference_probs(logits, temperature, 1.0, top_k), axis=-1)
        margin = np.abs(np.cumsum(ordered, -1) - ordered - top_p).min(-1)             # [V^3, NEW]
        rows = np.arange(len(index))
        reach = [np.ones(len(index), bool),                                             # t1: one context
                 probs[0, 0][index[:, 0]] > 0,
                 probs[0, 0][index[:, 0]] * probs[:, 1][rows, index[:, 1]] > 0,
                 joint3 > 0]
        for position in range(NEW):
            assert margin[reach[position], position].min() > 1e-5, f"position {position}"
    return joint3.reshape(VOCAB, VOCAB, VOCAB), t4


def _first_draft_acceptance(tiny, config) -> float:
    """Exact probability that the first step accepts its first draft token: the mean over t1 of
    sum_x min(p(x), q(x)), with q from the reference draft module and the reference transform."""
    import dflash.model as dm

    _, _, prefixes, logits, hf_target, hf_draft = tiny
    args = (config.temperature, config.top_p, config.top_k)
    probs = _reference_probs(logits, *args)
    with torch.no_grad():
        states = hf_target(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
        context = dm.extract_context_feature(states, hf_draft.target_layer_ids)
        total = 0.0
        for t1 in np.flatnonzero(probs[0, 0] > 0):
            block = torch.tensor([[t1] + [hf_draft.mask_token_id] * (hf_draft.block_size - 1)])
            hidden = hf_draft(target_hidden=context, noise_embedding=dm._raw_input_embeddings(hf_target, block),
                              position_ids=torch.arange(len(PROMPT) + block.shape[1])[None])
            q = _reference_probs(hf_draft.compute_logits(hidden[:, 1:2], dm._output_head(hf_target)).numpy(), *args)
            p = probs[np.flatnonzero(prefixes[:, 0] == t1)[0], 1]
            total += probs[0, 0, t1] * np.minimum(p, q[0, 0]).sum()
    return float(total)


def _chi2_pvalue(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """Chi-square goodness of fit; cells expected < 5 pooled into one. Samples in impossible
    cells fail outright (an exact sampler never produces them)."""
    observed = observed.ravel().astype(np.float64)
    expected_probs = expected_probs.ravel().astype(np.float64)
    impossible = expected_probs <= 1e-12
    assert observed[impossible].sum() == 0, "sampled a token sequence of probability 0"
    expected = expected_probs / expected_probs.sum() * observed.sum()
    big = (expected >= 5) & ~impossible
    small = ~big & ~impossible
    obs = np.append(observed[big], observed[small].sum())
    exp = np.append(expected[big], expected[small].sum())
    if exp[-1] < 5:   # too little mass to keep the pooled cell on its own
        obs, exp = obs[:-1], exp[:-1]
        exp = exp * obs.sum() / exp.sum()
    return float(stats.chisquare(obs, exp).pvalue)


SLOTS = 2048   # the rows one prefill step takes (generation.PREFILL_TOKENS): every decode chunk runs full


def _sample(tiny, sampling, *, draft=True, seed=0, accept_replay=None, block_size=None):
    target, draft_model = tiny[:2]
    out = generate(target, [PROMPT] * SAMPLES, draft=draft_model if draft else None, max_new_tokens=NEW,
                   sampling=sampling, seed=seed, impl="reference", accept_replay=accept_replay,
                   block_size=block_size, max_num_seqs=SLOTS)
    tokens = np.array(out.tokens)
    assert tokens.shape == (SAMPLES, NEW)
    return tokens, out


# Each test below asserts four p-values (the joint of t1..t3, whose sparse cells are pooled, and
# the t2, t3 and t4 marginals, which keep the power the pooling loses) at this level: about 0.3%
# over all of them that some seed change fails one by chance.
P_MIN = 1e-4


def _pvalues(tokens, joint3, t4) -> dict[str, float]:
    counts3 = np.zeros((VOCAB,) * 3, np.int64)
    np.add.at(counts3, (tokens[:, 0], tokens[:, 1], tokens[:, 2]), 1)
    return {"joint t1..t3": _chi2_pvalue(counts3, joint3),
            "t2": _chi2_pvalue(np.bincount(tokens[:, 1], minlength=VOCAB), joint3.sum(axis=(0, 2))),
            "t3": _chi2_pvalue(np.bincount(tokens[:, 2], minlength=VOCAB), joint3.sum(axis=(0, 1))),
            "t4": _chi2_pvalue(np.bincount(tokens[:, 3], minlength=VOCAB), t4)}


def _assert_exact(pvalues: dict[str, float], what: str) -> None:
    assert min(pvalues.values()) > P_MIN, f"{what}: " + ", ".join(f"{k} p={v:.3g}" for k, v in pvalues.items())


SAMPLING_CASES = {
    "t1.0": SamplingConfig(temperature=1.0),
    "t0.7": SamplingConfig(temperature=0.7),
    "top_k3": SamplingConfig(temperature=1.0, top_k=3),
    "top_p0.8": SamplingConfig(temperature=1.0, top_p=0.8),
    "t0.8-top_k5-top_p0.9": SamplingConfig(temperature=0.8, top_k=5, top_p=0.9),
}


@pytest.mark.parametrize("name", list(SAMPLING_CASES))
def test_speculative_sampling_is_exact_in_distribution(tiny, name):
    config = SAMPLING_CASES[name]
    joint3, t4 = _exact(tiny[3], tiny[2], config.temperature, config.top_p, config.top_k)
    tokens, out = _sample(tiny, config, seed=11)
    # rows share a prompt and one seed but not their random streams
    assert len({tuple(row) for row in tokens}) > 50
    # the draft is exercised: some steps accept drafts, some reject (residual sampling) ...
    first_step = np.array([seq[0] for seq in out.stats.accept_lengths])
    rate = (first_step >= 2).mean()
    assert 0.2 < rate < 0.8
    # ... and exactly as often as the reference draft (same q, same transform) accepts its first token
    expected = _first_draft_acceptance(tiny, config)
    assert abs(rate - expected) < 4.5 * np.sqrt(expected * (1 - expected) / len(first_step)), (rate, expected)
    _assert_exact(_pvalues(tokens, joint3, t4), name)


def test_speculative_sampling_at_block_2_is_exact_in_distribution(tiny):
    """Block 2: a step that accepts its one draft emits the bonus from p (at block 4 with NEW = 4
    that bonus is always cut by max_new_tokens)."""
    config = SAMPLING_CASES["t1.0"]
    joint3, t4 = _exact(tiny[3], tiny[2], config.temperature, config.top_p, config.top_k)
    tokens, out = _sample(tiny, config, seed=15, block_size=2)
    assert np.mean([length == 2 for seq in out.stats.accept_lengths for length in seq]) > 0.2
    _assert_exact(_pvalues(tokens, joint3, t4), "block 2")


@pytest.mark.parametrize("name", ["t1.0", "t0.8-top_k5-top_p0.9"])
def test_speculative_sampling_on_a_moe_target_is_exact_in_distribution(tiny_moe, name):
    config = SAMPLING_CASES[name]
    assert tiny_moe[0].config.family == "qwen3_moe"
    joint3, t4 = _exact(tiny_moe[3], tiny_moe[2], config.temperature, config.top_p, config.top_k)
    tokens, out = _sample(tiny_moe, config, seed=21)
    first_step = np.array([seq[0] for seq in out.stats.accept_lengths])
    assert 0.1 < (first_step >= 2).mean() < 0.9
    _assert_exact(_pvalues(tokens, joint3, t4), f"MoE {name}")


@pytest.mark.parametrize("name", ["t1.0", "t0.8-top_k5-top_p0.9"])
def test_dflash2_sampling_is_exact_in_distribution(tiny_dflash2, name):
    """DFlash2 drafts sample their path from the selector (q over 5 candidates, temperature
    only); rejection against the target's p keeps the output exactly the target's."""
    config = SAMPLING_CASES[name]
    assert tiny_dflash2[1].config.selector is not None
    joint3, t4 = _exact(tiny_dflash2[3], tiny_dflash2[2], config.temperature, config.top_p, config.top_k)
    tokens, out = _sample(tiny_dflash2, config, seed=25)
    first_step = np.array([seq[0] for seq in out.stats.accept_lengths])
    assert 0.1 < (first_step >= 2).mean() < 0.9
    _assert_exact(_pvalues(tokens, joint3, t4), f"DFlash2 {name}")


def test_speculative_sampling_on_a_hybrid_target_is_exact_in_distribution(tiny_hybrid):
    """Rejected drafts roll the recurrent state back: a wrong rollback skews t3 and t4."""
    config = SAMPLING_CASES["t1.0"]
    assert tiny_hybrid[0].config.recurrent_layers == (0,)
    joint3, t4 = _exact(tiny_hybrid[3], tiny_hybrid[2], config.temperature, config.top_p, config.top_k)
    tokens, out = _sample(tiny_hybrid, config, seed=23)
    first_step = np.array([seq[0] for seq in out.stats.accept_lengths])
    assert 0.1 < (first_step >= 2).mean() < 0.9
    _assert_exact(_pvalues(tokens, joint3, t4), "hybrid t1.0")


def test_plain_sampling_is_exact_in_distribution(tiny):
    config = SamplingConfig(temperature=1.0)
    joint3, t4 = _exact(tiny[3], tiny[2], 1.0, 1.0, 0)
    tokens, _ = _sample(tiny, config, draft=False, seed=12)
    _assert_exact(_pvalues(tokens, joint3, t4), "plain sampling")


def test_negative_controls_are_rejected(tiny):
    """The same test must reject a sampler that is not exact: one that accepts every draft token
    (so t2..t4 follow the draft), and one sampling at temperature 0.7 judged against 1.0."""
    joint3, t4 = _exact(tiny[3], tiny[2], 1.0, 1.0, 0)
    wrong_rule, _ = _sample(tiny, SamplingConfig(temperature=1.0), seed=13, accept_replay=1.0)
    pvalues = _pvalues(wrong_rule, joint3, t4)
    assert min(pvalues.values()) < 1e-6, f"accept-all not rejected: {pvalues}"
    wrong_temperature, _ = _sample(tiny, SAMPLING_CASES["t0.7"], seed=14)
    pvalues = _pvalues(wrong_temperature, joint3, t4)
    assert pvalues["joint t1..t3"] < 1e-6, f"temperature 0.7 vs 1.0 not rejected: {pvalues}"


def test_another_temperature_or_top_p_compiles_nothing(random_pair, compilations):
    """Temperature and top-p are run-time values of the compiled prefill and loop; greedy vs
    sampling, top-k and top-p on or off are what compile. (One prompt: with several, how many
    rows a chunk runs follows when each finishes, and each row count is a program of its own.)"""
    prompts = [[1, 2, 3, 4, 5, 6]]

    def run(**sampling):
        return generate(random_pair.target, prompts, draft=random_pair.draft, max_new_tokens=12,
                        sampling=SamplingConfig(**sampling), impl="reference").tokens
    first = run(temperature=0.7, top_p=0.9)
    with compilations() as compiled:
        second = run(temperature=1.3, top_p=0.5)
    assert compiled == [] and second != first
    with compilations() as compiled:
        run(temperature=0.7)  # top-p off: another program
    assert compiled


def test_sampling_config_derives_its_static_part():
    config = SamplingConfig(temperature=0.7, top_p=0.9, top_k=5)
    assert (config.greedy, config.nucleus) == (False, True)
    leaves, treedef = jax.tree.flatten(config.as_arrays())
    assert [x.dtype for x in leaves] == [jnp.float32, jnp.float32, jnp.int32, jnp.float32]
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert (rebuilt.top_k_cap, rebuilt.nucleus, rebuilt.sort_all, rebuilt.greedy) == (5, True, False, False)
    with pytest.raises(ValueError, match="greedy=True contradicts temperature=0.7"):
        SamplingConfig(temperature=0.7, greedy=True)
    with pytest.raises(TypeError, match="give temperature and top_p as numbers"):
        SamplingConfig(temperature=jnp.float32(0.7))


def test_rows_of_a_batch_sample_as_each_alone():
    """Per-row settings (greedy, temperature, top-k, top-p, min-p mixed in one batch) give each
    row the probabilities its own settings give alone; a greedy row is one-hot at its argmax."""
    configs = [SamplingConfig(), SamplingConfig(temperature=0.7), SamplingConfig(temperature=1.0, top_k=3),
               SamplingConfig(temperature=1.2, top_p=0.6), SamplingConfig(temperature=0.9, top_k=5, top_p=0.8),
               SamplingConfig(temperature=1.0, min_p=0.3), SamplingConfig(temperature=1.0, top_k=4, min_p=0.2)]
    logits = jax.random.normal(jax.random.key(11), (len(configs), 3, 40)) * 3
    rows = SamplingRows.stack(configs, top_k_cap=8)
    together = np.asarray(jax.jit(sampling_probs)(logits, rows))
    for i, config in enumerate(configs):
        alone = np.asarray(sampling_probs(logits[i], config)) if not config.greedy else \
            np.asarray(jax.nn.one_hot(jnp.argmax(logits[i], -1), 40))
        np.testing.assert_allclose(together[i], alone, atol=1e-6, err_msg=str(config))
    # min-p keeps exactly the tokens at least min_p times as likely as the best
    plain = np.asarray(sampling_probs(logits[5], SamplingConfig(temperature=1.0)))
    kept = plain >= 0.3 * plain.max(-1, keepdims=True)
    np.testing.assert_array_equal(together[5] > 0, kept)
    np.testing.assert_allclose(together[5], np.where(kept, plain, 0) / np.where(kept, plain, 0).sum(-1, keepdims=True),
                               atol=1e-6)
    with pytest.raises(ValueError, match="min_p must be in"):
        SamplingConfig(temperature=1.0, min_p=1.5)


def test_row_keys_draw_each_row_from_its_own_stream():
    """A batch with a key per row draws row i exactly as row i's key alone would."""
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(5), (4, 2, 30)), -1)
    keys = jax.random.split(jax.random.key(9), 4)
    together = np.asarray(sample_probs(keys, probs))
    for i in range(4):
        np.testing.assert_array_equal(together[i], np.asarray(sample_probs(keys[i], probs[i])))
    first, second = split_keys(keys, 2)
    assert first.shape == second.shape == (4,)
    assert not np.array_equal(jax.random.key_data(first), jax.random.key_data(second))


def test_engine_requests_with_their_own_settings_sample_exactly(tiny):
    """The serving engine, sampled requests (each its own seed) sharing batches with greedy ones:
    the sampled tokens are exact in distribution, the greedy requests give greedy tokens."""
    from dflash_jax.runtime.engine import Engine, RequestParams

    config = SAMPLING_CASES["t0.8-top_k5-top_p0.9"]
    joint3, t4 = _exact(tiny[3], tiny[2], config.temperature, config.top_p, config.top_k)
    target, draft = tiny[:2]
    engine = Engine(target, draft, max_num_seqs=512, max_model_len=16, page_size=4, prefill_rows=512, chunk_steps=2,
                    impl="reference", stop_token_ids=[], max_waiting=SAMPLES * 2)
    sampled, greedy = [], []
    for i in range(SAMPLES):
        sampled.append(engine.submit(PROMPT, RequestParams(max_tokens=NEW, sampling=config, seed=i)))
        if i % 64 == 0:
            greedy.append(engine.submit(PROMPT, RequestParams(max_tokens=NEW)))
    engine.run_until_done()
    alone = generate(target, [PROMPT], draft=draft, max_new_tokens=NEW, impl="reference").tokens[0]
    assert all(r.token_ids == alone for r in greedy)
    tokens = np.array([r.token_ids for r in sampled])
    assert 0.2 < np.mean([r.accept_lengths[0] >= 2 for r in sampled]) < 0.8
    _assert_exact(_pvalues(tokens, joint3, t4), "engine, mixed rows")


# The engine's other paths: waves of ENGINE_SAMPLES requests on an engine of ``_sample``'s shapes
# (SLOTS slots: its slot programs are shared), under settings with few tokens per position, so
# that the joint of three tokens has enough samples per cell. Each test asserts its p-values
# above FALSE_FAILURE over their number: on seeds drawn at random, exact sampling would fail one
# with a probability below FALSE_FAILURE (union bound, within the chi-square approximation).
ENGINE_SAMPLES = 1024
FALSE_FAILURE = 1e-6


def _assert_exact_strictly(pvalues: dict[str, dict[str, float]]) -> None:
    """``pvalues``: ``_pvalues``'s for each run."""
    flat = {f"{run}: {name}": value for run, values in pvalues.items() for name, value in values.items()}
    assert min(flat.values()) > FALSE_FAILURE / len(flat), ", ".join(f"{k} p={v:.3g}" for k, v in flat.items())


def _batch_engine(tiny, config, **options):
    from dflash_jax.runtime.generation import batch_engine

    return batch_engine(tiny[0], tiny[1], [len(PROMPT)] * SLOTS, [NEW] * SLOTS, max_num_seqs=SLOTS, impl="reference",
                        stop_token_ids=[], top_k_cap=max(config.top_k, 1), **options)


def _engine_samples(engine, config, seed, *, grammar=None):
    """ENGINE_SAMPLES copies of the prompt through ``engine`` at once, seeded as ``generate``
    seeds them: tokens [ENGINE_SAMPLES, NEW] and the requests."""
    from dflash_jax.runtime.engine import RequestParams
    from dflash_jax.runtime.generation import run_requests

    params = [RequestParams(max_tokens=NEW, sampling=config, seed=seed, sample_index=i, grammar=grammar)
              for i in range(ENGINE_SAMPLES)]
    requests, _ = run_requests(engine, [PROMPT] * ENGINE_SAMPLES, params)
    assert all(r.finish_reason == "length" for r in requests)
    return np.array([r.token_ids for r in requests]), requests


def test_adaptive_verification_sampling_is_exact_in_distribution(tiny):
    """The adaptive policy (widths 2 and 4; step costs 1 and 1.25 set for every row bucket
    instead of measured). A first wave starts from the prior acceptance 0.75: each first step
    verifies the whole block (2.31 expected tokens at cost 1.25 against 1.75 at cost 1), each
    later one, with 2 tokens left at most, the 2-wide prefix (as many expected tokens, cheaper).
    A second wave starts from the acceptance the first measured (under 0.4): every step narrow.
    Verifying a prefix keeps sampling exact: both waves' tokens follow the target's distribution.
    Top-k 3: a step verified against another position's probabilities would emit tokens out of
    the support."""
    config = SAMPLING_CASES["top_k3"]
    joint3, t4 = _exact(tiny[3], tiny[2], config.temperature, config.top_p, config.top_k)
    with contextlib.closing(_batch_engine(tiny, config, speculative_policy="adaptive")) as engine:
        assert engine.config.widths == (2, 4)
        engine.device.step_costs = {rows: np.asarray([1.0, 1.25]) for rows in engine.device.row_buckets}
        stats, n = engine.stats, ENGINE_SAMPLES
        wide_first, requests = _engine_samples(engine, config, seed=31)
        assert stats.verified_per_position[1:] == [n, n]            # drafts 2 and 3: each first step's
        assert np.mean([len(r.accept_lengths) > 1 for r in requests]) > 0.5
        narrow, _ = _engine_samples(engine, config, seed=32)
    assert stats.verified_per_position[1:] == [n, n]                # no wide step in the second wave
    assert stats.num_draft_tokens == 3 * n + stats.num_drafts - n   # every other step verified 1 draft
    _assert_exact_strictly({"wide first": _pvalues(wide_first, joint3, t4), "narrow": _pvalues(narrow, joint3, t4)})


# Structured output on the tiny vocabulary: ids 0..14 the letters a..o, 15 the end of text. The
# grammar allows a..j first, then letters alternating between odd and even ids, at least five
# (the end is never allowed here): 6 to 9 of the 16 tokens forbidden at each position, which ones
# depending on the token before (a mask one position off allows the forbidden half).
LETTERS = "abcdefghijklmno"
GRAMMAR = "[acegi](?:[bdfhjln][acegikmo]){2}[a-o]*|[bdfhj](?:[acegikmo][bdfhjln]){2}[a-o]*"


def _grammar_masks(prefixes) -> np.ndarray:
    """GRAMMAR's allowed tokens [V^(NEW-1), NEW, V] at each position after each prefix
    (``target_logits_after``'s rows)."""
    ids = np.arange(VOCAB)
    masks = np.empty((len(prefixes), NEW, VOCAB), bool)
    masks[:, 0] = ids < 10
    masks[:, 1:] = (ids < 15) & (ids % 2 != prefixes[..., None] % 2)
    return masks


@pytest.fixture(scope="module")
def letters_tokenizer(tmp_path_factory):
    """A tokenizer of the tiny vocabulary: a..o, then <eos> (the stop token)."""
    import json

    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    from dflash_jax.loading.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("letters_tokenizer")
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(LETTERS)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    tokenizer = Tokenizer(folder)
    assert tokenizer.encode(LETTERS) == list(range(15)) and tokenizer.stop_token_ids == [15]
    return tokenizer


def test_sampling_under_a_grammar_is_exact_in_distribution(tiny, letters_tokenizer):
    """Structured output with a draft: each block walked through the request's matcher, verified
    under the per-position masks and ended after the first draft token the grammar rejects (that
    one still tested, so a rejection samples the residual). The tokens follow the target's
    distribution with the forbidden tokens' logits at -inf, each position's mask after the
    tokens before it (plain decoding's under the grammar), through top-k and top-p after the
    mask; the mass the unmasked target puts on forbidden tokens is large, so a mask missed,
    misplaced or a residual skipped shows."""
    from dflash_jax.runtime.grammar import grammar_from_request

    config = SAMPLING_CASES["t0.8-top_k5-top_p0.9"]
    prefixes, logits = tiny[2], tiny[3]
    masks = _grammar_masks(prefixes)
    joint3, t4 = _exact(np.where(masks, logits, -np.inf), prefixes, config.temperature, config.top_p, config.top_k)
    # the mass the unmasked target (same settings) puts on forbidden tokens at each position, in
    # expectation over the contexts the masked one reaches: 0.6 to 0.8
    forbidden = (_reference_probs(logits, config.temperature, config.top_p, config.top_k) * ~masks).sum(-1)
    assert ((joint3.reshape(-1, 1) * forbidden).sum(0) > 0.5).all()
    grammar = grammar_from_request(guided_regex=GRAMMAR)
    # batch-invariant: each grammar step runs every slot, one shape (compiled once) to the end
    with contextlib.closing(_batch_engine(tiny, config, tokenizer=letters_tokenizer, batch_invariant=True)) as engine:
        tokens, requests = _engine_samples(engine, config, seed=37, grammar=grammar)
    assert 0.1 < np.mean([r.accept_lengths[0] >= 2 for r in requests]) < 0.9
    _assert_exact_strictly({"grammar": _pvalues(tokens, joint3, t4)})
