"""Measurement: interleaved trials per mode, records, the machine and its roofline."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from ..decoding.loop import GenerationStats
from ..targets.adapter import TargetAdapter
from .modes import Pair, Variant


@dataclass
class Measurement:
    variant: Variant
    trials: list[float] = field(default_factory=list)  # tok/s per trial
    draft_times: list[float] = field(default_factory=list)
    verify_times: list[float] = field(default_factory=list)
    peak: float = 0.0
    outputs: list[list[int]] | None = None
    stats: GenerationStats | None = None
    tokens: int = 0


def _merge(stats: Iterable[GenerationStats | None]) -> GenerationStats | None:
    stats = [s for s in stats if s is not None]
    if not stats:
        return None
    return GenerationStats(rounds=[r for s in stats for r in s.rounds])


def measure(
    pair: Pair,
    variants: list[Variant],
    prompts: list[list[int]],
    max_tokens: int,
    trials: int,
    progress: Callable[[str], None] = lambda message: None,
) -> list[Measurement]:
    """Run every variant on every prompt, ``trials`` times, interleaved: each
    prompt runs under every variant before the next prompt, in an order that
    reverses from one prompt to the next, so that a change in the machine's
    load falls on all variants alike."""
    results = [Measurement(v) for v in variants]
    for m in results:  # warm up: compilation, allocation, caches
        progress(f"warming up: {m.variant.name}")
        m.variant.run(pair, prompts[0], min(max_tokens, 8))
    for trial in range(trials):
        progress(f"trial {trial + 1}/{trials}")
        runs_of: list[list] = [[] for _ in results]
        for p, prompt in enumerate(prompts):
            order = range(len(results))
            for i in order if (trial * len(prompts) + p) % 2 == 0 else reversed(order):
                mx.reset_peak_memory()
                runs_of[i].append(results[i].variant.run(pair, prompt, max_tokens))
                results[i].peak = max(results[i].peak, mx.get_peak_memory() / 1e9)
        for m, runs in zip(results, runs_of, strict=True):
            tokens = sum(max(len(r.tokens) - 1, 0) for r in runs)
            seconds = sum(r.decode_time for r in runs)
            m.trials.append(tokens / seconds if seconds > 0 else 0.0)
            stats = _merge(r.stats for r in runs)
            if stats is not None:
                m.draft_times.append(stats.draft_time)
                m.verify_times.append(stats.verify_time)
            if m.outputs is None:
                m.outputs = [r.tokens for r in runs]
                m.stats = stats
                m.tokens = sum(len(r.tokens) for r in runs)
            elif m.outputs != [r.tokens for r in runs]:
                m.outputs = [[] for _ in runs]  # not reproducible: never lossless
    return results


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def records(
    results: list[Measurement], ceiling: float | None, synthetic: bool
) -> list[dict]:
    baseline = results[0]
    assert baseline.variant.kind == "target"
    base_rate = statistics.median(baseline.trials)
    out = []
    for m in results:
        rate = statistics.median(m.trials)
        stats = m.stats
        if m.variant.kind == "target":
            lossless, mean_length, by_position, rounds = True, 1.0, [], None
        else:
            lossless = m.outputs == baseline.outputs
            mean_length = stats.mean_accepted_length if stats.rounds else 1.0
            by_position = stats.acceptance_by_position
            rounds = len(stats.rounds)
        out.append(
            {
                "mode": m.variant.name,
                "kind": m.variant.kind,
                "synthetic": synthetic,
                "num_draft": m.variant.num_draft,
                "threshold": m.variant.threshold,
                "tok_per_s": rate,
                "tok_per_s_min": min(m.trials),
                "tok_per_s_max": max(m.trials),
                "tok_per_s_trials": m.trials,
                "speedup": rate / base_rate if base_rate > 0 else 0.0,
                "ceiling_fraction": rate / ceiling if ceiling else None,
                "mean_accepted_length": mean_length,
                "acceptance_by_position": by_position,
                "draft_time_s": _median(m.draft_times),
                "verify_time_s": _median(m.verify_times),
                "peak_memory_gb": m.peak,
                "tokens": m.tokens,
                "rounds": rounds,
                "lossless": lossless,
            }
        )
    return out


def target_bytes_per_step(model: nn.Module) -> int:
    """Bytes a decoding step reads: every parameter, except that an untied
    embedding table is read one row at a time."""
    from ..machine import model_bytes

    total = model_bytes(model)
    adapter = TargetAdapter(model)
    if not adapter.tied_head:
        embed = adapter.embedding
        total -= sum(v.nbytes for v in embed.parameters().values())
    return total


def machine_report(model: nn.Module) -> dict:
    from ..machine import backend, detect_blas, measure_bandwidth, roofline

    blas = detect_blas()
    bandwidth = measure_bandwidth()
    per_step = target_bytes_per_step(model)
    return {
        "backend": backend(),
        "blas": blas.kind,
        "blas_library": blas.library,
        "blas_gflops": blas.gflops,
        "blas_slow": blas.slow,
        "bandwidth_gb_s": bandwidth / 1e9,
        "target_bytes_per_step": per_step,
        "ceiling_tok_per_s": roofline(per_step, bandwidth),
        "mlx": mx.__version__,
    }
