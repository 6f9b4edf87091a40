"""Exact-resume checkpoints and the DeepSpec-format drafter export."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import DSparkError
from ..proposers.dspark import DSparkDrafter
from ..proposers.eagle3 import Eagle3Drafter
from ..targets.adapter import TargetAdapter
from ..utils import umask
from .model import dense_weight, head_weight

# 2: the teacher store replaced the feature cache (identity keys changed).
STATE_VERSION = 2


def checkpoint_path(out: Path) -> Path:
    return out.with_name(out.name + ".checkpoint")


def write_dir_atomically(final: Path, write: Callable[[Path], None]) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
    staging.chmod(0o777 & ~umask())  # mkdtemp's 0700, as mkdir would have made it
    try:
        write(staging)
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
        os.replace(staging, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def save_checkpoint(
    path: Path, drafter: DSparkDrafter, optimizer: optim.Optimizer, state: dict
) -> None:
    def write(directory: Path) -> None:
        mx.save_safetensors(
            str(directory / "drafter.safetensors"),
            dict(tree_flatten(drafter.parameters())),
        )
        mx.save_safetensors(
            str(directory / "optimizer.safetensors"),
            dict(tree_flatten(optimizer.state)),
        )
        (directory / "state.json").write_text(json.dumps(state, indent=1))

    write_dir_atomically(path, write)


def load_checkpoint(
    path: Path, drafter: DSparkDrafter, optimizer: optim.Optimizer
) -> dict:
    try:
        state = json.loads((path / "state.json").read_text())
        weights = mx.load(str(path / "drafter.safetensors"))
        opt_state = mx.load(str(path / "optimizer.safetensors"))
    except (OSError, json.JSONDecodeError, RuntimeError, ValueError):
        raise DSparkError(
            f"The checkpoint at {path} is missing or corrupted."
        ) from None
    drafter.load_weights(list(weights.items()))
    optimizer.state = tree_unflatten(list(opt_state.items()))
    mx.eval(drafter.parameters(), optimizer.state)
    return state


def export_drafter(
    out: Path,
    drafter: DSparkDrafter | Eagle3Drafter,
    target: TargetAdapter,
    record: dict,
    with_embeddings: bool,
    dtype: mx.Dtype,
    quantize: tuple[int, int] | None = None,
) -> None:
    """Write a DeepSpec-format drafter directory (atomically): a DSpark or
    an EAGLE-3 drafter.

    With ``quantize=(bits, group_size)`` the drafter is quantized in place
    first (MLX format: a ``quantization`` block in config.json).
    """
    if quantize is not None:
        bits, group_size = quantize

        def eligible(path: str, module: nn.Module) -> bool:
            weight = getattr(module, "weight", None)
            return (
                hasattr(module, "to_quantized")
                and not path.startswith("confidence_head")
                and weight is not None
                and weight.shape[-1] % group_size == 0
            )

        nn.quantize(drafter, group_size=group_size, bits=bits, class_predicate=eligible)
        drafter.config.quantization = {"group_size": group_size, "bits": bits}
    weights = {
        name: value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value
        for name, value in tree_flatten(drafter.parameters())
    }
    if with_embeddings:
        # Kept in the target's own dtype, so that loaders recognise them as
        # the target's and share instead of duplicating them.
        weights["embed_tokens.weight"] = dense_weight(target.embedding)
        if not drafter.config.reduced_vocab:
            weights["lm_head.weight"] = head_weight(target)

    # The target's config as DeepSpec copies it, then the drafter's keys
    # (an EAGLE-3 config's to_dict holds its own fields only).
    config = {**drafter.config.raw, **drafter.config.to_dict()}

    def write(directory: Path) -> None:
        (directory / "config.json").write_text(json.dumps(config, indent=2))
        mx.save_safetensors(
            str(directory / "model.safetensors"), weights, metadata={"format": "pt"}
        )
        (directory / "training_record.json").write_text(json.dumps(record, indent=2))

    write_dir_atomically(out, write)
