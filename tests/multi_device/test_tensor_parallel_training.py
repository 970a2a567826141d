"""Training a draft against a frozen target split over devices, and the end-to-end benchmark's
``--tp``: the same results as on one device (run by tests/test_tensor_parallel.py with 4 forced CPU
devices)."""

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from builders import make_target, save_target
from dflash_jax.training import data, train_draft
from dflash_jax.loading.models import load_target
from dflash_jax.model.sharding import TensorParallel, make_mesh
from dflash_jax.training.train_target import OptimConfig

if jax.device_count() < 4:   # run on its own (the main suite's conftest does not collect this folder)
    pytest.skip("needs 4 devices: XLA_FLAGS=--xla_force_host_platform_device_count=4, as "
                "tests/test_tensor_parallel.py runs it", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_e2e  # noqa: E402
import profile_step  # noqa: E402


def test_a_draft_trained_against_a_split_target_equals_one_trained_on_one_device(tmp_path):
    """TP 2 and TP 4 train the same draft as TP 1 (the taps come whole from the split forward; the
    draft's loss reads the split embedding and head through XLA's partitioning): every exported
    f32 tensor equal to 1e-5 (3 AdamW steps of lr 1e-3 move a weight by up to 3e-3; the shards sum
    in another order, which Adam's normalisation can lift to a few 1e-6)."""
    target_dir = save_target(make_target(seed=3, vocab=128, hidden=64, layers=4, heads=4, kv_heads=4, head_dim=16,
                                         rope_theta=1e4), tmp_path / "target")
    rows = data.TokenRows(np.random.default_rng(0).integers(0, 120, (16, 32)).astype(np.int32), np.ones((16, 32), bool))
    recipe = train_draft.DraftTrainConfig(optim=OptimConfig(steps=3, lr=1e-3), num_anchors=4, batch_size=2,
                                          compute_dtype="float32", save_every=10)
    exported = {}
    for tp in (1, 2, 4):
        split = None if tp == 1 else TensorParallel(make_mesh(tp), replicate_draft=True)
        target = load_target(target_dir, "float32", tensor_parallel=split)
        config = train_draft.new_draft_config(target.config, num_layers=2, block_size=4, mask_token_id=127)
        train_draft.train_draft(target, rows, tmp_path / f"draft{tp}", config, recipe, export_dtype="float32")
        exported[tp] = load_file(str(tmp_path / f"draft{tp}" / "model.safetensors"))
    for tp in (2, 4):
        assert exported[tp].keys() == exported[1].keys()
        for name, weight in exported[1].items():
            np.testing.assert_allclose(exported[tp][name], weight, rtol=1e-4, atol=1e-5, err_msg=f"tp {tp}: {name}")


def test_the_benchmark_times_split_models_on_cpu(tmp_path, capsys):
    """bench_e2e --tp 2 (draft split, then replicated) runs the tiny shape end to end, reports its
    split, and measures the all-reduces its floors count (one row for decode, 4 for the block)."""
    for extra in ([], ["--replicate-draft"]):
        bench_e2e.main(["--shape", "tiny", "--out", str(tmp_path), "--tp", "2", *extra, "--skip", "parts",
                        "--batches", "1", "--contexts", "16", "--blocks", "4", "--alphas", "0.86", "--repeats", "1"])
        printed = capsys.readouterr().out
        assert "tiny | tp 2" + (", draft replicated" if extra else " |") in printed
        assert "bs1_ctx16_block4_alpha0.86" in printed
        report = json.loads((tmp_path / "bench_e2e.json").read_text())
        assert sorted(report["allreduce_us"]) == ["1", "4"] and all(us > 0 for us in report["allreduce_us"].values())


def test_the_profiler_profiles_split_models_on_cpu(tmp_path):
    """profile_step --tp 2 traces both modes of the tiny shape split over two devices (no GPU
    kernels on a CPU: the run, not the kernel table, is what is checked here)."""
    profile_step.main(["--shape", "tiny", "--tp", "2", "--steps", "2", "--top", "1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "profile.json").read_text())
    assert report["decode"]["traced_wall_ms_per_step"] > 0 and report["dflash"]["traced_wall_ms_per_step"] > 0
