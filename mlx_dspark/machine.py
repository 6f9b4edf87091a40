"""Measurements of the machine that speculative decoding runs on.

Each measurement takes well under a second or two, so they can run at the start
of a benchmark and be reported next to its numbers.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

# Netlib's reference sgemm runs at a few GFLOP/s on any current CPU core; an
# optimised BLAS (OpenBLAS, MKL, BLIS, Accelerate) does tens to hundreds.
SLOW_BLAS_GFLOPS = 15.0

# Checked in order: when an optimised BLAS is mapped next to MLX's bundled
# reference one, it got there through LD_PRELOAD and is the one MLX calls.
_BLAS_KINDS = (
    ("mkl", ("libmkl",)),
    ("openblas", ("openblas",)),
    ("blis", ("libblis",)),
    ("atlas", ("atlas",)),
    ("accelerate", ("accelerate.framework", "veclib")),
    ("reference", ("libblas", "libcblas")),
)


@dataclass(frozen=True)
class BlasInfo:
    kind: (
        str  # "reference", "openblas", "mkl", "blis", "atlas", "accelerate", "unknown"
    )
    library: str | None  # path of the shared library, when known
    gflops: float | None  # float32 matmul on the CPU backend
    slow: bool
    fix: str | None  # how to get a fast BLAS, when slow


def _timed_best(fn, repeats: int) -> float:
    mx.eval(fn())  # warm up: allocation, library loading, caches
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s that MLX reaches on the default device.

    The array is summed as uint32: a float sum on the CPU backend is a serial
    dependency chain and measures adder latency, not memory.
    """
    x = mx.ones((nbytes // 4,), dtype=mx.uint32)
    mx.eval(x)
    seconds = _timed_best(x.sum, repeats)
    del x
    mx.clear_cache()
    return nbytes / seconds


def measure_matmul_gflops(
    n: int = 512, repeats: int = 5, device: mx.Device | None = None
) -> float:
    """Float32 ``n x n`` matmul throughput in GFLOP/s, best of ``repeats``."""
    with mx.stream(device or mx.default_device()):
        # Own keys: a seeded sampler's global key state is left alone.
        a = mx.random.normal((n, n), key=mx.random.key(0))
        b = mx.random.normal((n, n), key=mx.random.key(1))
        mx.eval(a, b)
        seconds = _timed_best(lambda: a @ b, repeats)
    return 2 * n**3 / seconds / 1e9


def classify_blas(maps: str) -> tuple[str, str | None]:
    """Which BLAS a process uses, from the text of its /proc/<pid>/maps.

    Returns ``(kind, library_path)``; ``("unknown", None)`` when no BLAS is mapped.
    Libraries vendored by other wheels (numpy's ``numpy.libs/libscipy_openblas64_``)
    are private to those packages: their symbols are suffixed or local, MLX
    never calls them.
    """
    paths = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith("/"):
            continue
        path = fields[5].strip()
        vendor_dir = Path(path).parent.name
        if vendor_dir.endswith(".libs") and not vendor_dir.startswith("mlx"):
            continue
        if "scipy_openblas" in path:
            continue
        if path not in paths:
            paths.append(path)
    for kind, needles in _BLAS_KINDS:
        for path in paths:
            lowered = path.lower()
            if any(needle in lowered for needle in needles):
                return kind, path
    return "unknown", None


def openblas_fix() -> str:
    """How to get MLX onto Debian's OpenBLAS (``mlx_dspark`` loads it by itself)."""
    triple = f"{platform.machine()}-linux-gnu"
    library = f"/usr/lib/{triple}/openblas-pthread/libopenblas.so.0"
    if Path(library).exists():
        return (
            "OpenBLAS is installed but not in use: import mlx_dspark before "
            f"mlx.core, or run with LD_PRELOAD={library} <command>"
        )
    return (
        "apt-get install libopenblas0-pthread; mlx_dspark then loads it "
        "by itself (check with mlx_dspark.doctor)"
    )


def detect_blas(gflops: float | None = None) -> BlasInfo:
    """Identify the BLAS behind MLX's CPU backend, and whether it is slow.

    The library is named from the process's mapped files; whether it is the
    one MLX calls is decided by speed: an optimised library that is mapped but
    runs matrix products at reference speed is not in use (it was loaded
    after ``mlx.core``), so the reference BLAS is reported. Pass ``gflops`` to
    reuse a measurement taken on the CPU device.
    """
    if gflops is None:
        gflops = measure_matmul_gflops(device=mx.cpu)
    if sys.platform == "darwin":
        kind, library = "accelerate", None
    else:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            maps = ""
        kind, library = classify_blas(maps)
        if kind != "reference" and gflops < SLOW_BLAS_GFLOPS:
            kind, library = "reference", None
    slow = kind == "reference" or gflops < SLOW_BLAS_GFLOPS
    fix = openblas_fix() if slow and sys.platform.startswith("linux") else None
    return BlasInfo(kind, library, gflops, slow, fix)


def backend() -> str:
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def parse_meminfo(text: str) -> tuple[int | None, int | None]:
    """(total, available) bytes from the text of /proc/meminfo."""
    values = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key] = int(parts[0]) * 1024  # reported in kB
    return values.get("MemTotal"), values.get("MemAvailable")


def _sysctl_int(name: str) -> int | None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    value = ctypes.c_uint64(0)
    size = ctypes.c_size_t(ctypes.sizeof(value))
    if libc.sysctlbyname(
        name.encode(), ctypes.byref(value), ctypes.byref(size), None, 0
    ):
        return None
    return value.value


def memory() -> tuple[int | None, int | None]:
    """(total, available) system memory in bytes; None where unknown.

    macOS keeps little memory truly free, so "available" is left unknown there;
    use the Metal device's recommended working set instead.
    """
    if sys.platform == "darwin":
        return _sysctl_int("hw.memsize"), None
    try:
        return parse_meminfo(Path("/proc/meminfo").read_text())
    except OSError:
        return None, None


def cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))  # honours container CPU limits
    return os.cpu_count() or 1


def system_info() -> dict:
    """Backend, device, versions, memory and CPUs, as plain JSON-able values."""
    device_info = {
        key: value
        for key, value in mx.device_info().items()
        if isinstance(value, (str, int, float, bool))
    }
    total, available = memory()
    return {
        "backend": backend(),
        "device": device_info.get("device_name") or platform.processor() or None,
        "architecture": device_info.get("architecture") or platform.machine(),
        "device_info": device_info,
        "mlx": mx.__version__,
        "mlx_lm": _version("mlx-lm"),
        "memory_total": total,
        "memory_available": available,
        "cpu_count": cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def roofline(bytes_per_token: float, bandwidth: float) -> float:
    """Tokens/s ceiling of a decoder that must read ``bytes_per_token`` per token."""
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
    return bandwidth / bytes_per_token


def model_bytes(model: nn.Module) -> int:
    """Bytes of a module's parameters; quantized weights count their packed size."""
    arrays = {id(v): v for _, v in tree_flatten(model.parameters())}
    return sum(v.nbytes for v in arrays.values())


def diagnose() -> dict:
    """Everything ``mlx_dspark.doctor`` reports, as JSON-able values."""
    info = system_info()
    gflops = measure_matmul_gflops()
    cpu_gflops = gflops if info["backend"] == "cpu" else None
    blas = detect_blas(cpu_gflops)
    return {
        **info,
        "matmul_gflops": gflops,
        "bandwidth": measure_bandwidth(),
        "blas": asdict(blas),
    }
