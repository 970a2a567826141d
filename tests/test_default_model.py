"""The embedded default pair: within its size budget, loadable by transformers, lossless."""

import pytest
import torch

from dflash_jax.generate import DEFAULT_MODEL, generate, main
from dflash_jax.models import load_draft, load_target
from dflash_jax.tokenizer import Tokenizer

PROMPTS = ["import os\n\ndef ", "class Stack:\n    def __init__(self):\n", "for i in range("]


def test_default_pair_fits_its_budget():
    files = [p for p in DEFAULT_MODEL.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 40 * 2**20
    assert max(p.stat().st_size for p in files) <= 16 * 2**20


def test_load_takes_the_three_float_dtypes_by_name_or_object():
    import jax.numpy as jnp
    for dtype in ("int8", jnp.int8, jnp.float64, "f32"):
        with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float16', 'float32'\]"):
            load_target(DEFAULT_MODEL / "target", dtype)
    assert load_target(DEFAULT_MODEL / "target", jnp.float16).params.embed.dtype == jnp.float16


@pytest.fixture(scope="module")
def pair():
    target = load_target(DEFAULT_MODEL / "target", "float32")
    return target, load_draft(DEFAULT_MODEL / "draft", target, "float32"), Tokenizer(DEFAULT_MODEL / "target")


def test_default_pair_is_lossless(pair):
    target, draft, tok = pair
    prompts = [tok.encode(p) for p in PROMPTS]
    plain = generate(target, prompts, max_new_tokens=40, stop_token_ids=tok.stop_token_ids)
    spec = generate(target, prompts, draft=draft, max_new_tokens=40, stop_token_ids=tok.stop_token_ids)
    assert spec.tokens == plain.tokens
    assert spec.stats.tau > 1.0  # the trained draft does get tokens accepted


def test_default_target_matches_transformers(pair):
    from transformers import Qwen3ForCausalLM

    from dflash_jax import target as target_model
    from dflash_jax.cache import allocate_pages, init_cache
    import jax.numpy as jnp

    target, _, tok = pair
    ids = tok.encode(PROMPTS[1])
    hf = Qwen3ForCausalLM.from_pretrained(DEFAULT_MODEL / "target", dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    table, pages = allocate_pages([len(ids)], 16)
    cache = init_cache(target.config, None, table, pages, 16, jnp.float32)
    hidden, _, _ = target_model.forward(target.params, target.config, jnp.asarray([ids]),
                                        jnp.zeros((1,), jnp.int32), cache, impl="reference")
    got = target_model.logits(target.params, hidden)[0]
    assert float(abs(got - expected).max()) < 1e-3


def test_cli_runs_the_default_pair(capsys):
    assert main(["--max-new-tokens", "12", "--dtype", "float32"]) == 0
    err = capsys.readouterr().err
    assert "tau" in err and "outputs identical: True" in err
