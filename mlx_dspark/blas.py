"""Use a system OpenBLAS for MLX's CPU backend on Linux, without LD_PRELOAD.

MLX's Linux CPU wheel calls the netlib *reference* BLAS it bundles, about a
hundred times slower than OpenBLAS on matrix products, which makes verifying k
drafts cost about k single-token steps. Its ``libmlx.so`` resolves the
``cblas_*`` symbols through the global scope, so a library loaded with
``RTLD_GLOBAL`` *before* ``mlx.core`` is imported takes the place of the
bundled one, exactly as ``LD_PRELOAD`` would. ``import mlx_dspark`` does this
first thing; this module must therefore never import MLX.

``MLX_DSPARK_BLAS=reference`` keeps MLX's own BLAS; ``MLX_DSPARK_BLAS=PATH``
names the library to load.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "MLX_DSPARK_BLAS"
OFF_VALUES = ("reference", "off", "none", "0")
# Debian/Ubuntu (pthread and plain builds), Fedora/RHEL, Arch/Alpine.
CANDIDATES = (
    "/usr/lib/{triple}/openblas-pthread/libopenblas.so.0",
    "/usr/lib/{triple}/libopenblas.so.0",
    "/usr/lib64/libopenblasp.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

logger = logging.getLogger("mlx_dspark")


@dataclass(frozen=True)
class BlasChoice:
    """What to do about the BLAS: ``load`` a library, ``skip``, or ``warn``."""

    action: str
    library: str | None
    reason: str


def candidate_paths(machine: str) -> list[str]:
    return [c.format(triple=f"{machine}-linux-gnu") for c in CANDIDATES]


def choose_blas(
    env: Mapping[str, str],
    platform: str,
    mlx_imported: bool,
    candidates: Iterable[str],
    exists: Callable[[str], bool],
    mapped: Iterable[str] = (),
) -> BlasChoice:
    """Decide, from facts about the process, whether to load a faster BLAS.

    ``candidates`` are tried in order; ``exists`` tells whether one is there;
    ``mapped`` are the real paths of the libraries the process already maps.
    """
    requested = env.get(ENV_VAR, "").strip()
    if requested.lower() in OFF_VALUES:
        return BlasChoice("skip", None, f"{ENV_VAR}={requested} keeps MLX's own BLAS")
    if not platform.startswith("linux"):
        return BlasChoice("skip", None, "MLX uses the platform's BLAS here")
    if "openblas" in env.get("LD_PRELOAD", "").lower():
        return BlasChoice("skip", None, "OpenBLAS is already preloaded")
    if requested:
        if not exists(requested):
            return BlasChoice(
                "warn",
                None,
                f"{ENV_VAR}={requested} does not exist; MLX keeps its reference "
                "BLAS (~100x slower matrix products).",
            )
        library = requested
    else:
        library = next((c for c in candidates if c and exists(c)), None)
        if library is None:
            return BlasChoice("skip", None, "no system OpenBLAS found")
    if os.path.realpath(library) in set(mapped):
        return BlasChoice("skip", library, "already loaded")
    if mlx_imported:
        return BlasChoice(
            "warn",
            library,
            "mlx.core was imported before mlx_dspark, so MLX keeps its reference "
            "BLAS (~100x slower matrix products); import mlx_dspark first, or run "
            f"with LD_PRELOAD={library}.",
        )
    return BlasChoice("load", library, "loaded before mlx.core")


def mapped_libraries() -> list[str]:
    """Real paths of the shared libraries this process maps (Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps.splitlines() if "/" in line})


def load_fast_blas() -> BlasChoice:
    """Apply :func:`choose_blas` to this process; warnings go to the logger."""
    import platform

    candidates = candidate_paths(platform.machine())
    found = ctypes.util.find_library("openblas")
    if found:
        candidates.append(found)  # a bare soname: the loader finds it
    choice = choose_blas(
        os.environ,
        sys.platform,
        "mlx.core" in sys.modules,
        candidates,
        lambda path: "/" not in path or Path(path).exists(),
        mapped_libraries(),
    )
    if choice.action == "load":
        try:
            ctypes.CDLL(choice.library, mode=ctypes.RTLD_GLOBAL)
        except OSError as error:
            choice = BlasChoice(
                "warn", None, f"could not load {choice.library}: {error}"
            )
    if choice.action == "warn":
        logger.warning("[mlx_dspark] %s", choice.reason)
    return choice
