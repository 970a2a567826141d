"""End-to-end DFlash benchmark at Qwen3-8B shape on one GPU (random weights, acceptance replayed).

Speed does not depend on weight values, so the target (36 layers, hidden 4096, vocab 151936,
bf16) and a 5-layer draft are random; acceptance is replayed: each draft position is accepted
with probability alpha up to the first rejection (tau(B) = (1 - alpha^B) / (1 - alpha)). The
whole machinery runs (draft, verify, commit, variable-length advance); only the accept decision
is replaced. Reports, against ceilings measured in the same run:

- baseline decode ms/token at bs 1/8/32, context 512 and 4k, as a fraction of its byte roofline;
- the DFlash step's parts (draft, verify, commit; context 512, block 16) against their rooflines;
- tok/s and speedup over the own baseline at the same batch and context, alpha 0.86 / 0.68,
  bs 1/8/32, every context, blocks 4/8/16;
- the z-lab reference's decode and DFlash step (from bench_reference.py's JSON, same machine), and
  ours over it at equal acceptance: bs 1, block 16, the reference's context.

    PYTHONPATH=. python3 benchmarks/bench_e2e.py --out $OUT [--reference-json $OUT/reference.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, measure_ceilings, median_seconds, override_auto_kernels, random_models  # noqa: E402

from dflash_jax import draft as draft_model  # noqa: E402
from dflash_jax import target as target_model  # noqa: E402
from dflash_jax.generate import prepare  # noqa: E402
from dflash_jax.models import Draft, Target  # noqa: E402


def tau(alpha: float, block: int) -> float:
    return (1 - alpha ** block) / (1 - alpha)


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


class Roofline:
    """Bytes and FLOPs a step must move/do, turned into a floor time by the measured ceilings."""

    def __init__(self, target: Target, draft: Draft, ceilings: dict):
        tc, dc = target.config, draft.config.model
        self.bw, self.rate = ceilings["bandwidth_bytes_per_s"], ceilings["matmul_flops_per_s"]
        t = target.params
        self.target_weights = nbytes(t) - nbytes(t.embed)       # everything a forward reads
        self.lm_head = nbytes(t.lm_head if t.lm_head is not None else t.embed)
        self.draft_weights = nbytes(draft.params) + self.lm_head  # draft logits re-read the head
        per_token = lambda cfg: 2 * cfg.num_kv_heads * cfg.head_dim * 2  # noqa: E731  (K+V, bf16)
        self.target_kv_token = per_token(tc) * tc.num_layers
        self.draft_kv_token = per_token(dc) * dc.num_layers

    def floor(self, weight_bytes, kv_bytes, tokens) -> float:
        """Bytes over bandwidth, or matmul FLOPs (2 per bf16 parameter per token) over the rate."""
        flops = 2 * (weight_bytes / 2) * tokens
        return max((weight_bytes + kv_bytes) / self.bw, flops / self.rate)

    def decode(self, batch, context):
        return self.floor(self.target_weights, batch * context * self.target_kv_token,
                          batch)

    def verify(self, batch, context, block):
        return self.floor(self.target_weights, batch * context * self.target_kv_token,
                          batch * block)

    def draft(self, batch, context, block):
        return self.floor(self.draft_weights, batch * context * self.draft_kv_token,
                          batch * block)

    def dflash_step(self, batch, context, block):
        return self.floor(self.target_weights + self.draft_weights,
                          batch * context * (self.target_kv_token + self.draft_kv_token),
                          batch * block)


def run_loop(target, draft, batch, context, block, steps, alphas, repeats, rng, impl, steps_per_check):
    """Median ms per step and tok/s of the real decode loop (chunks of ``steps`` steps)."""
    prompts = rng.integers(0, target.config.vocab_size // 2, (batch, context)).tolist()
    # One max_new_tokens for every block size: the prefill (and its compile) is then shared.
    max_new = steps * (draft.config.block_size if draft else 1) * (repeats + 2) + 1
    prep = prepare(target, prompts, draft=draft, block_size=block if draft else None,
                   max_new_tokens=max_new, chunk_steps=steps, steps_per_check=steps_per_check,
                   accept_replay=draft is not None, impl=impl)
    results = {}
    for alpha in alphas:
        state = None
        state = prep.prefill()
        state = jax.block_until_ready(prep.chunk(state, alpha))  # warm-up
        times, tokens = [], []
        for _ in range(repeats):
            before = int(jnp.sum(state.num_generated))
            start = time.perf_counter()
            state = jax.block_until_ready(prep.chunk(state, alpha))
            times.append(time.perf_counter() - start)
            tokens.append(int(jnp.sum(state.num_generated)) - before)
        seconds = statistics.median(times)
        results[alpha] = {"ms_per_step": seconds / steps * 1e3,
                          "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, times)),
                          "tokens_per_step": statistics.median(tokens) / steps / batch,
                          "compile_s": prep.compile_seconds}
        del state
    return results


def time_parts(target, draft, batch, context, block, iterations, repeats, rng, impl):
    """Draft, verify and commit alone, each as a dependent chain inside one jitted loop."""
    prompts = rng.integers(0, target.config.vocab_size // 2, (batch, context)).tolist()
    prep = prepare(target, prompts, draft=draft, block_size=block, max_new_tokens=block + 1,
                   chunk_steps=1, accept_replay=True, impl=impl)
    state = prep.prefill()
    cache, config = state.cache, prep.config
    block_lens = jnp.full((batch,), block, jnp.int32)
    masks = jnp.full((batch, block - 1), config.draft.mask_token_id, jnp.int32)

    @functools.partial(jax.jit, static_argnames="n")
    def draft_chain(tp, dp, cache, last, n):
        def body(i, last):
            hidden = draft_model.block_hidden(dp, config.draft, tp, jnp.concatenate([last[:, None], masks], 1),
                                              cache, block_lens, impl=config.impl)
            logits = draft_model.draft_logits(dp, config.draft, tp, hidden[:, 1:])
            return jnp.sum(jnp.argmax(logits, -1), axis=1).astype(jnp.int32) % (target.config.vocab_size // 2)
        return jax.lax.fori_loop(0, n, body, last)

    @functools.partial(jax.jit, static_argnames="n", donate_argnames="cache")
    def verify_chain(tp, cache, tokens, n):
        def body(i, carry):
            cache, tokens = carry
            hidden, _, cache = target_model.forward(tp, config.target, tokens, cache.lengths, cache,
                                                    tap_layers=config.tap_layers, impl=config.impl)
            return cache, jnp.argmax(target_model.logits(tp, hidden), -1).astype(jnp.int32)
        return jax.lax.fori_loop(0, n, body, (cache, tokens))

    @functools.partial(jax.jit, static_argnames="n", donate_argnames="cache")
    def commit_chain(dp, cache, taps, n):
        positions = cache.lengths[:, None] + jnp.arange(block, dtype=jnp.int32)[None, :]
        kv_proj = draft_model.context_kv_proj(dp)  # once, as the decode loop does

        def body(i, cache):
            return draft_model.write_context(dp, config.draft, taps, positions, cache, impl=config.impl,
                                             kv_proj=kv_proj)
        return jax.lax.fori_loop(0, n, body, cache)

    last = state.last_token
    tokens = jnp.zeros((batch, block), jnp.int32)
    taps = jax.random.normal(jax.random.key(3), (batch, block, len(config.tap_layers) * config.target.hidden_size),
                             jnp.bfloat16)
    holder = {"cache": cache}

    def run_verify():
        holder["cache"], _ = jax.block_until_ready(verify_chain(target.params, holder["cache"], tokens, iterations))

    def run_commit():
        holder["cache"] = jax.block_until_ready(commit_chain(draft.params, holder["cache"], taps, iterations))

    out = {"draft_ms": median_seconds(lambda: draft_chain(target.params, draft.params, holder["cache"], last,
                                                          iterations).block_until_ready(), repeats)}
    out["verify_ms"] = median_seconds(run_verify, repeats)
    out["commit_ms"] = median_seconds(run_commit, repeats)
    return {k: v / iterations * 1e3 for k, v in out.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--out", default="out")
    parser.add_argument("--reference-json")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--blocks", default="4,8,16")
    parser.add_argument("--alphas", default="0.86,0.68")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per timed chunk")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES), help="tiny: CPU smoke test")
    parser.add_argument("--ceiling-mib", type=int, default=1024, help="buffer size for the bandwidth ceiling")
    parser.add_argument("--impl", default="auto", choices=["auto", "reference", "pallas"])
    parser.add_argument("--parts-batches", default="1,32")
    parser.add_argument("--compile-cache", default="/tmp/dflash-jax-compile-cache")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: decode,parts,e2e")
    parser.add_argument("--steps-per-check", type=int, default=None,
                        help="decode steps between the loop's stop checks (must divide --steps; default: "
                        "decode.default_steps_per_check, what users get)")
    parser.add_argument("--auto-kernels", default="", metavar="OP=on|off,...",
                        help="override what impl=auto runs as a kernel (attention.AUTO_KERNELS), for A/B runs")
    args = parser.parse_args()
    if args.reference_json and not Path(args.reference_json).is_file():
        parser.error(f"--reference-json {args.reference_json}: no such file (run bench_reference.py first)")
    auto_kernels = override_auto_kernels(args.auto_kernels)
    # Identical programs (a prefill shared by several block sizes) compile once.
    jax.config.update("jax_compilation_cache_dir", args.compile_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    blocks = [int(b) for b in args.blocks.split(",")]
    alphas = [float(a) for a in args.alphas.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    rng = np.random.default_rng(0)
    log = lambda *a: print(*a, file=sys.stderr, flush=True)  # noqa: E731

    report = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    report["shape"], report["impl"], report["auto_kernels"] = args.shape, args.impl, auto_kernels
    report["steps_per_check"] = args.steps_per_check
    report["ceilings"] = ceilings = measure_ceilings(args.ceiling_mib)
    log("ceilings", ceilings)
    target, draft = random_models(args.shape)
    roof = Roofline(target, draft, ceilings)
    report["bytes"] = {"target_weights": roof.target_weights, "draft_weights_with_lm_head": roof.draft_weights}

    decode = report["decode"] = {}
    if "decode" not in skip:
        for batch in batches:
            for context in contexts:
                r = run_loop(target, None, batch, context, 1, args.steps * 2, [None], args.repeats, rng,
                             args.impl, args.steps_per_check)[None]
                r["roofline_ms"] = roof.decode(batch, context) * 1e3
                r["fraction_of_roofline"] = r["roofline_ms"] / r["ms_per_step"]
                decode[f"bs{batch}_ctx{context}"] = r
                log("decode", batch, context, r)

    parts = report["parts"] = {}
    if "parts" not in skip:
        for batch in [int(b) for b in args.parts_batches.split(",")]:
            r = time_parts(target, draft, batch, 512, 16, 8, args.repeats, rng, args.impl)
            r["draft_roofline_ms"] = roof.draft(batch, 512, 16) * 1e3
            r["verify_roofline_ms"] = roof.verify(batch, 512, 16) * 1e3
            parts[f"bs{batch}_ctx512_block16"] = r
            log("parts", batch, r)

    e2e = report["e2e"] = {}
    if "e2e" not in skip:
        for batch in batches:
            for context in contexts:
                base = decode.get(f"bs{batch}_ctx{context}") or run_loop(
                    target, None, batch, context, 1, args.steps * 2, [None], args.repeats, rng, args.impl,
                    args.steps_per_check)[None]
                for block in blocks:
                    runs = run_loop(target, draft, batch, context, block, args.steps, alphas, args.repeats, rng,
                                    args.impl, args.steps_per_check)
                    for alpha, r in runs.items():
                        r.update(expected_tau=tau(alpha, block), baseline_tokens_per_s=base["tokens_per_s"],
                                 speedup=r["tokens_per_s"] / base["tokens_per_s"],
                                 step_roofline_ms=roof.dflash_step(batch, context, block) * 1e3)
                        r["step_fraction_of_roofline"] = r["step_roofline_ms"] / r["ms_per_step"]
                        e2e[f"bs{batch}_ctx{context}_block{block}_alpha{alpha}"] = r
                        log("e2e", batch, context, block, alpha, r)

    if args.reference_json:
        ref = json.loads(Path(args.reference_json).read_text())
        ref.setdefault("context", 512)  # bench_reference.py's default; older JSONs did not say
        # At the acceptance our replay realized (the expected tau where ours did not run), so the
        # ratio of tok/s is the ratio of step times at equal acceptance.
        ref["tokens_per_s_at"], ref["compared_with"] = {}, {}
        for a in alphas:
            key = ref["compared_with"][str(a)] = f"bs1_ctx{ref['context']}_block16_alpha{a}"
            ours = e2e.get(key)
            ref["tokens_per_s_at"][str(a)] = (ours["tokens_per_step"] if ours else tau(a, 16)) / ref["dflash_step_s"]
        report["reference"] = ref
    (out_dir / "bench_e2e.json").write_text(json.dumps(report, indent=2))
    print_table(report, alphas)


def print_table(report, alphas):
    c = report["ceilings"]
    print(f"\n{report['device']} | jax {report['jax']} | {report['date']} | copy "
          f"{c['bandwidth_bytes_per_s'] / 1e12:.2f} TB/s (" +
          ", ".join(f"{k} {v / 1e3:.2f}" for k, v in c["copies_GBps"].items()) +
          f" TB/s) | bf16 matmul {c['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s")
    if report["decode"]:
        print("\nbaseline decode        ms/token  roofline ms  fraction  tok/s")
        for name, r in report["decode"].items():
            print(f"  {name:<20} {r['ms_per_step']:8.2f} {r['roofline_ms']:11.2f} {r['fraction_of_roofline']:9.2f}"
                  f" {r['tokens_per_s']:7.0f}")
    if report["parts"]:
        print("\nDFlash parts (ctx 512, block 16)  draft ms (floor)   verify ms (floor)   commit ms")
        for name, r in report["parts"].items():
            print(f"  {name:<28} {r['draft_ms']:6.2f} ({r['draft_roofline_ms']:.2f})   "
                  f"{r['verify_ms']:6.2f} ({r['verify_roofline_ms']:.2f})   {r['commit_ms']:6.2f}")
    if report["e2e"]:
        print("\nend to end                           tau   step ms (floor)  tok/s   baseline  speedup")
        for name, r in report["e2e"].items():
            print(f"  {name:<34} {r['tokens_per_step']:5.2f} {r['ms_per_step']:7.2f} ({r['step_roofline_ms']:5.2f})"
                  f" {r['tokens_per_s']:7.0f} {r['baseline_tokens_per_s']:8.0f} {r['speedup']:7.2f}x")
    ref = report.get("reference")
    if ref:
        print(f"\nreference (dflash {ref['torch']}): decode {ref['decode_step_s'] * 1e3:.2f} ms, DFlash step "
              f"{ref['dflash_step_s'] * 1e3:.2f} ms, tok/s at alpha " +
              ", ".join(f"{a}: {v:.0f}" for a, v in ref["tokens_per_s_at"].items()))
        ours = {a: report["e2e"].get(ref["compared_with"][str(a)], {}).get("tokens_per_s") for a in alphas}
        print(f"ours / reference at bs 1, ctx {ref['context']}, block 16, same tau: " + ", ".join(
            f"alpha {a}: {ours[a] / ref['tokens_per_s_at'][str(a)]:.1f}x" for a in alphas if ours[a]))


if __name__ == "__main__":
    main()
