"""``mlx_dspark convert``: turn checkpoints into MLX model directories.

Sources are mutually exclusive options (``--gguf``, ``--draft-model``); each
source has its own handler below. The conversions themselves are in
:mod:`mlx_dspark.convert.gguf` and :mod:`mlx_dspark.convert.drafter`.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import typer

from ..errors import DSparkError
from .terminal import progress_bar, run_command

DRAFTERS = "Drafters (--draft-model)"
_DRAFTER_ONLY = ("target",)


def _choice(flag: str, value, choices: tuple) -> None:
    if value is not None and value not in choices:
        names = ", ".join(map(str, choices))
        raise DSparkError(f"{flag} must be one of {names}, got {value}.")


def convert(
    gguf: str | None = typer.Option(
        None,
        "--gguf",
        metavar="FILE",
        help="GGUF target model (llama, qwen2, qwen3 or gemma3; any tensor type "
        "the gguf package reads).",
    ),
    draft_model: str | None = typer.Option(
        None,
        "--draft-model",
        metavar="PATH|REPO",
        help="DSpark drafter (DeepSpec, speculators 'dspark' or MLX checkpoint) "
        "or EAGLE-3 drafter (DeepSpec, speculators 'eagle3' or MLX) or Gemma-4 "
        "assistant (Hugging Face '*-assistant' or MLX).",
    ),
    mtp: str | None = typer.Option(
        None,
        "--mtp",
        metavar="PATH|REPO",
        help="Original Qwen3-Next / Qwen3.5 / Qwen3.5-MoE checkpoint: write its "
        "multi-token-prediction module as a drafter for any MLX conversion of "
        "it (float, or -q --q-bits 4|8).",
    ),
    out: str | None = typer.Option(
        None, "--out", metavar="DIR", help="Output directory."
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace a non-empty --out directory.", metavar=""
    ),
    dry_run: bool = typer.Option(
        False,
        "--dry-run",
        help="Print what would be converted and written, then stop.",
        metavar="",
    ),
    quantize: bool = typer.Option(
        False,
        "-q",
        "--quantize",
        help="Write MLX affine-quantized weights. A GGUF's Q4_0, Q4_1, Q5_0, "
        "Q5_1, Q8_0, Q4_K and Q5_K blocks are MLX affine groups of 32 exactly "
        "and are kept as they are, at their 4, 5 or 8 bits, unless --q-bits asks "
        "for more; other tensors are requantized at --q-bits (Q6_K at 6 bits at "
        "least).",
        metavar="",
    ),
    q_bits: int | None = typer.Option(
        None,
        "--q-bits",
        metavar="BITS",
        help="Bits per weight with -q: 2, 3, 4, 6 or 8 (default 4).",
    ),
    q_group_size: int | None = typer.Option(
        None,
        "--q-group-size",
        metavar="SIZE",
        help="Quantization group size with -q: 32, 64 or 128 (default 64; 32 "
        "for GGUF, its own block size).",
    ),
    target: str | None = typer.Option(
        None,
        "--target",
        metavar="PATH|REPO",
        help="The target model: leave out the drafter's copies of its embedding "
        "and LM head, or supply them with --to deepspec.",
        rich_help_panel=DRAFTERS,
    ),
    to: str = typer.Option(
        "mlx",
        "--to",
        metavar="FORMAT",
        help="Output format: mlx, deepspec or speculators; deepspec and "
        "speculators (vLLM, SGLang) write float checkpoints, and only speculators "
        "holds a reduced draft vocabulary.",
        rich_help_panel=DRAFTERS,
    ),
    dtype: str | None = typer.Option(
        None,
        "--dtype",
        metavar="DTYPE",
        help="dtype of float outputs: float16, bfloat16 or float32 (default "
        "float16 for GGUF targets); float32 runs fastest on CPU.",
    ),
) -> None:
    """Convert checkpoints into MLX model directories."""
    if [gguf, draft_model, mtp].count(None) != 2:
        raise DSparkError("Give one of --gguf, --draft-model and --mtp.")
    _choice("--q-bits", q_bits, (2, 3, 4, 6, 8))
    _choice("--q-group-size", q_group_size, (32, 64, 128))
    _choice("--to", to, ("mlx", "deepspec", "speculators"))
    _choice("--dtype", dtype, ("float16", "bfloat16", "float32"))
    args = SimpleNamespace(**locals())
    if args.mtp is not None:
        convert_mtp_cli(args)
    elif args.gguf is not None:
        used = [f"--{k.replace('_', '-')}" for k in _DRAFTER_ONLY if getattr(args, k)]
        if used or args.to != "mlx":
            raise DSparkError(f"{(used or ['--to'])[0]} applies to --draft-model only.")
        convert_gguf_cli(args)
    else:
        convert_drafter_cli(args)


def convert_gguf_cli(args: SimpleNamespace) -> None:
    from ..convert.gguf import convert_gguf, describe_plan, plan_conversion

    if not args.quantize and (args.q_bits or args.q_group_size):
        raise DSparkError("--q-bits and --q-group-size need -q.")
    options = dict(
        dtype=args.dtype or "float16",
        bits=(args.q_bits or 4) if args.quantize else None,
        group_size=args.q_group_size or 32,
    )
    if args.dry_run:
        print(describe_plan(plan_conversion(args.gguf, **options)))
        return
    if not args.out:
        raise DSparkError("--out is required unless --dry-run is given.")
    with progress_bar("converting tensors") as advance:
        plan = convert_gguf(
            args.gguf,
            args.out,
            force=args.force,
            on_tensor=advance,
            **options,
        )
    print(
        f"wrote {args.out} ({len(plan.tensors)} tensors, "
        f"{plan.total_bytes / 2**20:.1f} MiB)"
    )


def convert_drafter_cli(args: SimpleNamespace) -> None:
    from ..checkpoints.eagle3 import is_eagle3_path
    from ..checkpoints.gemma4_assistant import is_assistant_path
    from ..convert.drafter import convert_drafter, describe_plan, plan_drafter

    if is_assistant_path(args.draft_model):
        convert_assistant_cli(args)
        return
    if is_eagle3_path(args.draft_model):
        convert_eagle3_cli(args)
        return
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


def convert_eagle3_cli(args: SimpleNamespace) -> None:
    from ..convert.eagle3 import convert_eagle3

    result = _convert_to_mlx(args, convert_eagle3, "EAGLE-3 drafters")
    _report(args.out, f"MLX EAGLE-3 drafter, {result.config.flavour}", result.bits)


def convert_assistant_cli(args: SimpleNamespace) -> None:
    from ..convert.gemma4_assistant import convert_assistant

    result = _convert_to_mlx(args, convert_assistant, "Gemma-4 assistant drafters")
    _report(args.out, "MLX Gemma-4 assistant drafter", result.bits)


def _convert_to_mlx(args: SimpleNamespace, convert, kind: str):
    """A drafter kind that converts to MLX only, float or quantized."""
    if args.target or args.to != "mlx" or args.dry_run:
        flag = (
            "--target" if args.target else "--to" if args.to != "mlx" else "--dry-run"
        )
        raise DSparkError(f"{flag} does not apply to {kind}.")
    if not args.out:
        raise DSparkError("--out is required.")
    if not args.quantize and (args.q_bits or args.q_group_size):
        raise DSparkError("--q-bits and --q-group-size need -q.")
    return convert(
        args.draft_model,
        args.out,
        quantize=args.quantize,
        bits=args.q_bits,
        group_size=args.q_group_size,
        dtype=args.dtype,
        force=args.force,
    )


def _report(out: str, what: str, bits: int | None) -> None:
    kind = f"{bits}-bit" if bits else "float"
    written = sum(f.stat().st_size for f in Path(out).glob("*.safetensors"))
    print(f"wrote {out} ({kind} {what}): {written / 2**20:.1f} MiB of weights")


def convert_mtp_cli(args: SimpleNamespace) -> None:
    from ..convert.mtp import extract_mtp

    if args.target or args.to != "mlx" or args.dry_run:
        flag = (
            "--target" if args.target else "--to" if args.to != "mlx" else "--dry-run"
        )
        raise DSparkError(f"{flag} does not apply to --mtp.")
    if not args.out:
        raise DSparkError("--out is required.")
    if not args.quantize and (args.q_bits or args.q_group_size):
        raise DSparkError("--q-bits and --q-group-size need -q.")
    bits = (args.q_bits or 4) if args.quantize else None
    if bits not in (None, 4, 8):
        raise DSparkError("--mtp writes 4-bit or 8-bit drafters with -q.")
    result = extract_mtp(
        args.mtp,
        args.out,
        bits=bits,
        group_size=args.q_group_size or 64,
        dtype=args.dtype,
        force=args.force,
    )
    kind = f"{bits}-bit" if bits else "float"
    written = sum(f.stat().st_size for f in Path(args.out).glob("*.safetensors"))
    print(
        f"wrote {args.out} ({kind} MTP drafter for "
        f"{result.config.target_model_type}): {written / 2**20:.2f} MiB of weights"
    )


def main(argv: list[str] | None = None, prog: str = "mlx_dspark.convert") -> None:
    run_command(convert, argv, prog)


if __name__ == "__main__":
    main()
