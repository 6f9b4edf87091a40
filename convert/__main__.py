def main() -> None:
    raise SystemExit("mlx_dspark.convert is not implemented yet.")


if __name__ == "__main__":
    main()
