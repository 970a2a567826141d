"""The gated delta rule, the token mixer of Qwen3.5 / Qwen3-Next Gated DeltaNet layers: the
plain-jnp references and the argument checks the kernels of both backends share.

Per value head, with the state S [dk, dv] (f32) and, per token, q̂ = l2norm(q)·dk^-½, k̂ = l2norm(k)
(in f32, ``x * rsqrt(sum(x*x) + 1e-6)``, as transformers' ``use_qk_l2norm_in_kernel=True``):
S ← e^g·S; δ = β(v − Sᵀk̂); S ← S + k̂⊗δ; o = Sᵀq̂. Value head j reads key head j // (Hv / Hk)
(torch's ``repeat_interleave``). A token with g = 0 and β = 0 leaves S exactly unchanged: callers
mask padding and rejected draft tokens that way.

Two references: ``gated_delta_rule_reference`` walks the tokens (``lax.scan``);
``chunked_gated_delta_rule_reference`` is transformers' chunked (UT / WY) form, one lower
triangular solve per chunk of ``chunk_size`` tokens and a scan over the chunks. The kernels live in
``pallas_kernels.gpu.gated_delta`` and ``pallas_kernels.tpu.gated_delta``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.sizes import is_power_of_2

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
L2_EPS = 1e-6


def check_gated_delta_args(q, k, v, g, beta, state) -> None:
    """ValueError naming the argument for shapes and dtypes the functions do not take."""
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [batch, T, key_heads, key_dim], got {q.shape} and {k.shape}")
    batch, seq_len, key_heads, key_dim = q.shape
    if v.ndim != 4 or v.shape[:2] != (batch, seq_len):
        raise ValueError(f"v must be [batch={batch}, T={seq_len}, value_heads, value_dim], got {v.shape}")
    value_heads, value_dim = v.shape[2:]
    if batch < 1 or seq_len < 1:
        raise ValueError(f"q must hold at least one sequence and one token, got batch={batch}, T={seq_len}")
    if key_heads < 1 or value_heads % key_heads:
        raise ValueError(f"value heads ({value_heads}) must be a multiple of key heads ({key_heads})")
    for name, size in (("key_dim", key_dim), ("value_dim", value_dim)):
        if not is_power_of_2(size) or size < 16:
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (batch, seq_len, value_heads):
            raise ValueError(f"{name} must be [batch={batch}, T={seq_len}, value_heads={value_heads}], got {x.shape}")
    if state.shape != (batch, value_heads, key_dim, value_dim) or state.dtype != jnp.float32:
        raise ValueError(f"state must be float32 [batch={batch}, value_heads={value_heads}, key_dim={key_dim}, "
                         f"value_dim={value_dim}], got {state.dtype} {state.shape}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if k.dtype != q.dtype:
        raise ValueError(f"k dtype {k.dtype} must equal q dtype {q.dtype}")


def l2_normalize(x: jax.Array) -> jax.Array:
    """x * rsqrt(sum(x*x) + 1e-6) over the last axis, in f32 (as transformers' l2norm)."""
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _per_value_head(q, k, value_heads: int) -> tuple[jax.Array, jax.Array]:
    """q̂ (scaled by key_dim^-½) and k̂ [B, T, Hv, dk] f32, each key head repeated for its value heads."""
    group = value_heads // q.shape[2]
    q_hat = l2_normalize(q) * q.shape[-1] ** -0.5
    return jnp.repeat(q_hat, group, axis=2), jnp.repeat(l2_normalize(k), group, axis=2)


def gated_delta_rule_reference(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                               state: jax.Array, *, with_output: bool = True,
                               with_state: bool = True) -> tuple[jax.Array | None, jax.Array | None]:
    """The rule token by token (``lax.scan``), all in f32.

    q, k [B, T, Hk, dk] (raw: normalised here); v [B, T, Hv, dv]; g (log decay, <= 0), beta
    [B, T, Hv] (f32; bf16 / f16 are taken as f32); state [B, Hv, dk, dv] f32. Returns (out
    [B, T, Hv, dv] in v's dtype or None, new state [B, Hv, dk, dv] f32 or None), per
    ``with_output`` / ``with_state``.
    """
    check_gated_delta_args(q, k, v, g, beta, state)
    q_hat, k_hat = _per_value_head(q, k, v.shape[2])

    def step(s, token):
        q_t, k_t, v_t, g_t, beta_t = token  # [B, Hv, d...]
        s = s * jnp.exp(g_t)[..., None, None]
        delta = beta_t[..., None] * (v_t - jnp.sum(s * k_t[..., :, None], axis=-2))
        s = s + k_t[..., :, None] * delta[..., None, :]
        return s, (jnp.sum(s * q_t[..., :, None], axis=-2) if with_output else None)

    tokens = [jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q_hat, k_hat, v, g, beta)]
    new_state, out = lax.scan(step, state, tokens)
    out = jnp.moveaxis(out, 0, 1).astype(v.dtype) if with_output else None
    return out, (new_state if with_state else None)


def _forward_substitution_inverse(strict: jax.Array, einsum) -> jax.Array:
    """(I + L)⁻¹ for L [..., C, C] strictly lower triangular, row by row (forward substitution:
    row i = e_i − Σ_{j<i} L_ij row j), in plain jnp: XLA:CPU's LAPACK triangular solve, called
    in a process that has loaded torch, was seen to deadlock."""
    size = strict.shape[-1]
    identity = jnp.eye(size, dtype=strict.dtype)

    def row(i, inverse):
        return inverse.at[..., i, :].set(identity[i] - einsum("...j,...jk->...k", strict[..., i, :], inverse))

    return lax.fori_loop(0, size, row, jnp.zeros_like(strict))


def chunked_gated_delta_rule_reference(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                                       state: jax.Array, *, chunk_size: int = 64, with_output: bool = True,
                                       with_state: bool = True) -> tuple[jax.Array | None, jax.Array | None]:
    """``gated_delta_rule_reference`` in transformers' chunked form (same arguments and result).

    T is padded with g = 0, β = 0 tokens to whole chunks. Per chunk, with cum the running sum of
    g and L = (βk̂ k̂ᵀ · e^(cum_i − cum_j)) strictly below the diagonal: u = (I + L)⁻¹ βv and
    w = (I + L)⁻¹ (βk̂ e^cum) (the inverse by forward substitution); then over the chunks, v_new = u − w S,
    o = (q̂ e^cum) S + (q̂ k̂ᵀ · e^(cum_i − cum_j), j <= i) v_new,
    S ← e^cum_last S + (k̂ e^(cum_last − cum))ᵀ v_new.
    """
    check_gated_delta_args(q, k, v, g, beta, state)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, seq_len, value_heads, _ = v.shape
    q_hat, k_hat = _per_value_head(q, k, value_heads)
    pad = -seq_len % chunk_size

    def chunked(x):  # [B, T, Hv, ...] -> [N, B, Hv, C, ...], padded with zeros
        x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(batch, -1, chunk_size, *x.shape[2:])
        return jnp.moveaxis(jnp.moveaxis(x, 3, 2), 1, 0)

    q_c, k_c, v_c, g_c, beta_c = map(chunked, (q_hat, k_hat, v, g, beta))
    einsum = functools.partial(jnp.einsum, precision=lax.Precision.HIGHEST)
    cum = jnp.cumsum(g_c, axis=-1)
    rows = jnp.arange(chunk_size)
    lower = rows[:, None] >= rows[None, :]
    decay = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))
    k_beta = k_c * beta_c[..., None]
    strict = jnp.where(rows[:, None] > rows[None, :], einsum("...ik,...jk->...ij", k_beta, k_c) * decay, 0)
    inverse = _forward_substitution_inverse(strict, einsum)   # (I + L)^-1
    u = einsum("...ij,...jd->...id", inverse, v_c * beta_c[..., None])
    w = einsum("...ij,...jd->...id", inverse, k_beta * jnp.exp(cum)[..., None])
    attention = einsum("...ik,...jk->...ij", q_c, k_c) * decay
    q_decayed = q_c * jnp.exp(cum)[..., None]
    k_decayed = k_c * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]

    def step(s, chunk):
        u_i, w_i, attention_i, q_i, k_i, decay_i = chunk
        v_new = u_i - einsum("bhck,bhkv->bhcv", w_i, s)
        out = (einsum("bhck,bhkv->bhcv", q_i, s) + einsum("bhcj,bhjv->bhcv", attention_i, v_new)
               if with_output else None)
        return s * decay_i + einsum("bhck,bhcv->bhkv", k_i, v_new), out

    new_state, out = lax.scan(step, state, (u, w, attention, q_decayed, k_decayed, chunk_decay))
    if with_output:  # [N, B, Hv, C, dv] -> [B, T, Hv, dv]
        out = jnp.moveaxis(out, 0, 1).swapaxes(2, 3).reshape(batch, -1, value_heads, v.shape[-1])
        out = out[:, :seq_len].astype(v.dtype)
    return out, (new_state if with_state else None)
