"""``mlx_dspark train``: train a DSpark (or DFlash, EAGLE-3) drafter for an mlx-lm target.

The flags map one to one onto :class:`mlx_dspark.training.run.TrainArgs`; the work is
:func:`mlx_dspark.training.run.train`. The parser is argparse (with one-sentence
errors), not typer: ``--data A.jsonl B.txt`` takes several values after one
flag, which click options cannot, and existing command lines must keep working.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress

from ..training.run import (
    AUTO_DTYPE,
    DEFAULT_DRAFT_VOCAB,
    DTYPES,
    KINDS,
    Progress,
    TrainArgs,
    train,
)
from .terminal import ArgumentParser, log_to_terminal, run_cli


def _layer_ids(value: str) -> list[int]:
    try:
        return [int(v) for v in value.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers like 1,8,15, got {value!r}"
        ) from None


def _draft_vocab(value: str) -> int | str:
    if value in ("auto", "none"):
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number, auto or none, got {value!r}"
        ) from None


def build_parser(prog: str = "mlx_dspark.train") -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=prog,
        description="Train a DSpark, DFlash or EAGLE-3 drafter for an mlx-lm "
        "target model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = TrainArgs(model="", data=[], out="")

    def add(flag: str, *more: str, **kwargs) -> None:
        if kwargs.get("action") in ("store_true", argparse.BooleanOptionalAction):
            kwargs.setdefault("default", False)
        p.add_argument(flag, *more, **kwargs)

    add("--model", required=True, help="Target model path or Hugging Face repo.")
    add(
        "--data",
        nargs="+",
        required=True,
        metavar="FILE",
        help="Text files and/or JSONL files (messages, prompt/completion, text, tokens).",
    )
    add("--out", required=True, help="Output drafter directory (DeepSpec format).")
    add(
        "--kind",
        default=d.kind,
        choices=list(KINDS),
        help="Drafter to train: DSpark (a parallel block; DFlash is DSpark with "
        "--markov-head none --no-confidence) or EAGLE-3 (autoregressive, trained "
        "by DeepSpec's training-time test; the block, Markov, confidence, anchor "
        "and --init-from* flags do not apply to it).",
    )
    add(
        "--ttt-length",
        type=int,
        default=d.ttt_length,
        help="EAGLE-3: drafting steps unrolled in training (DeepSpec: 7).",
    )
    add("--block-size", type=int, default=d.block_size, help="Tokens per draft block.")
    add("--layers", type=int, default=d.layers, help="Draft decoder layers.")
    add(
        "--markov-head",
        default=d.markov_head,
        choices=["vanilla", "gated", "rnn", "none"],
        help="Sequential head over the block (none: parallel drafts only; with "
        "--no-confidence this is a DFlash drafter).",
    )
    add("--markov-rank", type=int, default=d.markov_rank, help="Sequential head rank.")
    add(
        "--draft-vocab",
        type=_draft_vocab,
        default=d.draft_vocab,
        metavar="N",
        help="Draft over the N most frequent training tokens only (smaller, faster "
        "drafter and teacher store; still lossless); none = the target's whole "
        f"vocabulary; auto = {DEFAULT_DRAFT_VOCAB} for a target with more than "
        f"{2 * DEFAULT_DRAFT_VOCAB} tokens, the starting drafter's with --init-from.",
    )
    add(
        "--target-layer-ids",
        type=_layer_ids,
        default=None,
        help="Target layers to tap, e.g. 1,8,15 (-1 = embeddings; the last layer is "
        "tapped normalised, as the LM head reads it); none = spread evenly.",
    )
    add(
        "--confidence",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Train the confidence head.",
    )
    add(
        "--mask-token-id",
        type=int,
        default=None,
        help="Mask token id; none = the last vocabulary id.",
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--steps", type=int, default=None, help="Optimizer steps (or --epochs)."
    )
    group.add_argument(
        "--epochs", type=float, default=None, help="Passes over the data; none = 1."
    )
    add("--batch-size", type=int, default=d.batch_size, help="Sequences per step.")
    add("--anchors", type=int, default=d.anchors, help="Blocks per sequence.")
    add("--lr", type=float, default=d.lr, help="Peak learning rate (AdamW).")
    add("--warmup", type=float, default=d.warmup, help="Warm-up fraction of steps.")
    add("--weight-decay", type=float, default=d.weight_decay, help="AdamW decay.")
    add(
        "--grad-clip",
        type=float,
        default=d.grad_clip,
        help="Gradient norm clip (0 = off).",
    )
    add("--seq-len", type=int, default=d.seq_len, help="Tokens per sequence.")
    add("--gamma", type=float, default=d.gamma, help="Position-weight decay.")
    add(
        "--greedy-weight",
        type=float,
        default=d.greedy_weight,
        help="Weight of a CE term against the target's most likely token, the "
        "draft greedy decoding keeps (0 = DeepSpec's loss).",
    )
    add("--seed", type=int, default=d.seed, help="Random seed.")
    add("--resume", action="store_true", help="Continue from the checkpoint.")
    add(
        "--checkpoint-every",
        type=int,
        default=d.checkpoint_every,
        help="Steps between checkpoints (beside --out, as OUT.checkpoint).",
    )
    add(
        "--keep-checkpoint",
        action="store_true",
        help="Keep OUT.checkpoint after a finished run (drafter and optimizer "
        "state, several times the drafter's size); by default it is removed.",
    )
    add(
        "--teacher-store",
        "--cache-features",
        dest="teacher_store",
        default=d.teacher_store,
        metavar="DIR",
        help="Compute the target's features and distributions once, into a "
        "store under DIR (memory-mapped), reused by later runs with the same "
        "target, data contents, --seq-len, taps and draft vocabulary; auto = "
        "the user cache ($MLX_DSPARK_CACHE or ~/.cache/mlx_dspark, in teacher/); "
        "none = run the target on the fly every step (several times slower).",
    )
    add(
        "--refresh-teacher-store",
        action="store_true",
        help="Rebuild the teacher store even when one matches.",
    )
    add(
        "--init-from-target",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Start the draft layers from the target's top decoder layers.",
    )
    add(
        "--init-from",
        default=None,
        metavar="DRAFTER",
        help="Start from a drafter trained earlier (a directory this command "
        "wrote, float or quantized), with a fresh optimizer and schedule; the "
        "shape flags must match it (--layers may add layers on top, started "
        "from the target's and adding nothing at first; from a vanilla Markov "
        "head, a larger --markov-rank widens it the same way and --markov-head "
        "gated grows it into a gated head, drafting as before at first), "
        "its draft vocabulary "
        "is kept, and its training record's runs are carried into the new one.",
    )
    add(
        "--regenerate",
        action="store_true",
        help="First let the target write the responses.",
    )
    add(
        "--regenerate-out",
        default=None,
        metavar="FILE",
        help="Where the regenerated responses go; none = OUT.regenerated.jsonl.",
    )
    add(
        "--regen-max-tokens",
        type=int,
        default=d.regen_max_tokens,
        help="Tokens per regenerated answer.",
    )
    add(
        "--regen-prompt-tokens",
        type=int,
        default=d.regen_prompt_tokens,
        help="Prompt tokens taken from plain-text chunks.",
    )
    add(
        "--regen-temperature",
        type=float,
        default=d.regen_temperature,
        help="Sampling temperature of the regeneration.",
    )
    add(
        "--regen-batch-size",
        type=int,
        default=d.regen_batch_size,
        help="Prompts answered together.",
    )
    add(
        "--with-embeddings",
        action="store_true",
        help="Also write embed_tokens/lm_head copies, as DeepSpec does.",
    )
    add(
        "--dtype",
        default=d.dtype,
        choices=[AUTO_DTYPE, *DTYPES],
        help="Dtype the drafter is written in (training keeps float32 weights); "
        "auto = float32 on a CPU, bfloat16 on a GPU.",
    )
    add(
        "--quantize-bits",
        type=int,
        default=None,
        choices=[2, 3, 4, 6, 8],
        help="Write the drafter quantized (MLX format) to this many bits; none = "
        "float.",
    )
    add(
        "--quantize-group-size",
        type=int,
        default=d.quantize_group_size,
        help="Quantization group size.",
    )
    add("--force", action="store_true", help="Replace an existing output.")
    add("--log-every", type=int, default=d.log_every, help="Steps between log lines.")
    add(
        "--val-sequences",
        type=int,
        default=d.val_sequences,
        help="Sequences held out of training; their loss and expected accepted "
        "length (tau) are measured every --val-every steps into the record.",
    )
    add(
        "--val-data",
        nargs="+",
        default=None,
        metavar="FILE",
        help="Held-out files (the --data formats) measured every --val-every steps "
        "instead of sequences split off the training data: text from prompts or "
        "sources training never sees, so the curve shows what generalises.",
    )
    add("--val-every", type=int, default=d.val_every, help="Steps between validations.")
    add("--quiet", action="store_true", help="No progress or messages.")
    return p


@contextmanager
def stage_progress(log_every: int, quiet: bool) -> Iterator[Progress | None]:
    """A rich bar per stage on a terminal; in a log, a plain line every
    ``log_every`` training steps and every tenth of the other stages (a bar
    there is cut and never updates)."""
    if quiet:
        yield None
        return
    if not sys.stdout.isatty():
        tenths: dict[str, int] = {}

        def line(stage: str, done: int, total: int, metrics: str) -> None:
            if stage == "training":
                if done % log_every == 0 or done == total:
                    print(f"step {done}/{total}  {metrics}", flush=True)
                return
            tenth = 10 * done // max(total, 1)
            if tenth > tenths.get(stage, 0):
                tenths[stage] = tenth
                print(f"{stage}: {done}/{total}  {metrics}".rstrip(), flush=True)

        yield line
        return
    bars = RichProgress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[metrics]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
    )
    tasks: dict[str, TaskID] = {}

    def draw(stage: str, done: int, total: int, metrics: str) -> None:
        if stage not in tasks:
            tasks[stage] = bars.add_task(stage, total=total, metrics="")
        bars.update(tasks[stage], completed=done, total=total, metrics=metrics)

    with bars:
        yield draw


def _main(argv: list[str] | None, prog: str) -> None:
    ns = build_parser(prog).parse_args(argv)
    log_to_terminal(quiet=ns.quiet)
    args = TrainArgs(**vars(ns))
    with stage_progress(args.log_every, args.quiet) as progress:
        result = train(args, progress=progress)
    if result.status == "interrupted":
        raise SystemExit(130)


def main(argv: list[str] | None = None, prog: str = "mlx_dspark.train") -> None:
    run_cli(lambda: _main(argv, prog))


if __name__ == "__main__":
    main()
