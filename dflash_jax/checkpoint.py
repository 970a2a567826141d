"""Reading and writing model weights: HF safetensors folders (streamed tensor by tensor) and
this library's orbax checkpoints. Every shape is checked against the config; missing, extra or
misshapen tensors raise CheckpointError naming the tensor.

One table per model kind (``target_slots``, ``draft_slots``) maps each HF tensor name to its
place in the params pytree; loading and exporting both read it, so the names live in one place.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import json
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from tqdm import tqdm

from dflash_jax.config import DraftConfig, ModelConfig, load_draft_config, load_target_config, read_json
from dflash_jax.params import DraftParams, TargetParams, init_draft_params, init_target_params

PARAMS_DIR = "params"          # orbax checkpoint inside a converted folder
MARKER_FILE = "dflash_jax.json"
FORMAT_VERSION = 2             # of converted folders; bump when their layout changes (2: fused qkv/gate_up)


class CheckpointError(ValueError):
    """Weights that do not match their config."""


# HF name inside a layer -> (LayerParams field, stored transposed). q/k/v and gate/up share one
# fused field each, in this order (``_layer_slots`` gives each its column range).
_LAYER_TENSORS = {
    "input_layernorm.weight": ("input_norm", False),
    "self_attn.q_proj.weight": ("qkv_proj", True),
    "self_attn.k_proj.weight": ("qkv_proj", True),
    "self_attn.v_proj.weight": ("qkv_proj", True),
    "self_attn.o_proj.weight": ("o_proj", True),
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("post_attention_norm", False),
    "mlp.gate_proj.weight": ("gate_up_proj", True),
    "mlp.up_proj.weight": ("gate_up_proj", True),
    "mlp.down_proj.weight": ("down_proj", True),
}


def _layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF-orientation ([out, in]) shape of every tensor in a layer."""
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * d, config.num_kv_heads * d
    return {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q), "self_attn.q_norm.weight": (d,),
            "self_attn.k_norm.weight": (d,), "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one HF tensor lives in a params pytree.

    ``path`` is the leaf's key path (``("layers", 3, "o_proj")``), or None for a tensor that is
    checked and dropped (speculators' ``t2d``, derivable from ``d2t``). ``shape`` is the HF
    ([out, in]) shape; ``transposed`` marks torch Linear weights, stored ``[in, out]`` here.
    ``columns`` (start, stop) places a tensor inside a fused leaf (q/k/v in ``qkv_proj``).
    ``integer`` marks an id map (``d2t``, ``t2d``), stored int32; every other tensor is a float.
    """

    path: tuple | None
    shape: tuple[int, ...]
    transposed: bool = False
    columns: tuple[int, int] | None = None
    integer: bool = False


def _layer_slots(config: ModelConfig, prefix: str) -> dict[str, Slot]:
    shapes = _layer_shapes(config)
    columns, offsets = {}, {}
    for name, (field, transposed) in _LAYER_TENSORS.items():
        if field in ("qkv_proj", "gate_up_proj"):
            start = offsets.get(field, 0)
            offsets[field] = start + shapes[name][0]
            columns[name] = (start, offsets[field])
    return {f"{prefix}{n}.{name}": Slot(("layers", n, field), shapes[name], transposed, columns.get(name))
            for n in range(config.num_layers) for name, (field, transposed) in _LAYER_TENSORS.items()}


def target_slots(config: ModelConfig) -> dict[str, Slot]:
    """HF Qwen3ForCausalLM tensor names of a target (``lm_head.weight`` only when untied)."""
    v, h = config.vocab_size, config.hidden_size
    slots = _layer_slots(config, "model.layers.")
    slots["model.embed_tokens.weight"] = Slot(("embed",), (v, h))
    slots["model.norm.weight"] = Slot(("norm",), (h,))
    if not config.tie_word_embeddings:
        slots["lm_head.weight"] = Slot(("lm_head",), (v, h), True)
    return slots


def draft_slots(config: DraftConfig) -> dict[str, Slot]:
    """Tensor names of a DFlash draft (no ``model.`` prefix). A reduced-vocabulary speculators
    draft adds its own LM head rows, ``d2t`` and ``t2d``."""
    model = config.model
    h = model.hidden_size
    slots = _layer_slots(model, "layers.")
    slots["fc.weight"] = Slot(("fc",), (h, len(config.target_layer_ids) * h), True)
    slots["hidden_norm.weight"] = Slot(("hidden_norm",), (h,))
    slots["norm.weight"] = Slot(("norm",), (h,))
    if config.draft_vocab_size is not None:
        slots["lm_head.weight"] = Slot(("lm_head",), (config.draft_vocab_size, h), True)
        slots["d2t"] = Slot(("d2t",), (config.draft_vocab_size,), integer=True)
        slots["t2d"] = Slot(None, (model.vocab_size,))  # often bool: checked for shape only
    return slots


# Tensors of a full-vocabulary speculators draft that this library does not keep: copies of the
# target's embedding and LM head, and identity id maps.
SPECULATORS_HEAD_COPIES = ("embed_tokens.weight", "lm_head.weight")
SPECULATORS_COPIES = SPECULATORS_HEAD_COPIES + ("d2t", "t2d")


def _key_path(path) -> tuple:
    return tuple(getattr(k, "name", getattr(k, "idx", getattr(k, "key", None))) for k in path)


def _leaves_by_path(params) -> dict[tuple, Any]:
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


def iter_tensors(directory: Path) -> Iterator[tuple[str, Callable[[], np.ndarray], tuple[int, ...]]]:
    """(name, load, shape) for every tensor, loading one tensor at a time on demand."""
    for path in safetensors_files(directory):
        with _open_safetensors(path) as handle:
            for name in handle.keys():
                shape = tuple(handle.get_slice(name).get_shape())
                yield name, (lambda h=handle, p=path, n=name: _load_tensor(h, p, n)), shape


def _count_tensors(directory: Path) -> int:
    total = 0
    for path in safetensors_files(directory):
        with _open_safetensors(path) as handle:
            total += len(handle.keys())
    return total


def _read(directory: Path, slots: dict[str, Slot], dtype, ignored: Callable[[str], bool], *,
          host: bool, progress: bool) -> dict[tuple, Any]:
    """Stream every tensor of an HF folder into its slot: check name and shape before loading,
    transpose Linear weights, cast floats to ``dtype`` (id maps to int32), then keep it as a
    numpy array (``host``) or a device array. Holds one source tensor at a time besides the
    converted ones (and the parts of a fused leaf until its last part arrives). Returns
    {key path: array}."""
    where = str(directory)
    values, seen = {}, set()
    parts_expected = collections.Counter(slot.path for slot in slots.values() if slot.columns)
    parts = collections.defaultdict(dict)
    tensors = iter_tensors(directory)
    if progress:
        tensors = tqdm(tensors, total=_count_tensors(directory), desc=f"reading {directory.name}",
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
        kind, target = (jnp.integer, np.int32) if slot.integer else (jnp.floating, dtype)
        if not jnp.issubdtype(array.dtype, kind):
            raise CheckpointError(f"{where}: tensor '{name}' has dtype {array.dtype}, expected "
                                  f"{'an integer' if slot.integer else 'a float'} dtype")
        array = host_layout(array, slot.transposed, target, f"{where}: tensor '{name}'")
        if slot.columns:
            parts[slot.path][slot.columns] = array
            if len(parts[slot.path]) < parts_expected[slot.path]:
                continue
            array = np.concatenate([part for _, part in sorted(parts.pop(slot.path).items())], axis=1)
        values[slot.path] = array if host else jax.device_put(array)
        del array  # before the next load: one source tensor at a time
    missing = sorted(set(slots) - seen)
    if missing:
        shown = ", ".join(f"'{m}'" for m in missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise CheckpointError(f"{where}: missing {len(missing)} tensor(s): {shown}")
    return values


def host_layout(array, transposed: bool, dtype, what: str) -> np.ndarray:
    """``array`` (host or device) as a contiguous host array of ``dtype``, transposed if asked;
    CheckpointError naming ``what`` when a cast to float16 overflows (bfloat16 and float32 hold
    every finite float16/bfloat16 value, so only float16 can turn weights into inf)."""
    source = np.asarray(array)
    with np.errstate(over="ignore"):
        out = np.ascontiguousarray(source.T if transposed else source, dtype=dtype)
    if out.dtype == np.float16 and np.isinf(out).sum() > np.isinf(source).sum():
        raise CheckpointError(f"{what} has values beyond float16's range "
                              f"(max |x| {float(np.abs(source).max()):.4g}); use bfloat16 or float32")
    return out


def _rotary(name: str) -> bool:
    return name.endswith("rotary_emb.inv_freq")  # derived, not a weight


def load_hf_target(directory: str | Path, dtype=jnp.bfloat16, *, host: bool = False,
                   progress: bool = False) -> tuple[ModelConfig, TargetParams]:
    """Load an HF Qwen3 folder (single file or sharded; any float dtype) as ``dtype`` params.

    ``host=True`` keeps numpy leaves (for writing a checkpoint without a device copy);
    ``progress`` shows a tqdm bar over tensors on stderr.
    """
    directory = Path(directory)
    config = load_target_config(directory)
    # A tied checkpoint may still carry a copy of lm_head.
    ignored = lambda name: _rotary(name) or (name == "lm_head.weight" and config.tie_word_embeddings)  # noqa: E731
    slots = target_slots(config)
    values = _read(directory, slots, dtype, ignored, host=host, progress=progress)
    if config.tie_word_embeddings:
        _warn_if_head_differs(directory, values[slots["model.embed_tokens.weight"].path])
    structure = jax.eval_shape(lambda: init_target_params(config, jax.random.key(0), dtype))
    return config, _fill(structure, values)


def _warn_if_head_differs(directory: Path, embed) -> None:
    """A tied checkpoint's stored lm_head.weight (if any) is ignored; say so when it is not the
    embedding. Reads only the shard headers unless the head is there."""
    for name, load, _ in iter_tensors(directory):
        if name == "lm_head.weight":
            embed = np.asarray(embed)
            if not np.array_equal(np.asarray(load(), dtype=embed.dtype), embed):
                warnings.warn(f"{directory}: config.json ties the LM head to the embedding "
                              "(tie_word_embeddings), so the stored lm_head.weight, which differs "
                              "from it, is ignored (as vLLM does; transformers 5 would use it)",
                              stacklevel=3)
            return


def load_hf_draft(directory: str | Path, dtype=jnp.bfloat16, *, host: bool = False,
                  progress: bool = False) -> tuple[DraftConfig, DraftParams]:
    """Load a DFlash draft in z-lab or speculators format (``host``/``progress`` as for targets)."""
    directory = Path(directory)
    config = load_draft_config(directory)
    slots = draft_slots(config)
    if config.source_format == "speculators":
        # Speculators drafts carry copies of the target's embedding and LM head (the target's are
        # used, see check_speculators_copies), unless a reduced vocabulary makes lm_head.weight
        # their own (then it is a slot, as are d2t and t2d). A full vocabulary may come with
        # identity d2t/t2d maps.
        ignored = lambda name: _rotary(name) or name in SPECULATORS_COPIES  # noqa: E731
    else:
        ignored = _rotary
    values = _read(directory, slots, dtype, ignored, host=host, progress=progress)
    if config.source_format == "speculators" and config.draft_vocab_size is None:
        _check_identity_d2t(directory)
    structure = jax.eval_shape(lambda: init_draft_params(config, jax.random.key(0), dtype))
    return config, _fill(structure, values)


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
                                   np.asarray(ours(slice(i, i + step))))
                for i in range(0, stored.shape[0], step))
            if differs:
                warnings.warn(f"{directory}: the draft's own {name} differs from the target's; this "
                              "library uses the target's (vLLM would use the draft's), so proposals "
                              "may differ from vLLM's (output stays exact)", stacklevel=3)


class HFTensor(NamedTuple):
    """One HF tensor of params: ``leaf[:, columns]`` (the whole leaf when ``columns`` is None),
    transposed when ``transposed``. Sliced only when read (``host``), so listing a checkpoint's
    tensors copies nothing."""

    name: str
    leaf: Any
    columns: tuple[int, int] | None
    transposed: bool

    @property
    def shape(self) -> tuple[int, ...]:
        shape = self.leaf.shape if self.columns is None else (self.leaf.shape[0], self.columns[1] - self.columns[0])
        return tuple(reversed(shape)) if self.transposed else tuple(shape)

    def host(self, dtype) -> np.ndarray:
        """The tensor in HF (torch ``[out, in]``) layout as a host array of ``dtype``."""
        leaf = self.leaf if self.columns is None else self.leaf[:, slice(*self.columns)]
        return host_layout(leaf, self.transposed, dtype, f"tensor '{self.name}'")


def hf_tensors(slots: dict[str, Slot], params) -> list[HFTensor]:
    """Every slot's tensor in ``params``, after checking that ``params`` holds exactly the slots'
    leaves with the slots' shapes (the inverse of loading)."""
    leaves = _leaves_by_path(params)
    extra = sorted(".".join(map(str, p)) for p in set(leaves) - {slot.path for slot in slots.values()})
    if extra:
        raise CheckpointError(f"params carry leaves that this config has no tensor for: {extra}")
    fused_width = collections.defaultdict(int)
    for slot in slots.values():
        if slot.columns:
            fused_width[slot.path] = max(fused_width[slot.path], slot.columns[1])
    for path, width in fused_width.items():
        leaf = leaves.get(path)
        if leaf is not None and leaf.shape[1] != width:
            raise CheckpointError(f"params leaf '{'.'.join(map(str, path))}' has {leaf.shape[1]} columns, "
                                  f"the config's fused tensors need {width}")
    out = []
    for name, slot in slots.items():
        if slot.path is None:
            continue
        leaf = leaves.get(slot.path)
        if leaf is None:
            raise CheckpointError(f"params lack tensor '{name}' that the config requires")
        tensor = HFTensor(name, leaf, slot.columns or None, slot.transposed)
        if tensor.shape != slot.shape:
            raise CheckpointError(f"tensor '{name}' has shape {list(tensor.shape)} in params, "
                                  f"config expects {list(slot.shape)}")
        out.append(tensor)
    return out


def is_converted(directory: str | Path) -> bool:
    """True for a folder written by ``checkpoints_convert`` (orbax params + config.json)."""
    return (Path(directory) / MARKER_FILE).is_file()


def write_marker(directory: Path, kind: str, dtype: str) -> None:
    """The file that marks a converted folder: format version, kind (target/draft), dtype."""
    (directory / MARKER_FILE).write_text(json.dumps(
        {"format_version": FORMAT_VERSION, "kind": kind, "dtype": dtype}, indent=2) + "\n")


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


def save_params(directory: Path, params) -> None:
    """Write a params pytree as an orbax checkpoint at ``directory / PARAMS_DIR``.

    Numpy leaves are written in place: orbax's default deep-copies host arrays, and compression
    buffers every encoded array until the commit, each nearly doubling peak memory. Without
    them a conversion peaks at about the params' own size. orbax-checkpoint < 0.12.5 always
    copies (a warning says so).
    """
    import orbax.checkpoint as ocp

    handlers = ocp.type_handlers
    if "deepcopy_host_arrays" in inspect.signature(handlers.NumpyHandler).parameters:
        numpy_handler = handlers.NumpyHandler(deepcopy_host_arrays=False)
    else:
        warnings.warn("this orbax-checkpoint (< 0.12.5) copies every array before writing it, so saving "
                      "needs about twice the params' size in host memory; a newer orbax-checkpoint does not",
                      stacklevel=2)
        numpy_handler = handlers.NumpyHandler()
    registry = handlers.create_type_handler_registry(
        (np.ndarray, numpy_handler), (jax.Array, handlers.ArrayHandler()))
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry, use_compression=False)
    with ocp.Checkpointer(handler) as checkpointer:
        checkpointer.save((directory / PARAMS_DIR).absolute(), args=ocp.args.PyTreeSave(params))


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
                   progress: bool = False):
    """Read an orbax params checkpoint into the structure of ``abstract`` (ShapeDtypeStructs):
    leaves are cast to its dtypes and placed with ``sharding`` (default: the first device).
    Raises CheckpointError naming the leaf when the stored params do not match ``abstract``
    (orbax itself would fill a missing leaf with None).

    Read one group of sibling leaves at a time (a layer; the top-level tensors), which bounds the
    host memory orbax stages to about one layer (in one call it stages up to the whole model,
    measured 1.5x its size at peak) and lets ``progress`` show a tqdm bar over bytes on stderr."""
    import orbax.checkpoint as ocp

    path = (Path(directory) / PARAMS_DIR).absolute()
    with _unreadable_params(directory), ocp.StandardCheckpointer() as checkpointer:
        metadata = checkpointer.metadata(path) if path.is_dir() else None
        if metadata is None or metadata.item_metadata is None:
            raise CheckpointError(f"{directory}: {PARAMS_DIR}/ is missing or has no orbax metadata; "
                                  "convert the model again")
        stored = _leaves_by_path(metadata.item_metadata.tree)
    wanted = _leaves_by_path(abstract)
    for key in sorted(set(stored) | set(wanted), key=str):
        have, want = stored.get(key), wanted.get(key)
        if have is None or want is None or tuple(have.shape) != tuple(want.shape):
            describe = lambda leaf: "absent" if leaf is None else list(leaf.shape)  # noqa: E731
            raise CheckpointError(f"{directory}: params leaf '{'.'.join(map(str, key))}' is {describe(have)} "
                                  f"in the checkpoint, config.json expects {describe(want)}")
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    groups = collections.defaultdict(list)  # parent key path -> indices of its leaves
    for index, (leaf_path, _) in enumerate(paths):
        groups[_key_path(leaf_path)[:-1]].append(index)
    leaves = [leaf for _, leaf in paths]
    restored = [None] * len(leaves)
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)
    with _unreadable_params(directory), \
            tqdm(total=total, unit="B", unit_scale=True, desc=f"reading {Path(directory).name}",
                 disable=not progress, file=sys.stderr) as bar, \
            ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
        for indices in groups.values():
            def only_group(make):
                return jax.tree_util.tree_unflatten(treedef, [
                    make(leaves[i]) if i in indices else ocp.PLACEHOLDER for i in range(len(leaves))])
            item = only_group(lambda leaf: leaf)
            restore_args = only_group(lambda leaf: ocp.ArrayRestoreArgs(
                sharding=sharding, dtype=leaf.dtype, global_shape=leaf.shape))
            out = checkpointer.restore(path, args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args))
            out_leaves = jax.tree_util.tree_leaves(out, is_leaf=lambda x: x is ocp.PLACEHOLDER)
            for i in indices:
                restored[i] = out_leaves[i]
                bar.update(leaves[i].size * leaves[i].dtype.itemsize)
    return jax.tree_util.tree_unflatten(treedef, restored)
