"""DFlash speculative decoding: losslessness, parity with the z-lab reference, draft internals,
draft variants (sliding window, scale options, speculators format) and config errors.

Reference: ``dflash.model.dflash_generate`` (bs=1) on the very same weights; ours runs the
prompts as one ragged batch through ``dflash_jax.entrypoints.generate.generate`` and every row must equal
the reference run of that prompt alone: tokens and per-step acceptance lengths.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from builders import make_copy_draft, save_draft, save_speculators_draft
from dflash_jax.model import draft as draft_model
from dflash_jax.model.cache import allocate_pages, init_cache
from dflash_jax.model.config import ConfigError
from dflash_jax.runtime.generation import generate
from dflash_jax.loading.models import Draft, load_draft
from dflash_jax.runtime.sampling import SamplingConfig

MAX_NEW = 48          # max over a batch: every call keeps it so compiled loops are shared
PROMPT_LENS = (7, 9, 11, 14)   # the copy construction needs >= 6


def _prompts(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    # the mask token (vocab - 1) never appears in a prompt
    return [rng.integers(0, vocab - 1, n).tolist() for n in PROMPT_LENS]


@functools.lru_cache(maxsize=None)
def _reference_cached(hf_draft, hf_target, prompt: tuple, max_new: int, stop: tuple | None, block: int | None):
    import dflash.model as dm

    out = dm.dflash_generate(hf_draft, hf_target, torch.tensor([list(prompt)]), max_new_tokens=max_new,
                             stop_token_ids=None if stop is None else list(stop), block_size=block,
                             return_stats=True)
    return out.output_ids[0, len(prompt):].tolist(), [int(n) for n in out.acceptance_lengths]


def reference(hf_draft, hf_target, prompt, max_new, stop=None, block=None):
    return _reference_cached(hf_draft, hf_target, tuple(prompt), int(max_new),
                             None if not stop else tuple(stop), block)


def _step_starts(accept):
    """Index (in the generated tokens) of each step's first token; token 0 comes from prefill."""
    return list(1 + np.concatenate([[0], np.cumsum(accept)[:-1]]).astype(int)) if accept else []


def _mid_block_stop(tokens, accept, limit):
    """A token whose first occurrence is inside a step, not its last token, before ``limit``."""
    for start, length in zip(_step_starts(accept), accept):
        for i in range(start, start + length - 1):
            if i < limit - 1 and tokens[i] not in tokens[:i]:
                return tokens[i], i
    return None


def _mid_block_cut(accept):
    """A max_new_tokens that ends inside the longest step (the step emits one token fewer)."""
    steps = [(length, start) for start, length in zip(_step_starts(accept), accept) if length >= 2]
    if not steps:
        return None
    length, start = max(steps)
    return start + length - 1


def _truncate(tokens, max_new, stop):
    out = tokens[:max_new]
    for i, token in enumerate(out):
        if stop and token in stop:
            return out[:i + 1]
    return out


@pytest.fixture(scope="module")
def baseline(spec_pair):
    """The target's own greedy output (plain decoding, no draft) for the shared prompts."""
    prompts = _prompts(spec_pair.target.config.vocab_size)
    out = generate(spec_pair.target, prompts, max_new_tokens=MAX_NEW, impl="reference")
    assert all(len(t) == MAX_NEW for t in out.tokens)
    return prompts, out.tokens


# ---------------------------------------------------------------------------------------------
# Losslessness and reference parity on the high-acceptance pair


def test_a_stop_token_just_past_the_cut_does_not_count(spec_pair, baseline):
    """Each row is cut at max_new_tokens c where its (c+1)-th greedy token, new until there, is
    its stop token: a block may propose that token, but the row must end at c, cut by length."""
    prompts, expected = baseline
    candidates = [[c for c in range(2, MAX_NEW - 1) if expected[b][c] not in expected[b][:c]] for b in range(4)]
    assert all(candidates)
    for k in range(3):
        cuts = [cands[min(k, len(cands) - 1)] for cands in candidates]
        out = generate(spec_pair.target, prompts, draft=spec_pair.draft, max_new_tokens=cuts,
                       stop_token_ids=[[expected[b][c]] for b, c in enumerate(cuts)], impl="reference")
        assert out.tokens == [expected[b][:c] for b, c in enumerate(cuts)]
        assert out.stats.finish_reasons == ["length"] * 4


def test_a_flat_stop_list_applies_to_every_row(spec_pair, baseline):
    prompts, expected = baseline
    stop = expected[1][6]
    flat = generate(spec_pair.target, prompts, draft=spec_pair.draft, max_new_tokens=MAX_NEW,
                    stop_token_ids=[stop], impl="reference")
    per_row = generate(spec_pair.target, prompts, draft=spec_pair.draft, max_new_tokens=MAX_NEW,
                       stop_token_ids=[[stop]] * 4, impl="reference")
    assert flat.tokens == per_row.tokens and flat.tokens[1] == expected[1][:expected[1].index(stop) + 1]


@pytest.mark.parametrize("block", [2, 4, 16])
def test_lossless_and_reference_parity_with_stops_and_cuts(spec_pair, baseline, block):
    pair = spec_pair
    prompts, expected = baseline
    free = generate(pair.target, prompts, draft=pair.draft, max_new_tokens=MAX_NEW, block_size=block,
                    impl="reference")
    assert free.tokens == expected, "greedy speculative output differs from the target's greedy output"
    assert free.stats.block_size == block
    for b, prompt in enumerate(prompts):
        ref_tokens, ref_accept = reference(pair.hf_draft, pair.hf_target, prompt, MAX_NEW, block=block)
        assert free.tokens[b] == ref_tokens
        assert free.stats.accept_lengths[b] == ref_accept, f"sequence {b}"
        assert max(ref_accept) <= block
    flat = [n for seq in free.stats.accept_lengths for n in seq]
    assert max(flat) > 1, "no step accepted a draft token: the pair is not exercising acceptance"
    if block == 16:
        assert np.mean(flat) > 2.0, f"mean acceptance {np.mean(flat):.2f}"
        assert len(set(flat)) >= 4, f"acceptance lengths not varied: {sorted(set(flat))}"

    # Per-sequence settings cut inside blocks: seq 0 untouched, seq 1 max_new_tokens ends inside
    # its longest step, seq 2 a stop token first seen inside a step, seq 3 both / a stop that never
    # comes.
    max_new = [MAX_NEW] * 4
    stops = [[] for _ in prompts]
    cut = _mid_block_cut(free.stats.accept_lengths[1])
    assert cut is not None
    max_new[1] = cut
    found = _mid_block_stop(free.tokens[2], free.stats.accept_lengths[2], MAX_NEW)
    assert found is not None, "no stop token candidate inside a block"
    stops[2] = [found[0]]
    found3 = _mid_block_stop(free.tokens[3], free.stats.accept_lengths[3], MAX_NEW)
    stops[3] = [found3[0]] if found3 else [pair.target.config.vocab_size - 1]
    max_new[3] = MAX_NEW - 5

    cut_run = generate(pair.target, prompts, draft=pair.draft, max_new_tokens=max_new, stop_token_ids=stops,
                       block_size=block, impl="reference")
    for b, prompt in enumerate(prompts):
        want = _truncate(expected[b], max_new[b], stops[b])
        assert cut_run.tokens[b] == want, f"sequence {b}"
        assert cut_run.stats.new_tokens[b] == len(want)
        ref_tokens, ref_accept = reference(pair.hf_draft, pair.hf_target, prompt, max_new[b], stops[b], block)
        assert cut_run.tokens[b] == ref_tokens, f"sequence {b} vs reference"
        assert cut_run.stats.accept_lengths[b] == ref_accept, f"sequence {b} acceptance vs reference"
        ended_at_stop = bool(want) and want[-1] in stops[b]
        assert cut_run.stats.finish_reasons[b] == ("stop" if ended_at_stop else "length"), f"sequence {b}"
    assert cut_run.stats.finish_reasons[:3] == ["length", "length", "stop"]
    # the cuts really fell inside steps: the last step emitted less than the uncut run did there
    for b in (1, 2):
        last = len(cut_run.stats.accept_lengths[b]) - 1
        assert cut_run.stats.accept_lengths[b][last] < free.stats.accept_lengths[b][last]
    assert cut_run.tokens[2][-1] == stops[2][0]


def test_random_weights_reference_parity(random_pair):
    pair = random_pair
    prompts = _prompts(pair.target.config.vocab_size, seed=1)
    max_new = [MAX_NEW, 33, MAX_NEW, 40]
    ours = generate(pair.target, prompts, draft=pair.draft, max_new_tokens=max_new, impl="reference")
    plain = generate(pair.target, prompts, max_new_tokens=max_new, impl="reference")
    assert ours.tokens == plain.tokens
    for b, prompt in enumerate(prompts):
        ref_tokens, ref_accept = reference(pair.hf_draft, pair.hf_target, prompt, max_new[b])
        assert ours.tokens[b] == ref_tokens
        assert ours.stats.accept_lengths[b] == ref_accept
        assert len(ours.tokens[b]) == max_new[b]


def test_stop_lists_first_token_stop_and_streaming(spec_pair, baseline):
    pair = spec_pair
    prompts, expected = baseline
    # seq 0 stops on its very first token; seq 1 has two stop tokens, the later one listed first
    stops = [[expected[0][0], 3], [expected[1][20], expected[1][6]], [], [1000, 1001]]
    chunks = []
    out = generate(pair.target, prompts, draft=pair.draft, max_new_tokens=MAX_NEW, stop_token_ids=stops,
                   impl="reference", chunk_steps=3, on_chunk=chunks.append)
    for b, prompt in enumerate(prompts):
        assert out.tokens[b] == _truncate(expected[b], MAX_NEW, stops[b])
        ref_tokens, ref_accept = reference(pair.hf_draft, pair.hf_target, prompt, MAX_NEW, stops[b])
        assert out.tokens[b] == ref_tokens and out.stats.accept_lengths[b] == ref_accept
    assert out.tokens[0] == [expected[0][0]] and out.stats.accept_lengths[0] == []
    assert out.stats.finish_reasons[0] == "stop" and out.stats.finish_reasons[3] == "length"
    assert out.stats.summary()["finish_reasons"] == out.stats.finish_reasons
    # streaming: the prefill's token first, then every chunk extends the previous one, the last
    # equals the result
    assert chunks[0] == [t[:1] for t in out.tokens] and len(chunks) >= 3
    for earlier, later in zip(chunks, chunks[1:]):
        for a, b in zip(earlier, later):
            assert b[:len(a)] == a
    assert chunks[-1] == out.tokens


def test_streaming_callbacks_time_is_neither_prefill_nor_decode_time(spec_pair, baseline, monkeypatch):
    """``on_chunk`` gets the tokens so far after each engine step that made some, and the time it
    takes counts in neither the prefill nor the decode time: a clock that only the callback
    advances reads zero (the programs compiled by a first run)."""
    import time

    prompts, expected = baseline
    generate(spec_pair.target, prompts, draft=spec_pair.draft, max_new_tokens=MAX_NEW, impl="reference",
             chunk_steps=3)
    clock, seen = [0.0], []
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])

    def on_chunk(tokens):
        seen.append(tokens)
        clock[0] += 100.0

    out = generate(spec_pair.target, prompts, draft=spec_pair.draft, max_new_tokens=MAX_NEW, impl="reference",
                   chunk_steps=3, on_chunk=on_chunk)
    assert out.tokens == expected and seen[-1] == expected and len(seen) >= 3
    # (tiny dispatch-time traces of the run still count, at the fake clock's readings)
    assert abs(out.stats.prefill_seconds) < 0.1 and abs(out.stats.decode_seconds) < 0.1


def test_a_decode_loop_that_never_finishes_is_an_error_not_a_hang(spec_pair, baseline, monkeypatch):
    """Every engine step runs a prompt chunk or emits a token for each decoding request, so
    ``run_requests`` knows how many steps can be needed; a chunk that made no progress (a bug)
    ends in an error naming the prompts, not in a loop that never returns."""
    from dflash_jax.runtime.decode import ChunkOutput
    from dflash_jax.runtime.engine import device

    def stuck(target, draft, state, rows, seen, seen_steps, replay_alpha, step_costs, max_steps, *, config, num_steps,
              steps_per_check):
        count, of = rows.shape[0], lambda x: jnp.take(x, rows, axis=0, mode="clip")  # noqa: E731
        return state, ChunkOutput(tokens=jnp.zeros((count, 2 * num_steps * config.block_size + 1), jnp.int32),
                                  num_generated=of(state.num_generated), done=of(state.done), steps=of(state.steps),
                                  accept_lengths=jnp.zeros((count, 2 * num_steps), jnp.int32),
                                  verified=jnp.zeros((count, 2 * num_steps), jnp.int32))

    monkeypatch.setattr(device, "engine_chunk", stuck)
    prompts, _ = baseline
    with pytest.raises(RuntimeError, match=r"prompts \[0, 1, 2, 3\] were not done after \d+ engine steps"):
        generate(spec_pair.target, prompts, draft=spec_pair.draft, max_new_tokens=MAX_NEW, impl="reference")


def test_token_id_0_stops_a_row_like_any_other_stop_id():
    """Stop lists are padded with -1: id 0 is a real token id and must count as a stop."""
    from dflash_jax.runtime.decode import _is_stop

    hits = _is_stop(jnp.asarray([[0, 3, 7, 0]]), jnp.asarray([[0, -1, -1, -1]]))
    assert np.asarray(hits).tolist() == [[True, False, False, True]]


def test_steps_per_check_changes_nothing_but_speed(spec_pair, baseline):
    """Checking for finished rows every 4 steps instead of every step: rows that stop mid-group
    (first token, later stop tokens, max_new_tokens) come out exactly the same, stats included."""
    pair = spec_pair
    prompts, expected = baseline
    stops = [[expected[0][0]], [expected[1][6]], [], [1000]]
    runs = [generate(pair.target, prompts, draft=pair.draft, max_new_tokens=[MAX_NEW, MAX_NEW, 5, MAX_NEW],
                     stop_token_ids=stops, impl="reference", chunk_steps=8, steps_per_check=k)
            for k in (1, 4)]
    assert runs[0].tokens == runs[1].tokens
    assert runs[0].stats.accept_lengths == runs[1].stats.accept_lengths
    with pytest.raises(ValueError, match="steps_per_check"):
        generate(pair.target, prompts, draft=pair.draft, max_new_tokens=MAX_NEW, impl="reference",
                 chunk_steps=6, steps_per_check=4)


def test_embedding_scale_rounds_as_torch_does(spec_pair):
    """bf16 embeddings times input_embedding_scale: the product of the bf16 values and the f32
    scale, rounded once (the reference multiplies a bf16 tensor by a Python float), not the
    product with the scale rounded to bf16 first (which differs in about a third of entries)."""
    import types
    config = dataclasses.replace(spec_pair.draft.config, input_embedding_scale=50.596)
    embed = jnp.asarray(np.random.default_rng(0).standard_normal((64, 32)), jnp.bfloat16)
    block = jnp.arange(64).reshape(4, 16)
    ours = draft_model.embed_block(config, types.SimpleNamespace(embed=embed), block)
    theirs = torch.from_numpy(np.asarray(embed[block], np.float32)).to(torch.bfloat16) * 50.596
    np.testing.assert_array_equal(np.asarray(ours, np.float32), theirs.float().numpy())


def test_64_bit_mode(spec_pair, baseline):
    """With jax's 64-bit mode on (JAX_ENABLE_X64), the loop's integers stay int32: greedy
    DFlash still equals the target's greedy output (stops included), and sampling runs."""
    pair = spec_pair
    prompts, expected = baseline
    with jax.enable_x64(True):
        out = generate(pair.target, prompts, draft=pair.draft, max_new_tokens=MAX_NEW,
                       stop_token_ids=[[expected[1][6]]] * len(prompts), impl="reference")
        sampled = generate(pair.target, prompts, draft=pair.draft, max_new_tokens=8, impl="reference",
                           sampling=SamplingConfig(temperature=0.8, top_p=0.9, top_k=20))
    assert out.tokens == [_truncate(t, MAX_NEW, [expected[1][6]]) for t in expected]
    assert all(len(t) == 8 for t in sampled.tokens)


def test_draft_sees_only_the_real_block_near_max_new(spec_pair, monkeypatch):
    """Near max_new_tokens the reference drafts a shorter block (verify_size = remaining + 1); ours
    keeps the block shape and must hand the draft block_lens = min(remaining + 1, block). Spied
    on inside the compiled loop (batch of 3: a shape no other test compiles)."""
    import jax

    calls = []
    original = draft_model.block_hidden

    def spy(params, config, target, block, cache, block_lens, **kwargs):
        jax.debug.callback(lambda lens, lengths: calls.append((np.asarray(lens), np.asarray(lengths))),
                           block_lens, cache.lengths)
        return original(params, config, target, block, cache, block_lens, **kwargs)

    monkeypatch.setattr(draft_model, "block_hidden", spy)
    prompts = _prompts(spec_pair.target.config.vocab_size)[:3]
    max_new = [5, 30, 12]
    out = generate(spec_pair.target, prompts, draft=spec_pair.draft, max_new_tokens=max_new, impl="reference")
    assert [len(t) for t in out.tokens] == max_new
    checked = 0
    for lens, lengths in calls:
        for b, prompt in enumerate(prompts):
            generated = lengths[b] - len(prompt) + 1     # the last emitted token is not yet committed
            remaining = max_new[b] - generated
            if remaining >= 1:                           # still active
                assert lens[b] == min(remaining + 1, 16), (b, remaining, lens[b])
                checked += 1
    assert checked >= 3 and any(lens.min() < 16 for lens, _ in calls)


# ---------------------------------------------------------------------------------------------
# Draft internals vs the reference module


def _reference_block(hf_target, hf_draft, context, block_tokens):
    """Reference context features, draft hidden and draft logits for one block after ``context``."""
    import dflash.model as dm

    with torch.no_grad():
        states = hf_target(torch.tensor([context]), output_hidden_states=True).hidden_states
        target_hidden = dm.extract_context_feature(states, hf_draft.target_layer_ids)
        features = hf_draft.hidden_norm(hf_draft.fc(target_hidden))
        scale = float(dm._draft_value(hf_draft.config, "input_embedding_scale", 1.0))
        noise = dm._raw_input_embeddings(hf_target, torch.tensor([block_tokens]), scale)
        positions = torch.arange(len(context) + len(block_tokens))[None]
        hidden = hf_draft(target_hidden=target_hidden, noise_embedding=noise, position_ids=positions,
                          past_key_values=None, use_cache=False)
        logits = hf_draft.compute_logits(hidden[:, 1:], dm._output_head(hf_target))
    return target_hidden[0].numpy(), features[0].numpy(), hidden[0].numpy(), logits[0].numpy()


def _check_draft_internals(hf_target, hf_draft, target, draft, context_lens=(7, 12, 9), short_block=5,
                           page_size=4, impl="reference"):
    """Ragged contexts in one batch, pages permuted and NaN-poisoned, vs the reference per row
    (``impl``: ours through the plain references or the kernels in interpret mode).

    The last row's block is cut to ``short_block`` tokens (as near max_new_tokens): the reference
    runs that shorter block, we run the full one with block_lens masking the rest."""
    config, params = draft.config, draft.params
    vocab = target.config.vocab_size
    block = config.block_size
    block_lens = [block] * (len(context_lens) - 1) + [short_block]
    rng = np.random.default_rng(5)
    contexts = [rng.integers(0, vocab - 1, n).tolist() for n in context_lens]
    refs = [_reference_block(hf_target, hf_draft, ctx, [ctx[-1]] + [config.mask_token_id] * (length - 1))
            for ctx, length in zip(contexts, block_lens)]
    width = max(context_lens)
    taps = np.zeros((len(contexts), width, refs[0][0].shape[-1]), np.float32)
    for b, (ref, n) in enumerate(zip(refs, context_lens)):
        taps[b, :n] = ref[0]
    features = np.asarray(draft_model.context_features(params, config, jnp.asarray(taps)))
    need = [width + block] * len(contexts)
    table, num_pages = allocate_pages(need, page_size, sum(-(-n // page_size) for n in need) + 3,
                                      rng=np.random.default_rng(3))
    cache = init_cache(target.config, config.model,
                       table, num_pages, page_size, jnp.float32, fill=float("nan"))
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (len(contexts), width))
    cache = draft_model.write_context(params, config, jnp.asarray(taps), positions, cache, impl=impl)
    cache = cache.replace(lengths=jnp.asarray(context_lens, jnp.int32))
    blocks = jnp.asarray([[ctx[-1]] + [config.mask_token_id] * (block - 1) for ctx in contexts], jnp.int32)
    hidden = draft_model.block_hidden(params, config, target.params, blocks, cache,
                                      jnp.asarray(block_lens, jnp.int32), impl=impl)
    logits = np.asarray(draft_model.draft_logits(params, config, target.params, hidden[:, 1:]))
    hidden = np.asarray(hidden)
    for b, (ref, n, length) in enumerate(zip(refs, context_lens, block_lens)):
        _, ref_features, ref_hidden, ref_logits = ref
        np.testing.assert_allclose(features[b, :n], ref_features, rtol=1e-5, atol=2e-5)
        np.testing.assert_allclose(hidden[b, :length], ref_hidden, rtol=1e-5, atol=2e-5)
        np.testing.assert_allclose(logits[b, :length - 1], ref_logits, rtol=1e-5, atol=2e-5)
        assert (np.argmax(logits[b, :length - 1], -1) == np.argmax(ref_logits, -1)).all()
    return refs


def test_draft_internals_match_reference(random_pair):
    _check_draft_internals(random_pair.hf_target, random_pair.hf_draft, random_pair.target, random_pair.draft)


# ---------------------------------------------------------------------------------------------
# The Pallas kernels forced on (interpret mode) against the same references


@pytest.mark.parametrize("impl", ["interpret", "interpret-tpu"])
def test_kernels_lossless_and_reference_parity(spec_pair, baseline, impl):
    """Long accepted runs (steps that commit many tokens) through every kernel (GPU's, or TPU's in
    TPU interpret mode): tokens equal the target's greedy output and dflash_generate's,
    acceptance lengths equal dflash_generate's."""
    prompts, expected = baseline
    max_new = MAX_NEW
    if impl == "interpret-tpu":  # the TPU interpreter runs kernels slowly: two rows, half the tokens
        prompts, expected, max_new = prompts[:2], [t[:MAX_NEW // 2] for t in expected[:2]], MAX_NEW // 2
    out = generate(spec_pair.target, prompts, draft=spec_pair.draft, max_new_tokens=max_new, impl=impl)
    assert out.tokens == expected
    for b, prompt in enumerate(prompts):
        ref_tokens, ref_accept = reference(spec_pair.hf_draft, spec_pair.hf_target, prompt, max_new)
        assert out.tokens[b] == ref_tokens and out.stats.accept_lengths[b] == ref_accept, f"sequence {b}"
    assert np.mean([n for seq in out.stats.accept_lengths for n in seq]) > 2.0


def test_kernels_sample_what_the_references_sample(spec_pair, baseline):
    """Sampled speculation (drafts drawn from q, accepted against p, residual draws) through every
    kernel draws what the references draw from the same seed: the kernels change p and q only by
    float rounding, far below what moves a draw, while a wrong q or p moves the acceptances."""
    prompts, greedy = baseline
    kwargs = dict(draft=spec_pair.draft, max_new_tokens=MAX_NEW, seed=3,
                  sampling=SamplingConfig(temperature=1.0, top_p=0.95))
    sampled = generate(spec_pair.target, prompts, impl="reference", **kwargs)
    kernels = generate(spec_pair.target, prompts, impl="interpret", **kwargs)
    assert kernels.tokens == sampled.tokens
    assert kernels.stats.accept_lengths == sampled.stats.accept_lengths
    assert sampled.tokens != greedy and np.mean([n for seq in sampled.stats.accept_lengths for n in seq]) > 1.5


def test_kernels_draft_internals_match_reference(random_pair, spec_pair, sliding_draft):
    """The draft's context writes, q/k/v and attention kernels (a sliding-window causal layer
    included) against the reference module's features, hidden states and logits."""
    _check_draft_internals(random_pair.hf_target, random_pair.hf_draft, random_pair.target, random_pair.draft,
                           impl="interpret")
    hf_draft, draft = sliding_draft
    _check_draft_internals(spec_pair.hf_target, hf_draft, spec_pair.target, draft, impl="interpret")


# ---------------------------------------------------------------------------------------------
# Draft variants: sliding-window layers, embedding/logit scale options, speculators format


def _strengthen_attention(hf_draft, layer: int, factor: float = 3.0):
    """Scale one draft layer's attention weights up so that what it attends to (its mask, the
    block's real length) shows in the draft's output."""
    attn = hf_draft.layers[layer].self_attn
    with torch.no_grad():
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            proj.weight.mul_(factor)
    return hf_draft


def _variant(spec_pair, tmp_path_factory, name, **kwargs):
    hf_draft = _strengthen_attention(make_copy_draft(spec_pair.hf_target, **kwargs), 1)
    path = save_draft(hf_draft, tmp_path_factory.mktemp(name))
    return hf_draft, load_draft(path, spec_pair.target, "float32")


@pytest.fixture(scope="module")
def sliding_draft(spec_pair, tmp_path_factory):
    # layer 0 copies (full attention, non-causal); layer 1 (strengthened) is a sliding-window layer
    # (window 3, causal by the reference's rule); the draft has its own rope theta
    return _variant(spec_pair, tmp_path_factory, "sliding", seed=103, rope_theta=5e4,
                    layer_types=("full_attention", "sliding_attention"), sliding_window=3)


@pytest.fixture(scope="module")
def scaled_draft(spec_pair, tmp_path_factory):
    # also taps the target's last layer (HF stores it final-normed)
    return _variant(spec_pair, tmp_path_factory, "scaled", seed=104, target_layer_ids=(0, 3),
                    extra={"input_embedding_scale": 1.5, "output_multiplier": 0.7,
                           "final_logit_softcapping": 2.0})


def _assert_matches_reference(spec_pair, hf_draft, draft):
    """Tokens and per-step acceptance lengths equal dflash_generate's for every prompt; short
    max_new_tokens shorten every block of those rows (the draft sees only the real ones)."""
    prompts = _prompts(spec_pair.target.config.vocab_size)
    max_new = [MAX_NEW, 12, 9, 15]
    out = generate(spec_pair.target, prompts, draft=draft, max_new_tokens=max_new, impl="reference")
    for b, prompt in enumerate(prompts):
        ref_tokens, ref_accept = reference(hf_draft, spec_pair.hf_target, prompt, max_new[b])
        assert out.tokens[b] == ref_tokens and out.stats.accept_lengths[b] == ref_accept, f"sequence {b}"
    return out


def test_sliding_window_draft_internals_and_parity(spec_pair, sliding_draft):
    hf_draft, draft = sliding_draft
    assert draft.config.model.layer_types == ("full_attention", "sliding_attention")
    assert draft.config.model.sliding_window == 3
    assert draft.config.causal_layers == (False, True)   # the reference's default for sliding layers
    _check_draft_internals(spec_pair.hf_target, hf_draft, spec_pair.target, draft)
    out = _assert_matches_reference(spec_pair, hf_draft, draft)
    assert max(n for seq in out.stats.accept_lengths for n in seq) > 1


def test_scale_options_draft_internals_and_parity(spec_pair, scaled_draft):
    hf_draft, draft = scaled_draft
    config = draft.config
    assert (config.input_embedding_scale, config.output_multiplier, config.final_logit_softcapping) == (1.5, 0.7, 2.0)
    refs = _check_draft_internals(spec_pair.hf_target, hf_draft, spec_pair.target, draft)
    capped = np.abs(np.concatenate([r[3] for r in refs]))
    assert capped.max() <= 2.0 and capped.max() > 1.5   # the softcap is really in play
    out = _assert_matches_reference(spec_pair, hf_draft, draft)
    assert np.mean([n for seq in out.stats.accept_lengths for n in seq]) > 2.0


def test_speculators_full_vocab_equals_zlab(spec_pair, tmp_path_factory):
    path = save_speculators_draft(spec_pair.hf_draft, spec_pair.hf_target, tmp_path_factory.mktemp("spec_full"))
    draft = load_draft(path, spec_pair.target, "float32")
    zlab = spec_pair.draft.config
    assert draft.config.source_format == "speculators"
    assert draft.config.target_layer_ids == zlab.target_layer_ids
    assert (draft.config.block_size, draft.config.mask_token_id) == (zlab.block_size, zlab.mask_token_id)
    assert draft.config.draft_vocab_size is None and draft.params.lm_head is None
    prompts = _prompts(spec_pair.target.config.vocab_size)
    ours = generate(spec_pair.target, prompts, draft=draft, max_new_tokens=MAX_NEW, impl="reference")
    theirs = generate(spec_pair.target, prompts, draft=spec_pair.draft, max_new_tokens=MAX_NEW, impl="reference")
    assert ours.tokens == theirs.tokens
    assert ours.stats.accept_lengths == theirs.stats.accept_lengths


def test_speculators_reduced_vocab_lossless(spec_pair, baseline, tmp_path_factory):
    prompts, expected = baseline
    vocab = spec_pair.target.config.vocab_size
    emitted = sorted({t for seq in expected for t in seq})
    rng = np.random.default_rng(9)
    size = len(emitted) + 8
    others = [t for t in rng.permutation(vocab).tolist() if t not in emitted]
    covering = sorted(emitted + others[:size - len(emitted)])
    # same draft vocab size (shared compile), but missing the two most frequent emitted tokens:
    # still lossless
    counts = np.bincount(np.concatenate(expected), minlength=vocab)
    dropped = set(np.argsort(-counts)[:2].tolist())
    partial = sorted([t for t in covering if t not in dropped] + others[size - len(emitted):][:len(dropped)])
    assert len(partial) == len(covering)
    zlab = generate(spec_pair.target, prompts, draft=spec_pair.draft, max_new_tokens=MAX_NEW, impl="reference")
    for name, selected in (("covering", covering), ("partial", partial)):
        path = save_speculators_draft(spec_pair.hf_draft, spec_pair.hf_target,
                                      tmp_path_factory.mktemp(f"spec_{name}"), selected_ids=selected)
        draft = load_draft(path, spec_pair.target, "float32")
        assert draft.config.draft_vocab_size == len(selected)
        assert (np.asarray(draft.params.d2t) + np.arange(len(selected))).tolist() == selected
        out = generate(spec_pair.target, prompts, draft=draft, max_new_tokens=MAX_NEW, impl="reference")
        assert out.tokens == expected, name   # lossless whatever the draft vocabulary
        if name == "covering":
            # the draft proposes from the selected rows only, which hold every token the target emits
            assert out.tokens == zlab.tokens
            assert np.mean([n for seq in out.stats.accept_lengths for n in seq]) > 2.0


# ---------------------------------------------------------------------------------------------
# Errors before any compute


def _config_only_draft(tmp_path, pair, edit):
    raw = json.loads((pair.draft_dir / "config.json").read_text())
    edit(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path   # no weights: load_draft must fail on the config alone


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw.update(hidden_size=32, head_dim=8), "hidden_size"),
    (lambda raw: raw.update(vocab_size=256), "vocab_size"),
    (lambda raw: raw["dflash_config"].update(target_layer_ids=[1, 4]), "target_layer_ids"),
    (lambda raw: raw["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda raw: raw["dflash_config"].update(mask_token_id=128), "mask_token_id"),
], ids=["hidden", "vocab", "layer-ids", "no-mask", "mask-outside-vocab"])
def test_draft_config_errors(spec_pair, tmp_path, edit, message):
    folder = _config_only_draft(tmp_path, spec_pair, edit)
    with pytest.raises(ConfigError, match=message):
        load_draft(folder, spec_pair.target, "float32")


@pytest.mark.parametrize("change, message", [
    (dict(model_hidden=32), "hidden_size"),
    (dict(model_vocab=100), "vocab_size"),
    (dict(target_layer_ids=(1, 9)), "target_layer_ids"),
], ids=["hidden", "vocab", "layer-ids"])
def test_generate_rejects_mismatched_draft_before_compute(spec_pair, change, message):
    config = spec_pair.draft.config
    model = config.model
    if "model_hidden" in change:
        model = dataclasses.replace(model, hidden_size=change["model_hidden"])
    if "model_vocab" in change:
        model = dataclasses.replace(model, vocab_size=change["model_vocab"])
    bad = dataclasses.replace(config, model=model,
                              target_layer_ids=change.get("target_layer_ids", config.target_layer_ids))
    with pytest.raises(ConfigError, match=message):
        # params=None: any attempt to compute would fail differently
        generate(spec_pair.target, [[1, 2, 3]], draft=Draft(bad, None), max_new_tokens=4, impl="reference")


def test_the_capacity_error_names_the_prompt_and_what_fits(spec_pair):
    """A prompt too long for the model's positions with its new tokens is named with what would
    fit, before any compile."""
    limit = spec_pair.target.config.max_position_embeddings
    with pytest.raises(ValueError, match=rf"prompt 1 has 88 tokens: with max_new_tokens {limit - 80} it needs "
                                         rf"{limit + 8} positions, .* \(at most {limit - 88} new tokens fit after it\)"):
        generate(spec_pair.target, [[1], list(range(2, 90))], max_new_tokens=limit - 80, impl="reference")
    with pytest.raises(ValueError, match="the prompt alone is too long"):
        generate(spec_pair.target, [[1] * limit], max_new_tokens=1, impl="reference")


@pytest.mark.parametrize("kwargs, error", [
    ({"prompts": [[1.0, 2.0, 3.0]]}, "prompt 0 must be a sequence of integers"),
    ({"max_new_tokens": 3.9}, "max_new_tokens must be a sequence of integers"),
    ({"stop_token_ids": [5, [6]]}, "stop_token_ids has 2 entries for 1 prompts"),
    ({"prompts": [[1, 2], [3]], "stop_token_ids": [5, [6]]}, r"stop_token_ids\[0\] must be a sequence of integers"),
    ({"stop_token_ids": [5.0]}, "stop_token_ids must be a sequence of integers"),
    ({"accept_replay": -0.5}, r"accept_replay \(an acceptance probability\) must be in \[0, 1\], got -0.5"),
    ({"accept_replay": 0.5, "draft": None}, "accept_replay replays the acceptance of a draft's proposals"),
    ({"sampling": "top_k=2.5"}, "top_k must be an integer >= 0, got 2.5"),
])
def test_generate_refuses_what_it_would_truncate_or_ignore(spec_pair, kwargs, error):
    """Floats where ids or counts go (they would be truncated), a stop list mixing forms, a
    replay probability outside [0, 1] or without a draft, a fractional top_k: a ValueError naming
    the argument, before any compile."""
    args = {"prompts": [[1, 2, 3]], "draft": spec_pair.draft, "max_new_tokens": 4, **kwargs}
    with pytest.raises(ValueError, match=error):
        if args.get("sampling") == "top_k=2.5":
            SamplingConfig(temperature=1.0, top_k=2.5)
        generate(spec_pair.target, args.pop("prompts"), impl="reference", **args)


def test_stop_ids_as_arrays_one_id_and_outside_the_vocabulary(spec_pair, baseline):
    """A numpy or jax array, or one int, is one stop list for every row; ids outside the
    vocabulary are named in a warning (they can never stop a sequence)."""
    prompts, expected = baseline
    stop = expected[1][6]
    want = generate(spec_pair.target, prompts, draft=spec_pair.draft, max_new_tokens=MAX_NEW,
                    stop_token_ids=[[stop]] * 4, impl="reference").tokens
    for form in (np.asarray([stop]), jnp.asarray([stop]), stop, np.int32(stop)):
        got = generate(spec_pair.target, prompts, draft=spec_pair.draft, max_new_tokens=MAX_NEW,
                       stop_token_ids=form, impl="reference").tokens
        assert got == want, type(form)
    vocab = spec_pair.target.config.vocab_size
    with pytest.warns(UserWarning, match=rf"stop token id\(s\) \[{vocab}\] lie outside the vocabulary"):
        generate(spec_pair.target, prompts[:1], max_new_tokens=2, stop_token_ids=[stop, vocab], impl="reference")


def test_kv_cache_that_does_not_fit_the_device_is_refused(spec_pair, monkeypatch):
    """Too little device memory beside the weights for even one request's pages: an error saying
    so before any compute (with room for some, requests wait for pages: test_engine)."""
    from dflash_jax.model import cache

    class Device:
        def memory_stats(self):
            return {"bytes_limit": 2**16, "bytes_in_use": 2**15}

    monkeypatch.setattr(cache.jax, "local_devices", lambda: [Device()])
    with pytest.raises(ValueError, match=r"the device has 0.00 GiB free beside the weights: not even one request "
                                         r"of max_model_len \d+ fits"):
        generate(spec_pair.target, [[1, 2, 3]] * 8, draft=spec_pair.draft, max_new_tokens=200, impl="reference")


@pytest.mark.parametrize("block", [0, 1, 17])
def test_block_size_out_of_range(spec_pair, block):
    with pytest.raises(ValueError, match="block_size"):
        generate(spec_pair.target, [[1, 2, 3]], draft=spec_pair.draft, max_new_tokens=4, block_size=block,
                 impl="reference")


def test_reduced_vocab_draft_logits_keep_other_ids_impossible_under_a_soft_cap():
    """The multiplier and soft cap shape the draft vocabulary's logits before they are scattered
    to target ids, so ids outside it stay -inf (a cap applied after would make them -cap)."""
    from types import SimpleNamespace

    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 8)), jnp.float32)
    head = jnp.asarray(np.random.default_rng(1).standard_normal((8, 4)) * 10, jnp.float32)
    params = SimpleNamespace(lm_head=head, d2t=jnp.asarray([1, 2, 4, 6], jnp.int32))   # target ids 1, 3, 6, 9
    config = SimpleNamespace(output_multiplier=0.5, final_logit_softcapping=5.0, model=SimpleNamespace(vocab_size=12))
    logits = np.asarray(draft_model.draft_logits(params, config, None, hidden))
    inside = [1, 3, 6, 9]
    expected = np.tanh(np.asarray(hidden @ head) * 0.5 / 5.0) * 5.0
    np.testing.assert_allclose(logits[..., inside], expected, rtol=1e-6)
    assert np.isneginf(np.delete(logits, inside, axis=-1)).all()


def test_nearby_batches_reuse_the_compiled_functions(spec_pair, compilations):
    """Batches whose slot counts, contexts and stop lists round to the same sizes
    (``generation.batch_engine``'s) compile nothing new."""
    vocab = spec_pair.target.config.vocab_size

    def run(lens, max_new, stops):
        prompts = [[(7 * i + j) % vocab for j in range(n)] for i, n in enumerate(lens)]
        generate(spec_pair.target, prompts, draft=spec_pair.draft, max_new_tokens=max_new, stop_token_ids=stops,
                 block_size=4, impl="reference")
    run([9, 20, 5], 24, [5, 6, 7])
    with compilations() as compiled:
        run([10, 21, 4, 7], 23, [5, 6, 7, 8])
    assert compiled == []


def test_draft_loads_in_the_targets_dtype_and_mixed_dtypes_are_refused(spec_pair):
    from dflash_jax.model.params import cast_params

    assert load_draft(spec_pair.draft.path, spec_pair.target).params.fc.dtype == spec_pair.target.params.embed.dtype
    bf16 = Draft(spec_pair.draft.config, cast_params(spec_pair.draft.params, jnp.bfloat16), spec_pair.draft.path)
    with pytest.raises(ValueError, match="load both in one dtype"):
        generate(spec_pair.target, [[1, 2, 3]], draft=bf16, max_new_tokens=4, impl="reference")
