"""DFlash2 drafts (the PyPI reference's DFlash2DraftModel): the grouped dynamic causal convolution
around each draft sublayer and the candidate selector, against the reference's modules and its
``dflash_generate`` (tokens and acceptance lengths) on a Qwen3 and a gpt-oss target; mutants
without the convolution or the selector change the acceptance, so the comparisons can fail.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from builders import as_dflash2, make_copy_draft, make_copy_target, make_zlab_draft, save_draft, save_target
from checkpoints_convert import export_draft
from dflash_jax.model import selector as selector_module
from dflash_jax.model.hf_config import draft_config_from_hf
from dflash_jax.runtime.generation import generate
from dflash_jax.loading.models import load_draft, load_target
from dflash_jax.model.nn import dynamic_conv
from dflash_jax.model.nn.dynamic_conv import ConvParams, ConvSpec
from dflash_jax.model.selector import SelectorParams, SelectorSpec

MAX_NEW = 40


def test_convolution_equals_the_references_module():
    from dflash.model import GroupedDynamicCausalConv

    torch.manual_seed(0)
    module = GroupedDynamicCausalConv(32, 3, 8)
    with torch.no_grad():
        module.base_kernel.normal_(0, 0.5)
        module.kernel_projection.weight.normal_(0, 0.3)
    x, y = torch.randn(2, 7, 32), torch.randn(2, 7, 32)
    with torch.no_grad():
        ref_in, dynamic = module.prepare(x)
        ref_out = module.finish(y, dynamic)
    params = ConvParams(base_kernel=jnp.asarray(module.base_kernel.detach().numpy()),
                        kernel_projection=jnp.asarray(module.kernel_projection.weight.detach().numpy().T))
    spec = ConvSpec(3, 8)
    ours_in, ours_dynamic = dynamic_conv.prepare(jnp.asarray(x.numpy()), params, spec)
    np.testing.assert_allclose(np.asarray(ours_in), ref_in.numpy(), rtol=1e-5, atol=1e-5)
    ours_out = dynamic_conv.finish(jnp.asarray(y.numpy()), ours_dynamic, params, spec)
    np.testing.assert_allclose(np.asarray(ours_out), ref_out.numpy(), rtol=1e-5, atol=1e-5)
    # causal within the block: position t reads nothing after it
    bumped = x.clone()
    bumped[:, 4] += 1.0
    moved = np.asarray(dynamic_conv.prepare(jnp.asarray(bumped.numpy()), params, spec)[0]) - np.asarray(ours_in)
    assert np.abs(moved[:, :4]).max() == 0 and np.abs(moved[:, 4:]).max() > 0


def _selector_pair(vocab=40, hidden=16, rank=6, top_k=5, seed=0):
    from dflash.model import CandidateSelector
    from transformers import Qwen3Config

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden,
                         dflash_config={"selector_rank": rank, "selector_top_k": top_k})
    module = CandidateSelector(config)
    with torch.no_grad():
        for tensor in module.parameters():
            tensor.normal_(0, 0.7)
    params = SelectorParams(predecessor_codebook=jnp.asarray(module.predecessor_codebook.weight.detach().numpy()),
                            successor_codebook=jnp.asarray(module.successor_codebook.weight.detach().numpy()),
                            hidden_projection=jnp.asarray(module.hidden_projection.weight.detach().numpy().T))
    return module, params, SelectorSpec(rank, top_k)


def test_greedy_selector_path_equals_the_references():
    """The left-to-right path at temperature 0, over distinct logits, and a path that leaves the
    per-position argmax somewhere (the bigram term decides)."""
    module, params, spec = _selector_pair()
    rng = np.random.default_rng(1)
    differs = False
    for trial in range(8):
        hidden = torch.tensor(rng.standard_normal((3, 6, 16)), dtype=torch.float32)
        logits = torch.tensor(rng.standard_normal((3, 6, 40)) * 2, dtype=torch.float32)
        anchor = torch.tensor(rng.integers(0, 40, 3))
        with torch.no_grad():
            path, _, _ = module.select(hidden, logits, anchor, 0.0)
        ours, candidates, probs = selector_module.select(params, spec, jnp.asarray(hidden.numpy()),
                                                         jnp.asarray(logits.numpy()), jnp.asarray(anchor.numpy()),
                                                         None, None)
        assert probs is None and np.asarray(ours).tolist() == path.tolist()
        differs |= bool((path != logits.argmax(-1)).any())
    assert differs


@pytest.mark.parametrize("vocab,chunk,k", [(1000, 16, 8), (1024, 32, 5), (300, 8, 16), (160, 4, 16), (97, 128, 4)])
def test_chunked_top_k_equals_one_rounds(vocab, chunk, k):
    """Values and indices of the chunked top k equal jax.lax.top_k's: many ties (small integer
    logits: the lower index first, across chunks too), rows all or half -inf, a vocabulary not a
    multiple of the chunk, chunks smaller than k, and as few chunks as k (one top k)."""
    rng = np.random.default_rng(vocab + chunk + k)
    x = rng.integers(-3, 4, (3, 5, vocab)).astype(np.float32)
    x[0, 0, :] = -np.inf
    x[1, 2, rng.permutation(vocab)[:vocab // 2]] = -np.inf
    want_values, want_ids = jax.lax.top_k(jnp.asarray(x), k)
    values, ids = selector_module.chunked_top_k(jnp.asarray(x), k, chunk)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))


def test_sampled_selector_rows_are_the_tempered_softmax_of_the_scores():
    """At T > 0 each row of q is softmax(score / T) over the k candidates given the token drawn
    before it; a row at T = 0 among sampled ones is one-hot at its best score."""
    module, params, spec = _selector_pair(seed=3)
    rng = np.random.default_rng(2)
    hidden = jnp.asarray(rng.standard_normal((2, 4, 16)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((2, 4, 40)) * 2, jnp.float32)
    anchor = jnp.asarray([3, 17])
    temperature = jnp.asarray([0.7, 0.0])
    path, candidates, probs = selector_module.select(params, spec, hidden, logits, anchor, temperature,
                                                     jax.random.key(0))
    prev = np.asarray(anchor)
    for t in range(4):
        unary = np.take_along_axis(np.asarray(logits[:, t]), np.asarray(candidates[:, t]), axis=-1)
        bigram = np.asarray(params.predecessor_codebook)[prev] * (np.asarray(hidden[:, t]) @ np.asarray(
            params.hidden_projection))
        scores = unary + np.einsum("br,bkr->bk", bigram, np.asarray(params.successor_codebook)[
            np.asarray(candidates[:, t])])
        expected = np.exp(scores[0] / 0.7 - (scores[0] / 0.7).max())
        np.testing.assert_allclose(np.asarray(probs[0, t]), expected / expected.sum(), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(probs[1, t]), np.eye(5)[scores[1].argmax()])
        prev = np.asarray(path[:, t])
        assert all(prev[b] in np.asarray(candidates[b, t]) for b in range(2))
    dense = selector_module.dense_probs(candidates, probs, 40)
    np.testing.assert_allclose(np.asarray(dense.sum(-1)), 1.0, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# End to end against dflash_generate


@pytest.fixture(scope="module")
def qwen3_dflash2(tmp_path_factory):
    """The copying Qwen3 pair, its draft turned DFlash2 (varied acceptance)."""
    root = tmp_path_factory.mktemp("dflash2")
    hf_target = make_copy_target()
    hf_draft = as_dflash2(make_copy_draft(hf_target), group_size=8)
    target = load_target(save_target(hf_target, root / "target"), "float32")
    folder = save_draft(hf_draft, root / "draft")
    return hf_target, hf_draft, target, load_draft(folder, target, "float32"), folder


def _prompts(vocab, seed=0, lens=(7, 11, 14)):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab - 1, n).tolist() for n in lens]


def _reference_runs(hf_draft, hf_target, prompts, max_new=MAX_NEW, block=None):
    import dflash.model as dm

    runs = []
    for prompt in prompts:
        out = dm.dflash_generate(hf_draft, hf_target, torch.tensor([prompt]), max_new_tokens=max_new,
                                 stop_token_ids=None, block_size=block, return_stats=True)
        runs.append((out.output_ids[0, len(prompt):].tolist(), [int(n) for n in out.acceptance_lengths]))
    return runs


@pytest.mark.parametrize("block,impl", [(None, "reference"), (6, "reference"), (None, "interpret-tpu")])
def test_dflash2_greedy_tokens_and_acceptance_equal_the_reference(qwen3_dflash2, block, impl, monkeypatch):
    import dflash.model as dm

    monkeypatch.setattr(dm, "_cuda_time", lambda: 0.0)
    hf_target, hf_draft, target, draft, _ = qwen3_dflash2
    assert draft.config.selector == SelectorSpec(6, 5) and draft.config.model.layers[0].conv == ConvSpec(2, 8)
    rows, max_new = (3, MAX_NEW) if impl == "reference" else (1, 16)  # the TPU interpreter runs kernels slowly
    prompts = _prompts(target.config.vocab_size)[:rows]
    plain = generate(target, prompts, max_new_tokens=max_new, impl="reference")
    ours = generate(target, prompts, draft=draft, max_new_tokens=max_new, block_size=block, impl=impl)
    assert ours.tokens == plain.tokens
    for b, (tokens, accept) in enumerate(_reference_runs(hf_draft, hf_target, prompts, max_new, block)):
        assert ours.tokens[b] == tokens
        assert ours.stats.accept_lengths[b] == accept, f"sequence {b}"
    flat = [n for seq in ours.stats.accept_lengths for n in seq]
    assert max(flat) >= 4 and len(set(flat)) >= (3 if rows > 1 else 2)


@pytest.mark.parametrize("mutant", ["no-convolution", "no-selector"])
def test_without_the_convolution_or_the_selector_acceptance_changes(qwen3_dflash2, mutant, monkeypatch):
    """Each DFlash2 piece matters on this pair: with either left out the acceptance lengths leave
    the reference's (the parity test above would fail)."""
    import dflash.model as dm

    monkeypatch.setattr(dm, "_cuda_time", lambda: 0.0)
    hf_target, hf_draft, target, draft, _ = qwen3_dflash2
    prompts = _prompts(target.config.vocab_size)
    if mutant == "no-convolution":
        monkeypatch.setattr(dynamic_conv, "prepare", lambda h, params, spec: (h, None))
        monkeypatch.setattr(dynamic_conv, "finish", lambda y, dynamic, params, spec: y)
    else:
        monkeypatch.setattr(selector_module, "select", lambda params, spec, hidden, logits, *rest: (
            jnp.argmax(logits, -1).astype(jnp.int32), None, None))
    jax.clear_caches()
    try:
        ours = generate(target, prompts, draft=draft, max_new_tokens=MAX_NEW, impl="reference")
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    reference = _reference_runs(hf_draft, hf_target, prompts)
    assert [accept for _, accept in reference] != ours.stats.accept_lengths


def test_dflash2_on_a_gpt_oss_target_equals_the_reference(tmp_path, monkeypatch):
    import dflash.model as dm

    from test_gpt_oss import make_gpt_oss

    monkeypatch.setattr(dm, "_cuda_time", lambda: 0.0)
    hf_target = make_gpt_oss(seed=2)
    hf_target.save_pretrained(tmp_path / "target")
    target = load_target(tmp_path / "target", "float32")
    hf_draft = as_dflash2(make_zlab_draft(hf_target, block_size=4, target_layer_ids=(0, 2), seed=7, std=0.3),
                          group_size=8, seed=1)
    draft = load_draft(save_draft(hf_draft, tmp_path / "draft"), target, "float32")
    prompts = _prompts(64, seed=3, lens=(9,))
    ours = generate(target, prompts, draft=draft, max_new_tokens=16, impl="reference")
    assert ours.tokens == generate(target, prompts, max_new_tokens=16, impl="reference").tokens
    [(tokens, accept)] = _reference_runs(hf_draft, hf_target, prompts, max_new=16)
    assert ours.tokens[0] == tokens and ours.stats.accept_lengths[0] == accept


def test_published_names_load_and_export_round_trips(qwen3_dflash2, tmp_path, monkeypatch):
    """z-lab publishes the codebooks without ``.weight``: such a folder loads the same params;
    export writes that form, and the reference loads the export with the same outputs."""
    import json

    import dflash.model as dm
    from safetensors.numpy import load_file, save_file

    monkeypatch.setattr(dm, "_cuda_time", lambda: 0.0)
    hf_target, hf_draft, target, draft, folder = qwen3_dflash2
    published = tmp_path / "published"
    published.mkdir()
    tensors = {name.removesuffix(".weight") if "_codebook" in name else name: array
               for name, array in load_file(folder / "model.safetensors").items()}
    save_file(tensors, published / "model.safetensors")
    (published / "config.json").write_text((folder / "config.json").read_text())
    jax.tree.map(np.testing.assert_array_equal, load_draft(published, target, "float32").params, draft.params)
    out = export_draft(draft.config, draft.params, tmp_path / "exported")
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["DFlash2DraftModel"] and raw["dflash_config"]["selector_top_k"] == 5
    assert "candidate_selector.predecessor_codebook" in load_file(out / "model.safetensors")
    reloaded = dm.DFlash2DraftModel.from_pretrained(out, dtype=torch.float32).eval()
    prompts = _prompts(target.config.vocab_size, lens=(9,))
    assert (_reference_runs(reloaded, hf_target, prompts, max_new=16)
            == _reference_runs(hf_draft, hf_target, prompts, max_new=16))


def test_dflash2_refusals(qwen3_dflash2, tmp_path):
    from dflash_jax.training import train_draft
    from dflash_jax.model.config import ConfigError

    _, _, target, draft, folder = qwen3_dflash2
    raw = json_of(folder)
    del raw["dflash_config"]["selector_rank"]
    with pytest.raises(ConfigError, match="selector_rank"):
        draft_config_from_hf(raw)
    with pytest.raises(ValueError, match="training DFlash2 drafts"):
        train_draft.train_draft(target, None, tmp_path / "out", draft.config, None)
    with pytest.raises(ConfigError, match="both its candidate selector"):
        dataclasses.replace(draft.config, selector=None)


def json_of(folder):
    import json

    return json.loads((folder / "config.json").read_text())


def test_the_serving_engine_runs_dflash2_beside_sampled_requests(qwen3_dflash2):
    """Through the engine (slots, chunks, per-row sampling): greedy requests equal offline
    greedy generation while sampled ones share the batch (per-row temperatures reach the selector)."""
    from dflash_jax.runtime.engine import Engine, RequestParams
    from dflash_jax.runtime.sampling import SamplingConfig

    _, _, target, draft, _ = qwen3_dflash2
    prompts = _prompts(target.config.vocab_size, seed=4, lens=(6, 9, 12, 8))
    engine = Engine(target, draft, max_num_seqs=3, max_model_len=64, page_size=8, chunk_steps=2, impl="reference")
    greedy, sampled = RequestParams(max_tokens=20), RequestParams(max_tokens=20, sampling=SamplingConfig(0.8), seed=3)
    requests = [engine.submit(p, greedy if i % 2 == 0 else sampled) for i, p in enumerate(prompts)]
    engine.run_until_done()
    expected = generate(target, prompts[::2], draft=draft, max_new_tokens=20, impl="reference").tokens
    assert [r.token_ids for r in requests[::2]] == expected
    assert all(len(r.token_ids) == 20 for r in requests[1::2])
    assert engine.pages_in_use == 0
