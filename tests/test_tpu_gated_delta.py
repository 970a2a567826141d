"""The TPU gated delta rule (``pallas_kernels.tpu.gated_delta``) against the recurrent reference in
TPU interpret mode (recurrent kernel: decode and verify; chunked kernel: T around chunk
boundaries), masked (g = 0, β = 0) tails, the output / state flags and the argument checks; then
compiled ahead of time for v5e and v6e at Qwen3.5-27B's linear-attention shapes."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import gated_delta_rule_reference
from pallas_kernels.tpu.gated_delta import gated_delta_rule

F32_TOL = 1e-5
BF16_TOL = 2e-2  # the output rounded to bf16; the state stays f32 from the same inputs
reference = jax.jit(gated_delta_rule_reference, static_argnames=("with_output", "with_state"))


def make_inputs(seed, batch, seq_len, key_heads, value_heads, dtype, key_dim=16, value_dim=32):
    """Raw q/k/v in ``dtype``, f32 log decays in (-2, 0] (about one in ten exactly 0), f32 beta in
    [0, 1), a random f32 state."""
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((batch, seq_len, key_heads, key_dim)) for _ in range(2))
    v = rng.standard_normal((batch, seq_len, value_heads, value_dim))
    gates = (batch, seq_len, value_heads)
    g = -rng.uniform(0, 2, gates) * (rng.uniform(size=gates) > 0.1)
    beta = rng.uniform(0, 1, gates)
    state = 0.5 * rng.standard_normal((batch, value_heads, key_dim, value_dim))
    return (*(jnp.asarray(x, dtype) for x in (q, k, v)), *(jnp.asarray(x, jnp.float32) for x in (g, beta, state)))


def mask_tail(args, row, length):
    """g = 0 and beta = 0 at positions >= length of batch row ``row`` (q/k/v there stay random)."""
    q, k, v, g, beta, state = args
    masked = (jnp.arange(q.shape[0])[:, None] == row) & (jnp.arange(q.shape[1])[None, :] >= length)
    return q, k, v, jnp.where(masked[..., None], 0.0, g), jnp.where(masked[..., None], 0.0, beta), state


def assert_close(out, ref, tol):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape and np.isfinite(out).all()
    err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err < tol, f"relative L2 error {err:.3g}"


CASES = {  # dtype, batch, T, key heads, value heads, tuning
    "decode": (jnp.float32, 2, 1, 1, 2, {}),
    "verify-bf16-head-blocks": (jnp.bfloat16, 2, 16, 2, 6, {"block_heads": 3}),
    "chunk-1": (jnp.float32, 1, 15, 1, 1, {"max_recurrent_len": 0, "chunk_size": 16}),
    "chunk": (jnp.float32, 2, 16, 1, 2, {"max_recurrent_len": 0, "chunk_size": 16}),
    "chunk+1-bf16": (jnp.bfloat16, 2, 17, 1, 2, {"chunk_size": 16}),
    "2chunks+3-head-blocks": (jnp.float32, 2, 35, 2, 6, {"chunk_size": 16, "block_heads": 3}),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_matches_reference_and_masked_tail_keeps_state(case):
    """Kernel == reference; the last row, masked (g = 0, β = 0) from T // 2 on, ends in the state
    of its unmasked prefix (with a fully masked row: exactly its initial state)."""
    dtype, batch, seq_len, key_heads, value_heads, tuning = case
    seed = zlib.crc32(repr(case).encode())
    prefix = seq_len // 2
    args = mask_tail(make_inputs(seed, batch, seq_len, key_heads, value_heads, dtype), batch - 1, prefix)
    out, state = gated_delta_rule(*args, interpret=True, **tuning)
    ref_out, ref_state = reference(*args)
    assert out.dtype == dtype and state.dtype == jnp.float32
    assert_close(out, ref_out, F32_TOL if dtype == jnp.float32 else BF16_TOL)
    assert_close(state, ref_state, F32_TOL)
    if batch > 1:
        if prefix == 0:
            np.testing.assert_array_equal(state[-1], args[-1][-1])
        else:
            _, prefix_state = reference(*(x[-1:, :prefix] for x in args[:-1]), args[-1][-1:])
            assert_close(state[-1], prefix_state[0], F32_TOL)


@pytest.mark.parametrize("seq_len,with_output,with_state", [(5, False, True), (20, True, False)],
                         ids=["recurrent-state-only", "chunked-output-only"])
def test_flags(seq_len, with_output, with_state):
    args = make_inputs(seq_len, 2, seq_len, 1, 3, jnp.float32)
    flags = dict(with_output=with_output, with_state=with_state)
    out, state = gated_delta_rule(*args, interpret=True, chunk_size=16, **flags)
    ref_out, ref_state = reference(*args, **flags)
    for x, ref, wanted in ((out, ref_out, with_output), (state, ref_state, with_state)):
        assert (x is None) == (ref is None) == (not wanted)
        if wanted:
            assert_close(x, ref, F32_TOL)
    assert gated_delta_rule(*args, interpret=True, with_output=False, with_state=False) == (None, None)


@pytest.mark.parametrize("match,tuning,interpret", [
    (r"block_heads must be a multiple of the group size 3", {"block_heads": 2}, True),
    (r"block_heads .* that divides value_heads 6", {"block_heads": 9}, True),
    (r"chunk_size must be a positive multiple of 16", {"chunk_size": 24}, True),
    (r"max_recurrent_len must be >= 0", {"max_recurrent_len": -1}, True),
    (r"key_dim and value_dim must be multiples of 128", {}, False),
])
def test_rejects_bad_tuning(match, tuning, interpret):
    args = make_inputs(0, 1, 2, 2, 6, jnp.float32)
    with pytest.raises(ValueError, match=match):
        gated_delta_rule(*args, interpret=interpret, **tuning)


def test_rejects_bad_args():  # the shared checks of pallas_kernels.gated_delta
    q, k, v, g, beta, state = make_inputs(0, 1, 2, 1, 2, jnp.float32)
    with pytest.raises(ValueError, match="state must be float32"):
        gated_delta_rule(q, k, v, g, beta, state.astype(jnp.bfloat16), interpret=True)


# Compiled for real TPUs ---------------------------------------------------------------------------

libtpu = pytest.importorskip("libtpu", reason='the TPU compiler comes with pip install -e ".[tpu]"')
from pallas_kernels.tpu.compile import compile_for, topology_devices  # noqa: E402

# Qwen3.5-27B's linear attention: 16 key heads and 48 value heads of 128.
KEY_HEADS, VALUE_HEADS, HEAD_DIM = 16, 48, 128


def model_shapes(batch, seq_len, key_dim=HEAD_DIM, value_dim=HEAD_DIM):
    keys = ((batch, seq_len, KEY_HEADS, key_dim), jnp.bfloat16)
    gates = ((batch, seq_len, VALUE_HEADS), jnp.float32)
    return [keys, keys, ((batch, seq_len, VALUE_HEADS, value_dim), jnp.bfloat16), gates, gates,
            ((batch, VALUE_HEADS, key_dim, value_dim), jnp.float32)]


# decode at batch 1 and verify at batch 32 (recurrent kernel); prefill (chunked kernel) of 512
# tokens and of 300 (the last 64-token chunk partial; one generation, its compile the slowest).
COMPILE_CASES = [(topology, batch, seq_len) for topology in ("v5e:2x2", "v6e:2x2")
                 for batch, seq_len in ((1, 1), (32, 16), (1, 512))]
COMPILE_CASES.append(("v6e:2x2", 1, 300))


@pytest.mark.parametrize("topology,batch,seq_len", COMPILE_CASES, ids=lambda x: str(x))
def test_compiles_for_tpus(topology, batch, seq_len):
    compiled = compile_for(topology_devices(topology)[0], gated_delta_rule, *model_shapes(batch, seq_len))
    state_bytes = batch * VALUE_HEADS * HEAD_DIM * HEAD_DIM * 4
    rows_bytes = batch * seq_len * (2 * KEY_HEADS + 2 * VALUE_HEADS) * HEAD_DIM * 2  # q, k, v, out (bf16)
    memory = compiled.memory_analysis()
    assert memory.argument_size_in_bytes >= state_bytes
    assert memory.output_size_in_bytes >= state_bytes
    assert memory.temp_size_in_bytes < state_bytes / 8  # no temporary copy of the state
    # the kernel's own count: the state read and written once, every q/k/v row read, out written
    assert compiled.cost_analysis()["bytes accessed"] >= 2 * state_bytes + rows_bytes


def test_oversized_block_is_refused_naming_the_kernel():
    oversized = lambda *args: gated_delta_rule(*args, block_heads=VALUE_HEADS)  # noqa: E731
    with pytest.raises(ValueError, match=r"tpu_gated_delta_recurrent: block_heads=48 .* MiB of VMEM.*fewer"):
        compile_for(topology_devices("v5e:2x2")[0], oversized, *model_shapes(1, 1, 512, 512))


def test_donated_state_is_updated_in_place():
    device = topology_devices("v6e:2x2")[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in model_shapes(32, 1)]
    with jax.default_device(device):
        compiled = jax.jit(gated_delta_rule, donate_argnums=5).lower(*structs).compile()
    state_bytes = 32 * VALUE_HEADS * HEAD_DIM * HEAD_DIM * 4
    assert compiled.memory_analysis().alias_size_in_bytes == state_bytes
    assert compiled.memory_analysis().temp_size_in_bytes < state_bytes / 8
    assert compiled.cost_analysis()["bytes accessed"] < 2.2 * state_bytes  # one read and one write, no copy
