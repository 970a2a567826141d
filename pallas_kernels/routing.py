"""A MoE layer's routing: the layer's RMSNorm, the router's logits, softmax, top k and their weights.

``route_reference`` is what the model runs through XLA, as transformers' routers compute it: the
normalised rows h, logits h @ router (+ bias) in h's dtype, softmax in f32, the top k experts,
their probabilities renormalised to sum 1 when asked (gpt-oss's softmax over its top k logits is
the same numbers). The GPU kernel (``pallas_kernels.gpu.routing``) does all of it in one launch
or two.

Benchmarks of random weights may draw each row's experts independently of every other row's
(``skew``, ``independent_experts``): a random router routes the tokens of a verify block far more
alike than a trained one, so it reads fewer experts than a real model. The draw is Gumbel-top-k
with noise hashed from the bits of the row h: equal rows get equal experts.
"""

import jax
import jax.numpy as jnp

from pallas_kernels.norm_rope import rms_norm

GOLDEN = 0x9E3779B1          # the multiplier that spreads each element's bits before they are summed
POSITION_SALT = 0x632BE5AB   # salts each element's position
EXPERT_MULTIPLIER = 0x85EBCA77
EXPERT_SALT = 0x27D4EB2F


def mix32(x: jax.Array) -> jax.Array:
    """murmur3's 32-bit finaliser: a bijection of uint32 in which every input bit moves every output bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def element_bits(h: jax.Array) -> jax.Array:
    """The bits of each element of h (a float of 2 or 4 bytes) as uint32."""
    if h.dtype.itemsize not in (2, 4):
        raise ValueError(f"hashed routing reads rows of 2- or 4-byte floats, got {h.dtype}")
    bits = jax.lax.bitcast_convert_type(h, jnp.uint16 if h.dtype.itemsize == 2 else jnp.uint32)
    return bits.astype(jnp.uint32)


def hash_terms(bits: jax.Array, position: jax.Array) -> jax.Array:
    """Each element's term of its row's hash: a bijection of its bits salted by its position."""
    return mix32(bits * jnp.uint32(GOLDEN) + mix32(position + jnp.uint32(POSITION_SALT)))


def row_hashes(h: jax.Array) -> jax.Array:
    """A uint32 hash [N] of each row's bits of h [N, H]: equal rows hash equal; rows that differ in
    one element always differ, in several collide with probability about 2^-32."""
    position = jnp.arange(h.shape[1], dtype=jnp.uint32)
    return mix32(jnp.sum(hash_terms(element_bits(h), position), axis=1, dtype=jnp.uint32))


def gumbel_scores(hashes: jax.Array, expert: jax.Array, log_popularity: jax.Array) -> jax.Array:
    """Gumbel noise hashed from each row's hash [N, 1] and expert ids [1, E] (uint32), plus the
    experts' log popularity [1, E] f32: the scores whose top k is a draw without replacement."""
    keys = mix32(mix32(hashes + expert * jnp.uint32(EXPERT_MULTIPLIER)) ^ jnp.uint32(EXPERT_SALT))
    uniform = ((keys >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -jnp.log(-jnp.log(uniform)) + log_popularity


def log_popularity(num_experts: int, skew: float) -> jax.Array:
    """log p_e for p_e = 1 / (e + 1)^skew (unnormalised), f32 [E]."""
    return -skew * jnp.log1p(jnp.arange(num_experts, dtype=jnp.float32))


def independent_experts(h: jax.Array, num_experts: int, top_k: int, skew: float) -> jax.Array:
    """Experts [N, k] int32 of rows h [N, H] drawn apart from every other row's: the top k of
    log p_e + g (``log_popularity``, g standard Gumbel noise hashed from the row's bits and e):
    k draws without replacement, each in proportion to p among the experts not yet drawn."""
    expert = jnp.arange(num_experts, dtype=jnp.uint32)[None, :]
    scores = gumbel_scores(row_hashes(h)[:, None], expert, log_popularity(num_experts, skew)[None, :])
    return jax.lax.top_k(scores, top_k)[1].astype(jnp.int32)


def route_reference(x: jax.Array, norm_weight: jax.Array, router: jax.Array, router_bias: jax.Array | None = None,
                    *, top_k: int, norm_topk_prob: bool, eps: float,
                    skew: float | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(h [N, H], experts [N, k] int32, weights [N, k] in x's dtype) of rows x [N, H]: h =
    rms_norm(x, norm_weight), logits h @ router [H, E] (+ router_bias [E]) in x's dtype, softmax
    in f32, and the top k experts with their probabilities, renormalised to sum 1 when
    ``norm_topk_prob``. With ``skew`` the experts are ``independent_experts`` instead, the weights
    still the softmax at them."""
    check_route_args(x, norm_weight, router, router_bias, top_k)
    h = rms_norm(x, norm_weight, eps)
    logits = h @ router
    if router_bias is not None:
        logits = logits + router_bias
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if skew is None:
        weights, experts = jax.lax.top_k(probs, top_k)
    else:
        experts = independent_experts(h, router.shape[1], top_k, skew)
        weights = jnp.take_along_axis(probs, experts, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return h, experts.astype(jnp.int32), weights.astype(x.dtype)


def check_route_args(x, norm_weight, router, router_bias, top_k: int) -> None:
    if x.ndim != 2 or router.ndim != 2 or router.shape[0] != x.shape[1]:
        raise ValueError(f"x must be [N, H] and router [H, E]; got {x.shape} and {router.shape}")
    if norm_weight.shape != (x.shape[1],):
        raise ValueError(f"norm_weight must be [H] = [{x.shape[1]}], got {norm_weight.shape}")
    if router_bias is not None and router_bias.shape != (router.shape[1],):
        raise ValueError(f"router_bias must be [E] = [{router.shape[1]}], got {router_bias.shape}")
    if not 1 <= top_k <= router.shape[1]:
        raise ValueError(f"top_k must be in [1, E = {router.shape[1]}], got {top_k}")
