"""Size and accepted length of 2-8 bit drafts against the float draft.

Builds a structured pair, converts its drafter with ``mlx_dspark.convert`` at
every bit width, and decodes greedily with each: reports the size on disk, the
mean accepted length (tokens committed per round) relative to the float draft,
and whether the output is identical to target-only greedy decoding.

    python examples/quantized_drafts.py [--group-size 64] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
import mlx.core as mx
from mlx_dspark.convert.drafter import convert_drafter
from mlx_lm.generate import generate_step

from mlx_dspark import stream_generate
from mlx_dspark.checkpoints.loading import load_drafter
from mlx_dspark.loading import load
from mlx_dspark.pairs.structured import PairSpec, build_structured_pair

PROMPTS = [[1, 2, 3], [7, 8], [20, 4, 11, 9], [0], [13, 5, 5, 21, 2, 17], [25, 3]]


def weights_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--head", default="vanilla")
    parser.add_argument("--seeds", type=int, default=4, help="sampled runs (T=1)")
    parser.add_argument("--perturbation", type=float, default=PairSpec.perturbation)
    parser.add_argument(
        "--default-dims",
        action="store_true",
        help="PairSpec's default dimensions (rank 31: the Markov head stays float)",
    )
    args = parser.parse_args()
    # Quantization-friendly dimensions: every quantized matrix's input axis is
    # a multiple of 128, and the Markov rank is padded to 128.
    dims = dict(hidden_size=128, head_dim=32, intermediate_size=256, markov_rank=128)
    spec = PairSpec(
        **({} if args.default_dims else dims),
        markov_head_type=args.head,
        perturbation=args.perturbation,
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        target_dir, drafter_dir = build_structured_pair(tmp / "pair", spec, mx.bfloat16)
        model, tokenizer, _ = load(target_dir)
        expected = [
            [
                int(t)
                for t, _ in generate_step(
                    mx.array(p), model, max_tokens=args.max_tokens
                )
            ]
            for p in PROMPTS
        ]
        rows = []
        for bits in (None, 2, 3, 4, 6, 8):
            out = tmp / f"draft-{bits or 'float'}"
            convert_drafter(
                drafter_dir,
                out,
                quantize=bits is not None,
                bits=bits,
                group_size=args.group_size if bits else None,
                target=target_dir,
            )
            drafter = load_drafter(out, model)
            rounds, identical = [], True
            for prompt, want in zip(PROMPTS, expected, strict=True):
                responses = list(
                    stream_generate(
                        model, tokenizer, drafter, prompt, max_tokens=args.max_tokens
                    )
                )
                identical &= [r.token for r in responses] == want
                rounds += responses[-1].stats.rounds
            tau = sum(r.accepted + 1 for r in rounds) / len(rounds)
            sampled = []
            for seed in range(args.seeds):
                for prompt in PROMPTS:
                    responses = list(
                        stream_generate(
                            model,
                            tokenizer,
                            drafter,
                            prompt,
                            max_tokens=args.max_tokens,
                            temperature=1.0,
                            seed=seed,
                        )
                    )
                    sampled += responses[-1].stats.rounds
            tau_t1 = sum(r.accepted + 1 for r in sampled) / max(len(sampled), 1)
            rows.append((bits, weights_bytes(out), tau, tau_t1, identical))
        _, float_size, float_tau, float_t1, _ = rows[0]
        print(
            f"{spec}\ngroup_size={args.group_size} prompts={len(PROMPTS)} "
            f"max_tokens={args.max_tokens}"
        )
        print(
            f"{'draft':>6} {'bytes':>8} {'size':>6} {'tau_T0':>7} {'ratio':>6} "
            f"{'tau_T1':>7} {'ratio':>6} greedy==target"
        )
        for bits, size, tau, tau_t1, identical in rows:
            name = f"{bits}-bit" if bits else "float"
            print(
                f"{name:>6} {size:>8} {size / float_size:6.3f} {tau:7.3f} "
                f"{tau / float_tau:6.3f} {tau_t1:7.3f} {tau_t1 / float_t1:6.3f} "
                f"{identical}"
            )


if __name__ == "__main__":
    main()
