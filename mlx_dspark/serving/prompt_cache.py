"""Recent prompts' target caches, reused by requests that start with them.

A chat client sends the whole conversation every turn, and clients often
repeat a system prompt: the tokens a new prompt shares with a cached one need
no prefill. The engine keeps a request's prompt when its prefill ends, and its
prompt and answer when it finishes, so a chat's next turn reuses the answer.
Like ``mlx_lm.server``'s prompt cache, entries are kept least recently used
first out, within a count and a byte budget. An entry also keeps the target's
tapped features of its tokens, which the drafter's context needs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx


@dataclass
class CachedPrompt:
    """A prompt's keys/values per layer (``[1, H, N, D]``) and its features
    ``[1, N, F]``."""

    tokens: tuple[int, ...]
    kv: list[tuple[mx.array, mx.array]]
    features: mx.array | None

    @property
    def nbytes(self) -> int:
        arrays = [a for pair in self.kv for a in pair]
        if self.features is not None:
            arrays.append(self.features)
        return sum(a.nbytes for a in arrays)


def common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PromptCache:
    """At most ``max_size`` prompts and ``max_bytes`` bytes (None: no byte
    limit), the least recently used dropped first."""

    def __init__(self, max_size: int = 10, max_bytes: int | None = None):
        self.max_size = max_size
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], CachedPrompt] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries.values())

    def fetch(self, prompt: list[int]) -> tuple[int, CachedPrompt] | None:
        """The entry sharing the longest prefix with ``prompt`` and how many
        tokens of it to reuse: at most all but the prompt's last token, whose
        logits the request's first token needs."""
        best, reuse = None, 0
        for entry in self._entries.values():
            n = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
            if n > reuse:
                best, reuse = entry, n
        if best is None:
            return None
        self._entries.move_to_end(best.tokens)
        return reuse, best

    def insert(self, entry: CachedPrompt) -> None:
        """Add ``entry``, dropping the entries it extends (any prompt they
        would serve, it serves as well)."""
        n = len(entry.tokens)
        for tokens in list(self._entries):
            if len(tokens) <= n and entry.tokens[: len(tokens)] == tokens:
                del self._entries[tokens]
        self._entries[entry.tokens] = entry
        while len(self._entries) > self.max_size or (
            self.max_bytes is not None
            and self._entries
            and self.nbytes > self.max_bytes
        ):
            self._entries.popitem(last=False)
