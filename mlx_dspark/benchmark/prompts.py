"""The benchmark prompt sets and how a prompt becomes token ids."""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from ..errors import DSparkError
from ..utils import encode_chat_prompt

PROMPT_SETS: dict[str, list[str]] = {
    "chat": [
        "What is a good way to spend a rainy Sunday afternoon at home?",
        "Explain to a child why the sky is blue.",
        "Write a short, friendly note thanking a neighbour for watering my plants.",
    ],
    "code": [
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        "Implement binary search over a sorted list in Python and explain it.",
        "Write a shell command that counts the lines of every .py file in a folder.",
    ],
    "math": [
        "A train travels 120 km in 1.5 hours. What is its average speed? Show the steps.",
        "Solve for x: 3x + 7 = 25. Explain each step.",
        "What is the sum of the integers from 1 to 100? Show the reasoning.",
    ],
}


def load_prompts(spec: str) -> tuple[str, list[str]]:
    """``(name, prompts)`` for a built-in set or a file.

    A ``.json`` file holds a list of strings; any other file one prompt per
    non-empty line.
    """
    if spec in PROMPT_SETS:
        return spec, list(PROMPT_SETS[spec])
    path = Path(spec).expanduser()
    if not path.exists():
        if os.sep in spec or "." in spec:
            raise DSparkError(f"The prompt file {spec} does not exist.")
        raise DSparkError(
            f"Unknown prompt set {spec!r}; use chat, code, math or a file path."
        )
    if not path.is_file():
        raise DSparkError(f"The prompt path {spec} is not a file.")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError):
        raise DSparkError(f"The prompt file {spec} is not readable text.") from None
    if path.suffix == ".json":
        try:
            prompts = json.loads(text)
        except json.JSONDecodeError:
            raise DSparkError(f"The prompt file {spec} is not valid JSON.") from None
        if not isinstance(prompts, list) or not all(
            isinstance(p, str) for p in prompts
        ):
            raise DSparkError(
                f"The prompt file {spec} must hold a JSON list of strings."
            )
    else:
        prompts = [line.strip() for line in text.splitlines()]
    prompts = [p for p in prompts if p.strip()]
    if not prompts:
        raise DSparkError(f"The prompt file {spec} holds no prompts.")
    return path.name, prompts


def encode_prompt(tokenizer, text: str, vocab_size: int, chat: bool) -> list[int]:
    """Token ids of a prompt (:func:`~mlx_dspark.utils.encode_chat_prompt`).

    Built-in structured pairs have a toy word-level tokenizer that maps all
    text to its unknown token; there, each word is hashed to a token id so
    prompts stay distinct and deterministic.
    """
    ids = encode_chat_prompt(tokenizer, text, chat)
    unk = getattr(tokenizer, "unk_token_id", None)
    if not ids or (unk is not None and ids.count(unk) * 2 > len(ids)):
        chain = max(vocab_size - 2, 1)
        ids = [zlib.crc32(word.encode()) % chain for word in text.split()]
    if not ids:
        raise DSparkError("A prompt is empty.")
    return ids
