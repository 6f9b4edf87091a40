"""Chain vs tree drafting: mean accepted length and tok/s, ratios vs target-only.

Greedy decoding on structured pairs (float32) built in a temporary directory:
the default tiny pair and a larger synthetic target. On Linux CPU run with
OpenBLAS preloaded, e.g.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python examples/tree_benchmark.py --budgets 4 8 16

Every speculative run is checked to produce the target-only tokens.
"""

from __future__ import annotations

import argparse
import tempfile
import time

# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
import mlx.core as mx
from mlx_lm.generate import generate_step

from mlx_dspark.decoding.loop import GenerationStats, speculative_generate_step
from mlx_dspark.decoding.modes import TreeMode
from mlx_dspark.loading import load
from mlx_dspark.machine import detect_blas
from mlx_dspark.pairs.structured import PairSpec, build_structured_pair
from mlx_dspark.proposers.copying import pair_proposer
from mlx_dspark.targets.adapter import TargetAdapter

PAIRS = {
    "tiny": PairSpec(block_size=8),
    "tiny-nohead": PairSpec(block_size=8, markov_head_type=None),
    "large": PairSpec(
        vocab_size=4096,
        hidden_size=768,
        num_layers=8,
        num_heads=12,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=2048,
        block_size=8,
        perturbation=0.1,
    ),
}
PROMPTS = [[1, 2, 3], [7, 8], [20, 4, 11, 9], [13, 5, 5, 21, 2, 17]]


def target_only(model, prompt, max_tokens):
    tokens = [
        int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)
    ]
    return tokens


def speculative(target, drafter, prompt, max_tokens, budget):
    stats = GenerationStats()
    mode = TreeMode(budget) if budget else None
    tokens = [
        t
        for t, _ in speculative_generate_step(
            mx.array(prompt),
            target,
            pair_proposer(drafter),
            num_draft=drafter.block_size,
            max_tokens=max_tokens,
            mode=mode,
            stats=stats,
            seed=0,
        )
    ]
    return tokens[:max_tokens], stats


def timed(fn, *args):
    tic = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - tic


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS))
    parser.add_argument("--budgets", nargs="+", type=int, default=[4, 8, 16])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--perturbation", type=float, default=None)
    args = parser.parse_args()
    blas = detect_blas()
    print(
        f"BLAS: {blas.kind} ({blas.library}), {blas.gflops:.0f} GFLOP/s float32 matmul"
    )
    for name in args.pairs:
        spec = PAIRS[name]
        if args.perturbation is not None:
            spec.perturbation = args.perturbation
        with tempfile.TemporaryDirectory() as directory:
            model, _, drafter = load(*build_structured_pair(directory, spec))
        target = TargetAdapter(model, drafter.config.target_layer_ids)
        print(f"\n{name}: {spec}")
        # Warm up every path once.
        target_only(model, PROMPTS[0], 8)
        for budget in [0, *args.budgets]:
            speculative(target, drafter, PROMPTS[0], 16, budget)
        expected, base_time = [], 0.0
        for prompt in PROMPTS:
            tokens, seconds = timed(target_only, model, prompt, args.max_tokens)
            expected.append(tokens)
            base_time += seconds
        n = args.max_tokens * len(PROMPTS)
        base_tps = n / base_time
        print(f"{'mode':>10} {'tau':>6} {'nodes':>6} {'tok/s':>8} {'vs target':>9}")
        print(f"{'target':>10} {1.0:6.2f} {'-':>6} {base_tps:8.1f} {1.0:9.2f}")
        for budget in [0, *args.budgets]:
            rounds, seconds = [], 0.0
            for prompt, reference in zip(PROMPTS, expected, strict=True):
                (tokens, stats), t = timed(
                    speculative, target, drafter, prompt, args.max_tokens, budget
                )
                assert tokens == reference, (name, budget, prompt)
                rounds += stats.rounds
                seconds += t
            tau = sum(r.accepted + 1 for r in rounds) / len(rounds)
            label = "chain" if budget == 0 else f"tree {budget}"
            verified = "8" if budget == 0 else str(budget)
            tps = n / seconds
            print(
                f"{label:>10} {tau:6.2f} {verified:>6} {tps:8.1f} {tps / base_tps:9.2f}"
            )


if __name__ == "__main__":
    main()
