"""Parameter pytrees of a target and a draft. Linear weights are stored ``[in, out]`` (torch's
``[out, in]`` transposed); a layer's params are ``nn.decoder.LayerParams``."""

from __future__ import annotations

import jax
from flax import struct

from dflash_jax.model.nn.decoder import LayerParams, init_layer
from dflash_jax.model.selector import SelectorParams, init_selector


@struct.dataclass
class TargetParams:
    """A causal LM of any family. ``lm_head`` is None when tied to ``embed``."""

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
    selector: SelectorParams | None = None   # DFlash2's candidate selector


def cast_params(params, dtype):
    """Cast every floating leaf to ``dtype`` (integer maps such as d2t stay as they are)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jax.numpy.issubdtype(x.dtype, jax.numpy.floating) else x,
                        params)


def init_target_params(config, key, dtype) -> TargetParams:
    """Random target params of ``config`` (a ModelConfig): for tests, benchmarks and training."""
    keys = jax.random.split(key, config.num_layers + 2)
    embed = jax.random.normal(keys[0], (config.vocab_size, config.hidden_size)).astype(dtype) * 0.02
    lm_head = None if config.tie_word_embeddings else (
        jax.random.normal(keys[1], (config.hidden_size, config.vocab_size)) * 0.02).astype(dtype)
    return TargetParams(embed=embed, lm_head=lm_head, norm=jax.numpy.ones((config.hidden_size,), dtype),
                        layers=tuple(init_layer(spec, config.hidden_size, k, dtype)
                                     for spec, k in zip(config.layers, keys[2:])))


def init_draft_params(draft_config, key, dtype) -> DraftParams:
    """Random draft params of ``draft_config`` (a DraftConfig)."""
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
    selector = None if draft_config.selector is None else init_selector(
        draft_config.selector, model.vocab_size, model.hidden_size, jax.random.fold_in(key, 1), dtype)
    return DraftParams(fc=fc, hidden_norm=ones(), norm=ones(), lm_head=lm_head, d2t=d2t, selector=selector,
                       layers=tuple(init_layer(spec, model.hidden_size, k, dtype)
                                    for spec, k in zip(model.layers, keys[1:])))
