"""Model-level: the Pallas kernels forced on (interpret mode) give the plain references' tokens and
acceptance. (With kernels on, parity with PyPI ``dflash`` and transformers, at long accepted runs,
is in test_dflash.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dflash_jax.model.config import DraftConfig, ModelConfig, uniform_config
from dflash_jax.runtime.generation import generate
from dflash_jax.model.nn.gated_deltanet import GatedDeltaNetSpec
from dflash_jax.model.nn.rope import RopeSpec
from dflash_jax.loading.models import Draft, Target
from dflash_jax.model.params import init_draft_params, init_target_params

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2, head_dim=16)
TARGET = uniform_config(num_layers=3, **SHAPE)
# One sliding-window causal draft layer (the reference's default for sliding layers), one full.
DRAFT = DraftConfig(model=uniform_config(num_layers=2, sliding_window=6, layer_types=("sliding_attention", "full_attention"),
                                         **SHAPE),
                    block_size=8, mask_token_id=95, target_layer_ids=(0, 2), causal_layers=(True, False))
# A target whose sliding layers see 8 tokens, far fewer than its prompts and outputs reach.
SLIDING_TARGET = uniform_config(num_layers=3, sliding_window=8,
                                layer_types=("sliding_attention", "full_attention", "sliding_attention"), **SHAPE)
# A hybrid (Qwen3.5): Gated DeltaNet layers (2 key / 4 value heads) around a gated attention with
# partial RoPE; its prompts pass the GDN kernel's chunked path (> 16 tokens) and the verify's.
HYBRID_TARGET = uniform_config(num_layers=3, layer_types=("linear_attention", "full_attention", "linear_attention"),
                               linear_attention=GatedDeltaNetSpec(2, 4, 16, 16), output_gate=True,
                               rope=RopeSpec(theta=1e6, rotary_dim=8), zero_centred_norms=True, **SHAPE)


def _models(target_config: ModelConfig, draft_config: DraftConfig, seed: int) -> tuple[Target, Draft]:
    # Large random weights so that predictions vary with context (attention matters).
    target = Target(target_config, jax.tree.map(lambda x: x * 8 if x.ndim == 2 else x,
                                                init_target_params(target_config, jax.random.key(seed), jnp.float32)))
    return target, Draft(draft_config, init_draft_params(draft_config, jax.random.key(seed + 1), jnp.float32))


@pytest.fixture(scope="module")
def models():
    return _models(TARGET, DRAFT, 0)


@pytest.mark.parametrize("target_config", [TARGET, SLIDING_TARGET, HYBRID_TARGET], ids=["full", "sliding", "hybrid"])
def test_kernels_match_reference_end_to_end(target_config):
    """Ragged prompts. In the sliding case every sequence outgrows the window, so the verify
    kernel's window start (masked first steps, earlier pages skipped) runs in prefill and verify."""
    target, draft = _models(target_config, DRAFT, 0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 90, n).tolist() for n in (5, 19, 33)]
    kwargs = dict(max_new_tokens=[20, 13, 24], stop_token_ids=None, page_size=16)
    plain = generate(target, prompts, impl="reference", **kwargs)
    spec_ref = generate(target, prompts, draft=draft, impl="reference", **kwargs)
    spec_kernels = generate(target, prompts, draft=draft, impl="interpret", **kwargs)
    assert spec_ref.tokens == plain.tokens
    assert spec_kernels.tokens == plain.tokens
    assert spec_kernels.stats.accept_lengths == spec_ref.stats.accept_lengths


def test_kernel_shape_limits_raise_before_compiling(models):
    target, _ = models
    odd = Target(uniform_config(num_layers=3, **{**SHAPE, "head_dim": 48}), target.params)
    with pytest.raises(ValueError, match="head_dim 48 .needs a power of two.*impl='reference'"):
        generate(odd, [[1, 2, 3]], impl="interpret", max_new_tokens=2)
    with pytest.raises(ValueError, match="page_size 4096 .one KV stage.*take a smaller page_size"):
        generate(target, [[1, 2, 3]], impl="interpret", max_new_tokens=2, page_size=4096)
    narrow = dataclasses.replace(HYBRID_TARGET, layers=tuple(
        dataclasses.replace(layer, mixer=GatedDeltaNetSpec(2, 4, 16, 24)) if i in HYBRID_TARGET.recurrent_layers
        else layer for i, layer in enumerate(HYBRID_TARGET.layers)))
    with pytest.raises(ValueError, match="linear attention value_dim 24 .the gated delta rule kernels"):
        generate(Target(narrow, init_target_params(narrow, jax.random.key(0), jnp.float32)), [[1, 2, 3]],
                 impl="interpret", max_new_tokens=2)


def test_gqa_group_that_is_not_a_power_of_two():
    """Qwen3-14B has 40 query heads over 8 KV heads: the kernels pad the group of 5 to 8."""
    shape = {**SHAPE, "num_heads": 6, "num_kv_heads": 2}
    draft_model = uniform_config(num_layers=2, sliding_window=6, layer_types=("sliding_attention", "full_attention"),
                                 **shape)
    target, draft = _models(uniform_config(num_layers=3, **shape), dataclasses.replace(DRAFT, model=draft_model), 2)
    prompts, kwargs = [[3, 1, 4, 1, 5], list(range(20, 41))], dict(max_new_tokens=12, stop_token_ids=None)
    plain = generate(target, prompts, impl="reference", **kwargs)
    spec_kernels = generate(target, prompts, draft=draft, impl="interpret", **kwargs)
    assert spec_kernels.tokens == plain.tokens
    assert spec_kernels.stats.accept_lengths == generate(target, prompts, draft=draft, impl="reference",
                                                         **kwargs).stats.accept_lengths


def test_auto_projects_single_narrow_rows_with_the_kernel_and_the_rest_with_xla(monkeypatch):
    """On a GPU "auto" runs the projection kernel for one row against a weight with a side of at
    most 3072 (hidden 2048-2880: Qwen3-30B-A3B's qkv and o_proj, gpt-oss's), and XLA for more
    rows or wider weights (Qwen3-8B's); the result is the projection's either way."""
    import pallas_kernels as pk
    from dflash_jax.model import ops
    from pallas_kernels import gpu as pk_gpu
    from pallas_kernels.gpu import tuning
    monkeypatch.setattr(tuning, "kernel_device_problem", lambda device=None: None)
    calls = []

    def kernel(x, w, interpret=False, **kw):
        calls.append((x.shape, w.shape))
        return pk.fused_matmul_reference(x, w, **kw)

    monkeypatch.setattr(pk_gpu, "fused_matmul", kernel)
    cases = {((1, 1, 2048), (2048, 5120)): True, ((1, 1, 4096), (4096, 2048)): True,
             ((1, 1, 2880), (2880, 5120)): True, ((1, 16, 2048), (2048, 5120)): False,
             ((2, 1, 2048), (2048, 5120)): False, ((1, 1, 4096), (4096, 6144)): False}
    for (x_shape, w_shape), kernel_runs in cases.items():
        x = jax.random.normal(jax.random.key(0), x_shape, jnp.float32)
        w = jax.random.normal(jax.random.key(1), w_shape, jnp.float32) / 64
        norm = jnp.ones(x_shape[-1], jnp.float32)
        calls.clear()
        out = ops.project(x, w, norm_weight=norm, impl="auto")
        assert bool(calls) == kernel_runs, (x_shape, w_shape)
        np.testing.assert_allclose(out, pk.fused_matmul_reference(x, w, norm_weight=norm), rtol=1e-5, atol=1e-5)
    # on a shard of a tensor-parallel program (measured on one device only), and for K not a
    # multiple of 16, XLA
    mesh = jax.make_mesh((1,), ("tp",))
    x, w = jnp.ones((1, 1, 2048)), jnp.ones((2048, 512)) / 2048
    calls.clear()
    jax.jit(jax.shard_map(lambda x, w: ops.project(x, w, impl="auto"), mesh=mesh, in_specs=(P(), P()),
                          out_specs=P()))(x, w)
    ops.project(jnp.ones((1, 1, 40)), jnp.ones((40, 8)), impl="auto")
    assert not calls


def test_dispatch_point(monkeypatch):
    """auto: the GPU kernels AUTO_KERNELS lists where the device can run them, the TPU kernels on
    a TPU; pallas on those only, with the reason elsewhere; interpret and interpret-tpu run
    anywhere; anything else is refused."""
    from dflash_jax.model import ops
    from dflash_jax.model.ops import AUTO_KERNELS, TPU_KERNELS, resolve_impl
    from pallas_kernels.gpu import tuning
    able = tuning.kernel_device_problem() is None
    if jax.default_backend() == "cpu":  # CI
        assert not able and not ops.on_tpu()
        for op, on in AUTO_KERNELS.items():
            assert resolve_impl("auto", op) == "reference"
            assert resolve_impl("interpret", op) == "gpu-interpret" and resolve_impl("reference", op) == "reference"
            assert resolve_impl("interpret-tpu", op) == ("tpu-interpret" if TPU_KERNELS[op] else "reference")
    monkeypatch.setattr(tuning, "kernel_device_problem", lambda device=None: "the device is a CPU, not a GPU")
    assert resolve_impl("auto", "verify_attention") == "reference"
    with pytest.raises(ValueError, match="'pallas' cannot run here: the device is a CPU, not a GPU or a TPU; use 'ref"):
        resolve_impl("pallas", "verify_attention")
    monkeypatch.setattr(tuning, "kernel_device_problem", lambda device=None: None)
    assert resolve_impl("auto", "verify_attention") == "gpu" and resolve_impl("pallas", "fused_matmul") == "gpu"
    assert resolve_impl("auto", "fused_matmul") == ("gpu" if AUTO_KERNELS["fused_matmul"] else "reference")
    monkeypatch.setattr(ops, "on_tpu", lambda: True)
    for op, on in TPU_KERNELS.items():
        assert resolve_impl("auto", op) == resolve_impl("pallas", op) == ("tpu" if on else "reference")
    with pytest.raises(ValueError, match="must be one of"):
        resolve_impl("triton", "verify_attention")
