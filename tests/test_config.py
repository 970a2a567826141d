"""Config parsing: HF Qwen3 config.json variants, z-lab and speculators draft configs, and every
ConfigError (each names the offending field)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dflash_jax.model.config import ConfigError, build_target_layer_ids
from dflash_jax.model.hf_config import draft_config_from_hf, load_draft_config, load_target_config, target_config_from_hf


def qwen3_raw(layers: int = 2, **overrides) -> dict:
    """A config.json as transformers 5 writes it for a tiny Qwen3."""
    from transformers import Qwen3Config

    raw = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16).to_dict()
    raw.update(overrides)
    return raw


def zlab_raw(**overrides) -> dict:
    """A z-lab draft config shaped like z-lab/Qwen3-8B-DFlash-b16's."""
    raw = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16,
           "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
           "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "num_target_layers": 36, "rms_norm_eps": 1e-6,
           "rope_theta": 1000000, "vocab_size": 151936, "max_position_embeddings": 40960,
           "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None}
    raw.update(overrides)
    return raw


def speculators_raw(**overrides) -> dict:
    raw = {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
           "transformer_layer_config": qwen3_raw(layers=1), "block_size": 8, "mask_token_id": 63,
           "aux_hidden_state_layer_ids": [1, 3], "draft_vocab_size": 64}
    raw.update(overrides)
    return raw


# ---------------------------------------------------------------------------------------------
# Target configs


def test_transformers_config_json_parses():
    config = target_config_from_hf(qwen3_raw())
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (64, 32, 64)
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (2, 4, 2, 16)
    assert config.rope_theta == 10000.0 and config.rms_norm_eps == 1e-6
    assert config.layer_types == ("full_attention", "full_attention") and config.sliding_window is None
    assert config.window(0) is None and config.tie_word_embeddings is False
    assert config.eos_token_ids == ()


def test_rope_theta_top_level_or_in_rope_parameters():
    nested = qwen3_raw(rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert target_config_from_hf(nested).rope_theta == 5e5
    both = qwen3_raw(rope_theta=1e4, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    assert target_config_from_hf(both).rope_theta == 5e5  # rope_parameters wins, as in transformers 5
    legacy = qwen3_raw(rope_theta=123456.0)
    del legacy["rope_parameters"]
    assert target_config_from_hf(legacy).rope_theta == 123456.0
    scaling = qwen3_raw(rope_theta=7.0, rope_scaling=None)
    del scaling["rope_parameters"]
    assert target_config_from_hf(scaling).rope_theta == 7.0


def test_head_dim_and_kv_heads_default_as_transformers():
    """Qwen3Config's defaults: head_dim 128 (not hidden // heads); 32 KV heads when the field is
    absent, whatever the query heads (64 here), and one per query head when it is null."""
    from transformers import Qwen3Config

    raw = qwen3_raw(num_attention_heads=64, hidden_size=64)
    del raw["head_dim"]
    del raw["num_key_value_heads"]
    for kv_field, kv_heads in (({}, 32), ({"num_key_value_heads": None}, 64)):
        config, hf = target_config_from_hf({**raw, **kv_field}), Qwen3Config.from_dict({**raw, **kv_field})
        assert config.head_dim == hf.head_dim == 128
        assert config.num_kv_heads == hf.num_key_value_heads == kv_heads


def test_absent_fields_default_as_transformers():
    """Each optional field a config.json may leave out takes Qwen3Config's default."""
    from transformers import Qwen3Config

    raw = qwen3_raw()
    for field in ("tie_word_embeddings", "rms_norm_eps", "max_position_embeddings"):
        raw.pop(field, None)
    config, hf = target_config_from_hf(raw), Qwen3Config.from_dict(raw)
    assert config.tie_word_embeddings == hf.tie_word_embeddings
    assert config.rms_norm_eps == hf.rms_norm_eps
    assert config.max_position_embeddings == hf.max_position_embeddings


def test_tied_layer_types_and_eos_forms():
    raw = qwen3_raw(tie_word_embeddings=True, layer_types=["sliding_attention", "full_attention"],
                    sliding_window=128, use_sliding_window=True, eos_token_id=[5, 7])
    config = target_config_from_hf(raw)
    assert config.tie_word_embeddings
    assert config.layer_types == ("sliding_attention", "full_attention")
    assert config.window(0) == 128 and config.window(1) is None
    assert config.eos_token_ids == (5, 7)
    assert target_config_from_hf(qwen3_raw(eos_token_id=3)).eos_token_ids == (3,)
    assert target_config_from_hf(qwen3_raw(eos_token_id=[4, None])).eos_token_ids == (4,)


def test_configs_are_frozen_and_hashable():
    a, b = target_config_from_hf(qwen3_raw()), target_config_from_hf(qwen3_raw())
    assert a == b and hash(a) == hash(b)   # static jit arguments: equal configs share compiles
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.hidden_size = 8


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                   "num_attention_heads"])
def test_missing_field_is_named(field):
    raw = qwen3_raw()
    del raw[field]
    with pytest.raises(ConfigError, match=field):
        target_config_from_hf(raw)


def test_missing_rope_theta_is_named():
    raw = qwen3_raw()
    del raw["rope_parameters"]
    with pytest.raises(ConfigError, match="rope_theta"):
        target_config_from_hf(raw)


def test_rope_scaling_beside_rope_parameters():
    """transformers 5 takes rope_scaling over rope_parameters: a config holding both, different
    (a YaRN block added to a saved Qwen3 config), is refused; the same dict twice is fine."""
    rope = {"rope_type": "default", "rope_theta": 5e5}
    assert target_config_from_hf(qwen3_raw(rope_parameters=rope, rope_scaling=dict(rope))).rope_theta == 5e5
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    for scaling in (yarn, {"rope_type": "default"}):
        with pytest.raises(ConfigError, match="rope_parameters .* and rope_scaling .* disagree"):
            target_config_from_hf(qwen3_raw(rope_parameters=rope, rope_scaling=scaling))


@pytest.mark.parametrize("where", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "longrope"])
def test_unsupported_rope_type(where, rope_type):
    raw = qwen3_raw(rope_theta=1e6)
    del raw["rope_parameters"]
    raw[where] = {"rope_type": rope_type, "factor": 4.0, "rope_theta": 1e6}
    with pytest.raises(ConfigError, match=rope_type):
        target_config_from_hf(raw)


@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(layer_types=["full_attention"]), "layer_types"),
    (dict(layer_types=["full_attention", "linear_attention"]), "linear_attention"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
     r"quantized checkpoints .* 'fp8'\) are not supported"),
], ids=["act", "layer-count", "layer-kind", "kv-heads", "quantized"])
def test_unsupported_target_settings(overrides, message):
    with pytest.raises(ConfigError, match=message):
        target_config_from_hf(qwen3_raw(**overrides))


@pytest.mark.parametrize("overrides, message", [
    (dict(hidden_size=[32]), r"'hidden_size' must be an integer, got \[32\]"),
    (dict(num_hidden_layers=2.5), "'num_hidden_layers' must be an integer"),
    (dict(num_hidden_layers=True), "'num_hidden_layers' must be an integer, got True"),
    (dict(rms_norm_eps="1e-6"), "'rms_norm_eps' must be a number"),
    (dict(rope_parameters="x"), "'rope_parameters' must be an object"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": True}), "'rope_theta' must be a number"),
    (dict(tie_word_embeddings="false"), "'tie_word_embeddings' must be true or false"),
    (dict(layer_types="full_attention"), "'layer_types' must be a list"),
    (dict(eos_token_id="2"), "'eos_token_id' must be an integer"),
    (dict(use_sliding_window=True, sliding_window="4096"), "'sliding_window' must be an integer"),
], ids=["hidden-list", "layers-float", "layers-bool", "eps-str", "rope-str", "theta-bool", "tied-str",
        "layer-types-str", "eos-str", "window-str"])
def test_wrongly_typed_target_field_is_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        target_config_from_hf(qwen3_raw(**overrides))


def test_integral_floats_are_integers_and_max_position_defaults_as_transformers():
    raw = qwen3_raw(hidden_size=32.0)
    del raw["max_position_embeddings"]
    config = target_config_from_hf(raw)
    assert config.hidden_size == 32 and isinstance(config.hidden_size, int)
    assert config.max_position_embeddings == 32768  # Qwen3Config's default


def test_load_target_config_checks_model_type(tmp_path):
    raw = {**qwen3_raw(model_type="mistral"), "architectures": ["MistralForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"architecture MistralForCausalLM is not supported \(supported: "
                                          r"Qwen3ForCausalLM, LlamaForCausalLM, Qwen3MoeForCausalLM, Qwen3_5ForCausalLM, "
                                          r"Qwen3_5MoeForCausalLM, Qwen3_5ForConditionalGeneration, "
                                          r"Qwen3_5MoeForConditionalGeneration, Qwen3NextForCausalLM, GptOssForCausalLM\)"):
        load_target_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "architectures": None}))
    with pytest.raises(ConfigError, match="model_type 'mistral' is not supported"):
        load_target_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(qwen3_raw()))
    assert load_target_config(tmp_path).hidden_size == 32
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_target_config(tmp_path / "missing")


def test_swapped_target_and_draft_folders_are_named(tmp_path):
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps(zlab_raw()))
    with pytest.raises(ConfigError, match="draft holds a DFlash draft, not a target; pass it as the draft"):
        load_target_config(tmp_path / "draft")
    (tmp_path / "config.json").write_text(json.dumps(qwen3_raw()))
    with pytest.raises(ConfigError, match="holds a Qwen3 target, not a DFlash draft; pass it as the target"):
        load_draft_config(tmp_path)


def test_config_json_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        load_target_config(tmp_path)


# ---------------------------------------------------------------------------------------------
# Draft configs


def test_build_target_layer_ids_matches_reference():
    import dflash.model as dm

    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)      # Qwen3-8B, 5 draft layers
    for layers in range(4, 64):
        for draft_layers in range(1, 9):
            assert list(build_target_layer_ids(layers, draft_layers)) == dm.build_target_layer_ids(layers, draft_layers)


def test_zlab_draft_config():
    config = draft_config_from_hf(zlab_raw())
    assert config.source_format == "z-lab"
    assert (config.block_size, config.mask_token_id) == (16, 151669)
    assert config.target_layer_ids == (1, 9, 17, 25, 33) and config.num_target_layers == 36
    assert config.model.num_layers == 5 and config.model.head_dim == 128
    assert (config.input_embedding_scale, config.output_multiplier, config.final_logit_softcapping) == (1.0, 1.0, None)
    assert config.causal_layers == (False,) * 5 and config.draft_vocab_size is None


def test_zlab_draft_options_and_defaults():
    raw = zlab_raw(num_hidden_layers=2, num_target_layers=36, block_size=None,
                   layer_types=["sliding_attention", "full_attention"], sliding_window=64, use_sliding_window=True,
                   dflash_config={"mask_token_id": 5, "block_size": 8, "input_embedding_scale": 2.0,
                                  "output_multiplier": 0.5, "final_logit_softcapping": 30.0})
    del raw["block_size"]
    config = draft_config_from_hf(raw)
    assert config.block_size == 8                                    # dflash_config wins / supplies it
    assert config.target_layer_ids == build_target_layer_ids(36, 2)  # ids absent -> build rule
    assert (config.input_embedding_scale, config.output_multiplier, config.final_logit_softcapping) == (2.0, 0.5, 30.0)
    assert config.causal_layers == (True, False)                     # sliding layers causal by default
    assert draft_config_from_hf({**raw, "is_causal": False}).causal_layers == (False, False)
    assert draft_config_from_hf({**raw, "is_causal": True}).causal_layers == (True, True)
    zero_cap = {**raw, "dflash_config": {**raw["dflash_config"], "final_logit_softcapping": 0}}
    assert draft_config_from_hf(zero_cap).final_logit_softcapping is None
    no_block = zlab_raw()
    del no_block["block_size"]
    assert draft_config_from_hf(no_block).block_size == 16            # the reference's default


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda raw: (raw["dflash_config"].pop("target_layer_ids"), raw.pop("num_target_layers")), "target_layer_ids"),
    (lambda raw: (raw.pop("dflash_config"), raw.update(architectures=["Qwen3ForCausalLM"])), "DFlash"),
    (lambda raw: raw.pop("hidden_size"), "hidden_size"),
    (lambda raw: raw.update(block_size=1), "block_size must be >= 2, got 1"),
], ids=["mask", "layer-ids", "not-dflash", "hidden", "block-size"])
def test_zlab_draft_errors(edit, message):
    raw = zlab_raw()
    edit(raw)
    with pytest.raises(ConfigError, match=message):
        draft_config_from_hf(raw)


@pytest.mark.parametrize("make, message", [
    (lambda: zlab_raw(dflash_config=[1]), "'dflash_config' must be an object"),
    (lambda: zlab_raw(dflash_config={"mask_token_id": 5, "target_layer_ids": "1,2"}),
     "dflash_config: field 'target_layer_ids' must be an integer"),
    (lambda: zlab_raw(dflash_config={"mask_token_id": "5", "target_layer_ids": [1]}), "'mask_token_id' must be an integer"),
    (lambda: zlab_raw(is_causal="no"), "'is_causal' must be true or false"),
    (lambda: speculators_raw(transformer_layer_config="x"), "'transformer_layer_config' must be an object"),
    (lambda: speculators_raw(aux_hidden_state_layer_ids=["a"]), "'aux_hidden_state_layer_ids' must be an integer"),
    (lambda: speculators_raw(block_size=[8]), "'block_size' must be an integer"),
], ids=["dflash-list", "ids-str", "mask-str", "causal-str", "layers-str", "aux-str", "block-list"])
def test_wrongly_typed_draft_field_is_named(make, message):
    with pytest.raises(ConfigError, match=message):
        draft_config_from_hf(make())


def test_speculators_sample_from_anchor_is_refused():
    """Such a draft's slot k predicts token t+k+1: loaded as an ordinary one it would propose
    every token one position off (lossless, but nearly nothing accepted)."""
    assert draft_config_from_hf(speculators_raw(sample_from_anchor=False)) == draft_config_from_hf(speculators_raw())
    with pytest.raises(ConfigError, match="sample_from_anchor=true"):
        draft_config_from_hf(speculators_raw(sample_from_anchor=True))


def test_speculators_draft_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(speculators_raw()))
    config = load_draft_config(tmp_path)
    assert config.source_format == "speculators"
    assert config.target_layer_ids == (0, 2)                          # aux ids are z-lab ids + 1
    assert (config.block_size, config.mask_token_id) == (8, 63)
    assert config.draft_vocab_size is None                            # == vocab: not reduced
    assert config.model.num_layers == 1
    reduced = draft_config_from_hf(speculators_raw(draft_vocab_size=20))
    assert reduced.draft_vocab_size == 20
    sliding = speculators_raw(transformer_layer_config=qwen3_raw(
        layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=16,
        use_sliding_window=True))
    assert draft_config_from_hf(sliding).causal_layers == (True, False)
    assert draft_config_from_hf({**sliding, "sliding_window_non_causal": True}).causal_layers == (False, False)


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw.update(speculators_model_type="eagle3"), "eagle3"),
    (lambda raw: raw.pop("transformer_layer_config"), "transformer_layer_config"),
    (lambda raw: raw.pop("mask_token_id"), "mask_token_id"),
    (lambda raw: raw.pop("aux_hidden_state_layer_ids"), "aux_hidden_state_layer_ids"),
    (lambda raw: raw.pop("block_size"), "block_size"),
], ids=["type", "layers", "mask", "aux", "block"])
def test_speculators_errors(edit, message):
    raw = speculators_raw()
    edit(raw)
    with pytest.raises(ConfigError, match=message):
        draft_config_from_hf(raw)


def test_check_target_errors():
    target = target_config_from_hf(qwen3_raw(layers=4))
    good = draft_config_from_hf(speculators_raw())
    good.check_target(target)
    cases = [
        (dataclasses.replace(good, model=dataclasses.replace(good.model, hidden_size=48)), "hidden_size"),
        (dataclasses.replace(good, model=dataclasses.replace(good.model, vocab_size=65)), "vocab_size"),
        (dataclasses.replace(good, target_layer_ids=(0, 4)), r"layer_ids \[5\] are outside"),
        (dataclasses.replace(good, target_layer_ids=(-1, 2)), r"layer_ids \[0\] are outside"),
        (dataclasses.replace(good, mask_token_id=64), "mask_token_id"),
    ]
    for bad, message in cases:
        with pytest.raises(ConfigError, match=message):
            bad.check_target(target)
    # speculators ids are named as the config writes them (z-lab id + 1), z-lab ids as they are
    with pytest.raises(ConfigError, match=r"aux_hidden_state_layer_ids \[5\] are outside the target's 4 layers"):
        dataclasses.replace(good, target_layer_ids=(0, 4)).check_target(target)
    with pytest.raises(ConfigError, match=r"draft target_layer_ids \[4\] are outside the target's 4 layers"):
        dataclasses.replace(good, target_layer_ids=(0, 4), source_format="z-lab").check_target(target)
    with pytest.raises(ConfigError, match="draft_vocab_size 65 is larger than the target vocabulary of 64"):
        dataclasses.replace(good, draft_vocab_size=65).check_target(target)


def test_draft_made_for_another_target_depth():
    """num_target_layers that disagrees with the target: a warning when the taps exist, and the
    error for taps that do not says which depth the draft was made for."""
    target = target_config_from_hf(qwen3_raw(layers=4))
    draft = draft_config_from_hf(zlab_raw(**{**qwen3_raw(layers=1), "architectures": ["DFlashDraftModel"]},
                                         num_target_layers=36, dflash_config={"mask_token_id": 3,
                                                                             "target_layer_ids": [1, 2]}))
    with pytest.warns(UserWarning, match="made for a 36-layer target and this target has 4 layers"):
        draft.check_target(target)
    with pytest.raises(ConfigError, match=r"target_layer_ids \[33\] are outside the target's 4 layers; "
                                          "it was made for a 36-layer target"):
        dataclasses.replace(draft, target_layer_ids=(1, 33)).check_target(target)


def test_unsupported_draft_architecture_is_named():
    raw = zlab_raw(architectures=["DFlash3DraftModel"])
    from dflash_jax.model.hf_config import is_draft_config
    assert is_draft_config(raw)  # so a swapped --target/--draft is still recognised
    with pytest.raises(ConfigError, match="architecture DFlash3DraftModel is not supported"):
        draft_config_from_hf(raw)
    # DFlash2 reads its convolution and selector fields, from dflash_config or the top level
    dflash2 = zlab_raw(architectures=["DFlash2DraftModel"], conv_kernel_size=2, conv_group_size=8,
                       selector_rank=4, selector_top_k=3)
    config = draft_config_from_hf(dflash2)
    assert config.selector.top_k == 3 and config.model.layers[0].conv.group_size == 8
    with pytest.raises(ConfigError, match="conv_kernel_size"):
        draft_config_from_hf(zlab_raw(architectures=["DFlash2DraftModel"]))


def test_speculators_tap_ids_and_top_level_window_fields():
    with pytest.raises(ConfigError, match=r"aux_hidden_state_layer_ids \[0, 2\] must be >= 1"):
        draft_config_from_hf(speculators_raw(aux_hidden_state_layer_ids=[0, 2]))
    layers = {k: v for k, v in qwen3_raw(layers=2).items()
              if k not in ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers")}
    config = draft_config_from_hf(speculators_raw(
        transformer_layer_config=layers, layer_types=["sliding_attention", "full_attention"],
        use_sliding_window=True, sliding_window=16))
    assert config.model.layer_types == ("sliding_attention", "full_attention")
    assert config.model.sliding_window == 16 and config.causal_layers == (True, False)


def test_sliding_window_follows_transformers_semantics():
    """use_sliding_window gates the window; without layer_types, layers >= max_window_layers slide."""
    from transformers import Qwen3Config


    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    for extra in ({"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 2},
                  {"use_sliding_window": False, "sliding_window": 7},
                  {"use_sliding_window": False, "sliding_window": 7,
                   "layer_types": ["sliding_attention", "full_attention"] * 2}):
        hf = Qwen3Config(**base, **extra)
        ours = target_config_from_hf(hf.to_dict())
        assert list(ours.layer_types) == list(hf.layer_types)
        assert ours.sliding_window == hf.sliding_window
    # the window's field absent (4096) or null (no window, so no sliding layers)
    for window in ({}, {"sliding_window": None}):
        raw = {**base, "model_type": "qwen3", "rope_theta": 1e6, "use_sliding_window": True, "max_window_layers": 1,
               **window}
        hf, ours = Qwen3Config.from_dict(raw), target_config_from_hf(raw)
        assert list(ours.layer_types) == list(hf.layer_types)
        assert ours.sliding_window == hf.sliding_window
        assert [ours.window(i) for i in range(4)] == [
            hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]


@pytest.mark.parametrize("block_inside", [False, True], ids=["block-top-level", "block-in-dflash-config"])
def test_a_qwen36_draft_config_parses_as_published(block_inside):
    """z-lab's Qwen3.6-27B draft as published: mask 248070, taps into a 64-layer hybrid, sliding
    (2048) layers before a full one, block_size at the top level or inside dflash_config; its
    sliding layers are causal, as the reference runs them."""
    dflash = {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}
    raw = zlab_raw(hidden_size=5120, intermediate_size=17408, num_target_layers=64, vocab_size=248320,
                   rope_theta=10000000, use_sliding_window=True, sliding_window=2048, max_window_layers=0,
                   layer_types=["sliding_attention"] * 4 + ["full_attention"], dflash_config=dflash)
    if block_inside:
        dflash["block_size"] = raw.pop("block_size")
    config = draft_config_from_hf(raw)
    assert (config.block_size, config.mask_token_id, config.target_layer_ids) == (16, 248070, (1, 16, 31, 46, 61))
    assert config.model.layer_types == ("sliding_attention",) * 4 + ("full_attention",)
    assert [config.model.window(i) for i in range(5)] == [2048] * 4 + [None]
    assert config.causal_layers == (True,) * 4 + (False,)
