"""Measure the built-in default pair on held-out text (one run).

    python examples/eval_default_pair.py --max-tokens 96

Held-out sets: chat-like questions (chat template), CPython standard-library
modules excluded from training (``crc32(relative path) % 10 == 0``: code
continuation) and docstrings of those modules (prose continuation). Reports
the mean accepted length (tokens per round, accepted drafts + 1) at T=0 and
T=1 with 7 drafts per round, and tok/s of the pair vs the target alone
(mlx-lm) at T=0, interleaved prompt by prompt in the same process.
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
import numpy as np
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate
from mlx_lm.sample_utils import make_sampler

from mlx_dspark import stream_generate

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
    ]
    code, prose = [], []
    # The modules from EVALUATED_MODULES on are the recipe's validation text.
    for path in held_out_modules()[:EVALUATED_MODULES]:
        text = path.read_text(encoding="utf-8", errors="replace")
        tokens = tokenizer.encode(text)
        if len(tokens) > 4 * prefix_tokens and len(code) < count:
            middle = len(tokens) // 3
            code.append(tokens[middle : middle + prefix_tokens])
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
    return {"chat": chat, "code": code, "prose": prose}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=4, help="prompts per set")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prefix-tokens", type=int, default=64)
    parser.add_argument(
        "--draft-model", default=None, help="another drafter for SmolLM2 (ablations)"
    )
    parser.add_argument(
        "--speed",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time the pair against SmolLM2 alone",
    )
    args = parser.parse_args()
    model, tokenizer, drafter = mlx_dspark.load()
    if args.draft_model is not None:
        drafter = mlx_dspark.load_drafter(args.draft_model, model)
    sets = held_out_sets(tokenizer, args.prompts, args.prefix_tokens)
    print(f"prompts: {', '.join(f'{k} {len(v)}' for k, v in sets.items())}")
    # warm up both paths
    list(
        stream_generate(
            model, tokenizer, drafter, sets["chat"][0], max_tokens=8, scheduler="off"
        )
    )
    list(mlx_lm_stream_generate(model, tokenizer, sets["chat"][0], max_tokens=8))
    base_tokens = base_time = pair_tokens = pair_time = 0.0
    for temp in (0.0, 1.0):
        for name, prompts in sets.items():
            accepted, rounds = [], 0
            for i, prompt in enumerate(prompts):
                tic = time.perf_counter()
                responses = list(
                    stream_generate(
                        model,
                        tokenizer,
                        drafter,
                        prompt,
                        max_tokens=args.max_tokens,
                        temperature=temp,
                        seed=i,
                        num_draft=7,
                        scheduler="off",
                    )
                )
                elapsed = time.perf_counter() - tic
                stats = responses[-1].stats
                accepted += [r.accepted for r in stats.rounds]
                rounds += len(stats.rounds)
                if temp == 0.0 and args.speed:
                    pair_tokens += len(responses)
                    pair_time += elapsed
                    tic = time.perf_counter()
                    base = list(
                        mlx_lm_stream_generate(
                            model,
                            tokenizer,
                            prompt,
                            max_tokens=args.max_tokens,
                            sampler=make_sampler(0.0),
                        )
                    )
                    base_time += time.perf_counter() - tic
                    base_tokens += len(base)
            print(
                f"T={temp:g} {name:5s}: mean accepted length "
                f"{np.mean(accepted) + 1:.2f} ({rounds} rounds)"
            )
    if not args.speed:
        return
    pair_tps, base_tps = pair_tokens / pair_time, base_tokens / base_time
    print(
        f"T=0 tok/s (incl. prefill): pair {pair_tps:.1f}, SmolLM2 alone "
        f"{base_tps:.1f}, ratio {pair_tps / base_tps:.2f}"
    )


if __name__ == "__main__":
    main()
