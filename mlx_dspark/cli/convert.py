"""``mlx_dspark convert``: turn checkpoints into MLX model directories.

Sources are mutually exclusive options (``--gguf``, ``--draft-model``); each
source has its own handler below. The conversions themselves are in
:mod:`mlx_dspark.convert.gguf` and :mod:`mlx_dspark.convert.drafter`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import DSparkError
from .terminal import ArgumentParser, progress_bar, run_cli


def build_parser(prog: str = "mlx_dspark.convert") -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=prog,
        description="Convert checkpoints into MLX model directories.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--gguf", metavar="FILE", help="llama-architecture GGUF target model"
    )
    source.add_argument(
        "--draft-model",
        metavar="PATH|REPO",
        help="DSpark drafter: DeepSpec, speculators 'dspark' or MLX checkpoint",
    )
    parser.add_argument("--out", metavar="DIR", help="output directory")
    parser.add_argument(
        "--force", action="store_true", help="replace a non-empty --out directory"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would be converted and written, then stop",
    )
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="write quantized GGUF tensors as float16 (faster on CPU)",
    )
    drafter = parser.add_argument_group("drafters (--draft-model)")
    drafter.add_argument(
        "-q", "--quantize", action="store_true", help="quantize the drafter"
    )
    drafter.add_argument(
        "--q-bits",
        type=int,
        choices=[2, 3, 4, 6, 8],
        help="bits per weight with -q (default 4)",
    )
    drafter.add_argument(
        "--q-group-size",
        type=int,
        choices=[32, 64, 128],
        help="quantization group size with -q (default 64)",
    )
    drafter.add_argument(
        "--target",
        metavar="PATH|REPO",
        help="the target model: leave out the drafter's copies of its embedding "
        "and LM head, or supply them with --to deepspec",
    )
    drafter.add_argument(
        "--to",
        choices=["mlx", "deepspec", "speculators"],
        default="mlx",
        help="output format (default mlx); deepspec and speculators (vLLM, SGLang) "
        "write float checkpoints, and only speculators holds a reduced draft vocabulary",
    )
    parser.add_argument(
        "--dtype",
        choices=["float16", "bfloat16", "float32"],
        help="dtype of float outputs (default: float16 for dequantized tensors, "
        "GGUF's own type otherwise); float32 runs fastest on CPU",
    )
    return parser


def convert_gguf_cli(args: argparse.Namespace) -> None:
    from ..convert.gguf import convert_gguf, describe_plan, plan_conversion

    if args.dry_run:
        plan = plan_conversion(args.gguf, dequantize=args.dequantize, dtype=args.dtype)
        print(describe_plan(plan))
        return
    if not args.out:
        raise DSparkError("--out is required unless --dry-run is given.")
    with progress_bar("converting tensors") as advance:
        plan = convert_gguf(
            args.gguf,
            args.out,
            force=args.force,
            dequantize=args.dequantize,
            dtype=args.dtype,
            on_tensor=advance,
        )
    print(
        f"wrote {args.out} ({len(plan.tensors)} tensors, "
        f"{plan.total_bytes / 2**20:.1f} MiB)"
    )


_DRAFTER_ONLY = ("quantize", "q_bits", "q_group_size", "target")


def convert_drafter_cli(args: argparse.Namespace) -> None:
    from ..convert.drafter import convert_drafter, describe_plan, plan_drafter

    if args.dequantize:
        raise DSparkError("--dequantize applies to --gguf only.")
    options = dict(
        quantize=args.quantize,
        bits=args.q_bits,
        group_size=args.q_group_size,
        dtype=args.dtype,
        target=args.target,
        to=args.to,
    )
    if args.dry_run:
        print(describe_plan(plan_drafter(args.draft_model, **options)))
        return
    if not args.out:
        raise DSparkError("--out is required unless --dry-run is given.")
    with progress_bar("converting tensors") as advance:
        plan = convert_drafter(
            args.draft_model, args.out, force=args.force, on_tensor=advance, **options
        )
    kind = f"{plan.bits}-bit MLX drafter" if plan.bits else f"{plan.to} drafter"
    written = sum(f.stat().st_size for f in Path(args.out).glob("*.safetensors"))
    print(
        f"wrote {args.out} ({kind}): {written / 2**20:.1f} MiB of weights "
        f"from {plan.source_bytes / 2**20:.1f} MiB"
    )


def _main(argv: list[str] | None = None, prog: str = "mlx_dspark.convert") -> None:
    args = build_parser(prog).parse_args(argv)
    if args.gguf is not None:
        used = [f"--{k.replace('_', '-')}" for k in _DRAFTER_ONLY if getattr(args, k)]
        if used or args.to != "mlx":
            raise DSparkError(f"{(used or ['--to'])[0]} applies to --draft-model only.")
        convert_gguf_cli(args)
    else:
        convert_drafter_cli(args)


def main(argv: list[str] | None = None, prog: str = "mlx_dspark.convert") -> None:
    run_cli(lambda: _main(argv, prog))


if __name__ == "__main__":
    main()
