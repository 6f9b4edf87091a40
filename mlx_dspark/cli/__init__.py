"""Command-line interfaces: one module per command, and the ``mlx_dspark`` family.

Only modules here parse arguments and render to the terminal (rich). They
parse with typer, or with argparse where a command needs what typer cannot
do: ``generate`` is built on mlx-lm's own parser, and ``train`` takes several
files after one ``--data``. The library modules they call return values, log
through :mod:`logging` and report progress through callbacks. Every command
module exposes ``main(argv=None, prog=...)``, which both the dotted console
script (``mlx_dspark.X``) and ``mlx_dspark X`` call.
"""
