"""User-facing errors: one sentence, a non-zero exit, no traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class DSparkError(Exception):
    """An error caused by the user's input (paths, flags, files).

    Its message is a single sentence that is shown as is, without a traceback.
    """


def run_cli(main: Callable[[], T]) -> T:
    """Run a command-line entry point, turning user errors into a clean exit."""
    try:
        return main()
    except DSparkError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
