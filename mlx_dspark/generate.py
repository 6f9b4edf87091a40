"""``python -m mlx_dspark.generate``: the command is :mod:`mlx_dspark.cli.generate`."""

from __future__ import annotations


def main() -> None:
    from .cli.generate import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
