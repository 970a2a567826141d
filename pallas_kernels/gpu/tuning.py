"""Block sizes for the GPU kernels: one rule per kernel family, overridable per call.

The attention kernels are memory-bound (at most a few dozen FLOPs per KV byte), so the rule aims
for (1) enough programs to cover every SM of the GPU (132 on an H100/H200), splitting the context
across programs when batch x KV heads x query tiles is small, and (2) KV tiles of 128 tokens (64
in f32) per loop step, software-pipelined as deep as shared memory allows. Measured on an H100
(benchmarks/bench_kernels.py, 2026-11-21): three stages beat two by 10-20% once a program holds
>= 32 query rows, two stages are best for decode; verify programs (64 rows) run best about one
per SM, decode programs (16 rows) about two per SM; at 16-64 rows 8 warps were slower than 4.
On the H200 (2026-11-22) a full batch of verify programs runs better two per SM on 64-token tiles
(see ``attention_blocks``).

The rules read the GPU's SM count and shared memory (``gpu_limits``): the tuning was measured on
Hopper, and other NVIDIA GPUs of compute capability >= 8.0 get tiles that fit their smaller
shared memory (A100 164 KB per SM, L4/L40/RTX 40 100 KB, against Hopper's 228 KB).
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from pallas_kernels.sizes import is_power_of_2, next_power_of_2

MIN_TILES_PER_SPLIT = 2  # never split the context finer than this many KV tiles per program...
# ...unless the page table is too short to give the GPU this many splits of two 128-token tiles
# (bs 1-2 at contexts up to ~2k): then the KV tile halves to 64 tokens and a program may hold one.
# In the model on an H200 (2026-11-26, two rounds): bs-1 decode 2.0-2.7% faster at ctx 512-1024,
# the bs-1 DFlash step 1.1% and bs 2 0.9%; going further at ctx 2048 (9 -> 16 splits of 64-token
# tiles) was 0.6-1.5% slower, so tables long enough for this many splits keep 128-token tiles.
SHORT_TABLE_SPLITS = 8
MAX_SPLITS = 64
# A split context is merged by the Pallas ``combine_splits`` kernel from this many splits, or
# from this many partial elements (splits x rows x head_dim), and by plain XLA below both. XLA
# fuses a small merge with its neighbours: in the model on an H200 (2026-11-26) it was 0.2-1%
# faster per step at bs 1, ctx 512-1024 (3-5 splits), while from 10 splits, and at bs 8 (2
# splits of 4096 rows, exactly 2^20 elements at Qwen3-8B shape), the kernel was level or up to
# 2% faster (means of two rounds); in #4's 134 MB cells it takes 0.3-3.5 µs less per call
# (benchmarks/RESULTS.md, split merge, 2026-11-26). 6-9 splits were not measured: 8 lies between the two.
PALLAS_MERGE_MIN_SPLITS = 8
PALLAS_MERGE_MIN_ELEMENTS = 1 << 20
# Shared memory per SM, KB, by CUDA compute capability (CUDA C++ Programming Guide, "Compute
# Capabilities"); a program may use all but 1 KB of it. Capabilities not listed get the smallest.
SMEM_PER_SM_KB = {(8, 0): 164, (8, 6): 100, (8, 7): 164, (8, 9): 100, (9, 0): 228, (10, 0): 228,
                  (10, 3): 228, (12, 0): 100, (12, 1): 100}
MIN_COMPUTE_CAPABILITY = (8, 0)  # bf16 tensor-core dots in Triton


@dataclasses.dataclass(frozen=True)
class GpuLimits:
    """What the tiling rules need from the GPU: its SM count and the shared memory of one SM."""

    num_sms: int
    smem_per_sm: int  # bytes

    @property
    def smem_budget(self) -> int:
        """Shared memory one program may plan for: the per-program maximum (all but 1 KB of an SM)
        less a margin. Triton keeps num_stages copies of the K and V tiles and the query tile in
        shared memory, and measured on an H100 (2026-11-25) its attention kernels asked for that
        plus under 1 KB; 7 KB of margin keeps every config launchable (Hopper: 220 KB)."""
        return self.smem_per_sm - 8 * 1024


HOPPER = GpuLimits(num_sms=132, smem_per_sm=228 * 1024)  # H100 / H200


def cuda_compute_capability(device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA GPU device; None for any other device (CPU, ROCm)."""
    if device.platform != "gpu" or "cuda" not in device.client.platform_version.lower():
        return None
    major, minor = str(device.compute_capability).split(".")[:2]
    return int(major), int(minor)


def kernel_device_problem(device=None) -> str | None:
    """Why the Pallas kernels cannot be compiled for ``device`` (by default: for some device of
    jax's default backend), or None when they can: an NVIDIA GPU of compute capability >= 8.0."""
    if device is None:
        return next(filter(None, map(kernel_device_problem, jax.local_devices())), None)
    if device.platform != "gpu":
        return f"the device is a {device.platform.upper()}, not a GPU"
    capability = cuda_compute_capability(device)
    if capability is None:
        return (f"the kernels are built and tested for NVIDIA GPUs (Triton through Pallas), and this GPU "
                f"runs {device.client.platform_version}")
    if capability < MIN_COMPUTE_CAPABILITY:
        return (f"{device.device_kind} has compute capability {capability[0]}.{capability[1]}; the kernels' "
                "bf16 tensor-core dots need 8.0 (Ampere) or newer")
    return None


def device_limits(device) -> GpuLimits:
    """The limits of a CUDA GPU device; ``HOPPER`` for any other (on CPU the kernels run in
    interpret mode, or are lowered for an H100)."""
    capability = cuda_compute_capability(device)
    if capability is None:
        return HOPPER
    smem_kb = SMEM_PER_SM_KB.get(capability, min(SMEM_PER_SM_KB.values()))
    return GpuLimits(num_sms=int(getattr(device, "core_count", HOPPER.num_sms)), smem_per_sm=smem_kb * 1024)


@functools.cache
def gpu_limits() -> GpuLimits:
    """The tightest ``device_limits`` over the devices of jax's default backend (the kernels
    compile for whichever of them a computation runs on)."""
    limits = [device_limits(device) for device in jax.local_devices()]
    return GpuLimits(num_sms=min(x.num_sms for x in limits), smem_per_sm=min(x.smem_per_sm for x in limits))


def check_launch(num_warps: int, num_stages: int) -> None:
    """ValueError for Triton launch settings the GPU compiler would reject (a num_warps that is
    not a power of two aborts the process there) or that could not run."""
    if not (is_power_of_2(num_warps) and num_warps <= 32):
        raise ValueError(f"num_warps must be a power of two in [1, 32], got {num_warps}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")


def check_positive(**values: int | None) -> None:
    """ValueError naming the first given tuning value that is not >= 1."""
    for name, value in values.items():
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


@dataclasses.dataclass(frozen=True)
class AttentionBlocks:
    """block_t: query tokens per program (rows = block_t * group); pages_per_block: pages per
    online-softmax step; num_splits: context partitions per (sequence, head, query tile);
    pallas_merge: the splits are merged by the Pallas kernel (False: by plain XLA)."""

    block_t: int
    pages_per_block: int
    num_splits: int
    num_warps: int
    num_stages: int
    pallas_merge: bool


def attention_blocks(*, q_len: int, group: int, head_dim: int, page_size: int,
                     pages_per_seq: int, batch: int, kv_heads: int, itemsize: int = 2,
                     extra_smem_bytes: int = 0, limits: GpuLimits | None = None,
                     block_t: int | None = None, pages_per_block: int | None = None,
                     num_splits: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, pallas_merge: bool | None = None) -> AttentionBlocks:
    """Pick the blocks for paged verify/draft attention; any argument given wins over the rule.

    Rows per program are padded to at least 16 (the smallest tensor-core tile) and capped at 128
    (64 for f32 or head_dim > 128), or at the GQA group when that is larger; the KV tile is 128
    tokens (64 for f32 or head_dim > 128, for a full batch of 64-row programs, see below, and for
    a page table too short to fill the GPU, ``SHORT_TABLE_SPLITS``), never under 16 and never
    less than one page. ``extra_smem_bytes``: shared memory a program
    holds besides its query tile and KV stages (counted when choosing the stages; ValueError when
    not even one stage fits). ``limits``: the GPU's (default ``gpu_limits()``); where two stages
    of 128-token tiles do not fit its shared memory, the tile halves down to 64 tokens first.
    """
    limits = limits or gpu_limits()
    budget = limits.smem_budget
    check_positive(block_t=block_t, pages_per_block=pages_per_block, num_splits=num_splits,
                   num_warps=num_warps, num_stages=num_stages)
    if q_len < 1 or batch < 1:
        raise ValueError(f"q must hold at least one query token and one sequence, got T={q_len}, batch={batch}")
    small = itemsize <= 2 and head_dim <= 128
    if block_t is None:
        rows = min(max(16, next_power_of_2(q_len * group)), max(128 if small else 64, group))
        block_t = max(1, rows // group)
    rows = block_t * group
    programs = batch * kv_heads * -(-q_len // block_t)
    # A full batch of verify programs (64 rows, at least one per SM unsplit) takes 64-token KV
    # tiles: three stages of them and the query tile fit twice in an SM's shared memory, so one
    # program computes while the other loads (H200, 2026-11-22: bs 32 verify 72-81% -> 77-84% of
    # copy). Smaller batches lost when split further to fill two per SM (bs 1 / 8: 5-15% slower),
    # and the draft kernel's block K/V (``extra_smem_bytes``) leave no room for a second program.
    kv_64_stage = 2 * 64 * head_dim * itemsize
    co_resident = (small and rows == 64 and page_size <= 64 and programs >= limits.num_sms and
                   2 * (3 * kv_64_stage + rows * head_dim * itemsize + extra_smem_bytes + 1024) <= limits.smem_per_sm)
    q_bytes = rows * head_dim * itemsize
    wanted_splits = max(1, limits.num_sms * (2 if rows <= 16 or co_resident else 1) // programs)
    min_tiles_per_split = MIN_TILES_PER_SPLIT

    def stage_bytes(pages: int) -> int:
        return 2 * pages * page_size * head_dim * itemsize

    def splits_for(pages: int, min_tiles: int) -> int:
        tiles = -(-pages_per_seq // pages)
        return max(1, min(wanted_splits, tiles // min_tiles, MAX_SPLITS))

    fewest_pages = max(1, 16 // page_size)
    if pages_per_block is None:
        kv_tokens = 64 if co_resident or not small else 128
        pages_per_block = max(1, kv_tokens // page_size, fewest_pages)
        # a short table (see SHORT_TABLE_SPLITS): 64-token tiles, one or more per split
        if (num_splits is None and page_size <= 64 and pages_per_block * page_size > 64 and
                splits_for(pages_per_block, MIN_TILES_PER_SPLIT) < min(wanted_splits, SHORT_TABLE_SPLITS)):
            pages_per_block, min_tiles_per_split = max(1, 64 // page_size), 1
        # a GPU with less shared memory than Hopper's (where the rule was measured): halve the
        # tile (to 64 tokens at least) until two stages fit, so loads still overlap compute
        while (limits.smem_per_sm < HOPPER.smem_per_sm and pages_per_block * page_size > 64 and
               pages_per_block > fewest_pages and
               2 * stage_bytes(pages_per_block) + q_bytes + extra_smem_bytes > budget):
            pages_per_block //= 2
        # large pages or head_dim, f32 or a long draft block: halve the tile until one stage fits
        while (pages_per_block > fewest_pages and
               stage_bytes(pages_per_block) + q_bytes + extra_smem_bytes > budget):
            pages_per_block //= 2
    if num_stages is None:
        num_stages = next(s for s in ((3, 2, 1) if rows >= 32 else (2, 1))
                          if s == 1 or s * stage_bytes(pages_per_block) + q_bytes + extra_smem_bytes <= budget)
    if stage_bytes(pages_per_block) + q_bytes + extra_smem_bytes > budget:
        if pages_per_block > fewest_pages:
            smaller = "fewer pages_per_block"
        elif page_size > 16:  # a smaller page makes a smaller tile
            smaller = "a smaller page_size"
        else:  # the tile is already the smallest
            smaller = "a 2-byte dtype, a shorter draft block"
        raise ValueError(f"one KV stage ({stage_bytes(pages_per_block)} B: {pages_per_block} page(s) of {page_size} "
                         f"tokens), the query tile ({q_bytes} B) and the block's own K/V ({extra_smem_bytes} B) "
                         f"exceed the {budget} B of shared memory a program may use: take {smaller} "
                         "or a smaller block_t")
    if num_stages * stage_bytes(pages_per_block) + q_bytes + extra_smem_bytes > budget:
        raise ValueError(f"num_stages={num_stages} KV stages ({stage_bytes(pages_per_block)} B each), the query tile "
                         f"({q_bytes} B) and the block's own K/V ({extra_smem_bytes} B) exceed the {budget} B of "
                         "shared memory a program may use: take fewer stages or fewer pages_per_block")
    if num_splits is None:
        num_splits = splits_for(pages_per_block, min_tiles_per_split)
    if num_warps is None:
        num_warps = 8 if rows >= 128 else 4
    if pallas_merge is None:
        partials = num_splits * batch * q_len * kv_heads * group * head_dim
        pallas_merge = (num_splits >= PALLAS_MERGE_MIN_SPLITS or
                        (num_splits > 1 and partials >= PALLAS_MERGE_MIN_ELEMENTS))
    check_launch(num_warps, num_stages)
    return AttentionBlocks(block_t, pages_per_block, num_splits, num_warps, num_stages, pallas_merge)


def row_block(rows: int, *, max_rows: int = 64) -> int:
    """Rows per program for the row-wise norm/RoPE kernels (power of two, at most max_rows)."""
    return min(max_rows, next_power_of_2(rows))
