"""``python -m mlx_dspark.train``: the command is :mod:`mlx_dspark.cli.train`."""

from mlx_dspark.cli.train import main

if __name__ == "__main__":
    main()
