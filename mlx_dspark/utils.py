"""Small shared utilities: atomic file writes, the user cache directory and
prompt encoding. (Model loading is :mod:`mlx_dspark.checkpoints.loading`.)"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    """The user cache: ``$MLX_DSPARK_CACHE``, else ``$XDG_CACHE_HOME/mlx_dspark``
    (``~/.cache/mlx_dspark``)."""
    root = os.environ.get("MLX_DSPARK_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlx_dspark"
    )
    return Path(root)


def umask() -> int:
    """The process's file-mode creation mask."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> None:
    """Let ``write(tmp)`` fill a temporary file beside ``path``, then rename it
    over ``path``: readers see the old file or the whole new one, never a part.

    The temporary name keeps ``path``'s suffix (writers such as matplotlib
    pick the format from it); it is removed if ``write`` fails. The file gets
    the mode a plain ``open(path, "w")`` gives (mkstemp's is 0600).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.tmp-", suffix=path.suffix
    )
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`write_atomic`)."""
    write_atomic(path, lambda tmp: tmp.write_text(text))


def encode_chat_prompt(tokenizer: Any, text: str, chat: bool = True) -> list[int]:
    """Token ids of a user prompt: through the chat template when the
    tokenizer has one (and ``chat``), else the plain encoding."""
    if chat and getattr(tokenizer, "has_chat_template", False):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            tokenize=False,
            add_generation_prompt=True,
        )
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))
