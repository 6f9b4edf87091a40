"""``mlx_dspark <command>``: the command family, like ``mlx_lm <command>``.

Each command is the same one the dotted console script runs
(``mlx_dspark generate ...`` is ``mlx_dspark.generate ...``): the arguments
after the command name go, untouched, to that command's own parser. typer
here only lists the commands (``mlx_dspark --help``) and refuses unknown ones.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

import typer

from .terminal import run_app

# name -> (module in mlx_dspark.cli, one-line help). Every module has
# ``main(argv, prog)``. A new command is one entry here.
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": (
        "generate",
        "Generate text with DSpark speculative decoding (a superset of "
        "mlx_lm.generate).",
    ),
    "convert": ("convert", "Convert GGUF targets and DSpark drafters to MLX."),
    "calibrate": ("calibrate", "Fit a drafter's confidence head for a pair."),
    "train": ("train", "Train a DSpark drafter for an mlx-lm target."),
    "benchmark": (
        "benchmark",
        "Compare target-only, mlx-lm speculative and DSpark decoding.",
    ),
    "doctor": ("doctor", "Check the machine: backend, memory, speed, BLAS."),
    "server": ("server", "Serve an OpenAI-compatible API with batched DSpark."),
}


def run_command(name: str, argv: Sequence[str]) -> None:
    """Run command ``name`` with its own arguments ``argv``."""
    module = importlib.import_module(f"mlx_dspark.cli.{COMMANDS[name][0]}")
    module.main(list(argv), prog=f"mlx_dspark {name}")


def _forwarder(name: str):
    def command(ctx: typer.Context) -> None:
        run_command(name, ctx.args)

    return command


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="mlx_dspark",
        help="DSpark speculative decoding for mlx-lm models. Run "
        "'mlx_dspark COMMAND --help' for a command's flags.",
        add_completion=False,
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
    )
    for name, (_, summary) in COMMANDS.items():
        app.command(
            name,
            help=summary,
            add_help_option=False,
            context_settings={
                "allow_extra_args": True,
                "ignore_unknown_options": True,
            },
        )(_forwarder(name))
    return app


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        # Straight to the command's parser: no second parse that could
        # reinterpret its flags.
        run_command(argv[0], argv[1:])
        return
    # The list of commands, or one sentence for an unknown command.
    run_app(build_app(), argv or ["--help"], "mlx_dspark")


if __name__ == "__main__":
    main()
