"""Convert DSpark drafters into MLX drafter directories (2-8 bit), and back.

Inputs (``--draft-model``):

* DeepSpec-native checkpoints: ``config.json`` (``Qwen3DSparkModel``) plus one
  or several safetensors files (bf16 / fp16 / fp32), sharded with a
  ``model.safetensors.index.json``;
* vLLM "speculators" ``dspark`` checkpoints: the same tensors under another
  config schema, optionally with a reduced draft vocabulary (``d2t`` / ``t2d``);
* MLX drafters written here (dequantized first, so they can be re-quantized or
  exported).

The output is a DeepSpec-format directory that :func:`mlx_dspark.load` reads:
``config.json`` keeps every DeepSpec key and adds mlx-lm's ``quantization``
block and a provenance record; the weights are safetensors, sharded above
5 GB. With ``--to deepspec`` the output is a dequantized DeepSpec checkpoint.

What is quantized: every Linear of the backbone (attention and MLP
projections), ``fc``, the Markov ``W2`` and ``W1`` (as a quantized
embedding). Norms, the confidence head, the gated head's ``gate_proj`` and the
RNN head's ``joint_proj`` stay in float: together they are well under 1% of a
drafter's parameters, and they feed sigmoids/tanh whose outputs gate the
transition bias and the confidence, where rounding buys nothing. A kept
embedding / LM head also stays float, so that loading can still recognise an
exact copy of the target's and share it.

Speculators translation (checked against vllm-project/speculators):
``aux_hidden_state_layer_ids`` index the verifier's hidden-state list (0 = the
embedding output), i.e. DeepSpec id + 1; ``d2t[i]`` is an offset
(``target = i + d2t[i]``, the EAGLE-3 convention) and ``t2d`` a boolean mask
over the target vocabulary. Absolute ``d2t`` tables are recognised too (by
``t2d`` when present). Markov ``W1`` is indexed by target ids in current
speculators checkpoints; a ``W1`` with draft-vocabulary rows is re-indexed by
target id here, target tokens outside the draft vocabulary getting a zero row.
"""

from __future__ import annotations

import glob
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mlx_dspark.errors import DSparkError

from .common import (
    SafetensorsEntry,
    atomic_output_dir,
    check_output_dir,
    read_safetensors_header,
    sha256_file,
)

QUANT_BITS = (2, 3, 4, 6, 8)
GROUP_SIZES = (32, 64, 128)
DEFAULT_BITS = 4
DEFAULT_GROUP_SIZE = 64
MAX_SHARD_BYTES = 5 * 2**30
FLOAT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
OUT_DTYPES = ("bfloat16", "float16", "float32")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# Tensors quantized with -q (when their last axis is a multiple of the group).
QUANTIZED = re.compile(
    r"^(fc|layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
    r"|markov_head\.markov_w[12])\.weight$"
)
SHARED = ("embed_tokens.weight", "lm_head.weight")
INTEGER_TENSORS = ("draft_to_target", "d2t", "t2d")
_INTEGER_DTYPES = ("I64", "I32", "I16", "U32", "BOOL", "U8", "I8", "U16")
# Speculators tensors rebuilt from the verifier at load time, not drafter weights.
_SPECULATORS_DROPPED = ("verifier_lm_head.weight", "verifier_norm.weight", "t2d")
# Keys of a speculators config that are not part of the translated config.
_SPECULATORS_ONLY = (
    "speculators_model_type",
    "speculators_config",
    "speculators_version",
    "transformer_layer_config",
    "aux_hidden_state_layer_ids",
    "target_hidden_size",
    "sample_from_anchor",
    "sliding_window_non_causal",
    "ce_loss_alpha",
    "l1_loss_alpha",
    "confidence_head_alpha",
    "loss_decay_gamma",
    "auto_map",
    "torch_dtype",
    "dtype",
    "transformers_version",
)
PROVENANCE_KEY = "mlx_dspark_conversion"
FORMATS = ("mlx", "deepspec", "speculators")
# DSpark keys a speculators config keeps at its top level.
SPECULATORS_DSPARK_KEYS = (
    "block_size",
    "mask_token_id",
    "num_anchors",
    "num_target_layers",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
)
# DSpark keys of a DeepSpec config; the rest describe the Qwen3 layer.
DSPARK_KEYS = (
    "architectures",
    "target_layer_ids",
    *SPECULATORS_DSPARK_KEYS,
    "draft_vocab_size",
    "target_model",
    PROVENANCE_KEY,
)
# Files beside the weights that a conversion carries over.
CALIBRATION_FILE = "dspark_calibration.json"
TRAINING_RECORD = "training_record.json"
PHRASES_FILE = (
    "phrases.npy"  # the phrase store (mlx_dspark.proposers.suffix_store), token ids
)


# --------------------------------------------------------------------- sources


@dataclass
class Tensor:
    """One logical drafter tensor, read lazily from the source."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "bfloat16" / "float16" / "float32" / "int32" / "uint32"
    load: Callable[[], Any]
    quantized_bits: int | None = None  # a quantized MLX source tensor

    @property
    def is_float(self) -> bool:
        return self.dtype in OUT_DTYPES


@dataclass
class DrafterSource:
    path: Path
    source_id: str
    format: str  # "deepspec" / "speculators" / "mlx"
    config: dict[str, Any]  # DeepSpec-format config (translated)
    tensors: dict[str, Tensor]
    files: list[Path]
    notes: list[str] = field(default_factory=list)

    @property
    def float_dtype(self) -> str:
        dtypes = [t.dtype for t in self.tensors.values() if t.is_float]
        return max(set(dtypes), key=dtypes.count) if dtypes else "float32"

    @property
    def weights(self) -> str:
        """The source's weights in words, e.g. ``4-bit`` or ``bfloat16``."""
        bits = {t.quantized_bits for t in self.tensors.values() if t.quantized_bits}
        if bits:
            return "/".join(f"{b}-bit" for b in sorted(bits))
        return self.float_dtype


class _Files:
    """Lazily ``mx.load``-ed safetensors files, each opened once."""

    def __init__(self):
        self.arrays: dict[Path, dict[str, Any]] = {}

    def get(self, entry: SafetensorsEntry) -> Any:
        import mlx.core as mx

        if entry.file not in self.arrays:
            try:
                self.arrays[entry.file] = mx.load(str(entry.file))
            except Exception:
                raise DSparkError(
                    f"{entry.file} is truncated or not a valid safetensors file."
                ) from None
        return self.arrays[entry.file][entry.name]


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
            raise DSparkError(f"{index} is not a valid safetensors index.") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise DSparkError(
                f"The shard {missing[0]} listed in {index.name} is missing."
            )
        return [path / n for n in names]
    files = [Path(f) for f in sorted(glob.glob(str(path / "*.safetensors")))]
    if files:
        return files
    for pattern in ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.npz"):
        other = sorted(glob.glob(str(path / pattern)))
        if other:
            raise DSparkError(
                f"{Path(other[0]).name} is not a supported drafter format; "
                "only safetensors checkpoints are."
            )
    raise DSparkError(f"{path} has no .safetensors weights.")


def _read_entries(files: list[Path], path: Path) -> dict[str, SafetensorsEntry]:
    entries: dict[str, SafetensorsEntry] = {}
    for file in files:
        for name, entry in read_safetensors_header(file).items():
            if name in entries:
                raise DSparkError(f"Tensor {name} appears in two shards of {path}.")
            entries[name] = entry
    index = path / "model.safetensors.index.json"
    if index.is_file():
        listed = json.loads(index.read_text())["weight_map"]
        absent = sorted(set(listed) - set(entries))
        if absent:
            raise DSparkError(
                f"{index.name} lists {absent[0]}, which none of the shards holds."
            )
    return entries


def _tensors(
    entries: dict[str, SafetensorsEntry], quantization: dict | None
) -> tuple[dict[str, Tensor], list[str]]:
    """Logical tensors: float ones as is, quantized MLX triples dequantized."""
    files = _Files()
    out, notes = {}, []
    for name, entry in entries.items():
        base = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) and f"{base}.weight" in entries:
            continue
        scales = entries.get(f"{base}.scales")
        if scales is not None and name.endswith(".weight"):
            if not quantization:
                raise DSparkError(
                    f"{name} is quantized but the config has no quantization block."
                )
            group, bits = quantization["group_size"], quantization["bits"]
            shape = (*entry.shape[:-1], entry.shape[-1] * 32 // bits)
            biases = entries.get(f"{base}.biases")
            if entry.dtype != "U32" or biases is None:
                raise DSparkError(f"The quantized tensor {name} is incomplete.")
            out[name] = Tensor(
                name,
                shape,
                FLOAT_DTYPES.get(scales.dtype, "float32"),
                _dequantizer(files, entry, scales, biases, group, bits),
                quantized_bits=bits,
            )
            continue
        if entry.dtype in FLOAT_DTYPES:
            dtype = FLOAT_DTYPES[entry.dtype]
        elif name in INTEGER_TENSORS and entry.dtype in _INTEGER_DTYPES:
            dtype = "int32"
        else:
            raise DSparkError(
                f"Tensor {name} has dtype {entry.dtype}; drafters must be "
                "bfloat16, float16 or float32."
            )
        out[name] = Tensor(name, entry.shape, dtype, _reader(files, entry))
    quantized = sum(t.quantized_bits is not None for t in out.values())
    if quantized:
        notes.append(f"{quantized} quantized source tensors are dequantized first")
    return out, notes


def _reader(files: _Files, entry: SafetensorsEntry) -> Callable[[], Any]:
    return lambda: files.get(entry)


def _dequantizer(files, weight, scales, biases, group, bits) -> Callable[[], Any]:
    def load():
        import mlx.core as mx

        return mx.dequantize(
            files.get(weight),
            files.get(scales),
            files.get(biases),
            group_size=group,
            bits=bits,
        )

    return load


def _source_id(path_or_repo: str | Path, path: Path) -> str:
    text = str(path_or_repo)
    local = Path(text).expanduser()
    return str(local.resolve()) if local.exists() else text


def open_drafter(path_or_repo: str | Path) -> DrafterSource:
    """Read and validate a drafter's config and tensor table (no tensor data)."""
    from mlx_dspark.checkpoints.weights import read_config, resolve_path

    path = resolve_path(path_or_repo, "drafter")
    config = read_config(path)
    files = _weight_files(path)
    entries = _read_entries(files, path)
    if is_speculators_config(config):
        fmt = "speculators"
        config = speculators_config_to_deepspec(config)
    else:
        fmt = "mlx" if config.get("quantization") else "deepspec"
    quantization = config.get("quantization")
    tensors, notes = _tensors(entries, quantization)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    if fmt == "speculators":
        tensors, more = speculators_tensors_to_deepspec(config, tensors)
        notes += more
    source = DrafterSource(
        path, _source_id(path_or_repo, path), fmt, config, tensors, files, notes
    )
    check_tensors(source)
    return source


# ------------------------------------------------------------------ speculators


def is_speculators_config(config: dict[str, Any]) -> bool:
    """A vLLM speculators config (any algorithm); refuses non-DSpark ones."""
    kind = config.get("speculators_model_type")
    if kind is None:
        algorithm = (config.get("speculators_config") or {}).get("algorithm")
        if algorithm is None:
            return False
        kind = algorithm
    if kind != "dspark":
        raise DSparkError(
            f"This is a speculators {kind!r} checkpoint, not a DSpark drafter."
        )
    return True


def speculators_config_to_deepspec(config: dict[str, Any]) -> dict[str, Any]:
    """Translate a speculators ``dspark`` config into the DeepSpec schema."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DSparkError("The speculators config has no transformer_layer_config.")
    model_type = layer.get("model_type", "qwen3")
    if model_type != "qwen3":
        raise DSparkError(
            f"Speculators DSpark drafters with a {model_type} backbone are not "
            "supported; only Qwen3 backbones are."
        )
    if config.get("sample_from_anchor") is False:
        raise DSparkError(
            "Speculators checkpoints trained with sample_from_anchor=false "
            "(DFlash-style blocks that do not draft from the anchor) are not supported."
        )
    target_hidden = config.get("target_hidden_size")
    if target_hidden not in (None, layer.get("hidden_size")):
        raise DSparkError(
            f"The drafter's hidden size {layer.get('hidden_size')} differs from its "
            f"target's ({target_hidden}), which is not supported."
        )
    aux = config.get("aux_hidden_state_layer_ids")
    if not aux:
        raise DSparkError("The speculators config has no aux_hidden_state_layer_ids.")
    if config.get("mask_token_id") is None:
        raise DSparkError("The speculators config has no mask_token_id.")
    out = dict(layer)
    out.update({k: v for k, v in config.items() if k not in _SPECULATORS_ONLY})
    out["architectures"] = ["Qwen3DSparkModel"]
    out["model_type"] = "qwen3"
    # Speculators index the verifier's hidden-state list (0 = embeddings);
    # DeepSpec ids name the layer whose output is taken (-1 = embeddings).
    out["target_layer_ids"] = [int(i) - 1 for i in aux]
    out["tie_word_embeddings"] = False
    out.setdefault("block_size", 8)
    out.setdefault("markov_rank", 0)
    out.setdefault("markov_head_type", "vanilla")
    out.setdefault("enable_confidence_head", False)
    out.setdefault("confidence_head_with_markov", False)
    draft_vocab = out.get("draft_vocab_size")
    if draft_vocab is None or int(draft_vocab) == int(out["vocab_size"]):
        out.pop("draft_vocab_size", None)
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    if verifier.get("name_or_path"):
        out.setdefault("target_model", verifier["name_or_path"])
    return out


def deepspec_config_to_speculators(
    config: dict[str, Any], verifier: str | None
) -> dict[str, Any]:
    """The speculators ``dspark`` config of a DeepSpec one (the inverse of
    :func:`speculators_config_to_deepspec`)."""
    layer = {k: v for k, v in config.items() if k not in DSPARK_KEYS}
    layer["model_type"] = "qwen3"
    layer["architectures"] = ["Qwen3ForCausalLM"]
    out = {
        "speculators_model_type": "dspark",
        "architectures": ["DSparkSpeculator"],
        "transformer_layer_config": layer,
        "draft_vocab_size": config.get("draft_vocab_size", config["vocab_size"]),
        "aux_hidden_state_layer_ids": [int(i) + 1 for i in config["target_layer_ids"]],
        "target_hidden_size": config["hidden_size"],
        "sample_from_anchor": True,
        "speculators_config": {
            "algorithm": "dspark",
            "verifier": {"name_or_path": verifier, "architectures": []},
        },
    }
    for key in SPECULATORS_DSPARK_KEYS:
        if key in config:
            out[key] = config[key]
    return out


def speculators_tensors_to_deepspec(
    config: dict[str, Any], tensors: dict[str, Tensor]
) -> tuple[dict[str, Tensor], list[str]]:
    import mlx.core as mx

    from mlx_dspark.checkpoints.weights import draft_to_target_ids

    notes = []
    tensors = dict(tensors)
    t2d = tensors.get("t2d")
    for name in _SPECULATORS_DROPPED:
        tensors.pop(name, None)
    d2t = tensors.pop("d2t", None)
    vocab = int(config["vocab_size"])
    if "draft_vocab_size" not in config:
        return tensors, notes
    if d2t is None:
        raise DSparkError(
            "The reduced-vocabulary speculators checkpoint has no d2t tensor."
        )
    ids = draft_to_target_ids(
        np.array(d2t.load()), None if t2d is None else np.array(t2d.load()), vocab
    )
    tensors["draft_to_target"] = Tensor(
        "draft_to_target",
        (ids.size,),
        "int32",
        lambda: mx.array(ids.astype(np.int32)),
    )
    notes.append(f"reduced draft vocabulary: {ids.size} of {vocab} target tokens (d2t)")
    w1 = tensors.get("markov_head.markov_w1.weight")
    if w1 is not None and w1.shape[0] == ids.size and ids.size != vocab:
        load = w1.load

        def expand():
            rows = load()
            full = mx.zeros((vocab, rows.shape[1]), dtype=rows.dtype)
            full[mx.array(ids.astype(np.int32))] = rows
            return full

        tensors[w1.name] = Tensor(w1.name, (vocab, w1.shape[1]), w1.dtype, expand)
        notes.append("Markov W1 re-indexed from draft ids to target ids")
    return tensors, notes


# -------------------------------------------------------------- validation


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of a float drafter for ``config`` (no embeddings)."""
    from mlx.utils import tree_flatten

    from mlx_dspark.proposers.dspark import DSparkDrafter
    from mlx_dspark.proposers.dspark_config import DraftConfig

    draft_config = DraftConfig.from_dict(config)
    drafter = DSparkDrafter(draft_config)
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(drafter.parameters())}
    d = draft_config.hidden_size
    shapes["embed_tokens.weight"] = (draft_config.vocab_size, d)
    shapes["lm_head.weight"] = (draft_config.output_vocab_size, d)
    return shapes


def check_tensors(source: DrafterSource) -> None:
    # The speculators table itself is checked when it is translated.
    shapes = expected_shapes(source.config)
    names = set(source.tensors)
    # Gemma-4's layer_scalar buffers (ones) may be left out; loading adds them.
    optional = {n for n in shapes if n.endswith(".layer_scalar")}
    missing = sorted(set(shapes) - names - set(SHARED) - optional)
    if missing:
        raise DSparkError(
            f"The drafter checkpoint is missing tensors: {', '.join(missing[:4])}."
        )
    unexpected = sorted(names - set(shapes))
    if unexpected:
        raise DSparkError(
            "The drafter checkpoint has tensors its config does not use: "
            f"{', '.join(unexpected[:4])}."
        )
    for name, tensor in source.tensors.items():
        if tensor.shape != shapes[name]:
            raise DSparkError(
                f"Tensor {name} has shape {list(tensor.shape)}, but the config "
                f"implies {list(shapes[name])}."
            )
        if name != "draft_to_target" and not tensor.is_float:
            raise DSparkError(f"Tensor {name} is not a float tensor.")


# ----------------------------------------------------------------------- target


@dataclass
class TargetIO:
    """The target's embedding and LM head, read from its checkpoint."""

    source_id: str
    embed: Any
    head: Any
    quantized: bool


def read_target_io(path_or_repo: str | Path) -> TargetIO:
    from mlx_dspark.checkpoints.weights import read_config, resolve_path

    path = resolve_path(path_or_repo, "target")
    config = read_config(path)
    entries = _read_entries(_weight_files(path), path)
    quantization = config.get("quantization")
    tensors, _ = _tensors(entries, quantization)
    embed = tensors.get("model.embed_tokens.weight")
    if embed is None:
        raise DSparkError(f"The target at {path} has no model.embed_tokens.weight.")
    head = tensors.get("lm_head.weight", embed)
    quantized = any(t.quantized_bits is not None for t in (embed, head))
    return TargetIO(_source_id(path_or_repo, path), embed, head, quantized)


def tensor_digest(array: Any) -> str:
    """sha256 of a tensor's values (as float32) and shape."""
    import mlx.core as mx

    values = np.array(array.astype(mx.float32))
    digest = hashlib.sha256(repr(values.shape).encode())
    digest.update(values.tobytes())
    return digest.hexdigest()


# ------------------------------------------------------------------------- plan


@dataclass
class TensorPlan:
    name: str
    shape: tuple[int, ...]
    action: str  # "quantize" / "float" / "int" / "vocab map" / "drop"
    dtype: str
    bits: int | None = None
    note: str = ""

    def out_bytes(self, group_size: int) -> int:
        n = int(np.prod(self.shape))
        if self.action == "drop":
            return 0
        if self.action == "int":
            return 4 * n
        if self.action == "vocab map":
            return 8 * n
        if self.action == "quantize":
            groups = n // group_size
            return n * self.bits // 8 + 2 * groups * _DTYPE_BYTES[self.dtype]
        return n * _DTYPE_BYTES[self.dtype]


@dataclass
class DrafterPlan:
    source: DrafterSource
    to: str  # "mlx" / "deepspec" / "speculators"
    config: dict[str, Any]
    tensors: list[TensorPlan]
    bits: int | None
    group_size: int | None
    dtype: str
    target: TargetIO | None = None

    @property
    def total_bytes(self) -> int:
        return sum(t.out_bytes(self.group_size or 1) for t in self.tensors)

    @property
    def source_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.source.files)


def plan_drafter(
    draft_model: str | Path,
    *,
    quantize: bool = False,
    bits: int | None = None,
    group_size: int | None = None,
    dtype: str | None = None,
    target: str | Path | None = None,
    to: str = "mlx",
) -> DrafterPlan:
    """Everything the conversion will do, decided before anything is written."""
    if to not in FORMATS:
        raise DSparkError(f"--to {to} is not a known format; use {', '.join(FORMATS)}.")
    if (bits is not None or group_size is not None) and not quantize:
        raise DSparkError("--q-bits and --q-group-size need -q.")
    if to != "mlx" and quantize:
        raise DSparkError(f"--to {to} writes float weights and cannot take -q.")
    if quantize:
        bits = DEFAULT_BITS if bits is None else bits
        group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
        if bits not in QUANT_BITS:
            raise DSparkError(f"--q-bits must be one of {QUANT_BITS}, got {bits}.")
        if group_size not in GROUP_SIZES:
            raise DSparkError(
                f"--q-group-size must be one of {GROUP_SIZES}, got {group_size}."
            )
    if dtype is not None and dtype not in OUT_DTYPES:
        raise DSparkError(f"--dtype must be one of {', '.join(OUT_DTYPES)}.")
    source = open_drafter(draft_model)
    dtype = dtype or source.float_dtype
    target_io = read_target_io(target) if target is not None else None
    if target_io is not None:
        _check_target_shapes(source, target_io)
    if to == "deepspec" and "draft_vocab_size" in source.config:
        raise DSparkError(
            "DeepSpec checkpoints cannot hold a reduced draft vocabulary, so this "
            "drafter cannot be exported to DeepSpec; use --to speculators."
        )
    # DeepSpec checkpoints hold the embedding and LM head; speculators ones
    # only the LM head (the embedding comes from the verifier).
    needed = {"mlx": (), "deepspec": SHARED, "speculators": ("lm_head.weight",)}[to]
    if target_io is None and any(name not in source.tensors for name in needed):
        raise DSparkError(
            "The MLX drafter omits the target's embedding and LM head; "
            "pass --target to take them from the target model."
        )
    reduced = "draft_vocab_size" in source.config
    plans = []
    for name, tensor in source.tensors.items():
        plans.append(
            _tensor_plan(
                name, tensor, quantize, bits, group_size, dtype, target_io, to, reduced
            )
        )
    for name in needed:
        if name not in source.tensors:
            shape = _target_tensor(target_io, name).shape
            plans.append(TensorPlan(name, shape, "float", dtype, note="from --target"))
    config = dict(source.config)
    if quantize:
        config["quantization"] = {"group_size": group_size, "bits": bits}
    if to == "speculators":
        verifier = config.get("target_model") or (
            target_io.source_id if target_io is not None else None
        )
        config = deepspec_config_to_speculators(config, verifier)
    return DrafterPlan(
        source, to, config, plans, bits, group_size, dtype, target=target_io
    )


def _target_tensor(target: TargetIO, name: str) -> Tensor:
    return target.embed if name == "embed_tokens.weight" else target.head


def _check_target_shapes(source: DrafterSource, target: TargetIO) -> None:
    vocab, d = source.config["vocab_size"], source.config["hidden_size"]
    if target.embed.shape != (vocab, d) or target.head.shape != (vocab, d):
        raise DSparkError(
            f"The target's embedding is {list(target.embed.shape)}, but the drafter "
            f"expects [{vocab}, {d}]; it belongs to another target."
        )


def _tensor_plan(name, tensor, quantize, bits, group_size, dtype, target, to, reduced):
    if name == "draft_to_target":
        if to == "speculators":
            note = "written as d2t offsets and a t2d mask"
            return TensorPlan(name, tensor.shape, "vocab map", "int64", note=note)
        return TensorPlan(name, tensor.shape, "int", "int32")
    if name == "embed_tokens.weight" and to == "speculators":
        note = "left out (speculators take it from the verifier)"
        return TensorPlan(name, tensor.shape, "drop", dtype, note=note)
    if quantize and name == "lm_head.weight" and reduced:
        # Over a reduced draft vocabulary it can never be the target's head.
        if tensor.shape[-1] % group_size == 0:
            note = "reduced draft vocabulary"
            return TensorPlan(name, tensor.shape, "quantize", dtype, bits, note)
    if name in SHARED and to == "mlx":
        if target is None:
            return TensorPlan(name, tensor.shape, "float", dtype, note="kept")
        if tensor.shape != _target_tensor(target, name).shape:
            note = "kept (reduced draft vocabulary)"
            return TensorPlan(name, tensor.shape, "float", dtype, note=note)
        if target.quantized:
            note = "kept (the target's copy is quantized)"
            return TensorPlan(name, tensor.shape, "float", dtype, note=note)
        if tensor_digest(tensor.load()) == tensor_digest(
            _target_tensor(target, name).load()
        ):
            return TensorPlan(
                name, tensor.shape, "drop", dtype, note="equals the target's"
            )
        return TensorPlan(
            name, tensor.shape, "float", dtype, note="kept (differs from the target's)"
        )
    if quantize and QUANTIZED.match(name):
        if tensor.shape[-1] % group_size == 0:
            return TensorPlan(name, tensor.shape, "quantize", dtype, bits=bits)
        note = f"float (last axis {tensor.shape[-1]} not a multiple of {group_size})"
        return TensorPlan(name, tensor.shape, "float", dtype, note=note)
    return TensorPlan(name, tensor.shape, "float", dtype)


def describe_plan(plan: DrafterPlan) -> str:
    source = plan.source
    mib = 2**20
    lines = [
        f"source: {source.source_id} ({source.format}, "
        f"{len(source.files)} file(s), {plan.source_bytes / mib:.2f} MiB)",
    ]
    lines += [f"note: {n}" for n in source.notes]
    if plan.to != "mlx":
        lines.append(f"output: {_FORMAT_NAMES[plan.to]} checkpoint in {plan.dtype}")
    elif plan.bits:
        lines.append(
            f"output: MLX drafter, {plan.bits}-bit, group size {plan.group_size}, "
            f"float tensors in {plan.dtype}"
        )
    else:
        lines.append(f"output: MLX drafter, float tensors in {plan.dtype}")
    if plan.target is not None:
        lines.append(f"target: {plan.target.source_id}")
    width = max(len(t.name) for t in plan.tensors)
    for t in plan.tensors:
        what = {
            "quantize": f"{t.bits}-bit",
            "float": t.dtype,
            "int": "int32",
            "vocab map": "int64",
            "drop": "left out",
        }[t.action]
        size = t.out_bytes(plan.group_size or 1) / mib
        extra = f"  {t.note}" if t.note else ""
        lines.append(
            f"  {t.name:<{width}}  {str(list(t.shape)):<16} {what:<9} "
            f"{size:9.3f} MiB{extra}"
        )
    counts = {a: sum(t.action == a for t in plan.tensors) for a in ("quantize", "drop")}
    lines.append(
        f"{len(plan.tensors)} tensors ({counts['quantize']} quantized, "
        f"{counts['drop']} left out); estimated size {plan.total_bytes / mib:.2f} MiB"
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------ write


def _convert_one(plan: DrafterPlan, t: TensorPlan) -> dict[str, Any]:
    import mlx.core as mx

    if t.action == "drop":
        return {}
    if t.name in plan.source.tensors:
        array = plan.source.tensors[t.name].load()
    else:
        array = _target_tensor(plan.target, t.name).load()
    if t.action == "int":
        return {t.name: array.astype(mx.int32)}
    if t.action == "vocab map":
        ids = np.array(array).astype(np.int64)
        t2d = np.zeros(plan.source.config["vocab_size"], dtype=bool)
        t2d[ids] = True
        return {"d2t": mx.array(ids - np.arange(ids.size)), "t2d": mx.array(t2d)}
    array = array.astype(getattr(mx, t.dtype))
    if t.action == "quantize":
        weight, scales, biases = mx.quantize(array, plan.group_size, plan.bits)
        base = t.name.rsplit(".", 1)[0]
        return {
            t.name: weight,
            f"{base}.scales": scales,
            f"{base}.biases": biases,
        }
    return {t.name: array}


def _shard(plan: DrafterPlan, max_shard_bytes: int) -> list[list[TensorPlan]]:
    shards: list[list[TensorPlan]] = []
    size = 0
    for t in plan.tensors:
        if t.action == "drop":
            continue
        n = t.out_bytes(plan.group_size or 1)
        if not shards or (size + n > max_shard_bytes and shards[-1]):
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    return shards or [[]]


def _provenance(plan: DrafterPlan) -> dict[str, Any]:
    source = plan.source
    record = {
        "tool": "mlx_dspark.convert",
        "source": source.source_id,
        "source_format": source.format,
        "files": {f.name: sha256_file(f) for f in source.files},
    }
    if plan.target is not None:
        record["target"] = plan.target.source_id
    left_out = [t.name for t in plan.tensors if t.action == "drop"]
    if left_out:
        record["from_target"] = left_out
    if source.notes:
        record["notes"] = source.notes
    return record


_FORMAT_NAMES = {"deepspec": "DeepSpec", "speculators": "vLLM speculators"}


def _model_card(plan: DrafterPlan) -> str:
    c = plan.source.config
    if plan.to != "mlx":
        what = f"{_FORMAT_NAMES[plan.to]}-format DSpark drafter ({plan.dtype})"
    elif plan.bits:
        what = f"{plan.bits}-bit MLX DSpark drafter (group size {plan.group_size})"
    else:
        what = f"MLX DSpark drafter ({plan.dtype})"
    shared = [t.name for t in plan.tensors if t.action == "drop"]
    lines = [
        "---",
        "library_name: mlx",
        "tags: [mlx, dspark, speculative-decoding]",
        "---",
        f"# {what}",
        "",
        f"Converted from `{plan.source.source_id}` ({plan.source.format}) with "
        "`mlx_dspark.convert`.",
        "",
        f"- draft layers: {c['num_hidden_layers']}, block size: {c['block_size']}, "
        f"target layers: {c['target_layer_ids']}",
        f"- sequential head: {c.get('markov_head_type') if c.get('markov_rank') else 'none'}"
        f" (rank {c.get('markov_rank', 0)}), confidence head: "
        f"{bool(c.get('enable_confidence_head'))}",
    ]
    if c.get("draft_vocab_size"):
        lines.append(f"- reduced draft vocabulary: {c['draft_vocab_size']} tokens")
    if shared:
        lines.append(
            f"- {', '.join(shared)} left out: they equal the target's and are "
            "taken from it at load time"
        )
    if plan.to == "speculators":
        lines += [
            "",
            "For vLLM / SGLang (speculators `dspark`); `mlx_dspark.convert "
            "--draft-model THIS_DIRECTORY` converts it back.",
            "",
        ]
        return "\n".join(lines)
    lines += [
        "",
        "```python",
        "from mlx_dspark import load, generate",
        "",
        'model, tokenizer, drafter = load("TARGET", draft_model="THIS_DIRECTORY")',
        "```",
        "",
        "Speculative decoding with this drafter is lossless: outputs follow the "
        "target model's distribution exactly.",
        "",
    ]
    return "\n".join(lines)


def convert_drafter(
    draft_model: str | Path,
    out: str | Path,
    *,
    quantize: bool = False,
    bits: int | None = None,
    group_size: int | None = None,
    dtype: str | None = None,
    target: str | Path | None = None,
    to: str = "mlx",
    force: bool = False,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    on_tensor: Callable[[int, int], None] | None = None,
) -> DrafterPlan:
    """Convert a drafter into an MLX drafter (``to="mlx"``) or a DeepSpec
    checkpoint (``to="deepspec"``) at ``out``; nothing is written at ``out``
    unless the whole conversion succeeds."""
    out = Path(out)
    check_output_dir(out.absolute(), force)
    plan = plan_drafter(
        draft_model,
        quantize=quantize,
        bits=bits,
        group_size=group_size,
        dtype=dtype,
        target=target,
        to=to,
    )
    import mlx.core as mx

    count = sum(t.action != "drop" for t in plan.tensors)
    shard_plans = _shard(plan, max_shard_bytes)
    metadata = {"format": "mlx" if plan.to == "mlx" else "pt"}
    pattern = "model.safetensors"
    if len(shard_plans) > 1:
        pattern = "model-{:05d}-of-{:05d}.safetensors"
    weight_map, total = {}, 0
    with atomic_output_dir(out, force) as tmp:
        done = 0
        for i, shard_plan in enumerate(shard_plans, 1):
            shard: dict[str, Any] = {}
            for t in shard_plan:
                shard.update(_convert_one(plan, t))
                done += 1
                if on_tensor is not None:
                    on_tensor(done, count)
            mx.eval(list(shard.values()))
            name = pattern.format(i, len(shard_plans))
            mx.save_safetensors(str(tmp / name), shard, metadata)
            weight_map.update(dict.fromkeys(shard, name))
            total += sum(v.nbytes for v in shard.values())
            shard.clear()
        _finish(tmp, plan, weight_map if len(shard_plans) > 1 else None, total)
    return plan


def _finish(
    tmp: Path, plan: DrafterPlan, weight_map: dict[str, str] | None, total: int
) -> None:
    if weight_map is not None:
        index = {
            "metadata": {"total_size": total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    config = dict(plan.config)
    config[PROVENANCE_KEY] = _provenance(plan)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "README.md").write_text(_model_card(plan))
    _carry_files(plan.source, tmp)


def _carry_files(source: DrafterSource, out: Path) -> None:
    """Copy the training record, the phrase store and the calibration beside
    the new weights.

    The calibration was fitted on the source's weights; it says so, since
    other bit widths shift the confidences slightly.
    """
    for name in (TRAINING_RECORD, PHRASES_FILE):
        if (source.path / name).is_file():
            (out / name).write_bytes((source.path / name).read_bytes())
    calibration = source.path / CALIBRATION_FILE
    if calibration.is_file():
        try:
            data = json.loads(calibration.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise DSparkError(f"{calibration} is not valid JSON.") from None
        data["measured_with"] = data.get("measured_with") or f"{source.weights} weights"
        (out / CALIBRATION_FILE).write_text(json.dumps(data, indent=1))


__all__ = [
    "DrafterPlan",
    "convert_drafter",
    "describe_plan",
    "open_drafter",
    "plan_drafter",
]
