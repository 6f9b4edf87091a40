"""Where a seeded generation leaves mlx-lm's seeded output, and why.

``benchmark --compare`` marks a sampled row lossless when its output equals
``mlx_lm.generate --seed S`` token for token. When a row says no, run this
with the same target, drafter, prompt set and seed::

    python examples/seeded_divergence.py --model T --draft-model D --prompts code

For each prompt it generates with mlx-lm (seeded, temperature ``--temp``)
and with DSpark at ``--num-draft`` fixed drafts a round, and at the first
token where they differ prints:

- the probability of each of the two tokens under mlx-lm's own row;
- the largest logit difference between that row (one-token steps) and the
  target's forward over the whole prefix at once (a batched row, as
  verification computes it);
- the token mlx-lm's sampler draws from each row with that token's key;
- how many of 40 draws with that key change when the logits move by 1e-6.

Two rows a few 1e-5 apart that draw different tokens are a floating-point
near-tie (README, "Seeds"), not a verification error.
"""

from __future__ import annotations

import argparse

# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
import mlx.core as mx
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate
from mlx_lm.sample_utils import make_sampler

from mlx_dspark import load, stream_generate
from mlx_dspark.benchmark.prompts import encode_prompt, load_prompts
from mlx_dspark.policy.settings import build_settings
from mlx_dspark.sampling.coupled import TokenKeys, mlx_lm_token
from mlx_dspark.sampling.processing import SamplingParams


def first_difference(a: list[int], b: list[int]) -> int | None:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), None)


def explain(model, prompt: list[int], reference, index: int, seed: int, temp: float):
    """The near-tie report at token ``index`` of mlx-lm's ``reference``."""
    params = SamplingParams(temperature=temp)
    key = TokenKeys.from_seed(seed, params).peek(index + 1)[index]
    step_row = reference[index].logprobs.astype(mx.float32)
    prefix = prompt + [r.token for r in reference[:index]]
    logits = model(mx.array(prefix)[None])[0, -1].astype(mx.float32)
    batched_row = logits - mx.logsumexp(logits)
    gap = mx.abs(step_row - batched_row).max().item()
    drawn = [mlx_lm_token(row, params, key).item() for row in (step_row, batched_row)]
    moved = sum(
        mlx_lm_token(step_row + 1e-6 * mx.random.normal(step_row.shape, key=k), params, key).item()
        != drawn[0]
        for k in mx.random.split(mx.random.key(seed), 40)
    )  # fmt: skip
    return gap, drawn, moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="target model")
    parser.add_argument("--draft-model", required=True, help="drafter")
    parser.add_argument("--prompts", default="chat", help="chat, code, math or a file")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temp", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-draft", type=int, default=7)
    args = parser.parse_args()
    if args.temp <= 0:
        raise SystemExit("--temp must be above 0: greedy output has no seed.")
    model, tokenizer, drafter = load(args.model, draft_model=args.draft_model)
    settings = build_settings(
        drafter.block_size, num_draft=min(args.num_draft, drafter.block_size),
        confidence_threshold=0.0, scheduler="off",
    )  # fmt: skip
    _, texts = load_prompts(args.prompts)
    for n, text in enumerate(texts, 1):
        prompt = encode_prompt(tokenizer, text, model.args.vocab_size, True)
        mx.random.seed(args.seed)
        reference = list(
            mlx_lm_stream_generate(
                model, tokenizer, mx.array(prompt), max_tokens=args.max_tokens,
                sampler=make_sampler(args.temp),
            )
        )  # fmt: skip
        ours = [
            r.token
            for r in stream_generate(
                model, tokenizer, drafter, prompt, max_tokens=args.max_tokens,
                temperature=args.temp, seed=args.seed, settings=settings,
            )
        ]  # fmt: skip
        tokens = [r.token for r in reference]
        index = first_difference(tokens, ours)
        if index is None:
            same = "identical" if tokens == ours else "one stops early"
            print(f"prompt {n}: {same} ({len(tokens)} and {len(ours)} tokens)")
            continue
        expected, got = reference[index].token, ours[index]
        gap, drawn, moved = explain(
            model, prompt, reference, index, args.seed, args.temp
        )
        probs = mx.exp(reference[index].logprobs.astype(mx.float32))
        print(
            f"prompt {n}: token {index + 1} differs: mlx-lm {expected} "
            f"(p={probs[expected].item():.2g}), DSpark {got} (p={probs[got].item():.2g}); "
            f"rows differ by at most {gap:.2g}; the key draws {drawn[0]} from mlx-lm's "
            f"row and {drawn[1]} from a batched row; 1e-6 of noise changes "
            f"{moved}/40 draws"
        )


if __name__ == "__main__":
    main()
