"""Shared fixtures: tiny random HF checkpoints written with transformers (and the z-lab package)."""

import atexit
import contextlib
import gc
import importlib.metadata
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
_JAXLIB_0_10 = importlib.metadata.version("jaxlib").startswith("0.10.")   # the CPU machine's; flags below
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    # tiny models run in no time at any level, and XLA:CPU compiles a third faster at level 0,
    # another tenth faster without LLVM's expensive passes, and 10-25% faster with its former
    # (not MLIR) fusion emitters, which jaxlib 0.11 no longer has (an unknown flag aborts XLA)
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    if _JAXLIB_0_10:
        os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
# One thread per process for XLA's and torch's (OpenMP) matrix products: the workers and the
# subprocesses already fill the cores, and threads that wait by spinning on a full machine cost it
# about an eighth of its CPU time. The XLA flag is set on jaxlib 0.10, as above.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if _JAXLIB_0_10 and "--xla_cpu_multi_thread_eigen" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_cpu_multi_thread_eigen=false"
if "PYTEST_XDIST_WORKER" not in os.environ:
    # One folder for the run, which pytest-xdist's workers inherit: compiled programs are kept
    # there (jax's persistent cache, unless JAX_COMPILATION_CACHE_DIR names another folder), so a
    # program that one test module or worker compiled is read back by the others instead of
    # compiled again; command lines keep theirs under it too (XDG_CACHE_HOME,
    # cli.keep_compiled_programs), never in the user's folders. It starts empty: a run is cold.
    _RUN_FOLDER = tempfile.mkdtemp(prefix="dflash-jax-tests-")
    atexit.register(shutil.rmtree, _RUN_FOLDER, ignore_errors=True)
    os.environ["XDG_CACHE_HOME"] = _RUN_FOLDER
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_RUN_FOLDER, "xla"))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", False)
# The f32 parity checks are near-exact; on a GPU, XLA would run f32 products as TF32 (~1e-3 off).
# No effect on CPU. Lets the suite run on a GPU too (JAX_PLATFORMS=cuda,cpu).
jax.config.update("jax_default_matmul_precision", "highest")

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/builders.py

# tests/multi_device needs several devices: test_tensor_parallel.py runs it in a subprocess with 4
# forced CPU devices, while this suite keeps one.
collect_ignore = [] if jax.device_count() >= 4 else ["multi_device"]


# Tests that run whole programs in subprocesses for minutes: first, so that pytest-xdist's workers
# start them early instead of ending the run waiting on one of them.
LONG_FIRST = ("tests/test_tensor_parallel.py::test_tensor_parallel_on_four_cpu_devices",
              "tests/test_notebooks.py::test_notebook_runs", "tests/test_multi_host.py")


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        return next((i for i, prefix in enumerate(LONG_FIRST) if item.nodeid.startswith(prefix)), len(LONG_FIRST))

    items.sort(key=rank)  # stable: the rest keep their order

@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """XLA:CPU maps every compiled program's code into the process (a few mappings per kernel),
    and Linux caps a process at vm.max_map_count (65530) mappings: the whole suite in one
    process compiles more than that holds, and the compile that crosses it segfaults. Each test
    module's programs are let go when it ends (jax's caches cleared); what a later module needs
    again is read back from the run's persistent compilation cache."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session", autouse=True)
def _zlab_reference_on_cpu():
    """dflash.model times its phases with torch.cuda.synchronize(); use a plain clock on CPU."""
    try:
        import dflash.model as dm
    except ImportError:  # suites that do not need the reference
        yield
        return
    original = dm._cuda_time
    dm._cuda_time = time.perf_counter
    yield
    dm._cuda_time = original


_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiled_names: list[list[str]] = []  # one list per open ``compilations`` block


def _record_compile(event, seconds, **kwargs):
    if event == _COMPILE_EVENT:
        for names in _compiled_names:
            names.append(str(kwargs.get("fun_name")))


jax.monitoring.register_event_duration_secs_listener(_record_compile)


@pytest.fixture
def compilations():
    """``with compilations() as names:`` collects the names of the functions XLA compiles inside
    the block (a cache hit compiles nothing)."""
    @contextlib.contextmanager
    def collect():
        names: list[str] = []
        _compiled_names.append(names)
        try:
            yield names
        finally:
            _compiled_names.remove(names)
    return collect


@dataclass
class ModelPair:
    """One target + z-lab draft: the torch reference modules, their folders and our loaded copies."""

    hf_target: object
    hf_draft: object
    target_dir: Path
    draft_dir: Path
    target: object   # dflash_jax.loading.models.Target (f32)
    draft: object    # dflash_jax.loading.models.Draft (f32)


# Architecture shared by the DFlash pairs (same shapes and configs -> compiled loops are reused).
PAIR_TARGET = dict(vocab=128, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, rope_theta=1e4)
PAIR_DRAFT = dict(layers=2, block_size=16, target_layer_ids=(0, 1), heads=4, kv_heads=2, rope_theta=1e4,
                  mask_token_id=127)


def _save_and_load(root: Path, hf_target, hf_draft) -> ModelPair:
    from builders import save_draft, save_target
    from dflash_jax.loading.models import load_draft, load_target

    target_dir = save_target(hf_target, root / "target")
    draft_dir = save_draft(hf_draft, root / "draft")
    target = load_target(target_dir, "float32")
    return ModelPair(hf_target, hf_draft, target_dir, draft_dir, target, load_draft(draft_dir, target, "float32"))


@pytest.fixture(scope="session")
def spec_pair(tmp_path_factory) -> ModelPair:
    """Copying target + copying draft: long, varied accepted runs over varied tokens
    (builders.make_copy_target / make_copy_draft)."""
    from builders import make_copy_draft, make_copy_target

    hf_target = make_copy_target()
    return _save_and_load(tmp_path_factory.mktemp("spec_pair"), hf_target, make_copy_draft(hf_target))


# The copy pair built on each other target family: a LLaMA target with llama3 RoPE (and a draft
# with the same RoPE, as z-lab's LLaMA drafts), a Qwen3-MoE target of 8 experts (top 2) on every
# layer.
FAMILY_PAIRS = {"llama": (dict(family="llama"), dict(rope="llama3")),
                "qwen3_moe": (dict(family="qwen3_moe", experts=8, top_k=2, expert_width=32), dict())}


@pytest.fixture(scope="session", params=list(FAMILY_PAIRS))
def family_pair(request, tmp_path_factory) -> ModelPair:
    """spec_pair's copying target + draft, for each family beside Qwen3."""
    from builders import LLAMA3_TEST_ROPE, make_copy_draft, make_copy_target

    target_kwargs, draft_kwargs = FAMILY_PAIRS[request.param]
    if draft_kwargs.get("rope") == "llama3":
        draft_kwargs = {**draft_kwargs, "rope": LLAMA3_TEST_ROPE}
    hf_target = make_copy_target(**target_kwargs)
    return _save_and_load(tmp_path_factory.mktemp(f"{request.param}_pair"), hf_target,
                          make_copy_draft(hf_target, **draft_kwargs))


@pytest.fixture(scope="session")
def random_pair(tmp_path_factory) -> ModelPair:
    """Plain random target + draft (acceptance ~1 token per step), same configs as spec_pair."""
    from builders import make_target, make_zlab_draft

    hf_target = make_target(seed=1, std=0.1, **PAIR_TARGET)
    hf_draft = make_zlab_draft(hf_target, seed=101, std=0.3, **PAIR_DRAFT)
    return _save_and_load(tmp_path_factory.mktemp("random_pair"), hf_target, hf_draft)
