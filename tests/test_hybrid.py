"""Qwen3.5 / Qwen3-Next hybrids under DFlash: the recurrent state's exact rollback.

A verify runs the whole block through the Gated DeltaNet layers; after a partial accept their
states must be exactly the states after the accepted tokens. The oracle here is a cache-free
DFlash (target and draft recomputed over the whole sequence every step: no state to roll
back), not the PyPI reference, whose transformers path restores only the conv state after a
partial accept and so diverges from the target's greedy output on hybrids (docs/families.md).
Forward parity with transformers (prefill, decode, verify) is in test_target.py; sampling
exactness on a hybrid in test_sampling.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from builders import make_copy_draft, make_copy_target, make_target, save_draft, save_target, train_briefly
from dflash_jax.model import target as target_model
from dflash_jax.model.cache import allocate_pages, init_cache
from dflash_jax.runtime.generation import generate
from dflash_jax.loading.models import load_draft, load_target

MAX_NEW = 40
PROMPT_LENS = (7, 9, 11, 14)
LINEAR_NOISE = 0.3   # Gated DeltaNet output scale of the copy target: a wrong rollback changes tokens


def _prompts(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 127, n).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=["qwen3_5_release", "qwen3_5_moe"])
def hybrid_pair(request, tmp_path_factory):
    """The copying target + draft (builders.make_copy_target) on a hybrid: Gated DeltaNet,
    gated attention (the copy head), Gated DeltaNet x2."""
    extra = dict(experts=4, top_k=2) if "moe" in request.param else {}
    hf_target = make_copy_target(family=request.param, linear_noise=LINEAR_NOISE, **extra)
    hf_draft = make_copy_draft(hf_target)
    root = tmp_path_factory.mktemp(request.param)
    target = load_target(save_target(hf_target, root / "target"), "float32")
    draft = load_draft(save_draft(hf_draft, root / "draft"), target, "float32")
    return hf_target, hf_draft, target, draft


@torch.no_grad()
def cache_free_dflash(hf_target, hf_draft, prompt: list[int], max_new: int, block: int):
    """Greedy DFlash with nothing cached: each step recomputes the target's taps over the whole
    context, the draft's block over them, and the verify as a forward of the whole sequence.
    Returns (tokens, tokens emitted per step)."""
    import dflash.model as dm

    layer_ids = hf_draft.target_layer_ids
    mask = hf_draft.mask_token_id
    head = dm._output_head(hf_target)
    generated = [int(hf_target(torch.tensor([prompt])).logits[0, -1].argmax())]
    accepted = []
    while len(generated) < max_new:
        sequence = prompt + generated
        context = len(sequence) - 1               # every token but the last has been run
        remaining = max_new - len(generated)
        size = min(block, remaining + 1)
        taps = dm.extract_context_feature(
            hf_target(torch.tensor([sequence[:context]]), output_hidden_states=True).hidden_states, layer_ids)
        block_ids = torch.tensor([[sequence[-1]] + [mask] * (size - 1)])
        noise = dm._raw_input_embeddings(hf_target, block_ids, 1.0)
        hidden = hf_draft(target_hidden=taps, noise_embedding=noise,
                          position_ids=torch.arange(context + size)[None])[:, 1 - size:]
        block_ids[0, 1:] = hf_draft.compute_logits(hidden, head).argmax(-1)[0]
        verify = hf_target(torch.cat([torch.tensor([sequence[:context]]), block_ids], dim=1)).logits[0, context:]
        posterior = verify.argmax(-1)
        n = int((block_ids[0, 1:] == posterior[:-1]).long().cumprod(0).sum())
        emitted = block_ids[0, 1:n + 1].tolist() + [int(posterior[n])]
        produced = min(n + 1, remaining)
        generated += emitted[:produced]
        accepted.append(produced)
    return generated, accepted


@pytest.mark.parametrize("block", [4, 16])
def test_dflash_on_a_hybrid_is_lossless_with_partial_accepts_of_every_length(hybrid_pair, block):
    _, _, target, draft = hybrid_pair
    prompts = _prompts()
    plain = generate(target, prompts, max_new_tokens=MAX_NEW, impl="reference")
    ours = generate(target, prompts, draft=draft, max_new_tokens=MAX_NEW, block_size=block, impl="reference")
    assert ours.tokens == plain.tokens
    lengths = {n for seq in ours.stats.accept_lengths for n in seq[:-1]}   # (a last step may be cut short)
    assert set(range(1, min(block, 6) + 1)) <= lengths, f"partial accepts missing: {sorted(lengths)}"


@pytest.mark.parametrize("impl", ["reference", "interpret-tpu"])
def test_acceptance_equals_a_cache_free_dflash(hybrid_pair, impl):
    """Tokens and acceptance lengths per step equal those of DFlash recomputed from scratch (also
    through the TPU kernels in TPU interpret mode: attention and the gated delta rule)."""
    hf_target, hf_draft, target, draft = hybrid_pair
    rows, max_new = (2, 24) if impl == "reference" else (1, 16)  # the TPU interpreter runs kernels slowly
    prompts = _prompts(1)[:rows]
    ours = generate(target, prompts, draft=draft, max_new_tokens=max_new, block_size=8, impl=impl)
    for b, prompt in enumerate(prompts):
        tokens, accepted = cache_free_dflash(hf_target, hf_draft, prompt, max_new, 8)
        assert ours.tokens[b] == tokens, f"sequence {b}"
        assert ours.stats.accept_lengths[b] == accepted, f"sequence {b} acceptance"


def test_the_pypi_reference_diverges_on_a_hybrid(hybrid_pair, monkeypatch):
    """The known divergence (docs/families.md): the PyPI reference's transformers path restores only the
    conv state after a partial accept, so its greedy DFlash output leaves the target's greedy
    output, where ours and the cache-free DFlash keep it. If this fails, the reference was fixed:
    it can become the oracle here again (and docs/families.md says so no more)."""
    import dflash.model as reference

    hf_target, hf_draft, target, draft = hybrid_pair
    monkeypatch.setattr(reference, "_cuda_time", lambda: 0.0)
    prompts = _prompts()
    plain = generate(target, prompts, max_new_tokens=MAX_NEW, impl="reference").tokens
    diverged = [reference.dflash_generate(hf_draft, hf_target, torch.tensor([prompt]), MAX_NEW, None,
                                          block_size=8)[0, len(prompt):].tolist() != tokens
                for prompt, tokens in zip(prompts, plain)]
    assert any(diverged)


# ---------------------------------------------------------------------------------------------
# Rollback of the recurrent state, per committed count


BLOCK = 6
PAGE = 8
_forward = jax.jit(target_model.forward, static_argnames=("config", "impl"))


def _states(cache, config):
    return [(np.asarray(cache.conv[i]), np.asarray(cache.recurrent[i])) for i in config.recurrent_layers]


def _prefill(target, prompts: np.ndarray, lens: np.ndarray, fill: float):
    config = target.config
    table, pages = allocate_pages([prompts.shape[1] + BLOCK] * len(prompts), PAGE, rng=np.random.default_rng(3))
    cache = init_cache(config, None, table, pages, PAGE, jnp.float32, fill=fill).emptied()
    _, _, cache = _forward(target.params, config, jnp.asarray(prompts), jnp.zeros(len(prompts), jnp.int32), cache,
                           impl="reference")
    return cache.commit(jnp.asarray(lens), "reference")


@pytest.fixture(scope="module")
def random_hybrid(tmp_path_factory):
    hf = make_target(seed=4, std=0.1, family="qwen3_5", vocab=64, hidden=32, layers=3, heads=2, kv_heads=1,
                     layer_types=("linear_attention", "full_attention", "linear_attention"), linear_heads=(1, 2))
    return load_target(save_target(hf, tmp_path_factory.mktemp("random_hybrid")), "float32")


def test_rollback_after_a_verify_leaves_the_state_of_the_committed_tokens(random_hybrid):
    """Row n of a batch verifies the same B tokens after a ragged prompt and commits n of them
    (0..B): its states equal a prefill of prompt + those n tokens, from scratch (NaN-poisoned
    pools: nothing stale is read)."""
    target = random_hybrid
    rng = np.random.default_rng(5)
    rows = BLOCK + 1
    lens = rng.integers(3, 9, rows).astype(np.int32)
    prompts = np.zeros((rows, 8), np.int32)
    for row, n in enumerate(lens):
        prompts[row, :n] = rng.integers(0, 64, n)
    block = rng.integers(0, 64, (rows, BLOCK)).astype(np.int32)
    cache = _prefill(target, prompts, lens, fill=float("nan"))
    _, _, cache = _forward(target.params, target.config, jnp.asarray(block), jnp.asarray(lens), cache,
                           impl="reference")
    counts = np.arange(rows, dtype=np.int32)
    cache = cache.commit(jnp.asarray(lens + counts), "reference")
    committed = np.zeros((rows, 8 + BLOCK), np.int32)
    for row, (n, count) in enumerate(zip(lens, counts)):
        committed[row, :n] = prompts[row, :n]
        committed[row, n:n + count] = block[row, :count]
    scratch = _prefill(target, committed, lens + counts, fill=0.0)
    for (conv, state), (conv_ref, state_ref) in zip(_states(cache, target.config), _states(scratch, target.config)):
        assert np.isfinite(state).all() and np.isfinite(conv).all()
        # (the layers past the attention see its verify-vs-prefill rounding: f32 near-exact, not bitwise)
        np.testing.assert_allclose(conv, conv_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(state, state_ref, rtol=5e-4, atol=5e-5)


def test_a_verify_without_a_commit_changes_no_state(random_hybrid):
    target = random_hybrid
    prompts = np.arange(16, dtype=np.int32).reshape(2, 8) % 64
    cache = _prefill(target, prompts, np.array([8, 5], np.int32), fill=0.0)
    before = _states(cache, target.config)
    _, _, after = _forward(target.params, target.config, jnp.ones((2, BLOCK), jnp.int32), jnp.array([8, 5]), cache,
                           impl="reference")
    for (conv, state), (conv_after, state_after) in zip(before, _states(after, target.config)):
        np.testing.assert_array_equal(conv, conv_after)
        np.testing.assert_array_equal(state, state_after)


def test_train_a_draft_for_a_hybrid_target(tmp_path):
    """train_draft over a hybrid's taps; the exported draft, run by z-lab's DFlashDraftModel in the
    cache-free DFlash, gives our tokens and acceptance lengths."""
    from dflash.model import DFlashDraftModel

    from dflash_jax.training import train_draft

    hf = make_target(seed=6, std=0.1, family="qwen3_5_release", vocab=96, hidden=32, layers=4, heads=2, kv_heads=1)
    target = load_target(save_target(hf, tmp_path / "target"), "float32")
    config = train_draft.new_draft_config(target.config, num_layers=1, block_size=4, mask_token_id=95,
                                          target_layer_ids=(0, 3))
    attention = config.model.attention
    assert not attention.output_gate and attention.rope.rotary_dim == attention.head_dim == 16
    train_briefly(target, config, tmp_path / "draft", vocab=95)
    draft = load_draft(tmp_path / "draft", target, "float32")
    ref_draft = DFlashDraftModel.from_pretrained(tmp_path / "draft", dtype=torch.float32).eval()
    prompt = list(range(10, 22))
    ours = generate(target, [prompt], draft=draft, max_new_tokens=12, block_size=4, impl="reference")
    plain = generate(target, [prompt], max_new_tokens=12, impl="reference")
    tokens, accepted = cache_free_dflash(hf, ref_draft, prompt, 12, 4)
    assert ours.tokens[0] == plain.tokens[0] == tokens
    assert ours.stats.accept_lengths[0] == accepted


def test_prefill_in_chunks_changes_nothing(hybrid_pair):
    """Prompts prefilled four positions at a time, one row per engine step (each chunk committed:
    ragged rows finish in different steps) give the same tokens and acceptance as one pass."""
    from dflash_jax.runtime.engine import Engine, RequestParams
    from dflash_jax.runtime.generation import run_requests

    _, _, target, draft = hybrid_pair
    prompts = _prompts(2)
    whole = generate(target, prompts, draft=draft, max_new_tokens=16, block_size=8, impl="reference")
    engine = Engine(target, draft, max_num_seqs=2, max_model_len=max(map(len, prompts)) + 16, block_size=8,
                    prefill_chunk=4, prefill_rows=1, impl="reference")
    assert engine.prefill_row_cap == 1    # a hybrid's calls keep to prefill_rows rows, however short
    requests, stats = run_requests(engine, prompts, [RequestParams(max_tokens=16)] * len(prompts))
    assert [r.token_ids for r in requests] == whole.tokens
    assert stats.accept_lengths == whole.stats.accept_lengths


def test_commit_ignores_non_finite_uncommitted_tokens():
    """Tokens past a row's committed count never reach its state, even non-finite ones (β = 0
    and g = 0 alone would let 0 x NaN through)."""
    from dflash_jax.model.nn import gated_deltanet
    from dflash_jax.model.nn.gated_deltanet import GatedDeltaNetSpec, PendingBlock

    spec = GatedDeltaNetSpec(num_key_heads=1, num_value_heads=2, key_dim=16, value_dim=16)
    rows, length = BLOCK + 1, BLOCK
    keys = jax.random.split(jax.random.key(8), 5)
    counts = jnp.arange(rows, dtype=jnp.int32)
    tail = jnp.arange(length)[None, :] >= counts[:, None]                   # [rows, T]: uncommitted
    inputs = jax.random.normal(keys[0], (rows, length, spec.conv_dim))
    block = PendingBlock(inputs=inputs, conv_weight=jax.random.normal(keys[1], (spec.conv_dim, 1, 4)),
                         decay=-jax.random.uniform(keys[2], (rows, length, 2)),
                         beta=jax.random.uniform(keys[3], (rows, length, 2)), spec=spec)
    conv = jax.random.normal(keys[4], (rows, 3, spec.conv_dim))
    state = jnp.ones((rows, 2, 16, 16))
    clean = gated_deltanet.advance(block.replace(inputs=jnp.where(tail[..., None], 0.0, inputs)), conv, state,
                                   counts, "reference")
    poisoned = gated_deltanet.advance(block.replace(inputs=jnp.where(tail[..., None], jnp.nan, inputs)), conv, state,
                                      counts, "reference")
    for ours, expected in zip(poisoned, clean):
        assert np.isfinite(np.asarray(ours)).all()
        np.testing.assert_array_equal(ours, expected)
