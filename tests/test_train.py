"""Training: anchors, blocks and the attention mask on a hand-computed case; a tiny target and
draft trained through the CLIs; resume; export round trip; parity with the z-lab reference."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sysconfig
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from dflash_jax.training import data, train_draft, train_target
from dflash_jax.loading.models import load_draft, load_target
from dflash_jax.loading.tokenizer import Tokenizer
from pallas_kernels.attention import masked_gqa_attention

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TEXT_GLOB = str(STDLIB / "json" / "*.py")
DRAFT_STEPS = 12


def cli_error(main, args: list[str], capsys) -> str:
    """The one error a training CLI prints for ``args`` (it exits with status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Anchors, blocks, mask: seq len 8, block 4, 2 anchors, by hand.

def test_sample_anchors_only_where_two_tokens_are_supervised():
    mask = jnp.array([[0, 1, 1, 1, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1]], bool)
    few = np.asarray(data.sample_anchors(jax.random.key(0), mask, 3))
    assert len(set(few[0])) == 3 and set(few[0]) <= {1, 2, 5, 6}
    assert few[1].tolist() == [6, -1, -1]
    many = np.asarray(data.sample_anchors(jax.random.key(1), mask, 10))
    assert sorted(many[0][:4]) == [1, 2, 5, 6] and (many[0][4:] == -1).all()
    again = np.asarray(data.sample_anchors(jax.random.key(0), mask, 3))
    assert (again == few).all()
    full = jnp.ones((1, 64), bool)  # the key draws them: another key, other anchors
    assert (data.sample_anchors(jax.random.key(0), full, 4) != data.sample_anchors(jax.random.key(1), full, 4)).any()


def test_blocks_labels_weights_and_visibility_by_hand():
    tokens = jnp.arange(10, 18, dtype=jnp.int32)[None]          # 10..17 at positions 0..7
    mask = jnp.array([[0, 0, 1, 1, 1, 1, 1, 0]], bool)          # position 7 not supervised
    anchors = jnp.array([[2, 5]], jnp.int32)
    blocks = data.make_blocks(tokens, mask, anchors, block_size=4, mask_token_id=99)
    assert blocks.tokens.tolist() == [[12, 99, 99, 99, 15, 99, 99, 99]]
    assert blocks.positions.tolist() == [[2, 3, 4, 5, 5, 6, 7, 8]]
    assert blocks.labels[0, 0].tolist() == [13, 14, 15]
    assert blocks.labels[0, 1, :2].tolist() == [16, 17]          # the third lies past the row
    assert blocks.label_mask.tolist() == [[[True, True, True], [True, False, False]]]

    gamma = data.default_gamma(4)
    assert gamma == pytest.approx(1.75)
    np.testing.assert_allclose(data.position_weights(4, gamma), np.exp(-np.arange(3) / 1.75), rtol=1e-6)
    assert data.default_gamma(16) == 7.0
    assert data.default_gamma(10) == 5.0 and data.default_gamma(8) == 4.0  # the paper's other block sizes

    # rows: block queries; columns: context positions 0..7, then the 8 block keys.
    expected = ["11000000" "11110000"] * 4 + ["11111000" "00001111"] * 4
    visible = train_draft.training_visibility(anchors, 8, 4)[0]
    assert ["".join("1" if v else "0" for v in row) for row in np.asarray(visible)] == expected

    unused = data.make_blocks(tokens, mask, jnp.array([[2, -1]], jnp.int32), 4, 99)
    assert not np.asarray(unused.label_mask[0, 1]).any()
    row = np.asarray(train_draft.training_visibility(jnp.array([[2, -1]]), 8, 4)[0, 4])
    assert "".join("1" if v else "0" for v in row) == "00000000" "00001111"


def test_labels_past_the_row_are_not_supervised():
    """Position 7 is supervised, but a block anchored at 5 reaches past the row's end (8): its
    third label does not exist and must not count."""
    tokens = jnp.arange(10, 18, dtype=jnp.int32)[None]
    blocks = data.make_blocks(tokens, jnp.ones((1, 8), bool), jnp.array([[5]], jnp.int32), 4, 99)
    assert blocks.label_mask.tolist() == [[[True, True, False]]]


def test_draft_loss_by_hand(random_pair):
    """The loss is the weighted mean cross entropy of the draft's logits for block slots 1..B-1
    (the slots inference reads; slot 0 holds the anchor's known token) against the next tokens,
    weights exp(-k / gamma) where a label is supervised."""
    from dflash_jax.model import draft as draft_model

    target, draft = random_pair.target, random_pair.draft
    config = dataclasses.replace(draft.config, block_size=4)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 127, (1, 12)), jnp.int32)
    loss_mask = jnp.asarray([[0, 0, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1]], bool)
    anchors = jnp.asarray([[3, 6, 9]], jnp.int32)
    loss, _ = train_draft.draft_loss(draft.params, target.params, tokens, loss_mask, anchors, config=config,
                                     target_config=target.config, gamma=2.0, dtype=jnp.float32)
    _, taps = train_draft.causal_forward(target.params, target.config, tokens, config.target_layer_ids)
    blocks = data.make_blocks(tokens, loss_mask, anchors, 4, config.mask_token_id)
    hidden = train_draft.draft_block_hidden(draft.params, config, target.params, taps, blocks, anchors)
    logits = draft_model.draft_logits(draft.params, config, target.params, hidden.reshape(1, 3, 4, -1)[:, :, 1:])
    cross_entropy = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, blocks.labels))
    weights = np.exp(-np.arange(3) / 2.0)[None, None] * np.asarray(blocks.label_mask)
    assert 0 < weights.sum() and not np.asarray(blocks.label_mask).all()  # some labels unsupervised
    np.testing.assert_allclose(float(loss), (cross_entropy * weights).sum() / weights.sum(), rtol=1e-5)


def test_token_files_and_prompt_response_rows(tmp_path):
    rows = data.prompt_response_rows([[1, 2], [3]], [[4, 5, 6], [7, 8, 9, 10, 11]], seq_len=5, pad_id=0)
    assert rows.tokens.tolist() == [[1, 2, 4, 5, 6], [3, 7, 8, 9, 10]]
    assert rows.loss_mask.astype(int).tolist() == [[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]]
    short = data.prompt_response_rows([[1]], [[4, 5]], seq_len=5, pad_id=0)  # padding is not supervised
    assert short.tokens.tolist() == [[1, 4, 5, 0, 0]] and short.loss_mask.astype(int).tolist() == [[0, 1, 1, 0, 0]]
    packed = data.pack_stream([np.array([1, 2]), np.array([3, 4, 5]), np.array([6])], 3)
    assert packed.tokens.tolist() == [[1, 2, 3], [4, 5, 6]] and packed.loss_mask.all()  # one stream, cut in rows
    data.save_token_file(tmp_path / "rows.npz", rows)
    (tmp_path / "notes.txt").write_text("some text")
    loaded, texts = train_draft.read_training_data([str(tmp_path / "*")])
    assert texts == ["some text"] and list(loaded) == [tmp_path / "rows.npz"]
    assert (loaded[tmp_path / "rows.npz"].tokens == rows.tokens).all()
    assert (loaded[tmp_path / "rows.npz"].loss_mask == rows.loss_mask).all()
    assert data.concat_rows([rows, rows]).tokens.shape == (4, 5)
    (tmp_path / "more" / "deeper").mkdir(parents=True)  # a glob that finds folders only adds nothing: refused
    with pytest.raises(FileNotFoundError, match="folders only"):
        train_draft.read_training_data([str(tmp_path / "*"), str(tmp_path / "m*")])
    with pytest.raises(FileNotFoundError, match="no file matches"):
        data.expand_paths([str(tmp_path / "x*")])
    first = rows.batch(3, 4, seed=0)[0]
    assert (first == rows.batch(3, 4, seed=0)[0]).all()
    many = data.TokenRows(np.arange(128, dtype=np.int32).reshape(64, 2), np.ones((64, 2), bool))
    assert (many.batch(0, 8, seed=0)[0] != many.batch(1, 8, seed=0)[0]).any()  # each step draws its own rows
    assert (many.batch(3, 8, seed=0)[0] != many.batch(3, 8, seed=1)[0]).any()  # and each seed


def test_expand_paths_globs_recursively(tmp_path):
    """``**`` in a --data pattern reaches files at any depth, the top folder's own included."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "x.txt").write_text("x")
    (tmp_path / "y.txt").write_text("y")
    found = data.expand_paths([str(tmp_path / "**" / "*.txt")])
    assert found == [tmp_path / "a" / "b" / "x.txt", tmp_path / "y.txt"]


def test_token_files_are_written_whole_and_damaged_ones_are_refused_by_name(tmp_path, monkeypatch):
    """An interrupted save leaves the old file as it was and nothing else; a truncated, corrupt or
    foreign .npz is a ValueError naming it (train_draft's CLI prints it as one error line)."""
    rows = data.prompt_response_rows([[1, 2]], [[4, 5, 6]], seq_len=5, pad_id=0)
    path = tmp_path / "rows.npz"
    data.save_token_file(path, rows)
    whole = path.read_bytes()

    def interrupted(file, **arrays):
        file.write(b"PK half an archive")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez_compressed", interrupted)
    with pytest.raises(KeyboardInterrupt):
        data.save_token_file(path, data.concat_rows([rows, rows]))
    monkeypatch.undo()
    assert path.read_bytes() == whole and [p.name for p in tmp_path.iterdir()] == ["rows.npz"]

    tokens = np.arange(4096, dtype=np.int32).reshape(64, 64)
    np.savez(tmp_path / "stored.npz", tokens=tokens, loss_mask=tokens > 0)  # stored: a flipped byte fails a CRC
    stored = bytearray((tmp_path / "stored.npz").read_bytes())
    stored[len(stored) // 3] ^= 0xFF  # inside the tokens
    np.savez(tmp_path / "foreign.npz", weights=np.zeros(3))
    with open(tmp_path / "array.npz", "wb") as file:  # one .npy array under an .npz name
        np.save(file, tokens)
    damaged = {"truncated.npz": whole[:len(whole) // 2], "flipped.npz": bytes(stored), "empty.npz": b"",
               "text.npz": b"not an archive"}
    for name, content in damaged.items():
        (tmp_path / name).write_bytes(content)
    for name in list(damaged) + ["foreign.npz", "array.npz"]:
        with pytest.raises(ValueError, match=f"{name}: (a damaged|not a readable|not a) token file"):
            train_draft.read_training_data([str(tmp_path / name)])


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_anchored_attention_matches_dense_masked_attention(dtype, tol):
    rows, num, block, seq, heads, kv_heads, dim = 2, 3, 4, 10, 4, 2, 16
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v = (jax.random.normal(key, (rows, num * block, shape, dim), dtype)
               for key, shape in zip(keys[:3], (heads, kv_heads, kv_heads)))
    ctx_k, ctx_v = (jax.random.normal(key, (rows, seq, kv_heads, dim), dtype) for key in keys[3:])
    anchors = jnp.array([[0, 7, -1], [9, 3, 4]], jnp.int32)
    out = jax.jit(train_draft.anchored_attention, static_argnums=6)(q, k, v, ctx_k, ctx_v, anchors, block)
    dense = jax.jit(lambda q, k, v, visible: masked_gqa_attention(*(x.astype(jnp.float32) for x in (q, k, v)), visible))
    ref = dense(q, jnp.concatenate([ctx_k, k], 1), jnp.concatenate([ctx_v, v], 1),
                train_draft.training_visibility(anchors, seq, block))
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=tol, rtol=tol)


# ---------------------------------------------------------------------------------------------
# A tiny target and draft, trained through the CLIs.

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    train_target.main(["--out", str(root / "target"), "--max-files", "12", "--vocab-size", "384",
                       "--hidden", "64", "--layers", "4", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                       "--intermediate", "128", "--seq-len", "64", "--batch", "8", "--steps", "40", "--lr", "3e-3",
                       "--dtype", "float32"])
    draft_args = ["--target", str(root / "target"), "--out", str(root / "draft"), "--data", TEXT_GLOB,
                  "--num-layers", "2", "--block-size", "4", "--seq-len", "64", "--anchors", "8", "--batch", "4",
                  "--steps", str(DRAFT_STEPS), "--lr", "3e-3", "--save-every", "6", "--dtype", "float32"]
    train_draft.main(draft_args)
    return root, draft_args


@pytest.mark.parametrize("chunk_rows", [1, 7, 64])
def test_chunked_cross_entropy_matches_the_whole_logits(monkeypatch, chunk_rows):
    """Values, argmax and gradients as from the whole logits, for chunks that do and do not
    divide the positions (20 here)."""
    vocab = 11
    monkeypatch.setattr(train_draft, "LOGIT_CHUNK_BYTES", 4 * vocab * chunk_rows)
    keys = jax.random.split(jax.random.key(np.random.SeedSequence().entropy % 2**32), 3)
    hidden = jax.random.normal(keys[0], (2, 5, 2, 8))
    weight = jax.random.normal(keys[1], (8, vocab))
    labels = jax.random.randint(keys[2], (2, 5, 2), 0, vocab)
    position_weights = jnp.linspace(0.1, 1.0, 20).reshape(2, 5, 2)

    def chunked(w, h):
        ce, predicted = train_draft.chunked_cross_entropy(lambda x: x @ w, h, labels)
        return jnp.sum(ce * position_weights), predicted

    def whole(w, h):
        logits = h @ w
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.sum(ce * position_weights), jnp.argmax(logits, -1)

    (value, predicted), grads = jax.value_and_grad(chunked, argnums=(0, 1), has_aux=True)(weight, hidden)
    (value_ref, predicted_ref), grads_ref = jax.value_and_grad(whole, argnums=(0, 1), has_aux=True)(weight, hidden)
    np.testing.assert_allclose(value, value_ref, rtol=1e-6)
    np.testing.assert_array_equal(predicted, predicted_ref)
    for grad, grad_ref in zip(grads, grads_ref):
        np.testing.assert_allclose(grad, grad_ref, rtol=1e-5, atol=1e-6)


def test_target_folder_loads_in_transformers(trained):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    folder = trained[0] / "target"
    summary = json.loads((folder / "train_summary.json").read_text())
    assert np.isfinite(summary["heldout_loss"])
    corpus = json.loads((folder / "corpus.json").read_text())
    assert corpus["heldout_files"] and all(data.is_heldout(f) for f in corpus["heldout_files"])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == data.EOS_TOKEN
    assert tokenizer.convert_tokens_to_ids(data.MASK_TOKEN) is not None
    model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tokenizer("def f(x):\n    return x", return_tensors="pt").input_ids
    ours = load_target(folder, dtype="float32")
    hidden, _ = train_target.causal_forward(ours.params, ours.config, jnp.asarray(ids.numpy(), jnp.int32))
    np.testing.assert_allclose(np.asarray(train_target.target_model.logits(ours.params, hidden)),
                               model(ids).logits.detach().numpy(), atol=1e-4, rtol=1e-4)


def test_target_and_draft_losses_go_down(trained):
    root = trained[0]
    target_log = json.loads((root / "target.ckpt" / "train_log.json").read_text())
    draft_log = json.loads((root / "draft.ckpt" / "train_log.json").read_text())
    for log in (target_log, draft_log):
        losses = [h["loss"] for h in log]
        assert np.mean(losses[-3:]) < losses[0] - 0.5, losses
    assert len(draft_log[-1]["position_accuracy"]) == 3 and draft_log[-1]["tau_proxy"] >= 1.0


def test_resume_continues_identically(trained):
    root, draft_args = trained
    ckpt = root / "draft.ckpt"
    full = json.loads((ckpt / "train_log.json").read_text())
    shutil.rmtree(ckpt / "state" / str(DRAFT_STEPS))             # as if stopped after step 6
    train_draft.main(draft_args + ["--resume"])
    resumed = json.loads((ckpt / "train_log.json").read_text())
    assert [h["step"] for h in resumed] == list(range(1, DRAFT_STEPS + 1))
    np.testing.assert_allclose([h["loss"] for h in resumed], [h["loss"] for h in full], rtol=1e-6)


def test_a_checkpoint_folder_holds_one_run(trained, tmp_path, capsys):
    root, draft_args = trained
    state = root / "draft.ckpt" / "state"
    saved = sorted(p.name for p in state.iterdir())
    error = cli_error(train_draft.main, draft_args, capsys)              # the same command again
    assert error.startswith("error: ") and "already holds checkpoints" in error and "pass --resume" in error
    error = cli_error(train_draft.main, draft_args + ["--out", str(tmp_path / "other"), "--ckpt-dir",
                                                      str(state.parent)], capsys)
    assert "already holds checkpoints" in error
    # --resume checks the stored run: a new --steps is refused (the schedule is laid out over it)
    error = cli_error(train_draft.main, draft_args + ["--resume", "--steps", "20"], capsys)
    assert f"train.optim.steps: {DRAFT_STEPS} in the stored run, 20 now" in error
    error = cli_error(train_draft.main, draft_args + ["--resume", "--block-size", "8"], capsys)
    assert "draft.block_size: 4 in the stored run, 8 now" in error
    assert sorted(p.name for p in state.iterdir()) == saved and not (tmp_path / "other").exists()


def test_resume_replaces_only_the_output_its_run_records(tmp_path):
    run, ckpt, own, other = {"train": {"steps": 2}}, tmp_path / "ckpt", tmp_path / "own", tmp_path / "other"
    with pytest.raises(FileNotFoundError, match="no checkpoints in .* to resume"):
        train_target.claim_run_folders(ckpt, own, run, resume=True, overwrite=False)
    train_target.claim_run_folders(ckpt, own, run, resume=False, overwrite=False)
    state = train_target.TrainState(step=jnp.zeros((), jnp.int32), params={"w": jnp.ones(2)}, opt_state=())
    train_target.run_training(state, lambda s, lr: (s.replace(step=s.step + 1), {}), lambda step: (),
                              optim=train_target.OptimConfig(steps=2, lr=1e-3), ckpt_dir=ckpt, save_every=1,
                              resume=False, desc="claim", postfix=lambda m: {})
    for folder in (own, other):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_text("keep me")
    train_target.claim_run_folders(ckpt, own, run, resume=True, overwrite=False)         # the run's own --out
    with pytest.raises(FileExistsError, match=f"the run in .* writes {own}.* --overwrite"):
        train_target.claim_run_folders(ckpt, other, run, resume=True, overwrite=False)
    # a run.json of before the field: only an empty --out, or --overwrite
    stored = json.loads((ckpt / "run.json").read_text())
    assert stored.pop("out") == str(own)
    (ckpt / "run.json").write_text(json.dumps(stored))
    with pytest.raises(FileExistsError, match="does not record which --out"):
        train_target.claim_run_folders(ckpt, own, run, resume=True, overwrite=False)
    train_target.claim_run_folders(ckpt, tmp_path / "new", run, resume=True, overwrite=False)
    assert json.loads((ckpt / "run.json").read_text())["out"] == str(tmp_path / "new")
    train_target.claim_run_folders(ckpt, other, run, resume=True, overwrite=True)
    assert (own / "model.safetensors").read_text() == (other / "model.safetensors").read_text() == "keep me"
    # the export replaces only a model folder, so a run that could not end in one is refused up front
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "notes.txt").write_text("keep me")
    for overwrite in (True, False):  # without --overwrite too: the refusal does not suggest it
        with pytest.raises(FileExistsError, match="not a model folder .* even with --overwrite"):
            train_target.claim_run_folders(ckpt, tmp_path / "notes", run, resume=True, overwrite=overwrite)
    # the export replaces --out whole: it must not hold the checkpoints or the run's inputs
    target = {"--target": tmp_path / "in"}
    for out, inputs in ((tmp_path, None), (ckpt, None), (tmp_path / "in", target), (tmp_path, target),
                        (tmp_path / "in" / "x", target)):
        with pytest.raises(ValueError, match="--out"):
            train_target.claim_run_folders(ckpt, out, run, resume=True, overwrite=True, inputs=inputs)
    # an --out that cannot be written is refused now, not after the training (a file where its folder would be)
    with pytest.raises(OSError, match="cannot write .*notes.txt/out"):
        train_target.claim_run_folders(ckpt, tmp_path / "notes" / "notes.txt" / "out", run, resume=True,
                                       overwrite=False)
    assert sorted(p.name for p in (tmp_path / "notes").iterdir()) == ["notes.txt"]


def test_draft_output_is_replaced_only_with_overwrite(trained, tmp_path, capsys):
    root, draft_args = trained
    out = tmp_path / "draft"
    shutil.copytree(root / "draft", out)                               # say, a downloaded draft
    (out / "README.md").write_text("keep me")
    args = draft_args + ["--out", str(out), "--ckpt-dir", str(tmp_path / "ckpt")]
    assert "--overwrite" in cli_error(train_draft.main, args, capsys)
    assert "no checkpoints" in cli_error(train_draft.main, args + ["--resume"], capsys)
    assert (out / "README.md").read_text() == "keep me" and not (tmp_path / "ckpt").exists()
    train_draft.main(args + ["--overwrite"])
    assert not (out / "README.md").exists() and (out / "config.json").is_file()
    assert (tmp_path / "ckpt" / "state" / str(DRAFT_STEPS)).is_dir()


def test_interrupted_run_keeps_its_log_and_resumes_within_its_budget(tmp_path):
    class Interrupted(Exception):
        pass

    def step_fn(state, learning_rate, stop_at=None, seconds=0.0):
        if int(state.step) == stop_at:
            raise Interrupted
        time.sleep(seconds)
        return state.replace(step=state.step + 1), {"loss": learning_rate}

    run = {"train": {"steps": 1000}}
    state = train_target.TrainState(step=jnp.zeros((), jnp.int32), params={"w": jnp.ones(2)},
                                    opt_state={"m": jnp.zeros(2)})
    common = dict(optim=train_target.OptimConfig(steps=1000, lr=1e-3), ckpt_dir=tmp_path, save_every=5,
                  desc="resume", postfix=lambda m: {})
    train_target.claim_run_folders(tmp_path, tmp_path / "out", run, resume=False, overwrite=False)
    with pytest.raises(Interrupted):
        train_target.run_training(state, lambda s, lr: step_fn(s, lr, stop_at=7), lambda step: (), resume=False,
                                  **common)
    logged = json.loads((tmp_path / "train_log.json").read_text())
    assert [h["step"] for h in logged] == [1, 2, 3, 4, 5]                # as of the checkpoint at step 5

    with pytest.raises(FileExistsError, match="--resume"):
        train_target.claim_run_folders(tmp_path, tmp_path / "out", run, resume=False, overwrite=False)
    with pytest.raises(ValueError, match="train.steps: 1000 in the stored run, 2000 now"):
        train_target.claim_run_folders(tmp_path, tmp_path / "out", {"train": {"steps": 2000}}, resume=True,
                                       overwrite=False)
    train_target.claim_run_folders(tmp_path, tmp_path / "out", run, resume=True, overwrite=False)
    began = time.perf_counter()
    state, history = train_target.run_training(state, lambda s, lr: step_fn(s, lr, seconds=0.05), lambda step: (),
                                               resume=True, time_budget=1.0, **common)
    seconds = time.perf_counter() - began
    total = json.loads((tmp_path / "schedule.json").read_text())["total_steps"]
    assert 17 <= total < 40 and int(state.step) == total and seconds < 2.5  # unbudgeted: ~50 s
    assert [h["step"] for h in history] == list(range(1, total + 1)) and history[:5] == logged
    assert json.loads((tmp_path / "train_log.json").read_text()) == history


def test_first_interrupt_ends_training_after_the_step_with_a_checkpoint(tmp_path):
    """A Ctrl-C (or SIGTERM) during a step: the step ends, a checkpoint and the log are written,
    then KeyboardInterrupt; --resume goes on from that step."""
    import os
    import signal

    def step_fn(state, learning_rate, signal_at=None):
        if int(state.step) == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return state.replace(step=state.step + 1), {"loss": learning_rate}

    state = train_target.TrainState(step=jnp.zeros((), jnp.int32), params={"w": jnp.ones(2)},
                                    opt_state={"m": jnp.zeros(2)})
    common = dict(optim=train_target.OptimConfig(steps=20, lr=1e-3), ckpt_dir=tmp_path, save_every=10,
                  desc="interrupt", postfix=lambda m: {})
    train_target.claim_run_folders(tmp_path, tmp_path / "out", {}, resume=False, overwrite=False)
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        train_target.run_training(state, lambda s, lr: step_fn(s, lr, signal_at=6), lambda step: (), resume=False,
                                  **common)
    assert signal.getsignal(signal.SIGTERM) is previous
    assert train_target.saved_steps(tmp_path) == [7]
    assert [h["step"] for h in json.loads((tmp_path / "train_log.json").read_text())] == list(range(1, 8))
    state, history = train_target.run_training(state, step_fn, lambda step: (), resume=True, **common)
    assert int(state.step) == 20 and [h["step"] for h in history] == list(range(1, 21))
    # during the last step: saved, and still an interrupt (the caller's export and evaluation wait for --resume)
    last = tmp_path / "last"
    train_target.claim_run_folders(last, last / "out", {}, resume=False, overwrite=False)
    state = state.replace(step=jnp.zeros((), jnp.int32))
    with pytest.raises(KeyboardInterrupt):
        train_target.run_training(state, lambda s, lr: step_fn(s, lr, signal_at=19), lambda step: (),
                                  resume=False, **{**common, "ckpt_dir": last})
    assert train_target.saved_steps(last) == [10, 20]


def test_a_closed_output_pipe_ends_training_with_a_checkpoint(tmp_path, monkeypatch, capsys):
    """The progress's reader leaving (``| head``: BrokenPipeError from a write) keeps the steps
    run: a checkpoint at that step, the log, and on stderr how to resume; then the error goes on
    (the command line exits quietly with 141)."""
    class ClosedAfterSix(train_target.tqdm):
        def update(self, n=1):
            super().update(n)
            if self.n == 6:
                raise BrokenPipeError

    monkeypatch.setattr(train_target, "tqdm", ClosedAfterSix)
    state = train_target.TrainState(step=jnp.zeros((), jnp.int32), params={"w": jnp.ones(2)},
                                    opt_state={"m": jnp.zeros(2)})
    train_target.claim_run_folders(tmp_path, tmp_path / "out", {}, resume=False, overwrite=False)
    with pytest.raises(BrokenPipeError):
        train_target.run_training(state, lambda s, lr: (s.replace(step=s.step + 1), {"loss": lr}),
                                  lambda step: (), optim=train_target.OptimConfig(steps=20, lr=1e-3),
                                  ckpt_dir=tmp_path, save_every=10, resume=False, desc="closed", postfix=lambda m: {})
    assert train_target.saved_steps(tmp_path) == [6]
    assert [h["step"] for h in json.loads((tmp_path / "train_log.json").read_text())] == list(range(1, 7))
    assert f"closed: output closed at step 6 of 20; checkpoint saved in {tmp_path}" in capsys.readouterr().err


def test_draft_cli_rejects_contradictory_options(capsys):
    base = ["--target", "unused", "--out", "unused"]
    for extra, message in ((["--eval-only"], "pass --eval-prompts N"),
                           (["--regenerate", "4", "--prompt-len", "63", "--seq-len", "64"],
                            "--prompt-len 63 must be at most --seq-len - 2 (62)"),
                           (["--save-data", "rows.bin"], "must name a .npz file"),
                           (["--save-data", "/no/such/folder/rows.npz"], "a .npz file in an existing folder")):
        assert message in cli_error(train_draft.main, base + extra, capsys)


@pytest.mark.parametrize("main,flag,value", [
    *((train_draft.main, flag, "0") for flag in ("--steps", "--save-every", "--batch", "--anchors", "--num-layers",
                                                  "--regen-batch", "--regenerate", "--gamma", "--time-budget")),
    (train_draft.main, "--steps", "-3"), (train_draft.main, "--gamma", "nan"), (train_draft.main, "--seq-len", "1"),
    (train_draft.main, "--regen-temperature", "-1"), (train_draft.main, "--regen-temperature", "nan"),
    (train_draft.main, "--block-size", "1"),
    *((train_target.main, flag, "0") for flag in ("--steps", "--save-every", "--batch", "--kv-heads", "--time-budget")),
    (train_target.main, "--seq-len", "1"), (train_target.main, "--steps", "many"),
    *((main, "--seed", value) for main in (train_draft.main, train_target.main) for value in ("-1", str(2**32))),
    *((main, "--lr", value) for main in (train_draft.main, train_target.main) for value in ("-0.001", "0", "nan")),
    (train_target.main, "--weight-decay", "-0.1")])
def test_cli_flag_values_are_checked_before_anything_runs(main, flag, value, capsys):
    args = ["--out", "unused"] + (["--target", "unused"] if main is train_draft.main else [])
    assert f"argument {flag}: must be" in cli_error(main, args + [flag, value], capsys)


def test_draft_data_is_checked_before_the_target_loads(trained, tmp_path, monkeypatch, capsys):
    root = trained[0]
    base = ["--target", str(root / "target"), "--out", str(tmp_path / "draft"), "--seq-len", "8"]
    (tmp_path / "chat.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "empty.py").write_text("")
    (tmp_path / "blank.txt").write_text("\n  \n")
    rows = data.TokenRows(np.ones((3, 8), np.int32), np.tile([True, False], (3, 4)))   # no two supervised in a row
    data.save_token_file(tmp_path / "sparse.npz", rows)
    data.save_token_file(tmp_path / "long.npz", data.TokenRows(np.ones((3, 16), np.int32), np.ones((3, 16), bool)))
    monkeypatch.setattr(train_draft, "load_target", lambda *a, **k: pytest.fail("the target was loaded"))
    for data_args, message in (([str(tmp_path / "chat.jsonl")], "JSON Lines files are not read as training data"),
                               ([str(tmp_path / "empty.py"), str(tmp_path / "blank.txt")],
                                "no training text in --data (all 2 files empty)"),
                               ([str(tmp_path / "long.npz")], "holds rows of 16 tokens, not --seq-len 8"),
                               ([str(tmp_path / "sparse.npz"), "--regenerate", "2", "--prompt-len", "4"],
                                "--regenerate cuts its prompts from the text of --data")):
        assert message in cli_error(train_draft.main, base + ["--data", *data_args], capsys)
    assert not (tmp_path / "draft.ckpt").exists()
    with pytest.raises(ValueError, match="no row of the 3 training rows has two consecutive supervised tokens"):
        data.trainable_rows(rows, vocab_size=8)
    data.save_token_file(tmp_path / "foreign.npz", data.TokenRows(np.full((3, 8), 500, np.int32), np.ones((3, 8), bool)))
    assert (f"--data {tmp_path / 'foreign.npz'}: token ids span [500, 500], outside the target's vocabulary"
            in cli_error(train_draft.main, base + ["--data", str(tmp_path / "foreign.npz")], capsys))
    # files the run reads or writes inside --out, which the export replaces whole
    out = Path(base[base.index("--out") + 1])
    out.mkdir()
    data.save_token_file(out / "rows.npz", rows)
    (out / "rows.npz").rename(out / "rows.NPZ")  # a token file, whatever the suffix's case
    for extra, message in ((["--data", TEXT_GLOB, "--save-data", str(out / "saved.npz")],
                            f"--save-data {out / 'saved.npz'} lies in --out {out}"),
                           (["--data", str(out / "rows.NPZ")], f"--data {out / 'rows.NPZ'} lies in --out {out}")):
        assert message in cli_error(train_draft.main, base + extra, capsys)
    assert not (tmp_path / "draft.ckpt").exists() and not (out / "saved.npz").exists()
    assert list(train_draft.read_training_data([str(out / "rows.NPZ")])[0]) == [out / "rows.NPZ"]


def test_prompt_digest_sees_where_prompts_end():
    assert train_draft._prompts_digest([[5, 6, 7], [8]]) != train_draft._prompts_digest([[5], [6, 7, 8]])


def test_mask_token_is_past_the_largest_tokenizer_id(tmp_path):
    """Without a <|mask|> token the mask id is the first past the tokenizer's largest id, not its
    token count: ids may leave gaps (here 3), and 4 is a real token."""
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2, "c": 4}, unk_token="<unk>")).save(
        str(tmp_path / "tokenizer.json"))
    assert train_draft.find_mask_token(tmp_path, vocab_size=8) == 5
    with pytest.raises(ValueError, match="fills the vocabulary; pass --mask-token-id"):
        train_draft.find_mask_token(tmp_path, vocab_size=5)


def test_rows_without_an_anchor_are_left_out():
    """A row with no two consecutive supervised tokens (a regenerated answer of one token) would
    train on a zero loss while AdamW still steps: it is dropped, with a warning; negative ids and
    ids past the vocabulary are refused."""
    mask = np.ones((3, 8), bool)
    mask[1] = [True, False] * 4
    rows = data.TokenRows(np.arange(24, dtype=np.int32).reshape(3, 8), mask)
    with pytest.warns(UserWarning, match="1 of 3 rows have no two consecutive supervised tokens"):
        kept = data.trainable_rows(rows, vocab_size=24)
    np.testing.assert_array_equal(kept.tokens, rows.tokens[[0, 2]])
    for tokens in (rows.tokens - 1, rows.tokens + 1):
        with pytest.raises(ValueError, match=r"token ids span \[-?\d+, \d+\], outside the target's vocabulary \[0, 24\)"):
            data.trainable_rows(data.TokenRows(tokens, mask), vocab_size=24)


def test_small_corpus_folders_hold_out_one_file(tmp_path):
    for name in ("a.py", "c.py", "g.py"):                  # crc32 % 1000: 502, 765, 274: none below 20
        assert not data.is_heldout(name)
        (tmp_path / name).write_text("x = 1\n")
    assert data.source_files(tmp_path) == ([tmp_path / "a.py", tmp_path / "c.py"], [tmp_path / "g.py"])
    for name in ("a.py", "c.py"):
        (tmp_path / name).unlink()
    with pytest.raises(ValueError, match="a single \\*.py file"):
        data.source_files(tmp_path)


def test_regenerate_generates_each_prompt_once(monkeypatch):
    import dflash_jax.runtime.generation

    batches = []

    def fake_generate(target, prompts, *, max_new_tokens, **kwargs):
        batches.append(len(prompts))
        return dflash_jax.runtime.generation.GenerationResult([[7] * n for n in max_new_tokens], None)

    monkeypatch.setattr(dflash_jax.runtime.generation, "generate", fake_generate)
    monkeypatch.setattr(train_draft, "stop_token_ids", lambda target: [0])
    rows = train_draft.regenerate(None, [[1, 2]] * 5, seq_len=6, temperature=0.0, batch_size=2, pad_id=0)
    assert batches == [2, 2, 1] and len(rows) == 5 and rows.loss_mask.sum() == 5 * 4


def test_progress_label_names_the_positions_shown():
    postfix = train_draft._postfix({"loss": 1.0, "tau_proxy": 1.5, "position_accuracy": [0.5, 0.25, 0.125]})
    assert postfix["acc@1,2"] == "0.50,0.25"


def test_eval_only_prints_an_untimed_speedup_as_na(trained, monkeypatch, capsys):
    root = trained[0]

    def untimed(target, draft, prompts, *, max_new_tokens, temperature):
        # what evaluate_tau returns when plain decoding timed no tokens (--eval-new-tokens 1)
        assert len(prompts) == 2 and max_new_tokens == 1
        return {"temperature": temperature, "tau": 1.0, "speedup": None, "tokens_per_second": None,
                "plain_tokens_per_second": None}

    monkeypatch.setattr(train_draft, "evaluate_tau", untimed)
    train_draft.main(["--target", str(root / "target"), "--out", str(root / "draft"), "--dtype", "float32",
                      "--eval-only", "--eval-prompts", "2", "--eval-new-tokens", "1"])
    out = capsys.readouterr().out
    assert out.count("speedup n/a (n/a vs n/a tok/s)") == 2
    assert "train_draft: evaluating at T=0.7: 2 prompts x 1 new tokens, with the draft and without ..." in out
    assert out.strip().endswith(f"train_draft: wrote {root / 'draft.eval.json'}")
    assert json.loads((root / "draft.eval.json").read_text())[1]["tokens_per_second"] is None


def test_resume_reads_back_the_regenerated_responses(trained, tmp_path, monkeypatch):
    root, _ = trained
    args = ["--target", str(root / "target"), "--out", str(tmp_path / "draft"), "--data", TEXT_GLOB,
            "--regenerate", "4", "--regen-batch", "4", "--prompt-len", "16", "--seq-len", "32",
            "--num-layers", "1", "--block-size", "4", "--anchors", "4", "--batch", "2", "--steps", "2",
            "--save-every", "1", "--dtype", "float32"]
    train_draft.main(args)
    ckpt = tmp_path / "draft.ckpt"
    first = json.loads((ckpt / "train_log.json").read_text())
    shutil.rmtree(ckpt / "state" / "2")

    def regenerate_again(*args, **kwargs):
        raise AssertionError("--resume generated the responses again")
    monkeypatch.setattr(train_draft, "regenerate", regenerate_again)
    train_draft.main(args + ["--resume"])
    resumed = json.loads((ckpt / "train_log.json").read_text())
    np.testing.assert_allclose([h["loss"] for h in resumed], [h["loss"] for h in first], rtol=1e-6)


def test_regenerate_from_a_prompts_file_rendered_as_chats(trained, tmp_path, monkeypatch):
    """--prompts FILE --chat --system: the first N prompts (a text prompt after the system turn,
    and a several-turn chat), rendered with the target's chat template, are what the target
    answers; the rows start with them."""
    root, _ = trained
    target = tmp_path / "target"
    shutil.copytree(root / "target", target)
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    config = json.loads((target / "tokenizer_config.json").read_text())
    (target / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    prompts = tmp_path / "prompts.jsonl"
    turns = [{"role": "user", "content": "def a"}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "x"}]
    prompts.write_text(json.dumps({"prompt": "import os"}) + "\n" + json.dumps({"messages": turns}) + "\n"
                       + json.dumps({"prompt": "unused"}) + "\n")
    seen = []
    original = train_draft.regenerate

    def spy(target, prompts, **kwargs):
        seen.extend(prompts)
        return original(target, prompts, **kwargs)
    monkeypatch.setattr(train_draft, "regenerate", spy)
    save = tmp_path / "rows.npz"
    train_draft.main(["--target", str(target), "--out", str(tmp_path / "draft"), "--prompts", str(prompts),
                      "--chat", "--system", "be brief", "--regenerate", "2", "--seq-len", "64", "--num-layers", "1", "--block-size", "4",
                      "--anchors", "4", "--steps", "1", "--dtype", "float32", "--save-data", str(save)])
    tokenizer = Tokenizer(target)
    expected = [tokenizer.encode("<system>be brief<user>import os<assistant>"), tokenizer.encode("<user>def a<assistant>ok<user>x<assistant>")]
    assert seen == expected
    rows = data.load_token_file(save)
    for row, mask, prompt in zip(rows.tokens, rows.loss_mask, expected):
        assert row[:len(prompt)].tolist() == prompt and not mask[:len(prompt)].any() and mask[len(prompt)]


def test_prompts_file_options_are_checked(trained, tmp_path, capsys):
    root, _ = trained
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("import os\n")
    base = ["--target", str(root / "target"), "--out", str(tmp_path / "draft"), "--seq-len", "64"]
    for extra, message in ((["--prompts", str(prompts)], "--prompts are the prompts of --regenerate N"),
                           (["--chat"], "--chat renders --prompts"),
                           (["--prompts", str(prompts), "--regenerate", "2"], "holds 1 prompts"),
                           (["--prompts", str(prompts), "--regenerate", "1", "--data", TEXT_GLOB],
                            "the text of --data would go unused"),
                           (["--prompts", str(prompts), "--regenerate", "1", "--chat"], "has no chat template"),
                           (["--prompts", str(prompts), "--regenerate", "1", "--system", "s"], "--system needs --chat"),
                           (["--prompts", str(prompts), "--regenerate", "1", "--no-thinking"],
                            "--no-thinking needs --chat"),
                           (["--prompts", str(prompts), "--regenerate", "1", "--seq-len", "3"],
                            "(the first: line 1, ")):
        assert message in cli_error(train_draft.main, base + extra, capsys)
    assert not (tmp_path / "draft.ckpt").exists()


def test_regenerated_rows_are_kept_per_record(tmp_path):
    rows = data.TokenRows(np.arange(8, dtype=np.int32).reshape(2, 4), np.ones((2, 4), bool))
    made = []

    def make(done, on_batch):
        made.append(1)
        return rows
    for record in ({"seed": 0}, {"seed": 0}, {"seed": 1}, {"seed": 1}):
        again = train_draft.regenerated_rows(tmp_path, record, make)
        np.testing.assert_array_equal(again.tokens, rows.tokens)
        np.testing.assert_array_equal(again.loss_mask, rows.loss_mask)
    assert len(made) == 2 and [p.name for p in tmp_path.iterdir()] == [train_draft.REGENERATED_FILE]


def test_interrupted_regeneration_goes_on_from_its_last_finished_batch(tmp_path, monkeypatch):
    """Each finished batch is kept: a second run generates only the batches left, with the same
    seeds, and gives the rows an uninterrupted run gives; another record starts afresh."""
    import functools

    import dflash_jax.runtime.generation

    seeds, fail_at = [], {"call": 3}

    def fake_generate(target, prompts, *, max_new_tokens, seed, **kwargs):
        seeds.append(seed)
        if len(seeds) == fail_at["call"]:
            raise KeyboardInterrupt
        return dflash_jax.runtime.generation.GenerationResult([[seed + 1] * n for n in max_new_tokens], None)

    monkeypatch.setattr(dflash_jax.runtime.generation, "generate", fake_generate)
    monkeypatch.setattr(train_draft, "stop_token_ids", lambda target: [0])
    make = functools.partial(train_draft.regenerate, None, [[1, 2]] * 5, seq_len=4, temperature=0.0,
                             batch_size=2, pad_id=0)
    with pytest.raises(KeyboardInterrupt):
        train_draft.regenerated_rows(tmp_path, {"seed": 0}, make)
    assert seeds == [0, 2, 4]
    (tmp_path / train_draft.REGENERATED_PARTS / "partial-4.npz").write_bytes(b"half-written")
    seeds.clear(), fail_at.update(call=0)
    rows = train_draft.regenerated_rows(tmp_path, {"seed": 0}, make)
    assert seeds == [4] and rows.tokens[:, 2].tolist() == [1, 1, 3, 3, 5]
    assert [p.name for p in tmp_path.iterdir()] == [train_draft.REGENERATED_FILE]
    seeds.clear(), fail_at.update(call=2)
    with pytest.raises(KeyboardInterrupt):
        train_draft.regenerated_rows(tmp_path, {"seed": 1}, make)
    seeds.clear(), fail_at.update(call=0)
    train_draft.regenerated_rows(tmp_path, {"seed": 2}, make)
    assert seeds == [0, 2, 4]  # the parts of record {"seed": 1} were not used


def test_generation_stops_where_the_generate_cli_does(trained, tmp_path):
    folder = tmp_path / "target"
    shutil.copytree(trained[0] / "target", folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 7]}))
    target = load_target(folder, dtype="float32")
    assert train_draft.stop_token_ids(target) == Tokenizer(folder).stop_token_ids == [0, 7]
    (folder / "tokenizer.json").unlink()
    with pytest.warns(UserWarning, match="no tokenizer.json"):
        assert train_draft.stop_token_ids(target) == list(target.config.eos_token_ids) == [0]


def _reference_models(root):
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3ForCausalLM

    target = Qwen3ForCausalLM.from_pretrained(root / "target", dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(root / "draft", dtype=torch.float32).eval()
    return target, draft


def test_export_round_trip_same_draft_logits(trained):
    from dflash.model import extract_context_feature

    root = trained[0]
    target = load_target(root / "target", dtype="float32")
    draft = load_draft(root / "draft", target, dtype="float32")
    ref_target, ref_draft = _reference_models(root)
    tokens = data.load_tokenizer(root / "target").encode("import json\nx = json.loads(s)\n").ids[:16]
    anchor, block = len(tokens) - 1, draft.config.block_size
    with torch.no_grad():
        hidden = ref_target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        taps = extract_context_feature(hidden, ref_draft.target_layer_ids)
        block_ids = torch.tensor([[tokens[anchor]] + [ref_draft.mask_token_id] * (block - 1)])
        ref_hidden = ref_draft(target_hidden=taps[:, :anchor], noise_embedding=ref_target.model.embed_tokens(block_ids),
                               position_ids=torch.arange(anchor + block)[None])
        ref_logits = ref_draft.compute_logits(ref_hidden, ref_target.lm_head).numpy()

    # Ours: the training forward (one anchor at the last token) on the reloaded draft.
    row = jnp.asarray([tokens], jnp.int32)
    _, our_taps = train_target.causal_forward(target.params, target.config, row, draft.config.target_layer_ids)
    np.testing.assert_allclose(np.asarray(our_taps), taps.numpy(), atol=1e-4, rtol=1e-4)
    anchors = jnp.array([[anchor]], jnp.int32)
    blocks = data.make_blocks(row, jnp.ones_like(row, bool), anchors, block, draft.config.mask_token_id)
    ours = train_draft.draft_block_hidden(draft.params, draft.config, target.params, our_taps, blocks, anchors)
    logits = train_draft.draft_model.draft_logits(draft.params, draft.config, target.params, ours)
    np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=2e-4, rtol=2e-4)


def test_reference_dflash_generate_matches_ours(trained, monkeypatch):
    import dflash.model as reference

    from dflash_jax.runtime.generation import generate

    monkeypatch.setattr(reference, "_cuda_time", lambda: 0.0)   # no CUDA on CPU
    root = trained[0]
    ref_target, ref_draft = _reference_models(root)
    target = load_target(root / "target", dtype="float32")
    draft = load_draft(root / "draft", target, dtype="float32")
    tokens = data.load_tokenizer(root / "target").encode("class Encoder:\n    def encode(self, o):\n").ids
    ours = generate(target, [tokens], draft=draft, max_new_tokens=24, impl="reference")
    ref = reference.dflash_generate(ref_draft, ref_target, torch.tensor([tokens]), 24, None, temperature=0.0,
                                    return_stats=True)
    assert ours.tokens[0] == ref.output_ids[0, len(tokens):].tolist()
    assert ours.stats.accept_lengths[0] == ref.acceptance_lengths
    assert max(ref.acceptance_lengths) > 1, "the draft should get some tokens accepted"


def test_a_vocabulary_smaller_than_bytes_warns(tmp_path):
    """A byte-level BPE holds at least the 256 bytes and its special tokens: a smaller
    --vocab-size is raised to that, with a warning saying so."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("a.py", "b.py", "c.py"):
        (corpus / name).write_text("def f(x):\n    return x + 1\n" * 20)
    train = train_target.TargetTrainConfig(shape=train_target.TinyTargetShape(vocab_size=100), seq_len=16)
    with pytest.warns(UserWarning, match=r"the tokenizer has \d+ tokens, not the 100 asked for"):
        run = train_target.open_target_run(tmp_path / "target", train, corpus=corpus)
    assert run.config.vocab_size > 256


def test_target_shape_must_suit_the_kernels():
    with pytest.raises(ValueError, match="must be a multiple of num_kv_heads"):
        train_target.TinyTargetShape(num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="head_dim"):
        train_target.TinyTargetShape(head_dim=48)


def test_schedule_and_time_budget(tmp_path):
    optim = train_target.OptimConfig(steps=100, lr=1e-3, warmup_frac=0.04)
    rates = [optim.learning_rate(s, 100) for s in range(100)]
    assert rates[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3]) and rates[-1] < 1e-6
    cosine = [1e-3 * 0.5 * (1 + math.cos(math.pi * (s - 4) / 96)) for s in range(4, 100)]  # from the peak
    assert rates[4:] == pytest.approx(cosine, rel=1e-9) and rates[-1] > 0
    assert np.all(np.diff(rates[3:]) <= 0)

    def step_fn(state, learning_rate):
        time.sleep(0.05)
        return state.replace(step=state.step + 1), {"loss": learning_rate}

    state = train_target.TrainState(step=jnp.zeros((), jnp.int32), params={"w": jnp.ones(2)}, opt_state=())
    state, history = train_target.run_training(
        state, step_fn, lambda step: (), optim=dataclasses.replace(optim, steps=1000), ckpt_dir=tmp_path,
        save_every=1000, resume=False, desc="budget", postfix=lambda m: {}, time_budget=1.5)
    total = json.loads((tmp_path / "schedule.json").read_text())["total_steps"]
    assert 12 <= total < 40 and int(state.step) == len(history) == total
    assert history[-1]["loss"] == pytest.approx(optim.learning_rate(total - 1, total))

    # Steps that slow down after the pace was measured (a busy machine, evaluations): the
    # schedule is shortened and the run still ends near its budget, with its rate annealed.
    def slowing_step(state, learning_rate):
        time.sleep(0.02 if int(state.step) < 20 else 0.08)
        return state.replace(step=state.step + 1), {"loss": learning_rate}

    state = train_target.TrainState(step=jnp.zeros((), jnp.int32), params={"w": jnp.ones(2)}, opt_state=())
    began = time.perf_counter()
    state, history = train_target.run_training(
        state, slowing_step, lambda step: (), optim=dataclasses.replace(optim, steps=1000),
        ckpt_dir=tmp_path / "slowing", save_every=1000, resume=False, desc="budget", postfix=lambda m: {},
        time_budget=2.0)
    seconds = time.perf_counter() - began
    total = json.loads((tmp_path / "slowing" / "schedule.json").read_text())["total_steps"]
    assert int(state.step) == len(history) == total and seconds < 3.0  # unchecked: ~5.6 s
    assert history[-1]["loss"] == pytest.approx(optim.learning_rate(total - 1, total))

    # Steps slower than the budget allows before the pace is measured (3-12 steps): the run ends
    # at the first step that finds the budget spent.
    def slow_step(state, learning_rate):
        time.sleep(0.2)
        return state.replace(step=state.step + 1), {"loss": learning_rate}

    state = train_target.TrainState(step=jnp.zeros((), jnp.int32), params={"w": jnp.ones(2)}, opt_state=())
    began = time.perf_counter()
    state, history = train_target.run_training(
        state, slow_step, lambda step: (), optim=dataclasses.replace(optim, steps=40), ckpt_dir=tmp_path / "slow",
        save_every=1000, resume=False, desc="budget", postfix=lambda m: {}, time_budget=0.5)
    assert int(state.step) == len(history) <= 4 and time.perf_counter() - began < 1.5  # unchecked: 12 steps


def test_corpus_special_token_strings_stay_text_and_dangling_links_are_skipped(tmp_path):
    """Source code that spells a special token trains on its text, not on the control token; a
    dangling *.py link or a folder named *.py is not a corpus file."""
    from dflash_jax.entrypoints.generate import DEFAULT_MODEL

    tokenizer = data.load_tokenizer(DEFAULT_MODEL / "target")
    eos = tokenizer.token_to_id(data.EOS_TOKEN)
    text = f's = "{data.EOS_TOKEN}"  # and <|mask|>'
    ids = data.encode_documents(tokenizer, [text], eos_id=eos)[0].tolist()
    assert ids[-1] == eos and eos not in ids[:-1] and tokenizer.token_to_id("<|mask|>") not in ids
    assert tokenizer.decode(ids[:-1]) == text
    assert tokenizer.encode(data.EOS_TOKEN).ids == [eos]  # the tokenizer's own setting is restored
    for name in ("a.py", "c.py"):
        (tmp_path / name).write_text("x = 1\n")
    (tmp_path / "stale.py").symlink_to(tmp_path / "gone.py")
    (tmp_path / "pkg.py").mkdir()
    train, heldout = data.source_files(tmp_path)
    assert sorted(p.name for p in train + heldout) == ["a.py", "c.py"]


def test_corpus_files_that_are_not_utf8_are_named(tmp_path):
    """A UTF-16 file still reads (as replacement characters) but is named in a warning."""
    (tmp_path / "ok.py").write_text("x = 1\n", encoding="utf-8")
    (tmp_path / "wide.py").write_text("x = 'é'\n", encoding="utf-16")
    with pytest.warns(UserWarning, match=r"1 file\(s\) are not UTF-8.*wide\.py"):
        texts = data.read_texts([tmp_path / "ok.py", tmp_path / "wide.py"])
    assert texts[0] == "x = 1\n" and "\ufffd" in texts[1]


@pytest.mark.parametrize("command", [train_target, train_draft], ids=["train_target", "train_draft"])
def test_training_refuses_a_compile_cache_it_cannot_write(command, tmp_path, capsys):
    """The training command lines keep compiled programs as generate does (``--compile-cache``, so
    a resumed run loads its step instead of compiling it); a folder they cannot write is one error
    line before any work."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    args = ["--out", str(tmp_path / "out"), "--compile-cache", str(blocker / "xla")]
    if command is train_draft:
        args += ["--target", str(tmp_path / "target")]
    err = cli_error(command.main, args, capsys)
    assert err.count("\n") == 1
    assert err.startswith(f"error: --compile-cache {blocker / 'xla'}: cannot write {blocker / 'xla'}")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# What mutation testing found unpinned (2026-11-26): seeds, metrics, the optimizer, held-out data.

def test_gradients_are_clipped_and_only_matrices_decay():
    """AdamW sees gradients clipped to ``clip`` global norm (its first moment after one step is
    (1 - b1) x the clipped gradient), and weight decay moves matrices, never vectors (norm weights)."""
    optimizer = train_target.make_optimizer(train_target.OptimConfig(steps=1, lr=1.0, clip=1.0))
    params = {"w": jnp.zeros((3, 3)), "b": jnp.zeros(3)}
    grads = {"w": jnp.full((3, 3), 100.0), "b": jnp.zeros(3)}                # global norm 300
    _, opt_state = optimizer.update(grads, optimizer.init(params), params)
    first_moment = optax.tree_utils.tree_get(opt_state, "mu")
    assert float(train_target.global_norm(first_moment)) == pytest.approx(0.1, rel=1e-5)

    params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    state = train_target.TrainState.create(params, optimizer)
    zero = jax.tree.map(jnp.zeros_like, params)
    state = train_target.apply_gradients(state, zero, optimizer, jnp.float32(1.0))
    np.testing.assert_allclose(state.params["w"], 1 - 0.01, rtol=1e-6)       # decoupled decay, lr 1
    np.testing.assert_array_equal(state.params["b"], 1.0)


def test_draft_metrics_count_supervised_labels_only(random_pair):
    """position_accuracy and the τ proxy count a block position only where its label is supervised:
    a prediction that equals an unsupervised label is not a hit."""
    from dflash_jax.model import draft as draft_model

    target, draft = random_pair.target, random_pair.draft
    config = dataclasses.replace(draft.config, block_size=4)
    anchors = jnp.asarray([[3]], jnp.int32)
    loss_mask = np.ones((1, 12), bool)
    loss_mask[0, 5] = False                                  # the block's second label (position 5)

    def predictions(tokens):
        _, taps = train_draft.causal_forward(target.params, target.config, tokens, config.target_layer_ids)
        blocks = data.make_blocks(tokens, jnp.asarray(loss_mask), anchors, 4, config.mask_token_id)
        hidden = train_draft.draft_block_hidden(draft.params, config, target.params, taps, blocks, anchors)
        logits = draft_model.draft_logits(draft.params, config, target.params, hidden.reshape(1, 1, 4, -1)[:, :, 1:])
        return np.asarray(jnp.argmax(logits, -1))[0, 0]

    tokens = np.random.default_rng(1).integers(0, 127, (1, 12)).astype(np.int32)
    predicted = predictions(jnp.asarray(tokens))
    # The block reads the context before its anchor and token 3 only, so its predictions stay put
    # while its labels (tokens 4-6) are set: right, right (unsupervised), wrong.
    tokens[0, 4:7] = predicted[0], predicted[1], (predicted[2] + 1) % 127
    tokens = jnp.asarray(tokens)
    assert (predictions(tokens) == predicted).all()
    _, metrics = train_draft.draft_loss(draft.params, target.params, tokens, jnp.asarray(loss_mask), anchors,
                                        config=config, target_config=target.config, gamma=2.0, dtype=jnp.float32)
    assert np.asarray(metrics["position_accuracy"]).tolist() == [1.0, 0.0, 0.0]
    assert float(metrics["tau_proxy"]) == 2.0


def test_each_step_draws_its_own_anchors_and_gamma_weighs_the_loss(random_pair):
    """train_step's anchors come from the seed folded with the step (another step, other anchors;
    the same step, the same ones), and DraftTrainConfig.gamma reaches the loss."""
    target, draft = random_pair.target, random_pair.draft
    config = dataclasses.replace(draft.config, block_size=4)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 127, (1, 32)), jnp.int32)
    mask = jnp.ones((1, 32), bool)

    def loss(step: int, **recipe) -> float:
        train = train_draft.DraftTrainConfig(num_anchors=2, compute_dtype="float32", **recipe)
        params = jax.tree.map(jnp.copy, draft.params)  # the state is donated
        state = train_target.TrainState.create(params, train_target.make_optimizer(train.optim))
        state = state.replace(step=jnp.asarray(step, jnp.int32))
        _, metrics = train_draft.train_step(state, jnp.float32(0.0), target.params, tokens, mask, config=config,
                                            target_config=target.config, train=train)
        return float(metrics["loss"])

    assert loss(0) == loss(0)
    assert loss(1) != loss(0)
    assert loss(0, seed=1) != loss(0)
    assert loss(0, gamma=0.5) != loss(0)


def test_the_draft_starts_from_weights_of_its_seed(random_pair, tmp_path, monkeypatch):
    """``--seed`` draws the draft's initial weights too, not only the batches and anchors."""
    keys = []

    class Drawn(Exception):
        pass

    def record(config, key, dtype):
        keys.append(np.asarray(jax.random.key_data(key)).tolist())
        raise Drawn

    monkeypatch.setattr(train_draft, "init_draft_params", record)
    rows = data.TokenRows(np.zeros((1, 8), np.int32), np.ones((1, 8), bool))
    for seed in (0, 1, 0):
        with pytest.raises(Drawn):
            train_draft.train_in_run(random_pair.target, rows, tmp_path / "out", random_pair.draft.config,
                                     train_draft.DraftTrainConfig(seed=seed), tmp_path / "ckpt", resume=False)
    assert keys[0] != keys[1] and keys[0] == keys[2]


def test_a_resumed_draft_run_sees_its_data_change(trained, tmp_path, monkeypatch):
    """The draft run's record holds a digest of the --data text, so --resume refuses a file that
    changed behind the same path (the record's comparison: ``claim_run_folders``)."""
    records = []

    class Claimed(Exception):
        pass

    def claim(target_config, target_path, out_dir, draft_config, train, data_record, **kwargs):
        records.append(data_record)
        raise Claimed

    monkeypatch.setattr(train_draft, "open_draft_run", claim)
    text = tmp_path / "notes.txt"
    args = ["--target", str(trained[0] / "target"), "--out", str(tmp_path / "draft"), "--data", str(text),
            "--seq-len", "16", "--num-layers", "1", "--block-size", "4"]
    for content in ("def f(x):\n    return x\n", "def f(x):\n    return x + 1\n"):
        text.write_text(content)
        with pytest.raises(Claimed):
            train_draft.main(args)
    assert records[0]["data"] == records[1]["data"] and records[0]["sha256"] != records[1]["sha256"]


def _corpus_with_a_heldout_file(folder: Path) -> Path:
    """a.py and c.py train, g.py is held out (``test_small_corpus_folders_hold_out_one_file``),
    each file one line repeated, the held-out one with characters of its own."""
    folder.mkdir()
    for name in ("a.py", "c.py"):
        (folder / name).write_text("zzzz = 2\n" * 300)
    (folder / "g.py").write_text("aaaa = 1\n" * 300)
    return folder


def test_eval_prompts_come_from_the_held_out_files(trained, tmp_path):
    corpus = _corpus_with_a_heldout_file(tmp_path / "corpus")
    tokenizer = data.load_tokenizer(trained[0] / "target")
    args = argparse.Namespace(eval_corpus=str(corpus), eval_prompts=3, prompt_len=6)
    prompts = train_draft._eval_prompts(args, tokenizer, None)
    assert len(prompts) == 3
    for prompt in prompts:
        text = tokenizer.decode(prompt)
        assert text.strip() and set(text) <= set("aaaa = 1\n"), text


def test_target_held_out_rows_come_from_the_held_out_files(tmp_path):
    corpus = _corpus_with_a_heldout_file(tmp_path / "corpus")
    train = train_target.TargetTrainConfig(shape=train_target.TinyTargetShape(vocab_size=300), seq_len=16)
    with pytest.warns(UserWarning, match="the tokenizer has"):
        run = train_target.open_target_run(tmp_path / "out", train, corpus=corpus)
    tokenizer = data.load_tokenizer(tmp_path / "out.ckpt" / "tokenizer")
    for rows, line in ((run.eval_rows, "aaaa = 1\n"), (run.rows, "zzzz = 2\n")):
        text = "".join(tokenizer.decode(row.tolist()) for row in rows.tokens).replace(data.EOS_TOKEN, "")
        assert text.strip() and set(text) <= set(line), text[:80]


def test_resume_keeps_the_schedule_its_run_recorded(tmp_path):
    """A resumed run ends where its schedule.json says (a time budget may have shortened it), at
    that schedule's rates: not at OptimConfig.steps."""
    class Stopped(Exception):
        pass

    def step_fn(state, learning_rate, stop_at=None):
        if int(state.step) == stop_at:
            raise Stopped
        return state.replace(step=state.step + 1), {"loss": learning_rate}

    optim = train_target.OptimConfig(steps=10, lr=1e-3)
    state = train_target.TrainState(step=jnp.zeros((), jnp.int32), params={"w": jnp.ones(2)},
                                    opt_state={"m": jnp.zeros(2)})
    common = dict(optim=optim, ckpt_dir=tmp_path, save_every=1, desc="schedule", postfix=lambda m: {})
    with pytest.raises(Stopped):
        train_target.run_training(state, lambda s, lr: step_fn(s, lr, stop_at=2), lambda step: (), resume=False,
                                  **common)
    (tmp_path / "schedule.json").write_text(json.dumps({"total_steps": 5}))  # as a budget shortened it
    state, history = train_target.run_training(state, step_fn, lambda step: (), resume=True, **common)
    assert int(state.step) == 5 and [h["step"] for h in history] == [1, 2, 3, 4, 5]
    assert [h["loss"] for h in history[2:]] == pytest.approx([optim.learning_rate(s, 5) for s in (2, 3, 4)])
