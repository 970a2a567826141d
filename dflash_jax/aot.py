"""``python -m dflash_jax.aot``: the engine's programs compiled ahead of time for a TPU topology,
with the bytes, FLOPs and HBM they need per device (``dflash_jax.entrypoints.aot``)."""

from dflash_jax.entrypoints.aot import main
from dflash_jax.entrypoints.cli import exit_with

__all__ = ["main"]

if __name__ == "__main__":
    exit_with(main)
