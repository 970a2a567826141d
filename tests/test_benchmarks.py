"""The GPU benchmark's logic on CPU at a tiny shape: it runs only on lent GPUs otherwise, so a
broken code path would first show there. Timings here mean nothing; the report's structure does."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bench_e2e(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_e2e.py"), "--shape", "tiny",
                           "--out", str(tmp_path / "out"), "--compile-cache", str(tmp_path / "cache"),
                           "--ceiling-mib", "8", "--repeats", "1", "--steps", "4", *args],
                          env=env, capture_output=True, text=True, timeout=600)


def test_bench_e2e_reports_every_context_against_its_own_baseline(tmp_path):
    reference = tmp_path / "reference.json"
    reference.write_text(json.dumps({"torch": "fake", "context": 48, "decode_step_s": 0.02,
                                     "dflash_step_s": 0.03}))
    done = run_bench_e2e(tmp_path, "--batches", "1", "--contexts", "16,48", "--blocks", "16",
                         "--alphas", "0.86", "--parts-batches", "1", "--reference-json", str(reference))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "bench_e2e.json").read_text())
    assert set(report["decode"]) == {"bs1_ctx16", "bs1_ctx48"}
    assert set(report["parts"]) == {"bs1_ctx512_block16"}
    assert set(report["e2e"]) == {"bs1_ctx16_block16_alpha0.86", "bs1_ctx48_block16_alpha0.86"}
    for context in (16, 48):
        run = report["e2e"][f"bs1_ctx{context}_block16_alpha0.86"]
        assert run["baseline_tokens_per_s"] == report["decode"][f"bs1_ctx{context}"]["tokens_per_s"]
        assert 1 <= run["tokens_per_step"] <= 16
    # Ours is compared with the reference at its context, at the acceptance our replay realized.
    ours = report["e2e"]["bs1_ctx48_block16_alpha0.86"]
    assert report["reference"]["compared_with"] == {"0.86": "bs1_ctx48_block16_alpha0.86"}
    assert abs(report["reference"]["tokens_per_s_at"]["0.86"] - ours["tokens_per_step"] / 0.03) < 1e-9
    assert "ours / reference at bs 1, ctx 48, block 16" in done.stdout


def test_bench_e2e_rejects_a_missing_reference_json_before_running(tmp_path):
    done = run_bench_e2e(tmp_path, "--reference-json", str(tmp_path / "missing.json"))
    assert done.returncode == 2
    assert "no such file" in done.stderr
    assert not (tmp_path / "out").exists()


def test_ab_kernels_alternates_the_op_and_reports_both_settings(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab_kernels.py"), "--shape", "tiny",
                           "--op", "write_kv", "--cases", "1:0:16,2:4", "--rounds", "2", "--steps", "2",
                           "--repeats", "1", "--out", str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "ab_kernels.json").read_text())["rows"]
    settings = [(r["round"], r["on"], r["batch"], r["block"], r["context"]) for r in rows]
    assert settings == [(n, on, *case) for n in (0, 1) for on in (True, False)
                        for case in ((1, 0, 16), (2, 4, 512))]
    assert all(r["ms_per_step"] > 0 for r in rows)
    assert "| bs 2, ctx 512, DFlash block 4 |" in done.stdout


def test_ab_kernels_rejects_a_malformed_case():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab_kernels.py"), "--shape", "tiny",
                           "--op", "write_kv", "--cases", "1-16"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "batch:block[:context]" in done.stderr
