"""``python -m mlx_dspark.server``: the OpenAI-compatible DSpark server.

The engine lives in :mod:`mlx_dspark.serving`, the command line in
:mod:`mlx_dspark.cli.server`.
"""

from __future__ import annotations


def main() -> None:
    from .cli.server import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
