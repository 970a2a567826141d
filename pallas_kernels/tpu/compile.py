"""Compiling for TPUs ahead of time, on any machine with libtpu (``pip install -e ".[tpu]"``):
the devices of a TPU topology without a TPU, and a function lowered and compiled for one."""

from __future__ import annotations

import functools
import os

import jax


@functools.cache
def topology_devices(topology: str) -> tuple:
    """The devices of a TPU topology such as ``"v6e:2x2"`` or ``"v5p:2x2x1"``
    (``jax.experimental.topologies``; single-chip names are refused by libtpu: use one device
    of a 2x2). Compiling touches no chip, so several processes may load libtpu at once (its
    lockfile guards chips: ``ALLOW_MULTIPLE_LIBTPU_LOAD``)."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    return tuple(topologies.get_topology_desc(platform="tpu", topology_name=topology).devices)


def compile_for(device, fn, *shapes):
    """``jax.jit(fn)`` compiled for one TPU ``device`` from (shape, dtype) pairs. Mosaic reads the
    chip's generation from jax's default device, so lowering runs under ``jax.default_device``."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    structs = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]
    with jax.default_device(device):
        return jax.jit(fn).lower(*structs).compile()


def chip_figures(device) -> dict:
    """One chip of a TPU ``device``'s kind, as libtpu reports it (per TensorCore, times its
    cores): HBM bytes, HBM bytes/s and bf16 FLOP/s."""
    from jax.experimental.pallas import tpu as pltpu

    with jax.default_device(device):
        info = pltpu.get_tpu_info()
    return {"kind": device.device_kind, "hbm_bytes": info.hbm_capacity_bytes * info.num_cores,
            "bandwidth_bytes_per_s": info.mem_bw_bytes_per_second * info.num_cores,
            "matmul_flops_per_s": info.bf16_ops_per_second * info.num_cores}
