"""``python -m mlx_dspark.calibrate``: the command is :mod:`mlx_dspark.cli.calibrate`."""

from __future__ import annotations


def main() -> None:
    from .cli.calibrate import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
