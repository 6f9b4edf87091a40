"""Recent prompts' target caches, reused by requests that start with them.

A chat client sends the whole conversation every turn, agents resend the same
system prompt and tools with every request, and concurrent requests often
share them: the tokens a new prompt shares with a cached one need no prefill.
The engine keeps a request's cache where its prompt's segments end (the end
of the system prompt, of each user turn: see :mod:`.segments`), where its
prefill ends, and with its answer when it finishes, so a chat's next turn
reuses the answer.

A cache of full-attention layers can be cut back to any shorter prefix, so
one entry serves every prompt that shares a prefix with it. A sliding-window
layer keeps only its last tokens and a recurrent layer a state, so such an
entry serves only prompts that share it whole (or nearly, for windows: see
:class:`~mlx_dspark.targets.adapter.CacheState`): that is why the segment
ends are kept apart. Like ``mlx_lm.server``'s prompt cache, entries are kept
least recently used first out, within a count and a byte budget. An entry
also keeps the target's tapped features of its tokens, which the drafter's
context needs.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import mlx.core as mx

from ..targets.adapter import CacheState


@dataclass
class CachedPrompt:
    """A prompt's target cache and its features ``[1, N, F]``."""

    tokens: tuple[int, ...]
    state: CacheState
    features: mx.array | None

    @property
    def nbytes(self) -> int:
        extra = 0 if self.features is None else self.features.nbytes
        return self.state.nbytes + extra

    def usable(self, shared: int) -> int:
        """How many of ``shared`` leading tokens this entry can give: all of
        them if it can be cut back there, else none."""
        return shared if self.state.shortest <= shared else 0


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

    def __contains__(self, tokens) -> bool:
        return tuple(tokens) in self._entries

    @property
    def nbytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries.values())

    def lookup(self, prompt: list[int]) -> tuple[int, CachedPrompt | None, int]:
        """``(reuse, entry, shared)``: the entry giving the most leading
        tokens of ``prompt`` and how many (at most all but the prompt's last
        token, whose logits the request's first token needs), and the longest
        prefix any entry shares with it, usable or not (the engine keeps a
        snapshot there, for the next prompt that shares it)."""
        best, reuse, shared = None, 0, 0
        for entry in self._entries.values():
            n = min(common_prefix(entry.tokens, prompt), len(prompt) - 1)
            shared = max(shared, n)
            n = entry.usable(n)
            if n > reuse:
                best, reuse = entry, n
        return reuse, best, shared

    def fetch(self, prompt: list[int]) -> tuple[int, CachedPrompt] | None:
        """The entry giving the most leading tokens of ``prompt`` and how
        many, now the most recently used; None if none gives any."""
        reuse, best, _ = self.lookup(prompt)
        if best is None:
            return None
        self._entries.move_to_end(best.tokens)
        return reuse, best

    def insert(self, entry: CachedPrompt) -> None:
        """Add ``entry``, dropping the entries it extends and can be cut back
        to as far as they can (any prompt they would serve, it serves as
        well)."""
        n = len(entry.tokens)
        for tokens, old in list(self._entries.items()):
            if (
                len(tokens) <= n
                and entry.tokens[: len(tokens)] == tokens
                and entry.state.shortest <= old.state.shortest
            ):
                del self._entries[tokens]
        self._entries[entry.tokens] = entry
        self._entries.move_to_end(entry.tokens)
        while len(self._entries) > self.max_size or (
            self.max_bytes is not None
            and self._entries
            and self.nbytes > self.max_bytes
        ):
            self._entries.popitem(last=False)
