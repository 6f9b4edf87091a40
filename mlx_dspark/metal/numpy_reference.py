"""Tree masks and a float64 attention reference in plain numpy.

Kept free of MLX so the CuPy harness can use it on machines without MLX.
"""

import numpy as np


def ancestor_bitmask(parents: list[int], words: int | None = None) -> np.ndarray:
    """Visibility bitmask [N, words] (uint32) of a tree given in topological order.

    ``parents[i]`` is the index of node i's parent, or -1 when the parent is the
    last prefix token. Bit j of row i is set when node j is node i or one of its
    ancestors.
    """
    n = len(parents)
    needed = max(1, (n + 31) // 32)
    words = needed if words is None else words
    if words < needed:
        raise ValueError(f"{n} nodes need at least {needed} bitmask words")
    bits = np.zeros((n, words), dtype=np.uint32)
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: parents must precede their children")
        if p >= 0:
            bits[i] = bits[p]
        bits[i, i // 32] |= np.uint32(1 << (i % 32))
    return bits


def bool_mask(bitmask: np.ndarray, prefix_len: int) -> np.ndarray:
    """Expand a bitmask [..., N, W] to a boolean mask [..., N, prefix_len + N]."""
    n = bitmask.shape[-2]
    j = np.arange(n)
    words = np.take(bitmask, j // 32, axis=-1)
    nodes = ((words >> (j % 32).astype(np.uint32)) & 1).astype(bool)
    prefix = np.ones((*bitmask.shape[:-1], prefix_len), dtype=bool)
    return np.concatenate([prefix, nodes], axis=-1)


def tree_attention_numpy(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, bitmask: np.ndarray, scale: float
) -> np.ndarray:
    """Float64 tree attention; q [B, Hq, N, D], k/v [B, Hkv, P+N, D]."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    n, length = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    k = np.repeat(k, rep, axis=1)
    v = np.repeat(v, rep, axis=1)
    mask = bool_mask(bitmask, length - n)
    if mask.ndim == 3:
        mask = mask[:, None]
    scores = np.where(mask, scale * q @ k.swapaxes(-1, -2), -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    w = np.exp(scores)
    return (w / w.sum(axis=-1, keepdims=True)) @ v
