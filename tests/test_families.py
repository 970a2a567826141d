"""Families beside Qwen3 on the one decoder: LLaMA-3.1 (llama3 RoPE, no q/k norms, biases) and
Qwen3-MoE (routed experts). Their forward against transformers is in test_target.py; here:
DFlash on each (lossless, and token for token and step for step the PyPI reference's), the RoPE
scalings against transformers', conversion and export round trips, a draft trained for a MoE
target, and every config or checkpoint these families can get wrong, refused by name.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from builders import LLAMA3_TEST_ROPE, edit_config, make_target, save_target, train_briefly
from checkpoints_convert import convert, export_target
from dflash_jax.model import families
from dflash_jax.model.hf_config import target_config_from_hf
from dflash_jax.loading.checkpoint import CheckpointError
from dflash_jax.model.config import ConfigError
from dflash_jax.runtime.generation import generate
from dflash_jax.loading.models import load_draft, load_target
from dflash_jax.model.nn.moe import MoESpec
from dflash_jax.model.nn.rope import RopeSpec, rope_from_hf

MAX_NEW = 40
PROMPT_LENS = (7, 9, 11, 14)


def _prompts(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab - 1, n).tolist() for n in PROMPT_LENS]


def _reference(pair, prompt, max_new, block=None):
    import dflash.model as dm

    out = dm.dflash_generate(pair.hf_draft, pair.hf_target, torch.tensor([prompt]), max_new_tokens=max_new,
                             stop_token_ids=None, block_size=block, return_stats=True)
    return out.output_ids[0, len(prompt):].tolist(), [int(n) for n in out.acceptance_lengths]


# ---------------------------------------------------------------------------------------------
# DFlash on LLaMA and Qwen3-MoE targets


@pytest.mark.parametrize("block", [4, 16])
def test_dflash_lossless_and_reference_parity(family_pair, block):
    """Greedy DFlash equals the target's own greedy output, and every row equals the PyPI
    reference's dflash_generate of that prompt alone: tokens and acceptance per step (its
    transformers backend is exact for these families); the pair accepts runs of varied length."""
    pair = family_pair
    prompts = _prompts(pair.target.config.vocab_size)
    plain = generate(pair.target, prompts, max_new_tokens=MAX_NEW, impl="reference")
    ours = generate(pair.target, prompts, draft=pair.draft, max_new_tokens=MAX_NEW, block_size=block,
                    impl="reference")
    assert ours.tokens == plain.tokens
    for b, prompt in enumerate(prompts):
        tokens, accept = _reference(pair, prompt, MAX_NEW, block)
        assert ours.tokens[b] == tokens, f"sequence {b}"
        assert ours.stats.accept_lengths[b] == accept, f"sequence {b} acceptance"
    flat = [n for seq in ours.stats.accept_lengths for n in seq]
    assert max(flat) >= min(block, 4) and len(set(flat)) >= 3, f"acceptance not varied: {sorted(set(flat))}"


@pytest.mark.parametrize("impl", ["interpret", "interpret-tpu"])
def test_dflash_through_every_kernel(family_pair, impl):
    """The same with every Pallas kernel interpreted: the GPU kernels (the routed-experts kernel
    for the MoE), or the TPU kernels in TPU interpret mode."""
    pair = family_pair
    rows, max_new = (2, 24) if impl == "interpret" else (1, 16)  # the TPU interpreter runs kernels slowly
    prompts = _prompts(pair.target.config.vocab_size)[:rows]
    ours = generate(pair.target, prompts, draft=pair.draft, max_new_tokens=max_new, impl=impl)
    for b, prompt in enumerate(prompts):
        assert (ours.tokens[b], ours.stats.accept_lengths[b]) == _reference(pair, prompt, max_new), f"sequence {b}"


def test_exported_draft_runs_in_the_reference(family_pair, tmp_path):
    """A draft exported in z-lab format (for the LLaMA target: with its llama3 RoPE) loads in the
    PyPI reference and drafts there as it does here."""
    import dataclasses as dc

    import dflash.model as dm
    from checkpoints_convert import export_draft

    pair = family_pair
    out = export_draft(pair.draft.config, pair.draft.params, tmp_path / "draft")
    reloaded = dm.DFlashDraftModel.from_pretrained(out, dtype=torch.float32).eval()
    assert reloaded.config.rope_parameters["rope_type"] == pair.draft.config.model.rope.kind
    prompt = _prompts(pair.target.config.vocab_size)[2]
    ours = generate(pair.target, [prompt], draft=pair.draft, max_new_tokens=24, impl="reference")
    assert (ours.tokens[0], ours.stats.accept_lengths[0]) == _reference(
        dc.replace(pair, hf_draft=reloaded), prompt, 24)


def test_family_pairs_are_what_they_claim(family_pair):
    config = family_pair.target.config
    if config.family == "llama":
        assert config.rope.kind == "llama3" and not config.attention.qk_norm
        assert family_pair.draft.config.model.rope.kind == "llama3"
    else:
        assert config.family == "qwen3_moe" and all(isinstance(layer.ffn, MoESpec) for layer in config.layers)


# ---------------------------------------------------------------------------------------------
# RoPE: llama3 and YaRN frequencies as transformers computes them


def _hf_inv_freq(kind: str, params: dict, head_dim: int, max_position: int):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=max_position, rope_parameters={"rope_type": kind, **params})
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config)
    return inv_freq.numpy(), scaling


ROPE_CASES = {
    "llama3.1-8b": ("llama3", {"rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 128, 131072),
    "llama3-tests": ("llama3", {k: v for k, v in LLAMA3_TEST_ROPE.items() if k != "rope_type"}, 16, 4096),
    "gpt-oss-yarn": ("yarn", {"rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                              "original_max_position_embeddings": 4096, "truncate": False}, 64, 131072),
    "qwen3-yarn": ("yarn", {"rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768}, 128, 131072),
    "yarn-mscale": ("yarn", {"rope_theta": 1e4, "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                             "original_max_position_embeddings": 4096}, 64, 163840),
}


@pytest.mark.parametrize("name", ROPE_CASES)
def test_scaled_rope_frequencies_as_transformers(name):
    kind, params, head_dim, max_position = ROPE_CASES[name]
    ours = rope_from_hf({"rope_parameters": {"rope_type": kind, **params}}, head_dim, max_position, name)
    hf_inv_freq, hf_scaling = _hf_inv_freq(kind, params, head_dim, max_position)
    assert ours.kind == kind
    np.testing.assert_allclose(ours.inv_freq(), hf_inv_freq, rtol=2e-7)  # f32: at most an ulp
    assert ours.attention_factor == pytest.approx(hf_scaling, rel=1e-12)


def test_llama3_test_rope_moves_the_phases_at_the_tests_lengths():
    """The tests' llama3 scaling is not a no-op where they run: at position 20 it shifts some
    frequency's phase by more than a radian (plain RoPE in its place fails the parity tests)."""
    scaled = rope_from_hf({"rope_parameters": LLAMA3_TEST_ROPE}, 16, 4096, "test")
    plain = RopeSpec(theta=LLAMA3_TEST_ROPE["rope_theta"], rotary_dim=16)
    assert np.max(np.abs(20 * (scaled.inv_freq() - plain.inv_freq()))) > 1.0


def test_partial_rotary_tables_leave_the_other_dims_alone():
    from dflash_jax.model.nn import rope
    from pallas_kernels import apply_rope

    spec = RopeSpec(theta=1e4, rotary_dim=8)
    x = jax.random.normal(jax.random.key(0), (1, 3, 2, 32))
    cos, sin = rope.tables(jnp.arange(3)[None] + 5, spec, jnp.float32)
    out = apply_rope(x, cos, sin)
    np.testing.assert_array_equal(out[..., 8:], x[..., 8:])
    assert not np.allclose(out[..., :8], x[..., :8])


# ---------------------------------------------------------------------------------------------
# Conversion and export


FAMILY_FOLDERS = {
    "llama": dict(family="llama", vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, bias=True),
    "qwen3_moe": dict(family="qwen3_moe", vocab=64, hidden=32, layers=3, heads=4, kv_heads=2, head_dim=8,
                      experts=4, top_k=2, expert_width=16, mlp_only_layers=(1,)),
    # a release (vision tower skipped, not exported) and Qwen3-Next's interleaved fused projections
    # (weights of std 0.1: at 0.3 their recurrent layers' f32 rounding reaches 4e-5 of the logits)
    "qwen3_5_release": dict(family="qwen3_5_release", vocab=64, hidden=32, layers=4, heads=2, kv_heads=1, std=0.1),
    "qwen3_next": dict(family="qwen3_next", vocab=64, hidden=32, layers=4, heads=2, kv_heads=1, linear_heads=(2, 4),
                       experts=4, top_k=2, expert_width=16, mlp_only_layers=[1], std=0.1),
    # sinks, biases everywhere, interleaved gate|up experts (stacked, [in, out])
    "gpt_oss": dict(family="gpt_oss", vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, experts=4,
                    top_k=2, expert_width=16),
}


@pytest.fixture(scope="module", params=list(FAMILY_FOLDERS))
def family_folder(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    hf = make_target(seed=3, **{"std": 0.3, **FAMILY_FOLDERS[request.param]})
    save_target(hf, root / "hf", rope_style="scaling" if request.param == "llama" else "parameters")
    return hf, root / "hf"


def _logits(hf, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].numpy()


def _our_logits(target, tokens):
    from dflash_jax.model import target as target_model
    from dflash_jax.model.cache import allocate_pages, init_cache

    table, pages = allocate_pages([len(tokens)], 16)
    cache = init_cache(target.config, None, table, pages, 16, target.params.embed.dtype)
    hidden, _, _ = target_model.forward(target.params, target.config, jnp.asarray([tokens]), jnp.zeros(1, jnp.int32),
                                        cache, impl="reference")
    return np.asarray(target_model.logits(target.params, hidden)[0])


def test_conversion_round_trip_is_bit_exact(family_folder, tmp_path):
    hf, src = family_folder
    out = convert(src, tmp_path / "converted", dtype="float32", progress=False)
    direct, converted = load_target(src, "float32"), load_target(out, "float32")
    assert converted.config == direct.config
    jax.tree.map(np.testing.assert_array_equal, converted.params, direct.params)
    tokens = list(range(3, 20))
    np.testing.assert_allclose(_our_logits(converted, tokens), _logits(hf, tokens), rtol=1e-5, atol=2e-5)
    if direct.config.family == "qwen3_moe":  # experts stacked [E, ...] in the HF order
        layer, expert = direct.params.layers[0].ffn, hf.model.layers[0].mlp.experts
        np.testing.assert_array_equal(layer.gate_up_proj, np.swapaxes(expert.gate_up_proj.detach().numpy(), 1, 2))
        np.testing.assert_array_equal(layer.down_proj, np.swapaxes(expert.down_proj.detach().numpy(), 1, 2))


def test_export_round_trip_loads_in_transformers(family_folder, tmp_path):
    import transformers

    hf, src = family_folder
    target = load_target(src, "float32")
    out = export_target(target.config, target.params, tmp_path / "exported", max_shard_mb=1)
    assert load_target(out, "float32").config == target.config
    architecture = getattr(transformers, families.get(target.config.family).architectures[0])
    reloaded = architecture.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(reloaded) is type(hf)
    tokens = list(range(5, 25))
    np.testing.assert_array_equal(_logits(reloaded, tokens), _logits(hf, tokens))


def test_conversion_holds_one_layer_at_a_time(family_folder, tmp_path, monkeypatch):
    """Conversion writes each layer (a MoE layer: its stacked experts) as soon as its last tensor
    arrives and lets it go: never two layers in host memory at once, which lets a 61 GB
    Qwen3-30B-A3B convert on a 24 GB machine."""
    from dflash_jax.loading import checkpoint

    _, src = family_folder
    events = []
    real_stream, real_writer = checkpoint.stream_leaves, checkpoint._params_writer

    def stream(*args, **kwargs):
        for path, array in real_stream(*args, **kwargs):
            events.append(("read", ".".join(map(str, path[:2] if path[0] == "layers" else path[:1]))))
            yield path, array

    class Writer:
        def __init__(self):
            self.inner = real_writer()

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def save(self, path, **kwargs):
            events.append(("written", path.name))
            return self.inner.save(path, **kwargs)

    monkeypatch.setattr(checkpoint, "stream_leaves", stream)
    monkeypatch.setattr(checkpoint, "_params_writer", Writer)
    convert(src, tmp_path / "converted", progress=False)
    pending = set()
    for kind, group in events:
        if kind == "read":
            pending.add(group)
        else:
            pending.discard(group)
        assert len({g for g in pending if g.startswith("layers.")}) <= 1, f"two layers held at once: {pending}"
    assert not pending
    groups = sorted(p.name for p in (tmp_path / "converted" / "params").iterdir())
    assert groups == sorted(["embed", "lm_head", "norm", *(f"layers.{i}" for i in range(FAMILY_FOLDERS[
        load_target(src, "float32").config.family]["layers"]))])


# ---------------------------------------------------------------------------------------------
# A draft trained for a MoE target


def test_train_a_draft_for_a_moe_target_and_the_reference_runs_it(tmp_path, monkeypatch):
    import dflash.model as reference
    from dflash.model import DFlashDraftModel

    from dflash_jax.training import train_draft

    monkeypatch.setattr(reference, "_cuda_time", lambda: 0.0)
    hf = make_target(seed=5, std=0.3, **{**FAMILY_FOLDERS["qwen3_moe"], "vocab": 96})
    target = load_target(save_target(hf, tmp_path / "target"), "float32")
    config = train_draft.new_draft_config(target.config, num_layers=2, block_size=4, mask_token_id=95,
                                          target_layer_ids=(0, 2))
    assert config.model.family == "qwen3" and config.model.intermediate_size == 64  # its dense layer's width
    assert config.model.attention.qk_norm and config.model.rope == target.config.rope
    all_sparse = dataclasses.replace(target.config, layers=tuple(
        dataclasses.replace(layer, ffn=target.config.layers[0].ffn) for layer in target.config.layers))
    assert train_draft.new_draft_config(all_sparse, num_layers=1, block_size=4, mask_token_id=95
                                        ).model.intermediate_size == 2 * 16  # top_k x expert width
    draft = train_briefly(target, config, tmp_path / "draft", vocab=95)
    exported = load_draft(tmp_path / "draft", target, "float32")
    ref_draft = DFlashDraftModel.from_pretrained(tmp_path / "draft", dtype=torch.float32).eval()
    prompt = list(range(10, 22))
    ours = generate(target, [prompt], draft=exported, max_new_tokens=16, impl="reference")
    ref = reference.dflash_generate(ref_draft, hf, torch.tensor([prompt]), 16, None, return_stats=True)
    assert ours.tokens[0] == ref.output_ids[0, len(prompt):].tolist()
    assert ours.stats.accept_lengths[0] == ref.acceptance_lengths
    assert draft.config == config


# ---------------------------------------------------------------------------------------------
# Refused by name


def _raw(family: str, **overrides) -> dict:
    from builders import FAMILY_CONFIGS

    arch = {k: v for k, v in FAMILY_FOLDERS[family].items() if k != "family"}
    raw = FAMILY_CONFIGS[family](**arch).to_dict()
    raw.update(overrides)
    return raw


@pytest.mark.parametrize("family, overrides, message", [
    ("qwen3_moe", dict(num_experts=None), "required field 'num_experts'"),
    ("qwen3_moe", dict(num_experts=6), "num_experts 6 and num_local_experts 4 disagree"),
    ("qwen3_moe", dict(num_experts_per_tok=None), "required field 'num_experts_per_tok'"),
    ("qwen3_moe", dict(moe_intermediate_size=None), "required field 'moe_intermediate_size'"),
    ("qwen3_moe", dict(num_experts_per_tok=5), r"num_experts_per_tok must be in \[1, num_experts=4\], got 5"),
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step must be >= 1"),
    ("qwen3_moe", dict(mlp_only_layers=[3]), r"mlp_only_layers \[3\] are outside the 3 layers"),
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "rope_type 'dynamic' is not supported"),
    ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
     "required field 'low_freq_factor'"),
    ("llama", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("llama", dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not used"),
], ids=["experts", "experts-disagree", "top-k", "expert-width", "top-k-too-large", "sparse-step", "dense-layer-index", "rope-type",
        "llama3-field", "act", "partial-rotary"])
def test_bad_family_configs_are_refused_by_name(family, overrides, message):
    raw = {k: v for k, v in _raw(family, **overrides).items() if v is not None or k not in overrides}
    if overrides.get("num_experts", 0) is None:
        raw.pop("num_local_experts", None)
    with pytest.raises(ConfigError, match=message):
        target_config_from_hf(raw)


HYBRID_ARCH = dict(vocab=64, hidden=32, layers=4, heads=2, kv_heads=1)


@pytest.mark.parametrize("overrides, message", [
    (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "unknown layer type 'sliding_attention'"),
    (dict(layer_types=["linear_attention"] * 3), "layer_types has 3 entries for 4 layers"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
    (dict(linear_key_head_dim=None), "required field 'linear_key_head_dim'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.5}),
     r"partial_rotary_factor must be in \(0, 1\]"),
    (dict(layer_types=None, full_attention_interval=0), "full_attention_interval must be >= 1"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
], ids=["layer-type", "layer-count", "value-heads", "key-dim", "partial-rotary", "interval", "act"])
@pytest.mark.parametrize("release", [False, True], ids=["text-only", "release"])
def test_bad_hybrid_configs_are_refused_by_name(overrides, message, release):
    from builders import hybrid_config

    raw = hybrid_config("qwen3_5_release" if release else "qwen3_5", **HYBRID_ARCH).to_dict()
    text = raw["text_config"] if release else raw
    for key, value in overrides.items():
        text.pop(key, None) if value is None else text.__setitem__(key, value)
    with pytest.raises(ConfigError, match=message):
        target_config_from_hf(raw)


def test_a_qwen35_27b_release_config_parses():
    """config.json as the Qwen3.5-27B release writes it: text_config, full_attention_interval,
    mrope sections (1-D for text), partial rotary, the tie flag at the top level."""
    raw = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
           "vision_config": {"depth": 27, "hidden_size": 1152},
           "text_config": {"model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64,
                           "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
                           "intermediate_size": 17408, "vocab_size": 248320, "linear_num_key_heads": 16,
                           "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                           "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "rms_norm_eps": 1e-6,
                           "max_position_embeddings": 262144, "eos_token_id": 248044, "hidden_act": "silu",
                           "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                                               "rope_type": "default", "rope_theta": 10000000,
                                               "partial_rotary_factor": 0.25}}}
    config = target_config_from_hf(raw)
    assert config.family == "qwen3_5_release" and config.zero_centred_norms and not config.tie_word_embeddings
    assert len(config.recurrent_layers) == 48 and config.attention_layers == tuple(range(3, 64, 4))
    attention = config.attention
    assert (attention.num_heads, attention.num_kv_heads, attention.head_dim, attention.output_gate) == (24, 4, 256, True)
    assert (attention.rope.rotary_dim, attention.rope.theta) == (64, 1e7)
    assert config.layers[0].mixer.state_bytes == 48 * 128 * 128 * 4 + 3 * 10240 * 2
    assert config.eos_token_ids == (248044,)


def test_qwen35_moe_routing_always_renormalises():
    """transformers' Qwen3.5-MoE router divides the top k by their sum whatever norm_topk_prob says."""
    from builders import hybrid_config

    raw = hybrid_config("qwen3_5_moe", **HYBRID_ARCH, experts=4, top_k=2).to_dict()
    for value in (False, None):
        raw["norm_topk_prob"] = value
        assert all(layer.ffn.norm_topk_prob for layer in target_config_from_hf(raw).layers)


def test_hybrid_layer_kinds_from_the_full_attention_interval():
    """Without layer_types, layer i is full attention iff (i + 1) % full_attention_interval == 0."""
    from builders import hybrid_config

    raw = hybrid_config("qwen3_5", **{**HYBRID_ARCH, "layers": 6}).to_dict()
    raw.pop("layer_types")
    raw["full_attention_interval"] = 3
    assert target_config_from_hf(raw).recurrent_layers == (0, 1, 3, 4)


@pytest.mark.parametrize("overrides", [dict(num_local_experts=0), dict(mlp_only_layers=[0, 1, 2])],
                         ids=["no-experts", "every-layer-dense"])
def test_a_moe_config_with_no_sparse_layer_is_all_dense_and_round_trips(overrides):
    """As transformers reads it: 0 experts, or every layer listed dense, makes a dense model."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    raw = _raw("qwen3_moe", **overrides)
    config = target_config_from_hf(raw)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_dict(raw))
    assert [type(layer.mlp).__name__ for layer in hf.model.layers] == ["Qwen3MoeMLP"] * 3
    assert not any(isinstance(layer.ffn, MoESpec) for layer in config.layers)
    assert target_config_from_hf(families.get("qwen3_moe").export_fields(config)) == config


def test_unknown_architecture_lists_the_supported_ones():
    raw = {**_raw("llama"), "architectures": ["GemmaForCausalLM"], "model_type": "gemma"}
    with pytest.raises(ConfigError, match=r"architecture GemmaForCausalLM is not supported \(supported: "
                                          r"Qwen3ForCausalLM, LlamaForCausalLM, Qwen3MoeForCausalLM, "
                                          r"Qwen3_5ForCausalLM, .*, Qwen3NextForCausalLM, GptOssForCausalLM\)"):
        target_config_from_hf(raw)
    assert families.find_family({"model_type": "llama"}).name == "llama"  # model_type alone suffices
    assert families.find_family({"model_type": "qwen3_5"}).name == "qwen3_5_release"


def _rewrite_tensors(folder, edit):
    from safetensors.numpy import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("edit, error, message", [
    (lambda t: t.update({"model.layers.0.mlp.experts.2.up_proj.weight": np.zeros((8, 32), np.float32)}),
     CheckpointError, r"'model.layers.0.mlp.experts.2.up_proj.weight' has shape \[8, 32\], config expects \[16, 32\]"),
    (lambda t: t.pop("model.layers.2.mlp.experts.3.down_proj.weight"), CheckpointError,
     r"missing 1 tensor\(s\): 'model.layers.2.mlp.experts.3.down_proj.weight'"),
    (lambda t: t.update({"model.layers.0.mlp.experts.4.gate_proj.weight": np.zeros((16, 32), np.float32)}),
     CheckpointError, r"unexpected tensor 'model.layers.0.mlp.experts.4.gate_proj.weight'"),
    (lambda t: t.update({"model.layers.1.mlp.experts.0.gate_proj.weight": np.zeros((16, 32), np.float32)}),
     CheckpointError, r"unexpected tensor 'model.layers.1.mlp.experts.0.gate_proj.weight'"),  # a dense layer
    (lambda t: t.update({"model.layers.0.mlp.gate.weight": np.zeros((5, 32), np.float32)}),
     CheckpointError, r"'model.layers.0.mlp.gate.weight' has shape \[5, 32\], config expects \[4, 32\]"),
], ids=["expert-shape", "expert-missing", "expert-extra", "expert-in-dense-layer", "router-shape"])
def test_mismatched_expert_tensors_are_named(tmp_path, edit, error, message):
    hf = make_target(seed=3, std=0.3, **FAMILY_FOLDERS["qwen3_moe"])
    folder = save_target(hf, tmp_path / "hf")
    _rewrite_tensors(folder, edit)
    with pytest.raises(error, match=message):
        load_target(folder, "float32")
    with pytest.raises(error, match=message):
        convert(folder, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_llama_checkpoint_that_lacks_its_biases_is_named(tmp_path):
    hf = make_target(seed=3, std=0.3, **FAMILY_FOLDERS["llama"])
    folder = save_target(hf, tmp_path / "hf")
    _rewrite_tensors(folder, lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\): 'model.layers.1.self_attn.k_proj.bias'"):
        load_target(folder, "float32")
    edit_config(folder, lambda raw: raw.update(attention_bias=False))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model.layers.0.self_attn.k_proj.bias'"):
        load_target(folder, "float32")


# ---------------------------------------------------------------------------------------------
# The command line on each family


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "qwen3_5_release", "gpt_oss"])
def test_generate_cli_runs_each_family(family, tmp_path, capsys):
    """``python -m dflash_jax.generate`` on a LLaMA, a Qwen3-MoE and a Qwen3.5 release target
    (with the embedded model's tokenizer, and a draft for them): DFlash output identical to plain
    decoding."""
    import shutil

    from builders import make_zlab_draft, save_draft
    from dflash_jax.entrypoints import generate as generate_module

    vocab = 8192  # the embedded tokenizer's
    arch = {"std": 0.3, **FAMILY_FOLDERS[family], "vocab": vocab}
    hf = make_target(seed=7, **arch)
    target_dir = save_target(hf, tmp_path / "target")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(generate_module.DEFAULT_MODEL / "target" / name, target_dir / name)
    draft_dir = save_draft(make_zlab_draft(hf, layers=1, block_size=4, target_layer_ids=(0, 1), heads=4, kv_heads=2,
                                           head_dim=8, mask_token_id=vocab - 1), tmp_path / "draft")
    assert generate_module.main(["--target", str(target_dir), "--draft", str(draft_dir), "--prompt", "def f(x):",
                                 "--max-new-tokens", "12", "--baseline", "--dtype", "float32",
                                 "--impl", "reference"]) == 0
    err = capsys.readouterr().err
    assert "outputs identical: True" in err


def test_stacked_expert_tensors_load_as_per_expert_ones(tmp_path):
    """A MoE checkpoint whose experts are stacked (``mlp.experts.gate_up_proj`` [E, 2I, H] and
    ``down_proj`` [E, H, I], transformers 5's own layout, as some Qwen3.5-MoE uploads carry)
    loads to the same params as one tensor per expert (transformers' save)."""
    from safetensors.numpy import load_file, save_file

    hf = make_target(seed=7, std=0.1, family="qwen3_5_moe_release", vocab=64, hidden=32, layers=4, heads=2,
                     kv_heads=1, experts=4, top_k=2, expert_width=16)
    per_expert = save_target(hf, tmp_path / "per_expert")
    tensors = load_file(per_expert / "model.safetensors")
    stacked = {}
    for name, array in tensors.items():
        head, sep, rest = name.partition("mlp.experts.")
        if not sep:
            stacked[name] = array
            continue
        prefix = f"{head}mlp.experts."
        if f"{prefix}gate_up_proj" not in stacked:
            count = 4
            stacked[f"{prefix}gate_up_proj"] = np.stack([np.concatenate(
                [tensors[f"{prefix}{e}.gate_proj.weight"], tensors[f"{prefix}{e}.up_proj.weight"]]) for e in range(count)])
            stacked[f"{prefix}down_proj"] = np.stack([tensors[f"{prefix}{e}.down_proj.weight"] for e in range(count)])
    folder = tmp_path / "stacked"
    folder.mkdir()
    (folder / "config.json").write_text((per_expert / "config.json").read_text())
    save_file(stacked, folder / "model.safetensors", metadata={"format": "pt"})
    jax.tree.map(np.testing.assert_array_equal, load_target(folder, "float32").params,
                 load_target(per_expert, "float32").params)
