"""Convert Gemma-4 assistant drafters (Hugging Face ``*-assistant`` layout, or
an MLX one written here) into MLX directories, float or quantized (2-8 bit).

The output keeps the checkpoint's tensor names and ``config.json``, plus
mlx-lm's ``quantization`` block when quantized: every layer's attention and
MLP projections, ``pre_projection``, ``post_projection`` and the centroid
scorer whose input width is a multiple of the group size. Norms, the
embedding (the assistant's LM head) and the cluster table stay as they are.
The weights are checked against the configuration (by building the drafter)
before anything is written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from mlx_dspark.checkpoints.gemma4_assistant import assistant_weights, build_assistant
from mlx_dspark.checkpoints.weights import read_config, read_weights, resolve_path
from mlx_dspark.errors import DSparkError
from mlx_dspark.proposers.gemma4_assistant_config import AssistantConfig, is_assistant

from .common import atomic_output_dir, dequantize_in_place

QUANT_BITS = (2, 3, 4, 6, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
QUANTIZED = re.compile(
    r"^(pre_projection|post_projection|masked_embedding\.centroids|"
    r"model\.layers\.\d+\.(self_attn\.[qo]_proj|mlp\.(gate|up|down)_proj))\.weight$"
)


@dataclass
class AssistantConversion:
    config: AssistantConfig
    bits: int | None
    group_size: int | None
    quantized: list[str]
    tensors: int


def convert_assistant(
    path_or_repo: str | Path,
    out: str | Path,
    *,
    quantize: bool = False,
    bits: int | None = None,
    group_size: int | None = None,
    dtype: str | None = None,
    force: bool = False,
) -> AssistantConversion:
    """Write an MLX Gemma-4 assistant drafter to ``out`` (nothing is left
    there on failure)."""
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
    if not is_assistant(raw):
        raise DSparkError(f"{path} is not a Gemma-4 assistant drafter.")
    config = AssistantConfig.from_dict(raw)
    weights = assistant_weights(read_weights(path), config)
    dequantize_in_place(weights, config)
    # Refuses missing, unused or misshapen tensors in one sentence.
    build_assistant(config, dict(weights), None, dequantize=False)
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
            f"No layer of this assistant has an input width divisible by "
            f"--q-group-size {group_size}."
        )
    if quantized:
        config.quantization = {"group_size": group_size, "bits": bits}
    with atomic_output_dir(out, force) as tmp:
        mx.save_safetensors(
            str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"}
        )
        (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    return AssistantConversion(
        config,
        bits if quantized else None,
        group_size if quantized else None,
        quantized,
        len(weights),
    )
