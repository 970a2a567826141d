"""Convert an HF folder (a target of any supported family, or a DFlash draft) into a folder that dflash_jax loads.
Everything is written into a hidden folder beside OUT, .NAME.<8 hex digits>.tmp (NAME: OUT's own
name), renamed to OUT when complete. Errors print one line and exit 2, as the other command lines
do, and Ctrl-C or SIGTERM exits 130; either way the hidden folder is removed. SIGKILL (kill -9, the
out-of-memory killer) cannot be caught: it may leave the hidden folder behind (with --overwrite,
also the folder being replaced, as .NAME.<8 hex digits>.old). A later conversion to OUT warns of
them; delete them once none runs."""

from __future__ import annotations

import argparse
import signal
import sys

from checkpoints_convert.convert import convert
from dflash_jax.entrypoints.cli import INTERRUPTED, DefaultsHelpFormatter, exit_with, one_line_warnings
from dflash_jax.loading.models import DTYPES


def _interrupt(signum, frame):
    raise KeyboardInterrupt


@one_line_warnings()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checkpoints_convert", description=__doc__,
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("src", metavar="SRC", help="HF model folder (config.json + safetensors)")
    parser.add_argument("out", metavar="OUT", help="output folder (appears only when complete)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES),
                        help="stored float dtype (config.json states it)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT if it is a model folder (with a config.json) or an empty folder; never "
                             "another folder")
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
