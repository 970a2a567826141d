"""The merge of a split context: per-split attention rows combined by their log-sum-exp.

When the attention kernels split a sequence's context over ``S`` programs (to fill the GPU at
small batch), split ``s`` writes its normalized rows ``o[s]`` and their log2-sum-exp ``lse[s]``
(``-inf`` where it saw no key). The full rows are

    sum_s 2^(lse[s] - top) * o[s] / sum_s 2^(lse[s] - top),   top = max_s lse[s],

and rows that no split saw come out as zeros. The GPU kernel is ``pallas_kernels.gpu.split_merge``.
"""

import jax
import jax.numpy as jnp


def combine_splits_reference(o: jax.Array, lse: jax.Array, sink: jax.Array | None = None) -> jax.Array:
    """o [S, ..., D] (normalized rows of each split), lse [S, ...] f32 log2-sum-exp -> [..., D].
    ``sink`` (broadcast against lse[0]; log2 units): one more term of the normaliser that adds
    nothing to the rows (gpt-oss's attention sinks)."""
    top = jnp.max(lse, axis=0)
    if sink is not None:
        top = jnp.maximum(top, sink)
    weights = jnp.exp2(lse - jnp.where(jnp.isfinite(top), top, 0.0))
    denom = jnp.sum(weights, axis=0)
    if sink is not None:
        denom = denom + jnp.exp2(sink - jnp.where(jnp.isfinite(top), top, 0.0))
    out = jnp.sum(weights[..., None] * o.astype(jnp.float32), axis=0)
    return (out / jnp.where(denom > 0, denom, 1.0)[..., None]).astype(o.dtype)
