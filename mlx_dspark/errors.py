"""User-facing errors: one sentence, a non-zero exit, no traceback (the
commands show them through :func:`mlx_dspark.cli.terminal.run_cli`)."""

from __future__ import annotations


class DSparkError(Exception):
    """An error caused by the user's input (paths, flags, files).

    Its message is a single sentence that is shown as is, without a traceback.
    """
