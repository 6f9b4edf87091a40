"""``python -m mlx_dspark.convert``: the command line is in :mod:`mlx_dspark.cli.convert`."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> None:
    from mlx_dspark.cli.convert import main as cli_main

    cli_main(argv)


if __name__ == "__main__":
    main()
