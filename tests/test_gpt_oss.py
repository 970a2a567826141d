"""gpt-oss targets on the one decoder against transformers' GptOssForCausalLM (f32, eager
attention: transformers' sdpa path refuses sinks): attention sinks, q/k/v/o biases, alternating
sliding and full layers, YaRN without truncation, a biased router, interleaved gate|up experts
with biases and the clamped SwiGLU. Weights are randomised past transformers' defaults (which
leave sinks near 0 and expert biases at 0) and the experts scaled so that the clamp at 7 cuts;
prompts run past twice the window so the sliding layers differ from the full ones.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from builders import fill_random, make_zlab_draft, save_draft, save_mxfp4_gpt_oss, train_briefly
from checkpoints_convert import export_target
from dflash_jax.model.config import ConfigError
from dflash_jax.model.hf_config import target_config_from_hf
from dflash_jax.loading import models
from dflash_jax.runtime.generation import generate
from dflash_jax.loading.models import load_draft, load_target

WINDOW = 4
CONFIG = dict(num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, vocab_size=64, hidden_size=32,
              intermediate_size=24, head_dim=8, num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW,
              max_position_embeddings=131072, rms_norm_eps=1e-5)


def make_gpt_oss(seed: int = 0, **overrides):
    """A tiny GptOssForCausalLM, every weight random: sinks ~N(0, 1), biases ~N(0, 0.5), expert
    projections ~N(0, 0.5) (some gate|up values pass the clamp), norms around 1."""
    from transformers import GptOssConfig, GptOssForCausalLM

    model = GptOssForCausalLM(GptOssConfig(**{**CONFIG, **overrides})).float().eval()
    fill_random(model, seed, std=0.2)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0, generator=gen)
            experts = layer.mlp.experts
            experts.gate_up_proj.normal_(0.0, 0.5, generator=gen)
            for bias in (experts.gate_up_proj_bias, experts.down_proj_bias, layer.mlp.router.bias):
                bias.normal_(0.0, 0.5, generator=gen)
    return model


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    hf = make_gpt_oss()
    folder = tmp_path_factory.mktemp("gpt_oss") / "hf"
    hf.save_pretrained(folder)
    return hf, folder, load_target(folder, "float32")


def _hf_logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].numpy()


def _forward_in_pieces(target, tokens, pieces):
    """Our logits of ``tokens`` run through the paged cache in consecutive pieces (a prefill,
    then verify blocks and single decode steps)."""
    from dflash_jax.model import target as target_model
    from dflash_jax.model.cache import allocate_pages, init_cache

    table, pages = allocate_pages([len(tokens)], 4)
    cache = init_cache(target.config, None, table, pages, 4, jnp.float32)
    out, start = [], 0
    for size in pieces:
        chunk = jnp.asarray([tokens[start:start + size]])
        hidden, _, cache = target_model.forward(target.params, target.config, chunk, jnp.asarray([start], jnp.int32),
                                                cache, impl="reference")
        out.append(np.asarray(target_model.logits(target.params, hidden)[0]))
        start += size
    return np.concatenate(out)


def test_config_reads_as_transformers_does(gpt_oss):
    hf, _, target = gpt_oss
    config = target.config
    assert config.family == "gpt_oss" and config.layer_types == tuple(hf.config.layer_types)
    assert [config.window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    attention, moe = config.layers[0].mixer, config.layers[0].ffn
    assert attention.sinks and attention.bias and not attention.qk_norm
    assert attention.rope.kind == "yarn" and attention.rope.truncate is False
    assert moe.bias and moe.swiglu_limit == 7.0 and moe.norm_topk_prob


@pytest.mark.parametrize("pieces", [(19,), (9, 4, 1, 1, 4)], ids=["prefill", "prefill-verify-decode"])
def test_logits_equal_transformers(gpt_oss, pieces):
    """f32 logits at every position, whole or through the paged cache piece by piece (a verify
    block and decode steps whose windows drop keys the full layers still see)."""
    hf, _, target = gpt_oss
    tokens = np.random.default_rng(0).integers(0, 63, sum(pieces)).tolist()
    expected = _hf_logits(hf, tokens)
    np.testing.assert_allclose(_forward_in_pieces(target, tokens, pieces), expected, rtol=1e-4, atol=1e-4)


def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(gpt_oss):
    """In bf16 the two differ in rounding (transformers multiplies the RMSNorm weight in f32, takes
    the attention and router softmaxes in bf16): ours stays as close to the f32 logits as theirs,
    position by position (median: at a router near-tie either bf16 run may pick another expert,
    as docs/families.md says, and that position then leaves f32 for both)."""
    from transformers import GptOssForCausalLM

    hf, folder, _ = gpt_oss
    tokens = np.random.default_rng(3).integers(0, 63, 19).tolist()
    exact = _hf_logits(hf, tokens)
    hf16 = GptOssForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        theirs = hf16(torch.tensor([tokens])).logits[0].float().numpy()
    ours = _forward_in_pieces(load_target(folder, "bfloat16"), tokens, (19,)).astype(np.float32)
    error = lambda x: np.median(np.linalg.norm(x - exact, axis=-1) / np.linalg.norm(exact, axis=-1))  # noqa: E731
    assert error(ours) < 1.5 * error(theirs) and error(ours) < 0.05


def test_sinks_windows_and_clamp_each_change_the_logits(gpt_oss):
    """Mutants of the three gpt-oss features (sinks zeroed, no window, no clamp) each move the
    logits: the parity test above can fail on each."""
    import dataclasses

    _, _, target = gpt_oss
    tokens = np.random.default_rng(1).integers(0, 63, 19).tolist()
    base = _forward_in_pieces(target, tokens, (19,))
    config, params = target.config, target.params
    no_sinks = params.replace(layers=[layer.replace(attention=layer.attention.replace(
        sinks=jnp.zeros_like(layer.attention.sinks))) for layer in params.layers])
    no_window = config.with_layers(tuple(dataclasses.replace(layer, mixer=dataclasses.replace(
        layer.mixer, sliding_window=None)) for layer in config.layers))
    no_clamp = config.with_layers(tuple(dataclasses.replace(layer, ffn=dataclasses.replace(
        layer.ffn, swiglu_limit=1e9)) for layer in config.layers))
    for mutant in (dataclasses.replace(target, params=no_sinks), dataclasses.replace(target, config=no_window),
                   dataclasses.replace(target, config=no_clamp)):
        assert np.abs(_forward_in_pieces(mutant, tokens, (19,)) - base).max() > 1e-3


def test_greedy_equals_transformers_generate_and_dflash_is_lossless(gpt_oss, tmp_path):
    hf, _, target = gpt_oss
    prompts = [np.random.default_rng(s).integers(0, 63, n).tolist() for s, n in ((2, 7), (3, 11))]
    plain = generate(target, prompts, max_new_tokens=16, impl="reference")
    for prompt, tokens in zip(prompts, plain.tokens):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        assert tokens == out[0, len(prompt):].tolist()
    draft_dir = save_draft(make_zlab_draft(hf, block_size=4, target_layer_ids=(0, 2), seed=7, std=0.3),
                           tmp_path / "draft")
    draft = load_draft(draft_dir, target, "float32")
    spec = generate(target, prompts, draft=draft, max_new_tokens=16, impl="reference")
    assert spec.tokens == plain.tokens
    # the PyPI reference, called directly (its loader forces sdpa, which gpt-oss refuses)
    import dflash.model as dm

    hf_draft = dm.DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()
    for b, prompt in enumerate(prompts):
        out = dm.dflash_generate(hf_draft, hf, torch.tensor([prompt]), max_new_tokens=16, stop_token_ids=None,
                                 return_stats=True)
        assert out.output_ids[0, len(prompt):].tolist() == spec.tokens[b]
        assert [int(n) for n in out.acceptance_lengths] == spec.stats.accept_lengths[b]


def test_export_round_trip_loads_in_transformers(gpt_oss, tmp_path):
    from transformers import GptOssForCausalLM

    hf, _, target = gpt_oss
    out = export_target(target.config, target.params, tmp_path / "exported", max_shard_mb=1)
    assert load_target(out, "float32").config == target.config
    reloaded = GptOssForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = list(range(5, 25))
    np.testing.assert_array_equal(_hf_logits(reloaded, tokens), _hf_logits(hf, tokens))


def test_defaults_and_refusals():
    """Absent fields read as GptOssConfig's (YaRN factor 32 untruncated, theta 150000, window 128
    on even layers); quantizations other than the released mxfp4 are refused by name."""
    raw = {"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 3, "num_local_experts": 4,
           "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16, "num_attention_heads": 16, "head_dim": 8}
    config = target_config_from_hf(raw)
    assert [config.window(i) for i in range(3)] == [128, None, 128]
    rope = config.layers[0].mixer.rope
    assert (rope.kind, rope.factor, rope.theta, rope.truncate) == ("yarn", 32.0, 150000.0, False)
    assert config.layers[0].ffn.top_k == 4 and config.rms_norm_eps == 1e-5
    assert config.layers[0].mixer.num_kv_heads == 8
    with pytest.raises(ConfigError, match="quant_method 'awq' is not supported for gpt-oss"):
        target_config_from_hf({**raw, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ConfigError, match="num_experts"):
        target_config_from_hf({k: v for k, v in raw.items() if k != "num_local_experts"})


@pytest.mark.parametrize("impl", ["interpret", "interpret-tpu"])
def test_dflash_through_every_kernel(tmp_path, impl):
    """The sink-aware verify attention and the biased, clamped expert kernels (interpreted: GPU's,
    or TPU's in TPU interpret mode) in the whole loop: the same greedy tokens as the reference path
    (head_dim and widths the kernels take)."""
    hf = make_gpt_oss(seed=4, head_dim=16, intermediate_size=32)
    hf.save_pretrained(tmp_path / "target")
    target = load_target(tmp_path / "target", "float32")
    draft = load_draft(save_draft(make_zlab_draft(hf, block_size=4, target_layer_ids=(0, 2), head_dim=16, seed=7,
                                                  std=0.3), tmp_path / "draft"), target, "float32")
    prompts = [np.random.default_rng(5).integers(0, 63, 10).tolist()]
    reference = generate(target, prompts, draft=draft, max_new_tokens=8, impl="reference")
    kernels = generate(target, prompts, draft=draft, max_new_tokens=8, impl=impl)
    assert kernels.tokens == reference.tokens


# ---------------------------------------------------------------------------------------------
# MXFP4 experts, as released


def test_mxfp4_dequantization_is_bit_exact_against_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from dflash_jax.loading.mxfp4 import dequantize_pair

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 40, 5, 16), dtype=np.uint8)
    scales = rng.integers(110, 141, (3, 40, 5), dtype=np.uint8)
    ours = dequantize_pair(blocks, scales)
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype)
        assert tuple(theirs.shape) == ours.shape == (3, 160, 40)
        np.testing.assert_array_equal(ours.astype(np.float32 if dtype == torch.float32 else jnp.bfloat16),
                                      theirs.float().numpy().astype(np.float32 if dtype == torch.float32
                                                                    else jnp.bfloat16))


@pytest.fixture(scope="module")
def mxfp4_gpt_oss(tmp_path_factory):
    """(transformers' model of a released-style MXFP4 folder, the folder) with kernel-ready sizes."""
    hf = make_gpt_oss(seed=6, hidden_size=64, intermediate_size=32, head_dim=16)
    return hf, save_mxfp4_gpt_oss(hf, tmp_path_factory.mktemp("mxfp4") / "hf", seed=6)


def test_an_mxfp4_checkpoint_keeps_its_experts_in_mxfp4_with_transformers_logits(mxfp4_gpt_oss, monkeypatch,
                                                                                 capsys):
    """A released-style folder (experts as *_blocks / *_scales, quantization_config mxfp4) loads
    with its experts still MXFP4 (the stored bytes, in the kernel's layout), with the logits of the
    model whose experts are transformers' dequantisation of the same codes; dequantised at load
    instead, the logits are the same bits; transformers' own MXFP4 loader (dequantize=True) reads
    the folder the same."""
    from safetensors.numpy import load_file
    from transformers import GptOssForCausalLM, Mxfp4Config

    from pallas_kernels import Mxfp4Weight

    hf, folder = mxfp4_gpt_oss
    target = load_target(folder, "float32", mxfp4_experts="keep")
    experts = target.params.layers[1].ffn
    assert isinstance(experts.gate_up_proj, Mxfp4Weight) and experts.gate_up_proj.blocks.dtype == jnp.uint8
    stored = load_file(folder / "model.safetensors")["model.layers.1.mlp.experts.down_proj_blocks"]
    e, outputs, groups, _ = stored.shape
    np.testing.assert_array_equal(np.asarray(experts.down_proj.blocks),
                                  stored.reshape(e, outputs, groups * 16).transpose(0, 2, 1))
    tokens = np.random.default_rng(2).integers(0, 63, 12).tolist()
    expected = _hf_logits(hf, tokens)
    ours = _forward_in_pieces(target, tokens, (12,))
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-4)
    dequantized = load_target(folder, "float32", mxfp4_experts="dequantize")
    assert not dequantized.config.mxfp4_experts and dequantized.params.layers[1].ffn.down_proj.dtype == jnp.float32
    np.testing.assert_array_equal(_forward_in_pieces(dequantized, tokens, (12,)), ours)
    # auto: dequantised where that fits 60% of a device's memory (a CPU reports none), else kept
    assert not load_target(folder, "float32").config.mxfp4_experts
    monkeypatch.setattr(models, "device_memory", lambda: 10**5)
    assert load_target(folder, "float32").config.mxfp4_experts
    assert "MXFP4 experts: kept in MXFP4 (dequantised, the params take 0.0 GB a device of the 0 GB" in \
        capsys.readouterr().err
    reloaded = GptOssForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True)).eval()
    np.testing.assert_array_equal(_hf_logits(reloaded, tokens), expected)


def test_auto_keeps_mxfp4_experts_on_one_gpu_where_every_step_runs_one_token(mxfp4_gpt_oss, monkeypatch, capsys):
    """Where the MXFP4 kernel is faster (one GPU, one token a step: plain decoding of one prompt)
    auto keeps the experts in MXFP4 and says why; with more tokens a step (a DFlash verify, a
    batch) or none given, on several devices, or off GPUs, it dequantises them where they fit."""
    _, folder = mxfp4_gpt_oss
    config = load_target(folder, "float32", mxfp4_experts="keep").config
    assert not load_target(folder, "float32", step_tokens=1).config.mxfp4_experts  # a CPU
    monkeypatch.setattr(models, "mxfp4_kernel_runs", lambda impl="auto": True)
    assert load_target(folder, "float32", step_tokens=1).config.mxfp4_experts
    assert "MXFP4 experts: kept in MXFP4 (every step runs 1 token: the MXFP4 kernel decodes it faster than " \
        "float32 experts" in capsys.readouterr().err
    for step_tokens in (None, 2, 16):
        assert not load_target(folder, "float32", step_tokens=step_tokens).config.mxfp4_experts
    assert models.dequantizes_experts(config, jnp.float32, "auto", tp=2, step_tokens=1)
    assert not models.dequantizes_experts(config, jnp.float32, "auto", tp=1, step_tokens=1)
    assert models.dequantizes_experts(config, jnp.float32, "dequantize", step_tokens=1)
    monkeypatch.undo()
    # where the kernel does not run (a CPU, --impl reference) callers pass no step count
    assert models.mxfp4_step_tokens("auto", 1, 1) is None and models.mxfp4_step_tokens("reference", 1, 1) is None


def test_mxfp4_experts_convert_export_and_run_dflash_through_the_kernel(mxfp4_gpt_oss, tmp_path):
    """An MXFP4 target converted keeps its codes (and dequantises on the device when asked);
    exported it writes the same *_blocks / *_scales bytes; DFlash on it is lossless, and the
    experts' kernel (interpreted) decoding MXFP4 gives the reference's tokens."""
    import json

    from safetensors.numpy import load_file

    from checkpoints_convert import convert

    hf, folder = mxfp4_gpt_oss
    target = load_target(folder, "float32", mxfp4_experts="keep")
    converted = convert(folder, tmp_path / "converted", dtype="float32", progress=False)
    assert json.loads((converted / "dflash_jax.json").read_text())["mxfp4_experts"] is True
    from_converted = load_target(converted, "float32", mxfp4_experts="keep")
    assert from_converted.config == target.config
    for ours, theirs in zip(jax.tree.leaves(from_converted.params), jax.tree.leaves(target.params)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    dense = load_target(folder, "float32", mxfp4_experts="dequantize")
    for ours, theirs in zip(jax.tree.leaves(load_target(converted, "float32", mxfp4_experts="dequantize").params),
                            jax.tree.leaves(dense.params)):
        np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
    exported = export_target(target.config, target.params, tmp_path / "exported")
    written, source = load_file(exported / "model.safetensors"), load_file(folder / "model.safetensors")
    for name in (n for n in source if n.endswith(("_blocks", "_scales"))):
        np.testing.assert_array_equal(written[name], source[name])
    assert load_target(exported, "float32", mxfp4_experts="keep").config == target.config

    draft = load_draft(save_draft(make_zlab_draft(hf, block_size=4, target_layer_ids=(0, 2), head_dim=16, seed=7,
                                                  std=0.3), tmp_path / "draft"), target, "float32")
    prompts = [np.random.default_rng(5).integers(0, 63, 10).tolist()]
    plain = generate(dense, prompts, max_new_tokens=8, impl="reference")
    assert generate(target, prompts, draft=draft, max_new_tokens=8, impl="reference").tokens == plain.tokens
    assert generate(target, prompts, draft=draft, max_new_tokens=8, impl="interpret").tokens == plain.tokens


def test_an_mxfp4_config_over_dense_experts_loads_them_dense(mxfp4_gpt_oss, tmp_path):
    """A folder whose config.json says mxfp4 but whose experts are dense (an HF folder saved
    dequantised; a folder converted before MXFP4 was kept, its marker silent on it) loads its
    experts as they are; asked to keep MXFP4, it says why it cannot."""
    import json

    from builders import edit_config
    from checkpoints_convert import convert
    from dflash_jax.model.families.gpt_oss import MXFP4_QUANTIZATION

    hf, _ = mxfp4_gpt_oss
    hf_dense = tmp_path / "hf"
    hf.save_pretrained(hf_dense)      # its experts dense, as transformers holds them
    target = load_target(hf_dense, "float32")
    converted = convert(hf_dense, tmp_path / "converted", dtype="float32", progress=False)
    assert "mxfp4_experts" not in json.loads((converted / "dflash_jax.json").read_text())
    tokens = list(range(3, 15))
    for path in (hf_dense, converted):
        edit_config(path, lambda raw: raw.update(quantization_config=MXFP4_QUANTIZATION))
        loaded = load_target(path, "float32")
        assert loaded.config == target.config
        np.testing.assert_array_equal(_forward_in_pieces(loaded, tokens, (12,)),
                                      _forward_in_pieces(target, tokens, (12,)))
        with pytest.raises(ValueError, match="stores its experts dequantised .* cannot be kept in MXFP4"):
            load_target(path, "float32", mxfp4_experts="keep")


def test_half_an_mxfp4_pair_is_named(tmp_path):
    from safetensors.numpy import save_file

    from dflash_jax.loading.checkpoint import CheckpointError, iter_tensors

    save_file({"model.layers.0.mlp.experts.down_proj_blocks": np.zeros((2, 32, 1, 16), np.uint8)},
              tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.layers.0.mlp.experts.down_proj_blocks' has no "
                                              "'model.layers.0.mlp.experts.down_proj_scales'"):
        list(iter_tensors(tmp_path))


def test_a_zlab_gpt_oss_draft_config_loads_and_matches_the_reference(gpt_oss, tmp_path):
    """z-lab's gpt-oss drafts: Qwen3 layers with attention biases, ``model_type`` "gpt_oss",
    ``block_size`` at the top level, the mask id and taps in ``dflash_config``. Read as the PyPI
    reference reads them (through Qwen3Config: plain RoPE, every layer full attention)."""
    import json

    import dflash.model as dm

    from builders import edit_config

    hf, _, target = gpt_oss
    hf_draft = make_zlab_draft(hf, block_size=8, target_layer_ids=(0, 1, 3), seed=9, std=0.3)
    with torch.no_grad():  # the biased layers z-lab's gpt-oss drafts have
        hf_draft.config.attention_bias = True
        biased = dm.DFlashDraftModel(hf_draft.config).eval()
        biased.load_state_dict(hf_draft.state_dict(), strict=False)
        gen = torch.Generator().manual_seed(3)
        for name, tensor in biased.named_parameters():
            if name.endswith("proj.bias"):
                tensor.normal_(0.0, 0.3, generator=gen)
    folder = save_draft(biased, tmp_path / "draft")

    def as_released(config):
        config.update(model_type="gpt_oss", block_size=8)
        config["dflash_config"] = {"mask_token_id": 63, "target_layer_ids": [0, 1, 3]}
    edit_config(folder, as_released)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "gpt_oss"
    draft = load_draft(folder, target, "float32")
    assert draft.config.block_size == 8 and draft.config.model.layers[0].mixer.bias
    prompts = [np.random.default_rng(8).integers(0, 63, 9).tolist()]
    ours = generate(target, prompts, draft=draft, max_new_tokens=16, impl="reference")
    reference = dm.DFlashDraftModel.from_pretrained(folder, dtype=torch.float32).eval()
    out = dm.dflash_generate(reference, hf, torch.tensor(prompts), max_new_tokens=16, stop_token_ids=None,
                             return_stats=True)
    assert out.output_ids[0, len(prompts[0]):].tolist() == ours.tokens[0]
    assert [int(n) for n in out.acceptance_lengths] == ours.stats.accept_lengths[0]


def test_train_a_draft_for_a_gpt_oss_target_and_the_reference_runs_it(gpt_oss, tmp_path, monkeypatch):
    """``train_draft`` on a gpt-oss target (its taps, its YaRN RoPE for the draft, an MLP as wide
    as the routed experts' top k): a few steps, exported, then the PyPI reference runs the draft
    on the transformers target with our tokens and acceptance lengths."""
    import dflash.model as reference

    from dflash_jax.training import train_draft

    monkeypatch.setattr(reference, "_cuda_time", lambda: 0.0)
    hf, _, target = gpt_oss
    config = train_draft.new_draft_config(target.config, num_layers=2, block_size=4, mask_token_id=63,
                                          target_layer_ids=(0, 2))
    assert config.model.intermediate_size == 2 * 24 and config.model.rope == target.config.rope
    train_briefly(target, config, tmp_path / "draft", vocab=63)
    exported = load_draft(tmp_path / "draft", target, "float32")
    ref_draft = reference.DFlashDraftModel.from_pretrained(tmp_path / "draft", dtype=torch.float32).eval()
    prompt = list(range(10, 22))
    ours = generate(target, [prompt], draft=exported, max_new_tokens=16, impl="reference")
    ref = reference.dflash_generate(ref_draft, hf, torch.tensor([prompt]), 16, None, return_stats=True)
    assert ours.tokens[0] == ref.output_ids[0, len(prompt):].tolist()
    assert ours.stats.accept_lengths[0] == [int(n) for n in ref.acceptance_lengths]
