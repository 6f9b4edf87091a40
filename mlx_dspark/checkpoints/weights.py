"""Reading drafter checkpoints: where they are, their config and tensors,
and how a drafter's weights are checked, shared with the target and made
ready for the CPU. Shared by the DSpark and EAGLE-3 loaders."""

from __future__ import annotations

import glob
import json
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from ..errors import DSparkError
from ..proposers.dspark import DSparkDrafter
from ..proposers.dspark_config import DraftConfig
from ..proposers.eagle3_config import Eagle3Config
from ..targets.adapter import TargetAdapter


def resolve_path(path_or_repo: str | Path, what: str) -> Path:
    """A local directory, or a Hugging Face repo id found through the hub cache."""
    path = Path(path_or_repo).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise DSparkError(f"The {what} path {path} is a file, not a model directory.")
    name = str(path_or_repo)
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise DSparkError(f"The {what} {name} does not exist.")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.npy"]
    try:
        return Path(
            snapshot_download(name, allow_patterns=patterns, local_files_only=True)
        )
    except Exception:
        pass
    try:
        return Path(snapshot_download(name, allow_patterns=patterns))
    except Exception:
        raise DSparkError(
            f"The {what} {name} is neither a local directory nor a reachable "
            "Hugging Face repository."
        ) from None


def read_config(path: Path) -> dict:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise DSparkError(f"{path} has no config.json.")
    try:
        return json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise DSparkError(f"{config_file} is not valid JSON.") from None


def check_safetensors(file: Path) -> None:
    """Refuse a safetensors file whose header or data is cut short or garbled.

    Reads only the header: the file must be exactly as long as the header's
    last tensor says, so a truncated copy is caught before MLX reads it.
    """
    bad = DSparkError(f"{file} is truncated or not a valid safetensors file.")
    size = file.stat().st_size
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise bad
        (header_size,) = struct.unpack("<Q", prefix)
        if header_size > size - 8:
            raise bad
        try:
            header = json.loads(handle.read(header_size))
            end = max(
                (
                    v["data_offsets"][1]
                    for k, v in header.items()
                    if k != "__metadata__"
                ),
                default=0,
            )
        except (ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError):
            raise bad from None
    if 8 + header_size + end != size:
        raise bad


def read_weights(path: Path) -> dict[str, mx.array]:
    """All tensors of a directory's safetensors files (single or sharded)."""
    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise DSparkError(f"{path} has no .safetensors weights.")
    weights = {}
    for file in files:
        try:
            weights.update(mx.load(file))
        except Exception:
            raise DSparkError(
                f"{file} is truncated or not a valid safetensors file."
            ) from None
    return weights


def check_trained_for(
    config: DraftConfig | Eagle3Config, target: TargetAdapter, name: str = "drafter"
) -> None:
    """Refuse, in one sentence, a drafter (``name``) trained for a target of
    another hidden size, vocabulary or depth."""
    if config.hidden_size != target.hidden_size:
        raise DSparkError(
            f"The {name}'s hidden size {config.hidden_size} does not match the "
            f"target's {target.hidden_size}; it was trained for another target."
        )
    if config.vocab_size != target.vocab_size:
        raise DSparkError(
            f"The {name}'s vocabulary ({config.vocab_size}) does not match the "
            f"target's ({target.vocab_size}); it was trained for another target."
        )
    if config.num_target_layers not in (None, target.num_layers):
        raise DSparkError(
            f"The {name} was trained on a target with {config.num_target_layers} "
            f"layers, but this target has {target.num_layers}."
        )


def _same(a: mx.array, b: mx.array) -> bool:
    return (
        a.shape == b.shape
        and mx.array_equal(a.astype(mx.float32), b.astype(mx.float32)).item()
    )


def _own_part(weights: dict[str, mx.array], module: str) -> dict[str, mx.array]:
    return {k: weights.pop(k) for k in list(weights) if k.split(".")[0] == module}


def _shareable(own: dict[str, mx.array], module: str, target_weight: mx.array) -> bool:
    """Whether a float checkpoint copy equals the target's tensor."""
    weight = own.get(f"{module}.weight")
    return (
        weight is not None
        and f"{module}.scales" not in own
        and _same(weight, target_weight)
    )


def attach_embeddings(
    drafter: nn.Module,
    config,
    weights: dict[str, mx.array],
    target: TargetAdapter | None,
    what: str,
    keep_whole: bool = True,
) -> None:
    """Give ``drafter`` its embedding and LM head: the target's where the
    checkpoint omits them or holds exact float copies, else its own (added to
    ``weights``). A reduced-vocabulary head is always the drafter's own; with
    ``keep_whole``, a complete checkpoint copy that differs anywhere is kept
    whole. ``what`` names the drafter in errors."""
    own_embed = _own_part(weights, "embed_tokens")
    own_head = _own_part(weights, "lm_head")
    share_embed = share_head = False
    if target is not None:
        share_embed = not own_embed or _shareable(
            own_embed, "embed_tokens", target.embedding.weight
        )
        share_head = not config.reduced_vocab and (
            not own_head or _shareable(own_head, "lm_head", _target_head_weight(target))
        )
        whole = keep_whole and own_embed and own_head and not config.reduced_vocab
        if whole and not (share_embed and share_head):
            share_embed = share_head = False
    if (not own_embed and not share_embed) or (not own_head and not share_head):
        if config.reduced_vocab and not own_head:
            raise DSparkError(
                f"The reduced-vocabulary {what} has no LM head of its own."
            )
        raise DSparkError(
            f"The {what} has no embedding or LM head of its own; load it with its target."
        )
    if config.is_gemma4:
        # DeepSpec's layer_scalar is a buffer of ones that a checkpoint may omit.
        for i in range(config.num_hidden_layers):
            weights.setdefault(f"layers.{i}.layer_scalar", mx.ones((1,)))
    drafter.own_embeddings(embed=not share_embed, head=not share_head)
    drafter.share_embeddings(
        target.embed if share_embed else None,
        target.lm_head if share_head else None,
    )
    if not share_embed:
        weights.update(own_embed)
    if not share_head:
        weights.update(own_head)


def load_checked_weights(
    module: nn.Module, weights: dict[str, mx.array], config, what: str
) -> None:
    """Quantize ``module`` as the checkpoint is (``config.quantization``), then
    load ``weights``, refusing missing, unused or misshapen tensors and a bad
    ``draft_to_target`` table in one sentence naming ``what`` was loaded."""
    if config.quantization:
        q = config.quantization
        nn.quantize(
            module,
            group_size=q["group_size"],
            bits=q["bits"],
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
    expected = {k for k, _ in tree_flatten(module.parameters())}
    missing = sorted(expected - set(weights))
    if missing:
        raise DSparkError(
            f"The {what} checkpoint is missing tensors: {', '.join(missing[:4])}."
        )
    unexpected = sorted(set(weights) - expected)
    if unexpected:
        raise DSparkError(
            f"The {what} checkpoint has tensors this configuration does not use: "
            f"{', '.join(unexpected[:4])}."
        )
    if config.reduced_vocab:
        weights["draft_to_target"] = _check_draft_to_target(
            weights["draft_to_target"], config
        )
    try:
        module.load_weights(list(weights.items()))
    except ValueError as error:
        raise DSparkError(
            f"The {what}'s tensor shapes do not match its config: {error}"
        ) from None


def dequantize_on_cpu(drafter: DSparkDrafter) -> None:
    """Give a quantized drafter float weights when MLX runs on the CPU.

    MLX's CPU quantized matmul is several times slower than its float one
    (a draft pass of the default drafter: about 5x), while on a GPU the
    quantized kernels are the fast ones, so there the weights stay quantized.
    """
    if mx.default_device().type == mx.cpu:
        dequantize(drafter)


def _target_head_weight(target: TargetAdapter) -> mx.array:
    return target.head.weight


def dequantize(drafter: DSparkDrafter) -> None:
    """Replace the drafter's quantized layers by float ones, in place."""
    from mlx_lm.utils import dequantize_model

    dequantize_model(drafter)


def _check_draft_to_target(table: mx.array, config: DraftConfig) -> mx.array:
    ids = np.array(table).astype(np.int64).reshape(-1)
    if ids.size != config.draft_vocab_size:
        raise DSparkError(
            f"draft_to_target has {ids.size} entries, but draft_vocab_size is "
            f"{config.draft_vocab_size}."
        )
    if (
        ids.min() < 0
        or ids.max() >= config.vocab_size
        or np.unique(ids).size != ids.size
    ):
        raise DSparkError(
            "draft_to_target must map draft ids to distinct target ids below "
            f"{config.vocab_size}."
        )
    return mx.array(ids.astype(np.int32))


def draft_to_target_ids(
    d2t: np.ndarray, t2d: np.ndarray | None, vocab_size: int
) -> np.ndarray:
    """Absolute target ids of the draft ids from a speculators ``d2t`` table
    (offsets by convention; absolute tables are recognised)."""
    d2t = d2t.astype(np.int64).reshape(-1)
    offset = d2t + np.arange(d2t.size)
    candidates = [("offset", offset), ("absolute", d2t)]

    def valid(ids):
        return (
            ids.min(initial=0) >= 0
            and ids.max(initial=0) < vocab_size
            and np.unique(ids).size == ids.size
        )

    if t2d is not None:
        t2d = t2d.reshape(-1)
        if t2d.size != vocab_size:
            raise DSparkError(
                f"t2d has {t2d.size} entries, but the target vocabulary has {vocab_size}."
            )
        mapped = set(np.flatnonzero(t2d).tolist())
        for _, ids in candidates:
            if valid(ids) and set(ids.tolist()) == mapped:
                return ids
        raise DSparkError("The d2t and t2d vocabulary maps do not agree.")
    for _, ids in candidates:
        if valid(ids):
            return ids
    raise DSparkError("The d2t map does not map draft ids to distinct target ids.")
