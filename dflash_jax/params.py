"""Parameter pytrees. Linear weights are stored ``[in, out]`` (torch's ``[out, in]`` transposed)."""

from __future__ import annotations

import jax
from flax import struct


@struct.dataclass
class LayerParams:
    """One Qwen3 decoder layer. H hidden, Hq/Hkv heads, D head_dim, I MLP width.

    Projections that read the same input are fused column-wise (one weight stream, one kernel
    per decode step instead of three or two): ``qkv_proj`` holds q | k | v and ``gate_up_proj``
    gate | up. HF keeps them as separate tensors; checkpoint.py maps each to its columns.
    """

    input_norm: jax.Array            # [H]
    qkv_proj: jax.Array              # [H, (Hq + 2*Hkv)*D]
    o_proj: jax.Array                # [Hq*D, H]
    q_norm: jax.Array                # [D]
    k_norm: jax.Array                # [D]
    post_attention_norm: jax.Array   # [H]
    gate_up_proj: jax.Array          # [H, 2*I]
    down_proj: jax.Array             # [I, H]

    @property
    def q_size(self) -> int:
        """Hq*D: where k's columns start in ``qkv_proj`` (v's start at q_size + Hkv*D)."""
        return self.o_proj.shape[0]


@struct.dataclass
class TargetParams:
    """Qwen3 causal LM. ``lm_head`` is None when tied to ``embed``."""

    embed: jax.Array                 # [V, H]
    layers: tuple[LayerParams, ...]
    norm: jax.Array                  # [H]
    lm_head: jax.Array | None        # [H, V]


@struct.dataclass
class DraftParams:
    """DFlash draft. Embedding and LM head come from the target, except for speculators drafts
    with a reduced vocabulary, which bring ``lm_head`` [H, V_draft] and ``d2t`` [V_draft]
    (target id = i + d2t[i])."""

    fc: jax.Array                    # [n_taps*H, H]
    hidden_norm: jax.Array           # [H]
    layers: tuple[LayerParams, ...]
    norm: jax.Array                  # [H]
    lm_head: jax.Array | None = None
    d2t: jax.Array | None = None


def cast_params(params, dtype):
    """Cast every floating leaf to ``dtype`` (integer maps such as d2t stay as they are)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x,
                        params)


def init_layer(config, key, dtype, scale: float = 0.02) -> LayerParams:
    """Random layer (normal(0, scale) weights, unit norms): for tests and benchmarks."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    shapes = {"qkv_proj": (h, (config.num_heads + 2 * config.num_kv_heads) * d),
              "o_proj": (config.num_heads * d, h), "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
    keys = jax.random.split(key, len(shapes))
    weights = {name: (scale * jax.random.normal(k, shape, jax.numpy.float32)).astype(dtype)
               for k, (name, shape) in zip(keys, shapes.items())}
    ones = lambda n: jax.numpy.ones((n,), dtype)  # noqa: E731
    return LayerParams(input_norm=ones(h), post_attention_norm=ones(h), q_norm=ones(d), k_norm=ones(d),
                       **weights)


def init_target_params(config, key, dtype) -> TargetParams:
    keys = jax.random.split(key, config.num_layers + 2)
    embed = jax.random.normal(keys[0], (config.vocab_size, config.hidden_size)).astype(dtype) * 0.02
    lm_head = None if config.tie_word_embeddings else (
        jax.random.normal(keys[1], (config.hidden_size, config.vocab_size)) * 0.02).astype(dtype)
    return TargetParams(embed=embed, lm_head=lm_head, norm=jax.numpy.ones((config.hidden_size,), dtype),
                        layers=tuple(init_layer(config, k, dtype) for k in keys[2:]))


def init_draft_params(draft_config, key, dtype) -> DraftParams:
    model = draft_config.model
    keys = jax.random.split(key, model.num_layers + 1)
    taps = len(draft_config.target_layer_ids) * model.hidden_size
    fc = (jax.random.normal(keys[0], (taps, model.hidden_size)) * 0.02).astype(dtype)
    ones = lambda: jax.numpy.ones((model.hidden_size,), dtype)  # noqa: E731 (one buffer each: training donates them)
    lm_head = d2t = None
    if draft_config.draft_vocab_size:  # speculators draft with a reduced vocabulary
        lm_head = (jax.random.normal(keys[0], (model.hidden_size, draft_config.draft_vocab_size)) * 0.02
                   ).astype(dtype)
        d2t = jax.numpy.zeros((draft_config.draft_vocab_size,), jax.numpy.int32)
    return DraftParams(fc=fc, hidden_norm=ones(), norm=ones(), lm_head=lm_head, d2t=d2t,
                       layers=tuple(init_layer(model, k, dtype) for k in keys[1:]))
