"""Achieved bandwidth of the paged attention kernels at Qwen3-8B shapes, against the copy bandwidth.

Qwen3-8B attention: 32 query heads, 8 KV heads, head_dim 128, bf16, page size 16, block 16.
For verify (T=16), decode (T=1) and draft (16 block queries over context + the block's own K/V)
at context 512 / 4k / 16k / 32k and batch 1 / 8 / 32, it times ``calls`` dependent calls (each
call's output is the next call's query; 8 unrolled per step of a fori_loop) inside one jit, takes
the median over repeats, and divides the bytes a kernel must move (K/V of every visible token
once, q in, out out) by the time per call. The ceiling is the device-to-device copy bandwidth
measured in the same run (bytes read + written). Anchors in the same run: jax's own Pallas
paged_attention (decode only) and jax.nn.dot_product_attention (16 queries on contiguous KV,
cudnn and xla).

    PYTHONPATH=. python3 benchmarks/bench_kernels.py --out $OUT [--explore] [--profile]

--profile splits the per-call time of the 134 MB cases (and of the --explore variants) by kernel
with the JAX profiler (attention kernel alone vs the split merge and launch gaps), and gives
their device time as a % of copy, the measure #4's 80% target is read on (busy: the kernel, the
split merge and the timing loop's own small kernels, ~0.7 µs per call; no idle gaps).

Also timed: norm_rope_write of one verify step's K/V into the cache, against its plain-XLA
reference (a launch-bound size: reported as time per call).

Page tables are 32k tokens wide (the model's fixed capacity) with pages in random order; the
context length is a runtime value, so one compiled kernel per (kernel, batch) serves all
contexts. Small cases (a few MB of KV) stay in the 50 MB L2 between calls and can exceed the
HBM bandwidth; the 80% target applies where the KV read is >= 100 MB.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from pallas_kernels import gpu as pk_gpu
from dflash_jax.model.nn import rope
from dflash_jax.model.nn.rope import RopeSpec

sys.path.insert(0, os.path.dirname(__file__))
from common import (CEILING_SIZES, copy_bandwidth, copy_ceiling_bytes_per_s, median_seconds,  # noqa: E402
                    output_dir, positive_ints, run_record, write_json)

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE, BLOCK = 32, 8, 128, 16, 16
MAX_CTX = 32768
CTXS = (512, 4096, 16384, 32768)
BATCHES = (1, 8, 32)
DTYPE = jnp.bfloat16
KERNELS = ("verify", "decode", "draft", "jax_paged")
DENSE = ("cudnn", "xla")
TARGET_SECONDS = 4e-3  # device time per timed jit call


UNROLL = 8


@functools.lru_cache(maxsize=None)
def chain(fn, static: tuple = ()):
    """One jit running ``UNROLL * reps`` dependent applications x <- fn(x, *rest, **static);
    ``reps`` is a runtime value, so every context length reuses one compilation."""
    step = functools.partial(fn, **dict(static))

    def run(x, reps, *rest):
        def body(_, x):
            for _ in range(UNROLL):
                x = step(x, *rest)
            return x
        return jax.lax.fori_loop(0, reps, body, x)
    return jax.jit(run)


def time_per_call(fn, static: dict, x, rest, nbytes: float) -> tuple[float, int]:
    reps = int(min(16, max(1, math.ceil(TARGET_SECONDS / (nbytes / 2.5e12 + 3e-6) / UNROLL))))
    run = chain(fn, tuple(sorted(static.items())))
    args = (x, jnp.int32(reps), *rest)
    return median_seconds(lambda: jax.block_until_ready(run(*args)), 7) / (reps * UNROLL), reps * UNROLL


class Cache:
    """Random bf16 pages for `batch` sequences of MAX_CTX tokens, pages in random order."""

    def __init__(self, batch: int, seed: int = 0):
        pages_per_seq = MAX_CTX // PAGE
        num_pages = batch * pages_per_seq
        k1, k2 = jax.random.split(jax.random.key(seed))
        shape = (num_pages, PAGE, KV_HEADS, HEAD_DIM)
        self.k = jax.random.normal(k1, shape, DTYPE)
        self.v = jax.random.normal(k2, shape, DTYPE)
        order = np.random.default_rng(seed).permutation(num_pages).astype(np.int32)
        self.table = jnp.asarray(order.reshape(batch, pages_per_seq))
        self.batch = batch
        self._jax_layout = None

    def jax_layout(self):
        """[KV_HEADS, P, S, D] copies of the pages for jax's paged_attention (made once)."""
        if self._jax_layout is None:
            self._jax_layout = tuple(jnp.transpose(x, (2, 0, 1, 3)) for x in (self.k, self.v))
        return self._jax_layout


def kv_bytes(batch: int, tokens: int) -> int:
    return batch * tokens * KV_HEADS * HEAD_DIM * 2 * 2


def q_bytes(batch: int, q_len: int) -> int:
    return 2 * batch * q_len * Q_HEADS * HEAD_DIM * 2  # q read + out written


def make_case(kind: str, cache: Cache, ctx: int):
    """(fn, q, rest, bytes moved) for verify, decode, draft (ours) or jax_paged (decode anchor)."""
    batch = cache.batch
    kind, _, tokens = kind.partition("@")
    q_len = int(tokens) if tokens else 1 if kind in ("decode", "jax_paged") else BLOCK
    key = jax.random.key(ctx + batch)
    q = jax.random.normal(key, (batch, q_len, Q_HEADS, HEAD_DIM), DTYPE)
    lens = jnp.full((batch,), ctx, jnp.int32)
    nbytes = kv_bytes(batch, ctx) + q_bytes(batch, q_len)
    if kind in ("verify", "decode"):
        return pk_gpu.paged_verify_attention, q, (cache.k, cache.v, cache.table, lens - q_len), nbytes
    if kind == "draft":
        blk = jax.random.normal(key, (2, batch, BLOCK, KV_HEADS, HEAD_DIM), DTYPE)
        rest = (cache.k, cache.v, cache.table, lens, blk[0], blk[1])
        return pk_gpu.paged_draft_attention, q, rest, nbytes + kv_bytes(batch, BLOCK)
    if kind == "jax_paged":
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
        k_t, v_t = cache.jax_layout()
        # (it expects q pre-scaled by head_dim**-0.5; irrelevant for timing)
        return jax_paged.paged_attention, q[:, 0], (k_t, v_t, cache.table, lens), nbytes
    raise ValueError(kind)


def run_case(kind: str, cache: Cache, ctx: int, tuning: dict | None = None) -> dict:
    """Time one call of ``kind`` (see make_case) at context ctx."""
    fn, q, rest, nbytes = make_case(kind, cache, ctx)
    tuning = tuning or {}
    seconds, calls = time_per_call(fn, tuning, q, rest, nbytes)
    return {"kind": kind, "batch": cache.batch, "ctx": ctx,
            "kv_MB": kv_bytes(cache.batch, ctx) / 1e6, "calls": calls, "us": seconds * 1e6,
            "GBps": nbytes / seconds / 1e9, "tuning": tuning}


def device_breakdown(kind: str, cache: Cache, ctx: int, tuning: dict | None = None,
                     reps: int = 4) -> dict:
    """Per-call GPU time of each kernel launched by one call, read from a profiler trace, to
    split the per-call time into the attention kernel, the split merge and idle gaps."""
    import glob
    import tempfile
    from jax.profiler import ProfileData
    fn, q, rest, nbytes = make_case(kind, cache, ctx)
    run = chain(fn, tuple(sorted((tuning or {}).items())))
    args = (q, jnp.int32(reps), *rest)
    jax.block_until_ready(run(*args))
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        jax.block_until_ready(run(*args))
        jax.profiler.stop_trace()
        data = ProfileData.from_file(glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)[0])
    calls = reps * UNROLL
    kernels, spans, lines = {}, [], set()
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            lines.add(line.name)
            if not line.name.startswith("Stream"):
                continue
            for event in line.events:
                kernels[event.name] = kernels.get(event.name, 0.0) + event.duration_ns
                spans.append((event.start_ns, event.end_ns))
    if not spans:
        return {"kind": kind, "batch": cache.batch, "ctx": ctx,
                "error": f"no GPU stream events; lines: {sorted(lines)}"}
    busy = sum(end - start for start, end in spans)
    top = max(kernels, key=kernels.get)
    return {"kind": kind, "batch": cache.batch, "ctx": ctx, "tuning": tuning or {},
            "span_us_per_call": (max(e for _, e in spans) - min(s for s, _ in spans)) / calls / 1e3,
            "busy_us_per_call": busy / calls / 1e3, "busy_GBps": nbytes / (busy / calls),
            "top_kernel": top, "top_kernel_us_per_call": kernels[top] / calls / 1e3,
            "top_kernel_GBps": nbytes / (kernels[top] / calls),
            "kernels_us_per_call": {k: v / calls / 1e3 for k, v in kernels.items()}}


# 134 MB of KV (the smallest cases the 80% target covers), where the per-call time is furthest
# from the bandwidth floor.
PROFILE = [(1, "verify", MAX_CTX), (1, "decode", MAX_CTX), (1, "draft", MAX_CTX),
           (8, "verify", 4096), (8, "decode", 4096), (8, "draft", 4096), (32, "verify", MAX_CTX)]


def run_dense(batch: int, ctx: int, implementation: str) -> dict:
    """jax.nn.dot_product_attention, 16 queries over contiguous KV of ctx tokens."""
    keys = jax.random.split(jax.random.key(batch * ctx), 3)
    q = jax.random.normal(keys[0], (batch, BLOCK, Q_HEADS, HEAD_DIM), DTYPE)
    k = jax.random.normal(keys[1], (batch, ctx, KV_HEADS, HEAD_DIM), DTYPE)
    v = jax.random.normal(keys[2], (batch, ctx, KV_HEADS, HEAD_DIM), DTYPE)
    nbytes = kv_bytes(batch, ctx) + q_bytes(batch, BLOCK)
    seconds, calls = time_per_call(jax.nn.dot_product_attention,
                                   {"implementation": implementation}, q, (k, v), nbytes)
    return {"kind": f"dpa_{implementation}", "batch": batch, "ctx": ctx,
            "kv_MB": kv_bytes(batch, ctx) / 1e6, "calls": calls, "us": seconds * 1e6,
            "GBps": nbytes / seconds / 1e9, "tuning": {}}


@functools.lru_cache(maxsize=None)
def _write_chain(write):
    """Like ``chain`` for norm_rope_write(-like) calls: the pages are the (donated) carry, so
    each call updates them in place as in the model."""
    def run(pages, reps, k, v, weight, cos, sin, positions, table):
        def body(_, pages):
            for _ in range(UNROLL):
                pages = write(k, v, weight, cos, sin, positions, *pages, table, eps=1e-6)
            return pages
        return jax.lax.fori_loop(0, reps, body, pages)
    return jax.jit(run, donate_argnums=0)


def run_rows(cache: Cache, log) -> list[dict]:
    """norm_rope_write of one verify step's K/V into the cache, kernel vs reference (plain XLA:
    fused elementwise + scatter). Consumes cache.k/v."""
    batch = cache.batch
    keys = jax.random.split(jax.random.key(7), 2)
    k, v = (jax.random.normal(key, (batch, BLOCK, KV_HEADS, HEAD_DIM), DTYPE) for key in keys)
    weight = jnp.ones((HEAD_DIM,), DTYPE)
    positions = jnp.broadcast_to(jnp.arange(BLOCK, dtype=jnp.int32) + 1000, (batch, BLOCK))
    cos, sin = rope.tables(positions, RopeSpec(theta=1e6, rotary_dim=HEAD_DIM), DTYPE)  # as the model's layers
    rows = []
    for impl, write in (("pallas", pk_gpu.norm_rope_write), ("xla", pk.norm_rope_write_reference)):
        reps = 16
        run = _write_chain(write)
        pages = (cache.k, cache.v)
        times = []
        for _ in range(6):  # first call compiles
            t0 = time.perf_counter()
            pages = jax.block_until_ready(run(pages, jnp.int32(reps), k, v, weight, cos, sin, positions,
                                              cache.table))
            times.append(time.perf_counter() - t0)
        cache.k, cache.v = pages
        seconds = statistics.median(times[1:]) / (reps * UNROLL)
        nbytes = 4 * k.size * k.dtype.itemsize
        rows.append({"kind": f"norm_rope_write_{impl}", "batch": batch, "ctx": 0, "kv_MB": 0,
                     "calls": reps * UNROLL, "us": seconds * 1e6, "GBps": nbytes / seconds / 1e9})
        log(rows[-1])
    return rows


# Tuning variants timed by --explore, where the rule is least sure: (batch, kind, ctx). A kind
# "verify@T" verifies T tokens per sequence (plain "verify" uses BLOCK). Fourth round (H200,
# 2026-11-22): the full-batch cells of the end-to-end runs, block-8 verify (32-row programs) and
# decode (16-row programs), on 64-token KV tiles that leave room for two or three programs per
# SM; none beat the rule by more than the noise. Earlier sweeps (8 warps, 32-row programs for
# block 16, 2-4 stages, 64-token tiles for block 16 at bs 8 and 32) are in benchmarks/RESULTS.md.
_SMALL_TILE_VARIANTS = [{"pages_per_block": 4, "num_stages": 3}, {"pages_per_block": 4, "num_stages": 2},
                        {"pages_per_block": 4, "num_stages": 4}, {"pages_per_block": 8, "num_stages": 2}]
# Fifth round (H200, 2026-11-22): fewer and more context splits for the 134 MB cells, each timed
# after the rule itself; none beat the rule (benchmarks/RESULTS.md).
_FEWER_MORE_SPLITS = {
    (1, "verify", MAX_CTX): [{"num_splits": 8}, {"num_splits": 32},
                             {"num_splits": 16, "pages_per_block": 4, "num_stages": 5}],
    (1, "decode", MAX_CTX): [{"num_splits": 8}, {"num_splits": 16}, {"num_splits": 64}],
    (1, "draft", MAX_CTX): [{"num_splits": 8}, {"num_splits": 32}],
    (8, "verify", 4096): [{"num_splits": 1}, {"num_splits": 1, "pages_per_block": 4, "num_stages": 5},
                          {"num_splits": 4}],
    (8, "decode", 4096): [{"num_splits": 1}, {"num_splits": 2}, {"num_splits": 8}],
    (8, "draft", 4096): [{"num_splits": 1}, {"num_splits": 4}],
}
EXPLORE = {
    **_FEWER_MORE_SPLITS,
    (32, "verify@8", 512): _SMALL_TILE_VARIANTS,
    (32, "verify@8", 4096): _SMALL_TILE_VARIANTS,
    (32, "decode", 512): _SMALL_TILE_VARIANTS,
    (32, "decode", 4096): _SMALL_TILE_VARIANTS,
    (32, "verify", 512): _SMALL_TILE_VARIANTS,
}


def explore(cache: Cache, log, profile: bool = False) -> list[dict]:
    """Time the EXPLORE variants of this batch (and, with ``profile``, their kernels' device time)."""
    rows = []
    for (batch, kind, ctx), variants in EXPLORE.items():
        if batch != cache.batch:
            continue
        for tuning in [{}] + variants:
            try:
                row = run_case(kind, cache, ctx, tuning)
                if profile:
                    row["profile"] = device_breakdown(kind, cache, ctx, tuning)
            except Exception as e:  # a variant that does not compile is a result too
                row = {"kind": kind, "batch": batch, "ctx": ctx, "tuning": tuning,
                       "error": f"{type(e).__name__}: {str(e)[:300]}"}
            rows.append(row)
            log(row)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=output_dir, default=os.environ.get("OUT", "bench_out"))
    parser.add_argument("--explore", action="store_true", help="also time tuning variants")
    parser.add_argument("--profile", action="store_true",
                        help="also split the per-call time of a few cases by kernel (profiler)")
    parser.add_argument("--skip-table", action="store_true")
    parser.add_argument("--batches", type=positive_ints, default=",".join(map(str, BATCHES)),
                        help="comma-separated batch sizes")
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        parser.error(f"the kernels are compiled for a GPU, and jax sees only {jax.default_backend()}; "
                     "their CPU checks are the interpret-mode tests (tests/test_kernels.py)")
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_record(args)
    results.update(rows=[], explore=[], profile=[])
    path = args.out / "bench_kernels.json"

    def log(row):
        print(json.dumps(row), flush=True)
        write_json(path, results)

    results["copy"] = copy_bandwidth(CEILING_SIZES["qwen3-8b"][0])
    log(results["copy"])
    for batch in args.batches:
        cache = Cache(batch)
        if args.explore:
            results["explore"] += explore(cache, log, profile=args.profile)
        if args.profile:
            for batch_, kind, ctx in PROFILE:
                if batch_ == batch:
                    results["profile"].append(device_breakdown(kind, cache, ctx))
                    log(results["profile"][-1])
        if not args.skip_table:
            for kind in KERNELS:
                for ctx in CTXS:
                    row = run_case(kind, cache, ctx)
                    results["rows"].append(row)
                    log(row)
            results["rows"] += run_rows(cache, log)
        del cache
        if not args.skip_table:
            for implementation in DENSE:
                for ctx in CTXS:
                    try:
                        row = run_dense(batch, ctx, implementation)
                    except Exception as e:
                        row = {"kind": f"dpa_{implementation}", "batch": batch, "ctx": ctx,
                               "error": f"{type(e).__name__}: {str(e)[:300]}"}
                    results["rows"].append(row)
                    log(row)
    print_table(results)


def print_table(results):
    ceiling = copy_ceiling_bytes_per_s(results["copy"]) / 1e9  # GB/s, the ceiling bench_e2e divides by
    print(f"\n{results['device']}, jax {results['jax']}, {results['date']}; copy bandwidth "
          + ", ".join(f"{k} {v:.0f}" for k, v in results["copy"].items()))
    if results["explore"]:
        print("\n| kind | batch | ctx | tuning | us | GB/s | kernel us (profiler) |\n|---|---|---|---|---|---|---|")
        for r in results["explore"]:
            if "error" in r:
                print(f"| {r['kind']} | {r['batch']} | {r['ctx']} | {r['tuning']} | error | | |")
            else:
                kernel = r.get("profile", {}).get("top_kernel_us_per_call")
                print(f"| {r['kind']} | {r['batch']} | {r['ctx']} | {r['tuning']} | "
                      f"{r['us']:.1f} | {r['GBps']:.0f} | {'' if kernel is None else f'{kernel:.1f}'} |")
    for r in results["profile"]:
        if "error" not in r:
            print(f"profile {r['kind']} b={r['batch']} ctx={r['ctx']}: span "
                  f"{r['span_us_per_call']:.1f} us/call, busy {r['busy_us_per_call']:.1f} us = "
                  f"{100 * r['busy_GBps'] / ceiling:.1f}% of copy, {r['top_kernel']} "
                  f"{r['top_kernel_us_per_call']:.1f} us = {100 * r['top_kernel_GBps'] / ceiling:.1f}%")
    if not results["rows"]:
        return
    print(f"\n| kernel | batch | ctx | KV MB | us/call | GB/s | % of copy ({ceiling:.0f} GB/s) |")
    print("|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        if "error" in r:
            print(f"| {r['kind']} | {r['batch']} | {r['ctx']} | | error: {r['error'][:60]} | | |")
            continue
        print(f"| {r['kind']} | {r['batch']} | {r['ctx']} | {r['kv_MB']:.0f} | {r['us']:.1f} | "
              f"{r['GBps']:.0f} | {100 * r['GBps'] / ceiling:.0f}% |")


if __name__ == "__main__":
    main()
