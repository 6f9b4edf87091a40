"""``python -m mlx_dspark.train``: the command is :mod:`mlx_dspark.cli.train`."""

from __future__ import annotations


def main() -> None:
    from .cli.train import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
