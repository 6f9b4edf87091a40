"""Plain DSpark rounds (0 drafts) against mlx-lm's ``generate_step``, interleaved.

    python examples/plain_rounds_vs_mlx_lm.py [TOKENS] [REPEATS]

Runs the built-in default pair's target alone through mlx-lm and through the
DSpark loop with a draft cap of 0 (what the default policy does when drafting
does not pay), alternating, and prints the decode tok/s of both and the median
ratio. Only the ratio means much on a shared machine.
"""

# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

from mlx_dspark.decoding.loop import ThresholdPolicy, speculative_generate_step
from mlx_dspark.loading import load
from mlx_dspark.pairs.default import default_pair
from mlx_dspark.proposers.copying import pair_proposer
from mlx_dspark.targets.adapter import TargetAdapter


def decode_rate(steps, tokens: int) -> float:
    first, n = None, 0
    for token, _ in steps:
        int(token)
        if first is None:
            first = time.perf_counter()
        n += 1
        if n == tokens:
            break
    return (n - 1) / (time.perf_counter() - first)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tokens", type=int, nargs="?", default=48)
    parser.add_argument("repeats", type=int, nargs="?", default=5)
    args = parser.parse_args()
    tokens, repeats = args.tokens, args.repeats
    model, tokenizer, drafter = load(*default_pair())
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    prompt = mx.array(
        tokenizer.encode("Write a short story about a lighthouse keeper.")
    )

    def theirs() -> float:
        return decode_rate(generate_step(prompt, model, max_tokens=tokens), tokens)

    def ours() -> float:
        steps = speculative_generate_step(
            prompt,
            target,
            pair_proposer(drafter),
            num_draft=0,
            max_tokens=tokens,
            policy=ThresholdPolicy(),
        )
        return decode_rate(steps, tokens)

    theirs(), ours()  # warm up
    ratios = []
    for _ in range(repeats):
        a, b = theirs(), ours()
        ratios.append(b / a)
        print(
            f"mlx-lm {a:.2f} tok/s, DSpark plain rounds {b:.2f} tok/s, ratio {b / a:.3f}"
        )
    print(f"median ratio {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
