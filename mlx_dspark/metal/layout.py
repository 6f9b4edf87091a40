"""Inputs and launch geometry shared by the Metal kernel and its CUDA twin.

Pure Python (MLX is imported only inside ``launch_args``) so the CuPy harness can
use it on machines without MLX.
"""

NSIMD = 4  # simdgroups (warps) of 32 threads per threadgroup (block)
INPUT_NAMES = ["q", "k", "v", "bitmask", "params", "scale"]
OUTPUT_NAMES = ["out"]


def kernel_params(
    batch: int,
    q_heads: int,
    kv_heads: int,
    nodes: int,
    length: int,
    words: int,
    per_batch_mask: bool,
) -> list[int]:
    """The int32 ``params`` input: [B, HQ, HKV, N, L, W, bitmask batch stride]."""
    stride = nodes * words if per_batch_mask else 0
    return [batch, q_heads, kv_heads, nodes, length, words, stride]


def launch_geometry(batch: int, q_heads: int, nodes: int) -> tuple[tuple, tuple]:
    """(grid, threadgroup) in threads, as MLX takes them: one group per query row."""
    return (32 * NSIMD, nodes, batch * q_heads), (32 * NSIMD, 1, 1)


def launch_args(q, k, v, bitmask, scale: float) -> dict:
    """Keyword arguments for calling either kernel object on MLX arrays."""
    import mlx.core as mx

    b, hq, n, d = q.shape
    bitmask = bitmask.astype(mx.uint32)
    params = kernel_params(
        b, hq, k.shape[1], n, k.shape[2], bitmask.shape[-1], bitmask.ndim == 3
    )
    grid, threadgroup = launch_geometry(b, hq, n)
    return {
        "inputs": [
            q,
            k,
            v,
            bitmask,
            mx.array(params, dtype=mx.int32),
            mx.array([scale], dtype=mx.float32),
        ],
        "template": [("T", q.dtype), ("D", d), ("NSIMD", NSIMD)],
        "grid": grid,
        "threadgroup": threadgroup,
        "output_shapes": [q.shape],
        "output_dtypes": [q.dtype],
    }
