"""The terminal side of the library: progress bars for its ``progress(done,
total)`` callbacks, and its :mod:`logging` records as plain lines."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from ..errors import DSparkError

T = TypeVar("T")


@contextmanager
def progress_bar(description: str) -> Iterator[Callable[[int, int], None]]:
    """A transient bar on stderr (on a terminal only) and the callback that
    drives it.

    The bar appears on the first call, so that errors before any work print
    alone, and goes away once ``done`` reaches ``total``, so that it never
    sits under text streamed afterwards.
    """
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    progress = Progress(
        *columns,
        console=Console(stderr=True),
        transient=True,
        disable=not sys.stderr.isatty(),
    )
    task = None

    def advance(done: int, total: int) -> None:
        nonlocal task
        if task is None:
            progress.start()
            task = progress.add_task(description, total=total)
        progress.update(task, completed=done, total=total)
        if done >= total:
            progress.stop()

    try:
        yield advance
    finally:
        progress.stop()


class _Lines(logging.Handler):
    """Records as bare lines on ``sys.stdout`` or ``sys.stderr``, as they are
    when the record is emitted (redirections made later are honoured)."""

    def __init__(self, stderr: bool) -> None:
        super().__init__()
        self.stderr = stderr
        self.setFormatter(logging.Formatter("%(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if self.stderr else sys.stdout
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def log_to_terminal(quiet: bool = False) -> None:
    """Show the ``mlx_dspark`` logger's records as bare lines: info on stdout
    (none when ``quiet``), warnings and errors on stderr."""
    logger = logging.getLogger("mlx_dspark")
    for handler in [h for h in logger.handlers if isinstance(h, _Lines)]:
        logger.removeHandler(handler)
    info = _Lines(stderr=False)
    info.setLevel(logging.WARNING if quiet else logging.INFO)
    info.addFilter(lambda record: record.levelno < logging.WARNING)
    problems = _Lines(stderr=True)
    problems.setLevel(logging.WARNING)
    logger.addHandler(info)
    logger.addHandler(problems)
    logger.setLevel(logging.INFO)
    logger.propagate = False


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
