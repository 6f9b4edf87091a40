"""Context copying: what followed the last earlier occurrence of the text's end.

Small targets decoding greedily repeat themselves (a loop body, a list's
pattern, a phrase from the prompt), and a one-layer drafter rarely learns to
copy. :func:`continuation` finds the latest earlier occurrence of the
history's longest suffix (``min_ngram`` to ``max_ngram`` tokens: one token
seen before is weak evidence) and returns the tokens that followed it; the
copy proposer adds a fixed bias to those tokens' logits in the drafter's rows
while its drafts keep following them (:mod:`~mlx_dspark.proposers.copying`).
The drafts are still drawn from the rows they are verified against, so the
output is unchanged; only the proposal moves.

Chat answers repeat their context far less than code does, but a small target
answers in stock phrases ("Here are some tips to", "It's important to note
that"). A :class:`PhraseStore` holds text the target wrote itself (its
greedy answers to many requests); when the context offers nothing,
:meth:`PhraseStore.continuation` proposes what most often followed the
history's last tokens there, and the drafter follows it as it follows a copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MIN_NGRAM, MAX_NGRAM = 2, 3
PHRASES_FILE = "phrases.npy"
_SEPARATOR = -1


def continuation(
    history: Sequence[int] | np.ndarray,
    length: int,
    min_ngram: int = MIN_NGRAM,
    max_ngram: int = MAX_NGRAM,
) -> np.ndarray:
    """The ``length`` tokens after the latest earlier occurrence of the
    history's longest matching suffix of ``min_ngram`` to ``max_ngram`` tokens.

    Where the copy reaches the history's end it goes on copying itself, as
    text that repeats with that period would. Returns int32 ``[length]``,
    all -1 when no suffix of ``min_ngram`` tokens occurred before.
    """
    tokens = np.asarray(history, dtype=np.int64)
    out = np.full(length, -1, dtype=np.int32)
    end = tokens.size
    if end < 2 or length == 0:
        return out
    starts, matched = np.flatnonzero(tokens[:-1] == tokens[-1]), 1
    for n in range(2, max_ngram + 1):
        longer = starts[starts >= n - 1]
        longer = longer[tokens[longer - (n - 1)] == tokens[end - n]]
        if longer.size == 0:
            break
        starts, matched = longer, n
    if starts.size == 0 or matched < min_ngram:
        return out
    source = starts[-1] + 1
    period = end - source
    for i in range(length):
        out[i] = tokens[source + i] if i < period else out[i - period]
    return out


def copy_for(
    history: Sequence[int], length: int, phrases: PhraseStore | None = None
) -> tuple[np.ndarray, bool]:
    """The coming round's copy: the context's :func:`continuation`, else
    (when it finds nothing) the phrase store's; and whether it is the store's."""
    copy = continuation(history, length)
    if phrases is None or offers(copy):
        return copy, False
    copy = phrases.continuation(history, length)
    return copy, offers(copy)


def offers(copy: np.ndarray | None) -> bool:
    """Whether a :func:`continuation` (None: no copying) found anything to copy."""
    return copy is not None and copy.size > 0 and bool(copy[0] >= 0)


@dataclass
class PhraseStore:
    """Documents of target-written tokens, searched by their n-grams.

    ``tokens`` is int32: the documents one after another, each followed by
    -1 (on disk, :meth:`save`, the ids + 1 and 0). :meth:`continuation`
    finds the history's longest suffix of ``min_ngram`` to ``max_ngram``
    tokens that occurs in a document, then walks on token by token, each
    time taking the token that most often followed the occurrences still
    matching (the smallest id on a tie).
    Occurrences are found by binary search over the positions sorted by the
    ``max_ngram`` tokens from each one (built with the store: about a second
    for a million tokens).
    """

    tokens: np.ndarray
    min_ngram: int = 3
    max_ngram: int = 6
    _order: np.ndarray = field(init=False, repr=False)
    _keys: list[np.ndarray] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        """Positions sorted by their next ``max_ngram`` tokens, compared two
        tokens (as 32-bit values, 0 for the end of a document) per uint64 key."""
        values = (self.tokens.astype(np.int64) + 1).astype(np.uint64)
        width = 2 * ((self.max_ngram + 1) // 2)
        padded = np.concatenate([values, np.zeros(width, np.uint64)])
        n = values.size
        keys = [
            (padded[i : i + n] << np.uint64(32)) | padded[i + 1 : i + 1 + n]
            for i in range(0, width, 2)
        ]
        self._order = np.lexsort(keys[::-1])
        self._keys = [key[self._order] for key in keys]

    @classmethod
    def from_documents(cls, documents: Sequence[Sequence[int]]) -> PhraseStore:
        parts = [
            np.append(np.asarray(d, dtype=np.int64), _SEPARATOR) for d in documents
        ]
        tokens = np.concatenate(parts) if parts else np.zeros(0)
        return cls(tokens.astype(np.int32))

    @classmethod
    def load(cls, path: str | Path) -> PhraseStore:
        """Read a store :meth:`save` wrote; ValueError if it is not one."""
        values = np.load(path, allow_pickle=False)
        if values.ndim != 1 or values.dtype.kind != "u":
            raise ValueError("it is not a 1-D array of unsigned token ids")
        if values.size and values[-1] != 0:
            raise ValueError("its documents must each be followed by 0")
        return cls((values.astype(np.int64) - 1).astype(np.int32))

    def save(self, path: str | Path) -> None:
        """Write the store as token ids + 1, 0 after each document, in 16
        bits when they fit (half the size of the tokens; temporary file,
        then rename)."""
        values = self.tokens.astype(np.int64) + 1
        small = values.size == 0 or values.max() <= np.iinfo(np.uint16).max
        path = Path(path)
        partial = path.with_name(path.name + ".partial")
        with open(partial, "wb") as file:
            np.save(file, values.astype(np.uint16 if small else np.uint32))
        partial.replace(path)

    def _occurrences(self, pattern: list[int]) -> np.ndarray:
        """Start positions of ``pattern`` within a document."""
        lo, hi = 0, self._order.size
        for i, key in enumerate(self._keys):
            pair = [t + 1 for t in pattern[2 * i : 2 * i + 2]]
            if not pair:
                break
            low = pair + [0] * (2 - len(pair))
            high = pair + [0xFFFFFFFF] * (2 - len(pair))
            first = np.uint64((low[0] << 32) | low[1])
            last = np.uint64((high[0] << 32) | high[1])
            segment = key[lo:hi]
            lo, hi = (
                lo + int(np.searchsorted(segment, first, "left")),
                lo + int(np.searchsorted(segment, last, "right")),
            )
            if lo == hi:
                break
        return self._order[lo:hi]

    def continuation(self, history: Sequence[int], length: int) -> np.ndarray:
        """``length`` tokens after the history's end (int32, -1 past what the
        store can say; all -1 when no suffix of ``min_ngram`` tokens occurs)."""
        out = np.full(length, -1, dtype=np.int32)
        tail = [int(t) for t in history[-self.max_ngram :]]
        if length == 0 or self.tokens.size == 0:
            return out
        for n in range(len(tail), self.min_ngram - 1, -1):
            after = self._occurrences(tail[-n:]) + n
            if after.size:
                break
        else:
            return out
        for i in range(length):
            following = self.tokens[after]
            kept = following != _SEPARATOR
            if not kept.any():
                break
            values, counts = np.unique(following[kept], return_counts=True)
            out[i] = values[np.argmax(counts)]
            after = after[following == out[i]] + 1
        return out
