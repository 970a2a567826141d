"""What a plain 134 MB read costs per call (device time), beside our attention kernel."""
import glob, json, os, sys, tempfile, time, statistics
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.profiler import ProfileData
sys.path.insert(0, "benchmarks")
import bench_kernels as bk
from common import copy_bandwidth

NBYTES = 134_217_728
out_dir = os.environ.get("OUT", "/tmp")


def profile_kernels(run, args, calls):
    jax.block_until_ready(run(*args))
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        jax.block_until_ready(run(*args))
        jax.profiler.stop_trace()
        data = ProfileData.from_file(glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)[0])
    kernels, spans = {}, []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for e in line.events:
                kernels[e.name] = kernels.get(e.name, 0.0) + e.duration_ns
                spans.append((e.start_ns, e.end_ns))
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) / calls / 1e3
    return span, {k: round(v / calls / 1e3, 2) for k, v in kernels.items() if v / calls > 300}


def wall(run, args, calls, repeats=7):
    jax.block_until_ready(run(*args))
    ts = []
    for _ in range(repeats):
        t = time.perf_counter(); jax.block_until_ready(run(*args)); ts.append(time.perf_counter() - t)
    return statistics.median(ts) / calls * 1e6


def read_kernel(programs, tile_rows, stages, warps):
    rows_total = NBYTES // 2 // 128
    steps = rows_total // programs // tile_rows

    def kernel(s_ref, x_ref, o_ref):
        def body(i, acc):
            t = plgpu.load(x_ref.at[i]).astype(jnp.float32)
            return acc + jnp.sum(t, axis=0)
        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros((128,), jnp.float32))
        plgpu.store(o_ref.at[0], acc * s_ref[0])

    def call(s, x):
        x4 = x.reshape(programs, steps, tile_rows, 128)
        return pl.pallas_call(
            kernel, grid=(programs,),
            in_specs=[pl.BlockSpec((1,), lambda p: (0,)),
                      pl.BlockSpec((None, steps, tile_rows, 128), lambda p: (p, 0, 0, 0))],
            out_specs=pl.BlockSpec((None, 1, 128), lambda p: (p, 0, 0)),
            out_shape=jax.ShapeDtypeStruct((programs, 1, 128), jnp.float32),
            compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages))(s, x4)
    return call


def chain_of(fn, n):
    @jax.jit
    def run(s, x):
        def body(_, s):
            for _ in range(8):
                s = jnp.reshape(jnp.sum(fn(s, x))[None] * 1e-30 + 1.0, (1,)).astype(jnp.float32)
            return s
        return jax.lax.fori_loop(0, n, body, s)
    return run


results = {"copy": copy_bandwidth()}
print(results["copy"], flush=True)
x = jax.random.normal(jax.random.key(0), (NBYTES // 2,), jnp.bfloat16)
s0 = jnp.ones((1,), jnp.float32)
reps = 8
calls = reps * 8
cases = {"xla_sum": lambda s, x: jnp.sum(x.astype(jnp.float32) * s[0], keepdims=True)}
for programs in (128, 132, 256, 264):
    for tile_rows, stages in ((256, 3), (256, 4), (512, 2)):
        cases[f"pallas_read p{programs} t{tile_rows} s{stages}"] = read_kernel(programs, tile_rows, stages, 4)
rows = []
for name, fn in cases.items():
    try:
        run = chain_of(fn, reps)
        us = wall(run, (s0, x), calls)
        span, kernels = profile_kernels(run, (s0, x), calls)
        top = max(kernels.values())
        row = {"case": name, "wall_us": round(us, 2), "span_us": round(span, 2), "kernels": kernels,
               "top_kernel_pct_of_copy": round(100 * NBYTES / (top * 1e-6) / (results["copy"]["torch_copy_GBps"] * 1e9), 1)}
    except Exception as e:
        row = {"case": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    rows.append(row); print(json.dumps(row), flush=True)

# torch: copy 67 MB -> 67 MB and sum over 134 MB, CUDA events over 200 calls
import torch
a = torch.randn(NBYTES // 4, dtype=torch.bfloat16, device="cuda"); b = torch.empty_like(a)
big = torch.randn(NBYTES // 2, dtype=torch.bfloat16, device="cuda")
for name, op in (("torch_copy_134MB_moved", lambda: b.copy_(a)), ("torch_sum_134MB", lambda: big.sum(dtype=torch.float32))):
    for _ in range(10): op()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(200): op()
        en.record(); torch.cuda.synchronize(); ts.append(st.elapsed_time(en) / 200 * 1e3)
    us = statistics.median(ts)
    row = {"case": name, "wall_us": round(us, 2), "pct_of_copy": round(100 * NBYTES / (us * 1e-6) / (results["copy"]["torch_copy_GBps"] * 1e9), 1)}
    rows.append(row); print(json.dumps(row), flush=True)

cache = bk.Cache(1)
for kind in ("verify", "decode", "draft"):
    row = bk.device_breakdown(kind, cache, bk.MAX_CTX)
    row.pop("kernels_us_per_call", None)
    rows.append(row); print(json.dumps(row), flush=True)
del cache
json.dump({"copy": results["copy"], "rows": rows}, open(f"{out_dir}/same_size.json", "w"), indent=1)
