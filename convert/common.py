"""Helpers shared by the converters."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

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


# ------------------------------------------------------------------ safetensors

SAFETENSORS_ITEMSIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
_MAX_HEADER = 100 * 2**20


@dataclass
class SafetensorsEntry:
    name: str
    dtype: str  # safetensors dtype name: "BF16", "F32", ...
    shape: tuple[int, ...]
    file: Path

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * SAFETENSORS_ITEMSIZE.get(self.dtype, 1)


def read_safetensors_header(path: Path) -> dict[str, SafetensorsEntry]:
    """The tensor table of a safetensors file, checked against the file size so
    that truncated or corrupt files are refused before any data is read."""
    bad = f"{path} is truncated or not a valid safetensors file."
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise DSparkError(bad)
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, _MAX_HEADER):
                raise DSparkError(bad)
            header = json.loads(f.read(length))
    except OSError as error:
        raise DSparkError(f"Cannot read {path}: {error.strerror}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DSparkError(bad) from None
    if not isinstance(header, dict):
        raise DSparkError(bad)
    data_size = size - 8 - length
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise DSparkError(bad) from None
        if dtype not in SAFETENSORS_ITEMSIZE:
            raise DSparkError(
                f"Tensor {name} in {path.name} has dtype {dtype}, which is not supported."
            )
        entry = SafetensorsEntry(name, dtype, shape, path)
        if not 0 <= begin <= end <= data_size or end - begin != entry.nbytes:
            raise DSparkError(bad)
        entries[name] = entry
    return entries


def sha256_file(path: Path, chunk: int = 16 * 2**20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def dequantize_in_place(weights: dict, config) -> None:
    """Float weights of an already quantized MLX drafter (``config.quantization``
    set), in place; the config then says it is float."""
    q = config.quantization
    if not q:
        return
    for name in [k for k in weights if k.endswith(".scales")]:
        base = name[: -len(".scales")]
        weights[f"{base}.weight"] = mx.dequantize(
            weights[f"{base}.weight"],
            weights.pop(name),
            weights.pop(f"{base}.biases", None),
            group_size=q["group_size"],
            bits=q["bits"],
        )
    config.quantization = None
