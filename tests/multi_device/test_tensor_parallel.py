"""Tensor parallelism on 4 CPU devices (tests/test_tensor_parallel.py runs this folder in a
subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4; the main suite has one).

Every family split over 2 and 4 devices gives the tokens of one device (f32) and its logits
within rounding, and its params, gathered back, equal the single-device load bit for bit;
a converted folder loads into any degree; DFlash keeps its tokens and acceptance lengths with
the draft split or replicated, on a hybrid too; sampling draws the samples of one device for the
same seed; the Pallas kernels run per shard (interpret mode); the CLI's --tp; and degrees that
cannot split are refused, naming the field, before any weight is read.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from scipy import stats

from builders import (as_dflash2, hybrid_config, make_copy_draft, make_copy_target, make_target, make_zlab_draft,
                      qwen3_moe_config, save_draft, save_mxfp4_gpt_oss, save_speculators_draft, save_target,
                      write_tokenizer)
from dflash_jax.entrypoints import generate as generate_cli
from dflash_jax.model import target as target_model
from dflash_jax.model.cache import allocate_pages, init_cache
from dflash_jax.runtime.generation import generate
from dflash_jax.loading.models import Draft, Target, load_draft, load_target, split_draft, split_target
from dflash_jax.model.collectives import gather_vocab, vocab_argmax
from dflash_jax.runtime.sampling import (SamplingConfig, SamplingRows, accept_sampling, sample_probs, sampling_probs,
                                 token_logprobs)
from dflash_jax.model.sharding import (TensorParallel, is_layout, local_config, make_mesh, specs, target_layout,
                                 unsharded)

if jax.device_count() < 4:   # run on its own (the main suite's conftest does not collect this folder)
    pytest.skip("needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4, as "
                "tests/test_tensor_parallel.py runs it", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
MAX_NEW = 12
PAGE = 16
# f32 logits of one device vs a split forward (the row-parallel sums add in another order: a few
# ulps of logits up to ~50)
LOGITS_TOLERANCE = dict(rtol=5e-6, atol=2e-5)


def _prompts(vocab: int, lens=(5, 9, 14), seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab - 1, n).tolist() for n in lens]


def _split(tp: int, replicate_draft: bool = False) -> TensorParallel:
    return TensorParallel(make_mesh(tp), replicate_draft=replicate_draft)


def prompt_logits(target: Target, prompts: list[list[int]]) -> np.ndarray:
    """Logits [B, T, V] of one forward over the right-padded prompts from an empty cache: on one
    device, or on a split target as one shard_map program (each device its slices and local
    config, the vocabulary gathered at the end)."""
    padded = max(map(len, prompts))
    tokens = np.zeros((len(prompts), padded), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = prompt
    table, num_pages = allocate_pages([padded] * len(prompts), PAGE)

    def run(params, tokens, *, config):
        cache = init_cache(config, None, table, num_pages, PAGE, jnp.float32)
        hidden, _, _ = target_model.forward(params, config, tokens, jnp.zeros(len(prompts), jnp.int32), cache,
                                            impl="reference")
        return gather_vocab(target_model.logits(params, hidden), config.tensor_axis)

    split = target.tensor_parallel
    if split is None:
        program = functools.partial(run, config=target.config)
    else:
        local = local_config(target.config, split.size, expert_parallel=split.expert_parallel)
        program = jax.shard_map(functools.partial(run, config=local), mesh=split.mesh, out_specs=P(), check_vma=False,
                                in_specs=(specs(target_layout(target.params, target.config, split.expert_parallel)),
                                          P()))
    return np.asarray(jax.jit(program)(target.params, jnp.asarray(tokens)))


def assert_each_device_holds_its_slices(params, layout, tp: int):
    """Every param split by its layout is on each device as one tp-th along the split axis (a
    replicated one whole): no device holds the whole model."""
    for x, leaf in zip(jax.tree.leaves(params), jax.tree.leaves(layout, is_leaf=is_layout), strict=True):
        shape = list(x.shape)
        if leaf.axis is not None:
            shape[leaf.axis] //= tp
        assert {shard.data.shape for shard in x.addressable_shards} == {tuple(shape)}, (leaf, x.shape)


def assert_same_params(actual, expected):
    """Same tree, every leaf the same shape and bits."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        assert x.shape == y.shape and np.array_equal(np.asarray(x), np.asarray(y)), jax.tree_util.keystr(path)


# ---------------------------------------------------------------------------------------------
# Every family at TP 2 and 4 vs one device

# Sizes every degree up to 4 divides: 4 KV heads (and 4 linear key heads), widths and vocabulary
# multiples of 4. LLaMA is tied (the head is the embedding, split by rows) and biased (o_proj's
# and down_proj's biases added once, after the sums).
ATTENTION = dict(vocab=128, hidden=64, heads=8, kv_heads=4, head_dim=16, rope_theta=1e4)
HYBRID = dict(ATTENTION, layers=3, layer_types=("linear_attention", "full_attention", "linear_attention"),
              linear_heads=(4, 8), linear_dims=(16, 16))
FAMILIES = {
    "qwen3": dict(ATTENTION, layers=2),
    "llama": dict(ATTENTION, family="llama", layers=2, tie=True, bias=True),
    # layer 0 dense, layer 1 routed (4 experts of width 16, top 2)
    "qwen3_moe": dict(ATTENTION, family="qwen3_moe", layers=2, experts=4, top_k=2, expert_width=16,
                      mlp_only_layers=(0,)),
    "qwen3_5": dict(HYBRID, family="qwen3_5"),
    # routed experts beside a gated shared expert of width 16 on every layer
    "qwen3_5_moe": dict(HYBRID, family="qwen3_5_moe", experts=4, top_k=2, expert_width=16, shared_width=16),
    # sinks split with their heads; router, expert and attention biases (the experts' output bias
    # added by one shard); windowed and full layers
    "gpt_oss": dict(vocab=128, hidden=64, heads=8, kv_heads=4, head_dim=16, family="gpt_oss", layers=2, experts=4,
                    top_k=2, expert_width=16, sliding_window=4),
}


@dataclass
class FamilyCase:
    name: str
    path: Path                 # the saved HF folder
    single: Target             # loaded on one device
    prompts: list[list[int]]
    tokens: list[list[int]]    # greedy on one device
    logits: np.ndarray         # prompt_logits on one device


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_case(request, tmp_path_factory) -> FamilyCase:
    hf = make_target(seed=3, std=0.1, **FAMILIES[request.param])
    path = save_target(hf, tmp_path_factory.mktemp(request.param))
    single = load_target(path, "float32")
    prompts = _prompts(single.config.vocab_size)
    tokens = generate(single, prompts, max_new_tokens=MAX_NEW, impl="reference").tokens
    return FamilyCase(request.param, path, single, prompts, tokens, prompt_logits(single, prompts))


# The split decode loop compiles per family and degree; the tokens are compared at one degree per
# family (both degrees across the families), the logits at both.
GREEDY_DEGREE = {"qwen3": 4, "llama": 2, "qwen3_moe": 4, "qwen3_5": 2, "qwen3_5_moe": 4, "gpt_oss": 2}


@pytest.mark.parametrize("tp", [2, 4])
def test_every_family_split_gives_the_tokens_and_logits_of_one_device(family_case, tp):
    case = family_case
    target = load_target(case.path, "float32", tensor_parallel=_split(tp))
    layout = target_layout(target.params, target.config)
    assert_each_device_holds_its_slices(target.params, layout, tp)
    first = target.tensor_parallel.mesh.devices.flat[0]
    held = sum(shard.data.nbytes for x in jax.tree.leaves(target.params) for shard in x.addressable_shards
               if shard.device == first)
    total = sum(x.nbytes for x in jax.tree.leaves(case.single.params))
    assert held < 1.05 * total / tp   # about a tp-th: only norms, routers and gates are whole on every device
    # gathered back and un-reordered, the loaded slices are the single-device params exactly
    assert_same_params(unsharded(target.params, layout, target.tensor_parallel), case.single.params)
    logits = prompt_logits(target, case.prompts)
    np.testing.assert_allclose(logits, case.logits, **LOGITS_TOLERANCE)
    if tp == GREEDY_DEGREE[case.name]:
        assert generate(target, case.prompts, max_new_tokens=MAX_NEW, impl="reference").tokens == case.tokens


@pytest.mark.parametrize("family_case", ["qwen3_moe", "qwen3_5_moe", "gpt_oss"], indirect=True)
@pytest.mark.parametrize("tp", [2, 4])
def test_moe_experts_dealt_out_whole_give_the_tokens_and_logits_of_one_device(family_case, tp):
    """Expert parallelism: each device holds 4 / tp whole experts (the shared expert split by
    width), runs the pairs routed to them, and the sums meet as with width-split experts."""
    case = family_case
    split = TensorParallel(make_mesh(tp), expert_parallel=True)
    target = load_target(case.path, "float32", tensor_parallel=split)
    layout = target_layout(target.params, target.config, expert_parallel=True)
    assert_each_device_holds_its_slices(target.params, layout, tp)
    routed = next(layer.ffn for layer in target.params.layers if getattr(layer.ffn, "router", None) is not None)
    assert {shard.data.shape[0] for shard in routed.gate_up_proj.addressable_shards} == {4 // tp}
    assert_same_params(unsharded(target.params, layout, split), case.single.params)
    np.testing.assert_allclose(prompt_logits(target, case.prompts), case.logits, **LOGITS_TOLERANCE)
    if tp != GREEDY_DEGREE[case.name]:  # the other degree than the width-split test's
        assert generate(target, case.prompts, max_new_tokens=MAX_NEW, impl="reference").tokens == case.tokens
    if case.name == "qwen3_moe" and tp == 2:  # the experts' kernel skipping the pairs held elsewhere (interpreted)
        assert generate(target, case.prompts, max_new_tokens=MAX_NEW, impl="interpret").tokens == case.tokens


@pytest.mark.parametrize("tp", [2, 4])
def test_a_converted_folder_loads_into_any_degree(family_case, tp, tmp_path):
    """A converted folder holds the single-device layout; each degree reorders it as it loads:
    the same slices on each device as the HF folder split (whose tokens and logits are tested
    above), the single-device params bit for bit once gathered."""
    from checkpoints_convert import convert

    converted = convert(family_case.path, tmp_path / "converted", dtype="float32", progress=False)
    target = load_target(converted, "float32", tensor_parallel=_split(tp))
    layout = target_layout(target.params, target.config)
    assert_each_device_holds_its_slices(target.params, layout, tp)
    assert_same_params(unsharded(target.params, layout, target.tensor_parallel), family_case.single.params)


# ---------------------------------------------------------------------------------------------
# DFlash (the copying pairs of builders: varied acceptance lengths) at TP 2

DFLASH_NEW = 32
DFLASH_PROMPT_LENS = (7, 9, 11, 14)   # the copy construction needs >= 6


@dataclass
class DFlashCase:
    target_dir: Path
    draft_dir: Path
    prompts: list[list[int]]
    tokens: list[list[int]]
    accept_lengths: list[list[int]]


def _dflash_case(target_dir: Path, draft_dir: Path, prompt_lens=None) -> DFlashCase:
    target = load_target(target_dir, "float32")
    prompts = _prompts(target.config.vocab_size, prompt_lens or DFLASH_PROMPT_LENS)
    out = generate(target, prompts, draft=load_draft(draft_dir, target), max_new_tokens=DFLASH_NEW,
                   impl="reference")
    lengths = {n for row in out.stats.accept_lengths for n in row[:-1]}
    assert len(lengths) >= 4, f"the pair's acceptance lengths barely vary: {sorted(lengths)}"
    return DFlashCase(target_dir, draft_dir, prompts, out.tokens, out.stats.accept_lengths)


@pytest.fixture(scope="module")
def copy_pair(spec_pair) -> DFlashCase:
    """conftest's spec_pair (Qwen3 copy target, 4/2 heads; its copying draft) on one device."""
    return _dflash_case(spec_pair.target_dir, spec_pair.draft_dir)


@pytest.fixture(scope="module")
def hybrid_copy_pair(tmp_path_factory) -> DFlashCase:
    """The copy pair on a Qwen3.5-MoE hybrid (Gated DeltaNet with 2/4 heads, whose output moves
    the tokens: a wrong rollback of a split state changes them; expert widths 32 that split into
    the projection kernel's multiples of 16)."""
    hf_target = make_copy_target(family="qwen3_5_moe", linear_noise=0.3, experts=4, top_k=2, shared_width=32)
    root = tmp_path_factory.mktemp("hybrid_copy_pair")
    # a 40-token prompt: its prefill runs the chunked gated delta rule (beyond a verify block's 16)
    return _dflash_case(save_target(hf_target, root / "target"), save_draft(make_copy_draft(hf_target), root / "draft"),
                        prompt_lens=(*DFLASH_PROMPT_LENS, 40))


def _load_split(case: DFlashCase, split: TensorParallel) -> tuple[Target, Draft]:
    target = load_target(case.target_dir, "float32", tensor_parallel=split)
    return target, load_draft(case.draft_dir, target)


@pytest.mark.parametrize("replicate_draft", [False, True], ids=["draft-split", "draft-replicated"])
def test_dflash_split_keeps_tokens_and_acceptance_lengths(copy_pair, replicate_draft):
    target, draft = _load_split(copy_pair, _split(2, replicate_draft))
    out = generate(target, copy_pair.prompts, draft=draft, max_new_tokens=DFLASH_NEW, impl="reference")
    assert out.tokens == copy_pair.tokens
    assert out.stats.accept_lengths == copy_pair.accept_lengths


def test_dflash_on_a_split_hybrid_keeps_tokens_and_acceptance_lengths(hybrid_copy_pair):
    """The models split in memory (``split_target`` / ``split_draft``) rather than loaded split."""
    single = load_target(hybrid_copy_pair.target_dir, "float32")
    split = _split(2)
    target = split_target(single, split)
    draft = split_draft(load_draft(hybrid_copy_pair.draft_dir, single), split)
    out = generate(target, hybrid_copy_pair.prompts, draft=draft, max_new_tokens=DFLASH_NEW, impl="reference")
    assert out.tokens == hybrid_copy_pair.tokens
    assert out.stats.accept_lengths == hybrid_copy_pair.accept_lengths


def test_dflash_split_with_a_reduced_vocabulary_draft_head(copy_pair, spec_pair, tmp_path):
    """A speculators draft with its own head over 80 of the 128 ids (replicated, the proposals
    mapped to target ids, each device keeping its vocabulary columns) keeps one device's tokens
    and acceptance lengths."""
    selected = sorted(np.random.default_rng(5).choice(127, 80, replace=False).tolist())
    path = save_speculators_draft(spec_pair.hf_draft, spec_pair.hf_target, tmp_path, selected_ids=selected)
    single = generate(spec_pair.target, copy_pair.prompts, draft=load_draft(path, spec_pair.target),
                      max_new_tokens=DFLASH_NEW, impl="reference")
    target = load_target(copy_pair.target_dir, "float32", tensor_parallel=_split(2))
    draft = load_draft(path, target)
    assert draft.config.draft_vocab_size == len(selected)
    out = generate(target, copy_pair.prompts, draft=draft, max_new_tokens=DFLASH_NEW, impl="reference")
    assert out.tokens == single.tokens == copy_pair.tokens   # lossless
    assert out.stats.accept_lengths == single.stats.accept_lengths


@pytest.fixture(scope="module")
def dflash2_copy_pair(tmp_path_factory) -> DFlashCase:
    """The copying Qwen3 pair with its draft turned DFlash2 (convolutions and a selector), on one
    device."""
    root = tmp_path_factory.mktemp("dflash2_copy_pair")
    hf_target = make_copy_target()
    return _dflash_case(save_target(hf_target, root / "target"),
                        save_draft(as_dflash2(make_copy_draft(hf_target), group_size=8), root / "draft"))


@pytest.mark.parametrize("replicate_draft", [False, True], ids=["draft-split", "draft-replicated"])
def test_dflash2_split_keeps_tokens_acceptance_and_samples(dflash2_copy_pair, replicate_draft):
    """DFlash2 at TP 2: each convolution on whole hidden vectors (after its sublayer's sum), the
    selector over the gathered vocabulary on every device (one path: its key is the same on
    each): one device's greedy tokens and acceptance lengths. Sampled, every row a valid run with
    accepts and rejections (the split sampler draws its own noise per shard: exact in
    distribution, not one device's draws)."""
    case = dflash2_copy_pair
    target, draft = _load_split(case, _split(2, replicate_draft))
    assert draft.config.selector is not None
    out = generate(target, case.prompts, draft=draft, max_new_tokens=DFLASH_NEW, impl="reference")
    assert out.tokens == case.tokens
    assert out.stats.accept_lengths == case.accept_lengths
    prompts = _prompts(128, DFLASH_PROMPT_LENS * 4, seed=4)
    sampled = generate(target, prompts, draft=draft, max_new_tokens=16, seed=3, impl="reference",
                       sampling=SamplingConfig(temperature=0.8, top_k=20))
    assert all(len(row) == 16 and all(0 <= t < 128 for t in row) for row in sampled.tokens)
    lengths = {n for row in sampled.stats.accept_lengths for n in row[:-1]}
    assert 1 in lengths and max(lengths) >= 3, f"accepts and rejections both exercised: {sorted(lengths)}"


@pytest.mark.parametrize("pair", ["copy_pair", "hybrid_copy_pair"])
def test_pallas_kernels_run_per_shard(request, pair):
    """impl="interpret": every kernel (projections, norm+RoPE page writes, paged and draft
    attention, routed experts and the gated delta rule on the hybrid) inside the shard_map
    program, on each device's heads and widths."""
    case = request.getfixturevalue(pair)
    target, draft = _load_split(case, _split(2))
    out = generate(target, case.prompts, draft=draft, max_new_tokens=DFLASH_NEW, impl="interpret")
    assert out.tokens == case.tokens
    assert out.stats.accept_lengths == case.accept_lengths


# ---------------------------------------------------------------------------------------------
# Sampling: the same samples as one device for the same seed

SAMPLING_ROWS = 64


SPLIT_SAMPLING = {"t1.0": SamplingConfig(temperature=1.0), "t0.7": SamplingConfig(temperature=0.7),
                  "top_k5": SamplingConfig(temperature=1.0, top_k=5),
                  "t0.8-top_k5-top_p0.9": SamplingConfig(temperature=0.8, top_k=5, top_p=0.9),
                  "top_p0.8 (gathered)": SamplingConfig(temperature=1.0, top_p=0.8),
                  "top_k beyond the vocabulary": SamplingConfig(temperature=1.0, top_k=100)}


def _on_columns(function, tp: int, *arrays, split_last=(True,)):
    """``function(*arrays)`` as one program per device of a tp mesh, each array's last axis split
    where ``split_last`` says (the rest replicated), the result's last axis gathered."""
    mesh = make_mesh(tp)
    in_specs = tuple(P(*(None,) * (a.ndim - 1), "tp") if split else P() for a, split in zip(arrays, split_last))
    return jax.jit(jax.shard_map(function, mesh=mesh, in_specs=in_specs, out_specs=P(), check_vma=False))(*arrays)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(SPLIT_SAMPLING))
def test_split_sampling_probabilities_are_one_devices(name, tp):
    """Each shard's columns of the sampling probabilities (from the shards' maxima, sums and top-k
    candidates; top-p alone from the gathered logits) are one device's, to f32 rounding."""
    config = SPLIT_SAMPLING[name].as_arrays()
    logits = jax.random.normal(jax.random.key(tp), (3, 5, 64)) * 3

    def split(logits):
        return gather_vocab(sampling_probs(logits, config, "tp"), "tp")

    np.testing.assert_allclose(np.asarray(_on_columns(split, tp, logits)),
                               np.asarray(sampling_probs(logits, config)), rtol=1e-5, atol=1e-7)


DRAWS = 40000


@pytest.mark.parametrize("name", ["t1.0", "t0.8-top_k5-top_p0.9"])
def test_split_samples_are_exact_in_distribution(name):
    """40000 draws over 16 tokens split 4 ways (each shard's Gumbel-max winner with its own noise,
    then the best of those) fit the probabilities (chi-square, p > 1e-4)."""
    config = SPLIT_SAMPLING[name].as_arrays()
    probs = sampling_probs(jax.random.normal(jax.random.key(3), (16,)) * 1.5, config)
    key = jax.random.key(11)
    draws = _on_columns(lambda p: sample_probs(key, p, "tp"), 4, jnp.broadcast_to(probs, (DRAWS, 16)))
    assert _chi2_pvalue(np.bincount(np.asarray(draws), minlength=16), np.asarray(probs)) > 1e-4


def test_the_split_sample_test_catches_shared_noise():
    """The test above fails a broken split: the same noise on every shard (columns at one offset
    then always race together), over 16 possible tokens."""
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(3), (16,)) * 1.5)
    key = jax.random.key(11)

    def shared_noise(p):
        return vocab_argmax(jnp.log(p) + jax.random.gumbel(key, p.shape), "tp")

    broken = _on_columns(shared_noise, 4, jnp.broadcast_to(probs, (DRAWS, 16)))
    assert _chi2_pvalue(np.bincount(np.asarray(broken), minlength=16), np.asarray(probs)) < 1e-4


def test_split_rejection_sampling_is_exact_in_distribution():
    """One draft token from q, accepted with min(1, p/q), else a residual draw, split over 4
    shards: the emitted token follows p (chi-square over 40000 rows) and the acceptance rate is
    sum min(p, q)."""
    vocab = 16
    p_logits, q_logits = jax.random.normal(jax.random.key(5), (2, vocab)) * 1.5
    p, q = jax.nn.softmax(p_logits), jax.nn.softmax(q_logits)
    drafts = jnp.asarray(np.random.default_rng(6).choice(vocab, size=(DRAWS, 1), p=np.asarray(q, np.float64)
                                                         / float(np.sum(np.asarray(q, np.float64)))), jnp.int32)
    target = jnp.broadcast_to(p, (DRAWS, 2, vocab))
    draft = jnp.broadcast_to(q, (DRAWS, 1, vocab))
    key = jax.random.key(7)

    def step(drafts, draft_probs, target_probs):
        accepted, bonus = accept_sampling(key, drafts, draft_probs, target_probs, jnp.full((DRAWS,), 2), "tp")
        return jnp.where(accepted > 0, drafts[:, 0], bonus), accepted

    emitted, accepted = _on_columns(step, 4, drafts, draft, target, split_last=(False, True, True))
    assert _chi2_pvalue(np.bincount(np.asarray(emitted), minlength=vocab), np.asarray(p)) > 1e-4
    rate, expected = float(np.mean(np.asarray(accepted))), float(jnp.sum(jnp.minimum(p, q)))
    assert abs(rate - expected) < 4.5 * np.sqrt(expected * (1 - expected) / DRAWS), (rate, expected)


def _chi2_pvalue(observed: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of counts to probabilities (cells expected < 5 pooled)."""
    expected = probs / probs.sum() * observed.sum()
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1] * obs[:-1].sum() / exp[:-1].sum()
    return float(stats.chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=1.0),
                                      SamplingConfig(temperature=0.8, top_k=20, top_p=0.9)],
                         ids=["t1", "t0.8-top_k-top_p"])
def test_speculative_sampling_runs_split(copy_pair, sampling):
    """Speculative sampling end to end at TP 2 (draft proposals, accepts, residual draws, bonus
    tokens, all on split vocabularies; exact in distribution by the three tests above): every row
    a valid run with accepts and rejections, another seed other tokens."""
    prompts = _prompts(128, DFLASH_PROMPT_LENS * (SAMPLING_ROWS // len(DFLASH_PROMPT_LENS)), seed=4)
    kwargs = dict(max_new_tokens=16, sampling=sampling, seed=7, impl="reference")
    target, draft = _load_split(copy_pair, _split(2))
    split = generate(target, prompts, draft=draft, **kwargs)
    assert all(len(row) == 16 and all(0 <= t < 128 for t in row) for row in split.tokens)
    reseeded = generate(target, prompts, draft=draft, **{**kwargs, "seed": 8})
    assert np.mean([a == b for a, b in zip(reseeded.tokens, split.tokens)]) < 0.2
    lengths = {n for row in split.stats.accept_lengths for n in row[:-1]}
    assert 1 in lengths and max(lengths) >= 3, f"accepts and rejections both exercised: {sorted(lengths)}"


# ---------------------------------------------------------------------------------------------
# The command line, and degrees that cannot split

CLI_VOCAB = 292   # 4 x 73: splits over 2 and 4, not 3 (a padded vocabulary beyond the tokenizer's)


@dataclass
class CliModels:
    target_dir: Path           # HF target (4/2 heads) with a real tokenizer
    draft_dir: Path            # its z-lab draft (4/2 heads)
    one_kv_head_dir: Path      # a draft of 2/1 heads: cannot split over 2
    prompts: list[list[int]]
    tokens: list[list[int]]    # DFlash greedy on one device with the draft of 2/1 heads


@pytest.fixture(scope="module")
def cli_models(tmp_path_factory) -> CliModels:
    root = tmp_path_factory.mktemp("cli")
    target_dir = root / "target"
    target_dir.mkdir()
    assert write_tokenizer(target_dir) <= CLI_VOCAB
    hf = make_target(seed=5, std=0.1, vocab=CLI_VOCAB, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8,
                     rope_theta=1e4)
    save_target(hf, target_dir)
    draft = dict(layers=1, block_size=4, target_layer_ids=(0, 1), head_dim=8, std=0.1)
    draft_dir = save_draft(make_zlab_draft(hf, heads=4, kv_heads=2, **draft), root / "draft")
    one_kv_head_dir = save_draft(make_zlab_draft(hf, heads=2, kv_heads=1, seed=101, **draft), root / "one_kv_head")
    target = load_target(target_dir, "float32")
    prompts = _prompts(CLI_VOCAB, seed=2)
    tokens = generate(target, prompts, draft=load_draft(one_kv_head_dir, target), max_new_tokens=MAX_NEW,
                      impl="reference").tokens
    return CliModels(target_dir, draft_dir, one_kv_head_dir, prompts, tokens)


def test_cli_tp_2_prints_what_tp_1_prints(cli_models, tmp_path, capsys):
    """What a user tries on a laptop: the same text and acceptance as one device."""
    runs = {}
    for tp in (1, 2):
        stats = tmp_path / f"tp{tp}.json"
        code = generate_cli.main(["--target", str(cli_models.target_dir), "--draft", str(cli_models.draft_dir),
                                  "--prompt", "def fib", "--max-new-tokens", str(MAX_NEW), "--dtype", "float32",
                                  "--impl", "reference", "--tp", str(tp), "--stats-json", str(stats)])
        printed = capsys.readouterr()
        assert code == 0, printed.err
        assert (" on 2 x cpu" in printed.err) == (tp == 2), printed.err   # the header names the split
        runs[tp] = printed.out, json.loads(stats.read_text())["dflash"]
    assert runs[2][0] == runs[1][0] and runs[1][0].startswith("def fib")
    for field in ("new_tokens", "steps", "histogram", "finish_reasons"):
        assert runs[2][1][field] == runs[1][1][field], field


@pytest.mark.parametrize("flags, message", [
    (["--tp", "3"], "the target cannot be split over tp 3: vocab_size 292 is not divisible by 3; "
                    "num_key_value_heads 2 is not divisible by 3"),
    (["--tp", "8"], "tp 8 needs 8 devices; 4 cpu device(s) are visible"),
    (["--replicate-draft"], "--replicate-draft needs --tp > 1 and a draft"),
    (["--expert-parallel"], "--expert-parallel needs --tp > 1"),
    (["--tp", "2", "--draft", "{one_kv_head}"], "the draft cannot be split over tp 2: "
                                                "num_key_value_heads 1 is not divisible by 2"),
])
def test_cli_refuses_a_degree_that_cannot_split_before_reading_weights(cli_models, tmp_path, capsys, flags,
                                                                       message):
    """The target folder holds no weights: an error naming the field, not a missing file, shows
    that nothing was read first."""
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(cli_models.target_dir / name, weightless / name)
    flags = [flag.format(one_kv_head=cli_models.one_kv_head_dir) for flag in flags]
    assert generate_cli.main(["--target", str(weightless), "--draft", str(cli_models.draft_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err and "Traceback" not in err


def test_a_draft_that_cannot_split_is_refused_and_runs_replicated(cli_models):
    target = load_target(cli_models.target_dir, "float32", tensor_parallel=_split(2))
    with pytest.raises(ValueError, match="the draft cannot be split over tp 2: num_key_value_heads 1 is not"):
        load_draft(cli_models.one_kv_head_dir, target)
    target = load_target(cli_models.target_dir, "float32", tensor_parallel=_split(2, replicate_draft=True))
    draft = load_draft(cli_models.one_kv_head_dir, target)
    out = generate(target, cli_models.prompts, draft=draft, max_new_tokens=MAX_NEW, impl="reference")
    assert out.tokens == cli_models.tokens


@pytest.mark.parametrize("family, fields", [
    ("qwen3_moe", ["vocab_size 128", "num_key_value_heads 4", "intermediate_size 128", "moe_intermediate_size 16"]),
    ("qwen3_5_moe", ["vocab_size 128", "num_key_value_heads 4", "linear_num_key_heads 4", "moe_intermediate_size 16",
                     "shared_expert_intermediate_size 16"]),
])
def test_load_target_refuses_every_field_that_cannot_split_before_reading_weights(family, fields, tmp_path):
    """A folder of config.json alone: the refusal comes before any weight is looked for."""
    arch = dict(FAMILIES[family])
    arch.pop("family")
    config = qwen3_moe_config(**arch) if family == "qwen3_moe" else hybrid_config(family, **arch)
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError) as refused:
        load_target(tmp_path, "float32", tensor_parallel=_split(3))
    assert str(refused.value).startswith("the target cannot be split over tp 3: ")
    for field in fields:
        assert f"{field} is not divisible by 3" in str(refused.value)


def test_expert_parallelism_is_refused_where_the_experts_do_not_divide(tmp_path):
    """Experts dealt out whole need num_experts divisible by the degree (4 experts over 3: named),
    and split no width of theirs (moe_intermediate_size not named)."""
    arch = dict(FAMILIES["qwen3_moe"])
    arch.pop("family")
    qwen3_moe_config(**arch).save_pretrained(tmp_path)
    with pytest.raises(ValueError) as refused:
        load_target(tmp_path, "float32", tensor_parallel=TensorParallel(make_mesh(3), expert_parallel=True))
    assert "num_experts 4 is not divisible by 3" in str(refused.value)
    assert "moe_intermediate_size" not in str(refused.value)


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory) -> FamilyCase:
    """A released-style gpt-oss folder whose experts are MXFP4 (width 64: two scale groups of the
    down projection, one a shard at tp 2), loaded on one device."""
    arch = dict(FAMILIES["gpt_oss"], expert_width=64)
    path = save_mxfp4_gpt_oss(make_target(seed=3, std=0.1, **arch), tmp_path_factory.mktemp("mxfp4") / "hf", seed=3)
    single = load_target(path, "float32", mxfp4_experts="keep")
    prompts = _prompts(single.config.vocab_size)
    tokens = generate(single, prompts, max_new_tokens=MAX_NEW, impl="reference").tokens
    return FamilyCase("gpt_oss_mxfp4", path, single, prompts, tokens, prompt_logits(single, prompts))


@pytest.mark.parametrize("tp, expert_parallel", [(2, False), (2, True), (4, True)])
def test_mxfp4_experts_split_give_the_tokens_and_logits_of_one_device(mxfp4_gpt_oss, tp, expert_parallel):
    """MXFP4 codes and scales split with their weights (by width: whole scale groups; or experts
    dealt out whole); the experts' kernel decodes each shard's (interpreted, at tp 2)."""
    case = mxfp4_gpt_oss
    split = TensorParallel(make_mesh(tp), expert_parallel=expert_parallel)
    target = load_target(case.path, "float32", tensor_parallel=split, mxfp4_experts="keep")
    layout = target_layout(target.params, target.config, expert_parallel)
    assert_each_device_holds_its_slices(target.params, layout, tp)
    assert target.params.layers[0].ffn.down_proj.blocks.dtype == jnp.uint8
    assert_same_params(unsharded(target.params, layout, split), case.single.params)
    np.testing.assert_allclose(prompt_logits(target, case.prompts), case.logits, **LOGITS_TOLERANCE)
    assert generate(target, case.prompts, max_new_tokens=MAX_NEW, impl="reference").tokens == case.tokens
    if tp == 2:
        assert generate(target, case.prompts, max_new_tokens=MAX_NEW, impl="interpret").tokens == case.tokens


def test_a_converted_mxfp4_folder_loads_into_any_degree_kept_or_dequantised(mxfp4_gpt_oss, tmp_path):
    """A converted folder keeps the codes: kept at tp 2 (by width) and tp 4 (by expert), and
    dequantised (on the host, layer by layer) at tp 4 by width, where kept codes cannot split:
    one device's params bit for bit (the HF folder's splits, tested above, give its tokens)."""
    from checkpoints_convert import convert

    case = mxfp4_gpt_oss
    converted = convert(case.path, tmp_path / "converted", dtype="float32", progress=False)
    for split in (_split(2), TensorParallel(make_mesh(4), expert_parallel=True)):
        target = load_target(converted, "float32", tensor_parallel=split, mxfp4_experts="keep")
        layout = target_layout(target.params, target.config, split.expert_parallel)
        assert_each_device_holds_its_slices(target.params, layout, split.size)
        assert_same_params(unsharded(target.params, layout, split), case.single.params)
    dense = load_target(case.path, "float32", mxfp4_experts="dequantize")
    target = load_target(converted, "float32", tensor_parallel=_split(4), mxfp4_experts="dequantize")
    assert_same_params(unsharded(target.params, target_layout(target.params, target.config), target.tensor_parallel),
                       dense.params)


def test_cli_tp_4_dequantises_mxfp4_experts_that_cannot_split_kept(tmp_path, capsys):
    """The CLI checks a split against the experts as they will load: --tp 4 with the experts
    dequantised (asked, or auto on a CPU) prints what one device prints; kept, it is refused
    before any weight is read, naming the ways out."""
    arch = dict(FAMILIES["gpt_oss"], vocab=CLI_VOCAB, expert_width=64)
    folder = save_mxfp4_gpt_oss(make_target(seed=4, std=0.1, **arch), tmp_path / "gpt_oss", seed=4)
    assert write_tokenizer(folder) <= CLI_VOCAB
    flags = ["--target", str(folder), "--prompt", "def fib", "--max-new-tokens", "6", "--dtype", "float32",
             "--impl", "reference"]
    outputs = []
    for extra in ([], ["--tp", "4", "--mxfp4-experts", "dequantize"], ["--tp", "4"]):
        assert generate_cli.main(flags + extra) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[1] == outputs[2] == outputs[0] and outputs[0].startswith("def fib")
    assert generate_cli.main(flags + ["--tp", "4", "--mxfp4-experts", "keep"]) == 2
    assert "got 64 / 4: take --expert-parallel or --mxfp4-experts dequantize" in capsys.readouterr().err


def test_split_selector_candidates_are_one_devices():
    """DFlash2's selector under a split vocabulary: each shard's best k, gathered, give one
    device's top k, ties to the lower id (logits rounded to a few values: many ties)."""
    from dflash_jax.model.selector import top_candidates

    logits = jnp.round(jax.random.normal(jax.random.key(5), (3, 7, 64)) * 2) / 2
    unary, ids = top_candidates(logits, 6)
    for tp in (2, 4):
        split = _on_columns(lambda x: jnp.concatenate(top_candidates(x, 6, "tp")[::-1], axis=-1).astype(jnp.float32),
                            tp, logits)
        np.testing.assert_array_equal(np.asarray(split[..., :6]).astype(np.int32), np.asarray(ids))
        np.testing.assert_array_equal(np.asarray(split[..., 6:]), np.asarray(unary))


def test_mxfp4_experts_split_into_partial_scale_groups_are_refused_or_dequantised(mxfp4_gpt_oss):
    """Width 64 over 4 devices would cut the down projection's 32-input scale groups: refused,
    naming the ways out; dequantised at load, the split runs and gives one device's tokens."""
    case = mxfp4_gpt_oss
    with pytest.raises(ValueError, match="intermediate_size / tp to be a multiple of 32 .* got 64 / 4: take "
                                         "--expert-parallel or --mxfp4-experts dequantize"):
        load_target(case.path, "float32", tensor_parallel=_split(4), mxfp4_experts="keep")
    target = load_target(case.path, "float32", tensor_parallel=_split(4), mxfp4_experts="dequantize")
    assert target.params.layers[0].ffn.down_proj.dtype == jnp.float32
    assert generate(target, case.prompts, max_new_tokens=MAX_NEW, impl="reference").tokens == case.tokens



def test_split_rows_with_mixed_settings_and_logprobs_are_one_devices():
    """Per-row settings (greedy, top-k, min-p, top-p alone) and the target's log-probabilities on
    vocabulary columns split 4 ways equal one device's."""
    configs = [SamplingConfig(), SamplingConfig(temperature=0.9, top_k=5), SamplingConfig(temperature=1.0, min_p=0.2),
               SamplingConfig(temperature=1.2, top_p=0.7)]
    rows = SamplingRows.stack(configs, top_k_cap=8)
    logits = jax.random.normal(jax.random.key(3), (4, 3, 64)) * 3
    tokens = jax.random.randint(jax.random.key(4), (4, 3), 0, 64)

    def split(logits):
        return gather_vocab(sampling_probs(logits, rows, "tp"), "tp")

    np.testing.assert_allclose(np.asarray(_on_columns(split, 4, logits)), np.asarray(sampling_probs(logits, rows)),
                               rtol=1e-5, atol=1e-7)
    ours = _on_columns(lambda logits, tokens: token_logprobs(logits, tokens, 5, "tp"), 4, logits, tokens,
                       split_last=(True, False))
    for split_value, single in zip(ours, token_logprobs(logits, tokens, 5)):
        np.testing.assert_allclose(np.asarray(split_value), np.asarray(single), rtol=1e-5, atol=1e-6)


def test_the_engine_split_serves_what_one_device_does(copy_pair):
    """The serving engine at TP 2 (continuous batching over fewer slots than requests, chunked
    prefill): greedy rows give one device's tokens; a sampled row's log-probabilities are one
    device's log-softmax at its tokens (the split draw itself differs from one device's: its
    noise is drawn per shard, exact in distribution, tested above)."""
    from dflash_jax.runtime.engine import Engine, RequestParams

    params = [RequestParams(max_tokens=DFLASH_NEW) for _ in copy_pair.prompts]
    sampled = RequestParams(max_tokens=10, sampling=SamplingConfig(temperature=0.9, top_k=5), seed=4, logprobs=2)
    settings = dict(max_num_seqs=2, max_model_len=96, page_size=8, prefill_chunk=8, chunk_steps=2, impl="reference")

    def run(target, draft):
        engine = Engine(target, draft, **settings)
        requests = [engine.submit(p, q) for p, q in zip(copy_pair.prompts + [copy_pair.prompts[0]], params + [sampled])]
        engine.run_until_done()
        assert engine.pages_in_use == 0
        return requests

    split = run(*_load_split(copy_pair, _split(2)))
    assert [r.token_ids for r in split[:-1]] == copy_pair.tokens
    prompt, tokens = copy_pair.prompts[0], split[-1].token_ids
    logits = prompt_logits(load_target(copy_pair.target_dir, "float32"), [prompt + tokens])[0, len(prompt) - 1:-1]
    expected = jax.nn.log_softmax(logits, -1)
    np.testing.assert_allclose([lp.logprob for lp in split[-1].logprobs],
                               np.asarray(expected)[np.arange(len(tokens)), tokens], atol=1e-5)
    assert [[t for t, _ in lp.top] for lp in split[-1].logprobs] == np.argsort(-expected, -1)[:, :2].tolist()


# ---------------------------------------------------------------------------------------------
# Benchmarks' independent MoE routing under tensor parallelism


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_independent_routing_is_the_same_on_every_shard(expert_parallel):
    """A MoE layer with ``IndependentRouting`` split over 4 devices (by width, or experts dealt out
    whole) gives the single-device layer's output: every shard draws each token's experts from
    the same replicated row bits (a shard that drew others would run, or skip, other pairs)."""
    import dataclasses

    from dflash_jax.model.nn import moe
    from dflash_jax.model.sharding import TP_AXIS, _ffn_layout, placed

    spec = moe.MoESpec(num_experts=8, top_k=2, intermediate_size=16, norm_topk_prob=True,
                       routing=moe.IndependentRouting(0.5))
    params = moe.init_moe(spec, 32, jax.random.key(0), jnp.float32, scale=0.2)
    x, norm = jax.random.normal(jax.random.key(1), (2, 5, 32)), jnp.ones(32)
    expected = moe.forward(x, params, spec, norm, 1e-6, "reference")
    split = TensorParallel(make_mesh(4), expert_parallel=expert_parallel)
    local = dataclasses.replace(spec, intermediate_size=16 if expert_parallel else 4)
    layout = _ffn_layout(params, spec, expert_parallel)
    program = jax.shard_map(lambda p, x: moe.forward(x, p, local, norm, 1e-6, "reference", tensor_axis=TP_AXIS),
                            mesh=split.mesh, in_specs=(specs(layout), P()), out_specs=P(), check_vma=False)
    np.testing.assert_allclose(jax.jit(program)(placed(params, layout, split), x), expected, rtol=1e-5, atol=1e-5)
    # the override is in force: the router's own top 2 gives another output
    plain = moe.forward(x, params, dataclasses.replace(spec, routing=None), norm, 1e-6, "reference")
    assert not np.allclose(plain, expected, atol=1e-3)
