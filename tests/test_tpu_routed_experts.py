"""The TPU routed-experts kernel (``pallas_kernels.tpu.routed_experts``) against
``routed_experts_reference`` in TPU interpret mode, and compiled ahead of time for real TPU
generations at Qwen3-30B-A3B's and gpt-oss-20b's expert shapes (no TPU needed)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.routed_experts import Mxfp4Weight, routed_experts_reference
from pallas_kernels.tpu.routed_experts import routed_experts, tile_matmul, tile_rows


def moe_case(seed, tokens, top_k, hidden, width, num_experts, dtype, biases, dropped):
    """Random experts and routing: each token's top_k distinct experts drawn from all but the
    last (which no token chooses), ``dropped`` pairs set to -1. Also returns the experts'
    weights with the unchosen expert's poisoned with NaN, for the kernel (never to be read)."""
    rng = np.random.default_rng(seed)
    keys = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(keys[0], (tokens, hidden), jnp.float32)
    # 3 / sqrt(H): gate and up values beyond the clamp of 7 occur
    gate_up = jax.random.normal(keys[1], (num_experts, hidden, 2 * width)) * 3 / hidden ** 0.5
    down = jax.random.normal(keys[2], (num_experts, width, hidden)) / width ** 0.5
    experts = np.stack([rng.choice(num_experts - 1, top_k, replace=False) for _ in range(tokens)]).astype(np.int32)
    experts.reshape(-1)[rng.choice(tokens * top_k, dropped, replace=False)] = -1
    weights = jax.random.uniform(keys[3], (tokens, top_k))
    bias = (jax.random.normal(keys[4], (num_experts, 2 * width)), jax.random.normal(keys[5], (num_experts, hidden))
            ) if biases else (None, None)
    x, weights, gate_up, down, *bias = (a if a is None else a.astype(dtype) for a in (x, weights, gate_up, down, *bias))
    args = [x, jnp.asarray(experts), weights, gate_up, down, *bias]
    poisoned = [w.at[-1].set(jnp.nan) for w in (gate_up, down)]
    return args, args[:3] + poisoned + args[5:]


CASES = {  # seed, tokens, top_k, hidden, width, experts, dtype, biases, dropped, swiglu_limit, tuning
    # reductions of 2 (gate|up) and 3 (down) steps; 5 tokens in one 16-row tile an expert
    "f32-shared-experts": (1, 5, 3, 256, 384, 6, jnp.float32, False, 3, None, dict(block_k=128)),
    # H = 320: output columns in 128-lane blocks, the last one partial
    "f32-biases-clamped": (2, 3, 2, 320, 128, 4, jnp.float32, True, 1, 7.0, dict(block_n=128)),
    # 40 tokens in 16-row tiles: an expert's pairs take several tiles, the last partial
    "bf16-biases-clamped": (3, 40, 2, 128, 256, 5, jnp.bfloat16, True, 5, 7.0, dict(block_m=16)),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_routed_experts_matches_reference(case):
    seed, *shape, dtype, biases, dropped, swiglu_limit, tuning = case
    args, kernel_args = moe_case(seed, *shape, dtype, biases, dropped)
    ref = routed_experts_reference(*args, swiglu_limit=swiglu_limit)
    out = routed_experts(*kernel_args, swiglu_limit=swiglu_limit, interpret=True, **tuning)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=tol,
                               atol=tol * scale)


def test_pairs_all_dropped_add_nothing():
    args, kernel_args = moe_case(4, 2, 2, 128, 128, 3, jnp.float32, False, 4)
    out = routed_experts(*kernel_args, interpret=True)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((2, 128), np.float32))


def test_mxfp4_and_bad_arguments_are_refused():
    args, _ = moe_case(5, 2, 2, 128, 128, 3, jnp.float32, True, 0)
    x, experts, weights, gate_up, down, gate_up_bias, down_bias = args
    packed = Mxfp4Weight(jnp.zeros((3, 64, 256), jnp.uint8), jnp.zeros((3, 4, 256), jnp.uint8))
    with pytest.raises(ValueError, match="not Mxfp4Weight: load the checkpoint with --mxfp4-experts dequantize"):
        routed_experts(x, experts, weights, packed, down)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        routed_experts(x.astype(jnp.float16), experts, weights, gate_up.astype(jnp.float16), down.astype(jnp.float16))
    with pytest.raises(ValueError, match=r"down_bias must be \[E, H\]"):
        routed_experts(x, experts, weights, gate_up, down, gate_up_bias, down_bias[:, :64])
    with pytest.raises(ValueError, match="tpu_routed_experts_gate_up: block_k must divide 128"):
        routed_experts(x, experts, weights, gate_up, down, block_k=96)


# Compiled for real TPUs ---------------------------------------------------------------------------

libtpu = pytest.importorskip("libtpu", reason='the TPU compiler comes with pip install -e ".[tpu]"')
from pallas_kernels.tpu.compile import compile_for  # noqa: E402

# (experts, top_k, hidden, width, biases)
MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768, False), "gpt-oss-20b": (32, 4, 2880, 2880, True)}


def tpu_device(topology: str):
    from pallas_kernels.tpu.compile import topology_devices
    return topology_devices(topology)[0]


def expert_bytes(num_experts, hidden, width):
    return num_experts * 3 * hidden * width * 2  # gate|up and down, bf16


@pytest.mark.parametrize("topology", ["v5e:2x2", "v6e:2x2"])
@pytest.mark.parametrize("model", MODELS.keys())
def test_kernels_compile_for_tpus(topology, model):
    """Both projections' kernels at 1, 32 and 512 tokens, with the tile layout the wrapper takes
    (one program, so that each generation and model compiles once)."""
    num_experts, top_k, hidden, width, biases = MODELS[model]
    layouts = []
    for tokens in (1, 32, 512):
        pairs = tokens * top_k
        block_m = tile_rows(tokens, pairs, num_experts)
        layouts.append((block_m, -(-pairs // block_m) + min(num_experts, pairs)))

    def projections(gate_up, down, *rest):
        (gate_up_bias, down_bias, *tiles) = rest if biases else (None, None, *rest)
        outs = []
        for i, (block_m, _) in enumerate(layouts):
            rows, hidden_rows, tile_expert, used = tiles[4 * i:4 * i + 4]
            run = functools.partial(tile_matmul, tile_expert=tile_expert, used_tiles=used, block_m=block_m,
                                    block_k=None, block_n=None, interpret=False)
            outs += [run(rows, gate_up, gate_up_bias, name="tpu_routed_experts_gate_up"),
                     run(hidden_rows, down, down_bias, name="tpu_routed_experts_down")]
        return outs

    bf16 = jnp.bfloat16
    shapes = [((num_experts, hidden, 2 * width), bf16), ((num_experts, width, hidden), bf16)]
    if biases:
        shapes += [((num_experts, 2 * width), bf16), ((num_experts, hidden), bf16)]
    for block_m, num_tiles in layouts:
        shapes += [((num_tiles * block_m, hidden), bf16), ((num_tiles * block_m, width), bf16),
                   ((num_tiles,), jnp.int32), ((), jnp.int32)]
    compiled = compile_for(tpu_device(topology), projections, *shapes)
    weights = expert_bytes(num_experts, hidden, width)
    memory = compiled.memory_analysis()
    assert memory.argument_size_in_bytes >= weights
    assert memory.temp_size_in_bytes < weights / 16  # no copy of the experts
    # the kernels' own count covers the routed experts' weights: top_k at one token, then all
    routed = expert_bytes(top_k + 2 * num_experts, hidden, width)
    assert compiled.cost_analysis()["bytes accessed"] >= routed


@pytest.mark.parametrize("model", MODELS.keys())
def test_decode_step_compiles_for_tpus(model):
    """The whole wrapper at one token (routing, gathers, SwiGLU and sums by XLA) on v6e: the
    experts are read in place, each routed one counted once."""
    num_experts, top_k, hidden, width, biases = MODELS[model]
    bf16 = jnp.bfloat16
    shapes = [((1, hidden), bf16), ((1, top_k), jnp.int32), ((1, top_k), bf16),
              ((num_experts, hidden, 2 * width), bf16), ((num_experts, width, hidden), bf16)]
    fn = routed_experts
    if biases:
        shapes += [((num_experts, 2 * width), bf16), ((num_experts, hidden), bf16)]
        fn = functools.partial(routed_experts, swiglu_limit=7.0)
    compiled = compile_for(tpu_device("v6e:2x2"), fn, *shapes)
    weights = expert_bytes(num_experts, hidden, width)
    assert compiled.memory_analysis().temp_size_in_bytes < weights / 64
    bytes_accessed = compiled.cost_analysis()["bytes accessed"]
    assert expert_bytes(top_k, hidden, width) <= bytes_accessed < weights / 2


def test_oversized_block_is_refused_naming_the_kernel():
    num_experts, top_k, hidden, width, _ = MODELS["qwen3-30b-a3b"]
    bf16 = jnp.bfloat16
    shapes = [((1, hidden), bf16), ((1, top_k), jnp.int32), ((1, top_k), bf16),
              ((num_experts, hidden, 2 * width), bf16), ((num_experts, width, hidden), bf16)]
    oversized = functools.partial(routed_experts, block_m=16384)
    with pytest.raises(ValueError, match=r"tpu_routed_experts_gate_up: block_m=16384 rows.*MiB of VMEM.*smaller"):
        compile_for(tpu_device("v5e:2x2"), oversized, *shapes)
