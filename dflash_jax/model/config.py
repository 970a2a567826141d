"""Frozen model configurations: the decoder that every target family and the draft's layers are
built from (a spec per layer), and the DFlash draft. ``dflash_jax.model.hf_config`` reads them from
``config.json`` (a target's by its family, a draft's layers as Qwen3 layers)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

from dflash_jax.model.hf_json import ConfigError, int_list, read_config_json, read_json
from dflash_jax.model.nn.attention import AttentionSpec
from dflash_jax.model.nn.decoder import LayerSpec
from dflash_jax.model.nn.gated_deltanet import GatedDeltaNetSpec
from dflash_jax.model.nn.mlp import MLPSpec
from dflash_jax.model.nn.moe import MoESpec
from dflash_jax.model.nn.rope import RopeSpec
from dflash_jax.model.selector import SelectorSpec

__all__ = ["ConfigError", "LayerSpec", "ModelConfig", "DraftConfig", "build_target_layer_ids", "read_json",
           "read_config_json", "int_list"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder stack: the target of any family, or the draft's layers. ``family`` names the
    ``dflash_jax.model.families`` entry that reads and writes its config.json and tensors.

    The per-layer specs are the truth; the properties below give the values every layer shares
    (a ConfigError when layers differ), for the code and the users that think in those terms.
    ``zero_centred_norms``: the decoder's RMSNorm weights w (layer norms, q/k norms, final norm)
    scale by 1 + w, as stored in the checkpoint (Qwen3.5 / Qwen3-Next).
    ``tensor_axis``: the mesh axis over which this config is one shard's part of a split model
    (``dflash_jax.model.sharding.local_config``): row-parallel results are summed over it. None on one
    device.
    """

    family: str
    vocab_size: int
    hidden_size: int
    layers: tuple[LayerSpec, ...]
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    eos_token_ids: tuple[int, ...] = ()
    zero_centred_norms: bool = False
    tensor_axis: str | None = None

    def __post_init__(self):
        if not self.layers:
            raise ConfigError("a decoder needs at least one layer (num_hidden_layers >= 1)")
        if min(self.vocab_size, self.hidden_size) < 1:
            raise ConfigError(f"vocab_size and hidden_size must be >= 1, got {self.vocab_size} and {self.hidden_size}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def _shared(self, what: str, values) -> Any:
        distinct = set(values)
        if not distinct:
            raise ConfigError(f"no layer has {what}")
        if len(distinct) != 1:
            raise ConfigError(f"{what} differs between layers ({sorted(distinct, key=str)}): read it per layer")
        return distinct.pop()

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the softmax-attention layers (the ones that keep K/V pages)."""
        return tuple(i for i, layer in enumerate(self.layers) if isinstance(layer.mixer, AttentionSpec))

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """Indices of the Gated DeltaNet layers (the ones that keep recurrent state)."""
        return tuple(i for i, layer in enumerate(self.layers) if isinstance(layer.mixer, GatedDeltaNetSpec))

    @property
    def attention(self) -> AttentionSpec:
        """The attention every attention layer shares, less its window (``window(i)`` gives that)."""
        return self._shared("the attention spec", (dataclasses.replace(self.layers[i].mixer, sliding_window=None)
                                                   for i in self.attention_layers))

    @property
    def num_heads(self) -> int:
        return self.attention.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.attention.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.attention.head_dim

    @property
    def rope(self) -> RopeSpec:
        return self.attention.rope

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def intermediate_size(self) -> int:
        """The width of the dense MLP layers (ConfigError when there are none)."""
        return self._shared("a dense MLP", (layer.ffn.intermediate_size for layer in self.layers
                                            if isinstance(layer.ffn, MLPSpec)))

    @property
    def layer_types(self) -> tuple[str, ...]:
        """HF ``layer_types``: "sliding_attention" or "full_attention" per layer."""
        return tuple(layer.kind for layer in self.layers)

    @property
    def sliding_window(self) -> int | None:
        """The window of the sliding layers (None when no layer slides)."""
        windows = {self.layers[i].mixer.sliding_window for i in self.attention_layers} - {None}
        return self._shared("sliding_window", windows) if windows else None

    def window(self, layer: int) -> int | None:
        """Sliding window of a layer, None for full (or linear) attention."""
        return getattr(self.layers[layer].mixer, "sliding_window", None)

    def with_layers(self, specs: tuple[LayerSpec, ...]) -> "ModelConfig":
        return dataclasses.replace(self, layers=tuple(specs))

    @property
    def mxfp4_experts(self) -> bool:
        """Whether the routed experts are held in MXFP4 (``MoESpec.mxfp4``)."""
        return any(getattr(layer.ffn, "mxfp4", False) for layer in self.layers)

    def with_dequantized_experts(self) -> "ModelConfig":
        """This config with MXFP4 experts held in the params' dtype instead (dequantised as read)."""
        return self.with_layers(dataclasses.replace(layer, ffn=dataclasses.replace(layer.ffn, mxfp4=False))
                                if getattr(layer.ffn, "mxfp4", False) else layer for layer in self.layers)

def uniform_config(*, family: str = "qwen3", vocab_size: int, hidden_size: int, intermediate_size: int | None = None,
                   num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                   rope_theta: float = 1_000_000.0, rope: RopeSpec | None = None, qk_norm: bool = True,
                   layer_types: tuple[str, ...] = (), sliding_window: int | None = None,
                   ffn: MLPSpec | MoESpec | Callable[[int], MLPSpec | MoESpec] | None = None,
                   output_gate: bool = False, linear_attention: GatedDeltaNetSpec | None = None,
                   **fields) -> ModelConfig:
    """A decoder whose layers all share one attention and one feed-forward spec (a dense SwiGLU of
    ``intermediate_size`` unless ``ffn`` says otherwise, or ``ffn(i)`` per layer), sliding where
    ``layer_types`` says so, Gated DeltaNet (``linear_attention``) on "linear_attention" layers:
    how tests, benchmarks and training build configs."""
    rope = rope or RopeSpec(theta=rope_theta, rotary_dim=head_dim)
    attention = AttentionSpec(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, rope=rope,
                              qk_norm=qk_norm, output_gate=output_gate)
    layer_types = layer_types or ("full_attention",) * num_layers
    if len(layer_types) != num_layers:
        raise ConfigError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    if ffn is None and intermediate_size is None:
        raise ConfigError("uniform_config needs intermediate_size (a dense MLP's width) or ffn")
    ffn = ffn or MLPSpec(intermediate_size)
    if "linear_attention" in layer_types and linear_attention is None:
        raise ConfigError("layer_types has linear_attention layers: pass their linear_attention spec")

    def mixer(kind: str):
        if kind == "linear_attention":
            return linear_attention
        return dataclasses.replace(attention, sliding_window=sliding_window if kind == "sliding_attention" else None)

    layers = tuple(LayerSpec(mixer(kind), ffn(i) if callable(ffn) else ffn, kind) for i, kind in enumerate(layer_types))
    return ModelConfig(family=family, vocab_size=vocab_size, hidden_size=hidden_size, layers=layers, **fields)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """Default target taps of a draft: spread over layers 1..L-3 (z-lab's rule)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    span = num_target_layers - 4
    return tuple(round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True)
class DraftConfig:
    """A DFlash draft: its Qwen3 layer stack plus how it reads the target.

    ``target_layer_ids`` are z-lab ids: the output of target decoder layer k (HF hidden_states[k+1]).
    ``draft_vocab_size`` is set only for speculators drafts with a reduced vocabulary (d2t map).
    ``causal_layers`` reproduces the reference: sliding-window draft layers are causal unless
    the config says ``is_causal``. ``selector``: a DFlash2 draft's candidate selector (its layers
    then carry ``LayerSpec.conv``).
    """

    model: ModelConfig
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    draft_vocab_size: int | None = None
    causal_layers: tuple[bool, ...] = ()
    source_format: str = "z-lab"
    selector: SelectorSpec | None = None

    def __post_init__(self):
        if not self.causal_layers:
            object.__setattr__(self, "causal_layers", (False,) * self.model.num_layers)
        if len(self.causal_layers) != self.model.num_layers:
            raise ConfigError(f"causal_layers has {len(self.causal_layers)} entries for "
                              f"{self.model.num_layers} draft layers")
        if self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2, got {self.block_size}")
        if (self.selector is None) != all(layer.conv is None for layer in self.model.layers):
            raise ConfigError("a DFlash2 draft has both its candidate selector and its layers' convolutions")
        if any(layer.mixer.sinks for layer in self.model.layers if isinstance(layer.mixer, AttentionSpec)):
            raise ConfigError("draft layers have no attention sinks (z-lab's layers are Qwen3's)")

    def check_target(self, target: ModelConfig) -> None:
        """Raise ConfigError if this draft cannot run on ``target``."""
        if self.model.hidden_size != target.hidden_size:
            raise ConfigError(f"draft hidden_size {self.model.hidden_size} != target hidden_size "
                              f"{target.hidden_size}")
        if self.model.vocab_size != target.vocab_size:
            raise ConfigError(f"draft vocab_size {self.model.vocab_size} != target vocab_size "
                              f"{target.vocab_size}")
        made_for = self.num_target_layers
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            if self.source_format == "speculators":
                names = f"aux_hidden_state_layer_ids {[i + 1 for i in bad]}"
            else:
                names = f"target_layer_ids {bad}"
            trained = "" if made_for in (None, target.num_layers) else f"; it was made for a {made_for}-layer target"
            raise ConfigError(f"draft {names} are outside the target's {target.num_layers} layers{trained}")
        if made_for is not None and made_for != target.num_layers:
            warnings.warn(f"the draft was made for a {made_for}-layer target and this target has "
                          f"{target.num_layers} layers: output stays exact, but expect few accepted "
                          "tokens")
        if self.draft_vocab_size is not None and self.draft_vocab_size > target.vocab_size:
            raise ConfigError(f"draft_vocab_size {self.draft_vocab_size} is larger than the target "
                              f"vocabulary of {target.vocab_size}")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(f"draft mask_token_id {self.mask_token_id} is outside the target "
                              f"vocabulary of {target.vocab_size}")
