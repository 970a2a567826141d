"""DMA copies started and waited for under one guard (Mosaic TPU kernels)."""

from jax.experimental import pallas as pl


def guarded(wanted, copies, action: str) -> None:
    """``action`` ("start" or "wait") on each of ``copies`` (``pltpu.make_async_copy``) when the
    traced bool ``wanted`` holds: a copy's wait must be guarded as its start was."""

    @pl.when(wanted)
    def _():
        for copy in copies:
            getattr(copy, action)()
