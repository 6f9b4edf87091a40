"""What every command shares: one-sentence errors (also for bad flags, with
argparse or typer), progress bars for the library's ``progress(done, total)``
callbacks, and its :mod:`logging` records as plain lines."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from ..errors import DSparkError

T = TypeVar("T")


@contextmanager
def progress_bar(description: str) -> Iterator[Callable[[int, int], None]]:
    """A transient bar on stderr and the callback that drives it; where
    stderr is not a terminal (a log, a pipe), one line saying what runs.

    The bar appears on the first call, so that errors before any work print
    alone, and goes away once ``done`` reaches ``total``, so that it never
    sits under text streamed afterwards.
    """
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn())
    terminal = sys.stderr.isatty()
    progress = Progress(
        *columns,
        console=Console(stderr=True),
        transient=True,
        disable=not terminal,
    )
    task = None

    def advance(done: int, total: int) -> None:
        nonlocal task
        if task is None:
            if not terminal:
                print(f"{description} ...", file=sys.stderr, flush=True)
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


def sentence(message: str) -> str:
    """``message`` as one sentence: capitalised, one final full stop."""
    message = " ".join(message.split())
    return message[:1].upper() + message[1:].rstrip(".") + "."


class ArgumentParser(argparse.ArgumentParser):
    """Flag errors become one-sentence DSpark errors (no usage dump)."""

    def error(self, message: str):
        raise DSparkError(sentence(message))


def run_command(
    command: Callable[..., None], argv: list[str] | None, prog: str
) -> None:
    """One typer command, with plain click help (typer's rich panels show a
    ``<bool>`` placeholder beside ``--help``) and one-sentence errors."""
    app = typer.Typer(
        add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None
    )
    app.command()(command)
    run_app(app, argv, prog)


def run_app(app: typer.Typer, argv: list[str] | None, prog: str) -> None:
    """Run a typer command with :func:`run_cli`; a bad flag is one sentence too."""

    args = None if argv is None else [str(arg) for arg in argv]  # paths too

    def call() -> None:
        try:
            code = app(args=args, prog_name=prog, standalone_mode=False)
        except typer.Abort:
            raise KeyboardInterrupt from None
        except Exception as error:
            # click's exceptions (typer may vendor its own click): usage errors
            # and bad values carry a message and an exit code.
            if not (hasattr(error, "format_message") and hasattr(error, "exit_code")):
                raise
            raise DSparkError(sentence(error.format_message())) from None
        if code:
            raise SystemExit(code)

    run_cli(call)
