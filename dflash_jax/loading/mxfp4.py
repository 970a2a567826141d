"""MXFP4 weights as gpt-oss releases its experts: per 32 values, 16 bytes of 4-bit E2M1 codes
(low nibble first) and one E8M0 scale byte (a power of two, bias 127). Dequantised on the host
as a checkpoint is read, one tensor at a time; every value is exact in bfloat16 and float32.

A checkpoint stores ``<name>_blocks`` [E, rows, G, 16] and ``<name>_scales`` [E, rows, G] u8,
rows being the output features; ``<name>`` in transformers' own layout is [E, G * 32, rows]
([in, out]), which ``dequantize_pair`` returns.
"""

from __future__ import annotations

import numpy as np

# E2M1: sign, two exponent bits, one mantissa bit; the index is the 4-bit code
FP4_VALUES = np.array([+0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """blocks [..., G, 16] u8, scales [..., G] u8 -> float32 [..., G * 32]: code c of byte b
    at 2b (low nibble) and 2b + 1 (high nibble), times 2^(scale - 127)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [..., G, 16] and scales [..., G] do not match: {list(blocks.shape)} and "
                         f"{list(scales.shape)}")
    values = np.empty((*blocks.shape[:-1], 32), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, (scales.astype(np.int32) - 127)[..., None])
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def dequantize_pair(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """An expert tensor [E, rows, G, 16] / [E, rows, G] -> float32 [E, G * 32, rows] (transformers'
    parameter layout), dequantised one expert at a time."""
    if blocks.ndim != 4:
        raise ValueError(f"MXFP4 expert blocks must be [E, rows, G, 16], got {list(blocks.shape)}")
    out = np.empty((blocks.shape[0], blocks.shape[2] * 32, blocks.shape[1]), np.float32)
    for expert in range(blocks.shape[0]):
        out[expert] = dequantize(blocks[expert], scales[expert]).T
    return out


def dequantized_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape ``dequantize_pair`` returns for blocks of ``blocks_shape``."""
    experts, rows, groups, _ = blocks_shape
    return experts, groups * 32, rows


def dequantize_packed(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """An expert weight in the experts' kernel's layout (``pallas_kernels.Mxfp4Weight``: blocks
    [E, K/2, N], scales [E, K/32, N]) -> float32 [E, K, N], as ``dequantize_pair`` decodes it."""
    experts, half, outputs = blocks.shape
    return dequantize_pair(np.swapaxes(blocks, 1, 2).reshape(experts, outputs, half // 16, 16),
                           np.swapaxes(scales, 1, 2))
