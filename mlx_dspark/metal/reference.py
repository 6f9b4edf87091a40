"""Pure-MLX tree attention, the reference every kernel is checked against."""

import mlx.core as mx

from .numpy_reference import ancestor_bitmask

__all__ = ["ancestor_bitmask", "mask_from_bitmask", "tree_attention_reference"]


def mask_from_bitmask(bitmask: mx.array, prefix_len: int) -> mx.array:
    """Boolean mask [..., N, prefix_len + N] (True = visible) from [..., N, W] words."""
    bitmask = mx.array(bitmask).astype(mx.uint32)
    n = bitmask.shape[-2]
    j = mx.arange(n)
    words = mx.take(bitmask, j // 32, axis=-1)
    nodes = ((words >> (j % 32).astype(mx.uint32)) & 1).astype(mx.bool_)
    prefix = mx.ones((*bitmask.shape[:-1], prefix_len), dtype=mx.bool_)
    return mx.concatenate([prefix, nodes], axis=-1)


def tree_attention_reference(
    q: mx.array, k: mx.array, v: mx.array, bitmask: mx.array, scale: float
) -> mx.array:
    """q [B, Hq, N, D], k/v [B, Hkv, P+N, D], bitmask [N, W] or [B, N, W]."""
    mask = mask_from_bitmask(bitmask, k.shape[2] - q.shape[2])
    if mask.ndim == 3:
        mask = mask[:, None]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
