"""The gated delta rule: references vs transformers' torch fallbacks, the Pallas kernels (interpret
mode on CPU) vs the recurrent reference, masking by g = 0 / beta = 0, NaN isolation, the CUDA
lowering and argument checks. On a GPU backend (``JAX_PLATFORMS=cuda``) the kernels run compiled.
"""

from __future__ import annotations

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gated_delta import chunked_gated_delta_rule_reference, gated_delta_rule_reference
from pallas_kernels.gpu.gated_delta import gated_delta_rule

F32_TOL = 1e-5
LOW_TOL = 1e-2  # bf16 q/k/v: relative L2 error of the output
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


@pytest.fixture
def interpret():
    return jax.default_backend() != "gpu"


def _rng(*key) -> np.random.Generator:
    """A fresh, reproducible stream per test case."""
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def make_inputs(rng, *, batch=2, seq_len=5, key_heads=1, value_heads=2, key_dim=16, value_dim=32,
                dtype=jnp.float32):
    """(q, k, v, g, beta, state): raw q/k/v in ``dtype``, f32 log decays in (-2, 0] (a few exactly
    0), f32 beta in [0, 1), a random f32 initial state."""
    q = rng.standard_normal((batch, seq_len, key_heads, key_dim))
    k = rng.standard_normal((batch, seq_len, key_heads, key_dim))
    v = rng.standard_normal((batch, seq_len, value_heads, value_dim))
    g = -rng.uniform(0, 2, (batch, seq_len, value_heads)) * (rng.uniform(size=(batch, seq_len, value_heads)) > 0.1)
    beta = rng.uniform(0, 1, (batch, seq_len, value_heads))
    state = 0.5 * rng.standard_normal((batch, value_heads, key_dim, value_dim))
    return (*(jnp.asarray(x, dtype) for x in (q, k, v)), *(jnp.asarray(x, jnp.float32) for x in (g, beta, state)))


_recurrent_reference = jax.jit(gated_delta_rule_reference, static_argnames=("with_output", "with_state"))
_chunked_reference = jax.jit(chunked_gated_delta_rule_reference,
                             static_argnames=("chunk_size", "with_output", "with_state"))


def _reference(*args, chunk_size=None, **flags):
    """The recurrent reference (or with ``chunk_size``, the chunked one), jitted."""
    if chunk_size is None:
        return _recurrent_reference(*args, **flags)
    return _chunked_reference(*args, chunk_size=chunk_size, **flags)


def assert_close(out, ref, tol=F32_TOL):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape
    assert np.isfinite(out).all(), "output has NaN/inf"
    err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err < tol, f"relative L2 error {err:.3g}"


# --------------------------------------------------------------------------------------------
# References vs transformers.

CHUNK = 16
TORCH_CASES = [(heads, seq_len) for heads in ((2, 2), (1, 3))
               for seq_len in (1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 3)]


@pytest.mark.parametrize("heads,seq_len", TORCH_CASES, ids=lambda c: str(c))
def test_references_match_transformers(heads, seq_len):
    torch = pytest.importorskip("torch")
    qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    key_heads, value_heads = heads
    args = make_inputs(_rng("torch", heads, seq_len), seq_len=seq_len, key_heads=key_heads, value_heads=value_heads)
    q, k, v, g, beta, state = (torch.from_numpy(np.array(x)) for x in args)
    common = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch_recurrent = qwen3_5.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **common)
    torch_chunked = qwen3_5.torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=CHUNK, **common)
    for ours, theirs in ((_reference(*args), torch_recurrent), (_reference(*args, chunk_size=CHUNK), torch_chunked)):
        for x, y in zip(ours, theirs):
            np.testing.assert_allclose(np.asarray(x), y.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,seq_len,chunk_size", [("f32", 1, 16), ("f32", 47, 16), ("f32", 64, 64),
                                                      ("f32", 100, 32), ("bf16", 37, 16)])
def test_chunked_reference_matches_recurrent(dtype, seq_len, chunk_size):
    args = make_inputs(_rng("chunked", dtype, seq_len), seq_len=seq_len, key_heads=2, value_heads=4,
                       dtype=DTYPES[dtype])
    out, state = _reference(*args, chunk_size=chunk_size)
    ref_out, ref_state = _reference(*args)
    assert_close(out, ref_out, F32_TOL if dtype == "f32" else LOW_TOL)
    assert_close(state, ref_state)


# --------------------------------------------------------------------------------------------
# The kernels vs the recurrent reference.

# (dtype, T, (key heads, value heads), (key_dim, value_dim), tuning): decode, verify lengths
# (recurrent kernel), chunk multiples and off-by-one (chunked kernel), and each kernel forced
# outside its default range of T.
KERNEL_CASES = [
    ("f32", 1, (2, 2), (16, 32), {}),
    ("bf16", 1, (1, 3), (32, 16), {}),
    ("f32", 2, (1, 2), (16, 16), {}),
    ("bf16", 5, (2, 4), (16, 32), {}),
    ("f32", 16, (2, 4), (32, 32), {"block_v": 16}),
    ("bf16", 16, (1, 2), (16, 32), {}),
    ("f32", 17, (1, 2), (16, 32), {}),
    ("f32", 32, (2, 2), (32, 16), {"chunk_size": 16}),
    ("bf16", 33, (1, 3), (16, 32), {"chunk_size": 32}),
    ("f32", 64, (2, 4), (16, 32), {"chunk_size": 64}),
    ("bf16", 65, (1, 2), (32, 32), {"chunk_size": 32, "block_v": 16}),
    ("f32", 131, (1, 2), (16, 32), {"chunk_size": 32, "block_v": 16}),
    ("f32", 1, (1, 2), (16, 32), {"max_recurrent_len": 0, "chunk_size": 16}),
    ("bf16", 5, (2, 4), (16, 16), {"max_recurrent_len": 0, "chunk_size": 16}),
    ("f32", 40, (1, 2), (16, 32), {"max_recurrent_len": 64}),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: "-".join(map(str, c)))
def test_kernel_matches_reference(case, interpret):
    dtype, seq_len, (key_heads, value_heads), (key_dim, value_dim), tuning = case
    args = make_inputs(_rng("kernel", case), seq_len=seq_len, key_heads=key_heads, value_heads=value_heads,
                       key_dim=key_dim, value_dim=value_dim, dtype=DTYPES[dtype])
    out, state = gated_delta_rule(*args, interpret=interpret, **tuning)
    ref_out, ref_state = _reference(*args)
    assert out.dtype == args[2].dtype and state.dtype == jnp.float32
    assert_close(out, ref_out, F32_TOL if dtype == "f32" else LOW_TOL)
    assert_close(state, ref_state)


@pytest.mark.parametrize("seq_len", [5, 37])  # recurrent, chunked
@pytest.mark.parametrize("with_output,with_state", [(True, False), (False, True), (False, False)])
def test_kernel_flags(seq_len, with_output, with_state, interpret):
    args = make_inputs(_rng("flags", seq_len), seq_len=seq_len)
    flags = dict(with_output=with_output, with_state=with_state)
    out, state = gated_delta_rule(*args, interpret=interpret, chunk_size=16, **flags)
    ref_out, ref_state = _reference(*args, **flags)
    for x, ref, wanted in ((out, ref_out, with_output), (state, ref_state, with_state)):
        assert (x is None) == (ref is None) == (not wanted)
        if wanted:
            assert_close(x, ref)


# --------------------------------------------------------------------------------------------
# Masking and isolation.

def _mask_tail(args, lens):
    """g = 0 and beta = 0 at positions >= lens[b] of each row (q/k/v there stay random)."""
    q, k, v, g, beta, state = args
    live = (jnp.arange(q.shape[1])[None, :] < jnp.asarray(lens)[:, None])[..., None]
    return q, k, v, jnp.where(live, g, 0), jnp.where(live, beta, 0), state


def _row_prefix(args, row, length):
    """Row ``row`` of the batch, its first ``length`` tokens."""
    *tokens, state = (x[row:row + 1] for x in args)
    return (*(x[:, :length] for x in tokens), state)


MASK_CASES = [(impl, seq_len, lens) for impl in ("kernel", "recurrent") for seq_len, lens in
              ((16, (16, 3, 1)), (40, (40, 17, 9)))] + [("chunked", 40, (40, 17, 9))]


@pytest.mark.parametrize("impl,seq_len,lens", MASK_CASES, ids=lambda c: str(c))
def test_masked_tail_keeps_state(impl, seq_len, lens, interpret):
    """Rows masked past ragged lengths end in the state of their unmasked prefix (the recurrent
    reference's), with the same outputs over the prefix; masked tokens appended to a batch leave
    its state bit for bit, and a fully masked batch keeps its initial state bit for bit."""
    args = make_inputs(_rng("mask", seq_len, lens), batch=len(lens), seq_len=seq_len, key_heads=1, value_heads=2)
    run = {"kernel": functools.partial(gated_delta_rule, interpret=interpret, chunk_size=16),
           "recurrent": _reference, "chunked": functools.partial(_reference, chunk_size=16)}[impl]
    out, state = run(*_mask_tail(args, lens))
    for row, length in enumerate(lens):
        prefix_out, prefix_state = _reference(*_row_prefix(args, row, length))
        assert_close(state[row], prefix_state[0])
        assert_close(out[row, :length], prefix_out[0])
    prefix = lens[1]  # 3 or 17: the same kernel (recurrent or chunked) runs both
    _, appended = run(*_mask_tail(args, [prefix] * len(lens)))
    _, prefix_state = run(*(x[:, :prefix] for x in args[:-1]), args[-1])
    np.testing.assert_array_equal(appended, prefix_state)
    _, kept = run(*_mask_tail(args, [0] * len(lens)))
    np.testing.assert_array_equal(kept, args[-1])


@pytest.mark.parametrize("seq_len", [1, 5, 37])
def test_nan_elsewhere_does_not_leak(seq_len, interpret):
    """NaN in another batch row, and in another key head with its value heads, stays there."""
    args = make_inputs(_rng("nan", seq_len), seq_len=seq_len, key_heads=2, value_heads=4)
    q, k, v, g, beta, state = args
    poisoned = (q.at[1].set(jnp.nan).at[:, :, 1].set(jnp.nan), k.at[1].set(jnp.nan).at[:, :, 1].set(jnp.nan),
                *(x.at[1].set(jnp.nan).at[:, :, 2:].set(jnp.nan) for x in (v, g, beta)),
                state.at[1].set(jnp.nan).at[:, 2:].set(jnp.nan))
    out, new_state = gated_delta_rule(*poisoned, interpret=interpret, chunk_size=16)
    ref_out, ref_state = _reference(*args)
    assert_close(out[0, :, :2], ref_out[0, :, :2])
    assert_close(new_state[0, :2], ref_state[0, :2])


# --------------------------------------------------------------------------------------------
# CUDA lowering (Triton) without a GPU, and argument checks.

S = jax.ShapeDtypeStruct


def _abstract_gpu():
    """Lowering for CUDA without a GPU (as tests/test_kernels.py)."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
    return jax.sharding.use_abstract_mesh(mesh)


def _shapes(*, batch=2, seq_len=16, key_heads=16, value_heads=48, key_dim=128, value_dim=128, dtype=jnp.bfloat16,
            gate_dtype=jnp.float32, state_dtype=jnp.float32):
    """Abstract arguments; by default Qwen3.5-27B's linear attention (16 key / 48 value heads x 128)."""
    return (S((batch, seq_len, key_heads, key_dim), dtype), S((batch, seq_len, key_heads, key_dim), dtype),
            S((batch, seq_len, value_heads, value_dim), dtype), S((batch, seq_len, value_heads), gate_dtype),
            S((batch, seq_len, value_heads), gate_dtype), S((batch, value_heads, key_dim, value_dim), state_dtype))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("seq_len", [1, 16, 200])
@pytest.mark.parametrize("flags", [{}, {"with_output": False}], ids=["out_state", "state_only"])
def test_lowers_for_cuda(dtype, seq_len, flags):
    shapes = _shapes(seq_len=seq_len, dtype=DTYPES[dtype])
    with _abstract_gpu():
        text = jax.jit(functools.partial(gated_delta_rule, **flags)).trace(*shapes).lower(
            lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


BAD_ARGS = [
    ("q and k", _shapes()[:1] + (S((2, 16, 16, 64), jnp.bfloat16),) + _shapes()[2:], {}),
    ("v must be", _shapes()[:2] + (S((2, 15, 48, 128), jnp.bfloat16),) + _shapes()[3:], {}),
    ("multiple of key heads", _shapes(value_heads=40), {}),
    ("key_dim must be a power of two", _shapes(key_dim=96), {}),
    ("value_dim must be a power of two", _shapes(value_dim=8), {}),
    ("g must be", _shapes()[:3] + (S((2, 16, 47), jnp.float32),) + _shapes()[4:], {}),
    ("state must be float32", _shapes(state_dtype=jnp.bfloat16), {}),
    ("state must be", _shapes()[:5] + (S((2, 48, 128, 64), jnp.float32),), {}),
    ("at least one", _shapes(seq_len=0), {}),
    ("g dtype", _shapes(gate_dtype=jnp.int32), {}),
    ("k dtype", _shapes()[:1] + (S((2, 16, 16, 128), jnp.float32),) + _shapes()[2:], {}),
    ("chunk_size", _shapes(seq_len=100), {"chunk_size": 24}),
    ("block_v", _shapes(), {"block_v": 256}),
    ("num_warps", _shapes(), {"num_warps": 3}),
]


@pytest.mark.parametrize("match,shapes,tuning", BAD_ARGS, ids=[b[0] for b in BAD_ARGS])
def test_rejects_bad_args(match, shapes, tuning):
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(functools.partial(gated_delta_rule, **tuning), *shapes)
    if not tuning:
        for reference in (gated_delta_rule_reference, chunked_gated_delta_rule_reference):
            with pytest.raises(ValueError, match=match):
                jax.eval_shape(reference, *shapes)
