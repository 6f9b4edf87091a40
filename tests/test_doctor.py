import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlx_dspark.machine import (
    classify_blas,
    detect_blas,
    model_bytes,
    parse_meminfo,
    roofline,
    system_info,
)

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
VENV = "/work/venv/lib/python3.11/site-packages"
MLX_BLAS = f"{VENV}/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0"
NUMPY_OPENBLAS = f"{VENV}/numpy.libs/libscipy_openblas64_-32a4b2a6.so"


def maps_line(path: str, perms: str = "r-xp") -> str:
    return f"7f0000000000-7f0000001000 {perms} 00000000 fe:00 123    {path}"


def maps(*paths: str) -> str:
    lines = [
        maps_line("/usr/bin/python3.11"),
        "7f0000002000-7f0000003000 rw-p 00000000 00:00 0 ",
        "7f0000004000-7f0000005000 rw-p 00000000 00:00 0    [heap]",
    ]
    for path in paths:
        lines += [maps_line(path, "r--p"), maps_line(path)]
    lines.append(maps_line("/lib/x86_64-linux-gnu/libc.so.6"))
    return "\n".join(lines) + "\n"


def run_doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlx_dspark.doctor", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
    )


@pytest.mark.parametrize(
    "paths, kind, library",
    [
        ([MLX_BLAS], "reference", MLX_BLAS),
        # numpy's vendored OpenBLAS is private to numpy: MLX still calls netlib.
        ([NUMPY_OPENBLAS, MLX_BLAS], "reference", MLX_BLAS),
        ([NUMPY_OPENBLAS], "unknown", None),
        # LD_PRELOAD puts OpenBLAS in the global scope, ahead of the bundled one.
        (
            [
                MLX_BLAS,
                "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so",
            ],
            "openblas",
            "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so",
        ),
        # Debian's libblas.so.3 alternative may point at OpenBLAS or at netlib.
        (
            ["/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"],
            "openblas",
            "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
        ),
        (
            ["/usr/lib/x86_64-linux-gnu/blas/libblas.so.3.11.0"],
            "reference",
            "/usr/lib/x86_64-linux-gnu/blas/libblas.so.3.11.0",
        ),
        (
            ["/usr/lib/x86_64-linux-gnu/libcblas.so.3"],
            "reference",
            "/usr/lib/x86_64-linux-gnu/libcblas.so.3",
        ),
        (
            [MLX_BLAS, "/opt/intel/oneapi/mkl/lib/libmkl_rt.so.2"],
            "mkl",
            "/opt/intel/oneapi/mkl/lib/libmkl_rt.so.2",
        ),
        (
            ["/usr/lib/x86_64-linux-gnu/blis-openmp/libblis.so.4"],
            "blis",
            "/usr/lib/x86_64-linux-gnu/blis-openmp/libblis.so.4",
        ),
        ([], "unknown", None),
    ],
)
def test_classify_blas(paths, kind, library):
    assert classify_blas(maps(*paths)) == (kind, library)


def test_classify_blas_empty_text():
    assert classify_blas("") == ("unknown", None)


def test_detect_blas_flags_slow_matmul():
    info = detect_blas(gflops=1.0)
    assert info.slow
    assert info.gflops == 1.0
    if sys.platform.startswith("linux"):
        assert "libopenblas0-pthread" in info.fix or "LD_PRELOAD=" in info.fix
        assert info.kind == "reference"


def test_detect_blas_flags_reference_by_name():
    info = detect_blas(gflops=1000.0)
    assert info.slow == (info.kind == "reference")
    assert (info.fix is None) == (not info.slow or not sys.platform.startswith("linux"))


def test_roofline():
    assert roofline(1e9, 25e9) == pytest.approx(25.0)
    assert roofline(270e6, 27e9) == pytest.approx(100.0)
    with pytest.raises(ValueError):
        roofline(0, 1e9)


def test_model_bytes_float():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))
    mx.eval(model.parameters())
    assert model_bytes(model) == (64 * 32 + 32 + 32 * 8) * 4
    model.set_dtype(mx.float16)
    assert model_bytes(model) == (64 * 32 + 32 + 32 * 8) * 2


def test_model_bytes_quantized():
    model = nn.Sequential(nn.Embedding(256, 64), nn.Linear(64, 128))
    nn.quantize(model, group_size=64, bits=4)
    assert isinstance(model.layers[1], nn.QuantizedLinear)

    def packed(rows, cols):  # 4-bit weights + one float32 scale and bias per group
        return rows * cols // 2 + 2 * rows * (cols // 64) * 4

    assert model_bytes(model) == packed(256, 64) + packed(128, 64) + 128 * 4


def test_model_bytes_counts_shared_arrays_once():
    model = nn.Module()
    model.a = mx.zeros((10, 10))
    model.b = model.a
    assert model_bytes(model) == 400


def test_parse_meminfo():
    text = "MemTotal:       24684096 kB\nMemFree:  1 kB\nMemAvailable:   24233200 kB\n"
    assert parse_meminfo(text) == (24684096 * 1024, 24233200 * 1024)
    assert parse_meminfo("") == (None, None)


def test_system_info():
    info = system_info()
    assert info["backend"] in ("cpu", "metal", "cuda")
    assert info["mlx"] == mx.__version__
    assert info["cpu_count"] >= 1
    assert info["memory_total"] is None or info["memory_total"] > 2**20
    json.dumps(info)


def test_doctor_cli_table():
    result = run_doctor()
    assert result.returncode == 0, result.stderr
    for field in (
        "Backend",
        "Device",
        "MLX",
        "mlx-lm",
        "Memory",
        "GFLOP/s",
        "GB/s",
        "BLAS",
    ):
        assert field in result.stdout
    if "reference" in result.stdout:
        assert "warning:" in result.stdout
        assert "fix:" in result.stdout


def test_doctor_cli_json():
    result = run_doctor("--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    for key in ("backend", "device", "mlx", "mlx_lm", "memory_total", "cpu_count"):
        assert key in report
    assert report["matmul_gflops"] > 0
    assert report["bandwidth"] > 1e8
    assert set(report["blas"]) == {"kind", "library", "gflops", "slow", "fix"}


@pytest.mark.skipif(not Path(OPENBLAS).exists(), reason="Debian OpenBLAS not installed")
def test_doctor_sees_preloaded_openblas():
    result = run_doctor("--json", env={"LD_PRELOAD": OPENBLAS})
    assert result.returncode == 0, result.stderr
    blas = json.loads(result.stdout)["blas"]
    if json.loads(result.stdout)["backend"] == "cpu":
        assert blas["kind"] == "openblas"
        assert not blas["slow"], blas
