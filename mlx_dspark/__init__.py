"""DSpark speculative decoding for mlx-lm models."""

from .blas import load_fast_blas

load_fast_blas()  # before anything imports mlx.core

from .checkpoints.loading import load_drafter  # noqa: E402
from .generation import DSparkResponse, generate, stream_generate  # noqa: E402
from .loading import load  # noqa: E402

__all__ = ["DSparkResponse", "generate", "load", "load_drafter", "stream_generate"]
