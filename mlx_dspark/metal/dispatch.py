"""Tree attention entry point: the Metal or CUDA kernel when one can run, else MLX."""

import os

import mlx.core as mx

from .reference import tree_attention_reference

KERNEL_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def _check(q: mx.array, k: mx.array, v: mx.array, bitmask: mx.array) -> None:
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape:
        raise ValueError(
            f"expected q [B, Hq, N, D] and k, v [B, Hkv, P+N, D], got "
            f"{q.shape}, {k.shape}, {v.shape}"
        )
    b, hq, n, d = q.shape
    if k.shape[0] != b or k.shape[3] != d or k.shape[2] < n:
        raise ValueError(f"k/v {k.shape} do not match q {q.shape}")
    if hq % k.shape[1]:
        raise ValueError(
            f"{hq} query heads are not a multiple of {k.shape[1]} kv heads"
        )
    if bitmask.shape[-2:-1] != (n,) or bitmask.ndim not in (2, 3):
        raise ValueError(f"bitmask {bitmask.shape} is not [N, W] or [B, N, W], N = {n}")
    if bitmask.ndim == 3 and bitmask.shape[0] != b:
        raise ValueError(f"bitmask batch {bitmask.shape[0]} != {b}")
    if 32 * bitmask.shape[-1] < n:
        raise ValueError(f"{bitmask.shape[-1]} bitmask words cannot hold {n} nodes")


def kernel_backend() -> str | None:
    """'metal', 'cuda' or None: which kernel tree_attention would use right now."""
    if os.environ.get("DSPARK_FORCE_REFERENCE_ATTENTION", "") not in ("", "0"):
        return None
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


def tree_attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    bitmask: mx.array,
    scale: float,
    *,
    force_reference: bool = False,
) -> mx.array:
    """Attention of N tree nodes over a cached prefix plus the nodes themselves.

    q [B, Hq, N, D]; k, v [B, Hkv, P+N, D] (the last N rows are the nodes);
    bitmask [N, W] or [B, N, W] uint32, bit j of row i set when node i sees node
    j (see ``ancestor_bitmask``). Every node sees the whole prefix.
    """
    _check(q, k, v, bitmask)
    backend = None if force_reference else kernel_backend()
    if backend is None or q.dtype not in KERNEL_DTYPES or q.shape[-1] % 32:
        return tree_attention_reference(q, k, v, bitmask, scale)
    dtype = q.dtype
    k, v = k.astype(dtype), v.astype(dtype)
    if backend == "metal":
        from .tree_metal import tree_attention_metal

        return tree_attention_metal(q, k, v, bitmask, scale)
    from .tree_cuda import tree_attention_cuda

    return tree_attention_cuda(q, k, v, bitmask, scale)
