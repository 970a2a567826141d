"""Convert an HF folder (a target of any supported family, or a DFlash draft) into a folder that dflash_jax loads.
Errors print one line and exit 2, as the other command lines do (130 on Ctrl-C or a kill);
nothing is left behind."""

from __future__ import annotations

import argparse
import signal
import sys

from checkpoints_convert.convert import convert
from dflash_jax.cli import INTERRUPTED, exit_with, one_line_warnings
from dflash_jax.models import DTYPES


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@one_line_warnings()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checkpoints_convert", description=__doc__)
    parser.add_argument("src", help="HF model folder (config.json + safetensors)")
    parser.add_argument("out", help="output folder (created atomically)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="stored float dtype")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it is a model folder (or empty)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a kill cleans up as Ctrl-C does
    try:
        out = convert(args.src, args.out, dtype=args.dtype, overwrite=args.overwrite, progress=not args.quiet)
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return INTERRUPTED
    except (ValueError, OSError) as error:  # ConfigError and CheckpointError are ValueErrors
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(out)
    return 0


if __name__ == "__main__":
    exit_with(main)
