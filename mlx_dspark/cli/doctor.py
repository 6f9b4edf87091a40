"""``mlx_dspark doctor``: backend, versions, memory, matmul speed, bandwidth, BLAS."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..doctor import diagnose
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


def doctor(
    as_json: bool = typer.Option(
        False, "--json", help="Print machine-readable JSON.", metavar=""
    ),
) -> None:
    """Report the backend, memory, matmul speed, bandwidth and BLAS."""
    report = diagnose()
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        render(report, Console())


def main(argv: list[str] | None = None, prog: str = "mlx_dspark.doctor") -> None:
    run_command(doctor, argv, prog)


if __name__ == "__main__":
    main()
