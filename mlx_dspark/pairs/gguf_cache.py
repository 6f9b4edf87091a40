"""Built-in pairs' targets, converted once from GGUF into the user cache."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def convert_into_cache(final: Path, gguf_in: Callable[[Path], Path]) -> Path:
    """Convert the GGUF file ``gguf_in(staging)`` gives to a float32 mlx-lm
    directory at ``final``: written in a staging directory beside it (which
    may also hold the GGUF) and renamed, so a failure leaves nothing behind
    and a concurrent first use finds one whole directory."""
    from ..convert.gguf import convert_gguf

    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-"))
    try:
        convert_gguf(gguf_in(staging), staging / "model", dtype="float32", force=True)
        (staging / "model").rename(final)
    except (FileExistsError, OSError):
        if not (final / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
