"""Tree-attention kernels: reference, dispatch, Metal body on g++, CUDA twin on nvcc."""

import json
import os
import shutil
import subprocess
import sys
import zlib
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np
import pytest

from mlx_dspark.metal import cpu_harness, dispatch, layout, tree_cuda, tree_metal
from mlx_dspark.metal.numpy_reference import (
    ancestor_bitmask,
    bool_mask,
    tree_attention_numpy,
)
from mlx_dspark.metal.reference import mask_from_bitmask, tree_attention_reference

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# |kernel - float64 reference| <= ATOL + RTOL * |reference|: output rounding plus
# float32 accumulation.
RTOL = {"float32": 1e-5, "float16": 2.0**-10, "bfloat16": 2.0**-7}
ATOL = {"float32": 1e-5, "float16": 1e-4, "bfloat16": 1e-3}

# (dtype, head dim, GQA ratio, nodes N, prefix P, batch, per-batch mask)
CASES = [
    ("float32", 64, 1, 1, 0, 1, False),
    ("float32", 64, 2, 3, 5, 1, False),
    ("float32", 64, 4, 7, 37, 1, False),
    ("float32", 64, 1, 13, 130, 1, False),
    ("float32", 64, 1, 40, 37, 2, True),
    ("float32", 128, 2, 13, 0, 1, False),
    ("float32", 128, 4, 3, 130, 1, False),
    ("float32", 128, 1, 64, 5, 1, False),
    ("float32", 256, 1, 7, 5, 1, False),
    ("float32", 256, 2, 1, 37, 1, False),
    ("float16", 64, 4, 13, 5, 1, False),
    ("float16", 128, 1, 7, 130, 1, False),
    ("float16", 128, 2, 40, 0, 1, False),
    ("float16", 256, 4, 3, 37, 1, False),
    ("float16", 256, 1, 1, 130, 1, False),
    ("bfloat16", 64, 2, 1, 130, 1, False),
    ("bfloat16", 128, 4, 13, 37, 1, False),
    ("bfloat16", 128, 1, 3, 5, 2, True),
    ("bfloat16", 256, 2, 7, 0, 1, False),
    ("bfloat16", 256, 4, 40, 5, 1, False),
]

# Each broken variant is a one-token edit of the real body that these cases catch.
BROKEN = {
    "last_key_dropped": ("j < L;", "j < L - 1;"),
    "first_mask_word_only": ("mrow[t >> 5]", "mrow[0]"),
    "prefix_node_off_by_one": ("const int t = j - P;", "const int t = j - P + 1;"),
    # Reads one row past the end for the last kv head: AddressSanitizer aborts.
    "value_row_off_by_one": ("vbase + (size_t)j * D", "vbase + (size_t)(j + 1) * D"),
}
BROKEN_CASES = [
    ("float32", 64, 2, 40, 37, 1, False),
    ("float32", 64, 1, 7, 5, 1, False),
]

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def _tree(rng: np.random.Generator, n: int) -> list[int]:
    # Random parents: several branches, some nodes hanging off the prefix.
    return [int(rng.integers(-1, i)) if i else -1 for i in range(n)]


def _make_case(case):
    dtype, d, ratio, n, p, batch, per_batch = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))
    kv_heads = 2
    shape_q = (batch, kv_heads * ratio, n, d)
    shape_kv = (batch, kv_heads, p + n, d)
    q, k, v = (
        mx.array(rng.standard_normal(s).astype(np.float32)).astype(DTYPES[dtype])
        for s in (shape_q, shape_kv, shape_kv)
    )
    if per_batch:
        bitmask = np.stack([ancestor_bitmask(_tree(rng, n)) for _ in range(batch)])
    else:
        bitmask = ancestor_bitmask(_tree(rng, n))
    return q, k, v, bitmask, float(d**-0.5)


def _f32(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32))


# ---------------------------------------------------------------- reference


def test_ancestor_bitmask():
    bits = ancestor_bitmask([-1, 0, 0, 1, -1, 4])
    assert bits.dtype == np.uint32 and bits.shape == (6, 1)
    assert bits[:, 0].tolist() == [0b1, 0b11, 0b101, 0b1011, 0b10000, 0b110000]
    chain = ancestor_bitmask(list(range(-1, 39)))
    assert chain.shape == (40, 2)
    assert chain[39].tolist() == [0xFFFFFFFF, 0xFF]
    assert ancestor_bitmask([-1], words=2).shape == (1, 2)
    with pytest.raises(ValueError):
        ancestor_bitmask([-1, 2, 0])
    with pytest.raises(ValueError):
        ancestor_bitmask([-1] * 40, words=1)


def test_mask_from_bitmask_matches_numpy():
    rng = np.random.default_rng(1)
    for n, p in [(1, 0), (7, 5), (40, 3)]:
        bits = ancestor_bitmask(_tree(rng, n))
        mask = np.array(mask_from_bitmask(mx.array(bits), p))
        np.testing.assert_array_equal(mask, bool_mask(bits, p))
        assert mask[:, :p].all() and mask[np.arange(n), p + np.arange(n)].all()
        assert not np.triu(mask[:, p:], 1).any()  # parents precede children
    stacked = np.stack([bits, bits[::-1]])
    np.testing.assert_array_equal(
        np.array(mask_from_bitmask(mx.array(stacked), 2)), bool_mask(stacked, 2)
    )


@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[7]])
def test_reference_matches_numpy(case):
    q, k, v, bitmask, scale = _make_case(case)
    out = tree_attention_reference(q, k, v, mx.array(bitmask), scale)
    want = tree_attention_numpy(_f32(q), _f32(k), _f32(v), bitmask, scale)
    np.testing.assert_allclose(_f32(out), want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- dispatch


def test_dispatch_falls_back_to_reference_here():
    q, k, v, bitmask, scale = _make_case(CASES[1])
    assert dispatch.kernel_backend() is None
    out = dispatch.tree_attention(q, k, v, mx.array(bitmask), scale)
    want = tree_attention_reference(q, k, v, mx.array(bitmask), scale)
    np.testing.assert_array_equal(_f32(out), _f32(want))


def test_dispatch_backend_selection(monkeypatch):
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.delenv("DSPARK_FORCE_REFERENCE_ATTENTION", raising=False)
    assert dispatch.kernel_backend() == "metal"
    monkeypatch.setenv("DSPARK_FORCE_REFERENCE_ATTENTION", "1")
    assert dispatch.kernel_backend() is None
    monkeypatch.delenv("DSPARK_FORCE_REFERENCE_ATTENTION")
    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert dispatch.kernel_backend() == "cuda"
    # force_reference never touches a kernel, even where one is "available".
    q, k, v, bitmask, scale = _make_case(CASES[0])
    out = dispatch.tree_attention(
        q, k, v, mx.array(bitmask), scale, force_reference=True
    )
    assert out.shape == q.shape


def test_dispatch_rejects_bad_shapes():
    q, k, v, bitmask, scale = _make_case(CASES[2])  # 8 q heads, 2 kv heads
    with pytest.raises(ValueError, match="multiple"):
        dispatch.tree_attention(q[:, :3], k, v, mx.array(bitmask), scale)
    with pytest.raises(ValueError, match="bitmask"):
        dispatch.tree_attention(q, k, v, mx.array(bitmask[:-1]), scale)
    with pytest.raises(ValueError):
        dispatch.tree_attention(q, k[:, :, :3], v[:, :, :3], mx.array(bitmask), scale)


# ---------------------------------------------------------------- Metal on g++


def _variant_source(variant: str) -> str:
    if variant == "ok":
        return tree_metal.METAL_SOURCE
    old, new = BROKEN[variant]
    assert tree_metal.METAL_SOURCE.count(old) == 1
    return tree_metal.METAL_SOURCE.replace(old, new)


_TRACE = """
import json, sys
import mlx.core as mx
from mlx_dspark.metal import cpu_harness, tree_metal

for name, dtype, d, src in json.load(open(sys.argv[1])):
    dt = getattr(mx, dtype)
    q, kv = mx.zeros((1, 2, 3, d), dt), mx.zeros((1, 1, 8, d), dt)
    fn = lambda q, k, v, m: tree_metal.tree_attention_metal(
        q, k, v, m, 0.5, source=src, name=name, verbose=True
    )
    cpu_harness.trace(fn, q, kv, kv, mx.zeros((3, 1), mx.uint32))
"""


@pytest.fixture(scope="module")
def binaries(tmp_path_factory):
    """Capture every generated source in one traced run, compile them all."""
    specs = sorted({("ok", c[0], c[1]) for c in CASES})
    specs += [(variant, *BROKEN_CASES[0][:2]) for variant in BROKEN]
    build = tmp_path_factory.mktemp("metal_build")
    spec_file = build / "specs.json"
    spec_file.write_text(
        json.dumps([[v, dt, d, _variant_source(v)] for v, dt, d in specs])
    )
    sources = cpu_harness.capture_sources(_TRACE, args=[str(spec_file)])
    assert len(sources) == len(specs)
    # Build the precompiled shim once before compiling in parallel.
    cpu_harness.compile_kernel(sources[0][1], ["out"], build)
    with ThreadPoolExecutor(max_workers=2) as pool:
        bins = pool.map(
            lambda s: cpu_harness.compile_kernel(s[1], ["out"], build), sources
        )
        return {
            "sources": dict(zip(specs, (s for _, s in sources), strict=True)),
            "bins": dict(zip(specs, bins, strict=True)),
        }


def _kernel_error(binary, case) -> float:
    q, k, v, bitmask, scale = _make_case(case)
    args = layout.launch_args(q, k, v, mx.array(bitmask), scale)
    outputs = {"out": (args["output_shapes"][0], args["output_dtypes"][0])}
    res = cpu_harness.run_kernel(
        binary,
        dict(zip(layout.INPUT_NAMES, args["inputs"], strict=True)),
        outputs,
        args["grid"],
        args["threadgroup"],
    )
    got = res["out"]
    assert got.dtype == q.dtype and got.shape == q.shape
    want = tree_attention_numpy(_f32(q), _f32(k), _f32(v), bitmask, scale)
    dtype = case[0]
    excess = np.abs(_f32(got) - want) - (ATOL[dtype] + RTOL[dtype] * np.abs(want))
    return float(np.nan_to_num(excess, nan=np.inf).max())


@needs_gxx
def test_generated_signature(binaries):
    source = binaries["sources"][("ok", "float16", 128)]
    instance, params = cpu_harness.parse_signature(source)
    assert instance.endswith("<float16_t, 128, 4>")
    buffers = [p.name for p in params if p.is_buffer]
    assert buffers == layout.INPUT_NAMES + layout.OUTPUT_NAMES
    # Inputs of fewer than 8 elements are passed in the constant address space
    # (the traced bitmask has 3); the shim turns a device/constant mix-up into
    # a compile error, so compiling this source at all checks the body for it.
    assert "const constant uint32_t* bitmask" in source
    assert "const constant int32_t* params" in source
    assert "const constant float* scale" in source
    assert "const device float16_t* q" in source


@needs_gxx
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_metal_kernel_matches_reference(binaries, case):
    binary = binaries["bins"][("ok", case[0], case[1])]
    assert _kernel_error(binary, case) <= 0


@needs_gxx
@pytest.mark.parametrize("variant", list(BROKEN))
def test_broken_variant_is_caught(binaries, variant):
    binary = binaries["bins"][(variant, *BROKEN_CASES[0][:2])]
    caught = []
    for case in BROKEN_CASES:
        try:
            caught.append(_kernel_error(binary, case) > 0)
        except RuntimeError as e:  # a crash counts as caught
            assert "AddressSanitizer" in str(e)
            caught.append(True)
    assert any(caught), f"{variant} passed every check"


@needs_gxx
def test_prefix_and_node_count_sweep(binaries):
    # Every ragged node count against every prefix length, most of them not a
    # multiple of the simdgroup stride.
    binary = binaries["bins"][("ok", "float32", 64)]
    for n in (1, 3, 7, 13, 33):
        for p in (0, 5, 37, 130):
            case = ("float32", 64, 1, n, p, 1, False)
            assert _kernel_error(binary, case) <= 0, case


# ---------------------------------------------------------------- CUDA twin


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_twin_compiles(tmp_path):
    specs = [("float32", 64), ("float16", 128), ("bfloat16", 256)]

    def build(spec):
        source, name = tree_cuda.standalone_source(*spec)
        cu = tmp_path / f"{name}.cu"
        cu.write_text(source)
        ptx = tmp_path / f"{name}.ptx"
        proc = subprocess.run(
            ["nvcc", "-ptx", "-arch=sm_90", str(cu), "-o", str(ptx)],
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f".entry {name}(" in ptx.read_text()

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(build, specs))


def test_metal_body_leaves_address_spaces_to_deduction():
    assert "device" not in tree_metal.METAL_SOURCE
    assert "constant " not in tree_metal.METAL_SOURCE


def test_cuda_body_mirrors_metal_body():
    # Same inputs and indexing: the two bodies differ only in their dialect.
    for needle in ("j < L;", "mrow[t >> 5]", "const int t = j - P;", "params[6]"):
        assert needle in tree_cuda.CUDA_SOURCE and needle in tree_metal.METAL_SOURCE


def test_cuda_harness_runs_without_mlx():
    code = (
        "import sys; sys.modules['mlx'] = None; sys.modules['mlx.core'] = None\n"
        "import runpy\n"
        "h = runpy.run_path(sys.argv[1])\n"
        "src, name = h['tree_cuda'].standalone_source('bfloat16', 128)\n"
        "assert name in src and '__nv_bfloat16' in src\n"
    )
    path = os.path.join(os.path.dirname(tree_cuda.__file__), "cuda_harness.py")
    proc = subprocess.run(
        [sys.executable, "-c", code, path], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_cuda_harness_bfloat16_rounding_matches_mlx():
    import importlib.util

    path = os.path.join(os.path.dirname(tree_cuda.__file__), "cuda_harness.py")
    spec = importlib.util.spec_from_file_location("_cuda_harness", path)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)

    class FakeCupy:
        asarray = staticmethod(np.asarray)
        asnumpy = staticmethod(np.asarray)

    x = np.random.default_rng(2).standard_normal(1000) * 10
    dev, back = harness._as_device(FakeCupy, x, "bfloat16")
    want = _f32(mx.array(x.astype(np.float32)).astype(mx.bfloat16))
    np.testing.assert_array_equal(back, want)
    np.testing.assert_array_equal(harness._to_host(FakeCupy, dev, "bfloat16"), want)
