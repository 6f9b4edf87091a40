"""Fixed draft lengths vs the threshold rule vs the calibrated scheduler.

For the small structured pair and a larger synthetic target, in one run:
calibrates the confidence head (STS), measures the cost profile, then decodes
the same prompts greedily with N = 1, 3, 5, 7 (scheduler off), the threshold
rule and ``auto``; prints tok/s, mean accepted length and ECE before/after.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python examples/bench_scheduler.py [--scale 1.0] [--threshold 0.5]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from mlx_dspark import load, stream_generate
from mlx_dspark.machine import detect_blas
from mlx_dspark.pairs.structured import PairSpec, build_structured_pair
from mlx_dspark.policy.calibrate import calibrate_pair
from mlx_dspark.policy.profile import get_profile
from mlx_dspark.utils import cache_dir

# name: (spec, calibration rounds, max tokens per prompt, prompts)
PAIRS = {
    "structured (d=64, 2 layers)": (PairSpec(), 200, 128, 4),
    "large synthetic (d=1024, 16 layers)": (
        PairSpec(
            vocab_size=2048,
            hidden_size=1024,
            num_layers=16,
            num_heads=16,
            num_kv_heads=8,
            head_dim=64,
            intermediate_size=2816,
        ),
        40,
        32,
        2,
    ),
}


def prompts_for(spec: PairSpec, count: int = 4) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [
        rng.integers(0, spec.vocab_size - 2, int(rng.integers(3, 9))).tolist()
        for _ in range(count)
    ]


def build(name: str, spec: PairSpec) -> tuple[Path, Path]:
    directory = cache_dir() / "bench" / f"pair-{abs(hash(repr(spec))) % 10**8}"
    if not (directory / "drafter" / "config.json").exists():
        build_structured_pair(directory, spec)
    return directory / "target", directory / "drafter"


def decode(model, tokenizer, drafter, prompts, max_tokens, **kwargs):
    tokens, seconds, rounds = 0, 0.0, []
    for prompt in prompts:
        tic = time.perf_counter()
        *_, response = stream_generate(
            model, tokenizer, drafter, prompt, max_tokens=max_tokens, **kwargs
        )
        seconds += time.perf_counter() - tic
        tokens += response.generation_tokens
        if response.stats is not None:
            rounds.extend(response.stats.rounds)
    tau = sum(r.accepted + 1 for r in rounds) / len(rounds) if rounds else float("nan")
    return tokens / seconds, tau


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scale", type=float, default=1.0, help="work multiplier")
    parser.add_argument("--threshold", type=float, default=0.5)
    args = parser.parse_args()
    console = Console()
    blas = detect_blas()
    console.print(f"BLAS: {blas.kind} ({blas.library}), {blas.gflops:.1f} GFLOP/s")
    for name, (spec, rounds, max_tokens, n_prompts) in PAIRS.items():
        rounds = max(1, int(rounds * args.scale))
        max_tokens = max(4, int(max_tokens * args.scale))
        tic = time.perf_counter()
        target_dir, drafter_dir = build(name, spec)
        model, tokenizer, drafter = load(target_dir, drafter_dir)
        console.print(
            f"\n[bold]{name}[/] built+loaded in {time.perf_counter() - tic:.1f} s"
        )
        prompts = prompts_for(spec, n_prompts)
        texts = [
            " ".join(f"t{t}" for t in p) for p in prompts_for(spec, 12)[n_prompts:]
        ]
        result, path, _ = calibrate_pair(
            model,
            tokenizer,
            drafter,
            prompts=texts,
            rounds=rounds,
            max_tokens=max_tokens,
            plot=False,
        )
        curve = get_profile(model, drafter, "refresh")
        ece_b = np.nanmean(result.ece_before)
        ece_a = np.nanmean(result.ece_after)
        console.print(
            f"STS on {result.n_rounds} held-out rounds: mean ECE {ece_b:.3f} -> "
            f"{ece_a:.3f} (per position: "
            + " ".join(
                f"{b:.2f}->{a:.2f}"
                for b, a in zip(result.ece_before, result.ece_after, strict=True)
                if math.isfinite(b)
            )
            + ")"
        )
        console.print(
            "Profile: step ms at B=1..8: "
            + " ".join(f"{1000 * curve.step_seconds(b):.2f}" for b in range(1, 9))
            + f"; draft block {1000 * curve.draft_seconds:.2f} ms"
        )
        runs = [("target only", dict(drafter=None))]
        runs += [(f"N={n}", dict(num_draft=n, scheduler="off")) for n in (1, 3, 5, 7)]
        runs += [
            (
                f"threshold {args.threshold}",
                dict(scheduler="threshold", confidence_threshold=args.threshold),
            ),
            ("auto", dict(scheduler="auto")),
        ]
        decode(model, tokenizer, drafter, prompts[:1], 16)  # warm-up
        table = Table(title=name)
        for column in ("mode", "tok/s", "speedup", "mean accepted length"):
            table.add_column(column, justify="right")
        base = None
        for label, kwargs in runs:
            d = kwargs.pop("drafter", drafter)
            tps, tau = decode(model, tokenizer, d, prompts, max_tokens, **kwargs)
            base = base or tps
            table.add_row(label, f"{tps:.1f}", f"{tps / base:.2f}x", f"{tau:.2f}")
        console.print(table)


if __name__ == "__main__":
    main()
