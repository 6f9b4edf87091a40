"""``mlx_dspark benchmark``: compare target-only, mlx-lm speculative and DSpark decoding.

Usage::

    mlx_dspark benchmark [--model T --draft-model D] [--prompts chat|code|math|FILE]
        [--max-tokens N] [--trials N] [--modes target,mlx-lm,fixed,threshold,scheduler,tree]
        [--json PATH] [--plot DIR] [--mlx-lm-draft-model M]
    mlx_dspark benchmark --synthetic 0.6b|1.7b|4b [--bits 4|8|16|32] [--accept chat|math]
    mlx_dspark benchmark [pair options] --parity-record trace.json
    mlx_dspark benchmark [pair options] --parity-check trace.json
    mlx_dspark benchmark [pair options] [--fixed-n 1,7] --profile
    mlx_dspark benchmark --model T --compare [NAME=]DRAFTER --compare ... \
        [--compare-n 7] [--temperatures 0,1] [--seed 0]

In one process and on the same prompts it runs target-only decoding (mlx-lm's
own ``stream_generate``), mlx-lm's speculative decoding (with
``--mlx-lm-draft-model``) and DSpark in every mode of :data:`MODES`, trials
interleaved so that machine noise hits every mode alike. Per mode: tok/s
(median, min and max over trials), speedup over target-only, mean accepted
length, acceptance by position, draft and verify time, peak memory, and
whether the greedy output equals target-only's. It also measures the memory
bandwidth and reports the plain-decoding ceiling (bandwidth / bytes read per
target step) and which BLAS the CPU backend used. Without ``--model`` it runs
the built-in default pair (:func:`mlx_dspark.pairs.default.default_pair`).

``--synthetic`` runs a Qwen3-shaped target of real size with structured
weights (see :mod:`mlx_dspark.pairs.synthetic`); all its outputs say "synthetic".

Backend parity (greedy): record a golden trace on one backend, replay it on
another; the check names the first divergence and exits non-zero. On an
NVIDIA machine::

    pip install -e ".[cuda]"     # mlx[cuda]
    mlx_dspark benchmark --parity-record cpu-trace.json           # here (CPU)
    mlx_dspark benchmark --parity-check cpu-trace.json            # there (CUDA)

The trace stores the prompts, the committed tokens, every round's drafts and
accepted count, and per draft position the sum, absolute sum and maximum of
the draft logits (compared with ``--parity-rtol``, default 1e-3).

``--profile`` splits a greedy round into its stages and compares the
adapter's target forward with mlx-lm's (see :mod:`mlx_dspark.policy.roundprofile`).

``--compare`` (repeatable) compares several drafters for one target in one
interleaved run: per temperature (``--temperatures``, seeded sampling),
the target alone and each drafter at ``--compare-n`` drafts a round (no
scheduler, no confidence cut), with mean accepted length, acceptance by
position, speed against the target alone and losslessness (see
:mod:`mlx_dspark.benchmark.compare`). Without ``--model`` the target is the
default pair's.

The measurement is :mod:`mlx_dspark.benchmark`; this module parses the flags,
loads the pair and renders the report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import typer
from rich.console import Console
from rich.table import Table

from ..benchmark.compare import (
    Contender,
    compare_records,
    compare_variants,
    parse_contender,
)
from ..benchmark.measure import machine_report, measure, records
from ..benchmark.modes import (
    MODES,
    Pair,
    Settings,
    make_useless,
    select_variants,
)
from ..benchmark.parity import check_trace, read_trace, record_trace
from ..benchmark.prompts import encode_prompt, load_prompts
from ..benchmark.report import write_json, write_plots
from ..benchmark.schema import SCHEMA_VERSION
from ..errors import DSparkError
from ..pairs.default import default_pair
from ..policy import roundprofile
from ..policy.settings import build_settings
from ..utils import write_atomic
from .terminal import run_command


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


_NARROW_COLUMNS = {
    "mode": "mode",
    "tok/s (min-max)": "tok/s",
    "speedup": "speedup",
    "mean acc. len": "acc. len",
    "lossless": "lossless",
}


def render(report: dict, console: Console) -> None:
    """The records as a table; below 140 columns the table keeps the main
    columns and the rest follows as one line per mode."""
    machine = report["machine"]
    tag = "SYNTHETIC " if report["synthetic"] else ""
    title = f"{tag}mlx-dspark benchmark: {report['pair']['label']}"
    wide = console.width >= 140
    table = Table(title=title)
    columns = [
        ("mode", "left"),
        ("tok/s (min-max)", "right"),
        ("speedup", "right"),
        ("x ceiling", "right"),
        ("mean acc. len", "right"),
        ("acceptance by position", "left"),
        ("draft / verify s", "right"),
        ("peak MB", "right"),
        ("lossless", "center"),
    ]
    shown = [c for c in columns if wide or c[0] in _NARROW_COLUMNS]
    for name, justify in shown:
        table.add_column(name if wide else _NARROW_COLUMNS[name], justify=justify)
    details = []
    for r in report["records"]:
        lossless = {True: "yes", False: "[red]NO[/]", None: "-"}[r["lossless"]]
        times = (
            "-"
            if r["draft_time_s"] is None
            else f"{r['draft_time_s']:.2f} / {r['verify_time_s']:.2f}"
        )
        by_position = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]) or "-"
        cells = {
            "mode": r["mode"],
            "tok/s (min-max)": f"{r['tok_per_s']:.1f}"
            + (f" ({r['tok_per_s_min']:.1f}-{r['tok_per_s_max']:.1f})" if wide else ""),
            "speedup": f"{r['speedup']:.2f}x",
            "x ceiling": _fmt(r["ceiling_fraction"]),
            "mean acc. len": f"{r['mean_accepted_length']:.2f}",
            "acceptance by position": by_position,
            "draft / verify s": times,
            "peak MB": f"{r['peak_memory_gb'] * 1000:.0f}",
            "lossless": lossless,
        }
        table.add_row(*(cells[name] for name, _ in shown))
        if not wide:
            details.append(
                f"{r['mode']}: tok/s {r['tok_per_s_min']:.1f}-{r['tok_per_s_max']:.1f}"
                f"; acceptance by position {by_position}; draft / verify {times} s; "
                f"peak {cells['peak MB']} MB; x ceiling {cells['x ceiling']}"
            )
    console.print(table)
    settings = report["settings"]
    trials = settings["trials"]
    lines = [
        *details,
        f"prompts: {settings['prompts']} ({settings['num_prompts']}), "
        f"max tokens {settings['max_tokens']}, {trials} trial{'s' * (trials != 1)}, "
        "greedy",
        f"backend {machine['backend']}, BLAS {machine['blas']}"
        + (
            f" ({machine['blas_gflops']:.1f} GFLOP/s matmul)"
            if machine["blas_gflops"] is not None
            else ""
        )
        + (" [slow reference BLAS]" if machine.get("blas_slow") else ""),
        f"roofline: {machine['bandwidth_gb_s']:.1f} GB/s measured, "
        f"{machine['target_bytes_per_step'] / 1e6:.1f} MB read per target step, "
        f"plain-decoding ceiling {machine['ceiling_tok_per_s']:.1f} tok/s "
        "(x ceiling: tok/s as a fraction of it)",
    ]
    if report["synthetic"]:
        lines.append(
            "SYNTHETIC: structured weights with real Qwen3 shapes, not a language "
            "model; speed and acceptance only."
        )
    for line in lines:
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def render_profiles(
    profiles: dict[int, dict[str, float]],
    overhead: list[dict[str, float]],
    console: Console,
) -> None:
    """Print the stage table (one column per draft length) and the verify table."""
    table = Table(title="Where a round's time goes (ms per round, greedy)")
    table.add_column("stage")
    for n in profiles:
        table.add_column(f"fixed-{n}", justify="right")
    for stage in (
        *roundprofile.STAGES,
        "round (instrumented)",
        "round (generation loop)",
    ):
        table.add_row(stage, *(f"{p[stage]:.2f}" for p in profiles.values()))
    table.add_row("rounds", *(str(int(p["rounds"])) for p in profiles.values()))
    console.print(table)
    verify = Table(title="Target forward: adapter vs mlx-lm (ms, median, interleaved)")
    for name in ("query tokens", "adapter", "mlx-lm", "adapter / mlx-lm"):
        verify.add_column(name, justify="right")
    for row in overhead:
        verify.add_row(
            str(row["query_tokens"]),
            f"{row['adapter_ms']:.2f}",
            f"{row['mlx_lm_ms']:.2f}",
            f"{row['ratio']:.3f}",
        )
    console.print(verify)


def _int_list(text: str, what: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise DSparkError(
            f"{what} expects comma-separated integers, got {text!r}."
        ) from None


def _float_list(text: str, what: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise DSparkError(
            f"{what} expects comma-separated numbers, got {text!r}."
        ) from None


def benchmark(
    model: str | None = typer.Option(
        None, "--model", help="Target model path or Hugging Face repo."
    ),
    draft_model: str | None = typer.Option(
        None,
        "--draft-model",
        help="DSpark, DFlash or EAGLE-3 drafter path or Hugging Face repo.",
    ),
    mlx_lm_draft_model: str | None = typer.Option(
        None,
        "--mlx-lm-draft-model",
        help="A small model for mlx-lm's own speculative decoding.",
    ),
    mlx_lm_num_draft: int = typer.Option(
        3, "--mlx-lm-num-draft", help="Drafts per round for it."
    ),
    prompts: str = typer.Option(
        "chat", "--prompts", help="chat, code, math, or a file."
    ),
    max_tokens: int = typer.Option(64, "--max-tokens", "-m", help="Tokens per prompt."),
    trials: int = typer.Option(3, "--trials", help="Passes over the prompts (median)."),
    modes: str = typer.Option(
        ",".join(MODES),
        "--modes",
        help=f"Comma-separated modes among {', '.join(MODES)}.",
    ),
    fixed_n: str | None = typer.Option(
        None,
        "--fixed-n",
        help="Draft counts for the fixed modes (default: 2,4,block; 0 = plain "
        "target decoding in the DSpark loop).",
    ),
    useless_drafter: bool = typer.Option(
        False,
        "--useless-drafter",
        help="Replace the drafter's weights by random ones of the same shapes "
        "(a pair that never drafts well: the default policy should stop drafting).",
        metavar="",
    ),
    thresholds: str = typer.Option(
        "0.5", "--thresholds", help="Confidence thresholds for threshold modes."
    ),
    tree_budgets: str = typer.Option(
        "8,16", "--tree-budgets", help="Node budgets for the tree modes."
    ),
    ignore_chat_template: bool = typer.Option(
        False,
        "--ignore-chat-template",
        help="Use the prompts as they are, without the tokenizer's chat template.",
        metavar="",
    ),
    json: Path | None = typer.Option(
        None, "--json", help="Write the records as JSON here."
    ),
    plot: Path | None = typer.Option(
        None, "--plot", help="Write PNG plots into this folder."
    ),
    synthetic: str | None = typer.Option(
        None, "--synthetic", help="Run a synthetic Qwen3-shaped pair: 0.6b, 1.7b or 4b."
    ),
    bits: int = typer.Option(
        4, "--bits", help="Synthetic target: 4, 8 (quantized), 16, 32."
    ),
    accept: str = typer.Option(
        "chat", "--accept", help="Synthetic acceptance profile: chat or math."
    ),
    parity_record: Path | None = typer.Option(
        None, "--parity-record", help="Record a golden greedy trace."
    ),
    parity_check: Path | None = typer.Option(
        None, "--parity-check", help="Replay a golden trace."
    ),
    parity_rtol: float = typer.Option(
        1e-3, "--parity-rtol", help="Relative logit tolerance of --parity-check."
    ),
    compare: list[str] | None = typer.Option(
        None,
        "--compare",
        metavar="[NAME=]DRAFTER",
        help="A drafter to compare, [NAME=]PATH (repeat: DSpark, DFlash, EAGLE-3 "
        "drafters for one --model), instead of the modes.",
    ),
    compare_n: int = typer.Option(
        7, "--compare-n", help="Drafts per round for --compare (fixed)."
    ),
    temperatures: str = typer.Option(
        "0,1", "--temperatures", help="Sampling temperatures for --compare."
    ),
    seed: int = typer.Option(0, "--seed", help="Sampling seed for --compare."),
    profile: bool = typer.Option(
        False,
        "--profile",
        help="Instead of the modes: split a greedy round into its stages at each "
        "--fixed-n, and time the adapter's target forward against mlx-lm's "
        "(5 x --trials calls each).",
        metavar="",
    ),
) -> None:
    """Compare target-only, mlx-lm speculative and DSpark decoding."""
    run(SimpleNamespace(**locals()))


def load_pair(args) -> Pair:
    from ..loading import load

    if args.synthetic is not None:
        from ..pairs.synthetic import load_synthetic

        if args.model or args.draft_model:
            raise DSparkError(
                "--synthetic builds its own pair; drop --model/--draft-model."
            )
        model, tokenizer, drafter = load_synthetic(
            args.synthetic, args.bits, args.accept
        )
        label = f"synthetic Qwen3-{args.synthetic} ({args.bits}-bit, {args.accept} acceptance)"
        if args.useless_drafter:
            make_useless(drafter)
            label += ", useless (random) drafter"
        return Pair(model, tokenizer, drafter, label, synthetic=True)
    if args.model is None:
        if args.draft_model is not None:
            raise DSparkError(
                "--draft-model needs --model (the target it was trained for)."
            )
        target_dir, drafter_dir = default_pair()
        label = f"default pair ({target_dir.name})"
    else:
        target_dir, drafter_dir, label = args.model, args.draft_model, str(args.model)
    model, tokenizer, drafter = load(target_dir, drafter_dir)
    if args.useless_drafter and drafter is not None:
        make_useless(drafter)
        label += ", useless (random) drafter"
    pair = Pair(model, tokenizer, drafter, label)
    if args.mlx_lm_draft_model:
        draft, _, _ = load(args.mlx_lm_draft_model)
        pair.mlx_lm_draft, pair.mlx_lm_draft_label = draft, args.mlx_lm_draft_model
    return pair


def _check_args(args) -> None:
    if args.max_tokens < 2:
        raise DSparkError(
            f"--max-tokens must be at least 2 (speed is measured after the first "
            f"token), got {args.max_tokens}."
        )
    if args.trials < 1:
        raise DSparkError(f"--trials must be at least 1, got {args.trials}.")
    if getattr(args, "compare", None):
        others = {
            "--draft-model": args.draft_model,
            "--synthetic": args.synthetic,
            "--parity-record": args.parity_record,
            "--parity-check": args.parity_check,
            "--profile": args.profile,
            "--mlx-lm-draft-model": args.mlx_lm_draft_model,
        }
        for flag, value in others.items():
            if value:
                raise DSparkError(f"--compare runs on its own; drop {flag}.")
        if args.compare_n < 1:
            raise DSparkError(f"--compare-n must be at least 1, got {args.compare_n}.")
        temps = _float_list(args.temperatures, "--temperatures")
        if not temps or any(t < 0 for t in temps):
            raise DSparkError(
                f"--temperatures must be numbers >= 0, got {args.temperatures!r}."
            )
    if args.parity_record and args.parity_check:
        raise DSparkError("Use --parity-record or --parity-check, not both.")
    if args.parity_check is not None and not args.parity_check.is_file():
        raise DSparkError(f"The parity trace {args.parity_check} does not exist.")
    if args.synthetic is not None:
        from ..pairs.synthetic import ACCEPT_PROFILES, BITS, SHAPES

        if args.synthetic not in SHAPES:
            raise DSparkError(
                f"Unknown synthetic size {args.synthetic!r}; choose {', '.join(SHAPES)}."
            )
        if args.bits not in BITS:
            raise DSparkError(f"--bits must be 4, 8, 16 or 32, got {args.bits}.")
        if args.accept not in ACCEPT_PROFILES:
            raise DSparkError(f"--accept must be chat or math, got {args.accept!r}.")


def run(args: SimpleNamespace) -> None:
    """The benchmark for the parsed flags (``args`` has one field per flag)."""
    _check_args(args)
    console = Console(width=None if sys.stdout.isatty() else 200)
    err = Console(stderr=True)
    prompt_name, texts = load_prompts(args.prompts)
    if args.compare:
        run_comparison(args, prompt_name, texts, console, err)
        return
    mode_names = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [n for n in mode_names if n not in MODES]
    if unknown:
        raise DSparkError(
            f"Unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}."
        )

    pair = load_pair(args)
    if pair.synthetic:
        err.print(f"SYNTHETIC pair: {pair.label}", highlight=False)
    vocab = pair.vocab_size
    prompts = [
        encode_prompt(pair.tokenizer, t, vocab, not args.ignore_chat_template)
        for t in texts
    ]

    if args.parity_record or args.parity_check:
        if pair.drafter is None:
            raise DSparkError("Parity traces need a DSpark drafter (--draft-model).")
        if args.parity_record:
            trace = record_trace(pair, prompts, args.max_tokens)
            write_atomic(
                args.parity_record, lambda tmp: tmp.write_text(json.dumps(trace))
            )
            rounds = sum(len(p["rounds"]) for p in trace["prompts"])
            console.print(
                f"parity trace written to {args.parity_record}: {len(prompts)} prompts, "
                f"{rounds} rounds, backend {trace['backend']}",
                highlight=False,
            )
            return
        trace = read_trace(args.parity_check)
        divergence, summary = check_trace(pair, trace, args.parity_rtol)
        from ..machine import backend

        if divergence is not None:
            raise DSparkError(
                f"Parity check failed against the {trace['backend']} trace: first "
                f"divergence at {divergence}."
            )
        console.print(
            f"parity ok: {summary['prompts']} prompts, {summary['rounds']} rounds, "
            f"{summary['tokens']} tokens match the {trace['backend']} trace "
            f"(this run: {backend()}).",
            highlight=False,
        )
        return

    block = pair.drafter.block_size if pair.drafter is not None else 1
    fixed = (
        _int_list(args.fixed_n, "--fixed-n")
        if args.fixed_n
        else sorted({n for n in (2, 4, block) if n <= block})
    )
    if args.profile:
        if pair.drafter is None:
            raise DSparkError("--profile needs a DSpark drafter (--draft-model).")
        caps = [
            build_settings(block, n, names={"num_draft": "--fixed-n"}).num_draft
            for n in fixed
        ]
        profiles = {
            n: roundprofile.profile_rounds(
                pair.adapter, pair.drafter, prompts, args.max_tokens, n
            )
            for n in caps
        }
        overhead = roundprofile.verify_overhead(
            pair.adapter, pair.model, repeats=5 * args.trials
        )
        render_profiles(profiles, overhead, console)
        return
    budgets = _int_list(args.tree_budgets, "--tree-budgets")
    if any(b < 1 for b in budgets):
        raise DSparkError("--tree-budgets values must be at least 1.")
    settings = Settings(
        fixed,
        _float_list(args.thresholds, "--thresholds"),
        args.mlx_lm_num_draft,
        budgets,
    )
    variants = select_variants(pair, settings, mode_names)

    err.print("measuring the machine (BLAS, bandwidth) ...", highlight=False)
    machine = machine_report(pair.model)
    if err.is_terminal:
        with err.status("benchmarking") as status:
            results = measure(
                pair, variants, prompts, args.max_tokens, args.trials, status.update
            )
    else:
        results = measure(
            pair,
            variants,
            prompts,
            args.max_tokens,
            args.trials,
            lambda message: print(message, file=sys.stderr, flush=True),
        )
    report = {
        "schema": SCHEMA_VERSION,
        "synthetic": pair.synthetic,
        "pair": {
            "label": pair.label,
            "mlx_lm_draft_model": pair.mlx_lm_draft_label,
            "block_size": pair.drafter.block_size if pair.drafter else None,
        },
        "settings": {
            "prompts": prompt_name,
            "num_prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "trials": args.trials,
            "temperature": 0.0,
        },
        "machine": machine,
        "records": records(results, machine["ceiling_tok_per_s"], pair.synthetic),
    }
    render(report, console)
    if args.json:
        write_json(report, args.json)
        console.print(f"JSON written to {args.json}", highlight=False)
    if args.plot:
        written = write_plots(report, args.plot)
        if written is None:
            console.print(
                "Plots skipped: matplotlib is not installed (pip install 'mlx-dspark[plot]').",
                markup=False,
                highlight=False,
            )
        else:
            console.print(
                f"Plots written: {', '.join(map(str, written))}", highlight=False
            )
    if any(r["lossless"] is False for r in report["records"]):
        err.print(
            "[bold yellow]warning:[/] a mode's greedy output differs from target-only "
            "decoding (see the lossless column)."
        )


def run_comparison(
    args, prompt_name: str, texts: list[str], console: Console, err: Console
) -> None:
    """``--compare``: the drafters side by side for one target."""
    from ..checkpoints.loading import load_drafter
    from ..loading import load

    target = args.model if args.model is not None else default_pair()[0]
    model, tokenizer, _ = load(target)
    contenders = []
    for value in args.compare:
        name, path = parse_contender(value)
        contenders.append(Contender(name, load_drafter(path, model)))
    temperatures = _float_list(args.temperatures, "--temperatures")
    variants = compare_variants(contenders, args.compare_n, temperatures, args.seed)
    pair = Pair(model, tokenizer, contenders[0].drafter, str(target))
    prompts = [
        encode_prompt(tokenizer, t, pair.vocab_size, not args.ignore_chat_template)
        for t in texts
    ]
    err.print("measuring the machine (BLAS, bandwidth) ...", highlight=False)
    machine = machine_report(model)
    results = measure(
        pair, variants, prompts, args.max_tokens, args.trials,
        lambda message: print(message, file=sys.stderr, flush=True),
    )  # fmt: skip
    report = {
        "schema": SCHEMA_VERSION,
        "synthetic": False,
        "pair": {
            "label": str(target),
            "drafters": dict(map(parse_contender, args.compare)),
        },
        "settings": {
            "prompts": prompt_name,
            "num_prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "trials": args.trials,
            "num_draft": args.compare_n,
            "temperatures": temperatures,
            "seed": args.seed,
        },  # fmt: skip
        "machine": machine,
        "records": compare_records(
            results, contenders, temperatures, machine["ceiling_tok_per_s"]
        ),
    }
    render_comparison(report, console)
    if args.json:
        write_json(report, args.json)
        console.print(f"JSON written to {args.json}", highlight=False)


def render_comparison(report: dict, console: Console) -> None:
    settings, machine = report["settings"], report["machine"]
    table = Table(
        title=f"drafters for {report['pair']['label']}: "
        f"{settings['num_draft']} drafts a round"
    )
    for name, justify in (
        ("drafter", "left"), ("T", "right"), ("mean acc. len", "right"),
        ("acceptance by position", "left"), ("tok/s", "right"),
        ("speedup", "right"), ("lossless", "center"),
    ):  # fmt: skip
        table.add_column(name, justify=justify)
    for r in report["records"]:
        table.add_row(
            r["drafter"],
            f"{r['temperature']:g}",
            f"{r['mean_accepted_length']:.2f}",
            " ".join(f"{a:.2f}" for a in r["acceptance_by_position"]) or "-",
            f"{r['tok_per_s']:.1f}",
            f"{r['speedup']:.2f}x",
            {True: "yes", False: "NO", None: "-"}[r["lossless"]],
        )
    console.print(table)
    trials = settings["trials"]
    console.print(
        f"prompts: {settings['prompts']} ({settings['num_prompts']}), max tokens "
        f"{settings['max_tokens']}, {trials} trial{'s' * (trials != 1)}, seed "
        f"{settings['seed']}; backend {machine['backend']}, BLAS {machine['blas']}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )


def main(argv: list[str] | None = None, prog: str = "mlx_dspark.benchmark") -> None:
    run_command(benchmark, argv, prog)


if __name__ == "__main__":
    main()
