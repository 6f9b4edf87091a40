"""Suffix drafts against the target alone, greedy, interleaved in one process.

    python examples/suffix_vs_target.py [--model DIR] [--max-tokens 200] [--repeats 3]

Without --model it uses the default pair's target (SmolLM2-135M-Instruct, float32,
converted into the user cache on first use). Two prompts: re-emitting a short Python
file from the standard library with one change, and a chat question. For each it
prints mlx-lm's tokens/s, ours with ``suffix=True`` (chain and a 6-node tree), the
ratio, whether the tokens were identical, and the suffix rounds' acceptance. Report
the BLAS it printed (``mlx_dspark.doctor``): OpenBLAS for both, on a quiet machine.
"""

from __future__ import annotations

# isort: off
import mlx_dspark  # first: it loads a system OpenBLAS before mlx.core

# isort: on
import argparse
import inspect
import statistics
import textwrap
import time

import mlx.core as mx
from mlx_lm.generate import generate_step

from mlx_dspark.generation import suffix_stats
from mlx_dspark.loading import load


def prompts(tokenizer) -> dict[str, list[int]]:
    source = textwrap.dedent(inspect.getsource(textwrap.indent))
    edit = (
        "Here is a Python function:\n\n" + source + "\nRewrite it with the "
        "parameter `prefix` renamed to `margin`. Reply with the whole function."
    )
    chat = "Write a short story about a lighthouse keeper who finds a message."
    return {
        name: tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        for name, text in (("re-emit a file", edit), ("chat", chat))
    }


def target_alone(model, prompt, max_tokens) -> tuple[list[int], float]:
    tic = time.perf_counter()
    tokens = [
        int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens)
    ]
    return tokens, len(tokens) / (time.perf_counter() - tic)


def suffix(model, tokenizer, prompt, max_tokens, tree_budget):
    tic = time.perf_counter()
    responses = list(
        mlx_dspark.stream_generate(
            model,
            tokenizer,
            None,
            prompt,
            max_tokens=max_tokens,
            suffix=True,
            tree_budget=tree_budget,
        )
    )
    seconds = time.perf_counter() - tic
    return [r.token for r in responses], len(responses) / seconds, responses[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if args.model is None:
        from mlx_dspark.pairs.default import target_dir

        args.model = target_dir()
    model, tokenizer, _ = load(args.model)
    eos = set(tokenizer.eos_token_ids)
    for name, prompt in prompts(tokenizer).items():
        rates = {"mlx-lm": [], "suffix chain": [], "suffix tree 6": []}
        same, lines = True, {}
        for _ in range(args.repeats):  # interleaved
            expected, rate = target_alone(model, prompt, args.max_tokens)
            rates["mlx-lm"].append(rate)
            end = next((i + 1 for i, t in enumerate(expected) if t in eos), None)
            for label, budget in (("suffix chain", 0), ("suffix tree 6", 6)):
                got, rate, last = suffix(
                    model, tokenizer, prompt, args.max_tokens, budget
                )
                rates[label].append(rate)
                same &= got == expected[:end]
                lines[label] = suffix_stats(last.stats)
        base = statistics.median(rates["mlx-lm"])
        print(f"{name} ({len(prompt)} prompt tokens), identical tokens: {same}")
        for label, values in rates.items():
            rate = statistics.median(values)
            print(f"  {label:14s} {rate:6.1f} tok/s  {rate / base:.2f}x")
            if label in lines:
                print(f"    {lines[label]}")


if __name__ == "__main__":
    main()
