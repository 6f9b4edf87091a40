"""``python -m mlx_dspark.doctor``: the command is :mod:`mlx_dspark.cli.doctor`."""

from mlx_dspark.cli.doctor import main

if __name__ == "__main__":
    main()
