"""Train a DFlash draft for a frozen target and export it in z-lab format.

    python -m dflash_jax.training.train_draft --target DIR --out DIR [--data FILES|GLOBS|stdlib]
        [--regenerate N [--prompts FILE [--chat]]] [--num-layers K] [--block-size 16] [--steps 1000] [--batch 1]
        [--seq-len 512] [--anchors 512] [--lr 6e-4] [--resume | --overwrite] [--eval-prompts N]

Per row: the target runs the clean sequence once (frozen, bf16) and its taps at the draft's
``target_layer_ids`` become context K/V exactly as inference writes them (``draft.write_context``).
Up to ``anchors`` random anchors t (t and t+1 supervised) each open a block
``[token_t, mask x (B-1)]`` at positions t..t+B-1 labelled with tokens t+1..t+B-1. A block
attends to itself (bidirectionally) and to context positions < t; blocks never see each other.
Loss: cross-entropy weighted by exp(-(k-1)/gamma) at block position k, over the total weight.

Checkpoints, the run's settings (run.json), its per-step log (train_log.json) and the target's
``--regenerate`` responses (regenerated.npz) go to ``--ckpt-dir`` (default OUT.ckpt), which holds
one run: a new run refuses a folder with checkpoints; ``--resume`` continues the run there with
the same settings and responses. A non-empty ``--out`` is replaced only with ``--overwrite`` or by
``--resume`` of the run that run.json records as writing it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import shutil
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from checkpoints_convert import export_draft
from checkpoints_convert.export import DEFAULT_MAX_SHARD_MB
from dflash_jax.training import data
from dflash_jax.model import draft as draft_model
from dflash_jax.model.cache import init_cache
from dflash_jax.entrypoints.cli import (COMPILE_CACHE_HELP, DTYPE_DEFAULT_HELP, at_least, default_dtype, exit_with,
                            interrupt_exits, keep_compiled_programs, non_negative_float, one_line_warnings, or_na,
                            positive_float, random_seed, reported_as_errors)
from dflash_jax.model.config import DraftConfig, LayerSpec, ModelConfig, build_target_layer_ids
from dflash_jax.model.hf_config import load_target_config
from dflash_jax.model.nn.mlp import MLPSpec
from dflash_jax.model.nn.moe import MoESpec
from dflash_jax.loading.models import Draft, Target, load_draft, load_target, loaded_config
from dflash_jax.model.params import DraftParams, TargetParams, cast_params, init_draft_params
from dflash_jax.runtime.sampling import SamplingConfig, leading_run
from dflash_jax.model.sharding import TensorParallel, local_config, make_mesh
from dflash_jax.entrypoints.arguments import add_chat_arguments
from dflash_jax.loading.tokenizer import Tokenizer, chat_options, read_prompt_file, render_prompts
from dflash_jax.training.train_target import (OptimConfig, TrainState, announced, apply_gradients, causal_forward,
                                     claim_run_folders, global_norm, lies_within, make_optimizer, run_recipe,
                                     run_training)


@dataclasses.dataclass(frozen=True)
class DraftTrainConfig:
    """Recipe of one draft training run. ``gamma`` None: ``data.default_gamma(block_size)``.

    Memory: activations grow with rows x anchors x block (every anchor's block runs the draft
    layers). At Qwen3-8B shape (hidden 4096, vocab 151936), 512 anchors of block 16 need about
    8 GiB of activations for one row with one draft layer, 4.7 GiB more per further layer, and
    39 GiB for 8 rows with one layer (XLA's buffer assignment, compiled on CPU), beside the frozen target and the f32 params and
    AdamW moments; hence one row per step by default (SpecForge's default too). The optimizer
    (``OptimConfig``: b2 0.95, weight decay 0.01 on matrices) is the usual LLM AdamW, not
    SpecForge's (torch defaults: b2 0.999, no decay); the DFlash recipe leaves it open."""

    optim: OptimConfig = OptimConfig(steps=1000, lr=6e-4)
    num_anchors: int = 512
    batch_size: int = 1
    gamma: float | None = None
    seed: int = 0
    compute_dtype: str = "bfloat16"
    save_every: int = 250
    time_budget: float | None = None


def new_draft_config(target: ModelConfig, *, num_layers: int, block_size: int, mask_token_id: int,
                     target_layer_ids: Sequence[int] | None = None) -> DraftConfig:
    """A fresh z-lab draft for ``target`` of any family: Qwen3 layers (q/k norms) with the
    target's attention shape, RoPE (on whole heads: a Qwen3 layer has no partial rotary or output
    gate, which hybrids' attention has; z-lab's own Qwen3.5 drafts use 32 x 128 heads instead of
    the target's 24 x 256) and biases (no attention sinks: z-lab's layers, gpt-oss's drafts
    included, have none), full attention, and a dense MLP as wide as the
    target's (for an all-MoE target, as wide as the experts a token runs: top_k x the expert
    width, 6144 for Qwen3-30B-A3B, which z-lab's drafts for it use)."""
    ids = tuple(target_layer_ids) if target_layer_ids else build_target_layer_ids(target.num_layers, num_layers)
    dense = [layer.ffn for layer in target.layers if isinstance(layer.ffn, MLPSpec)]
    routed = next((layer.ffn for layer in target.layers if isinstance(layer.ffn, MoESpec)), None)
    width = target.intermediate_size if dense else routed.top_k * routed.intermediate_size
    attention = target.attention
    attention = dataclasses.replace(attention, qk_norm=True, output_gate=False, sinks=False,
                                    rope=dataclasses.replace(attention.rope, rotary_dim=attention.head_dim))
    layer = LayerSpec(attention, MLPSpec(width))
    model = ModelConfig(family="qwen3", vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                        layers=(layer,) * num_layers, rms_norm_eps=target.rms_norm_eps,
                        tie_word_embeddings=target.tie_word_embeddings,
                        max_position_embeddings=target.max_position_embeddings)
    config = DraftConfig(model=model, block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=ids,
                         num_target_layers=target.num_layers, causal_layers=(False,) * num_layers)
    config.check_target(target)
    return config


def find_mask_token(target_dir: str | Path, vocab_size: int) -> int:
    """The target's mask token: <|mask|> (or <|MASK|>) from its tokenizer, else the first id the
    embedding reserves past the tokenizer (Qwen3's 151669 is found this way)."""
    tokenizer = data.load_tokenizer(target_dir)
    for name in (data.MASK_TOKEN, "<|MASK|>"):
        if tokenizer.token_to_id(name) is not None:
            return tokenizer.token_to_id(name)
    first_free = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if first_free < vocab_size:  # past the largest id: a tokenizer's ids may leave gaps
        return first_free
    raise ValueError(f"{target_dir}: the tokenizer has no <|mask|> token and fills the vocabulary; "
                     "pass --mask-token-id")


# ---------------------------------------------------------------------------------------------
# The training forward.

def training_visibility(anchors: jax.Array, seq_len: int, block_size: int) -> jax.Array:
    """Dense mask [R, N*B, T + N*B] of what each block query sees: context keys < its anchor,
    then every key of its own block. Defines ``anchored_attention`` (tests compare the two)."""
    rows, num = anchors.shape
    block_of = jnp.arange(num * block_size) // block_size
    context = jnp.arange(seq_len)[None, None, :] < anchors[:, block_of][:, :, None]
    own_block = jnp.broadcast_to(block_of[:, None] == block_of[None, :], (rows, num * block_size, num * block_size))
    return jnp.concatenate([context, own_block], axis=-1)


def anchored_attention(q: jax.Array, k: jax.Array, v: jax.Array, context_k: jax.Array, context_v: jax.Array,
                       anchors: jax.Array, block_size: int) -> jax.Array:
    """Attention of flattened blocks q/k/v [R, N*B, heads, D] over the context K/V [R, T, Hkv, D]
    before each block's anchor [R, N] plus the block's own keys, without materializing the
    N*B x N*B mask (one softmax over both parts, f32 statistics)."""
    rows, flat, q_heads, dim = q.shape
    kv_heads, num = k.shape[2], flat // block_size
    qg = q.reshape(rows, num, block_size, kv_heads, q_heads // kv_heads, dim)
    kb = k.reshape(rows, num, block_size, kv_heads, dim)
    vb = v.reshape(rows, num, block_size, kv_heads, dim)
    f32 = jnp.float32
    scale = dim ** -0.5
    s_ctx = jnp.einsum("rnqkgd,rskd->rnkgqs", qg, context_k, preferred_element_type=f32) * scale
    visible = jnp.arange(context_k.shape[1])[None, None, :] < anchors[:, :, None]
    s_ctx = jnp.where(visible[:, :, None, None, None, :], s_ctx, -jnp.inf)
    s_blk = jnp.einsum("rnqkgd,rnpkd->rnkgqp", qg, kb, preferred_element_type=f32) * scale
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1).astype(v.dtype)
    split = context_k.shape[1]
    out = (jnp.einsum("rnkgqs,rskd->rnqkgd", probs[..., :split], context_v, preferred_element_type=f32)
           + jnp.einsum("rnkgqp,rnpkd->rnqkgd", probs[..., split:], vb, preferred_element_type=f32))
    return out.reshape(rows, flat, q_heads, dim).astype(q.dtype)


def draft_block_hidden(params: DraftParams, config: DraftConfig, target: TargetParams, taps: jax.Array,
                       blocks: data.Blocks, anchors: jax.Array) -> jax.Array:
    """Draft hidden states [R, N*B, H] of every block, over context taps [R, T, n*H]."""
    if any(config.causal_layers) or any(config.model.window(i) for i in range(config.model.num_layers)):
        raise ValueError("training supports full-attention, non-causal draft layers only")
    rows, seq_len = taps.shape[:2]
    # One page per row: after write_context each layer's pages are the dense context K/V.
    cache = init_cache(None, config.model,
                       np.arange(rows, dtype=np.int32)[:, None], rows, seq_len, taps.dtype)
    positions = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (rows, seq_len))
    cache = draft_model.write_context(params, config, taps, positions, cache, impl="reference")

    def attend(index, q, k, v):
        return anchored_attention(q, k, v, *cache.layer(index), anchors, config.block_size)

    x = draft_model.embed_block(config, target, blocks.tokens)
    return draft_model.layer_stack(params, config, x, blocks.positions, attend, impl="reference")


LOGIT_CHUNK_BYTES = 256 * 2**20  # f32 logits alive at once in the loss, forward and backward


def chunked_cross_entropy(logits_fn: Callable[[jax.Array], jax.Array], hidden: jax.Array,
                          labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Cross-entropy and argmax [...] of ``logits_fn(hidden)`` for hidden [..., H] and integer
    labels [...], over chunks of positions whose f32 logits take at most LOGIT_CHUNK_BYTES and
    are recomputed in the backward pass: the whole [..., V] logits (35 GiB at Qwen3's vocabulary,
    8 rows and 512 anchors of block 16) never exist at once."""
    shape, width = labels.shape, hidden.shape[-1]
    flat_hidden, flat_labels = hidden.reshape(-1, width), labels.reshape(-1)
    count = flat_labels.shape[0]
    vocab = jax.eval_shape(logits_fn, flat_hidden[:1]).shape[-1]
    chunk = max(1, min(count, LOGIT_CHUNK_BYTES // (4 * vocab)))
    pad = -count % chunk
    flat_hidden = jnp.pad(flat_hidden, ((0, pad), (0, 0))).reshape(-1, chunk, width)
    flat_labels = jnp.pad(flat_labels, (0, pad)).reshape(-1, chunk)

    @jax.checkpoint
    def one_chunk(chunk_args):
        chunk_hidden, chunk_labels = chunk_args
        logits = logits_fn(chunk_hidden)
        return (optax.softmax_cross_entropy_with_integer_labels(logits, chunk_labels),
                jnp.argmax(logits, axis=-1))

    ce, predicted = jax.lax.map(one_chunk, (flat_hidden, flat_labels))
    return ce.reshape(-1)[:count].reshape(shape), predicted.reshape(-1)[:count].reshape(shape)


def draft_loss(params: DraftParams, target: TargetParams, tokens: jax.Array, loss_mask: jax.Array,
               anchors: jax.Array, *, config: DraftConfig, target_config: ModelConfig, gamma: float,
               dtype, tensor_parallel: TensorParallel | None = None) -> tuple[jax.Array, dict]:
    """Decay-weighted block cross-entropy, per-position accuracy and the greedy acceptance proxy
    (1 + leading correct block positions, averaged over used anchors: τ under teacher forcing).
    ``tensor_parallel``: the frozen target is split over its mesh (its taps come whole to every
    device; XLA partitions the draft's use of the split embedding and head)."""
    params, target = cast_params(params, dtype), cast_params(target, dtype)
    _, taps = causal_forward(target, target_config, tokens, config.target_layer_ids, tensor_parallel)
    taps = jax.lax.stop_gradient(taps)
    blocks = data.make_blocks(tokens, loss_mask, anchors, config.block_size, config.mask_token_id)
    hidden = draft_block_hidden(params, config, target, taps, blocks, anchors)
    rows, num = anchors.shape
    hidden = hidden.reshape(rows, num, config.block_size, -1)[:, :, 1:]
    ce, predicted = chunked_cross_entropy(lambda h: draft_model.draft_logits(params, config, target, h),
                                          hidden, blocks.labels)
    valid = blocks.label_mask.astype(jnp.float32)
    weights = data.position_weights(config.block_size, gamma) * valid
    loss = jnp.sum(ce * weights) / jnp.maximum(jnp.sum(weights), 1e-6)
    correct = (predicted == blocks.labels) & blocks.label_mask
    used = (anchors >= 0).astype(jnp.float32)
    accepted = leading_run(correct)
    metrics = {"loss": loss,
               "position_accuracy": jnp.sum(correct, axis=(0, 1)) / jnp.maximum(jnp.sum(valid, axis=(0, 1)), 1.0),
               "tau_proxy": 1.0 + jnp.sum(accepted * used) / jnp.maximum(jnp.sum(used), 1.0),
               "anchors": jnp.sum(used) / rows}
    return loss, metrics


@functools.partial(jax.jit, static_argnames=("config", "target_config", "train", "tensor_parallel"),
                   donate_argnames=("state",))
def train_step(state: TrainState, learning_rate: jax.Array, target: TargetParams, tokens: jax.Array,
               loss_mask: jax.Array, *, config: DraftConfig, target_config: ModelConfig, train: DraftTrainConfig,
               tensor_parallel: TensorParallel | None = None) -> tuple[TrainState, dict]:
    """One pure AdamW step (``state`` donated: params and moments are not held twice): anchors
    drawn from a key folded with the step, so a resumed run draws the same anchors as an
    uninterrupted one."""
    key = jax.random.fold_in(jax.random.key(train.seed), state.step)
    anchors = data.sample_anchors(key, loss_mask, train.num_anchors)
    grads, metrics = jax.grad(draft_loss, has_aux=True)(
        state.params, target, tokens, loss_mask, anchors, config=config, target_config=target_config,
        gamma=data.default_gamma(config.block_size) if train.gamma is None else train.gamma,
        dtype=jnp.dtype(train.compute_dtype), tensor_parallel=tensor_parallel)
    metrics["grad_norm"] = global_norm(grads)
    return apply_gradients(state, grads, make_optimizer(train.optim), learning_rate), metrics


def _postfix(metrics: dict) -> dict:
    """Progress-bar fields: loss, τ proxy and the accuracy at block positions 1, 2, 4, 8 (those
    the block has)."""
    acc = metrics["position_accuracy"]
    shown = [k for k in (1, 2, 4, 8) if k <= len(acc)]
    return {"loss": f"{metrics['loss']:.3f}", "tau~": f"{metrics['tau_proxy']:.2f}",
            "acc@" + ",".join(map(str, shown)): ",".join(f"{acc[k - 1]:.2f}" for k in shown)}


def open_draft_run(target_config: ModelConfig, target_path: str | Path | None, out_dir: str | Path,
                   draft_config: DraftConfig, train: DraftTrainConfig, data_record: dict, *,
                   ckpt_dir: str | Path | None = None, resume: bool = False, overwrite: bool = False) -> Path:
    """Claim the run's checkpoint folder (default OUT.ckpt, returned) and ``out_dir`` for the
    target (its folder and config: its weights need not be loaded yet), draft, data and recipe
    (``claim_run_folders``), before any training work."""
    out_dir = Path(out_dir)
    ckpt_dir = Path(ckpt_dir) if ckpt_dir else out_dir.with_name(out_dir.name + ".ckpt")
    draft_config.check_target(target_config)
    run = {"target": {"path": str(Path(target_path).absolute()) if target_path else None,
                      "config": dataclasses.asdict(target_config)},
           "draft": dataclasses.asdict(draft_config), "data": data_record, "train": run_recipe(train)}
    claim_run_folders(ckpt_dir, out_dir, run, resume=resume, overwrite=overwrite,
                      inputs={"--target": target_path} if target_path else None)
    return ckpt_dir


def train_draft(target: Target, rows: data.TokenRows, out_dir: str | Path, draft_config: DraftConfig,
                train: DraftTrainConfig, *, ckpt_dir: str | Path | None = None, resume: bool = False,
                overwrite: bool = False, data_record: dict | None = None,
                export_dtype="bfloat16", max_shard_mb: int = DEFAULT_MAX_SHARD_MB) -> Draft:
    """Train a draft on token rows with ``target`` frozen, export it (z-lab HF format) to
    ``out_dir`` (a non-empty one only when resuming from checkpoints or with ``overwrite``) and
    return it as loaded (f32 training params). ``data_record`` describes the rows for resuming
    (default: their shape)."""
    if draft_config.selector is not None:
        raise ValueError("training DFlash2 drafts (convolutions, candidate selector) is not supported: "
                         "train_draft trains DFlash drafts")
    rows = data.trainable_rows(rows, target.config.vocab_size)
    data_record = {"rows": len(rows), "seq_len": rows.seq_len} if data_record is None else data_record
    ckpt_dir = open_draft_run(target.config, target.path, out_dir, draft_config, train, data_record,
                              ckpt_dir=ckpt_dir, resume=resume, overwrite=overwrite)
    return train_in_run(target, rows, out_dir, draft_config, train, ckpt_dir, resume=resume,
                        export_dtype=export_dtype, max_shard_mb=max_shard_mb)


def train_in_run(target: Target, rows: data.TokenRows, out_dir: str | Path, draft_config: DraftConfig,
                 train: DraftTrainConfig, ckpt_dir: Path, *, resume: bool, export_dtype="bfloat16",
                 max_shard_mb: int = DEFAULT_MAX_SHARD_MB) -> Draft:
    """``train_draft``'s training and export, in a run folder ``open_draft_run`` has claimed (the
    CLI claims it before building its rows, which can take long, and checks them as
    ``train_draft`` does)."""
    params = init_draft_params(draft_config, jax.random.key(train.seed + 1), jnp.float32)
    state = TrainState.create(params, make_optimizer(train.optim))
    if target.tensor_parallel is not None:  # the draft trains whole on every device of the split target's mesh
        state = jax.device_put(state, NamedSharding(target.tensor_parallel.mesh, P()))
    target_params = cast_params(target.params, jnp.dtype(train.compute_dtype))
    step_fn = functools.partial(train_step, config=draft_config, target_config=target.config, train=train,
                                tensor_parallel=target.tensor_parallel)
    state, _ = run_training(
        state, lambda s, lr, t, m: step_fn(s, lr, target_params, t, m),
        lambda step: rows.batch(step, train.batch_size, train.seed), optim=train.optim, ckpt_dir=ckpt_dir,
        save_every=train.save_every, resume=resume, time_budget=train.time_budget, desc="draft", postfix=_postfix)
    export_draft(draft_config, state.params, out_dir, dtype=export_dtype, overwrite=True, max_shard_mb=max_shard_mb,
                 progress=True)
    return Draft(draft_config, state.params, Path(out_dir))


# ---------------------------------------------------------------------------------------------
# Data: text or token files, responses regenerated by the target, held-out prompts.

def read_training_data(specs: Sequence[str]) -> tuple[dict[Path, data.TokenRows], list[str]]:
    """``--data`` read, not yet tokenized: token files (.npz) as rows, by path; the text of text
    files (paths or globs) and of the training split of folders of ``*.py`` (or ``stdlib``).
    JSON Lines is refused rather than trained on as raw text, and so is data with no text."""
    token_files, text_paths = {}, []
    for spec in specs:
        if spec == "stdlib" or Path(spec).is_dir():
            text_paths += data.source_files(data.stdlib_root() if spec == "stdlib" else spec)[0]
            continue
        for path in data.expand_paths([spec]):
            if path.suffix.lower() == ".jsonl":
                raise ValueError(f"--data {path}: JSON Lines files are not read as training data (they would be "
                                 "trained on as raw text); pass text files, folders of *.py or .npz token files")
            if path.suffix.lower() == ".npz":
                token_files[path] = data.load_token_file(path)
            else:
                text_paths.append(path)
    texts = data.read_texts(text_paths)
    if not token_files and not texts:
        raise ValueError(f"no training text in --data (all {len(text_paths)} files empty)")
    return token_files, texts


def sample_prompts(documents: Sequence[np.ndarray], count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens cut at random offsets of random documents."""
    rng = np.random.default_rng(seed)
    long_enough = [d for d in documents if len(d) > length]
    if not long_enough:
        raise ValueError(f"no document is longer than the prompt length {length}")
    prompts = []
    for _ in range(count):
        doc = long_enough[rng.integers(len(long_enough))]
        start = rng.integers(len(doc) - length)
        prompts.append(doc[start:start + length].tolist())
    return prompts


def stop_token_ids(target: Target) -> list[int]:
    """Where the target's generation stops, as ``python -m dflash_jax.generate`` decides it
    (``Tokenizer.stop_token_ids``: generation_config.json, config.json and the tokenizer's eos of
    its folder). A folder without tokenizer.json: config.json's eos_token_id only, with a warning."""
    if target.path is not None and (Path(target.path) / "tokenizer.json").is_file():
        return Tokenizer(target.path).stop_token_ids
    warnings.warn(f"no tokenizer.json in the target folder {target.path}: generation stops only on config.json's "
                  f"eos_token_id {list(target.config.eos_token_ids)}, not on generation_config.json's or the "
                  "tokenizer's eos", stacklevel=2)
    return list(target.config.eos_token_ids)


def regenerate(target: Target, prompts: Sequence[Sequence[int]], *, seq_len: int, temperature: float,
               batch_size: int, pad_id: int, seed: int = 0, done: Sequence[data.TokenRows] = (),
               on_batch: Callable[[int, data.TokenRows], None] | None = None) -> data.TokenRows:
    """Responses written by the target itself (batched on-device generation, a progress bar over
    the batches, stopping at ``stop_token_ids(target)``) filling rows of ``seq_len``; only
    response tokens are supervised. Batches of ``batch_size`` prompts and a smaller last one: two
    shapes to compile at most, and no sequence generated in vain. Each batch's rows go to
    ``on_batch(index of its first prompt, rows)`` when made; ``done`` holds the rows of the first
    batches, made earlier (an interrupted run's), which are not generated again (each batch's
    seed depends only on its position)."""
    from dflash_jax.runtime.generation import generate

    if max(len(p) for p in prompts) >= seq_len:
        raise ValueError(f"a prompt of {max(len(p) for p in prompts)} tokens leaves no room for a response in "
                         f"rows of seq_len {seq_len}")
    sampling = SamplingConfig(temperature=temperature)
    stop = stop_token_ids(target) or None
    parts = list(done)
    first = sum(len(part) for part in parts)
    for i in tqdm(range(first, len(prompts), batch_size), desc="regenerate", unit="batch", dynamic_ncols=True,
                  initial=-(-first // batch_size), total=-(-len(prompts) // batch_size)):
        chunk = list(prompts[i:i + batch_size])
        new = [seq_len - len(p) for p in chunk]
        result = generate(target, chunk, max_new_tokens=new, sampling=sampling, stop_token_ids=stop, seed=seed + i)
        parts.append(data.prompt_response_rows(chunk, result.tokens, seq_len, pad_id))
        if on_batch is not None:
            on_batch(i, parts[-1])
    return data.concat_rows(parts)


REGENERATED_FILE = "regenerated.npz"  # in the run's checkpoint folder
REGENERATED_PARTS = "regenerated.parts"  # the finished batches of an unfinished regeneration


def regenerated_rows(ckpt_dir: Path, record: dict, make: Callable[..., data.TokenRows]) -> data.TokenRows:
    """The rows ``make(done=..., on_batch=...)`` (``regenerate``'s arguments) regenerates, kept in
    ``ckpt_dir`` with ``record`` (JSON: everything they depend on). A later call with an equal
    record, such as a resumed run, reads them back instead of generating again; a different
    record regenerates and replaces them. Each finished batch is kept as it comes, so a run
    interrupted while generating goes on from its last finished batch."""
    path, key = Path(ckpt_dir) / REGENERATED_FILE, json.dumps(record, sort_keys=True)
    if path.is_file() and data.token_file_record(path) == key:
        print(f"train_draft: reusing the target's responses in {path}")
        return data.load_token_file(path)
    parts_dir = path.with_name(REGENERATED_PARTS)
    done = _finished_batches(parts_dir, key)
    if done:
        print(f"train_draft: {sum(len(part) for part in done)} responses kept from an interrupted run in "
              f"{parts_dir}; generating the rest")
    parts_dir.mkdir(exist_ok=True)

    def keep(first: int, rows: data.TokenRows) -> None:
        data.save_token_file(parts_dir / f"{first:09d}.npz", rows, record=key)

    rows = make(done=done, on_batch=keep)
    data.save_token_file(path, rows, record=key)
    shutil.rmtree(parts_dir)
    return rows


def _finished_batches(parts_dir: Path, key: str) -> list[data.TokenRows]:
    """The batches kept in ``parts_dir`` for ``key``, in order, as far as they run unbroken from
    the first prompt; the other files there (another record's, half-written ones) are deleted."""
    if not parts_dir.is_dir():
        return []
    done, expected = [], 0
    for file in sorted(parts_dir.iterdir()):
        if file.stem.isdigit() and int(file.stem) == expected and data.token_file_record(file) == key:
            done.append(data.load_token_file(file))
            expected += len(done[-1])
        else:
            file.unlink()
    return done


def evaluate_tau(target: Target, draft: Draft, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                 temperature: float, seed: int = 0) -> dict:
    """τ (mean tokens per step) of DFlash generation on ``prompts``, and the speedup over plain
    decoding (tok/s, same batch; None when plain decoding timed no tokens). Generation stops at
    ``stop_token_ids(target)``."""
    from dflash_jax.runtime.generation import generate

    sampling = SamplingConfig(temperature=temperature)
    stop = stop_token_ids(target) or None
    spec = generate(target, prompts, draft=draft, max_new_tokens=max_new_tokens, sampling=sampling,
                    stop_token_ids=stop, seed=seed).stats
    plain = generate(target, prompts, max_new_tokens=max_new_tokens, sampling=sampling, stop_token_ids=stop,
                     seed=seed).stats
    ours, theirs = spec.summary(), plain.summary()  # undefined values as None
    return {"temperature": temperature, "tau": ours["tau"], "position_acceptance": ours["position_acceptance"],
            "histogram": ours["histogram"], "tokens_per_second": ours["tokens_per_second"],
            "plain_tokens_per_second": theirs["tokens_per_second"], "speedup": spec.speedup_over(plain)}


@one_line_warnings()
@interrupt_exits()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash_jax.training.train_draft", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="target HF folder (with tokenizer.json)")
    parser.add_argument("--out", required=True, help="output draft folder (z-lab HF format)")
    parser.add_argument("--data", nargs="+", default=None,
                        help="token files (.npz, rows of --seq-len), text files or globs (packed as raw text; "
                             ".jsonl is refused), folders of *.py (their training split), or 'stdlib' (default "
                             "without --prompts)")
    parser.add_argument("--regenerate", type=at_least(1), default=0, metavar="N",
                        help="train on N responses generated by the target to prompts cut from --data's text "
                             "(--prompt-len tokens each), or to the first N of --prompts")
    parser.add_argument("--prompts", default=None, metavar="FILE",
                        help="--regenerate's prompts: one per line (.txt), or per line an object with a "
                             "\"prompt\" string or a \"messages\" chat (.jsonl), as generate --batch-file reads them")
    add_chat_arguments(parser, "render --prompts with the target's chat template (a text prompt is one user "
                               "turn), as generate --chat does: the draft then learns the target's chat answers")
    parser.add_argument("--prompt-len", type=at_least(1), default=64,
                        help="prompt tokens for --regenerate/--eval-prompts")
    parser.add_argument("--regen-temperature", type=non_negative_float, default=0.0,
                        help="--regenerate's sampling temperature (0: greedy)")
    parser.add_argument("--regen-batch", type=at_least(1), default=256)
    parser.add_argument("--save-data", default=None, help="write the training rows to this .npz token file")
    parser.add_argument("--num-layers", type=at_least(1), default=2)
    parser.add_argument("--block-size", type=at_least(2), default=16)
    parser.add_argument("--target-layer-ids", default=None, help="comma-separated z-lab ids (default: build rule)")
    parser.add_argument("--mask-token-id", type=int, default=None, help="default: the target's <|mask|>")
    defaults = DraftTrainConfig()
    parser.add_argument("--steps", type=at_least(1), default=defaults.optim.steps)
    parser.add_argument("--batch", type=at_least(1), default=defaults.batch_size,
                        help="rows per step (activations grow with rows x anchors: at Qwen3-8B shape, 512 "
                             "anchors take ~8 GiB for one row and one draft layer, ~4.7 GiB more per layer, "
                             "~39 GiB for 8 rows)")
    parser.add_argument("--seq-len", type=at_least(2), default=512)
    parser.add_argument("--anchors", type=at_least(1), default=defaults.num_anchors)
    parser.add_argument("--lr", type=positive_float, default=defaults.optim.lr)
    parser.add_argument("--gamma", type=positive_float, default=None, help="loss decay (default 7 for block 16)")
    parser.add_argument("--save-every", type=at_least(1), default=defaults.save_every)
    parser.add_argument("--seed", type=random_seed, default=defaults.seed)
    parser.add_argument("--time-budget", type=positive_float, default=None, metavar="SECONDS",
                        help="fit training (compile included) in this time: fewer steps, same schedule shape "
                             "(with --resume: the steps left)")
    parser.add_argument("--max-shard-mb", type=at_least(1), default=DEFAULT_MAX_SHARD_MB,
                        help="largest safetensors shard of the exported draft, MB")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"],
                        help=f"compute dtype, and the frozen target's; the draft's master weights stay float32 "
                             f"({DTYPE_DEFAULT_HELP})")
    parser.add_argument("--tp", type=at_least(1), default=1,
                        help="split the frozen target over this many devices (tensor parallelism); the draft "
                             "trains whole on each")
    parser.add_argument("--ckpt-dir", default=None,
                        help="orbax checkpoints, run.json and train_log.json of one run (default OUT.ckpt)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --ckpt-dir (same target, data and settings; --steps included)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty --out (otherwise refused unless --resume continues the run "
                             "that wrote it)")
    parser.add_argument("--eval-prompts", type=at_least(0), default=0, metavar="N",
                        help="after training, measure τ of the exported draft on N prompts from the held-out "
                             "files of --eval-corpus (required with --eval-only)")
    parser.add_argument("--eval-new-tokens", type=at_least(1), default=256)
    parser.add_argument("--eval-corpus", default="stdlib", help="'stdlib' or a folder: prompts from its held-out split")
    parser.add_argument("--eval-only", action="store_true", help="skip training: evaluate the draft in --out")
    parser.add_argument("--compile-cache", metavar="DIR", help=COMPILE_CACHE_HELP)
    args = parser.parse_args(argv)
    if args.eval_only and not args.eval_prompts:
        parser.error("--eval-only evaluates the draft in --out on held-out prompts: pass --eval-prompts N")
    if args.regenerate and not args.prompts and args.prompt_len > args.seq_len - 2:
        parser.error(f"--prompt-len {args.prompt_len} must be at most --seq-len - 2 ({args.seq_len - 2}): the "
                     "target's responses to --regenerate prompts fill the rest of each row, and a block needs "
                     "two response tokens")
    if args.prompts and not args.regenerate:
        parser.error("--prompts are the prompts of --regenerate N: add it")
    if args.chat and not args.prompts:
        parser.error("--chat renders --prompts with the chat template: add --prompts FILE")
    try:
        chat_options(args)
    except ValueError as error:
        parser.error(str(error))
    if args.data is None:
        args.data = [] if args.prompts else ["stdlib"]
    args.dtype = args.dtype or default_dtype()
    if args.save_data and (Path(args.save_data).suffix != ".npz" or not Path(args.save_data).parent.is_dir()):
        parser.error(f"--save-data {args.save_data}: must name a .npz file in an existing folder")

    with reported_as_errors():  # everything that reads the user's input, cheapest first; weights last
        keep_compiled_programs(args.compile_cache)
        target_config = load_target_config(args.target)
        tokenizer = data.load_tokenizer(args.target)
        eos_id = target_config.eos_token_ids[0] if target_config.eos_token_ids else None
        eval_prompts = _eval_prompts(args, tokenizer, eos_id) if args.eval_prompts else None
        tensor_parallel = None if args.tp == 1 else TensorParallel(make_mesh(args.tp), replicate_draft=True)
        if tensor_parallel is not None:  # before the run's folders are claimed (with its experts as loaded)
            local_config(loaded_config(args.target, args.dtype, tp=args.tp), args.tp)
        if args.eval_only:
            target = load_target(args.target, dtype=args.dtype, tensor_parallel=tensor_parallel)
            draft = load_draft(args.out, target, dtype=args.dtype)
        else:
            target, draft_config, train, ckpt_dir, rows = _open_cli_run(args, target_config, tokenizer, eos_id,
                                                                        tensor_parallel)
    if not args.eval_only:
        train_in_run(target, rows, args.out, draft_config, train, ckpt_dir, resume=args.resume,
                     max_shard_mb=args.max_shard_mb)
        print(f"train_draft: exported {args.out}")
        if eval_prompts:  # τ of the exported (bfloat16) files, as --eval-only and users load them
            draft = load_draft(args.out, target, dtype=args.dtype)
    if eval_prompts:
        results = []
        for temperature in (0.0, 0.7):
            with announced("train_draft", f"evaluating at T={temperature}: {len(eval_prompts)} prompts x "
                                          f"{args.eval_new_tokens} new tokens, with the draft and without"):
                results.append(r := evaluate_tau(target, draft, eval_prompts, max_new_tokens=args.eval_new_tokens,
                                                 temperature=temperature))
            print(f"eval T={temperature}: tau {or_na(r['tau'], '{:.3f}')}, speedup "
                  f"{or_na(r['speedup'], '{:.2f}x')} ({or_na(r['tokens_per_second'], '{:.0f}')} vs "
                  f"{or_na(r['plain_tokens_per_second'], '{:.0f}')} tok/s)")
        path = Path(args.out).with_name(Path(args.out).name + ".eval.json")
        path.write_text(json.dumps(results, indent=1))
        print(f"train_draft: wrote {path}")


def _eval_prompts(args, tokenizer, eos_id: int | None) -> list[list[int]]:
    """``--eval-prompts`` prompts cut from the held-out files of ``--eval-corpus``."""
    root = data.stdlib_root() if args.eval_corpus == "stdlib" else args.eval_corpus
    heldout = data.encode_documents(tokenizer, data.read_texts(data.source_files(root)[1]), eos_id)
    return sample_prompts(heldout, args.eval_prompts, args.prompt_len, seed=12345)


def _open_cli_run(args, target_config: ModelConfig, tokenizer, eos_id: int | None,
                  tensor_parallel: TensorParallel | None) -> tuple[Target, DraftConfig, DraftTrainConfig, Path,
                                                                   data.TokenRows]:
    """The CLI's run, checked cheapest first: the draft's shape and the data files, then the run's
    folders (claimed), then the target's weights and the training rows (tokenized or generated
    by the target: the long part)."""
    mask_id = args.mask_token_id if args.mask_token_id is not None else find_mask_token(
        args.target, target_config.vocab_size)
    ids = [int(i) for i in args.target_layer_ids.split(",")] if args.target_layer_ids else None
    draft_config = new_draft_config(target_config, num_layers=args.num_layers, block_size=args.block_size,
                                    mask_token_id=mask_id, target_layer_ids=ids)
    token_files, texts = read_training_data(args.data) if args.data else ({}, [])
    if args.regenerate and args.prompts and texts:
        raise ValueError("with --prompts, --regenerate takes its prompts from that file; the text of --data would "
                         "go unused: pass only .npz token files in --data (or none)")
    if args.regenerate and not args.prompts and not texts:
        raise ValueError("--regenerate cuts its prompts from the text of --data, and --data holds only .npz "
                         "token files: add text files or folders, or give --prompts FILE")
    file_prompts = _file_prompts(args) if args.prompts else None
    for path, rows in token_files.items():
        if rows.seq_len != args.seq_len:
            raise ValueError(f"--data {path} holds rows of {rows.seq_len} tokens, not --seq-len {args.seq_len}: "
                             f"pass --seq-len {rows.seq_len}")
        data.check_token_ids(rows, target_config.vocab_size, f"--data {path}")
    train = DraftTrainConfig(optim=OptimConfig(steps=args.steps, lr=args.lr), num_anchors=args.anchors,
                             batch_size=args.batch, gamma=args.gamma, seed=args.seed,
                             compute_dtype=args.dtype, save_every=args.save_every, time_budget=args.time_budget)
    # a resumed run must read the same data, not only the same paths
    data_record = {"data": args.data, "sha256": data.data_digest(texts, token_files.values()),
                   "seq_len": args.seq_len, "regenerate": args.regenerate}
    if args.regenerate:
        data_record.update(prompt_len=args.prompt_len, regen_temperature=args.regen_temperature,
                           regen_batch=args.regen_batch)  # batches draw their own seeds
    if file_prompts:
        data_record.update(prompts=str(Path(args.prompts).absolute()), chat=args.chat,
                           prompts_sha256=_prompts_digest(file_prompts))
    specs = [spec for spec in args.data if spec != "stdlib"]  # folders as themselves, the rest as files
    folders = [Path(spec) for spec in specs if Path(spec).is_dir()]
    files = data.expand_paths([spec for spec in specs if not Path(spec).is_dir()])
    read_or_written = [("--save-data", args.save_data), ("--prompts", args.prompts)] + [
        ("--data", path) for path in folders + files]
    for flag, path in read_or_written:
        if path and lies_within(Path(path), Path(args.out)):
            raise ValueError(f"{flag} {path} lies in --out {args.out}, which the export replaces whole: "
                             "keep it outside --out")
    ckpt_dir = open_draft_run(target_config, args.target, args.out, draft_config, train, data_record,
                              ckpt_dir=args.ckpt_dir, resume=args.resume, overwrite=args.overwrite)
    target = load_target(args.target, dtype=args.dtype, tensor_parallel=tensor_parallel)
    rows = _training_rows(args, target, tokenizer, eos_id, token_files, texts, file_prompts, ckpt_dir, data_record)
    return target, draft_config, train, ckpt_dir, rows


def _file_prompts(args) -> list[list[int]]:
    """The first ``--regenerate`` prompts of ``--prompts`` (chat-rendered with ``--chat``), as the
    target's tokenizer encodes them (special tokens of the template as such); each must leave two
    tokens of the row for the response."""
    tokenizer = Tokenizer(args.target)
    prompts = read_prompt_file(args.prompts, "--prompts")
    if len(prompts) < args.regenerate:
        raise ValueError(f"--regenerate {args.regenerate}, but --prompts {args.prompts} holds {len(prompts)} prompts")
    lines = list(prompts)[:args.regenerate]
    texts = render_prompts(tokenizer, [prompts[line] for line in lines], **chat_options(args), flag="--prompts")
    encoded = [tokenizer.encode(text) for text in texts]
    too_long = [i for i, p in enumerate(encoded) if len(p) > args.seq_len - 2]
    if too_long:
        raise ValueError(f"{len(too_long)} of the {len(encoded)} prompts of --prompts (the first: line "
                         f"{lines[too_long[0]]}, {len(encoded[too_long[0]])} tokens) leave less than two tokens of "
                         f"--seq-len {args.seq_len} for the response: raise --seq-len or shorten them")
    if any(not p for p in encoded):
        raise ValueError(f"--prompts {args.prompts}:{lines[[len(p) for p in encoded].index(0)]} encodes to no tokens")
    return encoded


def _prompts_digest(prompts: Sequence[Sequence[int]]) -> str:
    """A digest of the prompts, where each one ends included ([[5, 6], [7]] is not [[5], [6, 7]])."""
    digest = hashlib.sha256()
    for prompt in prompts:
        digest.update(np.asarray([len(prompt), *prompt], np.int64).tobytes())
    return digest.hexdigest()


def _training_rows(args, target: Target, tokenizer, eos_id: int | None, token_files: dict[Path, data.TokenRows],
                   texts: list[str], file_prompts: list[list[int]] | None, ckpt_dir: Path,
                   data_record: dict) -> data.TokenRows:
    """The CLI's training rows: token files as they are, text packed, or target-written responses
    (regenerated once per run: ``--resume`` reads them back from the checkpoint folder)."""
    pad_id = eos_id if eos_id is not None else 0
    parts, documents = list(token_files.values()), []
    if texts:
        with announced("train_draft", f"tokenizing {len(texts)} text files"):
            documents = data.encode_documents(tokenizer, texts, eos_id)
    if args.regenerate:
        prompts = file_prompts or sample_prompts(documents, args.regenerate, args.prompt_len, args.seed)
        record = {"target": str(Path(args.target).absolute()), "dtype": args.dtype, "data": data_record,
                  "seed": args.seed, "prompts_sha256": _prompts_digest(prompts)}
        parts.append(regenerated_rows(ckpt_dir, record, functools.partial(
            regenerate, target, prompts, seq_len=args.seq_len, temperature=args.regen_temperature,
            batch_size=args.regen_batch, pad_id=pad_id, seed=args.seed)))
    elif documents:
        parts.append(data.pack_stream(documents, args.seq_len, name=f"the {len(texts)} text files of --data"))
    rows = data.trainable_rows(data.concat_rows(parts), target.config.vocab_size)
    if args.save_data:
        data.save_token_file(args.save_data, rows)
        print(f"train_draft: wrote the training rows to {args.save_data}")
    print(f"train_draft: {len(rows)} rows of {rows.seq_len} tokens, {int(rows.loss_mask.sum()):,} supervised")
    return rows


if __name__ == "__main__":
    exit_with(main)
