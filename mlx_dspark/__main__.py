"""``python -m mlx_dspark <command>``: the command family (:mod:`mlx_dspark.cli.main`)."""

from mlx_dspark.cli.main import main

if __name__ == "__main__":
    main()
