"""RMSNorm and rotary embedding: the plain-jnp references and the argument checks the kernels of
both backends share.

Math follows transformers: RMSNorm in f32, cast back, times the weight; RoPE in the rotate-half
layout on the first ``rotary_dim`` dims of a head (the rest pass through), with cos/sin tables
``[batch, T, rotary_dim / 2]`` in the input dtype. The tables come from the caller
(``dflash_jax.model.nn.rope.tables``: default, llama3 or YaRN frequencies), so the references and the
kernels rotate by exactly the same values. A per-head norm weight of None skips the RMSNorm
(families without q/k norms, such as LLaMA).

``norm_rope_write_reference`` stores k's per-head RMSNorm and RoPE, with v unchanged, into the
paged cache; ``qkv_norm_rope_write_reference`` does a target layer's whole attention input from
the fused qkv projection: q normed and rotated out, k and v into their pages;
``qkv_norm_rope_reference`` returns k and v instead (the draft's block, which never enters the
cache).
"""

import jax
import jax.numpy as jnp

from pallas_kernels.paging import write_pages
from pallas_kernels.sizes import is_power_of_2

_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis; statistics in f32, result in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first ``2 * cos.shape[-1]`` dims of x [B, T, heads, head_dim] by the tables
    cos, sin [B, T, rotary_dim / 2] (rotate-half layout); the remaining dims pass through."""
    rotary = 2 * cos.shape[-1]
    cos = jnp.concatenate([cos, cos], axis=-1)[..., None, :].astype(x.dtype)
    sin = jnp.concatenate([sin, sin], axis=-1)[..., None, :].astype(x.dtype)
    x_rot, x_pass = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)


def norm_rope_reference(x: jax.Array, weight: jax.Array | None, cos: jax.Array, sin: jax.Array, *,
                        eps: float) -> jax.Array:
    """Per-head RMSNorm (weight [head_dim]; None: no norm) then RoPE: x [B, T, heads, head_dim]."""
    return apply_rope(x if weight is None else rms_norm(x, weight, eps), cos, sin)


def norm_rope_write_reference(k: jax.Array, v: jax.Array, k_norm_weight: jax.Array | None, cos: jax.Array,
                              sin: jax.Array, positions: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                              page_table: jax.Array, *, eps: float) -> tuple[jax.Array, jax.Array]:
    """Store norm_rope(k) and v [B, T, Hkv, D] at ``positions`` [B, T] into their pages."""
    k = norm_rope_reference(k, k_norm_weight, cos, sin, eps=eps)
    return (write_pages(k_pages, page_table, positions, k),
            write_pages(v_pages, page_table, positions, v))


def split_qkv(qkv: jax.Array, num_heads: int, num_kv_heads: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [..., Hq, D], k and v [..., Hkv, D] from a fused projection [..., (Hq + 2 Hkv) * D]."""
    slots = num_heads + 2 * num_kv_heads
    heads = qkv.reshape(*qkv.shape[:-1], slots, qkv.shape[-1] // slots)
    return (heads[..., :num_heads, :], heads[..., num_heads:num_heads + num_kv_heads, :],
            heads[..., num_heads + num_kv_heads:, :])


def qkv_norm_rope_reference(qkv: jax.Array, q_norm_weight: jax.Array | None, k_norm_weight: jax.Array | None,
                            cos: jax.Array, sin: jax.Array, *, num_heads: int, num_kv_heads: int,
                            eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """qkv [B, T, (Hq + 2 Hkv) * D] with tables cos, sin [B, T, R/2] -> (norm_rope(q) [B, T, Hq, D],
    norm_rope(k) [B, T, Hkv, D], v [B, T, Hkv, D]); norm weights of None skip the norms."""
    q, k, v = split_qkv(qkv, num_heads, num_kv_heads)
    return (norm_rope_reference(q, q_norm_weight, cos, sin, eps=eps),
            norm_rope_reference(k, k_norm_weight, cos, sin, eps=eps), v)


def qkv_norm_rope_write_reference(qkv: jax.Array, q_norm_weight: jax.Array | None,
                                  k_norm_weight: jax.Array | None, cos: jax.Array, sin: jax.Array,
                                  positions: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                                  page_table: jax.Array, *, num_heads: int, num_kv_heads: int,
                                  eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """qkv [B, T, (Hq + 2 Hkv) * D] at ``positions`` [B, T] -> (norm_rope(q) [B, T, Hq, D],
    k_pages, v_pages with norm_rope(k) and v stored)."""
    q, k, v = qkv_norm_rope_reference(qkv, q_norm_weight, k_norm_weight, cos, sin, num_heads=num_heads,
                                      num_kv_heads=num_kv_heads, eps=eps)
    return (q, write_pages(k_pages, page_table, positions, k),
            write_pages(v_pages, page_table, positions, v))


def _check_tables(name: str, shape: tuple, cos: jax.Array, sin: jax.Array) -> int:
    """The chunk width R/2 of rotary tables for ``name`` [B, T, heads, D]; ValueError unless cos
    and sin are [B, T, R/2] with R/2 a power of two dividing D / 2."""
    head_dim = shape[3]
    if cos.ndim != 3 or cos.shape[:2] != tuple(shape[:2]) or sin.shape != cos.shape:
        raise ValueError(f"cos and sin must be [batch, T, rotary_dim / 2] with [batch, T] = {tuple(shape[:2])}, "
                         f"got {cos.shape} and {sin.shape}")
    width = cos.shape[2]
    if not is_power_of_2(width) or (head_dim // 2) % width:
        raise ValueError(f"{name}: rotary tables of {width} frequencies need a power of two dividing "
                         f"head_dim / 2 = {head_dim // 2}")
    return width


def _check_rows(name: str, x, weight: jax.Array | None, weight_name: str) -> None:
    if x.ndim != 4:
        raise ValueError(f"{name} must be [batch, T, heads, head_dim], got shape {x.shape}")
    if 0 in x.shape[:3]:
        raise ValueError(f"{name} must hold at least one row (batch, T and heads >= 1), got shape {x.shape}")
    head_dim = x.shape[3]
    if head_dim < 16 or not is_power_of_2(head_dim):
        raise ValueError(f"{name} head_dim must be a power of two >= 16, got {head_dim}")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name} dtype must be float32, bfloat16 or float16, got {x.dtype}")
    if weight is not None and weight.shape != (head_dim,):
        raise ValueError(f"{weight_name} must be [head_dim={head_dim}], got {weight.shape}")


def check_positions(positions: jax.Array, shape: tuple) -> None:
    if positions.shape != tuple(shape[:2]) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"positions must be an integer [batch, T] = {tuple(shape[:2])} array, got "
                         f"{positions.dtype} {positions.shape}")


def check_pages(k, k_pages: jax.Array, v_pages: jax.Array, page_table: jax.Array) -> None:
    """k (or its shape/dtype) [B, T, Hkv, D] against pages [P, S, Hkv, D] and the page table."""
    batch, _, heads, head_dim = k.shape
    if k_pages.ndim != 4 or k_pages.shape[2:] != (heads, head_dim):
        raise ValueError(f"k_pages must be [num_pages, page_size, {heads}, {head_dim}], got "
                         f"{k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} != k_pages shape {k_pages.shape}")
    if k_pages.dtype != k.dtype or v_pages.dtype != k.dtype:
        raise ValueError(f"k_pages/v_pages dtype {k_pages.dtype}/{v_pages.dtype} must equal k dtype {k.dtype}")
    if page_table.ndim != 2 or page_table.shape[0] != batch or page_table.dtype != jnp.int32:
        raise ValueError(f"page_table must be int32 [batch={batch}, pages_per_seq], got "
                         f"{page_table.dtype} {page_table.shape}")


def check_norm_rope_write_args(k, v, k_norm_weight, cos, sin, positions, k_pages, v_pages, page_table) -> None:
    """ValueError naming the argument of a norm_rope_write call (either backend's) that is wrong."""
    _check_rows("k", k, k_norm_weight, "k_norm_weight")
    check_positions(positions, k.shape)
    _check_tables("k", k.shape, cos, sin)
    if v.shape != k.shape:
        raise ValueError(f"v shape {v.shape} != k shape {k.shape}")
    check_pages(k, k_pages, v_pages, page_table)


def check_qkv(qkv: jax.Array, q_norm_weight, k_norm_weight, cos, sin, num_heads: int,
               num_kv_heads: int) -> tuple[int, int, int, int]:
    """(batch, T, head_dim, rows) of a valid fused projection; ValueError naming what is not."""
    if num_heads < 1 or num_kv_heads < 1:
        raise ValueError(f"num_heads and num_kv_heads must be >= 1, got {num_heads} and {num_kv_heads}")
    slots = num_heads + 2 * num_kv_heads
    if qkv.ndim != 3 or qkv.shape[-1] % slots:
        raise ValueError(f"qkv must be [batch, T, (num_heads + 2 * num_kv_heads) * head_dim] = "
                         f"[.., .., {slots} * head_dim], got {qkv.shape}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight must both be given or both be None")
    batch, q_len, width = qkv.shape
    head_dim = width // slots
    shape = jax.ShapeDtypeStruct((batch, q_len, num_heads, head_dim), qkv.dtype)
    _check_rows("qkv", shape, q_norm_weight, "q_norm_weight")
    _check_tables("qkv", shape.shape, cos, sin)
    if k_norm_weight is not None and k_norm_weight.shape != (head_dim,):
        raise ValueError(f"k_norm_weight must be [head_dim={head_dim}], got {k_norm_weight.shape}")
    return batch, q_len, head_dim, batch * q_len * slots
