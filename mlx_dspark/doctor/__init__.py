"""Check the machine: backend, versions, memory, matmul speed, bandwidth, BLAS.

Usage: ``mlx_dspark doctor [--json]`` or ``mlx_dspark.doctor [--json]``; the
command line is in :mod:`mlx_dspark.cli.doctor`.
"""

from __future__ import annotations

from dataclasses import asdict

from ..machine import (
    detect_blas,
    measure_bandwidth,
    measure_matmul_gflops,
    system_info,
)


def diagnose() -> dict:
    """Everything the doctor reports, as JSON-able values."""
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
