"""Reading and writing model weights: HF safetensors folders (streamed tensor by tensor) and
this library's orbax checkpoints. Every shape is checked against the config; missing, extra or
misshapen tensors raise CheckpointError naming the tensor.

Which HF tensor goes where is the family's table (``dflash_jax.model.families.tensors``): loading,
conversion and exporting all read it, so the names live in one place. Tensors that share a leaf
(q/k/v columns, a MoE layer's experts) are written into one preallocated buffer as they arrive.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import json
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from safetensors import safe_open
from tqdm import tqdm

from dflash_jax.loading import mxfp4
from dflash_jax.model.config import DraftConfig, ModelConfig, read_json
from dflash_jax.model.hf_config import load_draft_config, load_target_config
from dflash_jax.model.families import get as get_family
from dflash_jax.model.families.tensors import Slot, column_index, column_width, draft_slots, target_slots
from dflash_jax.model.params import DraftParams, TargetParams, init_draft_params, init_target_params

PARAMS_DIR = "params"          # orbax checkpoints inside a converted folder, one per group of leaves
MARKER_FILE = "dflash_jax.json"
# of converted folders; bump when their layout changes (2: fused qkv/gate_up; 3: params by layer
# and block, one orbax checkpoint per layer)
FORMAT_VERSION = 3


class CheckpointError(ValueError):
    """Weights that do not match their config."""


# Tensors of a full-vocabulary speculators draft that this library does not keep: copies of the
# target's embedding and LM head, and identity id maps.
SPECULATORS_HEAD_COPIES = ("embed_tokens.weight", "lm_head.weight")
SPECULATORS_COPIES = SPECULATORS_HEAD_COPIES + ("d2t", "t2d")


def _key_path(path) -> tuple:
    return tuple(getattr(k, "name", getattr(k, "idx", getattr(k, "key", None))) for k in path)


def leaves_by_path(params) -> dict[tuple, Any]:
    """Every non-None leaf of a params pytree under its key path (``("layers", 0, "o_proj")``)."""
    return {_key_path(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(params)}


def _fill(structure, values: dict[tuple, Any]):
    """``structure``'s pytree with its leaves taken from ``values`` by key path."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(structure)
    return jax.tree_util.tree_unflatten(treedef, [values[_key_path(p)] for p, _ in paths])


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of an HF folder: model.safetensors, or the shards its index names."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map' object")
        if not all(isinstance(shard, str) for shard in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' values must be shard file names")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard file(s) that are missing: {missing}")
        return [directory / s for s in shards]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json")


@contextlib.contextmanager
def _open_safetensors(path: Path):
    """safe_open, with a corrupt or truncated file reported as a CheckpointError naming it
    (safetensors raises its own SafetensorError, neither an OSError nor a ValueError)."""
    try:
        handle = safe_open(str(path), framework="numpy")
    except Exception as error:  # noqa: BLE001 - any failure to parse the header
        raise CheckpointError(f"{path}: not a readable safetensors file ({error})") from error
    with handle:
        yield handle


def _load_tensor(handle, path: Path, name: str) -> np.ndarray:
    try:
        return handle.get_tensor(name)
    except Exception as error:  # noqa: BLE001 - e.g. a dtype numpy lacks (float8), truncated data
        raise CheckpointError(f"{path}: tensor '{name}' could not be read ({error})") from error


def iter_tensors(directory: Path, packed_mxfp4: bool = False
                 ) -> Iterator[tuple[str, Callable[[], np.ndarray], tuple[int, ...]]]:
    """(name, load, shape) for every tensor, loading one tensor at a time on demand. An MXFP4
    pair (uint8 ``<name>_blocks`` and ``<name>_scales``, gpt-oss's experts) comes as the one
    tensor ``<name>`` in transformers' layout, dequantised to float32 when loaded
    (``mxfp4.dequantize_pair``), or with ``packed_mxfp4`` as its two tensors, the blocks' last two
    axes [G, 16] flattened (``Slot.mxfp4``); CheckpointError for half a pair."""
    parts: dict[str, dict[str, tuple[Path, tuple[int, ...]]]] = {}
    for path in safetensors_files(directory):
        with _open_safetensors(path) as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                shape = tuple(piece.get_shape())
                suffix = name[-len(mxfp4.BLOCKS_SUFFIX):]
                if piece.get_dtype() == "U8" and suffix in (mxfp4.BLOCKS_SUFFIX, mxfp4.SCALES_SUFFIX):
                    base = name[:-len(suffix)]
                    pair = parts.setdefault(base, {})
                    pair[suffix] = (path, shape)
                    if len(pair) < 2:
                        continue
                    dequantized_shape = _checked_mxfp4_shape(directory, base, parts_of=pair)
                    if not packed_mxfp4:
                        yield base, functools.partial(_dequantized, base, parts.pop(base)), dequantized_shape
                        continue
                    for part, (part_path, part_shape) in sorted(parts.pop(base).items()):
                        if part == mxfp4.BLOCKS_SUFFIX:
                            part_shape = part_shape[:-2] + (part_shape[-2] * part_shape[-1],)
                        yield base + part, functools.partial(_packed_part, part_path, base + part, part_shape), part_shape
                    continue
                yield name, (lambda h=handle, p=path, n=name: _load_tensor(h, p, n)), shape
    if parts:
        base, pair = next(iter(parts.items()))
        have, lack = next(iter(pair)), ({mxfp4.BLOCKS_SUFFIX, mxfp4.SCALES_SUFFIX} - set(pair)).pop()
        raise CheckpointError(f"{directory}: MXFP4 tensor '{base}{have}' has no '{base}{lack}'")


def _packed_part(path: Path, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """One half of an MXFP4 pair as stored, in ``shape`` (the blocks' [G, 16] flattened)."""
    with _open_safetensors(path) as handle:
        return _load_tensor(handle, path, name).reshape(shape)


def _checked_mxfp4_shape(directory: Path, base: str, parts_of: dict) -> tuple[int, ...]:
    blocks, scales = parts_of[mxfp4.BLOCKS_SUFFIX][1], parts_of[mxfp4.SCALES_SUFFIX][1]
    if len(blocks) != 4 or blocks[-1] != 16 or blocks[:-1] != scales:
        raise CheckpointError(f"{directory}: MXFP4 tensors '{base}_blocks' {list(blocks)} and '{base}_scales' "
                              f"{list(scales)} must be [E, rows, G, 16] and [E, rows, G]")
    return mxfp4.dequantized_shape(blocks)


def _dequantized(base: str, pair: dict) -> np.ndarray:
    arrays = {}
    for suffix, (path, _) in pair.items():
        with _open_safetensors(path) as handle:
            arrays[suffix] = _load_tensor(handle, path, base + suffix)
    return mxfp4.dequantize_pair(arrays[mxfp4.BLOCKS_SUFFIX], arrays[mxfp4.SCALES_SUFFIX])


def _count_tensors(directory: Path, packed_mxfp4: bool) -> int:
    return sum(1 for _ in iter_tensors(directory, packed_mxfp4))


def stream_leaves(directory: Path, slots: dict[str, Slot], structure, dtype, ignored: Callable[[str], bool], *,
                  progress: bool, packed_mxfp4: bool = False) -> Iterator[tuple[tuple, np.ndarray]]:
    """Stream every tensor of an HF folder into its slot and yield each leaf (key path, host
    array) as soon as it is whole: check name and shape before loading, transpose Linear
    weights, cast floats to ``dtype`` (id maps to int32; MXFP4 pairs dequantised, or with
    ``packed_mxfp4`` kept as their uint8 halves). A tensor that fills part of a leaf
    (``Slot.columns``, ``Slot.expert``) is copied into the leaf's buffer, allocated at its first
    part (the shapes come from ``structure``, the params' ShapeDtypeStructs). Holds one source
    tensor at a time besides the leaves still incomplete. CheckpointError for tensors missing at
    the end."""
    where = str(directory)
    shapes = {path: leaf.shape for path, leaf in leaves_by_path(structure).items()}
    seen = set()
    parts_left = collections.Counter(slot.path for slot in slots.values() if slot.is_part)
    buffers = {}
    tensors = iter_tensors(directory, packed_mxfp4)
    if progress:
        tensors = tqdm(tensors, total=_count_tensors(directory, packed_mxfp4), desc=f"reading {directory.name}",
                       unit="tensor", file=sys.stderr)
    for name, load, shape in tensors:
        slot = slots.get(name)
        if slot is None:
            if ignored(name):
                continue
            raise CheckpointError(f"{where}: unexpected tensor '{name}' {list(shape)} "
                                  "(not part of this architecture/config)")
        if shape != slot.shape:
            raise CheckpointError(f"{where}: tensor '{name}' has shape {list(shape)}, "
                                  f"config expects {list(slot.shape)}")
        if name in seen:
            raise CheckpointError(f"{where}: tensor '{name}' appears in more than one shard")
        seen.add(name)
        if slot.path is None:
            continue
        array = load()
        kind, target, expected = ((np.uint8, np.uint8, "MXFP4's uint8") if slot.mxfp4 else
                                  (jnp.integer, np.int32, "an integer") if slot.integer else
                                  (jnp.floating, dtype, "a float"))
        if not jnp.issubdtype(array.dtype, kind):
            raise CheckpointError(f"{where}: tensor '{name}' has dtype {array.dtype}, expected {expected} dtype")
        array = host_layout(array, slot.transposed, target, f"{where}: tensor '{name}'")
        if slot.is_part:
            buffer = buffers.get(slot.path)
            if buffer is None:
                buffer = buffers[slot.path] = np.empty(shapes[slot.path], array.dtype)
            view = buffer if slot.expert is None else buffer[slot.expert]
            view[..., column_index(slot.columns)] = array
            del array
            parts_left[slot.path] -= 1
            if parts_left[slot.path]:
                continue
            array = buffers.pop(slot.path)
        yield slot.path, array
        del array  # before the next load: one source tensor at a time
    missing = sorted(set(slots) - seen)
    if missing:
        shown = ", ".join(f"'{m}'" for m in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise CheckpointError(f"{where}: missing {len(missing)} tensor(s): {shown}")


def host_layout(array, transposed: bool, dtype, what: str) -> np.ndarray:
    """``array`` (host or device) as a contiguous host array of ``dtype``, its last two axes
    swapped if ``transposed``; CheckpointError naming ``what`` when a cast to float16 overflows
    (bfloat16 and float32 hold every finite float16/bfloat16 value, so only float16 can turn
    weights into inf)."""
    source = np.asarray(array)
    with np.errstate(over="ignore"):
        out = np.ascontiguousarray(np.swapaxes(source, -1, -2) if transposed else source, dtype=dtype)
    if out.dtype == np.float16 and np.isinf(out).sum() > np.isinf(source).sum():
        raise CheckpointError(f"{what} has values beyond float16's range "
                              f"(max |x| {float(np.abs(source).max()):.4g}); use bfloat16 or float32")
    return out


def _rotary(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")  # derived, not a weight


def stored_target_config(directory: Path) -> ModelConfig:
    """A target folder's config with its experts as the folder stores them: an MXFP4 config.json
    over dense expert tensors (an HF folder saved dequantised, or a folder converted before
    converted folders kept MXFP4: its marker does not say ``mxfp4_experts``) reads as dense."""
    config = load_target_config(directory)
    if not config.mxfp4_experts:
        return config
    if is_converted(directory):
        stored = read_marker(directory, "target").get("mxfp4_experts", False)
    else:
        stored = any(name.endswith(mxfp4.BLOCKS_SUFFIX) for name, _, _ in iter_tensors(directory, True))
    return config if stored else config.with_dequantized_experts()


def _target_source(directory: Path, dtype, progress: bool,
                   config: ModelConfig | None = None) -> tuple[ModelConfig, Any, Iterator]:
    """(config, params structure, leaf stream) of an HF target folder of any family: ``config``
    its config as it is to load (the experts' form settled: ``models.load_target``), by default
    as stored (``stored_target_config``)."""
    config = config or stored_target_config(directory)
    packed = config.mxfp4_experts
    names = get_family(config.family).names
    tensor_names = [name for name, _, _ in iter_tensors(directory, packed)]
    unused = [name for name in tensor_names if names.is_ignored(name)]
    if unused:
        prefixes = sorted({prefix for prefix in names.ignored for name in unused if name.startswith(prefix)})
        print(f"{directory}: skipping {len(unused)} tensors this library does not use "
              f"({', '.join(p + '*' for p in prefixes)}): text generation only", file=sys.stderr)
    # A tied checkpoint may still carry a copy of lm_head: checked once the embedding is read.
    ignored = lambda name: (_rotary(name) or names.is_ignored(name)  # noqa: E731
                            or (name == names.lm_head and config.tie_word_embeddings))
    stacked = any(name.endswith(names.stacked_experts + "gate_up_proj") for name in tensor_names)
    structure = jax.eval_shape(lambda: init_target_params(config, jax.random.key(0), dtype))

    def leaves():
        for path, array in stream_leaves(directory, target_slots(config, stacked), structure, dtype, ignored,
                                         progress=progress, packed_mxfp4=packed):
            if path == ("embed",) and config.tie_word_embeddings:
                _warn_if_head_differs(directory, names.lm_head, array)
            yield path, array

    return config, structure, leaves()


def _draft_source(directory: Path, dtype, progress: bool) -> tuple[DraftConfig, Any, Iterator]:
    """(config, params structure, leaf stream) of an HF draft folder (z-lab or speculators)."""
    config = load_draft_config(directory)
    if config.source_format == "speculators":
        # Speculators drafts carry copies of the target's embedding and LM head (the target's are
        # used, see check_speculators_copies), unless a reduced vocabulary makes lm_head.weight
        # their own (then it is a slot, as are d2t and t2d). A full vocabulary may come with
        # identity d2t/t2d maps.
        ignored = lambda name: _rotary(name) or name in SPECULATORS_COPIES  # noqa: E731
    else:
        ignored = _rotary
    structure = jax.eval_shape(lambda: init_draft_params(config, jax.random.key(0), dtype))

    def leaves():
        torch_names = any(name.endswith("_codebook.weight") for name, _, _ in iter_tensors(directory))
        slots = draft_slots(config, ".weight" if torch_names else "")
        yield from stream_leaves(directory, slots, structure, dtype, ignored, progress=progress)
        if config.source_format == "speculators" and config.draft_vocab_size is None:
            _check_identity_d2t(directory)

    return config, structure, leaves()


def hf_source(directory: str | Path, kind: str, dtype, *, progress: bool = False) -> tuple[Any, Any, Iterator]:
    """(config, params structure, stream of (key path, host array)) of an HF ``kind`` ("target"
    or "draft") folder: what conversion writes as it reads (MXFP4 experts as stored)."""
    source = _target_source if kind == "target" else _draft_source
    return source(Path(directory), dtype, progress)


Place = Callable[[tuple, np.ndarray], jax.Array]


def _collect(structure, leaves: Iterator, host: bool, place: Place | None = None):
    """The params pytree of a leaf stream: numpy leaves (``host``) or device arrays, each put on
    the device as it arrives (or ``place(key path, host array)``d: split over a mesh)."""
    place = place or (lambda _, array: jax.device_put(array))
    return _fill(structure, {path: array if host else place(path, array) for path, array in leaves})


def load_hf_target(directory: str | Path, dtype=jnp.bfloat16, *, host: bool = False, progress: bool = False,
                   place: Place | None = None, config: ModelConfig | None = None) -> tuple[ModelConfig, TargetParams]:
    """Load an HF target folder of any supported family (single file or sharded; any float
    dtype) as ``dtype`` params, as ``config`` (default: the folder's as stored; with its MXFP4
    experts dequantised, they are dequantised as they are read).

    ``host=True`` keeps numpy leaves; ``progress`` shows a tqdm bar over tensors on stderr;
    ``place(key path, host array)`` puts each leaf where it goes as it is read (default: the
    default device).
    """
    config, structure, leaves = _target_source(Path(directory), dtype, progress, config)
    return config, _collect(structure, leaves, host, place)


def _warn_if_head_differs(directory: Path, head_name: str, embed) -> None:
    """A tied checkpoint's stored LM head (if any) is ignored; say so when it is not the
    embedding. Reads only the shard headers unless the head is there."""
    for name, load, _ in iter_tensors(directory):
        if name == head_name:
            embed = np.asarray(embed)
            if not np.array_equal(np.asarray(load(), dtype=embed.dtype), embed):
                warnings.warn(f"{directory}: config.json ties the LM head to the embedding "
                              "(tie_word_embeddings), so the stored lm_head.weight, which differs "
                              "from it, is ignored (as vLLM does; transformers 5 would use it)",
                              stacklevel=3)
            return


def load_hf_draft(directory: str | Path, dtype=jnp.bfloat16, *, host: bool = False,
                  progress: bool = False, place: Place | None = None) -> tuple[DraftConfig, DraftParams]:
    """Load a DFlash draft in z-lab or speculators format (``host``/``progress``/``place`` as for
    targets)."""
    config, structure, leaves = _draft_source(Path(directory), dtype, progress)
    return config, _collect(structure, leaves, host, place)


def _check_identity_d2t(directory: Path) -> None:
    """A full-vocabulary speculators draft may carry d2t only as the identity (all offsets 0)."""
    for name, load, _ in iter_tensors(directory):
        if name == "d2t":
            d2t = load()
            if not jnp.issubdtype(d2t.dtype, jnp.integer) or np.any(d2t):
                raise CheckpointError(f"{directory}: d2t maps draft ids to other target ids, but the draft "
                                      "vocabulary is the target's (draft_vocab_size)")


def speculators_copies(directory: str | Path) -> list[str]:
    """Names of the embedding / LM head copies a full-vocabulary speculators draft carries."""
    return [name for name, _, _ in iter_tensors(Path(directory)) if name in SPECULATORS_HEAD_COPIES]


def _on_host(array: jax.Array) -> np.ndarray:
    """A whole array on the host, also one split over the devices of several processes."""
    if array.is_fully_addressable:
        return np.asarray(array)
    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def check_speculators_copies(directory: str | Path, target: TargetParams) -> None:
    """A full-vocabulary speculators draft's own embedding and LM head are ignored in favour of
    the target's: warn when they differ from the target's (vLLM would use them). Reads only the
    shard headers unless such tensors are there."""
    directory = Path(directory)
    target_rows = {"embed_tokens.weight": lambda rows: target.embed[rows],
                   "lm_head.weight": lambda rows: (target.embed[rows] if target.lm_head is None
                                                    else target.lm_head[:, rows].T)}
    for name, load, shape in iter_tensors(directory):
        if name in target_rows:
            ours = target_rows[name]
            step = 8192  # the target's rows come to the host a block at a time
            stored = load()
            differs = stored.shape != (target.embed.shape[0], target.embed.shape[1]) or any(
                not np.array_equal(np.asarray(stored[i:i + step], dtype=target.embed.dtype),
                                   _on_host(ours(slice(i, i + step))))
                for i in range(0, stored.shape[0], step))
            if differs:
                warnings.warn(f"{directory}: the draft's own {name} differs from the target's; this "
                              "library uses the target's (vLLM would use the draft's), so proposals "
                              "may differ from vLLM's (output stays exact)", stacklevel=3)


class HFTensor(NamedTuple):
    """One HF tensor of params: ``leaf[expert][..., columns]`` (``expert`` and ``columns`` None:
    all of it), its last two axes swapped when ``transposed``; MXFP4 blocks (``mxfp4``
    "blocks") written [..., G, 16] as stored. Sliced only when read (``host``), so listing a
    checkpoint's tensors copies nothing."""

    name: str
    leaf: Any
    columns: tuple[tuple[int, int], ...] | None
    transposed: bool
    expert: int | None = None
    mxfp4: str | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        shape = tuple(self.leaf.shape[1:] if self.expert is not None else self.leaf.shape)
        if self.columns is not None:
            shape = (*shape[:-1], column_width(self.columns))
        return (*shape[:-2], shape[-1], shape[-2]) if self.transposed else shape

    def host(self, dtype) -> np.ndarray:
        """The tensor in HF (torch ``[out, in]``) layout as a host array of ``dtype``."""
        leaf = self.leaf if self.expert is None else self.leaf[self.expert]
        leaf = leaf if self.columns is None else leaf[..., column_index(self.columns)]
        array = host_layout(leaf, self.transposed, dtype, f"tensor '{self.name}'")
        return array.reshape(*array.shape[:-1], -1, 16) if self.mxfp4 == "blocks" else array


def hf_tensors(slots: dict[str, Slot], params) -> list[HFTensor]:
    """Every slot's tensor in ``params``, after checking that ``params`` holds exactly the slots'
    leaves with the slots' shapes (the inverse of loading)."""
    leaves = leaves_by_path(params)
    extra = sorted(".".join(map(str, p)) for p in set(leaves) - {slot.path for slot in slots.values()})
    if extra:
        raise CheckpointError(f"params carry leaves that this config has no tensor for: {extra}")
    fused_width = collections.defaultdict(int)
    for slot in slots.values():
        if slot.columns:
            fused_width[slot.path] = max(fused_width[slot.path], *(stop for _, stop in slot.columns))
    for path, width in fused_width.items():
        leaf = leaves.get(path)
        if leaf is not None and leaf.shape[-1] != width:
            raise CheckpointError(f"params leaf '{'.'.join(map(str, path))}' has {leaf.shape[-1]} columns, "
                                  f"the config's fused tensors need {width}")
    out = []
    for name, slot in slots.items():
        if slot.path is None:
            continue
        leaf = leaves.get(slot.path)
        if leaf is None:
            raise CheckpointError(f"params lack tensor '{name}' that the config requires")
        tensor = HFTensor(name, leaf, slot.columns, slot.transposed, slot.expert, slot.mxfp4)
        if tensor.shape != slot.shape:
            raise CheckpointError(f"tensor '{name}' has shape {list(tensor.shape)} in params, "
                                  f"config expects {list(slot.shape)}")
        out.append(tensor)
    return out


def is_converted(directory: str | Path) -> bool:
    """True for a folder written by ``checkpoints_convert`` (orbax params + config.json)."""
    return (Path(directory) / MARKER_FILE).is_file()


def write_marker(directory: Path, kind: str, dtype: str, mxfp4_experts: bool = False) -> None:
    """The file that marks a converted folder: format version, kind (target/draft), dtype, and
    whether a target's experts are stored in MXFP4."""
    marker = {"format_version": FORMAT_VERSION, "kind": kind, "dtype": dtype}
    if mxfp4_experts:
        marker["mxfp4_experts"] = True
    (directory / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def read_marker(directory: str | Path, kind: str) -> dict:
    """The marker of a converted folder, checked to be of this version and ``kind``."""
    marker = read_json(Path(directory) / MARKER_FILE)
    if not isinstance(marker, dict):
        raise CheckpointError(f"{directory}/{MARKER_FILE} is not a JSON object")
    if marker.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{directory}: converted with format version {marker.get('format_version')}, "
                              f"this library reads version {FORMAT_VERSION}; convert it again")
    if marker.get("kind") != kind:
        raise CheckpointError(f"{directory}: is a converted {marker.get('kind')}, not a {kind}")
    return marker


class LeafStream(NamedTuple):
    """Params that arrive one leaf at a time (a conversion reading its source): ``structure`` is
    the params' pytree of ShapeDtypeStructs, ``leaves`` yields (key path, array) once per leaf."""

    structure: Any
    leaves: Iterator[tuple[tuple, Any]]


def _group_of(path: tuple) -> tuple:
    """The group a leaf is saved in: its layer (``("layers", 3)``) or, outside the layers, itself."""
    return path[:2] if path[0] == "layers" else path[:1]


def _nest(leaves: dict[tuple, Any], group: tuple) -> dict:
    """A group's leaves as nested dicts keyed by their path below the group (orbax's tree)."""
    tree: dict = {}
    for path, leaf in leaves.items():
        relative = path[len(group):] or path[-1:]
        node = tree
        for key in relative[:-1]:
            node = node.setdefault(str(key), {})
        node[str(relative[-1])] = leaf
    return tree


def _group_leaves(tree) -> dict[tuple, Any]:
    """{relative key path: leaf} of a group's nested tree (the inverse of ``_nest``)."""
    return {tuple(str(k) for k in path): leaf for path, leaf in leaves_by_path(tree).items()}


def _params_writer():
    """An orbax Checkpointer that writes numpy leaves in place: orbax's default deep-copies host
    arrays, and compression buffers every encoded array until the commit, each nearly doubling
    peak memory. orbax-checkpoint < 0.12.5 always copies (a warning says so)."""
    import orbax.checkpoint as ocp

    handlers = ocp.type_handlers
    if "deepcopy_host_arrays" in inspect.signature(handlers.NumpyHandler).parameters:
        numpy_handler = handlers.NumpyHandler(deepcopy_host_arrays=False)
    else:
        warnings.warn("this orbax-checkpoint (< 0.12.5) copies every array before writing it, so saving "
                      "needs about twice the largest layer's size in host memory; a newer orbax-checkpoint "
                      "does not", stacklevel=3)
        numpy_handler = handlers.NumpyHandler()
    registry = handlers.create_type_handler_registry(
        (np.ndarray, numpy_handler), (jax.Array, handlers.ArrayHandler()))
    return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_compression=False))


def save_params(directory: Path, params) -> None:
    """Write params (a pytree, or a ``LeafStream``) under ``directory / PARAMS_DIR``: one orbax
    checkpoint per group of leaves (a layer, or one top-level tensor), each written as soon as
    its last leaf arrives and then let go. A conversion therefore holds about one layer in host
    memory (a 60 GB MoE converts on a 24 GB machine), never the whole model."""
    import orbax.checkpoint as ocp

    stream = params if isinstance(params, LeafStream) else LeafStream(params, iter(leaves_by_path(params).items()))
    expected = collections.Counter(_group_of(path) for path in leaves_by_path(stream.structure))
    root = (directory / PARAMS_DIR).absolute()
    root.mkdir()
    pending: dict[tuple, dict] = collections.defaultdict(dict)
    written = set()
    with _params_writer() as checkpointer:
        for path, array in stream.leaves:
            group = _group_of(path)
            pending[group][path] = array
            del array
            if len(pending[group]) == expected[group]:
                tree = _nest(pending.pop(group), group)
                checkpointer.save(root / ".".join(map(str, group)), args=ocp.args.PyTreeSave(tree))
                written.add(group)
                del tree
    unwritten = sorted(".".join(map(str, group)) for group in set(expected) - written)
    if unwritten:  # a stream that ended early: a bug in the caller, never a silent partial checkpoint
        raise CheckpointError(f"the params stream ended before {unwritten} were whole")


@contextlib.contextmanager
def _unreadable_params(directory: str | Path):
    """Report orbax's and TensorStore's failures to read a damaged params/ folder (truncated or
    missing files) as one CheckpointError naming the folder."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - orbax raises bare Exceptions with long dumps
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        first_line = first_line.split(" See full TensorStore details")[0][:300]  # a dump follows
        raise CheckpointError(f"{directory}: {PARAMS_DIR}/ could not be read ({first_line}); "
                              "convert the model again") from error


def restore_params(directory: str | Path, abstract, sharding: jax.sharding.Sharding | None = None, *,
                   progress: bool = False, place: Place | None = None):
    """Read the params written by ``save_params`` into the structure of ``abstract``
    (ShapeDtypeStructs): leaves are cast to its dtypes and placed with ``sharding`` (default: the
    first device), or read to host memory a layer at a time and ``place(key path, host array)``d.
    Raises CheckpointError naming the leaf when the stored params do not match ``abstract``
    (orbax itself would fill a missing leaf with None), before reading any weights.

    Reads one group (a layer) at a time, which bounds the host memory orbax stages to about one
    layer and lets ``progress`` show a tqdm bar over bytes on stderr."""
    import orbax.checkpoint as ocp

    root = (Path(directory) / PARAMS_DIR).absolute()
    wanted = collections.defaultdict(dict)  # group -> {relative path: abstract leaf}
    full_path = {}
    for path, leaf in leaves_by_path(abstract).items():
        group = _group_of(path)
        relative = tuple(str(k) for k in (path[len(group):] or path[-1:]))
        wanted[group][relative] = leaf
        full_path[group, relative] = path
    names = {".".join(map(str, group)): group for group in wanted}
    describe = lambda leaf: "absent" if leaf is None else list(leaf.shape)  # noqa: E731
    with _unreadable_params(directory), ocp.StandardCheckpointer() as checkpointer:
        if not root.is_dir():
            raise CheckpointError(f"{directory}: {PARAMS_DIR}/ is missing or has no orbax metadata; "
                                  "convert the model again")
        for extra in sorted({p.name for p in root.iterdir() if p.is_dir()} - set(names)):
            metadata = checkpointer.metadata(root / extra).item_metadata
            relative, leaf = next(iter(_group_leaves(metadata.tree).items())) if metadata else ((), None)
            name = extra if relative == (extra,) else ".".join((extra, *relative))
            raise CheckpointError(f"{directory}: params leaf '{name}' is {describe(leaf)} in the checkpoint, "
                                  "config.json expects absent")
        for name, group in sorted(names.items()):
            metadata = checkpointer.metadata(root / name) if (root / name).is_dir() else None
            stored = {} if metadata is None or metadata.item_metadata is None else _group_leaves(
                metadata.item_metadata.tree)
            for relative in sorted(set(stored) | set(wanted[group])):
                have, want = stored.get(relative), wanted[group].get(relative)
                if have is None or want is None or tuple(have.shape) != tuple(want.shape):
                    path = full_path.get((group, relative), group + relative)
                    raise CheckpointError(f"{directory}: params leaf '{'.'.join(map(str, path))}' is "
                                          f"{describe(have)} in the checkpoint, config.json expects {describe(want)}")
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def restore_arg(leaf):  # to host memory when placed afterwards, else straight onto the device(s)
        if place is not None:
            return ocp.RestoreArgs(restore_type=np.ndarray, dtype=leaf.dtype)
        return ocp.ArrayRestoreArgs(sharding=sharding, dtype=leaf.dtype, global_shape=leaf.shape)

    values = {}
    total = sum(leaf.size * leaf.dtype.itemsize for group in wanted.values() for leaf in group.values())
    with _unreadable_params(directory), \
            tqdm(total=total, unit="B", unit_scale=True, desc=f"reading {Path(directory).name}",
                 disable=not progress, file=sys.stderr) as bar, \
            ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        for name, group in sorted(names.items()):
            leaves = wanted[group]
            item = _nest({relative: leaf for relative, leaf in leaves.items()}, ())
            restore_args = jax.tree.map(restore_arg, item)
            out = checkpointer.restore(root / name, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args))
            for relative, leaf in _group_leaves(out).items():
                path = full_path[group, relative]
                values[path] = leaf if place is None else place(path, np.asarray(leaf))
                bar.update(leaves[relative].size * leaves[relative].dtype.itemsize)
    return _fill(abstract, values)
