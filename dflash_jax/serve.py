"""``python -m dflash_jax.serve``: the OpenAI-compatible server (``dflash_jax.entrypoints.serve``).

It parses its arguments before importing jax, so ``--help`` and usage errors answer at once."""

from dflash_jax.entrypoints.arguments import serve_parser
from dflash_jax.entrypoints.cli import exit_with, interrupt_exits

__all__ = ["main"]


@interrupt_exits()
def main(argv: list[str] | None = None) -> int:
    """The server on ``argv`` (default: ``sys.argv[1:]``); its exit status."""
    args = serve_parser().parse_args(argv)
    from dflash_jax.entrypoints.serve import run

    return run(args)


if __name__ == "__main__":
    exit_with(main)
