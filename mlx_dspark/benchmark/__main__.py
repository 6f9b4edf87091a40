"""``python -m mlx_dspark.benchmark``: the command is :mod:`mlx_dspark.cli.benchmark`."""

from mlx_dspark.cli.benchmark import main

if __name__ == "__main__":
    main()
