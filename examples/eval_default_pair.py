"""Measure the built-in default pair on held-out text (one run).

    python examples/eval_default_pair.py --max-tokens 96
    python examples/eval_default_pair.py --pair gemma3-270m --max-tokens 96

Held-out sets: chat-like questions (chat template), CPython standard-library
modules excluded from training (``crc32(relative path) % 10 == 0``: code
continuation) and docstrings of those modules (prose continuation). Reports
the mean accepted length (tokens per round, accepted drafts + 1) at T=0 and
T=1 with 7 drafts per round (T=1 pooled over ``--seeds`` sets of seeds: one
set's figure moves by about 0.1 from set to set), and per set the tok/s of
the pair with no DSpark arguments (the default policy) vs the target alone
(mlx-lm), interleaved prompt by prompt in the same process: greedy, or
sampled at ``--temp`` (prompt i with seed i on both sides). ``--pair`` names
another built-in pair; a base model (no chat template) has no chat set.
"""

from __future__ import annotations

import argparse
import ast
import sysconfig
import time
import zlib
from pathlib import Path

# isort: off
import mlx_dspark  # first: it loads a system OpenBLAS before mlx.core

# isort: on
import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate
from mlx_lm.sample_utils import make_sampler

from mlx_dspark import stream_generate
from mlx_dspark.errors import DSparkError
from mlx_dspark.pairs.default import default_pair

CHAT = [
    "What are three tips for getting better sleep?",
    "Explain what a black hole is in simple terms.",
    "Write a short poem about autumn leaves.",
    "How do I make a cup of green tea?",
]
EVALUATED_MODULES = 32
SKIP = ("test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages")


def held_out_modules() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not any(part in SKIP for part in p.parts)
    )
    return [p for p in files if zlib.crc32(str(p.relative_to(root)).encode()) % 10 == 0]


def held_out_sets(tokenizer, count: int, prefix_tokens: int) -> dict[str, list]:
    chat = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True
        )
        for q in CHAT[:count]
        if tokenizer.has_chat_template
    ]
    code, prose = [], []
    start = tokenizer.encode("")  # Gemma's <bos>; nothing for SmolLM2
    # The modules from EVALUATED_MODULES on are the recipe's validation text.
    for path in held_out_modules()[:EVALUATED_MODULES]:
        text = path.read_text(encoding="utf-8", errors="replace")
        tokens = tokenizer.encode(text)
        if len(tokens) > 4 * prefix_tokens and len(code) < count:
            middle = len(tokens) // 3
            code.append(start + tokens[middle : middle + prefix_tokens])
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if len(prose) >= count:
                break
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 600:
                    prose.append(tokenizer.encode(doc[:300]))
                    break
    sets = {"chat": chat, "code": code, "prose": prose}
    return {name: prompts for name, prompts in sets.items() if prompts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per set")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prefix-tokens", type=int, default=64)
    parser.add_argument(
        "--pair", default=None, help="a built-in pair (default: smollm2-135m)"
    )
    parser.add_argument(
        "--draft-model", default=None, help="another drafter for the pair's target"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="another SmolLM2-135M-Instruct target, e.g. mlx_lm.convert -q of it",
    )
    parser.add_argument(
        "--acceptance",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="mean accepted length with 7 drafts a round, T=0 and T=1",
    )
    parser.add_argument(
        "--speed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="time the pair with no DSpark arguments against the target alone",
    )
    parser.add_argument(
        "--greedy-check",
        action="store_true",
        help="also check that greedy output (7 drafts a round, and the default "
        "policy) is mlx-lm's, token for token, on every prompt",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=3,
        help="seed sets the T=1 acceptance pools (set s samples prompt i with "
        "seed s * prompts + i)",
    )
    parser.add_argument(
        "--temp",
        type=float,
        default=0.0,
        help="sampling temperature of the timed runs (default greedy)",
    )
    args = parser.parse_args()
    if args.temp < 0:
        parser.error("--temp must be >= 0.")
    if args.seeds < 1:
        parser.error("--seeds must be at least 1.")
    try:
        if args.model is None:
            model, tokenizer, drafter = mlx_dspark.load(pair=args.pair)
        else:
            model, tokenizer, drafter = mlx_dspark.load(
                args.model, draft_model=default_pair()[1]
            )
    except DSparkError as error:
        parser.error(str(error))
    if args.draft_model is not None:
        try:
            drafter = mlx_dspark.load_drafter(args.draft_model, model)
        except DSparkError as error:
            parser.error(str(error))
    sets = held_out_sets(tokenizer, args.prompts, args.prefix_tokens)
    print(f"prompts: {', '.join(f'{k} {len(v)}' for k, v in sets.items())}")
    # warm up both paths (the default policy measures this machine once)
    first = next(iter(sets.values()))[0]
    list(stream_generate(model, tokenizer, drafter, first, max_tokens=8))
    list(mlx_lm_stream_generate(model, tokenizer, first, max_tokens=8))
    if args.acceptance:
        for temp in (0.0, 1.0):
            for name, prompts in sets.items():
                accepted = acceptance(model, tokenizer, drafter, prompts, temp, args)
                print(
                    f"T={temp:g} {name:5s}: mean accepted length "
                    f"{np.mean(accepted) + 1:.2f} ({len(accepted)} rounds)"
                )
    if args.greedy_check:
        for name, prompts in sets.items():
            same = greedy_identical(model, tokenizer, drafter, prompts, args.max_tokens)
            print(f"greedy {name:5s}: identical to mlx-lm on {same}/{2 * len(prompts)}")
    if args.speed:
        for name, prompts in sets.items():
            pair, alone, same = speed(
                model, tokenizer, drafter, prompts, args.max_tokens, args.temp
            )
            print(
                f"T={args.temp:g} {name:5s}: tok/s (incl. prefill) target alone "
                f"{alone:.1f}, pair with no flags {pair:.1f}, ratio {pair / alone:.2f}"
                f"; output identical to mlx-lm's on {same}/{len(prompts)} prompts"
            )


def acceptance(model, tokenizer, drafter, prompts, temp, args) -> list[int]:
    """Accepted drafts of every round, 7 drafts a round; sampled, over
    ``args.seeds`` sets of seeds (greedy rounds do not depend on the seed)."""
    sets = args.seeds if temp > 0 else 1
    accepted = []
    for seed in range(sets * len(prompts)):
        prompt = prompts[seed % len(prompts)]
        responses = list(
            stream_generate(
                model,
                tokenizer,
                drafter,
                prompt,
                max_tokens=args.max_tokens,
                temperature=temp,
                seed=seed,
                num_draft=7,
                scheduler="off",
            )
        )
        accepted += [r.accepted for r in responses[-1].stats.rounds]
    return accepted


def greedy_identical(model, tokenizer, drafter, prompts, max_tokens: int) -> int:
    """How many of the prompts x (7 drafts a round, the default policy) give
    mlx-lm's greedy tokens exactly (up to and including an end token)."""
    eos = set(tokenizer.eos_token_ids)
    same = 0
    for prompt in prompts:
        steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens)
        ref = [int(token) for token, _ in steps]
        cut = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
        for num_draft in (7, None):
            got = stream_generate(
                model, tokenizer, drafter, prompt, max_tokens=max_tokens,
                num_draft=num_draft,
            )  # fmt: skip
            same += [r.token for r in got] == ref[:cut]
    return same


def speed(
    model, tokenizer, drafter, prompts, max_tokens: int, temp: float = 0.0
) -> tuple[float, float, int]:
    """tok/s of the pair with no DSpark arguments and of mlx-lm alone, prompt
    by prompt, interleaved (prompt i samples with seed i on both sides), and
    on how many prompts the two outputs are the same tokens."""
    pair_tokens = pair_time = base_tokens = base_time = 0.0
    same = 0
    for seed, prompt in enumerate(prompts):
        tic = time.perf_counter()
        ours = [
            r.token
            for r in stream_generate(
                model,
                tokenizer,
                drafter,
                prompt,
                max_tokens=max_tokens,
                temperature=temp,
                seed=seed,
            )
        ]
        pair_time += time.perf_counter() - tic
        mx.random.seed(seed)
        tic = time.perf_counter()
        theirs = [
            r.token
            for r in mlx_lm_stream_generate(
                model,
                tokenizer,
                prompt,
                max_tokens=max_tokens,
                sampler=make_sampler(temp),
            )
        ]
        base_time += time.perf_counter() - tic
        pair_tokens += len(ours)
        base_tokens += len(theirs)
        same += ours == theirs
    return pair_tokens / pair_time, base_tokens / base_time, same


if __name__ == "__main__":
    main()
