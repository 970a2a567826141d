"""Every way a checkpoint can be wrong gives one clear error naming the tensor, field or file,
and a failed conversion leaves nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from checkpoints_convert import convert, export_draft, export_target
from dflash_jax.loading import checkpoint
from dflash_jax.loading.checkpoint import CheckpointError
from dflash_jax.model.config import ConfigError
from dflash_jax.loading.models import load_draft, load_target
from builders import edit_config, speculators_draft_folder, target_folder, zlab_draft_folder


def _edit_tensors(directory: Path, edit, file: str = "model.safetensors") -> None:
    path = directory / file
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _only(directory: Path) -> list[str]:
    """What a directory holds (to check that nothing, not even a temp dir, was left)."""
    return sorted(p.name for p in directory.iterdir())


@pytest.fixture
def target(tmp_path) -> Path:
    target_folder(tmp_path / "hf")
    return tmp_path / "hf"


def _convert_fails(src: Path, error, match: str):
    out = src.parent / "out"
    with pytest.raises(error, match=match):
        convert(src, out, progress=False)
    assert _only(src.parent) == [src.name]


def test_missing_tensor(target):
    _edit_tensors(target, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    _convert_fails(target, CheckpointError, r"missing 1 tensor\(s\): 'model.layers.1.mlp.up_proj.weight'")


def test_extra_tensor(target):
    _edit_tensors(target, lambda t: t.update({"model.layers.0.mlp.bias": np.zeros(4, np.float32)}))
    _convert_fails(target, CheckpointError, r"unexpected tensor 'model.layers.0.mlp.bias' \[4\]")


def test_wrong_shape(target):
    _edit_tensors(target, lambda t: t.update({"model.norm.weight": np.zeros(31, np.float32)}))
    _convert_fails(target, CheckpointError, r"'model.norm.weight' has shape \[31\], config expects \[32\]")


def test_config_claims_more_layers_than_the_weights(target):
    edit_config(target, lambda raw: raw.update(num_hidden_layers=3, layer_types=["full_attention"] * 3))
    _convert_fails(target, CheckpointError, r"missing 11 tensor\(s\): 'model.layers.2.input_layernorm.weight'")


def test_config_hidden_size_disagrees_with_weights(target):
    edit_config(target, lambda raw: raw.update(hidden_size=48))
    _convert_fails(target, CheckpointError, r"tensor '[\w.]+' has shape \[\d+(, \d+)?\], config expects")


def test_unknown_model_type(target):
    edit_config(target, lambda raw: raw.update(model_type="mistral", architectures=["MistralForCausalLM"]))
    _convert_fails(target, ConfigError, r"architecture MistralForCausalLM is not supported \(supported: Qwen3ForCausalLM")


def test_missing_config_field(target):
    edit_config(target, lambda raw: raw.pop("intermediate_size"))
    _convert_fails(target, ConfigError, "required field 'intermediate_size' is missing")


def test_missing_draft_field(tmp_path):
    zlab_draft_folder(tmp_path / "draft")
    edit_config(tmp_path / "draft", lambda raw: raw["dflash_config"].pop("mask_token_id"))
    _convert_fails(tmp_path / "draft", ConfigError, "'dflash_config.mask_token_id' is missing")


def test_speculators_draft_missing_d2t(tmp_path):
    speculators_draft_folder(tmp_path / "draft")
    _edit_tensors(tmp_path / "draft", lambda t: t.pop("d2t"))
    _convert_fails(tmp_path / "draft", CheckpointError, r"missing 1 tensor\(s\): 'd2t'")


def test_speculators_full_vocabulary_copies(tmp_path):
    """A full-vocabulary speculators draft's own embedding and head are not used: a warning when
    they differ from the target's, silence for exact copies; identity d2t/t2d maps are accepted,
    any other d2t refused."""
    import warnings

    target_folder(tmp_path / "hf", num_hidden_layers=4)
    target = load_target(tmp_path / "hf", dtype="float32")
    speculators_draft_folder(tmp_path / "draft", draft_vocab=None)  # random copies: they differ
    with pytest.warns(UserWarning) as caught:
        load_draft(tmp_path / "draft", target, dtype="float32")
    assert sorted(str(w.message).split("own ")[1].split(" ")[0] for w in caught) == [
        "embed_tokens.weight", "lm_head.weight"]
    embed = np.asarray(target.params.embed)
    head = np.ascontiguousarray(np.asarray(target.params.lm_head).T)

    def exact_copies(tensors):
        tensors.update({"embed_tokens.weight": embed, "lm_head.weight": head,
                        "d2t": np.zeros(len(embed), np.int64), "t2d": np.ones(len(embed), bool)})
    _edit_tensors(tmp_path / "draft", exact_copies)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_draft(tmp_path / "draft", target, dtype="float32")
    one_moved = np.zeros(len(embed), np.int64)
    one_moved[5] = 1  # draft id 5 is target id 6
    _edit_tensors(tmp_path / "draft", lambda t: t.update(d2t=one_moved))
    with pytest.raises(CheckpointError, match="d2t maps draft ids to other target ids"):
        load_draft(tmp_path / "draft", target, dtype="float32")
    with pytest.raises(CheckpointError, match="d2t maps draft ids"):  # no target needed
        convert(tmp_path / "draft", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_integer_weight_and_float_id_map_are_refused(target, tmp_path):
    """Only id maps (d2t) are integers: an int8 weight without a quantization_config is not cast."""
    _edit_tensors(target, lambda t: t.update({"model.norm.weight": np.ones(32, np.int8)}))
    _convert_fails(target, CheckpointError, "'model.norm.weight' has dtype int8, expected a float dtype")
    tmp_path = tmp_path / "spec"
    speculators_draft_folder(tmp_path / "draft", draft_vocab=64)
    _edit_tensors(tmp_path / "draft", lambda t: t.update(d2t=t["d2t"].astype(np.float32)))
    _convert_fails(tmp_path / "draft", CheckpointError, "'d2t' has dtype float32, expected an integer dtype")


def test_float16_overflow_is_refused(target):
    _edit_tensors(target, lambda t: t["model.norm.weight"].__setitem__(3, 1e5))
    with pytest.raises(CheckpointError, match=r"'model.norm.weight' has values beyond float16's range \(max \|x\| 1e\+05\)"):
        convert(target, target.parent / "out", dtype="float16", progress=False)
    convert(target, target.parent / "out", dtype="bfloat16", progress=False)


def test_index_with_a_non_string_shard_name(tmp_path):
    target_folder(tmp_path / "hf", max_shard_size="20KB")
    index = tmp_path / "hf" / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["weight_map"]["model.norm.weight"] = 3
    index.write_text(json.dumps(raw))
    _convert_fails(tmp_path / "hf", CheckpointError, "'weight_map' values must be shard file names")


def test_missing_shard(tmp_path):
    target_folder(tmp_path / "hf", max_shard_size="20KB")
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[1]
    shard.unlink()
    _convert_fails(tmp_path / "hf", CheckpointError, f"missing: \\['{shard.name}'\\]")


def test_truncated_shard(tmp_path):
    target_folder(tmp_path / "hf", max_shard_size="20KB")
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:100])
    _convert_fails(tmp_path / "hf", CheckpointError, f"{shard.name}: not a readable safetensors file")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_target(tmp_path / "hf", "float32")


def test_tensor_in_two_shards(tmp_path):
    """A tensor that a second shard holds again (not named by the index) is refused rather than
    read twice, the later copy silently winning."""
    target_folder(tmp_path / "hf", max_shard_size="20KB")
    first, second = sorted((tmp_path / "hf").glob("model-*.safetensors"))[:2]
    name = next(iter(load_file(str(first))))
    _edit_tensors(tmp_path / "hf", lambda t: t.update({name: load_file(str(first))[name]}), second.name)
    _convert_fails(tmp_path / "hf", CheckpointError, f"tensor '{name}' appears in more than one shard")


@pytest.mark.parametrize("index", ['{"metadata": {}}', "not json"], ids=["no-weight-map", "not-json"])
def test_broken_shard_index(tmp_path, index):
    target_folder(tmp_path / "hf", max_shard_size="20KB")
    (tmp_path / "hf" / "model.safetensors.index.json").write_text(index)
    message = "has no 'weight_map' object" if "metadata" in index else "is not valid JSON"
    _convert_fails(tmp_path / "hf", ValueError, f"model.safetensors.index.json {message}")


def test_tensor_numpy_cannot_hold(target):
    """An fp8 weight in a checkpoint that does not declare its quantization."""
    import torch
    from safetensors.torch import load_file as load_torch, save_file as save_torch

    path = target / "model.safetensors"
    tensors = load_torch(str(path))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_torch(tensors, str(path), metadata={"format": "pt"})
    _convert_fails(target, CheckpointError, f"tensor '{name}' could not be read")


def test_quantized_checkpoint_is_refused(target):
    edit_config(target, lambda raw: raw.update(quantization_config={"quant_method": "fp8"}))
    _convert_fails(target, ConfigError, r"quantized checkpoints .* 'fp8'\) are not supported")


def test_tied_checkpoint_with_a_different_stored_head_warns(tmp_path):
    import warnings

    target_folder(tmp_path / "hf", tie_word_embeddings=True)
    embed = "model.embed_tokens.weight"
    _edit_tensors(tmp_path / "hf", lambda t: t.update({"lm_head.weight": t[embed].copy()}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an identical copy is silently ignored
        load_target(tmp_path / "hf", "float32")
    _edit_tensors(tmp_path / "hf", lambda t: t.update({"lm_head.weight": t[embed] + 1}))
    with pytest.warns(UserWarning, match="stored lm_head.weight, which differs from it, is ignored"):
        target = load_target(tmp_path / "hf", "float32")
    np.testing.assert_array_equal(np.asarray(target.params.embed),
                                  load_file(str(tmp_path / "hf" / "model.safetensors"))[embed])


def test_missing_source(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        convert(tmp_path / "nowhere", tmp_path / "out", progress=False)


def test_existing_output_is_refused_before_any_work(target, monkeypatch):
    """The refusal suggests --overwrite only where --overwrite would replace the folder."""
    out = target.parent / "out"
    out.mkdir()
    (out / "keep").write_text("mine")
    monkeypatch.setattr(checkpoint, "load_hf_target", lambda *a, **k: pytest.fail("work started"))
    with pytest.raises(FileExistsError) as refused:
        convert(target, out, progress=False)
    assert str(refused.value) == (f"{out} already exists and is not a model folder (with a config.json) or an "
                                  "empty folder: refusing to replace it, even with --overwrite / overwrite=True; "
                                  "choose another output folder")
    assert _only(out) == ["keep"]
    (out / "config.json").write_text("{}")
    with pytest.raises(FileExistsError) as refused:
        convert(target, out, progress=False)
    assert str(refused.value) == f"{out} already exists (use --overwrite / overwrite=True to replace it)"
    assert _only(out) == ["config.json", "keep"]


def test_read_only_destination_is_named(target, capsys):
    """A destination in a folder that takes no new entries: the error names the destination given
    and the folder that refused, not the hidden folder the conversion writes first."""
    import os

    from checkpoints_convert.__main__ import main

    parent = target.parent / "read-only"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        if os.access(parent, os.W_OK):
            pytest.skip("chmod does not stop this user's writes (root)")
        for out in (parent / "out", parent / "missing" / "out"):
            with pytest.raises(PermissionError) as refused:
                convert(target, out, progress=False)
            assert str(refused.value) == f"cannot write {out}: Permission denied (in {parent})"
        assert main([str(target), str(parent / "out"), "--quiet"]) == 2
        assert capsys.readouterr().err == f"error: cannot write {parent / 'out'}: Permission denied (in {parent})\n"
        assert _only(parent) == []
    finally:
        parent.chmod(0o755)


def test_overwrite_replaces_only_a_model_or_empty_folder(target):
    out = target.parent / "out"
    out.mkdir()
    (out / "keep").write_text("mine")
    with pytest.raises(FileExistsError, match="not a model folder .* even with --overwrite"):
        convert(target, out, overwrite=True, progress=False)
    model = load_target(target)
    with pytest.raises(FileExistsError, match="not a model folder"):
        export_target(model.config, model.params, out, overwrite=True)
    assert _only(out) == ["keep"]
    (out / "keep").unlink()
    convert(target, out, overwrite=True, progress=False)            # empty: replaced
    convert(target, out, overwrite=True, progress=False)            # converted: replaced
    assert checkpoint.is_converted(out)
    export_target(model.config, model.params, out, overwrite=True)  # a model folder: replaced
    assert not checkpoint.is_converted(out) and (out / "model.safetensors").is_file()


def test_output_that_appears_during_the_conversion_is_kept(target, monkeypatch):
    """The existence check runs again before the output is moved into place."""
    out = target.parent / "out"
    real_save = checkpoint.save_params

    def save_while_someone_writes_out(directory, params):
        real_save(directory, params)
        out.mkdir()
        (out / "keep").write_text("mine")

    monkeypatch.setattr(checkpoint, "save_params", save_while_someone_writes_out)
    with pytest.raises(FileExistsError, match="already exists"):
        convert(target, out, progress=False)
    assert _only(target.parent) == ["hf", "out"] and _only(out) == ["keep"]


def test_cli_kill_leaves_nothing_and_stale_folders_are_named(target, monkeypatch, capsys):
    import os
    import signal

    from checkpoints_convert.__main__ import main

    monkeypatch.setattr(checkpoint, "save_params", lambda directory, params: os.kill(os.getpid(), signal.SIGTERM))
    assert main([str(target), str(target.parent / "out"), "--quiet"]) == 130
    assert "interrupted: nothing was written" in capsys.readouterr().err
    assert _only(target.parent) == ["hf"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
    monkeypatch.undo()
    (target.parent / ".out.1234abcd.tmp").mkdir()  # as a SIGKILL would leave it
    with pytest.warns(UserWarning, match=r"holds \.out\.1234abcd\.tmp, left by an interrupted conversion"):
        assert main([str(target), str(target.parent / "out"), "--quiet"]) == 0


def test_cli_kill_waits_for_the_params_writers(target, monkeypatch, capsys):
    """orbax writes params/ from threads a KeyboardInterrupt does not stop: a kill during the save
    lets them finish before the partial output is removed, so nothing is left behind."""
    import os
    import signal
    import threading
    import time

    from checkpoints_convert.__main__ import main

    def save_from_a_thread(directory, params):
        def write():
            time.sleep(0.3)
            (directory / "params").mkdir()
            (directory / "params" / "late").write_text("written after the signal")
        writer = threading.Thread(target=write)
        writer.start()
        os.kill(os.getpid(), signal.SIGTERM)
        writer.join()  # as orbax's Checkpointer waits for its writes on exit

    monkeypatch.setattr(checkpoint, "save_params", save_from_a_thread)
    assert main([str(target), str(target.parent / "out"), "--quiet"]) == 130
    err = capsys.readouterr().err
    assert "finishing the write of params/" in err and "interrupted: nothing was written" in err
    assert _only(target.parent) == ["hf"]


def test_damaged_converted_folder_is_named(target):
    import shutil

    out = target.parent / "out"
    convert(target, out, progress=False)
    data = sorted((p for p in (out / checkpoint.PARAMS_DIR).rglob("*") if p.is_file() and p.stat().st_size > 4096),
                  key=lambda p: p.stat().st_size)[-1]
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"{checkpoint.PARAMS_DIR}/ could not be read .*convert the model again"):
        load_target(out)
    shutil.rmtree(out / checkpoint.PARAMS_DIR)
    with pytest.raises(CheckpointError, match=f"{checkpoint.PARAMS_DIR}/ is missing .*convert the model again"):
        load_target(out)


def test_converted_folder_as_source_is_named(target):
    convert(target, target.parent / "out", progress=False)
    with pytest.raises(ValueError, match="out is already a converted folder"):
        convert(target.parent / "out", target.parent / "again", progress=False)


def test_output_may_not_replace_the_source(target):
    with pytest.raises(ValueError, match="would replace the source"):
        convert(target, target.parent, overwrite=True, progress=False)


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failure_mid_conversion_leaves_nothing(target, monkeypatch, error):
    real_save = checkpoint.save_params

    def save_then_fail(directory, params):
        real_save(directory, params)   # half the output exists when the failure hits
        raise error

    monkeypatch.setattr(checkpoint, "save_params", save_then_fail)
    with pytest.raises(type(error)):
        convert(target, target.parent / "out", progress=False)
    assert _only(target.parent) == ["hf"]


def test_failed_overwrite_keeps_the_old_output(target, monkeypatch):
    out = target.parent / "out"
    convert(target, out, dtype="float32", progress=False)

    def fail(directory, params):
        raise RuntimeError("boom")

    monkeypatch.setattr(checkpoint, "save_params", fail)
    with pytest.raises(RuntimeError):
        convert(target, out, overwrite=True, progress=False)
    assert _only(target.parent) == ["hf", "out"]
    assert json.loads((out / checkpoint.MARKER_FILE).read_text())["dtype"] == "float32"
    monkeypatch.undo()
    convert(target, out, overwrite=True, progress=False)
    assert _only(target.parent) == ["hf", "out"]
    assert json.loads((out / checkpoint.MARKER_FILE).read_text())["dtype"] == "bfloat16"


def test_converted_folder_of_the_wrong_kind(tmp_path):
    zlab_draft_folder(tmp_path / "draft")
    convert(tmp_path / "draft", tmp_path / "out", progress=False)
    with pytest.raises(ConfigError, match="holds a DFlash draft, not a target"):
        load_target(tmp_path / "out")
    target_folder(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "target", progress=False)
    with pytest.raises(ConfigError, match="holds a Qwen3 target, not a DFlash draft"):
        load_draft(tmp_path / "target")


def test_marker_of_the_wrong_kind(target):
    out = target.parent / "out"
    convert(target, out, progress=False)
    checkpoint.write_marker(out, "draft", "bfloat16")
    with pytest.raises(CheckpointError, match="is a converted draft, not a target"):
        load_target(out)


def test_marker_that_is_not_json(target):
    out = target.parent / "out"
    convert(target, out, progress=False)
    (out / checkpoint.MARKER_FILE).write_text("{truncated")
    with pytest.raises(ConfigError, match=f"{checkpoint.MARKER_FILE} is not valid JSON"):
        load_target(out)


def test_converted_config_edited_after_conversion(target):
    out = target.parent / "out"
    convert(target, out, progress=False)
    edit_config(out, lambda raw: raw.update(tie_word_embeddings=True))
    with pytest.raises(CheckpointError, match="params leaf 'lm_head' is \\[32, 128\\] in the checkpoint, "
                                              "config.json expects absent"):
        load_target(out)
    edit_config(out, lambda raw: raw.update(tie_word_embeddings=False, intermediate_size=96))
    with pytest.raises(CheckpointError, match="params leaf 'layers.0.ffn.down_proj' is \\[64, 32\\]"):
        load_target(out)


@pytest.mark.parametrize("version", [1, 99], ids=["older", "newer"])
def test_converted_folder_of_an_older_or_newer_format(target, version):
    """Only this library's own format version is read: version 1 folders (unfused q/k/v) too
    must be converted again."""
    out = target.parent / "out"
    convert(target, out, progress=False)
    (out / checkpoint.MARKER_FILE).write_text(json.dumps({"format_version": version, "kind": "target"}))
    with pytest.raises(CheckpointError, match=f"format version {version}, this library reads version"):
        load_target(out)


def test_export_checks_params_against_config(tmp_path):
    target_folder(tmp_path / "hf")
    target = load_target(tmp_path / "hf", dtype="float32")
    layers = list(target.params.layers)
    attention = layers[1].attention
    layers[1] = layers[1].replace(attention=attention.replace(qkv_proj=attention.qkv_proj[:, :-8]))
    with pytest.raises(CheckpointError, match=r"'layers.1.attention.qkv_proj' has \d+ columns, the config's fused "
                                              "tensors need"):
        export_target(target.config, target.params.replace(layers=tuple(layers)), tmp_path / "out")
    ffn = target.params.layers[1].ffn
    layers[1] = target.params.layers[1].replace(ffn=ffn.replace(down_proj=ffn.down_proj[:, :8]))
    with pytest.raises(CheckpointError, match=r"'model.layers.1.mlp.down_proj.weight' has shape \[8, "):
        export_target(target.config, target.params.replace(layers=tuple(layers)), tmp_path / "out")
    with pytest.raises(CheckpointError, match="params lack tensor 'lm_head.weight'"):
        export_target(target.config, target.params.replace(lm_head=None), tmp_path / "out")
    assert _only(tmp_path) == ["hf"]


def test_export_draft_refuses_what_zlab_format_cannot_hold(tmp_path):
    speculators_draft_folder(tmp_path / "spec")
    draft = load_draft(tmp_path / "spec", dtype="float32")
    with pytest.raises(ValueError, match="reduced draft vocabulary"):
        export_draft(draft.config, draft.params, tmp_path / "out")
    speculators_draft_folder(tmp_path / "full", draft_vocab=None)
    draft = load_draft(tmp_path / "full", dtype="float32")
    with pytest.raises(ValueError, match="num_target_layers is unknown"):
        export_draft(draft.config, draft.params, tmp_path / "out")
    target_folder(tmp_path / "hf")
    target = load_target(tmp_path / "hf", dtype="float32")
    export_target(target.config, target.params, tmp_path / "out")
    with pytest.raises(FileExistsError):
        export_target(target.config, target.params, tmp_path / "out")
    assert _only(tmp_path) == ["full", "hf", "out", "spec"]
