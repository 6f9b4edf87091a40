"""Seeded DSpark output against mlx-lm's on the default pair (one run).

    python examples/seed_parity_default_pair.py --max-tokens 48 --seeds 3

For each chat prompt of ``eval_default_pair.py``, seed and sampling setting,
generates with ``stream_generate(..., seed=S)`` (the default policy, and 7
drafts a round) and with ``mlx_lm.stream_generate`` after
``mx.random.seed(S)``, and reports how many runs are identical and where the
others first differ. A real model's multi-token verify forward may differ
from one-token steps in the last bits, so a near-tie can flip a token.
"""

from __future__ import annotations

import argparse

# isort: off
import mlx_dspark  # first: it loads a system OpenBLAS before mlx.core

# isort: on
import mlx.core as mx
from eval_default_pair import held_out_sets
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate
from mlx_lm.sample_utils import make_sampler

from mlx_dspark import stream_generate

SETTINGS = {
    "T=0.7": {"temperature": 0.7},
    "T=1 top-p 0.9": {"temperature": 1.0, "top_p": 0.9},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer, drafter = mlx_dspark.load()
    prompts = held_out_sets(tokenizer, args.prompts, 64)["chat"]
    for name, kwargs in SETTINGS.items():
        for policy in ({}, {"num_draft": 7}):
            same, diverged = 0, []
            for i, prompt in enumerate(prompts):
                for seed in range(args.seeds):
                    mx.random.seed(seed)
                    sampler = make_sampler(
                        kwargs["temperature"], kwargs.get("top_p", 0.0)
                    )
                    theirs = [
                        r.token
                        for r in mlx_lm_stream_generate(
                            model,
                            tokenizer,
                            prompt,
                            max_tokens=args.max_tokens,
                            sampler=sampler,
                        )
                    ]
                    ours = [
                        r.token
                        for r in stream_generate(
                            model,
                            tokenizer,
                            drafter,
                            prompt,
                            max_tokens=args.max_tokens,
                            seed=seed,
                            **kwargs,
                            **policy,
                        )
                    ]
                    if ours == theirs:
                        same += 1
                        continue
                    first = next(
                        (
                            k
                            for k, (a, b) in enumerate(zip(ours, theirs, strict=False))
                            if a != b
                        ),
                        min(len(ours), len(theirs)),
                    )
                    diverged.append(f"prompt {i} seed {seed} at token {first}")
            label = "default policy" if not policy else "7 drafts"
            total = len(prompts) * args.seeds
            print(f"{name}, {label}: {same}/{total} identical", flush=True)
            for line in diverged:
                print(f"  differs: {line}")


if __name__ == "__main__":
    main()
