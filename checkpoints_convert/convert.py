"""HF folder -> converted folder (orbax params + config.json + tokenizer files + marker).

Conversion streams the source tensor by tensor into host arrays of the output dtype and writes
each layer with orbax as soon as its last tensor arrives, without further copies (with
orbax-checkpoint >= 0.12.5), so peak memory is about one layer: a 61 GB bf16 Qwen3-30B-A3B
converts on a 24 GB machine. Output is atomic: everything is written into a hidden sibling
directory that is renamed to OUT only when complete.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Iterator

from dflash_jax.loading import checkpoint
from dflash_jax.entrypoints.cli import deferred_interrupts
from dflash_jax.model.config import read_config_json
from dflash_jax.model.hf_config import is_draft_config
from dflash_jax.loading.models import DTYPES

# Files copied next to the converted weights when the source has them.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
              "generation_config.json")


@contextlib.contextmanager
def atomic_output(out: Path, overwrite: bool) -> Iterator[Path]:
    """Yield an empty hidden sibling directory of ``out``; when the block completes it becomes
    ``out`` (replacing an existing one only with ``overwrite``, and then only a model folder or
    an empty one), with the umask's permissions on everything inside, and on any failure, Ctrl-C
    included, it is removed and ``out`` is left as it was. The checks run again at the end, for
    an ``out`` that appeared meanwhile."""
    check_replaceable(out, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise _cannot_write(out, error) from None
    stale = sorted(path.name for suffix in ("tmp", "old") for path in out.parent.glob(f".{out.name}.*.{suffix}"))
    if stale:
        warnings.warn(f"{out.parent} holds {', '.join(stale)}, left by an interrupted conversion or export "
                      f"to {out.name} (*.old: a folder it replaced); delete them once none is running",
                      stacklevel=3)
    tmp = out.parent / f".{out.name}.{secrets.token_hex(4)}.tmp"
    try:
        tmp.mkdir()  # not mkdtemp: OUT gets the umask's permissions, not 0700
    except OSError as error:
        raise _cannot_write(out, error) from None
    trash = None
    try:
        yield tmp
        _apply_umask_permissions(tmp)
        check_replaceable(out, overwrite)
        if out.exists() or out.is_symlink():
            trash = tmp.with_suffix(".old")
            out.rename(trash)
            try:
                tmp.rename(out)
            except BaseException:
                trash.rename(out)
                raise
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # OUT is complete from here on: an interrupt waits for the replaced folder's removal (a second
    # one leaves it, named by the warning above on the next run)
    if trash is not None:
        with deferred_interrupts(f"{out} is written; removing the folder it replaced"):
            if trash.is_dir() and not trash.is_symlink():
                shutil.rmtree(trash)
            else:
                trash.unlink()


def check_replaceable(out: Path, overwrite: bool) -> None:
    """FileExistsError unless ``out`` is absent, or ``overwrite`` and it is an empty folder or a
    model folder (HF or converted: config.json inside), never a user's other folder; only where
    ``overwrite`` would replace it does the error suggest it."""
    if not (out.exists() or out.is_symlink()):
        return
    if out.is_symlink() or not out.is_dir() or not ((out / "config.json").is_file() or not any(out.iterdir())):
        raise FileExistsError(f"{out} already exists and is not a model folder (with a config.json) or an empty "
                              "folder: refusing to replace it, even with --overwrite / overwrite=True; choose "
                              "another output folder")
    if not overwrite:
        raise FileExistsError(f"{out} already exists (use --overwrite / overwrite=True to replace it)")


def check_writable(out: Path) -> None:
    """OSError naming ``out`` unless it could be written: its nearest existing ancestor folder
    takes a new folder (``atomic_output`` makes the missing ones and a hidden sibling of ``out``).
    For callers with long work before the write, such as training, which would otherwise fail
    only at its export; leaves nothing behind."""
    ancestor = next(folder for folder in out.absolute().parents if folder.exists())
    probe = ancestor / f".{out.name}.{secrets.token_hex(4)}.probe"
    try:
        probe.mkdir()
    except OSError as error:
        raise _cannot_write(out, error) from None
    probe.rmdir()


def _cannot_write(out: Path, error: OSError) -> OSError:
    """``error``, met making a folder for ``out`` (a hidden sibling or a parent), as an error of its
    kind naming ``out`` and the folder that refused, not the folder it was making."""
    refused = f" (in {Path(error.filename).parent})" if error.filename else ""
    return type(error)(f"cannot write {out}: {error.strerror or error}{refused}")


def _apply_umask_permissions(root: Path) -> None:
    """Give everything under ``root`` the permissions of a plain create under the umask: those of
    ``root`` itself (made by mkdir: 0o777 less the umask) for folders, without execute bits for
    files. Writers may leave others: safetensors writes through an owner-only temp file, and
    copy2 keeps the source's mode."""
    folder_mode = root.stat().st_mode & 0o777
    for path in root.rglob("*"):
        if not path.is_symlink():
            path.chmod(folder_mode if path.is_dir() else folder_mode & 0o666)


def _stating_dtype(config_json: dict, dtype: str) -> dict:
    """``config_json`` saying that its weights are stored as ``dtype``: ``dtype`` (transformers 5)
    and ``torch_dtype`` (older readers) at the top, and those of them a release's ``text_config``
    has."""
    stated = {**config_json, "dtype": dtype, "torch_dtype": dtype}
    text = config_json.get("text_config")
    if isinstance(text, dict):
        stated["text_config"] = {**text, **{key: dtype for key in ("dtype", "torch_dtype") if key in text}}
    return stated


def _until(interrupted, leaves):
    """``leaves``, raising KeyboardInterrupt before the next one once an interrupt has arrived
    (the layers already handed to orbax finish writing first)."""
    for leaf in leaves:
        if interrupted():
            raise KeyboardInterrupt
        yield leaf


def convert(src: str | Path, out: str | Path, *, dtype: str = "bfloat16", overwrite: bool = False,
            progress: bool = True) -> Path:
    """Convert the HF folder ``src`` (a target of any supported family, or a DFlash draft in z-lab or speculators
    format, told apart by its config.json) into ``out``, which ``dflash_jax.loading.models.load_target``
    / ``load_draft`` then read. Floats are stored as ``dtype``, which config.json states. Raises ConfigError or
    CheckpointError (naming the field or tensor) when config and weights disagree, and
    FileExistsError when ``out`` exists and not ``overwrite``; a failed conversion leaves nothing.
    """
    src, out = Path(src), Path(out)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a directory (expected an HF model folder)")
    if checkpoint.is_converted(src):
        raise ValueError(f"{src} is already a converted folder: load_target / load_draft and "
                         "python -m dflash_jax.generate read it as it is")
    if out.resolve() == src.resolve() or out.resolve() in src.resolve().parents:
        raise ValueError(f"output {out} would replace the source folder {src}")
    raw_config = read_config_json(src)
    kind = "draft" if is_draft_config(raw_config) else "target"
    with atomic_output(out, overwrite) as tmp:
        config, structure, leaves = checkpoint.hf_source(src, kind, DTYPES[dtype], progress=progress)
        if kind == "draft" and config.source_format == "speculators" and config.draft_vocab_size is None:
            dropped = checkpoint.speculators_copies(src)
            if dropped:
                warnings.warn(f"{src}: the draft's own {' and '.join(dropped)} are not kept: a converted draft uses "
                              "the target's (vLLM would use the draft's); load_draft on the HF folder with its "
                              "target warns if they differ", stacklevel=2)
        # orbax writes from threads that outlive a KeyboardInterrupt in this one: let them finish
        # before the partial output is removed
        with deferred_interrupts("finishing the write of params/, then removing the partial output") as interrupted:
            checkpoint.save_params(tmp, checkpoint.LeafStream(structure, _until(interrupted, leaves)))
        if interrupted():
            raise KeyboardInterrupt
        (tmp / "config.json").write_text(json.dumps(_stating_dtype(raw_config, dtype), indent=2) + "\n")
        for name in SIDE_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        checkpoint.write_marker(tmp, kind, dtype, mxfp4_experts=kind == "target" and config.mxfp4_experts)
    return out
