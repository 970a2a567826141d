"""The TPU RMSNorm + RoPE kernels (``pallas_kernels.tpu.norm_rope``) against their references in
TPU interpret mode (DMAs into the pages simulated on the CPU), and compiled ahead of time for real
TPU generations by libtpu's compiler (no TPU needed; ``pip install -e ".[tpu]"``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import norm_rope as reference
from pallas_kernels.tpu import norm_rope as tpu_norm_rope

EPS = 1e-6


def tolerance(dtype) -> float:
    return 1e-5 if dtype == jnp.float32 else 2e-2


def rotary_tables(key, batch, q_len, rotary_dim, dtype):
    angles = jax.random.uniform(key, (batch, q_len, rotary_dim // 2), jnp.float32, 0.0, 2 * np.pi)
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def norm_weight(key, head_dim, dtype, with_norm):
    return (1 + 0.2 * jax.random.normal(key, (head_dim,), jnp.float32)).astype(dtype) if with_norm else None


def paged_pool(seed, batch, q_len, kv_heads, head_dim, page_size, pages_per_seq, dtype):
    """A pool NaN-poisoned outside the pages the tables name, permuted tables, and positions that
    cross page boundaries and hit every dropped case: sequence 0 starts at -2 (padding), sequence
    1 runs past the end of its table, and the table of sequence 2 (when there is one) names the
    sentinel page ``num_pages`` and the id -1 where its tokens land. Also returns the mask
    [num_pages, page_size] of the rows the tokens write."""
    rng = np.random.default_rng(seed)
    num_pages = batch * pages_per_seq + 3
    keys = jax.random.split(jax.random.key(seed), 2)
    table = rng.permutation(num_pages)[:batch * pages_per_seq].reshape(batch, pages_per_seq).astype(np.int32)
    start = rng.integers(0, pages_per_seq * page_size - q_len, batch)
    start[0] = -2
    if batch > 1:
        start[1] = pages_per_seq * page_size - q_len // 2
    if batch > 2:
        table[2, start[2] // page_size] = num_pages
        table[2, (start[2] + q_len - 1) // page_size] = -1
    positions = (start[:, None] + np.arange(q_len)).astype(np.int32)
    unused = np.setdiff1d(np.arange(num_pages), table)
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_pages, v_pages = (jax.random.normal(key, shape, dtype).at[unused].set(jnp.nan) for key in keys)
    written = np.zeros((num_pages, page_size), bool)
    for b, t in np.ndindex(batch, q_len):
        p = positions[b, t]
        if 0 <= p < pages_per_seq * page_size and 0 <= table[b, p // page_size] < num_pages:
            written[table[b, p // page_size], p % page_size] = True
    return k_pages, v_pages, jnp.asarray(table), jnp.asarray(positions), written


def assert_pages_match(out, ref, before, written, dtype):
    """The written rows close to the reference's; every other row bit for bit as it was."""
    out, ref, before = (np.asarray(x.astype(jnp.float32)) for x in (out, ref, before))
    np.testing.assert_array_equal(out[~written], before[~written])
    np.testing.assert_allclose(out[written], ref[written], rtol=tolerance(dtype), atol=tolerance(dtype))


def assert_close(out, ref, dtype):
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=tolerance(dtype),
                               atol=tolerance(dtype))


QKV_CASES = {  # seed, batch, q_len, q_heads, kv_heads, head_dim, rotary_dim, norms, dtype, block_t
    # Qwen3.5-like partial RoPE (64 of 256), q/k norms, one program
    "partial-norms-bf16": (11, 3, 5, 4, 2, 256, 64, True, jnp.bfloat16, None),
    # LLaMA-like (no norms, full rotary); 21 tokens in programs of 16: a chunk loop and a partial tile
    "llama-f32-two-programs": (12, 3, 7, 2, 1, 128, 128, False, jnp.float32, 16),
}


@pytest.mark.parametrize("case", QKV_CASES.values(), ids=QKV_CASES.keys())
def test_qkv_norm_rope_write_matches_reference(case):
    seed, batch, q_len, q_heads, kv_heads, head_dim, rotary_dim, norms, dtype, block_t = case
    keys = jax.random.split(jax.random.key(seed), 4)
    qkv = jax.random.normal(keys[0], (batch, q_len, (q_heads + 2 * kv_heads) * head_dim), dtype)
    q_norm, k_norm = (norm_weight(key, head_dim, dtype, norms) for key in keys[1:3])
    cos, sin = rotary_tables(keys[3], batch, q_len, rotary_dim, dtype)
    k_pages, v_pages, table, positions, written = paged_pool(seed, batch, q_len, kv_heads, head_dim, 4, 3, dtype)
    heads = dict(num_heads=q_heads, num_kv_heads=kv_heads, eps=EPS)
    ref = reference.qkv_norm_rope_write_reference(qkv, q_norm, k_norm, cos, sin, positions, k_pages, v_pages, table,
                                                  **heads)
    out = tpu_norm_rope.qkv_norm_rope_write(qkv, q_norm, k_norm, cos, sin, positions, k_pages, v_pages, table,
                                            **heads, interpret=True, block_t=block_t)
    assert out[0].shape == ref[0].shape
    assert_close(out[0], ref[0], dtype)
    for pages_out, pages_ref, before in zip(out[1:], ref[1:], (k_pages, v_pages)):
        assert_pages_match(pages_out, pages_ref, before, written, dtype)


def test_qkv_norm_rope_matches_reference():
    seed, batch, q_len, q_heads, kv_heads, head_dim, rotary_dim, dtype = 13, 2, 3, 6, 2, 128, 32, jnp.float32
    keys = jax.random.split(jax.random.key(seed), 4)
    qkv = jax.random.normal(keys[0], (batch, q_len, (q_heads + 2 * kv_heads) * head_dim), dtype)
    q_norm, k_norm = (norm_weight(key, head_dim, dtype, True) for key in keys[1:3])
    cos, sin = rotary_tables(keys[3], batch, q_len, rotary_dim, dtype)
    heads = dict(num_heads=q_heads, num_kv_heads=kv_heads, eps=EPS)
    ref = reference.qkv_norm_rope_reference(qkv, q_norm, k_norm, cos, sin, **heads)
    out = tpu_norm_rope.qkv_norm_rope(qkv, q_norm, k_norm, cos, sin, **heads, interpret=True)
    for o, r in zip(out, ref):
        assert o.shape == r.shape
        assert_close(o, r, dtype)


WRITE_CASES = {  # seed, batch, q_len, kv_heads, head_dim, rotary_dim, norm, dtype
    "norm-partial-bf16": (14, 3, 6, 2, 128, 64, True, jnp.bfloat16),
    "no-norm-f32": (15, 2, 4, 4, 128, 128, False, jnp.float32),
}


@pytest.mark.parametrize("case", WRITE_CASES.values(), ids=WRITE_CASES.keys())
def test_norm_rope_write_matches_reference(case):
    seed, batch, q_len, kv_heads, head_dim, rotary_dim, norm, dtype = case
    keys = jax.random.split(jax.random.key(seed), 4)
    k, v = (jax.random.normal(key, (batch, q_len, kv_heads, head_dim), dtype) for key in keys[:2])
    k_norm = norm_weight(keys[2], head_dim, dtype, norm)
    cos, sin = rotary_tables(keys[3], batch, q_len, rotary_dim, dtype)
    k_pages, v_pages, table, positions, written = paged_pool(seed, batch, q_len, kv_heads, head_dim, 4, 4, dtype)
    ref = reference.norm_rope_write_reference(k, v, k_norm, cos, sin, positions, k_pages, v_pages, table, eps=EPS)
    out = tpu_norm_rope.norm_rope_write(k, v, k_norm, cos, sin, positions, k_pages, v_pages, table, eps=EPS,
                                        interpret=True)
    for pages_out, pages_ref, before in zip(out, ref, (k_pages, v_pages)):
        assert_pages_match(pages_out, pages_ref, before, written, dtype)


def test_bad_arguments_are_refused():
    qkv = jnp.zeros((1, 2, 4 * 128), jnp.float16)
    cos = sin = jnp.zeros((1, 2, 64), jnp.float16)
    with pytest.raises(ValueError, match="tpu_qkv_norm_rope: dtype must be float32 or bfloat16"):
        tpu_norm_rope.qkv_norm_rope(qkv, None, None, cos, sin, num_heads=2, num_kv_heads=1, eps=EPS)
    with pytest.raises(ValueError, match="block_t must be a multiple of 16"):
        tpu_norm_rope.qkv_norm_rope(qkv.astype(jnp.float32), None, None, cos, sin, num_heads=2, num_kv_heads=1,
                                    eps=EPS, block_t=1)


# Compiled for real TPUs ---------------------------------------------------------------------------

libtpu = pytest.importorskip("libtpu", reason='the TPU compiler comes with pip install -e ".[tpu]"')
from pallas_kernels.tpu.compile import topology_devices  # noqa: E402


def compile_donating(topology: str, fn, donate: tuple, *shapes):
    """Like ``compile.compile_for``, with the arguments ``donate`` donated (a caller that owns its
    cache), so that the aliased pages can be updated in place."""
    device = topology_devices(topology)[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]
    with jax.default_device(device):
        return jax.jit(fn, donate_argnums=donate).lower(*structs).compile()


# Attention of Qwen3-8B (q/k norms, full rotary), Qwen3.5-27B (norms, RoPE on 64 of 256 dims) and
# LLaMA-3.1-8B (no norms): q heads, KV heads, head_dim, rotary_dim, norms. Pool: 4096 pages of 16.
MODELS = {"qwen3-8b": (32, 8, 128, 128, True), "qwen3.5-27b": (24, 4, 256, 64, True),
          "llama-3.1-8b": (32, 8, 128, 128, False)}
NUM_PAGES, PAGE_SIZE, PAGES_PER_SEQ = 4096, 16, 128
COMPILE_CASES = [("qwen3-8b", 32, 16), ("qwen3-8b", 1, 1), ("qwen3.5-27b", 1, 512), ("qwen3.5-27b", 32, 1),
                 ("llama-3.1-8b", 1, 16)]


def qkv_write(model: str, batch: int, q_len: int, block_t: int | None = None):
    """``qkv_norm_rope_write`` of a model's attention over flat arguments (the norm weights only
    where the model has them), their (shape, dtype) pairs and the indices of the two pools."""
    q_heads, kv_heads, head_dim, rotary_dim, norms = MODELS[model]
    dtype = jnp.bfloat16
    weights = [((head_dim,), dtype)] * 2 if norms else []
    rope = ((batch, q_len, rotary_dim // 2), dtype)
    pool = ((NUM_PAGES, PAGE_SIZE, kv_heads, head_dim), dtype)
    shapes = [((batch, q_len, (q_heads + 2 * kv_heads) * head_dim), dtype), *weights, rope, rope,
              ((batch, q_len), jnp.int32), pool, pool, ((batch, PAGES_PER_SEQ), jnp.int32)]

    def write(qkv, *args):
        norm_weights, rest = (args[:2], args[2:]) if norms else ((None, None), args)
        return tpu_norm_rope.qkv_norm_rope_write(qkv, *norm_weights, *rest, num_heads=q_heads,
                                                 num_kv_heads=kv_heads, eps=EPS, block_t=block_t)

    return write, shapes, (len(weights) + 4, len(weights) + 5)


def nbytes(shape_dtype) -> int:
    shape, dtype = shape_dtype
    return int(np.prod(shape)) * jnp.dtype(dtype).itemsize


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("model,batch,q_len", COMPILE_CASES, ids=[f"{m}-B{b}-T{t}" for m, b, t in COMPILE_CASES])
def test_qkv_norm_rope_write_compiles_in_place(topology, model, batch, q_len):
    write, shapes, pools = qkv_write(model, batch, q_len)
    compiled = compile_donating(topology, write, pools, *shapes)
    memory = compiled.memory_analysis()
    pool_bytes = nbytes(shapes[pools[0]])
    assert memory.alias_size_in_bytes >= 2 * pool_bytes  # both pools are their outputs
    assert memory.temp_size_in_bytes < pool_bytes / 64  # no copy of a pool
    # the kernel's own count: the projection read once, q and the new k/v rows written once
    assert compiled.cost_analysis()["bytes accessed"] >= 2 * nbytes(shapes[0])


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
def test_norm_rope_write_and_qkv_norm_rope_compile(topology):
    q_heads, kv_heads, head_dim, rotary_dim, _ = MODELS["qwen3.5-27b"]
    batch, q_len, dtype = 32, 16, jnp.bfloat16
    rows, weight = ((batch, q_len, kv_heads, head_dim), dtype), ((head_dim,), dtype)
    table = ((batch, q_len, rotary_dim // 2), dtype)
    pool = ((NUM_PAGES, PAGE_SIZE, kv_heads, head_dim), dtype)
    write = compile_donating(topology, lambda *args: tpu_norm_rope.norm_rope_write(*args, eps=EPS), (6, 7), rows, rows,
                             weight, table, table, ((batch, q_len), jnp.int32), pool, pool,
                             ((batch, PAGES_PER_SEQ), jnp.int32))
    assert write.memory_analysis().alias_size_in_bytes >= 2 * nbytes(pool)
    assert write.memory_analysis().temp_size_in_bytes < nbytes(pool) / 64
    assert write.cost_analysis()["bytes accessed"] >= 4 * nbytes(rows)  # k and v read, their rows written

    qkv = ((batch, q_len, (q_heads + 2 * kv_heads) * head_dim), dtype)
    no_write = compile_donating(topology, lambda *args: tpu_norm_rope.qkv_norm_rope(
        *args, num_heads=q_heads, num_kv_heads=kv_heads, eps=EPS), (), qkv, weight, weight, table, table)
    assert no_write.memory_analysis().temp_size_in_bytes < nbytes(qkv)
    assert no_write.cost_analysis()["bytes accessed"] >= 2 * nbytes(qkv)  # read, and q, k, v written


def test_oversized_block_is_refused_naming_the_kernel():
    write, shapes, _ = qkv_write("qwen3-8b", 1, 8192, block_t=8192)
    with pytest.raises(ValueError, match=r"tpu_qkv_norm_rope_write: block_t=8192 tokens .* MiB of VMEM.*smaller"):
        compile_donating("v5e:2x2", write, (), *shapes)
