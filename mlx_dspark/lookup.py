"""Context copying: what followed the last earlier occurrence of the text's end.

Small targets decoding greedily repeat themselves (a loop body, a list's
pattern, a phrase from the prompt), and a one-layer drafter rarely learns to
copy. :func:`continuation` finds the latest earlier occurrence of the
history's longest suffix (``min_ngram`` to ``max_ngram`` tokens: one token
seen before is weak evidence) and returns the tokens that followed it; the drafter adds a fixed bias to those tokens' logits while
its drafts keep following them (:meth:`~mlx_dspark.drafter.DSparkDrafter.propose`).
The drafts are still drawn from the rows they are verified against, so the
output is unchanged; only the proposal moves.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_NGRAM, MAX_NGRAM = 2, 3


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


def offers(copy: np.ndarray | None) -> bool:
    """Whether a :func:`continuation` (None: no copying) found anything to copy."""
    return copy is not None and copy.size > 0 and bool(copy[0] >= 0)
