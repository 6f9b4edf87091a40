"""Recipe: the DSpark paper's comparison (Table 1) for the default target.

Trains a DSpark, a DFlash and an EAGLE-3 drafter for SmolLM2-135M-Instruct
(float32, the default pair's target) on the same data, then benchmarks them
side by side (``mlx_dspark.benchmark --compare``): mean accepted length at 7
drafts a round, at T=0 and T=1, and speed against the target alone, per
prompt set. From the repository root (Linux: OpenBLAS is used when present)::

    python examples/compare_drafters.py --work ~/dspark-compare

Data: the first stage of ``train_default_drafter.py`` as committed, no
network needed: the target's answers to the recipe's prompts
(``FIRST_SHARDS`` of ``examples/data/regenerated/``) and its continuations
of plain text (``examples/data/continued/``). One teacher store serves all
three drafters (same data, target layers and 4096-token draft vocabulary).

Budget: the same number of supervised predictions (block positions) for
each drafter. DSpark and DFlash train ``--steps`` steps of ten sequences
with 64 anchored blocks of 7; EAGLE-3 trains every position of its
sequences, 7 unrolled steps each, so it gets the steps that supervise as
many predictions (computed from the data by the library's own batch
makers). Wall-clock is not equalised (an EAGLE-3 prediction cost 2.7 times a
DSpark one here: a twice-wide attention input and attention over the
unrolled steps) but each drafter's training time is printed before the
tables. The full run: docs/training.md, "DFlash and EAGLE-3 drafters". The three share the
flags below: one draft layer, random initialisation (no
``--init-from-target``: EAGLE-3's layer reads twice the target's width),
learning rate 1.5e-3, float32 weights. DFlash is DSpark with
``--markov-head none --no-confidence``.

Each step is skipped when its output exists, so a rerun continues.
``--kinds`` picks the drafters (default all three).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
import numpy as np
from train_default_drafter import CONTINUATION_DIR, FIRST_SHARDS, OPENBLAS, REGEN_DIR

SEQ_LEN, BATCH, ANCHORS, BLOCK, TTT_LENGTH = 320, 10, 64, 7, 7
SHARED = [
    "--layers", "1", "--draft-vocab", "4096", "--seq-len", str(SEQ_LEN),
    "--dtype", "float32", "--batch-size", str(BATCH), "--lr", "1.5e-3",
    "--checkpoint-every", "20", "--log-every", "10", "--seed", "0",
]  # fmt: skip
KIND_FLAGS = {
    "dspark": ["--markov-head", "vanilla", "--markov-rank", "64",
               "--block-size", str(BLOCK), "--anchors", str(ANCHORS)],
    "dflash": ["--markov-head", "none", "--no-confidence",
               "--block-size", str(BLOCK), "--anchors", str(ANCHORS)],
    "eagle3": ["--kind", "eagle3", "--ttt-length", str(TTT_LENGTH)],
}  # fmt: skip


def run(cmd: list[str], env: dict) -> int:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env).returncode


def training_files(shards: int | None) -> list[Path]:
    """The first stage's answers and the continuations (``shards`` of each
    at most, for a quick try)."""
    answers = [REGEN_DIR / f"{name}.jsonl.gz" for name in FIRST_SHARDS]
    continued = sorted(CONTINUATION_DIR.glob("t*.jsonl.gz"))
    if shards is not None:
        answers, continued = answers[:shards], continued[:shards]
    return [*answers, *continued]


def eagle3_steps(target: Path, files: list[Path], steps: int) -> int:
    """EAGLE-3 steps supervising as many predictions as ``steps`` DSpark
    steps, on average over the data."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_dspark.training.batches import make_batch
    from mlx_dspark.training.data import load_sequences
    from mlx_dspark.training.eagle3 import make_eagle3_batch

    sequences, _ = load_sequences(files, load_tokenizer(target), SEQ_LEN)
    rng = np.random.default_rng(0)
    dspark = np.mean(
        [make_batch([s], ANCHORS, BLOCK, 0, 4.0, rng).supervised for s in sequences]
    )
    eagle3 = np.mean([make_eagle3_batch([s], TTT_LENGTH).supervised for s in sequences])
    return max(1, round(steps * dspark / eagle3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="working directory")
    parser.add_argument("--steps", type=int, default=300,
                        help="DSpark/DFlash steps (EAGLE-3: as many predictions)")  # fmt: skip
    parser.add_argument("--kinds", default="dspark,dflash,eagle3",
                        help="drafters to train and compare")  # fmt: skip
    parser.add_argument("--shards", type=int, default=None,
                        help="answer and continuation shards of each (default all)")  # fmt: skip
    parser.add_argument("--prompts", default="chat,code,math",
                        help="benchmark prompt sets, one table each")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--trials", type=int, default=1)
    args = parser.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KIND_FLAGS)
    if unknown:
        raise SystemExit(f"--kinds: unknown drafter {sorted(unknown)[0]!r}.")
    work = args.work.expanduser()
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if sys.platform == "linux" and Path(OPENBLAS).exists():
        env.setdefault("LD_PRELOAD", OPENBLAS)
    from mlx_dspark.pairs.default import target_dir

    target = target_dir()
    files = training_files(args.shards)
    steps = {"dspark": args.steps, "dflash": args.steps}
    if "eagle3" in kinds:
        steps["eagle3"] = eagle3_steps(target, files, args.steps)
    store = ["--teacher-store", str(work / "teacher")]
    for kind in kinds:
        out = work / kind
        if out.exists():
            continue
        resume = ["--resume"] if (work / f"{kind}.checkpoint").exists() else []
        cmd = [sys.executable, "-m", "mlx_dspark.train", "--model", str(target),
               "--data", *map(str, files), "--out", str(out), *SHARED,
               *KIND_FLAGS[kind], "--steps", str(steps[kind]), *store, *resume]  # fmt: skip
        if run(cmd, env):
            raise SystemExit(f"training the {kind} drafter failed")
    print(f"{'drafter':8} {'steps':>6} {'positions':>10} {'minutes':>8} {'pos/s':>6}")
    for kind in kinds:
        record = json.loads((work / kind / "training_record.json").read_text())
        print(
            f"{kind:8} {record['steps']:6d} {record['block_positions']:10d} "
            f"{record['train_time_s'] / 60:8.1f} {record['block_positions_per_s']:6.0f}"
        )
    compare = [f for kind in kinds for f in ("--compare", f"{kind}={work / kind}")]
    failed = False
    for prompts in args.prompts.split(","):
        cmd = [sys.executable, "-m", "mlx_dspark.benchmark", "--model", str(target),
               *compare, "--prompts", prompts, "--max-tokens", str(args.max_tokens),
               "--trials", str(args.trials), "--json", str(work / f"{prompts}.json")]  # fmt: skip
        failed |= run(cmd, env) != 0
    if failed:
        raise SystemExit("a benchmark failed (see above)")


if __name__ == "__main__":
    main()
