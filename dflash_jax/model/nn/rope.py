"""Rotary position embedding: one spec for every family (default, llama3 and YaRN scaling,
partial rotary), and the cos/sin tables that the reference path and the Pallas kernels share.

Frequencies follow transformers' ``modeling_rope_utils`` in float32, computed on the host (an f32
``pow`` gives other last bits eagerly and under jit, where XLA folds the constant). A table holds
``rotary_dim / 2`` frequencies per token; the rotate-half layout repeats them over both halves
of the first ``rotary_dim`` dims of a head, and the dims past it pass through unrotated.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.model.hf_json import ConfigError, field

ROPE_TYPES = ("default", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """How a head's first ``rotary_dim`` dims rotate with the token's position.

    ``kind`` "llama3" rescales the frequencies by wavelength (``factor``, ``low_freq_factor``,
    ``high_freq_factor``, ``original_max_position_embeddings``); "yarn" blends interpolated and
    extrapolated frequencies between the ``beta_fast``/``beta_slow`` correction dims and scales
    cos/sin by ``attention_factor``.
    """

    theta: float
    rotary_dim: int
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float = 1.0
    truncate: bool = True

    def __post_init__(self):
        if self.kind not in ROPE_TYPES:
            raise ConfigError(f"rope_type '{self.kind}' is not supported (supported: {', '.join(ROPE_TYPES)})")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ConfigError(f"the rotary dimension must be even and >= 2, got {self.rotary_dim}")

    def inv_freq(self) -> np.ndarray:
        """The ``rotary_dim / 2`` inverse frequencies, float32, as transformers computes them."""
        base = _default_inv_freq(self.rotary_dim, self.theta)
        if self.kind == "llama3":
            return _llama3(base, self)
        if self.kind == "yarn":
            return _yarn(self)
        return base


def _default_inv_freq(dim: int, theta: float) -> np.ndarray:
    """1 / theta ** (2i / dim) in f32 as transformers computes it: the power rounded to f32, then
    its reciprocal (one rounding instead of two put 24 of Qwen3-8B's 64 frequencies 1 ulp off HF's;
    now at most one differs, where torch's f32 ``pow`` is not correctly rounded)."""
    power = np.float32(theta ** (np.arange(0, dim, 2) / dim))
    return np.float32(1.0 / power.astype(np.float64))


def _llama3(inv_freq: np.ndarray, spec: RopeSpec) -> np.ndarray:
    """transformers' ``_compute_llama3_parameters``: long wavelengths divided by ``factor``, short
    ones kept, a smooth blend between (every step in f32, as torch does it)."""
    f32 = np.float32
    old = spec.original_max_position_embeddings
    low_wavelen, high_wavelen = old / spec.low_freq_factor, old / spec.high_freq_factor
    wavelen = f32(2 * math.pi) / inv_freq
    scaled = np.where(wavelen > f32(low_wavelen), inv_freq / f32(spec.factor), inv_freq)
    smooth = (f32(old) / wavelen - f32(spec.low_freq_factor)) / f32(spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (f32(1) - smooth) * scaled / f32(spec.factor) + smooth * scaled
    medium = ~(wavelen < f32(high_wavelen)) & ~(wavelen > f32(low_wavelen))
    return np.where(medium, smoothed, scaled).astype(f32)


def _yarn(spec: RopeSpec) -> np.ndarray:
    """transformers' ``_compute_yarn_parameters``: interpolated frequencies (/ factor) for the
    low dims, extrapolated ones for the high dims, a linear ramp between the correction dims."""
    f32, dim, base = np.float32, spec.rotary_dim, spec.theta

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(spec.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    pos_freqs = np.float32(base ** (np.arange(0, dim, 2) / dim))
    extrapolation = f32(1) / pos_freqs
    interpolation = f32(1) / (f32(spec.factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1).astype(f32)
    extrapolation_factor = f32(1) - ramp
    return (interpolation * (f32(1) - extrapolation_factor) + extrapolation * extrapolation_factor).astype(f32)


def tables(positions: jax.Array, spec: RopeSpec, dtype) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., rotary_dim / 2] at integer positions [...]: f32 angles, times YaRN's
    attention factor, rounded to ``dtype`` (as transformers casts them to the activations')."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(spec.inv_freq())
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    if spec.attention_factor != 1.0:
        cos, sin = cos * spec.attention_factor, sin * spec.attention_factor
    return cos.astype(dtype), sin.astype(dtype)


# ---------------------------------------------------------------------------------------------
# config.json


def _yarn_attention_factor(params: dict, factor: float, where: str) -> float:
    """YaRN's cos/sin scale: given, or 0.1 ln(factor) + 1 (with DeepSeek's mscale ratio)."""
    given = field(params, "attention_factor", where, float, None)
    if given is not None:
        return given

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = field(params, "mscale", where, float, None), field(params, "mscale_all_dim", where, float, None)
    return float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)


def rope_from_hf(raw: dict, rotary_dim: int, max_position_embeddings: int, where: str) -> RopeSpec:
    """The RoPE of a config.json: ``rope_parameters`` (transformers 5) or ``rope_scaling`` (older),
    with ``rope_theta`` there or at the top level. The base is required: a wrong one would go
    unnoticed. A type other than ``ROPE_TYPES`` is a ConfigError naming it."""
    params = field(raw, "rope_parameters", where, dict, None)
    scaling = field(raw, "rope_scaling", where, dict, None)
    if params and scaling and scaling != params:
        # transformers 5 lets rope_scaling replace rope_parameters (Qwen3's long-context recipe
        # adds a YaRN rope_scaling to such configs): refuse rather than pick a different RoPE
        raise ConfigError(f"{where}: rope_parameters {params} and rope_scaling {scaling} disagree "
                          "(transformers would use rope_scaling): keep one of them")
    params = params or scaling or {}
    inner = f"{where} {'rope_parameters' if raw.get('rope_parameters') else 'rope_scaling'}"
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{where}: rope_type '{kind}' is not supported (supported: {', '.join(ROPE_TYPES)})")
    if params.get("rope_theta") is not None:
        theta = field(params, "rope_theta", inner, float)
    elif raw.get("rope_theta") is None:
        raise ConfigError(f"{where}: required field 'rope_theta' (or rope_parameters.rope_theta) is missing")
    else:
        theta = field(raw, "rope_theta", where, float)
    if kind == "default":
        return RopeSpec(theta=theta, rotary_dim=rotary_dim)
    # transformers: a top-level original_max_position_embeddings (Phi-3's) wins, else the rope
    # dict's, else max_position_embeddings
    original = field(raw, "original_max_position_embeddings", where, int, None) or field(
        params, "original_max_position_embeddings", inner, int, max_position_embeddings)
    if kind == "llama3":
        return RopeSpec(theta=theta, rotary_dim=rotary_dim, kind=kind,
                        factor=field(params, "factor", inner, float),
                        low_freq_factor=field(params, "low_freq_factor", inner, float),
                        high_freq_factor=field(params, "high_freq_factor", inner, float),
                        original_max_position_embeddings=original)
    factor = field(params, "factor", inner, float, None) or max_position_embeddings / original
    return RopeSpec(theta=theta, rotary_dim=rotary_dim, kind=kind, factor=factor,
                    original_max_position_embeddings=original,
                    beta_fast=field(params, "beta_fast", inner, float, None) or 32.0,
                    beta_slow=field(params, "beta_slow", inner, float, None) or 1.0,
                    attention_factor=_yarn_attention_factor(params, factor, inner),
                    truncate=field(params, "truncate", inner, bool, True))


def rope_to_hf(spec: RopeSpec, head_dim: int) -> dict:
    """``rope_parameters`` for a config.json of heads of ``head_dim`` dims (the inverse of
    ``rope_from_hf``)."""
    out = {"rope_type": spec.kind, "rope_theta": spec.theta}
    if spec.rotary_dim != head_dim:
        out["partial_rotary_factor"] = spec.rotary_dim / head_dim
    if spec.kind == "llama3":
        out.update(factor=spec.factor, low_freq_factor=spec.low_freq_factor, high_freq_factor=spec.high_freq_factor,
                   original_max_position_embeddings=spec.original_max_position_embeddings)
    elif spec.kind == "yarn":
        out.update(factor=spec.factor, original_max_position_embeddings=spec.original_max_position_embeddings,
                   beta_fast=spec.beta_fast, beta_slow=spec.beta_slow, attention_factor=spec.attention_factor,
                   truncate=spec.truncate)
    return out
