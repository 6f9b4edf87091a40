"""``mlx_dspark doctor``: backend, versions, memory, matmul speed, bandwidth, BLAS."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..machine import diagnose
from ..targets.support import Support, target_support
from .terminal import run_command


def _gib(nbytes: int | None) -> str:
    return "?" if nbytes is None else f"{nbytes / 2**30:.1f} GiB"


def render(report: dict, console: Console) -> None:
    blas = report["blas"]
    memory = f"{_gib(report['memory_total'])} total"
    if report["memory_available"] is not None:
        memory += f", {_gib(report['memory_available'])} available"
    blas_line = blas["kind"]
    if blas["library"]:
        blas_line += (
            f" ({Path(blas['library']).parent.name}/{Path(blas['library']).name})"
        )
    if report["backend"] != "cpu" and blas["gflops"] is not None:
        blas_line += f", CPU matmul {blas['gflops']:.1f} GFLOP/s"

    table = Table(title="mlx-dspark doctor", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows = [
        ("Backend", report["backend"]),
        ("Device", f"{report['device']} ({report['architecture']})"),
        ("MLX", report["mlx"]),
        ("mlx-lm", report["mlx_lm"] or "not installed"),
        ("Python", f"{report['python']} on {report['platform']}"),
        ("CPUs", str(report["cpu_count"])),
        ("Memory", memory),
        ("Matmul (float32)", f"{report['matmul_gflops']:.1f} GFLOP/s"),
        ("Memory bandwidth", f"{report['bandwidth'] / 1e9:.1f} GB/s"),
        ("BLAS (CPU)", blas_line),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    if blas["slow"]:
        console.print(
            f"[bold yellow]warning:[/] MLX's CPU backend is using a slow "
            f"{blas['kind']} BLAS ({blas['gflops']:.1f} GFLOP/s): verifying k "
            "draft tokens costs about k single-token steps, so speculative "
            "decoding cannot win on CPU.",
            highlight=False,
        )
        if blas["fix"]:
            console.print(f"fix: {blas['fix']}", highlight=False, soft_wrap=True)


def render_support(support: Support, console: Console) -> None:
    if not support.supported:
        console.print(
            f"{support.model}: not supported. {support.reason}", highlight=False
        )
        return
    bits = (support.quantization or {}).get("bits")
    weights = f"{bits}-bit" if bits else "float"
    tree = "chain and tree" if support.tree else "chain (no tree)"
    console.print(
        f"{support.model}: supported ({support.model_type}, {weights}); rejected "
        f"drafts roll back by {', '.join(support.rollback)}; verification: {tree}.",
        highlight=False,
    )


def mtp_weights(model: str, support: Support) -> bool | None:
    """Whether the checkpoint carries an MTP module (None: not an MTP
    family, or not known without downloading weights)."""
    from ..proposers.mtp_config import MTP_MODEL_TYPES

    if support.model_type not in MTP_MODEL_TYPES:
        return None
    from ..checkpoints.mtp import carries_mtp

    return carries_mtp(model)


def mtp_line(model: str, carries: bool) -> str:
    if carries:
        return (
            f"{model}: carries MTP weights; extract a drafter with "
            f"mlx_dspark.convert --mtp {model} --out DIR."
        )
    return (
        f"{model}: carries no MTP weights (mlx-lm conversions drop them); "
        "extract them from the original checkpoint."
    )


def doctor(
    as_json: bool = typer.Option(
        False, "--json", help="Print machine-readable JSON.", metavar=""
    ),
    model: str | None = typer.Option(
        None,
        "--model",
        help="Say whether this model (directory or Hugging Face repo) can be a "
        "target, from its config.json alone; nothing else downloads.",
        metavar="MODEL",
    ),
) -> None:
    """Report the backend, memory, matmul speed, bandwidth and BLAS, or with
    --model whether a model can be a target."""
    if model is not None:
        support = target_support(model)
        mtp = mtp_weights(model, support)
        if as_json:
            print(json.dumps({**asdict(support), "mtp_weights": mtp}, indent=2))
        else:
            render_support(support, Console())
            if mtp is not None:
                print(mtp_line(model, mtp))
        if not support.supported:
            raise typer.Exit(1)
        return
    report = diagnose()
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        render(report, Console())


def main(argv: list[str] | None = None, prog: str = "mlx_dspark.doctor") -> None:
    run_command(doctor, argv, prog)


if __name__ == "__main__":
    main()
