"""``python -m dflash_jax.aot``: the engine's prefill and decode-chunk programs compiled ahead of
time for TPU topologies by libtpu's compiler (no TPU), with per-device sizes and a fits / does
not fit answer. The real-width programs compile here with a few layers of each model (one period
of its layer pattern): a layer's kernels and shapes are what can fail; depth only multiplies."""

import dataclasses
import math

import pytest

pytest.importorskip("libtpu", reason='the TPU compiler comes with pip install -e ".[tpu]"')

from dflash_jax.entrypoints.aot import main, size_for_topology  # noqa: E402
from dflash_jax.model.shapes import SHAPES  # noqa: E402


def shallow(shape: str, layers: int):
    """SHAPES[shape] with the target's first ``layers`` layers and a one-layer draft tapping them."""
    target, draft = SHAPES[shape]
    target = target.with_layers(target.layers[:layers])
    draft = dataclasses.replace(draft, model=draft.model.with_layers(draft.model.layers[:1]),
                                causal_layers=draft.causal_layers[:1], target_layer_ids=(0, layers - 1),
                                num_target_layers=layers)
    return target, draft


def test_cli_fits_on_one_device_and_split(capsys):
    common = ["--topology", "v5e:2x2", "--shape", "tiny", "--max-model-len", "256", "--max-num-seqs", "4"]
    assert main(common) == 0
    one = capsys.readouterr().out
    assert main(common + ["--tp", "2"]) == 0
    split = capsys.readouterr().out
    for out in (one, split):
        assert "per device: weights" in out and "DFlash step (bs 4)" in out and out.rstrip().endswith("fits")
    assert "1 device(s)" in one and "2 device(s)" in split


def test_cli_says_why_a_pool_does_not_fit(capsys):
    # 2M pages of the tiny pair's 6 attention layers: about 23 GiB against v5e's 16 (the compiler
    # refuses it, or the tool's own count does)
    assert main(["--topology", "v5e:2x2", "--shape", "tiny", "--max-model-len", "256", "--max-num-seqs", "4",
                 "--num-pages", "2000000"]) == 2
    out = capsys.readouterr().out
    assert "does not fit:" in out and "HBM" in out


def test_cli_refuses_bad_setups(capsys):
    assert main(["--topology", "v5e:2x2", "--shape", "no-such-model"]) == 2
    assert "--shape must be one of" in capsys.readouterr().err
    assert main(["--topology", "v5e:2x2", "--shape", "tiny", "--tp", "8"]) == 2
    assert "tp 8 needs 8 devices; v5e:2x2 has 4" in capsys.readouterr().err


# shape, layers (one period of its pattern), topology, devices. Each costs a minute or more of
# compiling on CI's two cores, so the suite runs the MoE split over four chips; the hybrid and
# the rest at full depth run by `python -m dflash_jax.aot` (their figures: benchmarks/RESULTS.md).
REAL_WIDTHS = {
    "qwen3-30b-a3b-split": ("qwen3-30b-a3b", 1, "v6e:2x2", 4),
}


@pytest.mark.parametrize("case", REAL_WIDTHS.values(), ids=REAL_WIDTHS.keys())
def test_real_widths_compile_and_fit(case):
    shape, layers, topology, devices = case
    target, draft = shallow(shape, layers)
    sizing = size_for_topology(target, draft, topology=topology, tp=devices, max_num_seqs=2, max_model_len=512,
                               prefill_chunk=128, prefill_rows=2)
    assert sizing.problem is None and sizing.devices == devices
    assert [r.name for r in sizing.programs] == ["prefill (2 rows x 128 tokens)", "DFlash step (bs 2)"]
    prefill, step = sizing.programs
    assert step.peak_bytes >= sizing.weight_bytes + sizing.kv_pool_bytes  # the step reads every weight
    assert prefill.peak_bytes >= sizing.kv_pool_bytes
    for report in sizing.programs:
        assert report.temp_bytes < sizing.weight_bytes / 4  # no copy of the weights or the pool
        assert report.bytes_accessed > 0 and report.roofline_s > 0


def test_estimates_script_gives_floors_per_chip_and_split(tmp_path, capsys):
    """benchmarks/tpu_estimates.py: a row per chip, split and batch; a split chip's share is the
    whole's divided (weights and KV), and libtpu's bandwidths order the chips' decode floors."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import tpu_estimates

    out = tmp_path / "estimates.json"
    assert tpu_estimates.main(["--shapes", "qwen3-8b", "--chips", "v5e:2x2=1,v5e:2x2=4,v6e:2x2=1",
                               "--batches", "1,32", "--json", str(out)]) == 0
    rows = {(r["chip"], r["tp"], r["batch"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 6 and "TPU v6 lite" in capsys.readouterr().out
    one, four, v6e = rows["TPU v5 lite", 1, 1], rows["TPU v5 lite", 4, 1], rows["TPU v6 lite", 1, 1]
    assert not one["fits"] and four["fits"] and v6e["fits"]  # 16 GiB of Qwen3-8B on a 16 GiB v5e chip
    assert math.isclose(four["weights_bytes"] * 4, one["weights_bytes"])
    assert v6e["decode_ms"] < one["decode_ms"] and v6e["decode_bytes"] == one["decode_bytes"]
    for row in rows.values():
        assert row["step_bytes"] > row["decode_bytes"] and row["speedup"] > 1
