"""DSpark speculative decoding for mlx-lm models."""

from .generation import DSparkResponse, generate, stream_generate
from .loading import load, load_drafter

__all__ = ["DSparkResponse", "generate", "load", "load_drafter", "stream_generate"]
