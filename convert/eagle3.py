"""Convert EAGLE-3 drafters (DeepSpec, speculators, or MLX ones written here)
into MLX directories, optionally quantized (2-8 bit).

The output is the DeepSpec layout that :func:`mlx_dspark.checkpoints.eagle3.load_eagle3`
reads: ``config.json`` (``architectures`` naming the flavour; a speculators
Llama-style drafter becomes ``LlamaEagle3Model``) with mlx-lm's
``quantization`` block, and ``model.safetensors`` with DeepSpec tensor names
plus ``draft_to_target`` for a reduced draft vocabulary. Quantized: ``fc``
and every attention and MLP projection whose input width is a multiple of the
group size. Norms stay float, and so do a kept embedding and LM head, so
that loading still recognises exact copies of the target's and shares them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mlx_dspark.checkpoints.eagle3 import (
    is_eagle3,
    is_speculators_eagle3,
    read_eagle3_config,
    speculators_weights,
)
from mlx_dspark.checkpoints.weights import read_config, read_weights, resolve_path
from mlx_dspark.errors import DSparkError
from mlx_dspark.proposers.eagle3_config import Eagle3Config

from .common import atomic_output_dir, dequantize_in_place

QUANT_BITS = (2, 3, 4, 6, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
QUANTIZED = re.compile(
    r"^(fc|layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj))\.weight$"
)


@dataclass
class Eagle3Conversion:
    config: Eagle3Config
    bits: int | None
    group_size: int | None
    quantized: list[str]
    tensors: int


def convert_eagle3(
    path_or_repo: str | Path,
    out: str | Path,
    *,
    quantize: bool = False,
    bits: int | None = None,
    group_size: int | None = None,
    dtype: str | None = None,
    num_target_layers: int | None = None,
    force: bool = False,
) -> Eagle3Conversion:
    """Write an MLX EAGLE-3 drafter to ``out`` (nothing is left there on
    failure). ``num_target_layers`` supplies speculators' default taps for a
    config that names none."""
    bits = bits or 4
    group_size = group_size or 64
    if quantize and bits not in QUANT_BITS:
        raise DSparkError(f"--q-bits must be one of {QUANT_BITS}, got {bits}.")
    if quantize and group_size not in GROUP_SIZES:
        raise DSparkError(
            f"--q-group-size must be one of {GROUP_SIZES}, got {group_size}."
        )
    if dtype is not None and dtype not in DTYPES:
        raise DSparkError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype}.")
    path = resolve_path(path_or_repo, "draft model")
    raw = read_config(path)
    if not is_eagle3(raw):
        raise DSparkError(f"{path} is not an EAGLE-3 drafter.")
    config = read_eagle3_config(raw, num_target_layers)
    weights = read_weights(path)
    if is_speculators_eagle3(raw):
        weights = speculators_weights(weights, config)
    dequantize_in_place(weights, config)
    quantized = []
    for name, value in list(weights.items()):
        if not mx.issubdtype(value.dtype, mx.floating):
            continue
        if dtype is not None:
            value = value.astype(DTYPES[dtype])
        weights[name] = value
        if quantize and QUANTIZED.match(name) and value.shape[-1] % group_size == 0:
            base = name[: -len(".weight")]
            w, scales, biases = mx.quantize(value, group_size=group_size, bits=bits)
            weights[name] = w
            weights[f"{base}.scales"], weights[f"{base}.biases"] = scales, biases
            quantized.append(base)
    if quantize and not quantized:
        raise DSparkError(
            f"No layer of this drafter has an input width divisible by "
            f"--q-group-size {group_size}."
        )
    if quantized:
        config.quantization = {"group_size": group_size, "bits": bits}
    with atomic_output_dir(out, force) as tmp:
        mx.save_safetensors(
            str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"}
        )
        (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    return Eagle3Conversion(
        config,
        bits if quantized else None,
        group_size if quantized else None,
        quantized,
        len(weights),
    )
