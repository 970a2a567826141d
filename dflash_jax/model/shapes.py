"""The model shapes of the published checkpoints DFlash serves, with their z-lab drafts' shapes, and
tiny ones of the same structure: configs only (no weights), for the benchmarks (random weights at
these shapes) and for ``python -m dflash_jax.aot`` (programs compiled for TPUs at these shapes).
``SHAPES`` names each (target, draft) pair."""

from __future__ import annotations

import dataclasses

from dflash_jax.model.config import DraftConfig, ModelConfig, uniform_config
from dflash_jax.model.hf_config import target_config_from_hf
from dflash_jax.model.nn.dynamic_conv import ConvSpec
from dflash_jax.model.nn.gated_deltanet import GatedDeltaNetSpec
from dflash_jax.model.nn.moe import MoESpec
from dflash_jax.model.nn.rope import RopeSpec
from dflash_jax.model.selector import SelectorSpec

QWEN3_8B = uniform_config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
                          num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6,
                          max_position_embeddings=40960)
DFLASH_DRAFT_8B = DraftConfig(model=QWEN3_8B.with_layers(QWEN3_8B.layers[:5]), block_size=16,
                              mask_token_id=151669, target_layer_ids=(1, 9, 17, 25, 33), num_target_layers=36)
# A DFlash2 draft of the same size (z-lab's published DFlash2 settings: kernel 2, groups of 16,
# selector rank 256, top 16): its step against the DFlash draft's is the selector's cost.
DFLASH2_DRAFT_8B = dataclasses.replace(
    DFLASH_DRAFT_8B, model=DFLASH_DRAFT_8B.model.with_layers(tuple(
        dataclasses.replace(layer, conv=ConvSpec(2, 16)) for layer in DFLASH_DRAFT_8B.model.layers)),
    selector=SelectorSpec(rank=256, top_k=16))
# Qwen3-32B (the tensor-parallel benchmark's target): a 5-layer draft of its width, as the 8B's.
QWEN3_32B = uniform_config(vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_layers=64,
                           num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=1e6,
                           max_position_embeddings=40960)
DFLASH_DRAFT_32B = DraftConfig(model=QWEN3_32B.with_layers(QWEN3_32B.layers[:5]), block_size=16,
                               mask_token_id=151669, target_layer_ids=(1, 16, 31, 46, 61), num_target_layers=64)
# LLaMA-3.1-8B-Instruct: no q/k norms, llama3 RoPE; z-lab's draft: 5 Qwen3 layers, block 10.
LLAMA31_8B = uniform_config(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                            num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, qk_norm=False,
                            rope=RopeSpec(theta=500000.0, rotary_dim=128, kind="llama3", factor=8.0,
                                          low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=8192),
                            rms_norm_eps=1e-5, max_position_embeddings=131072)
DFLASH_DRAFT_LLAMA31_8B = DraftConfig(
    model=uniform_config(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=5, num_heads=32,
                         num_kv_heads=8, head_dim=128, rope=LLAMA31_8B.rope, rms_norm_eps=1e-5),
    block_size=10, mask_token_id=128002, target_layer_ids=(1, 8, 15, 22, 29), num_target_layers=32)
# Qwen3-30B-A3B: 48 layers of 128 experts (top 8, width 768); a dense 5-layer Qwen3 draft.
QWEN3_30B_A3B = uniform_config(family="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=48, num_heads=32,
                               num_kv_heads=4, head_dim=128, rope_theta=1e6, max_position_embeddings=40960,
                               ffn=MoESpec(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=True))
DFLASH_DRAFT_30B_A3B = DraftConfig(
    model=uniform_config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=5, num_heads=32,
                         num_kv_heads=4, head_dim=128, rope_theta=1e6),
    block_size=16, mask_token_id=151669, target_layer_ids=(1, 12, 23, 34, 45), num_target_layers=48)
# Qwen3.5-27B: 64 layers, every fourth gated attention (24/4 heads x 256, RoPE on 64 dims), the rest
# Gated DeltaNet (16 key / 48 value heads x 128); z-lab's Qwen3.6-27B draft: 5 Qwen3 layers, block 16.
HYBRID_TYPES = lambda n: tuple("full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n))  # noqa: E731
QWEN35_27B = uniform_config(family="qwen3_5_release", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                            num_layers=64, num_heads=24, num_kv_heads=4, head_dim=256, output_gate=True,
                            rope=RopeSpec(theta=1e7, rotary_dim=64), layer_types=HYBRID_TYPES(64),
                            linear_attention=GatedDeltaNetSpec(16, 48, 128, 128), max_position_embeddings=262144,
                            zero_centred_norms=True)
DFLASH_DRAFT_35_27B = DraftConfig(
    model=uniform_config(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_layers=5, num_heads=32,
                         num_kv_heads=8, head_dim=128, rope_theta=1e7),
    block_size=16, mask_token_id=248070, target_layer_ids=(1, 16, 31, 46, 61), num_target_layers=64)
# Qwen3.5-35B-A3B-like: 40 layers, 256 experts (top 8, width 512) + a shared expert (512) on each;
# its z-lab draft: 8 Qwen3 layers.
QWEN35_35B_A3B = uniform_config(family="qwen3_5_moe_release", vocab_size=248320, hidden_size=2048, num_layers=40,
                                num_heads=16, num_kv_heads=2, head_dim=256, output_gate=True,
                                rope=RopeSpec(theta=1e7, rotary_dim=64), layer_types=HYBRID_TYPES(40),
                                linear_attention=GatedDeltaNetSpec(16, 32, 128, 128), max_position_embeddings=262144,
                                zero_centred_norms=True,
                                ffn=MoESpec(num_experts=256, top_k=8, intermediate_size=512, norm_topk_prob=True,
                                            shared_intermediate_size=512))
DFLASH_DRAFT_35_35B_A3B = DraftConfig(
    model=uniform_config(vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_layers=8, num_heads=32,
                         num_kv_heads=4, head_dim=128, rope_theta=1e7),
    block_size=16, mask_token_id=248070, target_layer_ids=(1, 10, 19, 28, 37), num_target_layers=40)
# gpt-oss-20b: 24 layers alternating a 128-token window and full attention, 64/8 heads x 64 with
# sinks and biases, 32 experts (top 4, width 2880, biased, clamped SwiGLU) in MXFP4 as released, or
# dequantised (random bf16 experts); z-lab's draft: 8 Qwen3 layers with attention biases, block 8.


def gpt_oss_shape(**fields) -> ModelConfig:
    return target_config_from_hf({"architectures": ["GptOssForCausalLM"], "max_position_embeddings": 131072,
                                **fields}, "a gpt-oss benchmark shape")


def biased_attention(config: ModelConfig) -> ModelConfig:
    return config.with_layers(tuple(dataclasses.replace(layer, mixer=dataclasses.replace(layer.mixer, bias=True))
                                    for layer in config.layers))


GPT_OSS_20B_MXFP4 = gpt_oss_shape(num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4,
                                  vocab_size=201088, hidden_size=2880, intermediate_size=2880, head_dim=64,
                                  num_attention_heads=64, num_key_value_heads=8,
                                  quantization_config={"quant_method": "mxfp4"})
GPT_OSS_20B = GPT_OSS_20B_MXFP4.with_dequantized_experts()
DFLASH_DRAFT_GPT_OSS_20B = DraftConfig(
    model=biased_attention(uniform_config(vocab_size=201088, hidden_size=2880, intermediate_size=7680, num_layers=8,
                                          num_heads=64, num_kv_heads=8, head_dim=64, rope_theta=150000.0,
                                          rms_norm_eps=1e-5)),
    block_size=8, mask_token_id=200000, target_layer_ids=(1, 6, 11, 16, 21), num_target_layers=24)
# CPU smoke-test shapes: same structure, minutes -> seconds.
TINY = uniform_config(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                      num_kv_heads=2, head_dim=16, rope_theta=1e6, max_position_embeddings=40960)
TINY_DRAFT = DraftConfig(model=TINY.with_layers(TINY.layers[:2]), block_size=16, mask_token_id=511,
                         target_layer_ids=(1, 2), num_target_layers=4)
TINY_DFLASH2_DRAFT = dataclasses.replace(
    TINY_DRAFT, model=TINY_DRAFT.model.with_layers(tuple(
        dataclasses.replace(layer, conv=ConvSpec(2, 16)) for layer in TINY_DRAFT.model.layers)),
    selector=SelectorSpec(rank=8, top_k=4))
TINY_MOE = uniform_config(family="qwen3_moe", vocab_size=512, hidden_size=64, num_layers=4, num_heads=4,
                          num_kv_heads=2, head_dim=16, rope_theta=1e6, max_position_embeddings=40960,
                          ffn=MoESpec(num_experts=8, top_k=2, intermediate_size=32, norm_topk_prob=True))
TINY_GPT_OSS_MXFP4 = gpt_oss_shape(num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=512,
                                   hidden_size=64, intermediate_size=32, head_dim=16, num_attention_heads=4,
                                   num_key_value_heads=2, sliding_window=8, quantization_config={"quant_method": "mxfp4"})
TINY_GPT_OSS = TINY_GPT_OSS_MXFP4.with_dequantized_experts()
TINY_HYBRID = uniform_config(family="qwen3_5_release", vocab_size=512, hidden_size=64, intermediate_size=128,
                             num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, output_gate=True,
                             rope=RopeSpec(theta=1e7, rotary_dim=8), layer_types=HYBRID_TYPES(4),
                             linear_attention=GatedDeltaNetSpec(2, 4, 16, 16), max_position_embeddings=40960,
                             zero_centred_norms=True)
SHAPES = {"qwen3-8b": (QWEN3_8B, DFLASH_DRAFT_8B), "qwen3-8b-dflash2": (QWEN3_8B, DFLASH2_DRAFT_8B), "qwen3-32b": (QWEN3_32B, DFLASH_DRAFT_32B),
          "llama3.1-8b": (LLAMA31_8B, DFLASH_DRAFT_LLAMA31_8B),
          "qwen3-30b-a3b": (QWEN3_30B_A3B, DFLASH_DRAFT_30B_A3B), "qwen3.5-27b": (QWEN35_27B, DFLASH_DRAFT_35_27B),
          "qwen3.5-35b-a3b": (QWEN35_35B_A3B, DFLASH_DRAFT_35_35B_A3B), "tiny": (TINY, TINY_DRAFT),
          "gpt-oss-20b": (GPT_OSS_20B, DFLASH_DRAFT_GPT_OSS_20B),
          "gpt-oss-20b-mxfp4": (GPT_OSS_20B_MXFP4, DFLASH_DRAFT_GPT_OSS_20B),
          "tiny-moe": (TINY_MOE, TINY_DRAFT), "tiny-hybrid": (TINY_HYBRID, TINY_DRAFT),
          "tiny-gpt-oss": (TINY_GPT_OSS, TINY_DRAFT), "tiny-gpt-oss-mxfp4": (TINY_GPT_OSS_MXFP4, TINY_DRAFT),
          "tiny-dflash2": (TINY, TINY_DFLASH2_DRAFT)}
