"""Train a tiny Qwen3-architecture target from scratch on an offline corpus (the stdlib source),
plus the training machinery the draft trainer shares (optimizer, train state, orbax loop).

    python -m dflash_jax.training.train_target --out DIR [--corpus stdlib] [--steps N] [--batch N]
        [--resume | --overwrite]

Writes an HF Qwen3 folder (config.json, safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) that this library and transformers both load, plus corpus.json (the
held-out files) and train_summary.json. Orbax checkpoints, the run's settings (run.json) and its
per-step log (train_log.json, written with every checkpoint) go to ``--ckpt-dir`` (default
DIR.ckpt), which holds one run: a new run refuses a folder with checkpoints, ``--resume``
continues the run there (with the same settings). A non-empty ``--out`` is replaced only with
``--overwrite`` or by ``--resume`` of the run that run.json records as writing it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from checkpoints_convert import export_target
from checkpoints_convert.convert import check_replaceable, check_writable
from checkpoints_convert.export import DEFAULT_MAX_SHARD_MB
from dflash_jax.training import data
from dflash_jax.model import target as target_model
from dflash_jax.model.cache import init_cache
from dflash_jax.entrypoints.cli import (COMPILE_CACHE_HELP, DTYPE_DEFAULT_HELP, at_least, default_dtype,
                            deferred_interrupts, exit_with, interrupt_exits, keep_compiled_programs,
                            non_negative_float, one_line_warnings, positive_float, random_seed,
                            reported_as_errors)
from dflash_jax.model.config import ModelConfig, uniform_config
from dflash_jax.model.params import TargetParams, cast_params, init_target_params
from dflash_jax.model.sharding import TensorParallel, local_config, specs, target_layout
from pallas_kernels.sizes import is_power_of_2


# ---------------------------------------------------------------------------------------------
# Shared command-line helpers.

@contextlib.contextmanager
def announced(desc: str, what: str) -> Iterator[None]:
    """Print ``what`` a long preparation step does before it starts and its time after, so a
    silent wait of half a minute (tokenizing the stdlib) is explained."""
    print(f"{desc}: {what} ...", flush=True)
    began = time.perf_counter()
    yield
    print(f"{desc}: {what}: done in {time.perf_counter() - began:.1f} s", flush=True)


# ---------------------------------------------------------------------------------------------
# Shared training machinery.

@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm clipping, weight decay on matrices only, and a learning rate that
    warms up linearly over ``warmup_frac`` of the steps then decays to 0 on a cosine."""

    steps: int
    lr: float
    warmup_frac: float = 0.04
    clip: float = 1.0
    weight_decay: float = 0.01
    b2: float = 0.95

    def learning_rate(self, step: int, total_steps: int) -> float:
        """Rate of step ``step`` (0-based) in a run of ``total_steps``."""
        warmup = max(1, round(self.warmup_frac * total_steps))
        if step < warmup:
            return self.lr * (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(config: OptimConfig) -> optax.GradientTransformation:
    """The update direction at unit rate; ``apply_gradients`` scales it by the step's rate, which
    comes from the host so a time budget can shorten the schedule without recompiling."""
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(config.clip),
                       optax.adamw(1.0, b2=config.b2, weight_decay=config.weight_decay, mask=decay_mask))


@struct.dataclass
class TrainState:
    """f32 master params, optimizer state and the step count (all checkpointed)."""

    step: jax.Array
    params: Any
    opt_state: Any

    @classmethod
    def create(cls, params, optimizer: optax.GradientTransformation) -> "TrainState":
        return cls(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


def global_norm(tree) -> jax.Array:
    """L2 norm over every leaf (logged before clipping)."""
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def apply_gradients(state: TrainState, grads, optimizer: optax.GradientTransformation,
                    learning_rate: jax.Array) -> TrainState:
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    updates = jax.tree.map(lambda u: u * learning_rate.astype(u.dtype), updates)
    return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates),
                         opt_state=opt_state)


RUN_FILE, SCHEDULE_FILE, LOG_FILE = "run.json", "schedule.json", "train_log.json"


def write_json(path: Path, value) -> None:
    """Write ``value`` as JSON, whole or not at all (``data.written_whole``): an interruption
    leaves the old file as it was."""
    with data.written_whole(path) as file:
        file.write(json.dumps(value).encode())


def saved_steps(ckpt_dir: Path) -> list[int]:
    """Steps of the orbax checkpoints in ``ckpt_dir``."""
    import orbax.checkpoint as ocp

    if not (ckpt_dir / "state").is_dir():
        return []
    with ocp.CheckpointManager(ckpt_dir / "state") as manager:
        return list(manager.all_steps())


def run_recipe(train) -> dict:
    """A train config as JSON, less what may change when a run is resumed (checkpoint interval,
    time budget)."""
    return {k: v for k, v in dataclasses.asdict(train).items() if k not in ("save_every", "time_budget")}


def _differences(stored, now, prefix: str = "") -> list[str]:
    """'key.path: stored value, new value' for each leaf where two JSON records differ."""
    if isinstance(stored, dict) and isinstance(now, dict):
        return [line for key in sorted(stored.keys() | now.keys())
                for line in _differences(stored.get(key), now.get(key), f"{prefix}{key}.")]
    return [] if stored == now else [f"{prefix.rstrip('.')}: {stored!r} in the stored run, {now!r} now"]


def lies_within(path: Path, folder: Path) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def claim_run_folders(ckpt_dir: Path, out_dir: Path, run: dict, *, resume: bool, overwrite: bool,
                      inputs: Mapping[str, str | Path] | None = None) -> None:
    """Make ``ckpt_dir`` the home of the run described by ``run`` (JSON: model, data, recipe;
    recorded there as run.json, with the ``out_dir`` it writes) and check that it may write
    ``out_dir``. Without ``resume``, ``ckpt_dir`` must hold no checkpoints (orbax would keep
    another run's steps and skip this one's); with it, it must hold checkpoints of an equal
    ``run``. A non-empty ``out_dir`` is replaced only with ``overwrite`` or by a resumed run whose
    run.json records it as its output. The export replaces ``out_dir`` whole, so it must not hold
    ``ckpt_dir``, nor hold or lie inside the folders of ``inputs`` (flag: folder the run reads),
    and it must be writable (``check_writable``). Raises FileNotFoundError / FileExistsError /
    ValueError / OSError before writing anything; deletes nothing."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    if lies_within(ckpt_dir, out_dir):
        raise ValueError(f"--ckpt-dir {ckpt_dir} lies in --out {out_dir}, which the export replaces whole: "
                         "choose a --ckpt-dir outside it")
    for flag, folder in (inputs or {}).items():
        if lies_within(Path(folder), out_dir) or lies_within(out_dir, Path(folder)):
            raise ValueError(f"--out {out_dir} and {flag} {folder} are the same folder or one holds the other, "
                             "and the export replaces --out whole: choose an --out apart from it")
    steps = saved_steps(ckpt_dir)
    run = json.loads(json.dumps(run))
    if resume and not steps:
        raise FileNotFoundError(f"--resume: no checkpoints in {ckpt_dir} to resume; start the run without --resume")
    if steps and not resume:
        raise FileExistsError(f"{ckpt_dir} already holds checkpoints (steps {steps}) of a training run: pass "
                              "--resume to continue that run, or choose another --ckpt-dir (or empty this one)")
    stored_out = None
    if steps:
        if not (ckpt_dir / RUN_FILE).is_file():
            raise ValueError(f"{ckpt_dir} holds checkpoints but no {RUN_FILE} describing their run, so resuming "
                             "cannot check it is the same run: choose another --ckpt-dir")
        stored = json.loads((ckpt_dir / RUN_FILE).read_text())
        stored_out = stored.pop("out", None)  # where the run writes is no part of what it is
        differences = _differences(stored, run)
        if differences:
            raise ValueError(f"--resume: the run in {ckpt_dir} differs from this one ("
                             + "; ".join(differences) + "). A resumed run keeps its model, data and recipe "
                             "(the learning-rate schedule is laid out over its --steps): pass the values it "
                             "was started with, or start a new run in another --ckpt-dir")
    own_output = stored_out is not None and Path(stored_out).resolve() == out_dir.resolve()
    check_replaceable(out_dir, overwrite=True)  # the export at the end replaces only a model folder
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())) and not (overwrite or own_output):
        why = ("this run does not continue one from its checkpoints" if not steps else
               f"the run in {ckpt_dir} writes {stored_out}" if stored_out else
               f"{ckpt_dir / RUN_FILE} does not record which --out its run writes")
        raise FileExistsError(f"{out_dir} already exists and is not empty ({why}): pass --overwrite to replace "
                              "it, or choose another --out")
    check_writable(out_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    write_json(ckpt_dir / RUN_FILE, {**run, "out": str(out_dir.absolute())})


def run_training(state: TrainState, step_fn: Callable, batch_fn: Callable[[int], tuple], *, optim: OptimConfig,
                 ckpt_dir: str | Path, save_every: int, resume: bool, desc: str,
                 postfix: Callable[[dict], dict], time_budget: float | None = None,
                 evaluate: Callable[[Any], dict] | None = None, eval_every: int = 0
                 ) -> tuple[TrainState, list[dict]]:
    """Run ``state, metrics = step_fn(state, learning_rate, *batch_fn(step))`` for ``optim.steps``
    steps with a tqdm bar, orbax checkpoints every ``save_every`` steps and at the end, resuming
    from the latest one (callers first claim ``ckpt_dir`` with ``claim_run_folders``).

    With ``time_budget`` (seconds, compile included; on a resumed run, for the steps left) the
    run ends at the first step that finds it spent; before that, the pace of the first 3-12
    steps run decides the number of steps that fit, and the schedule is
    laid out over that many (recorded in schedule.json for resuming); when the run then goes
    slower (evaluations, checkpoints, a busy machine) the schedule is shortened to end on time.
    ``evaluate(params)`` (held-out metrics) runs every ``eval_every`` steps and at the end.
    Batches and keys must be pure functions of the step so a resumed run repeats exactly what an
    uninterrupted one does. The log (one metrics dict per step, train_log.json) is written with
    every checkpoint; a resumed run continues it. A first Ctrl-C or SIGTERM ends the run after
    the step in progress with a checkpoint, then raises KeyboardInterrupt (a second one stops at
    once). Returns the final state and the whole log.
    """
    import orbax.checkpoint as ocp

    began = time.perf_counter()
    ckpt_dir = Path(ckpt_dir).absolute()
    total = optim.steps
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    history = []
    with ocp.CheckpointManager(ckpt_dir / "state", options=options) as manager:
        if resume and manager.latest_step() is not None:
            state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(state))
            total = json.loads((ckpt_dir / SCHEDULE_FILE).read_text())["total_steps"]
            # steps logged past the checkpoint were not kept: they run again
            history = [h for h in json.loads((ckpt_dir / LOG_FILE).read_text()) if h["step"] <= int(state.step)]
            print(f"{desc}: resuming {ckpt_dir} at step {int(state.step)} of {total}")
        else:
            write_json(ckpt_dir / SCHEDULE_FILE, {"total_steps": total})
        first = step = int(state.step)
        pace_from = None if time_budget is None else first + 2
        paced = None  # (step, time) where the pace measurement began
        # the pace is re-read over the last `window` steps, which span an evaluation when there are any
        window, step_times = max(10, eval_every), {}
        pending = []  # (step, metrics on the device) not logged yet

        def reschedule(message: str, per_step: float | None = None) -> None:
            """Record the new ``total`` (for resuming), show it on the bar and say why."""
            write_json(ckpt_dir / SCHEDULE_FILE, {"total_steps": total} | (
                {} if per_step is None else {"seconds_per_step": per_step}))
            bar.total = total
            bar.write(f"{desc}: {message}")

        def log_pending() -> None:
            while pending:
                done, metrics = pending.pop(0)
                metrics = {k: np.asarray(v).tolist() for k, v in jax.device_get(metrics).items()}
                history.append({"step": done, **metrics})
                bar.set_postfix(postfix(metrics), refresh=False)

        def save(step: int) -> None:
            log_pending()
            write_json(ckpt_dir / LOG_FILE, history)  # first: a resume drops steps past its checkpoint
            manager.save(step, args=ocp.args.StandardSave(state))

        def stopped(why: str) -> None:
            """After a checkpoint of ``step``: wait for it, and say how to go on (on stderr, where
            the bar is: stdout may be the closed pipe that stopped the run)."""
            manager.wait_until_finished()
            bar.write(f"{desc}: {why} at step {step} of {total}; checkpoint saved in {ckpt_dir}: --resume "
                      "continues the run", file=sys.stderr)

        with (tqdm(total=total, initial=first, desc=desc, dynamic_ncols=True) as bar,
              deferred_interrupts("finishing the step and saving a checkpoint") as interrupted):
            try:
                while step < total:
                    state, metrics = step_fn(state, jnp.float32(optim.learning_rate(step, total)), *batch_fn(step))
                    step += 1
                    # The previous step's metrics are read while this one runs: the host builds the next
                    # batch while the device works, instead of waiting for each step to end.
                    log_pending()
                    pending.append((step, metrics))
                    bar.update(1)
                    now = step_times[step] = time.perf_counter()
                    step_times.pop(step - window - 1, None)
                    if pace_from is not None and now - began >= time_budget:
                        # the budget ran out before the pace was measured (slow first steps, or too few
                        # steps left to measure it): end here
                        total, pace_from = step, None
                        reschedule(f"the time budget ran out after step {step}")
                    elif pace_from is not None and step == pace_from:
                        paced = (step, now)
                    elif pace_from is not None and step == pace_from + 10:
                        per_step = (now - paced[1]) / 10
                        total = min(total, step + max(0, int((time_budget - (now - began)) / per_step)))
                        pace_from = None
                        reschedule(f"{per_step * 1e3:.1f} ms/step, {total} steps fit the time budget", per_step)
                    elif paced is not None and pace_from is None and paced[0] < step < total:
                        # the recent pace, evaluations and checkpoints included
                        since = max(paced[0], step - window)
                        per_step = (now - step_times.get(since, paced[1])) / (step - since)
                        if (now - began) + (total - step) * per_step > 1.05 * time_budget:
                            total = step + max(0, int((time_budget - (now - began)) / per_step))
                            reschedule(f"slower than planned ({per_step * 1e3:.1f} ms/step lately), schedule "
                                       f"shortened to {total} steps", per_step)
                    if evaluate is not None and ((eval_every and step % eval_every == 0) or step == total):
                        log_pending()
                        history[-1].update(evaluate(state.params))
                        bar.write(f"{desc} step {step}: " + ", ".join(
                            f"{k} {v:.4f}" for k, v in history[-1].items() if k.startswith("heldout")))
                    stop = interrupted()  # read once: a signal between two reads would skip the save
                    if step % save_every == 0 or step == total or stop:
                        save(step)
                    if stop:  # at the last step too: the export and evaluation are left to --resume
                        stopped("interrupted")
                        raise KeyboardInterrupt
            except BrokenPipeError:  # the reader of the progress left (| head): keep the steps run
                if manager.latest_step() != step:
                    save(step)
                stopped("output closed")
                raise
        manager.wait_until_finished()
    return state, history


# ---------------------------------------------------------------------------------------------
# Target model.

@dataclasses.dataclass(frozen=True)
class TinyTargetShape:
    """Architecture of the tiny target (Qwen3, tied embeddings). Defaults: 12.9M params,
    25.8 MB in bf16, leaving room for a 3-layer draft (10.6 MB) under 40 MB."""

    vocab_size: int = 8192
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1024
    rope_theta: float = 10_000.0
    max_position_embeddings: int = 4096

    def __post_init__(self):
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim < 16 or not is_power_of_2(self.head_dim):
            raise ValueError(f"head_dim {self.head_dim} must be a power of two >= 16 (the attention kernels)")

    def model_config(self, eos_id: int) -> ModelConfig:
        return uniform_config(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           rope_theta=self.rope_theta, tie_word_embeddings=True,
                           max_position_embeddings=self.max_position_embeddings, eos_token_ids=(eos_id,))


def causal_forward(params: TargetParams, config: ModelConfig, tokens: jax.Array,
                   tap_layers: tuple[int, ...] = (),
                   tensor_parallel: TensorParallel | None = None) -> tuple[jax.Array, jax.Array | None]:
    """Plain causal forward of full rows [R, T] from position 0 (training, feature extraction):
    ``target.forward`` over a throwaway cache of one page per row, reference attention (which is
    differentiable). Returns final-normed hidden [R, T, H] and the concatenated taps. With
    ``tensor_parallel`` the params are split over its mesh (``dflash_jax.model.sharding``) and the
    forward runs as one program per device; its outputs are whole on every device."""
    if tensor_parallel is not None:
        local = local_config(config, tensor_parallel.size, expert_parallel=tensor_parallel.expert_parallel)

        def run(params, tokens):
            return causal_forward(params, local, tokens, tap_layers)

        layout = target_layout(params, config, tensor_parallel.expert_parallel)
        return jax.shard_map(run, mesh=tensor_parallel.mesh, in_specs=(specs(layout), P()),
                             out_specs=(P(), P() if tap_layers else None), check_vma=False)(params, tokens)
    rows, length = tokens.shape
    cache = init_cache(config, None, np.arange(rows, dtype=np.int32)[:, None], rows, length,
                       params.embed.dtype)
    hidden, taps, _ = target_model.forward(params, config, tokens, jnp.zeros((rows,), jnp.int32), cache,
                                           tap_layers=tap_layers, impl="reference")
    return hidden, taps


def lm_loss(params: TargetParams, config: ModelConfig, tokens: jax.Array, loss_mask: jax.Array,
            dtype) -> tuple[jax.Array, dict]:
    """Next-token cross-entropy over supervised targets, computed in ``dtype`` (f32 logits)."""
    hidden, _ = causal_forward(cast_params(params, dtype), config, tokens)
    logits = target_model.logits(cast_params(params, dtype), hidden[:, :-1])
    labels, mask = tokens[:, 1:], loss_mask[:, 1:].astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    loss = jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    accuracy = jnp.sum((jnp.argmax(logits, -1) == labels) * mask) / jnp.maximum(jnp.sum(mask), 1.0)
    return loss, {"loss": loss, "accuracy": accuracy}


@dataclasses.dataclass(frozen=True)
class TargetTrainConfig:
    shape: TinyTargetShape = TinyTargetShape()
    optim: OptimConfig = OptimConfig(steps=1200, lr=2e-3, weight_decay=0.1)
    seq_len: int = 512
    batch_size: int = 64
    seed: int = 0
    compute_dtype: str = "bfloat16"
    save_every: int = 500
    time_budget: float | None = None


@functools.partial(jax.jit, static_argnames=("config", "train"), donate_argnames=("state",))
def train_step(state: TrainState, learning_rate: jax.Array, tokens: jax.Array, loss_mask: jax.Array, *,
               config: ModelConfig, train: TargetTrainConfig) -> tuple[TrainState, dict]:
    """One pure AdamW step on a batch of rows (jitted once per (config, train); ``state`` donated)."""
    grads, metrics = jax.grad(lm_loss, has_aux=True)(state.params, config, tokens, loss_mask,
                                                     jnp.dtype(train.compute_dtype))
    metrics["grad_norm"] = global_norm(grads)
    return apply_gradients(state, grads, make_optimizer(train.optim), learning_rate), metrics


def make_evaluator(config: ModelConfig, rows: data.TokenRows, batch_size: int, dtype) -> Callable[[Any], dict]:
    """params -> {"heldout_loss", "heldout_accuracy"} over whole batches of ``rows``."""
    step = jax.jit(lambda p, t, m: lm_loss(p, config, t, m, jnp.dtype(dtype))[1])
    count = max(batch_size, len(rows) // batch_size * batch_size)

    def evaluate(params) -> dict:
        results = [step(params, rows.tokens[i:i + batch_size], rows.loss_mask[i:i + batch_size])
                   for i in range(0, min(count, len(rows)), batch_size)]
        return {f"heldout_{k}": float(np.mean([r[k] for r in results])) for k in ("loss", "accuracy")}

    return evaluate


@dataclasses.dataclass(frozen=True)
class TargetRun:
    """A target run opened by ``open_target_run``: its folders claimed, its data tokenized."""

    out_dir: Path
    ckpt_dir: Path
    train: TargetTrainConfig
    config: ModelConfig
    rows: data.TokenRows
    eval_rows: data.TokenRows
    corpus: dict  # corpus.json: the corpus, its held-out rule and files, the training file count
    resume: bool


def open_target_run(out_dir: str | Path, train: TargetTrainConfig, *, corpus: str | Path = "stdlib",
                    max_files: int | None = None, ckpt_dir: str | Path | None = None, resume: bool = False,
                    overwrite: bool = False, max_eval_rows: int = 128) -> TargetRun:
    """Everything a run reads from the user, checked before it writes: the split of ``corpus``
    (``"stdlib"``: the running interpreter's; or a folder of ``*.py``) and the run's folders
    (``claim_run_folders``: ``out_dir`` non-empty only when resuming the run that wrote it or with
    ``overwrite``); then the tokenizer, trained on the training split (read back on resume), and
    the packed training and held-out rows."""
    out_dir = Path(out_dir)
    ckpt_dir = Path(ckpt_dir) if ckpt_dir else out_dir.with_name(out_dir.name + ".ckpt")
    root = data.stdlib_root() if corpus == "stdlib" else Path(corpus)
    files, heldout = data.source_files(root)
    files = files[:max_files] if max_files else files
    texts = data.read_texts(files)
    claim_run_folders(ckpt_dir, out_dir, {"corpus": str(corpus if corpus == "stdlib" else root.absolute()),
                                          "max_files": max_files, "sha256": data.data_digest(texts),
                                          "train": run_recipe(train)},
                      resume=resume, overwrite=overwrite, inputs={"--corpus": root})
    staging = ckpt_dir / "tokenizer"
    if resume and (staging / "tokenizer.json").is_file():
        tokenizer = data.load_tokenizer(staging)
    else:
        with announced("train_target", f"training a {train.shape.vocab_size}-token tokenizer on {len(files)} files"):
            tokenizer = data.train_tokenizer(texts, train.shape.vocab_size, staging)
    eos_id = tokenizer.token_to_id(data.EOS_TOKEN)
    if tokenizer.get_vocab_size() != train.shape.vocab_size:
        warnings.warn(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, not the {train.shape.vocab_size} asked "
                      "for (a byte-level BPE holds at least the 256 bytes and its special tokens, and a small "
                      "corpus may give fewer merges); the model takes the tokenizer's size")
    config = dataclasses.replace(train.shape, vocab_size=tokenizer.get_vocab_size()).model_config(eos_id)
    with announced("train_target", f"tokenizing {len(files)} training and {len(heldout)} held-out files"):
        rows = data.pack_stream(data.encode_documents(tokenizer, texts, eos_id), train.seq_len,
                                name=f"the {len(files)} training files of {root}")
        eval_rows = data.pack_stream(data.encode_documents(tokenizer, data.read_texts(heldout), eos_id),
                                     train.seq_len, name=f"the {len(heldout)} held-out files of {root}")
    eval_rows = data.TokenRows(eval_rows.tokens[:max_eval_rows], eval_rows.loss_mask[:max_eval_rows])
    print(f"train_target: {len(files)} files, {rows.tokens.size:,} tokens ({len(heldout)} held-out files), "
          f"vocab {config.vocab_size}")
    return TargetRun(out_dir, ckpt_dir, train, config, rows, eval_rows,
                     {**data.corpus_manifest(root, heldout), "train_files": len(files)}, resume)


def train_target(run: TargetRun, *, eval_every: int = 250, max_shard_mb: int = DEFAULT_MAX_SHARD_MB):
    """Train the target of an opened run, tracking the loss on its held-out rows; export the HF
    folder (with the tokenizer, corpus.json and train_summary.json) to its ``out_dir`` and return
    (config, f32 params)."""
    train, config, rows, eval_rows = run.train, run.config, run.rows, run.eval_rows
    params = init_target_params(config, jax.random.key(train.seed), jnp.float32)
    state = TrainState.create(params, make_optimizer(train.optim))
    state, history = run_training(
        state, functools.partial(train_step, config=config, train=train),
        lambda step: rows.batch(step, train.batch_size, train.seed),
        optim=train.optim, ckpt_dir=run.ckpt_dir, save_every=train.save_every, resume=run.resume,
        time_budget=train.time_budget, desc="target",
        postfix=lambda m: {"loss": f"{m['loss']:.3f}", "acc": f"{m['accuracy']:.3f}"},
        evaluate=make_evaluator(config, eval_rows, train.batch_size, train.compute_dtype), eval_every=eval_every)

    out_dir = run.out_dir
    export_target(config, state.params, out_dir, dtype="bfloat16", overwrite=True, max_shard_mb=max_shard_mb,
                  side_files_from=run.ckpt_dir / "tokenizer", progress=True)
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": config.eos_token_ids[0],
                                                                "do_sample": False}))
    (out_dir / "corpus.json").write_text(json.dumps(run.corpus, indent=1))
    last = history[-1] if history else {}
    summary = {"params": int(sum(x.size for x in jax.tree.leaves(state.params))),
               "train_tokens": int(rows.tokens.size), "steps": int(state.step),
               "loss": last.get("loss"), "heldout_loss": last.get("heldout_loss"),
               "heldout_tokens": int(eval_rows.tokens.size), "config": dataclasses.asdict(train)}
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=1))
    return config, state.params


@one_line_warnings()
@interrupt_exits()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash_jax.training.train_target", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output HF model folder")
    parser.add_argument("--corpus", default="stdlib",
                        help="'stdlib' (the running interpreter's *.py) or a folder of *.py files (at least 2)")
    parser.add_argument("--max-files", type=at_least(1), default=None, help="use only the first N training files")
    parser.add_argument("--ckpt-dir", default=None, help="orbax checkpoints and tokenizer staging (DIR.ckpt)")
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --ckpt-dir (same settings; --steps included)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    defaults, shape = TargetTrainConfig(), TinyTargetShape()
    parser.add_argument("--vocab-size", type=at_least(1), default=shape.vocab_size)
    parser.add_argument("--hidden", type=at_least(1), default=shape.hidden_size)
    parser.add_argument("--layers", type=at_least(1), default=shape.num_layers)
    parser.add_argument("--heads", type=at_least(1), default=shape.num_heads)
    parser.add_argument("--kv-heads", type=at_least(1), default=shape.num_kv_heads)
    parser.add_argument("--head-dim", type=at_least(1), default=shape.head_dim)
    parser.add_argument("--intermediate", type=at_least(1), default=shape.intermediate_size)
    parser.add_argument("--seq-len", type=at_least(2), default=defaults.seq_len)
    parser.add_argument("--batch", type=at_least(1), default=defaults.batch_size)
    parser.add_argument("--steps", type=at_least(1), default=defaults.optim.steps)
    parser.add_argument("--lr", type=positive_float, default=defaults.optim.lr)
    parser.add_argument("--weight-decay", type=non_negative_float, default=defaults.optim.weight_decay)
    parser.add_argument("--save-every", type=at_least(1), default=defaults.save_every)
    parser.add_argument("--eval-every", type=at_least(0), default=250,
                        help="held-out loss every N steps (0: at the end only)")
    parser.add_argument("--seed", type=random_seed, default=defaults.seed)
    parser.add_argument("--time-budget", type=positive_float, default=None, metavar="SECONDS",
                        help="fit the run (compile included) in this time: fewer steps, same schedule "
                             "shape (with --resume: the steps left)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"],
                        help=f"compute dtype; master weights stay float32 ({DTYPE_DEFAULT_HELP})")
    parser.add_argument("--max-shard-mb", type=at_least(1), default=DEFAULT_MAX_SHARD_MB,
                        help="largest safetensors shard of the exported model, MB")
    parser.add_argument("--compile-cache", metavar="DIR", help=COMPILE_CACHE_HELP)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or default_dtype()
    with reported_as_errors():
        keep_compiled_programs(args.compile_cache)
        train = TargetTrainConfig(
            shape=TinyTargetShape(vocab_size=args.vocab_size, hidden_size=args.hidden, num_layers=args.layers,
                                  num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                                  intermediate_size=args.intermediate),
            optim=OptimConfig(steps=args.steps, lr=args.lr, weight_decay=args.weight_decay),
            seq_len=args.seq_len, batch_size=args.batch, seed=args.seed, compute_dtype=args.dtype,
            save_every=args.save_every, time_budget=args.time_budget)
        run = open_target_run(args.out, train, corpus=args.corpus, max_files=args.max_files,
                              ckpt_dir=args.ckpt_dir, resume=args.resume, overwrite=args.overwrite)
    train_target(run, eval_every=args.eval_every, max_shard_mb=args.max_shard_mb)


if __name__ == "__main__":
    exit_with(main)
