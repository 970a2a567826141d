"""Checkpoint conversion (HF -> converted folder) and export (params -> HF folders): round trips
against direct HF loads, transformers and the z-lab reference, with tiny random models."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import checkpoints_convert
from builders import speculators_draft_folder, target_folder, zlab_draft_folder
from checkpoints_convert import convert, export_draft, export_target
from checkpoints_convert.convert import SIDE_FILES
from dflash_jax.loading import checkpoint
from dflash_jax.loading.checkpoint import CheckpointError
from dflash_jax.loading.models import load_draft, load_target
from dflash_jax.model.params import cast_params

REPO = Path(__file__).resolve().parents[1]


def assert_same_tree(a, b):
    """Same structure, and every leaf the same dtype and bits."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert np.array_equal(np.asarray(x), np.asarray(y)), path


def assert_same_state_dict(actual: dict, expected: dict):
    assert sorted(actual) == sorted(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert torch.equal(actual[name], tensor), name


@pytest.mark.parametrize("src_dtype,out_dtype,tied,shard", [
    ("float32", "float32", False, None),
    ("bfloat16", "bfloat16", True, "20KB"),
    ("float16", "float16", False, "20KB"),
    ("float32", "bfloat16", True, None),
])
def test_target_round_trip_is_bit_exact(tmp_path, src_dtype, out_dtype, tied, shard):
    src, out = tmp_path / "hf", tmp_path / "converted"
    target_folder(src, dtype=src_dtype, tie_word_embeddings=tied, max_shard_size=shard)
    if shard:
        assert (src / "model.safetensors.index.json").is_file()
    assert convert(src, out, dtype=out_dtype, progress=False) == out
    direct, converted = load_target(src, dtype=out_dtype), load_target(out, dtype=out_dtype)
    assert converted.config == direct.config
    assert (converted.params.lm_head is None) == tied
    assert_same_tree(converted.params, direct.params)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(converted.params))
    marker = json.loads((out / checkpoint.MARKER_FILE).read_text())
    assert marker == {"format_version": checkpoint.FORMAT_VERSION, "kind": "target", "dtype": out_dtype}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (src / name).read_bytes()
    # config.json states the dtype stored, not the source's
    source_config = json.loads((src / "config.json").read_text())
    assert source_config["dtype"] == src_dtype
    assert json.loads((out / "config.json").read_text()) == {**source_config, "dtype": out_dtype,
                                                             "torch_dtype": out_dtype}
    assert not list(out.glob("*.safetensors"))


def test_a_release_s_text_config_states_the_stored_dtype():
    """A release (Qwen3.5) keeps the decoder's fields, its dtype among them, in text_config."""
    from checkpoints_convert.convert import _stating_dtype

    release = {"architectures": ["Qwen3_5ForConditionalGeneration"], "torch_dtype": "float32",
               "text_config": {"dtype": "float32", "hidden_size": 32}, "vision_config": {"depth": 2}}
    assert _stating_dtype(release, "bfloat16") == {
        "architectures": ["Qwen3_5ForConditionalGeneration"], "torch_dtype": "bfloat16", "dtype": "bfloat16",
        "text_config": {"dtype": "bfloat16", "hidden_size": 32}, "vision_config": {"depth": 2}}


def test_converted_folder_loads_in_another_dtype(tmp_path, capsys):
    src, out = tmp_path / "hf", tmp_path / "converted"
    target_folder(src)
    convert(src, out, dtype="float32", progress=False)
    assert_same_tree(load_target(out, dtype="bfloat16", progress=True).params,
                     load_target(src, dtype="bfloat16").params)
    assert "reading converted: 100%" in capsys.readouterr().err  # a bar over bytes, layer by layer


def test_save_params_with_an_orbax_that_always_copies(tmp_path, monkeypatch):
    """orbax-checkpoint < 0.12.5 (the GPU image has 0.12.4) has no deepcopy_host_arrays: saving
    still works, with a warning about the memory it takes."""
    import orbax.checkpoint as ocp

    class CopyingNumpyHandler(ocp.type_handlers.NumpyHandler):
        def __init__(self):
            super().__init__()
    monkeypatch.setattr(ocp.type_handlers, "NumpyHandler", CopyingNumpyHandler)
    params = {"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4, np.float32)}
    with pytest.warns(UserWarning, match="twice the largest layer's size"):
        checkpoint.save_params(tmp_path, params)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    assert_same_tree(checkpoint.restore_params(tmp_path, abstract), params)


def test_zlab_draft_round_trip(tmp_path):
    src, out = tmp_path / "draft", tmp_path / "converted"
    zlab_draft_folder(src)
    convert(src, out, dtype="float32", progress=False)
    direct, converted = load_draft(src, dtype="float32"), load_draft(out, dtype="float32")
    assert converted.config == direct.config and direct.config.model.sliding_window == 8
    assert_same_tree(converted.params, direct.params)
    assert json.loads((out / checkpoint.MARKER_FILE).read_text())["kind"] == "draft"


@pytest.mark.parametrize("draft_vocab", [64, None])
def test_speculators_draft_round_trip(tmp_path, draft_vocab):
    src, out = tmp_path / "draft", tmp_path / "converted"
    tensors = speculators_draft_folder(src, draft_vocab=draft_vocab)
    if draft_vocab:
        convert(src, out, dtype="float32", progress=False)
    else:  # its own embedding and head copies are dropped, and it says so
        with pytest.warns(UserWarning, match="own embed_tokens.weight and lm_head.weight are not kept"):
            convert(src, out, dtype="float32", progress=False)
    direct, converted = load_draft(src, dtype="float32"), load_draft(out, dtype="float32")
    assert converted.config == direct.config
    assert converted.config.target_layer_ids == (1, 2)
    assert_same_tree(converted.params, direct.params)
    # HF's separate q/k/v and gate/up tensors sit side by side in the fused leaves
    layer = converted.params.layers[1]
    qkv = np.concatenate([tensors[f"layers.1.self_attn.{p}_proj.weight"].numpy().T for p in "qkv"], axis=1)
    gate_up = np.concatenate([tensors[f"layers.1.mlp.{p}_proj.weight"].numpy().T for p in ("gate", "up")], axis=1)
    np.testing.assert_array_equal(layer.attention.qkv_proj, qkv)
    np.testing.assert_array_equal(layer.ffn.gate_up_proj, gate_up)
    if draft_vocab:
        np.testing.assert_array_equal(converted.params.lm_head, tensors["lm_head.weight"].numpy().T)
        assert converted.params.d2t.dtype == np.int32
        np.testing.assert_array_equal(converted.params.d2t, tensors["d2t"].numpy())
    else:
        assert converted.params.lm_head is None and converted.params.d2t is None


@pytest.mark.parametrize("is_causal, causal", [(None, [True, False]), (True, [True, True])],
                         ids=["sliding-causal", "is-causal"])
def test_export_draft_loads_in_reference_with_identical_weights(tmp_path, is_causal, causal):
    """The reference's causality comes back: its default rule (the sliding layer causal) with no
    is_causal written, and a draft whose is_causal makes every layer causal with that flag."""
    from dflash.model import DFlashDraftModel

    original = zlab_draft_folder(tmp_path / "draft", **({} if is_causal is None else {"is_causal": is_causal}))
    draft = load_draft(tmp_path / "draft", dtype="float32")
    out = export_draft(draft.config, draft.params, tmp_path / "exported", max_shard_mb=1)
    assert json.loads((out / "config.json").read_text()).get("is_causal") == is_causal
    reloaded = DFlashDraftModel.from_pretrained(out)
    assert reloaded.target_layer_ids == [1, 2] and reloaded.block_size == 4 and reloaded.mask_token_id == 100
    assert [layer.self_attn.is_causal for layer in reloaded.layers] == causal
    assert_same_state_dict(reloaded.state_dict(), original.state_dict())
    again = load_draft(out, dtype="float32")
    assert again.config == draft.config
    assert_same_tree(again.params, draft.params)


def test_export_draft_casts_and_reads_back(tmp_path):
    zlab_draft_folder(tmp_path / "draft")
    draft = load_draft(tmp_path / "draft", dtype="bfloat16")
    out = export_draft(draft.config, draft.params, tmp_path / "exported", dtype="float32")
    written = json.loads((out / "config.json").read_text())
    assert written["dtype"] == written["torch_dtype"] == "float32"  # transformers 5 and older readers
    assert [f.name for f in out.glob("*.safetensors")] == ["model.safetensors"]  # 5 GB shards by default
    assert_same_tree(load_draft(out, dtype="float32").params, cast_params(draft.params, jnp.float32))


@pytest.mark.parametrize("tied", [False, True])
def test_export_target_loads_in_transformers_with_identical_weights(tmp_path, tied):
    from transformers import Qwen3ForCausalLM

    # 768 kB embedding (3000 x 64 f32) + 2 layers of 510 kB (3 x 162 kB of MLP): max_shard_mb=1
    # must shard, and MB means 10**6 bytes: the two layers (1.02 MB) fit 1 MiB but not one shard.
    original = target_folder(tmp_path / "hf", tie_word_embeddings=tied, vocab_size=3000, hidden_size=64,
                           intermediate_size=632, eos_token_id=[5, 7])
    target = load_target(tmp_path / "hf", dtype="float32")
    out = export_target(target.config, target.params, tmp_path / "exported", max_shard_mb=1)
    files = sorted(out.glob("*.safetensors"))
    assert len(files) >= 2 and all(f.stat().st_size <= 10**6 for f in files)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    assert ("lm_head.weight" in index["weight_map"]) != tied
    assert_same_state_dict(Qwen3ForCausalLM.from_pretrained(out).state_dict(), original.state_dict())
    again = load_target(out, dtype="float32")
    assert again.config == target.config and again.config.eos_token_ids == (5, 7)
    assert_same_tree(again.params, target.params)


def test_export_target_side_files_in_place_and_refusals(tmp_path):
    target_folder(tmp_path / "hf")
    (tmp_path / "hf" / "chat_template.jinja").write_text("{{ messages }}")
    (tmp_path / "hf" / "README.md").write_text("not a side file")
    target = load_target(tmp_path / "hf", dtype="float32")
    out = export_target(target.config, target.params, tmp_path / "exported", side_files_from=tmp_path / "hf")
    side = sorted(p.name for p in out.iterdir() if p.name not in ("config.json", "model.safetensors"))
    assert side == sorted(name for name in SIDE_FILES if (tmp_path / "hf" / name).is_file())
    assert "chat_template.jinja" in side and "README.md" not in side
    # saved back in place: the side files are read before the folder is replaced
    export_target(target.config, target.params, out, dtype="bfloat16", side_files_from=out, overwrite=True)
    assert sorted(p.name for p in out.iterdir() if p.name not in ("config.json", "model.safetensors")) == side
    assert load_target(out).params.embed.dtype == jnp.bfloat16
    with pytest.raises(TypeError, match="config must be a ModelConfig, got Target"):
        export_target(target, target.params, tmp_path / "x")
    with pytest.raises(TypeError, match="params must be a TargetParams, got ModelConfig"):
        export_target(target.config, target.config, tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="side_files_from"):
        export_target(target.config, target.params, tmp_path / "x", side_files_from=tmp_path / "missing")
    # a float16 cast that overflows is refused, naming the tensor, as conversion refuses it
    big = target.params.replace(norm=target.params.norm.at[0].set(1e6))
    with pytest.raises(CheckpointError, match="tensor 'model.norm.weight' has values beyond float16's range"):
        export_target(target.config, big, tmp_path / "x", dtype="float16")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=["022", "027"])
def test_outputs_get_the_umask_permissions(tmp_path, umask):
    """Every file and folder written, whatever its writer (safetensors' private temp file, a copied
    owner-only tokenizer file, orbax), gets what a plain create under the umask gives."""
    target_folder(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").chmod(0o600)
    target = load_target(tmp_path / "hf", dtype="float32")
    old_umask = os.umask(umask)
    try:
        outputs = [convert(tmp_path / "hf", tmp_path / "converted", progress=False),
                   export_target(target.config, target.params, tmp_path / "exported", max_shard_mb=1)]
    finally:
        os.umask(old_umask)
    for out in outputs:
        paths = [out, *out.rglob("*")]
        modes = {p.relative_to(out): oct(p.stat().st_mode & 0o777) for p in paths}
        assert modes == {p.relative_to(out): oct((0o777 if p.is_dir() else 0o666) & ~umask) for p in paths}


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "checkpoints_convert", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=900)


def test_cli_converts_and_reports_errors_in_one_line(tmp_path):
    target_folder(tmp_path / "hf")
    done = _cli(str(tmp_path / "hf"), str(tmp_path / "out"), "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "out")
    assert "tensor" in done.stderr  # the tqdm bar
    assert_same_tree(load_target(tmp_path / "out", dtype="float32").params,
                     load_target(tmp_path / "hf", dtype="float32").params)
    failed = _cli(str(tmp_path / "hf"), str(tmp_path / "out"), "--quiet")
    assert failed.returncode == 2  # as generate and the trainers exit on refused input
    assert failed.stderr.count("\n") == 1 and failed.stderr.startswith("error: ") and "already exists" in failed.stderr
    assert "Traceback" not in failed.stderr


def test_cli_help_is_true_about_interruptions():
    """--help promises no cleanup after a SIGKILL, which cannot be caught: it says what may remain."""
    shown = " ".join(_cli("--help").stdout.split())
    assert "Ctrl-C or SIGTERM exits 130; either way the hidden folder is removed" in shown
    assert "SIGKILL (kill -9, the out-of-memory killer) cannot be caught: it may leave the hidden folder" in shown
    assert ".NAME.<8 hex digits>.tmp (NAME: OUT's own name)" in shown and "delete them" in shown
    assert "nothing is left behind" not in shown and "(default: bfloat16)" in shown


def test_package_api():
    assert checkpoints_convert.__all__ == ["convert", "export_draft", "export_target"]
