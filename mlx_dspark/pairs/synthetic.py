"""Synthetic full-size pairs: Qwen3-shaped targets with structured weights.

They let the benchmark measure wall-clock speedups at paper-like acceptance
(mean accepted length about 3.5 for chat, 5.5 for math at block 7) on any
machine, without downloads. The weights are not a language model: every
number measured with them is labelled synthetic.

A pair is built once per size into the user cache (float16, Qwen3's real
shapes and vocabulary) with a base perturbation; loading rescales the
perturbation to the acceptance profile asked for, then casts or quantizes.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ..checkpoints.loading import dequantize_on_cpu
from ..errors import DSparkError
from .structured import PairSpec, cached_pair, rescale_perturbation

# Real Qwen3 shapes (hidden, layers, heads, KV heads, head dim, MLP width).
SHAPES = {
    "0.6b": dict(
        hidden_size=1024,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=3072,
    ),
    "1.7b": dict(
        hidden_size=2048,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=6144,
    ),
    "4b": dict(
        hidden_size=2560,
        num_layers=36,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=9728,
    ),
}
QWEN3_VOCAB = 151936
MARKOV_RANK = 256  # DeepSpec's markov_rank
BLOCK_SIZE = 7
BASE_PERTURBATION = 0.3

# Perturbation giving the paper's mean accepted length at block 7 (greedy):
# chat about 3.5 (per-token agreement about 0.78), math about 5.5 (about 0.91).
# Measured in float32 on chain continuations: 0.6b agreement 0.97 / 0.81 / 0.63
# at 0.15 / 0.17 / 0.19; 1.7b 0.94 / 0.79 / 0.59 at 0.16 / 0.18 / 0.20. The
# 4b values are extrapolated, not measured (building it is too slow here).
PERTURBATION = {
    ("0.6b", "chat"): 0.175,
    ("0.6b", "math"): 0.16,
    ("1.7b", "chat"): 0.181,
    ("1.7b", "math"): 0.167,
    ("4b", "chat"): 0.185,
    ("4b", "math"): 0.17,
}
ACCEPT_PROFILES = ("chat", "math")
BITS = (4, 8, 16, 32)


def synthetic_spec(size: str) -> PairSpec:
    if size not in SHAPES:
        raise DSparkError(
            f"Unknown synthetic size {size!r}; choose one of {', '.join(SHAPES)}."
        )
    return PairSpec(
        vocab_size=QWEN3_VOCAB,
        draft_layers=1,
        block_size=BLOCK_SIZE,
        markov_head_type="vanilla",
        perturbation=BASE_PERTURBATION,
        code_size=MARKOV_RANK,
        **SHAPES[size],
    )


def synthetic_pair(size: str) -> tuple[Path, Path]:
    """Build (once, into the user cache) the float16 pair of ``size``."""
    return cached_pair(f"synthetic-qwen3-{size}-v1", synthetic_spec(size), mx.float16)


def _quantizable(path: str, module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        hasattr(module, "to_quantized")
        and weight is not None
        and weight.shape[-1] % 64 == 0
        and weight.shape[0] >= 64
    )


def prepare(model: nn.Module, drafter: nn.Module, bits: int) -> None:
    """Cast (16, 32) or quantize (4, 8) the target and the drafter in place.

    Computation runs in float32 (CPU MLX is much slower in float16); quantized
    weights keep float32 scales. The drafter is dequantized again on the CPU,
    as :func:`mlx_dspark.checkpoints.loading.build_drafter` does for a quantized drafter.
    """
    if bits not in BITS:
        raise DSparkError(f"--bits must be one of 4, 8, 16, 32, got {bits}.")
    dtype = mx.float16 if bits == 16 else mx.float32
    model.set_dtype(dtype)
    drafter.set_dtype(dtype)
    if bits in (4, 8):
        nn.quantize(model, group_size=64, bits=bits, class_predicate=_quantizable)
        nn.quantize(drafter, group_size=64, bits=bits, class_predicate=_quantizable)
        dequantize_on_cpu(drafter)
    mx.eval(model.parameters(), drafter.parameters())


def boost_markov_head(drafter: nn.Module) -> None:
    """Scale the Markov head so that it outweighs the base logits at width d.

    The structured drafter's base logits grow like d and its Markov bias like
    sqrt(d); they balance at d = 64 (the tiny pairs). Past that the base logits
    (the anchor's successor at every position) win from position 2 on and
    every chain breaks after one draft, so the bias is scaled by sqrt(d) / 8.
    """
    head = drafter.markov_head
    d = drafter.config.hidden_size
    factor = max(1.0, d**0.5 / 8)
    head.markov_w2.weight = head.markov_w2.weight * factor
    mx.eval(head.markov_w2.weight)


def load_synthetic(size: str, bits: int = 4, accept: str = "chat"):
    """``(model, tokenizer, drafter)`` for a synthetic pair, ready to run."""
    from ..checkpoints.loading import load_pair

    if accept not in ACCEPT_PROFILES:
        raise DSparkError(
            f"--accept must be one of {', '.join(ACCEPT_PROFILES)}, got {accept!r}."
        )
    target_dir, drafter_dir = synthetic_pair(size)
    model, tokenizer, drafter = load_pair(target_dir, drafter_dir)
    rescale_perturbation(model, BASE_PERTURBATION, PERTURBATION[(size, accept)])
    boost_markov_head(drafter)
    prepare(model, drafter, bits)
    return model, tokenizer, drafter
