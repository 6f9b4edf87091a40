"""Acceptance of the two exact sampling rules on the default pair (one run).

    python examples/coupled_vs_residual.py --max-tokens 64 --seeds 2

Gumbel-coupled sampling (the target's own mlx-lm draw at every row, what
``--seed`` uses) against rejection sampling with residual resampling, on the
held-out sets of ``eval_default_pair.py`` (chat, code and prose
continuation), 7 drafts a round, at T=0.7 and T=1. Both rules run the same
prompts with the same seeds (set s samples prompt i with seed
s * prompts + i). Reports the mean accepted length (tokens per round,
accepted drafts + 1) per set and pooled; it does not depend on timings.
"""

from __future__ import annotations

import argparse

# isort: off
import mlx_dspark  # first: it loads a system OpenBLAS before mlx.core

# isort: on
import numpy as np
from eval_default_pair import held_out_sets

from mlx_dspark import stream_generate

RULES = ("coupled", "residual")


def rounds(model, tokenizer, drafter, prompt, temp, sampling, seed, max_tokens):
    """Accepted drafts of each round of one generation."""
    responses = list(
        stream_generate(
            model,
            tokenizer,
            drafter,
            prompt,
            max_tokens=max_tokens,
            temperature=temp,
            num_draft=7,
            seed=seed,
            sampling=sampling,
        )
    )
    return [r.accepted for r in responses[-1].stats.rounds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per set")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prefix-tokens", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=2, help="seed sets")
    parser.add_argument("--temps", type=float, nargs="+", default=[0.7, 1.0])
    args = parser.parse_args()
    if args.seeds < 1 or args.prompts < 1 or args.max_tokens < 2:
        parser.error("--seeds and --prompts must be >= 1, --max-tokens >= 2.")
    model, tokenizer, drafter = mlx_dspark.load()
    sets = held_out_sets(tokenizer, args.prompts, args.prefix_tokens)
    print(f"prompts: {', '.join(f'{k} {len(v)}' for k, v in sets.items())}")
    print(f"{'T':>4} {'set':6} {'coupled':>8} {'residual':>9}  rounds")
    for temp in args.temps:
        pooled = {rule: [] for rule in RULES}
        for name, prompts in sets.items():
            got = {rule: [] for rule in RULES}
            for seed in range(args.seeds * len(prompts)):
                prompt = prompts[seed % len(prompts)]
                for rule in RULES:
                    got[rule] += rounds(
                        model,
                        tokenizer,
                        drafter,
                        prompt,
                        temp,
                        rule,
                        seed,
                        args.max_tokens,
                    )
            for rule in RULES:
                pooled[rule] += got[rule]
            print(
                f"{temp:4g} {name:6} {np.mean(got['coupled']) + 1:8.2f} "
                f"{np.mean(got['residual']) + 1:9.2f}  "
                f"{len(got['coupled'])}/{len(got['residual'])}",
                flush=True,
            )
        print(
            f"{temp:4g} {'all':6} {np.mean(pooled['coupled']) + 1:8.2f} "
            f"{np.mean(pooled['residual']) + 1:9.2f}  "
            f"{len(pooled['coupled'])}/{len(pooled['residual'])}",
            flush=True,
        )


if __name__ == "__main__":
    main()
