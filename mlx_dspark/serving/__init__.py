"""Serving: the batched speculative-decoding engine and its OpenAI-compatible
HTTP front end (``mlx_dspark.server``)."""

from .api import ServerSettings, make_server
from .engine import BatchEngine, EngineConfig, GenerationRequest

__all__ = [
    "BatchEngine",
    "EngineConfig",
    "GenerationRequest",
    "ServerSettings",
    "make_server",
]
