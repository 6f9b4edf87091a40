"""Helpers shared by the converters."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mlx_dspark.errors import DSparkError


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse an output path that exists as a file, or as a non-empty directory
    unless ``force`` is set."""
    if out.exists() and not out.is_dir():
        raise DSparkError(f"--out {out} exists and is not a directory.")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise DSparkError(
            f"--out {out} is not empty; pass --force to replace its contents."
        )


@contextmanager
def atomic_output_dir(out: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to ``out`` and move it to ``out`` when
    the block succeeds.

    On any error (or Ctrl-C) the temporary directory and any parent directories
    created for it are removed, so a failed conversion leaves nothing behind.
    With ``force`` an existing ``out`` is replaced only after the new one is
    complete.
    """
    out = Path(out).absolute()
    check_output_dir(out, force)

    missing = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise DSparkError(
            f"cannot create the parent directory of --out {out}: {error.strerror}."
        ) from None
    created_parent = missing[-1] if missing else None

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    try:
        yield tmp
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created_parent is not None:
            shutil.rmtree(created_parent, ignore_errors=True)
        raise


def _replace_dir(src: Path, dst: Path) -> None:
    if not dst.exists():
        src.rename(dst)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".old", dir=dst.parent))
    old.rmdir()
    dst.rename(old)
    try:
        src.rename(dst)
    except BaseException:
        old.rename(dst)
        raise
    shutil.rmtree(old, ignore_errors=True)
