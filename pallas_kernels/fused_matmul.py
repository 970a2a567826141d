"""A decoder layer's projection with its glue: [RMSNorm] -> x @ w [+ bias] -> [SwiGLU] -> [+ residual].

``fused_matmul_reference`` is the plain-jnp form the model runs through XLA; the GPU kernel
(``pallas_kernels.gpu.fused_matmul``) does the same in one launch and ``finish_projection``
finishes its split-K sums.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.norm_rope import rms_norm


def finish_projection(y: jax.Array, residual: jax.Array | None, gated: bool, dtype) -> jax.Array:
    """The product y [M, N or 2N] through the gate and residual (in y's dtype), then ``dtype``."""
    if gated:
        gate, up = jnp.split(y, 2, axis=-1)
        y = jax.nn.silu(gate) * up
    if residual is not None:
        y = y + residual.astype(y.dtype)
    return y.astype(dtype)


def fused_matmul_reference(x: jax.Array, w: jax.Array, *, norm_weight: jax.Array | None = None,
                           eps: float = 1e-6, bias: jax.Array | None = None, gated: bool = False,
                           residual: jax.Array | None = None) -> jax.Array:
    """[rms_norm(x, norm_weight)] @ w [+ bias] [-> silu(gate) * up] [+ residual], x [..., K], w
    [K, N or 2N], bias [N or 2N] -> [..., N] in x's dtype. Written as the model always ran it
    through XLA: the product (with its bias, added before the rounding, as torch's Linear does)
    rounded to x's dtype, gate and residual in x's dtype (the kernel keeps them in f32 and
    rounds once, which is within the usual bf16 tolerance of this)."""
    h = x if norm_weight is None else rms_norm(x, norm_weight, eps)
    if bias is None:
        y = jnp.einsum("...k,kn->...n", h, w)
    else:
        y = (jnp.einsum("...k,kn->...n", h, w, preferred_element_type=jnp.float32)
             + bias.astype(jnp.float32)).astype(x.dtype)
    return finish_projection(y, residual, gated, x.dtype)
