"""The GPU benchmark's logic on CPU at a tiny shape: it runs only on lent GPUs otherwise, so a
broken code path would first show there. Timings here mean nothing; the report's structure, the
arithmetic and the argument checks do."""

import json
import math
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ab_kernels  # noqa: E402
import bench_e2e  # noqa: E402
import bench_matmul  # noqa: E402
import bench_moe  # noqa: E402
import bench_serving  # noqa: E402
import engine_breakdown  # noqa: E402
import profile_step  # noqa: E402


def run_bench_e2e(tmp_path, capsys, *args) -> tuple[int, str, str]:
    """bench_e2e at the tiny shape, in this process: (exit status, standard output, standard
    error)."""
    try:
        bench_e2e.main(["--shape", "tiny", "--out", str(tmp_path / "out"), "--repeats", "2", "--steps", "4", *args])
        status = 0
    except SystemExit as exit_info:
        status = exit_info.code
    printed = capsys.readouterr()
    return status, printed.out, printed.err


def test_bench_e2e_reports_every_context_against_its_own_baseline(tmp_path, capsys):
    reference = tmp_path / "reference.json"
    reference.write_text(json.dumps({"torch": "fake-torch", "dflash": "fake-dflash", "context": 48,
                                     "decode_step_s": 0.02, "dflash_step_s": 0.03}))
    status, out, err = run_bench_e2e(tmp_path, capsys, "--batches", "1", "--contexts", "16,48", "--blocks", "16",
                                     "--alphas", "0.86", "--parts-batches", "1", "--reference-json", str(reference))
    assert status == 0, err[-3000:]
    report = json.loads((tmp_path / "out" / "bench_e2e.json").read_text())
    assert report["command"] and report["settings"]["steps"] == 4 and report["jax"] and report["device"]
    assert set(report["decode"]) == {"bs1_ctx16", "bs1_ctx48"}
    assert set(report["parts"]) == {"bs1_ctx512_block16"}
    parts = report["parts"]["bs1_ctx512_block16"]
    for part in ("draft", "verify", "commit"):
        assert math.isclose(parts[f"{part}_fraction_of_roofline"], parts[f"{part}_roofline_ms"] / parts[f"{part}_ms"])
    assert set(report["e2e"]) == {"bs1_ctx16_block16_alpha0.86", "bs1_ctx48_block16_alpha0.86"}
    for context in (16, 48):
        base = report["decode"][f"bs1_ctx{context}"]
        assert base["steps_per_check"] == 4 and base["steps"] == 8
        assert base["mean_context"] == context + 3.5  # 8 one-token steps from the prompt's end
        run = report["e2e"][f"bs1_ctx{context}_block16_alpha0.86"]
        assert run["baseline_tokens_per_s"] == base["tokens_per_s"]
        assert 1 <= run["tau_measured"] <= 16 and run["steps_per_check"] == 4
        assert context <= run["mean_context"] < context + 4 * 16  # each chunk starts at the context
        assert math.isclose(run["tokens_per_s"], run["tau_expected"] / (run["ms_per_step"] / 1e3))
    # Ours is compared with the reference at its context, both at the expected tau.
    assert report["reference"]["compared_with"] == {"0.86": "bs1_ctx48_block16_alpha0.86"}
    assert math.isclose(report["reference"]["tokens_per_s_at"]["0.86"], bench_e2e.expected_tau(0.86, 16) / 0.03)
    assert "reference (dflash fake-dflash, torch fake-torch)" in out
    assert "ours / reference at bs 1, ctx 48, block 16" in out


def test_bench_e2e_rejects_a_missing_reference_json_before_running(tmp_path, capsys):
    status, _, err = run_bench_e2e(tmp_path, capsys, "--reference-json", str(tmp_path / "missing.json"))
    assert status == 2
    assert "no such file" in err
    assert not (tmp_path / "out").exists()


def parse_error(capsys, parse, argv) -> str:
    """The ``error:`` line a script's argument parser prints for ``argv`` (it must exit 2)."""
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (["--alphas", "1.0"], "alpha must be in [0, 1)"),
    (["--alphas", "-0.1"], "alpha must be in [0, 1)"),
    (["--alphas", ""], "no empty items"),
    (["--batches", "1,"], "no empty items"),
    (["--batches", "0"], "must be an integer >= 1"),
    (["--contexts", "x"], "must be an integer >= 1"),
    (["--blocks", "1"], "block 1 must be in [2, 16]"),
    (["--blocks", "32"], "block 32 must be in [2, 16]"),
    (["--repeats", "0"], "must be an integer >= 1"),
    (["--steps", "0"], "must be an integer >= 1"),
    (["--skip", "decode,e2ee"], "unknown e2ee"),
    (["--steps", "16", "--steps-per-check", "32"], "must divide the steps of every timed chunk (16"),
    (["--steps", "16", "--steps-per-check", "3", "--skip", "e2e"], "every timed chunk (32"),
    (["--contexts", "40900"], "exceeds the model's 40960 positions"),
    (["--auto-kernels", "nope=on"], "expected OP=on|off"),
    (["--steps", "5"], "check for finished rows after every step"),
    (["--steps-per-check", "1"], "must be an integer >= 2"),
    (["--batches", "1,8,1"], "1 given more than once"),
    (["--alphas", "0.86,0.860"], "0.86 given more than once"),
    (["--skip", "parts,parts"], "parts given more than once"),
    (["--tp", "2"], "add --skip parts"),
    (["--replicate-draft"], "need --tp > 1"),
    (["--expert-parallel", "--skip", "parts"], "need --tp > 1"),
    (["--tp", "2", "--skip", "parts"], "--tp 2 needs 2 devices; 1 visible"),
])
def test_bench_e2e_rejects_bad_settings_when_parsing(capsys, argv, message):
    line = parse_error(capsys, bench_e2e.parse_args, ["--shape", "tiny", *argv])
    assert "error:" in line and message in line


def test_bench_e2e_defaults_follow_the_shape():
    """The issue's grid at Qwen3-8B; at tiny, a CPU smoke test (its reference attention at bs 32
    and 4096 tokens took ~20 GB)."""
    real, _ = bench_e2e.parse_args([])
    assert (real.batches, real.contexts, real.parts_batches) == ([1, 8, 32], [512, 4096], [1, 32])
    tiny, _ = bench_e2e.parse_args(["--shape", "tiny"])
    assert (tiny.batches, tiny.contexts, tiny.parts_batches) == ([1, 8], [16, 64], [1])
    given, _ = bench_e2e.parse_args(["--shape", "tiny", "--batches", "32", "--contexts", "8"])
    assert (given.batches, given.contexts) == ([32], [8])
    # LLaMA-3.1's draft is trained at block 10: its blocks stop there
    assert bench_e2e.parse_args(["--shape", "llama3.1-8b"])[0].blocks == [4, 8, 10]
    assert bench_e2e.parse_args(["--shape", "qwen3-30b-a3b"])[0].blocks == [4, 8, 16]


@pytest.mark.parametrize("script", [bench_e2e, profile_step, bench_serving, engine_breakdown])
def test_routing_option_parses_and_refuses_a_dense_shape(capsys, script):
    """--routing model|independent|independent:SKEW: only a MoE shape's experts can be drawn."""
    from common import IndependentRouting

    def parse(argv):
        parsed = script.parse_args(argv)
        return parsed[0] if isinstance(parsed, tuple) else parsed

    assert parse(["--shape", "tiny-moe"]).routing is None
    assert parse(["--shape", "tiny-moe", "--routing", "independent"]).routing == IndependentRouting(0.0)
    assert parse(["--shape", "tiny-moe", "--routing", "independent:1.5"]).routing == IndependentRouting(1.5)
    assert parse(["--shape", "tiny", "--routing", "model"]).routing is None
    line = parse_error(capsys, parse, ["--shape", "tiny", "--routing", "independent"])
    assert line.endswith("--routing independent: the target has no MoE layers (--shape tiny)")
    for bad, message in (("independent:-1", "skew must be a finite number >= 0"), ("independent:x", "'independent:x'"),
                         ("uniform", "expected model, independent or independent:SKEW")):
        assert message in parse_error(capsys, parse, ["--shape", "tiny-moe", "--routing", bad])


def test_routing_puts_the_draw_on_every_moe_layer_of_the_target_only():
    from common import IndependentRouting, random_models
    from dflash_jax.model.nn.moe import MoESpec

    target, draft = random_models("tiny-moe", routing=IndependentRouting(0.5))
    assert all(layer.ffn.routing == IndependentRouting(0.5) for layer in target.config.layers)
    assert not any(isinstance(layer.ffn, MoESpec) for layer in draft.config.model.layers)
    assert all(layer.ffn.routing is None for layer in random_models("tiny-moe")[0].config.layers)


def test_expert_report_gives_uniform_and_skewed_expectations():
    from common import expert_report
    report = expert_report(128, 8, [1, 4], 16, skew=1.0)
    passes = report["passes"]
    assert (report["num_experts"], report["top_k"], report["skew"]) == (128, 8, 1.0)
    assert set(passes) == {"decode_bs1", "verify_bs1_block16", "decode_bs4", "verify_bs4_block16"}
    assert passes["decode_bs1"]["uniform"] == pytest.approx(8) and passes["decode_bs1"]["skewed"] == pytest.approx(8)
    assert passes["verify_bs1_block16"]["uniform"] == pytest.approx(128 * (1 - (120 / 128) ** 16))
    assert passes["verify_bs4_block16"]["tokens"] == 64
    assert passes["verify_bs4_block16"]["skewed"] < passes["verify_bs4_block16"]["uniform"]
    assert "skewed" not in expert_report(128, 8, [1], 16)["passes"]["decode_bs1"]


def test_bench_e2e_prints_the_routing_and_its_expected_and_measured_experts(tmp_path, capsys):
    status, out, err = run_bench_e2e(tmp_path, capsys, "--shape", "tiny-moe", "--routing", "independent:1",
                                     "--skip", "parts,e2e", "--batches", "1", "--contexts", "16")
    assert status == 0, err
    report = json.loads((tmp_path / "out" / "bench_e2e.json").read_text())
    assert report["routing"] == report["settings"]["routing"] == "independent:1"
    experts = report["distinct_experts"]
    assert experts["measured_context"] == 16
    assert set(experts["passes"]["verify_bs1_block16"]) == {"tokens", "uniform", "skewed", "measured"}
    assert experts["passes"]["decode_bs1"]["measured"] == 2  # one token: its top 2
    assert 2 < experts["passes"]["verify_bs1_block16"]["measured"] <= 8
    assert "MoE routing independent:1: expected distinct experts of 8 (top 2)" in out
    assert re.search(r"verify_bs1_block16 +16 +7\.9 +7\.\d +\d\.\d", out)


def test_measured_experts_follow_the_routing():
    """The experts a target's routing picks per pass (tiny-moe with 64 experts, top 2): one token's
    top k at block 1; over 2 x 16 tokens, independent routing reads about E(1-(1-k/E)^32) = 40.8
    experts a layer, the random router, which routes the tokens alike, fewer."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    from common import SHAPES, IndependentRouting, expected_experts, measured_experts, with_routing
    from dflash_jax.loading.models import Target
    from dflash_jax.model.params import init_target_params

    tiny = SHAPES["tiny-moe"][0]
    config = tiny.with_layers(tuple(dataclasses.replace(layer, ffn=dataclasses.replace(layer.ffn, num_experts=64))
                                    for layer in tiny.layers))
    params = init_target_params(config, jax.random.key(0), jnp.bfloat16)
    model = measured_experts(Target(config, params), 2, 16, (1, 16))
    drawn = measured_experts(Target(with_routing(config, IndependentRouting()), params), 2, 16, (1, 16))
    assert 2 <= model[1] <= 4 and 2 <= drawn[1] <= 4
    assert drawn[16] == pytest.approx(expected_experts(64, 2, 32), abs=3)
    assert model[16] < drawn[16] - 5


def test_bench_e2e_accepts_steps_per_check_that_divides_only_the_chunks_it_runs():
    args, _ = bench_e2e.parse_args(["--steps", "16", "--steps-per-check", "32", "--skip", "e2e"])
    assert args.steps_per_check == 32


def test_bench_e2e_rejects_an_output_path_that_is_a_file(capsys, tmp_path):
    (tmp_path / "taken").write_text("")
    assert "is not a folder" in parse_error(capsys, bench_e2e.parse_args, ["--out", str(tmp_path / "taken")])


@pytest.mark.parametrize("content, extra, message", [
    ("{", [], "not valid JSON"),
    (json.dumps({"torch": "x", "dflash_step_s": 0.03}), [], "needs positive numbers decode_step_s"),
    (json.dumps({"decode_step_s": 0.02, "dflash_step_s": 0}), [], "needs positive numbers dflash_step_s"),
    (json.dumps({"decode_step_s": 0.02, "dflash_step_s": 0.03, "context": 4096}), ["--contexts", "512"],
     "comparison cell (bs 1, block 16, ctx 4096) is not run"),
    (json.dumps({"decode_step_s": 0.02, "dflash_step_s": 0.03}), ["--blocks", "8"], "is not run"),
    (json.dumps({"decode_step_s": 0.02, "dflash_step_s": 0.03}), ["--batches", "8"], "is not run"),
    (json.dumps({"decode_step_s": 0.02, "dflash_step_s": 0.03}), ["--skip", "e2e"], "is not run"),
    (json.dumps({"decode_step_s": 0.02, "dflash_step_s": 0.03, "context": 16.0}), ["--contexts", "16"],
     "context must be a positive integer, got 16.0"),
])
def test_bench_e2e_checks_the_reference_json_when_parsing(capsys, tmp_path, content, extra, message):
    path = tmp_path / "reference.json"
    path.write_text(content)
    assert message in parse_error(capsys, bench_e2e.parse_args, ["--reference-json", str(path), *extra])


def test_expected_tau_and_the_figures_of_one_row_agree():
    assert bench_e2e.expected_tau(0.0, 16) == 1.0
    assert math.isclose(bench_e2e.expected_tau(0.5, 2), 1.5)
    assert math.isclose(bench_e2e.expected_tau(0.86, 16), sum(0.86 ** k for k in range(16)))
    base = bench_e2e.baseline_row({"ms_per_step": 4.0, "tau_measured": 1.0, "mean_context": 515.5}, batch=8)
    assert "tau_measured" not in base and math.isclose(base["tokens_per_s"], 2000)
    row = bench_e2e.e2e_row({"ms_per_step": 5.0, "tau_measured": 6.0}, base, batch=8, alpha=0.5, block=4)
    assert math.isclose(row["tau_expected"], 1.875)
    assert math.isclose(row["tokens_per_s"], 8 * 1.875 / 0.005)  # batch x expected tau / median step
    assert math.isclose(row["tokens_per_s_measured"], 8 * 6.0 / 0.005)
    assert math.isclose(row["speedup"], row["tokens_per_s"] / 2000)


def test_chunks_give_the_median_step_and_pool_tau_and_context():
    chunks = [bench_e2e.Chunk(0.4, 4, np.array([[1, 2, 3, 2]])), bench_e2e.Chunk(0.1, 4, np.array([[4, 4, 4, 4]])),
              bench_e2e.Chunk(0.2, 4, np.array([[1, 1, 1, 1]]))]
    summary = bench_e2e.summarize_chunks(chunks, context=10)
    assert math.isclose(summary["ms_per_step"], 50.0)  # the median chunk, 0.2 s over 4 steps
    assert math.isclose(summary["tau_measured"], 28 / 12)
    # Steps start at committed lengths 10+{0,1,3,6}, 10+{0,4,8,12}, 10+{0,1,2,3}.
    assert math.isclose(summary["mean_context"], 10 + 40 / 12)
    assert summary["repeats"] == 3 and summary["steps"] == 4


@pytest.fixture(scope="module")
def tiny_models():
    """The benchmark's tiny (target, draft), random weights: built once for this file's tests."""
    from common import random_models
    return random_models("tiny")


def test_roofline_charges_the_draft_what_its_block_pass_reads(tiny_models):
    target, draft = tiny_models
    roof = bench_e2e.Roofline(target, draft, {"bandwidth_bytes_per_s": 1.0, "matmul_flops_per_s": 1.0})
    t, d = target.params, draft.params
    n = bench_e2e.nbytes
    part = roof.draft(2, 0, 16)
    assert part.bytes == n(d.layers) + n(d.norm) + n(t.lm_head)  # no fc: only commit reads it
    head = t.lm_head.size
    dc, tc = draft.config.model, target.config
    assert roof.draft_attention == 4 * dc.num_heads * dc.head_dim * dc.num_layers
    attention = roof.draft_attention * 2 * 16 * 16  # 16 queries x 16 keys (the block) per sequence
    assert part.flops == 2 * (bench_e2e.nparams(d.layers) + d.norm.size) * 2 * 16 + 2 * head * 2 * 15 + attention
    # verify: every new token sees the context and the new tokens up to itself
    verify = roof.verify(2, 100, 4)
    pairs = 2 * (4 * 100 + (1 + 2 + 3 + 4))
    assert verify.flops == roof.target.flops * 2 * 4 + 4 * tc.num_heads * tc.head_dim * tc.num_layers * pairs
    step = roof.dflash_step(2, 0, 16)
    kv_columns = sum(layer.attention.qkv_proj.shape[0] * (layer.attention.qkv_proj.shape[1] - layer.attention.q_size)
                     for layer in d.layers)
    assert step.bytes == roof.verify(2, 0, 16).bytes + part.bytes + n(d.fc) + 2 * kv_columns


def test_roofline_charges_a_moe_layer_its_routed_experts():
    """A MoE target's pass reads the experts its tokens route to (uniform routing: E(1-(1-k/E)^T)
    of them), each token computing its top_k; everything else as for a dense target."""
    from common import random_models
    target, draft = random_models("tiny-moe")
    roof = bench_e2e.Roofline(target, draft, {"bandwidth_bytes_per_s": 1.0, "matmul_flops_per_s": 1.0})
    n = bench_e2e.nbytes
    layers = target.params.layers
    experts = sum(n(layer.ffn.gate_up_proj) + n(layer.ffn.down_proj) for layer in layers)
    assert roof.target.bytes == n(target.params) - n(target.params.embed) - experts
    spec = target.config.layers[0].ffn
    one_expert = experts / target.config.num_layers / spec.num_experts
    assert roof.experts(1).bytes == pytest.approx(target.config.num_layers * spec.top_k * one_expert)
    assert roof.experts(10_000).bytes == pytest.approx(experts)
    assert bench_e2e.expected_experts(128, 8, 16) == pytest.approx(128 * (1 - (120 / 128) ** 16))
    per_token = 2 * spec.top_k * sum(layer.ffn.gate_up_proj[0].size + layer.ffn.down_proj[0].size for layer in layers)
    assert roof.verify(3, 0, 2).flops == roof.target.flops * 6 + per_token * 6 + roof.target_attention * 3 * 2 * 1.5
    assert roof.weight_bytes()["target_weights"] == roof.target.bytes + roof.experts(1).bytes


def test_roofline_charges_each_layer_its_kv_cache(tiny_models):
    """K and V, bf16, every layer: what a step reads of the context, by hand from the configs."""
    target, draft = tiny_models
    roof = bench_e2e.Roofline(target, draft, {"bandwidth_bytes_per_s": 1.0, "matmul_flops_per_s": 1.0})
    tc, dc = target.config, draft.config.model
    for batch, context, block in ((1, 100, 1), (3, 37, 4)):
        target_kv = batch * context * tc.num_layers * 2 * tc.num_kv_heads * tc.head_dim * 2
        draft_kv = batch * context * dc.num_layers * 2 * dc.num_kv_heads * dc.head_dim * 2
        assert roof.verify(batch, context, block).bytes == roof.verify(batch, 0, block).bytes + target_kv
        assert roof.draft(batch, context, block).bytes == roof.draft(batch, 0, block).bytes + draft_kv


def test_replay_accepts_as_often_as_alpha_says(tiny_models):
    """Tokens per step under replay average tau(alpha, block) = (1 - alpha^block) / (1 - alpha):
    each draft accepted with probability alpha up to the first rejection, then the bonus token."""
    from common import random_prompts
    from dflash_jax.runtime.generation import batch_engine
    target, draft = tiny_models
    block, max_new = 8, 4 * draft.config.block_size + 1
    prompts = random_prompts(np.random.default_rng(0), 64, 8, 512)
    engine = batch_engine(target, draft, [8] * 64, [max_new], block_size=block, chunk_steps=4, accept_replay=0.0,
                          impl="reference")
    for alpha in (0.0, 0.5, 0.86):
        engine.set_accept_replay(alpha)
        lengths = np.concatenate([bench_e2e.time_chunk(engine, prompts, max_new, seed).accept_lengths
                                  for seed in (1, 2)]).ravel()
        assert lengths.min() >= 1 and lengths.max() <= block
        if alpha == 0:
            assert (lengths == 1).all()
        else:  # 512 draws; within 4 standard errors of the exact mean
            standard_error = lengths.std() / np.sqrt(lengths.size)
            assert abs(lengths.mean() - bench_e2e.expected_tau(alpha, block)) < 4 * standard_error, alpha


def test_replay_draws_depend_on_the_prefill_seed(tiny_models):
    from common import random_prompts
    from dflash_jax.runtime.generation import batch_engine
    target, draft = tiny_models
    prompts = random_prompts(np.random.default_rng(0), 2, 8, 512)
    engine = batch_engine(target, draft, [8, 8], [65], chunk_steps=4, accept_replay=0.7, impl="reference")
    lengths = [bench_e2e.time_chunk(engine, prompts, 65, seed).accept_lengths for seed in (1, 2, 1)]
    assert lengths[0].shape == (2, 4)
    assert (lengths[0] == lengths[2]).all() and not (lengths[0] == lengths[1]).all()


def test_ab_kernels_alternates_the_op_and_reports_both_settings(tmp_path, capsys):
    from dflash_jax.model import ops

    default = dict(ops.AUTO_KERNELS)
    ab_kernels.main(["--shape", "tiny", "--op", "write_kv", "--cases", "1:0:16,2:4", "--rounds", "2", "--steps", "2",
                     "--repeats", "1", "--out", str(tmp_path)])
    assert ops.AUTO_KERNELS == default   # the op's setting restored
    rows = json.loads((tmp_path / "ab_kernels.json").read_text())["rows"]
    settings = [(r["round"], r["on"], r["batch"], r["block"], r["context"]) for r in rows]
    assert settings == [(n, on, *case) for n, order in ((0, (True, False)), (1, (False, True))) for on in order
                        for case in ((1, 0, 16), (2, 4, 512))]  # the order turns each round: a drift hits both
    assert all(r["ms_per_step"] > 0 for r in rows)
    assert "| bs 2, ctx 512, DFlash block 4 |" in capsys.readouterr().out


@pytest.mark.parametrize("cases, message", [
    ("1-16", "batch:block[:context]"), ("1:16,", "batch:block[:context]"), ("0:16", "batch and context must be >= 1"),
    ("1:16:0", "batch and context must be >= 1"), ("1:1", "block 1 must be in [2, 16]"), ("1:17", "block 17 must be in [2, 16]"),
])
def test_ab_kernels_rejects_a_bad_case(capsys, cases, message):
    assert message in parse_error(capsys, ab_kernels.parse_args, ["--shape", "tiny", "--op", "write_kv",
                                                                  "--cases", cases])


@pytest.mark.parametrize("argv, message", [
    (["--modes", "decode,dflsh"], "unknown dflsh"), (["--modes", ""], "no empty items"),
    (["--block", "1"], "block 1 must be in [2, 16]"), (["--batch", "0"], "must be an integer >= 1"),
    (["--sequence", "-3"], "must be an integer >= 0"),
    (["--tp", "2"], "--tp 2 needs 2 devices; 1 visible"),
    (["--modes", "decode", "--block", "8"], "only the dflash mode runs blocks; --modes has no dflash"),
])
def test_profile_step_rejects_bad_settings_when_parsing(capsys, argv, message):
    assert message in parse_error(capsys, profile_step.parse_args, ["--shape", "tiny", *argv])


def test_profile_step_blocks_default_to_the_drafts_trained_size():
    """gpt-oss's draft is trained on blocks of 8: its profile needs no --block, decode alone included."""
    for modes in ("decode", "decode,dflash"):
        assert profile_step.parse_args(["--shape", "gpt-oss-20b", "--modes", modes]).block == 8
    assert profile_step.parse_args(["--shape", "qwen3-8b"]).block == 16


def test_profile_step_runs_the_tiny_shape_on_cpu(tmp_path):
    profile_step.main(["--shape", "tiny", "--steps", "2", "--top", "1", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "profile.json").read_text())
    for mode in profile_step.MODES:
        assert report[mode]["traced_wall_ms_per_step"] > 0 and len(list(tmp_path.glob(f"trace_{mode}_*"))) == 1


def test_profile_step_turns_command_buffers_off_before_the_backends_start(monkeypatch):
    """Traced with XLA's command buffers on, a GPU's next read fails (jax-ml/jax#40260): the flag is
    added while the backends are not started, and a started GPU backend is refused."""
    from jax._src import xla_bridge

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    profile_step.without_command_buffers()
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_enable_command_buffer="
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    profile_step.without_command_buffers()        # a started CPU backend: nothing to turn off
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/x --xla_gpu_enable_command_buffer="
    monkeypatch.setattr(profile_step.jax, "default_backend", lambda: "gpu")
    with pytest.raises(RuntimeError, match="command-buffer flag"):
        profile_step.without_command_buffers()


def test_profile_step_refuses_a_trace_folder_with_more_than_one_trace(tmp_path):
    for run in ("first", "second"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "perfetto_trace.json.gz").write_bytes(b"")
    with pytest.raises(RuntimeError, match="expected one Perfetto trace"):
        profile_step.kernel_events(tmp_path)


@pytest.mark.parametrize("argv, message", [
    (["--passes", "fused,kernel:qkv+nope"], "unknown pass 'kernel:qkv+nope'"),
    (["--passes", "fused,"], "unknown pass ''"),
    (["--tunings", "{};{"], "is not valid JSON"),
    (["--tunings", '{"block_kk": 64}'], "expected an object of"),
    (["--rows", "1,0"], "must be an integer >= 1"),
    (["--tunings", '{"block_k": "x"}'], "tuning values must be integers"),
    (["--tunings", '{};{"block_k": 48}'], "at qkv, M=1: block_k must be a power of two, got 48"),
    (["--passes", "kernel:down", "--tunings", '{"num_warps": 3}'], "at down, M=1: num_warps must be a power of two"),
])
def test_bench_matmul_rejects_bad_settings_before_any_device_work(capsys, argv, message):
    assert message in parse_error(capsys, bench_matmul.main, ["--shape", "tiny", *argv])


def test_bench_matmul_times_a_moe_shapes_attention_projections_alone(capsys, tmp_path):
    """A MoE shape: q|k|v and o of every layer (the experts are bench_moe's), each pass and tuning."""
    assert "--shape tiny-moe has no gate_up projection" in parse_error(
        capsys, bench_matmul.main, ["--shape", "tiny-moe", "--passes", "kernel:o+gate_up"])
    bench_matmul.main(["--shape", "tiny-moe", "--rows", "1", "--passes", "separate,kernel",
                       "--tunings", '{};{"num_splits": 2}', "--out", str(tmp_path)])
    runs = json.loads((tmp_path / "matmul.json").read_text())["runs"]
    from common import SHAPES
    config = SHAPES["tiny-moe"][0]
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    attention_bytes = config.num_layers * 2 * config.hidden_size * (2 * q + 2 * kv)
    assert [(r["weights"], r["tuning"]) for r in runs] == [("separate", {}), ("kernel", {}), ("kernel", {"num_splits": 2})]
    assert all(r["weight_bytes"] == attention_bytes and r["ms"] > 0 for r in runs)


def test_bench_reference_checks_its_settings(capsys, tmp_path):
    import bench_reference
    assert "is a folder" in parse_error(capsys, bench_reference.parse_args, ["--out", str(tmp_path)])
    assert "--repeats must be >= 1" in parse_error(capsys, bench_reference.parse_args,
                                                   ["--out", str(tmp_path / "r.json"), "--repeats", "0"])


def test_full_block_clock_times_only_the_steps_that_verify_a_whole_block():
    import bench_reference
    ticks = iter(range(100, 200, 10))
    clock = bench_reference.FullBlockClock(16, lambda: next(ticks))
    for block_len in (16, 16, 16, 9, 3):
        clock.on_draft(block_len)
    assert clock.full_steps == 3 and clock.seconds_per_step(finished_at=1000) == (110 - 100) / 3
    never_short = bench_reference.FullBlockClock(16, lambda: 5.0)
    never_short.on_draft(16)
    assert never_short.seconds_per_step(finished_at=11.0) == 6.0


def test_the_reference_shortens_verify_blocks_only_at_the_end():
    """FullBlockClock's premise, on the real dflash_generate (tiny random torch models, CPU)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("dflash")
    import bench_reference
    from builders import make_target, make_zlab_draft
    from conftest import PAIR_DRAFT, PAIR_TARGET
    target = make_target(seed=1, std=0.1, **PAIR_TARGET)
    draft = make_zlab_draft(target, seed=101, std=0.3, **PAIR_DRAFT)
    block_lens = []
    hook = draft.register_forward_pre_hook(
        lambda module, positional, keywords: block_lens.append(keywords["noise_embedding"].shape[1]), with_kwargs=True)
    try:
        seconds = bench_reference.dflash_step_seconds(draft, target, torch.tensor([[3, 5, 7, 9]]), 8, time.perf_counter)
    finally:
        hook.remove()
    full = block_lens.index(next(n for n in block_lens if n < 16)) if min(block_lens) < 16 else len(block_lens)
    assert full >= 1 and all(n < 16 for n in block_lens[full:]) and seconds > 0


@pytest.mark.parametrize("script", [bench_e2e, profile_step, ab_kernels, bench_matmul, bench_moe])
def test_real_shape_runs_refuse_a_cpu_in_one_line(script, capsys, tmp_path):
    argv = ["--out", str(tmp_path)] + (["--op", "write_kv"] if script is ab_kernels else [])
    with pytest.raises(SystemExit) as exit_:
        script.main(argv)
    assert exit_.value.code == 2
    shape = "qwen3-30b-a3b" if script is bench_moe else "qwen3-8b"
    kinds = "GPU" if script in (bench_matmul, bench_moe) else "GPU or TPU"  # the engine's runs take a TPU too
    assert capsys.readouterr().err.strip() == (f"error: --shape {shape} is timed on a {kinds}, and jax sees only cpu "
                                               "(--shape tiny is the CPU smoke test)")


def test_bench_moe_times_every_method_against_the_routed_bytes(tmp_path, capsys):
    """Each method per token count, against the bytes of the experts the routing chose: as many as
    top_k for one token, at most all of them; the kernel variants named by their tuning."""
    bench_moe.main(["--shape", "tiny-moe", "--out", str(tmp_path), "--tokens", "1,8", "--iterations", "2",
                    "--repeats", "1", "--layers", "2", "--tunings", '{};{"block_n": 16}'])
    report = json.loads((tmp_path / "bench_moe.json").read_text())
    cells = {(c["tokens"], c["method"]): c for c in report["cells"]}
    assert set(cells) == {(t, m) for t in (1, 8) for m in ("ragged_dot", "gather", "dense_loop", "pallas",
                                                          'pallas {"block_n": 16}')}
    assert cells[1, "pallas"]["experts"] == 2 and 2 <= cells[8, "pallas"]["experts"] <= 8
    for cell in cells.values():
        assert math.isclose(cell["fraction_of_floor"], cell["floor_us"] / cell["us"])
    assert report["expert_bytes"] == 3 * 64 * 32 * 2
    assert "tokens  method" in capsys.readouterr().out


def test_bench_moe_times_the_mxfp4_kernel_against_its_packed_bytes(tmp_path, capsys):
    """MXFP4 experts (gpt-oss's form): the reference and the kernel only (the other methods index
    dense weights), each expert's bytes its codes and scales (4.25 bits a weight)."""
    bench_moe.main(["--shape", "tiny-gpt-oss-mxfp4", "--out", str(tmp_path), "--tokens", "1", "--iterations", "2",
                    "--repeats", "1", "--layers", "2", "--tunings", '{};{"block_k": 32}'])
    report = json.loads((tmp_path / "bench_moe.json").read_text())
    assert {c["method"] for c in report["cells"]} == {"ragged_dot", "pallas", 'pallas {"block_k": 32}'}
    hidden, width = 64, 32
    assert report["expert_bytes"] == (3 * hidden * width) * 17 / 32     # 16 bytes of codes + 1 scale per 32
    assert "mxfp4)" in capsys.readouterr().out


def test_bench_serving_sweeps_both_modes_against_the_offline_engine(tmp_path, capsys):
    """The serving benchmark at the tiny shape, prompts of a shared 16-token prefix (one page) and
    20 tokens of their own (one prefill shape, cached prefix or not): per concurrency a baseline
    and a DFlash server of 3 slots (replayed acceptance: tau near its expectation) with prefix
    caching on and off, each serving both concurrencies, each row beside the offline engine's tok/s; the soak ends with no page in use. Then a JSON
    row at c1 on a DFlash server of the same shapes (its programs compiled already but the
    grammar's)."""
    settings = ["--shape", "tiny", "--rounds", "2", "--prompt-len", "20", "--shared-prefix-len", "16",
                "--max-tokens", "24"]
    assert bench_serving.main([*settings, "--concurrency", "1,3", "--max-num-seqs", "3", "--soak-seconds", "1",
                               "--soak-concurrency", "3", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_serving.json").read_text())
    assert [(r["concurrency"], r["mode"], r["prefix_caching"], r["structured"]) for r in report["rows"]] == [
        (c, mode, caching, "none") for mode in ("baseline", "dflash") for caching in (True, False) for c in (1, 3)]
    for row in report["rows"]:
        assert row["requests"] == 2 * row["concurrency"] and row["tokens"] == 24 * row["requests"]
        assert row["offline_tok_s"] > 0 and row["ttft_p50_ms"] > 0 and "json_valid" not in row
        assert (row["tau"] is None) == (row["mode"] == "baseline")
        if row["tau"] is not None:
            assert 1 < row["tau"] <= 16 and row["dflash_over_baseline"] > 0
        # the warm-up cached the shared page: each timed prompt finds it (16 of 36 tokens) and prefills the rest
        assert row["prefix_cache_hit_rate"] == (16 / 36 if row["prefix_caching"] else 0)
        assert row["prefill_tokens_computed"] == row["requests"] * (20 if row["prefix_caching"] else 36)
        assert ("ttft_p50_off_over_on" in row) == row["prefix_caching"]
    costs = report["step_costs_ms"]["3"]      # the adaptive DFlash servers' measured step costs
    assert costs["widths"] == [2, 4, 8, 16] and all(ms > 0 for row in costs["by_rows"].values() for ms in row)
    assert report["soak"]["after"]["pages_in_use"] == 0 and report["soak"]["requests"] > 0
    assert report["soak"]["elapsed_s"] >= 1
    out = capsys.readouterr().out
    assert re.search(r"soak \d+ s at c=3: \d+ requests, \d+ tok/s; pages in use 0 -> 0", out)
    assert re.search(r"\n  3  dflash\+cache .* hit 44%; TTFT p50 uncached/cached [\d.]+x\n", out)

    assert bench_serving.main([*settings, "--concurrency", "1", "--modes", "dflash", "--structured", "json",
                               "--prefix-caching", "off", "--skip-offline", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "bench_serving.json").read_text())
    (row,) = report["rows"]
    assert (row["mode"], row["structured"]) == ("dflash", "json") and row["tau"] > 1
    # the schema's string is short enough for every output to close before max_tokens
    assert row["json_valid"] == row["json_finished"] == row["requests"] == 2 and 2 * 9 < row["tokens"] < 2 * 24
    assert report["response_format"]["json_schema"]["schema"]["properties"]["text"]["maxLength"] > 0
    assert re.search(r"\n  1  dflash json .* JSON valid 2 of 2 finished \(2 requests\)", capsys.readouterr().out)


@pytest.mark.parametrize("argv, message", [
    (["--structured", "xml"], "unknown xml"), (["--prefix-caching", "on,of"], "unknown of"),
    (["--shared-prefix-len", "-1"], "must be an integer >= 0"),
    (["--shape", "tiny-hybrid", "--shared-prefix-len", "16"], "--prefix-caching on: not for --shape tiny-hybrid"),
    (["--batch-invariant"], "--batch-invariant needs --speculative-policy fixed"),
    (["--batch-invariant", "--speculative-policy", "fixed", "--shared-prefix-len", "16"],
     "--batch-invariant runs without prefix caching"),
])
def test_bench_serving_rejects_bad_settings_when_parsing(capsys, argv, message):
    assert message in parse_error(capsys, bench_serving.parse_args, argv)


def test_bench_serving_tokenizer_writes_json_and_words(tmp_path):
    """The benchmark's vocabulary: JSON's punctuation and the field name first, then words; text
    encodes back into those tokens (llguidance tokenizes forced text with it), "</s>" the stop."""
    tokenizer = bench_serving.word_tokenizer(64, tmp_path)
    ids = tokenizer.encode('{"text":" w30 w63 7"}')
    assert tokenizer.decode(ids) == '{"text":" w30 w63 7"}' and 30 in ids and 63 in ids
    assert tokenizer.stop_token_ids == [bench_serving.JSON_TOKENS.index("</s>")]
    response_format = bench_serving.json_response_format(64, 100)
    assert bench_serving.valid_json('{"text": "w1"}', response_format)
    assert not bench_serving.valid_json('{"text": "w1"', response_format)
    assert not bench_serving.valid_json('{"text": 1}', response_format)


def test_engine_breakdown_times_every_program_of_each_mode(tmp_path):
    """The breakdown at the tiny shape: plain and one DFlash block, every engine program timed
    (prefill, chunks, slot updates), the same tokens in the overlapped and the waited run."""
    assert engine_breakdown.main(["--shape", "tiny", "--concurrency", "3", "--rounds", "2", "--prompt-len", "12",
                                  "--max-tokens", "10", "--blocks", "8", "--speculative-policy", "fixed",
                                  "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "engine_breakdown.json").read_text())
    assert [row["mode"] for row in report["rows"]] == ["plain", "dflash block 8"]
    for row in report["rows"]:
        assert row["tokens"] == 6 * 10 and row["output_tok_s"] > 0
        assert set(row["programs"]) == set(engine_breakdown.PROGRAMS)
        assert row["programs"]["prefill_slots"]["calls"] >= 1
        assert 1 <= row["programs"]["release_slots"]["calls"] <= 6  # a step's finished slots in one call
