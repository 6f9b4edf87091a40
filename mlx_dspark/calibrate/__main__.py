"""``python -m mlx_dspark.calibrate``: the command is :mod:`mlx_dspark.cli.calibrate`."""

from mlx_dspark.cli.calibrate import main

if __name__ == "__main__":
    main()
