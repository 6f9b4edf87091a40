"""``python -m mlx_dspark.doctor``: the command is :mod:`mlx_dspark.cli.doctor`."""

from __future__ import annotations


def main() -> None:
    from .cli.doctor import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
