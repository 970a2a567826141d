"""``python -m dflash_jax.generate``: DFlash generation from the command line, and the library's
``generate()`` (which lives in ``dflash_jax.runtime.generation``; the command line in
``dflash_jax.entrypoints.generate``).

The command line parses its arguments before importing jax, so ``--help`` and usage errors
answer at once; the library's names are imported on first use."""

from typing import TYPE_CHECKING

from dflash_jax.entrypoints.arguments import DEFAULT_MODEL, generate_parser
from dflash_jax.entrypoints.cli import exit_with, interrupt_exits

if TYPE_CHECKING:  # for type checkers and editors; at run time ``__getattr__`` imports them
    from dflash_jax.runtime.generation import GenerationResult, GenerationStats, generate

__all__ = ["DEFAULT_MODEL", "GenerationResult", "GenerationStats", "generate", "main"]
_LIBRARY = ("GenerationResult", "GenerationStats", "generate")


def __getattr__(name: str):
    """The library's names, imported on first use (so that the command line starts without jax)."""
    if name in _LIBRARY:
        from dflash_jax.runtime import generation

        return getattr(generation, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@interrupt_exits()
def main(argv: list[str] | None = None) -> int:
    """The command line on ``argv`` (default: ``sys.argv[1:]``); its exit status."""
    args = generate_parser().parse_args(argv)
    from dflash_jax.entrypoints.generate import run

    return run(args)


if __name__ == "__main__":
    exit_with(main)
