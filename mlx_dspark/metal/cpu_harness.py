"""Run MLX-generated Metal kernels on the CPU: capture, compile with g++, execute.

MLX prints the full Metal source of a custom kernel when it is called with
``verbose=True``; on a CPU-only build that call still works inside
``mx.export_function`` tracing. The source is compiled against
``shim/metal_shim.h`` with a generated ``main`` that loads the inputs from
files, runs every threadgroup on std::threads and writes the outputs back.
Binaries run in a subprocess so a bad index kills only the binary.
"""

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

SHIM_DIR = Path(__file__).parent / "shim"

_BLOCK = re.compile(r"Generated source code for `(\w+)`:\n```\n(.*?)\n```", re.S)
_SIGNATURE = re.compile(r"\[\[kernel\]\] void (\w+)\((.*?)\)\s*\{", re.S)
_INSTANCE = re.compile(r"decltype\((\w+(?:<[^>]*>)?)\)")
_BUFFER = re.compile(r"^(.*?)\*\s*(\w+)\s*\[\[buffer\(\d+\)\]\]$")
_ATTRIBUTE = re.compile(r"^(uint3?)\s+(\w+)\s*\[\[(\w+)\]\]$")


def trace(fn, *args) -> None:
    """Trace ``fn(*args)`` with mx.export_function; verbose kernels print their source."""
    with tempfile.TemporaryDirectory() as d:
        mx.export_function(os.path.join(d, "trace.mlxfn"), fn, *args)


def capture_sources(
    code: str, args: list[str] | None = None, timeout: float = 120
) -> list[tuple[str, str]]:
    """Run ``code`` in a fresh interpreter, return the (name, source) pairs it printed.

    MLX prints from C++, so a subprocess is the simplest way to see its stdout.
    """
    proc = subprocess.run(
        [sys.executable, "-c", code, *(args or [])],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"tracing failed:\n{proc.stderr[-4000:]}")
    return _BLOCK.findall(proc.stdout)


@dataclass
class Param:
    name: str
    ctype: str  # element type (with const) for buffers, uint/uint3 for attributes
    is_buffer: bool


def parse_signature(source: str) -> tuple[str, list[Param]]:
    """The instantiated kernel expression and its parameters, in order."""
    sig = _SIGNATURE.search(source)
    inst = _INSTANCE.search(source)
    if sig is None or inst is None:
        raise ValueError("no MLX kernel signature found in the source")
    params = []
    for raw in sig.group(2).split(","):
        raw = " ".join(raw.split())
        if m := _BUFFER.match(raw):
            ctype = " ".join(
                w for w in m.group(1).split() if w not in ("device", "constant")
            )
            params.append(Param(m.group(2), ctype, True))
        elif m := _ATTRIBUTE.match(raw):
            params.append(Param(m.group(2), m.group(1), False))
        else:
            raise ValueError(f"unsupported kernel parameter: {raw!r}")
    return inst.group(1), params


def _main_source(source: str, outputs: list[str]) -> str:
    instance, params = parse_signature(source)
    lines = ['#include "metal_shim.h"', source, "", "int main(int argc, char** argv) {"]
    lines.append('  const std::string dir = std::string(argv[1]) + "/";')
    lines.append(
        "  const uint3 grid{uint(std::stoul(argv[2])), uint(std::stoul(argv[3])),"
        " uint(std::stoul(argv[4]))};"
    )
    lines.append(
        "  const uint3 group{uint(std::stoul(argv[5])), uint(std::stoul(argv[6])),"
        " uint(std::stoul(argv[7]))};"
    )
    args = []
    for p in params:
        if not p.is_buffer:
            args.append(f"ids.{p.name}")
            continue
        if p.name in outputs:
            idx = 8 + outputs.index(p.name)
            lines.append(
                f"  std::vector<unsigned char> buf_{p.name}(std::stoull(argv[{idx}]), 0xff);"
            )
        else:
            lines.append(
                f'  auto buf_{p.name} = shim::read_file((dir + "{p.name}.bin").c_str());'
            )
        args.append(f"reinterpret_cast<{p.ctype}*>(buf_{p.name}.data())")
    lines.append("  shim::launch(grid, group, [&](const shim::Ids& ids) {")
    lines.append(f"    {instance}(" + ", ".join(args) + ");")
    lines.append("  });")
    for name in outputs:
        lines.append(f'  shim::write_file((dir + "{name}.bin").c_str(), buf_{name});')
    lines.append("  return 0;")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _precompiled_shim(build_dir: Path, flags: list[str]) -> Path:
    """Precompile the shim once per flag set; it dominates compile time."""
    key = hashlib.sha1(
        (" ".join(flags) + (SHIM_DIR / "metal_shim.h").read_text()).encode()
    ).hexdigest()[:12]
    pch_dir = build_dir / f"shim_{key}"
    gch = pch_dir / "metal_shim.h.gch"
    if not gch.exists():
        tmp = Path(tempfile.mkdtemp(dir=build_dir))
        for f in SHIM_DIR.iterdir():
            shutil.copy(f, tmp)
        proc = subprocess.run(
            [
                *flags,
                "-x",
                "c++-header",
                str(tmp / "metal_shim.h"),
                "-o",
                str(tmp / "metal_shim.h.gch"),
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"g++ failed on the shim:\n{proc.stderr[-6000:]}")
        try:
            tmp.rename(pch_dir)
        except OSError:  # built concurrently by someone else
            shutil.rmtree(tmp, ignore_errors=True)
    return pch_dir


def compile_kernel(
    source: str,
    outputs: list[str],
    build_dir: str | Path,
    *,
    sanitize: bool = True,
    opt: str = "-O1",
) -> Path:
    """Compile a generated Metal source with g++; returns the binary path (cached).

    ``sanitize`` adds AddressSanitizer, so an out-of-bounds read fails loudly
    instead of returning garbage.
    """
    main = _main_source(source, outputs)
    cxx = shutil.which("g++") or "c++"
    flags = [
        cxx,
        "-std=c++20",
        opt,
        "-pthread",
        "-Wno-attributes",
    ]
    if sanitize:
        flags += ["-fsanitize=address", "-fno-omit-frame-pointer"]
    key = hashlib.sha1((main + " ".join(flags)).encode()).hexdigest()[:16]
    build_dir = Path(build_dir)
    binary = build_dir / f"kernel_{key}"
    if binary.exists():
        return binary
    build_dir.mkdir(parents=True, exist_ok=True)
    pch_dir = _precompiled_shim(build_dir, flags)
    cpp = build_dir / f"kernel_{key}.cpp"
    cpp.write_text(main)
    tmp = build_dir / f"kernel_{key}.{os.getpid()}.tmp"
    proc = subprocess.run(
        [*flags, f"-I{pch_dir}", str(cpp), "-o", str(tmp)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"g++ failed:\n{proc.stderr[-6000:]}")
    tmp.rename(binary)
    return binary


def _to_bytes(x) -> bytes:
    x = mx.array(x) if not isinstance(x, mx.array) else x
    if x.dtype == mx.bfloat16:
        x = x.view(mx.uint16)
    return np.ascontiguousarray(np.array(x)).tobytes()


def _from_bytes(raw: bytes, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    if dtype == mx.bfloat16:
        return mx.array(np.frombuffer(raw, np.uint16).reshape(shape)).view(mx.bfloat16)
    np_dtype = np.array(mx.zeros((1,), dtype)).dtype
    return mx.array(np.frombuffer(raw, np_dtype).reshape(shape))


def run_kernel(
    binary: str | Path,
    inputs: dict,
    outputs: dict[str, tuple[tuple[int, ...], mx.Dtype]],
    grid: tuple[int, int, int],
    threadgroup: tuple[int, int, int],
    *,
    timeout: float = 120,
) -> dict[str, mx.array]:
    """Run a compiled kernel on named inputs; outputs maps name -> (shape, dtype)."""
    with tempfile.TemporaryDirectory() as d:
        for name, x in inputs.items():
            Path(d, f"{name}.bin").write_bytes(_to_bytes(x))
        sizes = [
            str(int(np.prod(shape)) * dtype.size) for shape, dtype in outputs.values()
        ]
        argv = [str(binary), d, *map(str, grid), *map(str, threadgroup), *sizes]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(
                f"kernel exited with {proc.returncode}:\n{proc.stderr[-4000:]}"
            )
        return {
            name: _from_bytes(Path(d, f"{name}.bin").read_bytes(), shape, dtype)
            for name, (shape, dtype) in outputs.items()
        }
