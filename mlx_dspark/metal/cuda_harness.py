"""Check the CUDA twin on an NVIDIA machine with CuPy (MLX not needed).

    python mlx_dspark/metal/cuda_harness.py [--bench] [--nvcc]

Compiles ``tree_cuda.standalone_source`` (the same source the nvcc test builds)
with cupy.RawKernel, compares against the float64 numpy reference on ragged
shapes and random trees, and prints the max error and kernel time per case.
Exits non-zero when any case is off. ``--nvcc`` compiles with nvcc instead of
NVRTC; set CUDA_PATH if the CUDA headers are not found.
"""

import functools
import importlib
import itertools
import os
import sys
import time
import types
from pathlib import Path

import numpy as np


def _load_kernel_modules():
    # Import the sibling modules as a private package: the real package's
    # __init__ imports MLX, which this machine may not have.
    pkg = types.ModuleType("_dspark_kernels")
    pkg.__path__ = [str(Path(__file__).resolve().parent)]
    sys.modules["_dspark_kernels"] = pkg
    return tuple(
        importlib.import_module(f"_dspark_kernels.{m}")
        for m in ("layout", "tree_cuda", "numpy_reference")
    )


layout, tree_cuda, numpy_reference = _load_kernel_modules()

TOLERANCE = {"float32": 2e-5, "float16": 2.0**-10, "bfloat16": 2.0**-7}


def _random_parents(rng: np.random.Generator, n: int) -> list[int]:
    return [int(rng.integers(-1, i)) if i else -1 for i in range(n)]


def _as_device(cp, x: np.ndarray, dtype: str):
    if dtype == "bfloat16":  # round to nearest even, keep the top 16 bits
        u = x.astype(np.float32).view(np.uint32)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        host = u.astype(np.uint16)
        back = (host.astype(np.uint32) << 16).view(np.float32)
    else:
        host = x.astype(dtype)
        back = host.astype(np.float32)
    return cp.asarray(host), back


def _to_host(cp, x, dtype: str) -> np.ndarray:
    h = cp.asnumpy(x)
    if dtype == "bfloat16":
        return (h.astype(np.uint32) << 16).view(np.float32)
    return h.astype(np.float32)


def _compile(cp, dtype: str, d: int, nvcc: bool):
    source, name = tree_cuda.standalone_source(dtype, d)
    options = ["-std=c++17"]
    include = os.path.join(os.environ.get("CUDA_PATH", "/usr/local/cuda"), "include")
    if os.path.isdir(include):
        options.append(f"-I{include}")
    backend = "nvcc" if nvcc else "nvrtc"
    return cp.RawKernel(source, name, options=tuple(options), backend=backend)


def run_case(cp, kernels, rng, dtype, d, ratio, n, p, batch=2, kv_heads=2, reps=0):
    hq = kv_heads * ratio
    length = p + n
    kernel = kernels(dtype, d)
    bitmask = numpy_reference.ancestor_bitmask(_random_parents(rng, n))
    q, qf = _as_device(cp, rng.standard_normal((batch, hq, n, d)), dtype)
    k, kf = _as_device(cp, rng.standard_normal((batch, kv_heads, length, d)), dtype)
    v, vf = _as_device(cp, rng.standard_normal((batch, kv_heads, length, d)), dtype)
    scale = d**-0.5
    params = layout.kernel_params(
        batch, hq, kv_heads, n, length, bitmask.shape[1], False
    )
    out = cp.empty(q.shape, dtype=q.dtype)
    args = (
        q,
        k,
        v,
        cp.asarray(bitmask),
        cp.asarray(np.array(params, dtype=np.int32)),
        cp.asarray(np.array([scale], dtype=np.float32)),
        out,
    )
    grid, block = layout.launch_geometry(batch, hq, n)
    blocks = tuple(g // b for g, b in zip(grid, block, strict=True))
    kernel(blocks, block, args)
    cp.cuda.Device().synchronize()
    ref = numpy_reference.tree_attention_numpy(qf, kf, vf, bitmask, scale)
    err = float(np.abs(_to_host(cp, out, dtype) - ref).max())
    ms = float("nan")
    if reps:
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        for _ in range(reps):
            kernel(blocks, block, args)
        stop.record()
        stop.synchronize()
        ms = cp.cuda.get_elapsed_time(start, stop) / reps
    return err, ms


def main() -> int:
    import cupy as cp

    bench = "--bench" in sys.argv
    nvcc = "--nvcc" in sys.argv
    rng = np.random.default_rng(0)
    kernels = functools.cache(lambda dtype, d: _compile(cp, dtype, d, nvcc))
    failures = 0
    cases = itertools.product(
        ["float32", "float16", "bfloat16"], [64, 128, 256], [1, 2, 4], [1, 3, 13, 40]
    )
    for dtype, d, ratio, n in cases:
        for p in (0, 5, 37, 130):
            t0 = time.perf_counter()
            err, ms = run_case(cp, kernels, rng, dtype, d, ratio, n, p)
            ok = err <= 4 * TOLERANCE[dtype]
            failures += not ok
            print(
                f"{dtype:8s} D={d:3d} gqa={ratio} N={n:2d} P={p:3d} "
                f"max_err={err:.2e} {'ok' if ok else 'FAIL'} "
                f"({time.perf_counter() - t0:.2f}s)"
            )
    if bench:
        for dtype, n, p in itertools.product(
            ["float16", "bfloat16"], [8, 64], [1024, 8192]
        ):
            _, ms = run_case(
                cp, kernels, rng, dtype, 128, 4, n, p, batch=1, kv_heads=8, reps=50
            )
            print(f"bench {dtype} D=128 Hq=32 Hkv=8 N={n} P={p}: {ms * 1e3:.1f} us")
    print(f"{failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
