"""Command-line interfaces: one module per command, and the ``mlx_dspark`` family.

Only modules here parse arguments (typer; argparse where a command must
accept what typer cannot: ``generate``, built on mlx-lm's own parser, and
``train``'s multi-value ``--data``) and render to the terminal (rich); the library modules they
call return values, log through :mod:`logging` and report progress through
callbacks. Every command module exposes ``main(argv=None, prog=...)``, which
both the dotted console script (``mlx_dspark.X``) and ``mlx_dspark X`` call.
"""
