"""``mlx_dspark calibrate``: calibrate a drafter's confidence head for a pair.

The work is in :mod:`mlx_dspark.policy.calibrate`; this module parses the flags and
renders the result and the progress.
"""

from __future__ import annotations

import math
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..errors import DSparkError
from ..loading import load
from ..policy.calibrate import calibrate_pair
from ..policy.calibration import CalibrationResult
from ..sampling.processing import SamplingParams
from .terminal import progress_bar, run_command


def render_result(result: CalibrationResult, console: Console) -> None:
    def fmt(value: float) -> str:
        return "-" if value is None or not math.isfinite(value) else f"{value:.3f}"

    extended, copies = bool(result.top_weights), bool(result.copy_weights)
    kind = "STS + offset + top log-prob" if extended else "STS"
    kind += " + copy" if copies else ""
    table = Table(title=f"{kind} calibration ({result.n_rounds} held-out rounds)")
    columns = ["pos", "T", *(["w top", "offset"] if extended else [])]
    for name in (*columns, "ECE raw", "ECE cal", "AUC raw", "AUC cal"):
        table.add_column(name, justify="right")
    for k, temp in enumerate(result.temperatures):
        extra = [result.top_weights[k], result.offsets[k]] if extended else []
        table.add_row(
            str(k + 1),
            *map(fmt, [temp, *extra]),
            fmt(result.ece_before[k]),
            fmt(result.ece_after[k]),
            fmt(result.auc_before[k]),
            fmt(result.auc_after[k]),
        )
    console.print(table)
    if not copies:
        return
    table = Table(title="Copied drafts add")
    for name in ("pos", "offset", "w z", "w top"):
        table.add_column(name, justify="right")
    slopes = [result.copy_logit_weights, result.copy_top_weights]
    for k, weight in enumerate(result.copy_weights):
        own = [w[k] if k < len(w) else math.nan for w in slopes]
        table.add_row(str(k + 1), *map(fmt, [weight, *own]))
    console.print(table)


def calibrate(
    model: str = typer.Option(..., "--model", help="Target model path or repo."),
    draft_model: str = typer.Option(
        ..., "--draft-model", help="DSpark drafter path or repo."
    ),
    prompts: Path | None = typer.Option(
        None,
        "--prompts",
        help="Text file with one prompt per line (default: built-in chat/code/math set).",
    ),
    rounds: int = typer.Option(
        300, "--rounds", help="Speculative rounds to record, spread over the prompts."
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Output JSON (default: beside the drafter, else the user cache).",
    ),
    max_tokens: int = typer.Option(
        128, "--max-tokens", help="Tokens generated per prompt."
    ),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature."),
    seed: int = typer.Option(0, "--seed", help="Random seed."),
    plot: bool = typer.Option(
        True, "--plot/--no-plot", help="Write a reliability diagram PNG.", metavar=""
    ),
) -> None:
    """Calibrate a pair's confidence head (STS, offset, top log-probability)."""
    if rounds < 1:
        raise DSparkError(f"--rounds must be at least 1, got {rounds}.")
    if max_tokens < 2:
        raise DSparkError(
            f"--max-tokens must be at least 2 (a round needs a token to verify), "
            f"got {max_tokens}."
        )
    if temp < 0:
        raise DSparkError(f"--temp must be >= 0, got {temp}.")
    texts = None
    if prompts is not None:
        try:
            texts = [
                line.replace("\\n", "\n")
                for line in prompts.read_text().splitlines()
                if line.strip()
            ]
        except (OSError, UnicodeDecodeError):
            raise DSparkError(f"Cannot read the prompts file {prompts}.") from None
        if not texts:
            raise DSparkError(f"The prompts file {prompts} has no prompts.")
    target, tokenizer, drafter = load(model, draft_model)
    console = Console(stderr=True)
    with progress_bar("Speculative rounds") as progress:
        result, path, png = calibrate_pair(
            target,
            tokenizer,
            drafter,
            prompts=texts,
            rounds=rounds,
            params=SamplingParams(temperature=temp),
            max_tokens=max_tokens,
            seed=seed,
            out=out,
            plot=plot,
            progress=progress,
        )
    render_result(result, Console())
    console.print(f"Calibration written to {path}")
    if png is not None:
        console.print(f"Reliability diagram written to {png}")
    elif plot:
        console.print("No reliability diagram: install matplotlib to get one.")


def main(argv: list[str] | None = None, prog: str = "mlx_dspark.calibrate") -> None:
    run_command(calibrate, argv, prog)


if __name__ == "__main__":
    main()
