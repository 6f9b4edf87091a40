"""Train a DSpark drafter for an mlx-lm target: ``mlx_dspark.train``.

Method (DeepSpec / paper section 3.3): the frozen target runs once over each
sequence and yields the tapped context features and its own next-token
distributions. Anchors are sampled per sequence; each block ``[anchor, mask,
...]`` sits at positions ``anchor ..`` and attends, bidirectionally within the
block, to the projected features of the tokens strictly before the anchor.
Blocks are laid out along the batch axis so that the drafter's own attention
layers (with per-block RoPE offsets) do the work. Block position ``k``
predicts token ``anchor + k + 1``; the sequential head is teacher-forced with
the true previous tokens. Losses: CE (0.1) + total variation L1 between draft
and target distributions (0.9) + BCE of the confidence head against
``1 - L1 / 2`` (1.0), position ``k`` weighted by ``exp(-k / gamma)``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .config import DraftConfig
from .data import Sequence, load_sequences, regenerate, sha256
from .drafter import DSparkDrafter
from .errors import DSparkError, run_cli
from .target import TargetAdapter

CE_WEIGHT = 0.1
TV_WEIGHT = 0.9
CONFIDENCE_WEIGHT = 1.0
STATE_VERSION = 1
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass
class TrainArgs:
    model: str
    data: list[str]
    out: str
    block_size: int = 7
    layers: int = 2
    markov_head: str = "vanilla"
    markov_rank: int = 256
    draft_vocab: int | None = None
    target_layer_ids: list[int] | None = None
    confidence: bool = True
    mask_token_id: int | None = None
    steps: int | None = None
    epochs: float | None = None
    batch_size: int = 4
    anchors: int = 64
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seq_len: int = 512
    gamma: float = 4.0
    seed: int = 0
    resume: bool = False
    checkpoint_every: int = 500
    cache_features: str | None = None
    regenerate: bool = False
    regenerate_out: str | None = None
    regen_max_tokens: int = 256
    regen_prompt_tokens: int = 64
    regen_temperature: float = 0.7
    regen_batch_size: int = 8
    with_embeddings: bool = False
    dtype: str = "bfloat16"
    quantize_bits: int | None = None
    quantize_group_size: int = 64
    force: bool = False
    log_every: int = 10
    quiet: bool = False


@dataclass
class TrainResult:
    status: str
    out: Path | None
    checkpoint: Path
    step: int
    metrics: dict = field(default_factory=dict)
    history: list = field(default_factory=list)


# ---------------------------------------------------------------- configuration


def default_layer_ids(num_layers: int) -> list[int]:
    """Evenly spaced taps, DeepSpec style (``1 .. L-3`` for deep targets)."""
    if num_layers >= 8:
        ids = np.linspace(1, num_layers - 3, 5)
    else:
        ids = np.linspace(0, max(num_layers - 2, 0), min(max(num_layers - 1, 1), 3))
    return sorted({int(round(i)) for i in ids})


def drafter_config(
    target_config: dict,
    adapter: TargetAdapter,
    args: TrainArgs,
    mask_token_id: int,
    draft_vocab_size: int | None = None,
) -> DraftConfig:
    """The target's config plus the DSpark keys, as DeepSpec writes it."""
    config = {
        k: v
        for k, v in target_config.items()
        if k not in ("quantization", "quantization_config", "layer_types")
    }
    rank = 0 if args.markov_head == "none" else args.markov_rank
    head_dim = config.get("head_dim") or (
        adapter.hidden_size // config["num_attention_heads"]
    )
    config.update(
        architectures=["Qwen3DSparkModel"],
        head_dim=head_dim,
        num_hidden_layers=args.layers,
        num_target_layers=adapter.num_layers,
        block_size=args.block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=list(adapter.layer_ids),
        num_anchors=args.anchors,
        markov_rank=rank,
        markov_head_type=args.markov_head if rank else "vanilla",
        enable_confidence_head=args.confidence,
        confidence_head_with_markov=bool(args.confidence and rank),
        tie_word_embeddings=False,
        layer_types=["full_attention"] * args.layers,
    )
    if draft_vocab_size is not None:
        config["draft_vocab_size"] = draft_vocab_size
    config.setdefault("rope_theta", 10000.0)
    config.setdefault("rms_norm_eps", 1e-6)
    return DraftConfig.from_dict(config)


def training_labels(sequences: list[Sequence]) -> np.ndarray:
    return np.concatenate([s.tokens[s.loss_mask] for s in sequences]).astype(np.int64)


def frequent_tokens(labels: np.ndarray, count: int, vocab_size: int) -> np.ndarray:
    """The ``count`` most frequent labels (ties by lower id), sorted by id."""
    counts = np.bincount(labels, minlength=vocab_size)
    return np.sort(np.argsort(-counts, kind="stable")[:count]).astype(np.int32)


def new_drafter(
    config: DraftConfig,
    target: TargetAdapter,
    seed: int,
    draft_ids: np.ndarray | None = None,
) -> DSparkDrafter:
    """A freshly initialised drafter sharing the target's frozen embedding/head.

    With a reduced draft vocabulary (``draft_ids``, target ids) the LM head is
    the drafter's own: the target head's rows for those ids, also frozen.
    """
    mx.random.seed(seed)
    drafter = DSparkDrafter(config)
    if config.reduced_vocab:
        drafter.share_embeddings(target.embed, None)
        drafter.own_embeddings(embed=False, head=True)
        ids = mx.array(draft_ids)
        drafter.lm_head.weight = _head_weight(target)[ids]
        drafter.draft_to_target = ids
        drafter.freeze(keys=["lm_head"], recurse=True)
    else:
        drafter.share_embeddings(target.embed, target.lm_head)
    drafter.update(
        tree_unflatten(
            [
                (k, v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
                for k, v in tree_flatten(drafter.parameters())
            ]
        )
    )
    # The drafter's output feeds the target's LM head: start from the target's
    # final-norm scale so that the first logits are on the target's scale.
    final_norm = getattr(target.inner.norm, "weight", None)
    if final_norm is not None and final_norm.shape == drafter.norm.weight.shape:
        drafter.norm.weight = final_norm.astype(mx.float32)
    mx.eval(drafter.parameters())
    return drafter


# ----------------------------------------------------------------- the forward


def training_hidden(
    drafter: DSparkDrafter,
    features: mx.array,
    anchors: mx.array,
    blocks: mx.array,
) -> mx.array:
    """Backbone hidden states of many blocks at once.

    ``features`` ``[N, S, F]`` are the target features of N sequences,
    ``anchors`` ``[N, A]`` the anchor positions and ``blocks`` ``[N, A, B]``
    the block tokens. Block ``(n, a)`` attends to the context features of
    positions ``< anchors[n, a]`` of sequence ``n`` and to itself. Returns
    ``[N * A, B, d]``; this equals ``drafter(block, anchor, features[:, :anchor],
    fresh_cache)`` block by block.
    """
    N, S, _ = features.shape
    A, B = blocks.shape[1], blocks.shape[2]
    flat_anchors = anchors.reshape(-1).astype(mx.int32)
    visible = mx.arange(S)[None, :] < flat_anchors[:, None]
    mask = mx.concatenate([visible, mx.ones((N * A, B), dtype=mx.bool_)], axis=1)
    mask = mask[:, None, None, :]
    projected = drafter.hidden_norm(drafter.fc(features))
    h = drafter.embed(blocks.reshape(N * A, B))
    for layer in drafter.layers:
        keys, values = layer.self_attn.key_values(projected, 0)
        keys = mx.repeat(keys, A, axis=0)
        values = mx.repeat(values, A, axis=0)
        h = layer(h, flat_anchors, keys, values, mask)
    return drafter.norm(h)


@dataclass
class Batch:
    tokens: mx.array  # [N, S]
    anchors: mx.array  # [N, A]
    blocks: mx.array  # [N, A, B]
    labels: mx.array  # [N, A, B] in the drafter's output vocabulary
    in_vocab: mx.array  # [N, A, B] the label is in that vocabulary
    prev: mx.array  # [N, A, B]
    weights: mx.array  # [N, A, B] eval mask x position decay
    valid: mx.array  # [N, A, B] eval mask
    positions: mx.array  # [N, A, B] target rows predicting the labels


def sample_anchors(
    sequences: list[Sequence], count: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted anchors ``[N, count]`` whose first label is a training target."""
    anchors = np.zeros((len(sequences), count), dtype=np.int32)
    keep = np.zeros((len(sequences), count), dtype=bool)
    for n, seq in enumerate(sequences):
        candidates = np.flatnonzero(seq.loss_mask[1:])
        if len(candidates) > count:
            candidates = np.sort(rng.choice(candidates, count, replace=False))
        anchors[n, : len(candidates)] = candidates
        keep[n, : len(candidates)] = True
    return anchors, keep


def make_batch(
    sequences: list[Sequence],
    count: int,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    rng: np.random.Generator,
    target_to_draft: np.ndarray | None = None,
) -> Batch:
    """Anchors, blocks and labels; ``target_to_draft`` maps target ids to a
    reduced draft vocabulary (-1: not in it)."""
    N = len(sequences)
    S = max(len(s) for s in sequences)
    tokens = np.zeros((N, S), dtype=np.int32)
    loss_mask = np.zeros((N, S + block_size + 1), dtype=bool)
    for n, seq in enumerate(sequences):
        tokens[n, : len(seq)] = seq.tokens
        loss_mask[n, : len(seq)] = seq.loss_mask
    anchors, keep = sample_anchors(sequences, count, rng)
    k = np.arange(block_size)
    label_pos = anchors[..., None] + k + 1
    rows = np.arange(N)[:, None, None]
    valid = (
        np.take_along_axis(loss_mask[:, None, :].repeat(count, 1), label_pos, axis=2)
        & keep[..., None]
    )
    valid = np.cumprod(valid, axis=-1).astype(bool)
    padded = np.concatenate([tokens, np.zeros((N, block_size + 1), np.int32)], axis=1)
    labels = padded[rows, label_pos]
    anchor_tokens = tokens[np.arange(N)[:, None], anchors]
    prev = np.concatenate([anchor_tokens[..., None], labels[..., :-1]], axis=-1)
    blocks = np.full((N, count, block_size), mask_token_id, dtype=np.int32)
    blocks[..., 0] = anchor_tokens
    weights = valid * np.exp(-k / gamma)[None, None, :]
    positions = np.minimum(label_pos - 1, S - 1)
    in_vocab = np.ones_like(valid)
    if target_to_draft is not None:
        labels = target_to_draft[labels]
        in_vocab = labels >= 0
        labels = np.maximum(labels, 0)
    return Batch(
        mx.array(tokens),
        mx.array(anchors),
        mx.array(blocks),
        mx.array(labels),
        mx.array(in_vocab),
        mx.array(prev),
        mx.array(weights.astype(np.float32)),
        mx.array(valid),
        mx.array(positions.astype(np.int32)),
    )


def target_probs(
    target: TargetAdapter,
    hidden: mx.array,
    positions: mx.array,
    draft_ids: mx.array | None = None,
) -> mx.array:
    """Target probabilities at ``positions`` ``[N, A, B]`` from final hidden
    states, restricted to ``draft_ids`` for a reduced draft vocabulary."""
    N, A, B = positions.shape
    rows = mx.take_along_axis(
        hidden, positions.reshape(N, A * B)[..., None], axis=1
    ).reshape(N * A, B, -1)
    logits = target.lm_head(rows).astype(mx.float32)
    if draft_ids is None:
        return mx.stop_gradient(mx.softmax(logits, axis=-1, precise=True))
    logp = mx.take(logits, draft_ids, axis=-1) - mx.logsumexp(
        logits, axis=-1, keepdims=True
    )
    return mx.stop_gradient(mx.exp(logp))


def loss_terms(
    drafter: DSparkDrafter,
    features: mx.array,
    target_p: mx.array,
    batch: Batch,
) -> tuple[mx.array, tuple[mx.array, ...]]:
    """The DSpark loss and its terms (ce, l1, confidence BCE, expected length).

    With a reduced draft vocabulary the draft puts no mass outside it, so the
    target's mass there adds to the L1 distance as it is.
    """
    hidden = training_hidden(drafter, features, batch.anchors, batch.blocks)
    NA, B, _ = hidden.shape
    prev = batch.prev.reshape(NA, B)
    logits = drafter.logits(hidden).astype(mx.float32)
    if drafter.markov_head is not None:
        logits = logits + drafter.markov_head.block_bias(prev, hidden).astype(
            mx.float32
        )
    q = mx.softmax(logits, axis=-1, precise=True)
    weights = batch.weights.reshape(NA, B)
    valid = batch.valid.reshape(NA, B).astype(mx.float32)
    total = mx.maximum(weights.sum(), 1e-6)
    labels = batch.labels.reshape(NA, B)
    label_q = mx.take_along_axis(q, labels[..., None], axis=-1).squeeze(-1)
    ce = -mx.log(mx.maximum(label_q, 1e-30)) * batch.in_vocab.reshape(NA, B)
    l1 = mx.abs(q - target_p).sum(axis=-1)
    if drafter.config.reduced_vocab:
        l1 = l1 + mx.maximum(1.0 - target_p.sum(axis=-1), 0.0)
    ce_loss = (ce * weights).sum() / total
    l1_loss = (l1 * weights).sum() / total
    accept = mx.stop_gradient(mx.clip(1.0 - 0.5 * l1, 0.0, 1.0))
    loss = CE_WEIGHT * ce_loss + TV_WEIGHT * l1_loss
    confidence = drafter.confidence(hidden, prev)
    if confidence is not None:
        bce = nn.losses.binary_cross_entropy(confidence, accept, reduction="none")
        conf_loss = (bce * weights).sum() / total
        loss = loss + CONFIDENCE_WEIGHT * conf_loss
    else:
        conf_loss = mx.array(0.0)
    blocks = valid[:, 0]
    expected = mx.cumprod(accept * valid, axis=-1).sum(axis=-1) + 1.0
    tau = (expected * blocks).sum() / mx.maximum(blocks.sum(), 1.0)
    return loss, (ce_loss, l1_loss, conf_loss, tau)


# --------------------------------------------------------------- target features


class FeatureSource:
    """Target features and final hidden states of sequences, on the fly or cached."""

    def __init__(
        self, target: TargetAdapter, cache_dir: Path | None, sequences: list[Sequence]
    ):
        self.target = target
        self.cache_dir = cache_dir
        self.sequences = sequences
        if cache_dir is not None:
            cache_dir.mkdir(parents=True, exist_ok=True)

    def _compute(self, tokens: mx.array) -> tuple[mx.array, mx.array]:
        hidden, features = self.target.hidden(tokens, self.target.make_cache())
        return features.astype(mx.float32), hidden

    def _file(self, index: int) -> Path:
        return self.cache_dir / f"{index:08d}.safetensors"

    def get(self, indices: list[int], tokens: mx.array) -> tuple[mx.array, mx.array]:
        if self.cache_dir is None:
            features, hidden = self._compute(tokens)
            mx.eval(features, hidden)
            return features, hidden
        missing = [j for j, i in enumerate(indices) if not self._file(i).exists()]
        if missing:
            features, hidden = self._compute(tokens[mx.array(missing)])
            for row, j in enumerate(missing):
                n = len(self.sequences[indices[j]])
                arrays = {"features": features[row, :n], "hidden": hidden[row, :n]}
                arrays = {k: _storable(v) for k, v in arrays.items()}
                final = self._file(indices[j])
                partial = final.with_name(final.stem + ".tmp.safetensors")
                mx.save_safetensors(str(partial), arrays)
                os.replace(partial, final)
        S = tokens.shape[1]
        feats, hids = [], []
        for i in indices:
            try:
                loaded = mx.load(str(self._file(i)))
            except Exception:
                raise DSparkError(
                    f"The feature cache file {self._file(i)} is corrupted; delete it."
                ) from None
            pad = S - loaded["features"].shape[0]
            feats.append(
                mx.pad(loaded["features"].astype(mx.float32), [(0, pad), (0, 0)])
            )
            hids.append(mx.pad(loaded["hidden"], [(0, pad), (0, 0)]))
        features, hidden = mx.stack(feats), mx.stack(hids)
        mx.eval(features, hidden)
        return features, hidden


def _storable(x: mx.array) -> mx.array:
    x = x.astype(mx.float32)
    if mx.abs(x).max().item() < 6e4:
        return x.astype(mx.float16)
    return x.astype(mx.bfloat16)


# ------------------------------------------------------------------ checkpoints


def _write_dir_atomically(final: Path, write: Callable[[Path], None]) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
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

    _write_dir_atomically(path, write)


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


def _head_weight(target: TargetAdapter) -> mx.array:
    """The target's LM head matrix ``[vocab, hidden]`` (tied or not), dense."""
    if "lm_head" in target.model:
        return _dense_weight(target.model.lm_head)
    return _dense_weight(target.inner.embed_tokens)


def _dense_weight(module: nn.Module) -> mx.array:
    if "scales" in module:
        return mx.dequantize(
            module.weight,
            module.scales,
            module.get("biases"),
            group_size=module.group_size,
            bits=module.bits,
            mode=getattr(module, "mode", "affine"),
        )
    return module.weight


def export_drafter(
    out: Path,
    drafter: DSparkDrafter,
    target: TargetAdapter,
    record: dict,
    with_embeddings: bool,
    dtype: mx.Dtype,
    quantize: tuple[int, int] | None = None,
) -> None:
    """Write a DeepSpec-format drafter directory (atomically).

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
        weights["embed_tokens.weight"] = _dense_weight(target.inner.embed_tokens)
        if not drafter.config.reduced_vocab:
            weights["lm_head.weight"] = _head_weight(target)

    def write(directory: Path) -> None:
        (directory / "config.json").write_text(
            json.dumps(drafter.config.to_dict(), indent=2)
        )
        mx.save_safetensors(
            str(directory / "model.safetensors"), weights, metadata={"format": "pt"}
        )
        (directory / "training_record.json").write_text(json.dumps(record, indent=2))

    _write_dir_atomically(out, write)


# ---------------------------------------------------------------------- training


def checkpoint_path(out: Path) -> Path:
    return out.with_name(out.name + ".checkpoint")


def _schedule(lr: float, total: int, warmup: int):
    decay = optim.cosine_decay(lr, max(total - warmup, 1), end=0.1 * lr)
    if warmup <= 0:
        return decay
    return optim.join_schedules(
        [optim.linear_schedule(lr / warmup, lr, warmup), decay], [warmup]
    )


class _StopFlag:
    """Ctrl-C asks for a clean stop at the end of the step; twice aborts."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


def _load_target(path: str):
    from mlx_lm.utils import load as mlx_lm_load

    from .loading import read_config, resolve_path

    target_path = resolve_path(path, "model")
    config = read_config(target_path)
    try:
        model, tokenizer = mlx_lm_load(str(target_path))
    except (ValueError, FileNotFoundError, OSError) as error:
        raise DSparkError(
            f"Could not load the model at {target_path}: {error}"
        ) from None
    model.freeze()
    return target_path, config, model, tokenizer


def _check_args(args: TrainArgs) -> None:
    if args.markov_head not in ("vanilla", "gated", "rnn", "none"):
        raise DSparkError(
            f"--markov-head must be vanilla, gated, rnn or none, got {args.markov_head!r}."
        )
    positive = {
        "--block-size": args.block_size,
        "--layers": args.layers,
        "--batch-size": args.batch_size,
        "--anchors": args.anchors,
        "--seq-len": args.seq_len,
    }
    if args.draft_vocab is not None:
        positive["--draft-vocab"] = args.draft_vocab
    if args.markov_head != "none":
        positive["--markov-rank"] = args.markov_rank
    for flag, value in positive.items():
        if value < 1:
            raise DSparkError(f"{flag} must be at least 1, got {value}.")
    if args.steps is not None and args.epochs is not None:
        raise DSparkError("Give either --steps or --epochs, not both.")
    if args.steps is not None and args.steps < 1:
        raise DSparkError(f"--steps must be at least 1, got {args.steps}.")
    if args.epochs is not None and args.epochs <= 0:
        raise DSparkError(f"--epochs must be positive, got {args.epochs}.")
    if args.lr <= 0:
        raise DSparkError(f"--lr must be positive, got {args.lr}.")
    if args.dtype not in DTYPES:
        raise DSparkError(
            f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}."
        )


def _progress(quiet: bool):
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[metrics]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=quiet,
    )


def _say(args: TrainArgs, message: str) -> None:
    if not args.quiet:
        print(message, flush=True)


def train(
    args: TrainArgs, should_stop: Callable[[int], bool] | None = None
) -> TrainResult:
    """Train a drafter; ``should_stop(step)`` can request a clean stop (tests)."""
    _check_args(args)
    out = Path(args.out).expanduser()
    ckpt = checkpoint_path(out)
    if out.exists() and not args.force:
        raise DSparkError(
            f"The output directory {out} already exists; pass --force to replace it."
        )
    if ckpt.exists() and not args.resume and not args.force:
        raise DSparkError(
            f"A training checkpoint exists at {ckpt}; pass --resume to continue it "
            "or --force to start over."
        )
    if args.resume and not ckpt.exists():
        raise DSparkError(f"--resume found no checkpoint at {ckpt}.")

    target_path, target_config, model, tokenizer = _load_target(args.model)
    layer_ids = args.target_layer_ids
    if layer_ids is None:
        layer_ids = default_layer_ids(len(model.layers))
    target = TargetAdapter(model, layer_ids)
    mask_token_id = (
        target.vocab_size - 1 if args.mask_token_id is None else args.mask_token_id
    )
    if not 0 <= mask_token_id < target.vocab_size:
        raise DSparkError(
            f"--mask-token-id {mask_token_id} is outside the vocabulary (size {target.vocab_size})."
        )
    data_files = list(args.data)
    inputs = [
        {"path": str(p), "sha256": sha256(p)} for p in data_files if Path(p).is_file()
    ]
    if args.regenerate:
        regen_out = Path(args.regenerate_out or str(out) + ".regenerated.jsonl")
        with _progress(args.quiet) as bar:
            task = bar.add_task("regenerating", total=None, metrics="")
            regen_path, regen_report = regenerate(
                data_files,
                model,
                tokenizer,
                regen_out,
                seq_len=args.seq_len,
                max_tokens=args.regen_max_tokens,
                prompt_tokens=args.regen_prompt_tokens,
                batch_size=args.regen_batch_size,
                temperature=args.regen_temperature,
                seed=args.seed,
                progress=lambda done, total: bar.update(
                    task, completed=done, total=total
                ),
            )
        _say(args, f"regenerated responses in {regen_path}")
        data_files = [str(regen_path)]
    sequences, report = load_sequences(data_files, tokenizer, args.seq_len)
    _say(args, f"data: {report.summary()}")
    data_hashes = [{"path": str(p), "sha256": sha256(p)} for p in data_files]
    draft_ids = target_to_draft = coverage = None
    if args.draft_vocab is not None:
        if args.draft_vocab >= target.vocab_size:
            raise DSparkError(
                f"--draft-vocab {args.draft_vocab} must be smaller than the target's "
                f"vocabulary ({target.vocab_size})."
            )
        labels = training_labels(sequences)
        draft_ids = frequent_tokens(labels, args.draft_vocab, target.vocab_size)
        target_to_draft = np.full(target.vocab_size, -1, dtype=np.int32)
        target_to_draft[draft_ids] = np.arange(len(draft_ids), dtype=np.int32)
        coverage = float(np.mean(target_to_draft[labels] >= 0))
        _say(
            args,
            f"draft vocabulary: {len(draft_ids)} tokens, "
            f"{coverage:.1%} of the training labels",
        )
    config = drafter_config(
        target_config,
        target,
        args,
        mask_token_id,
        None if draft_ids is None else len(draft_ids),
    )

    per_epoch = math.ceil(len(sequences) / args.batch_size)
    if args.steps is not None:
        total = args.steps
    else:
        total = max(1, math.ceil((args.epochs or 1.0) * per_epoch))
    warmup = int(args.warmup * total)

    drafter = new_drafter(config, target, args.seed, draft_ids)
    draft_ids_mx = None if draft_ids is None else mx.array(draft_ids)
    optimizer = optim.AdamW(
        learning_rate=_schedule(args.lr, total, warmup), weight_decay=args.weight_decay
    )
    identity = {
        "version": STATE_VERSION,
        "config": config.to_dict(),
        "data": data_hashes,
        "seed": args.seed,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "gamma": args.gamma,
        "lr": args.lr,
        "total_steps": total,
    }
    step, history = 0, []
    if args.resume:
        state = load_checkpoint(ckpt, drafter, optimizer)
        changed = [
            k for k, v in identity.items() if state.get("identity", {}).get(k) != v
        ]
        if changed:
            raise DSparkError(
                f"--resume needs the same settings and data as the checkpoint; "
                f"these differ: {', '.join(changed)}."
            )
        step, history = state["step"], state.get("history", [])
        _say(args, f"resumed from {ckpt} at step {step}")

    cache_dir = None
    if args.cache_features:
        key = sha256_text(
            json.dumps([str(target_path), layer_ids, data_hashes, args.seq_len])
        )
        cache_dir = Path(args.cache_features).expanduser() / key[:16]
    features = FeatureSource(target, cache_dir, sequences)
    loss_and_grad = nn.value_and_grad(drafter, loss_terms)

    def run_step(indices: list[int], rng: np.random.Generator):
        seqs = [sequences[i] for i in indices]
        batch = make_batch(
            seqs,
            args.anchors,
            args.block_size,
            mask_token_id,
            args.gamma,
            rng,
            target_to_draft,
        )
        feats, hidden = features.get(indices, batch.tokens)
        probs = target_probs(target, hidden, batch.positions, draft_ids_mx)
        (loss, terms), grads = loss_and_grad(drafter, feats, probs, batch)
        if args.grad_clip > 0:
            grads, _ = optim.clip_grad_norm(grads, args.grad_clip)
        optimizer.update(drafter, grads)
        mx.eval(drafter.parameters(), optimizer.state, loss, terms)
        return [loss.item(), *(t.item() for t in terms)]

    def snapshot(step: int) -> dict:
        epoch, position = divmod(step, per_epoch)
        return {
            "identity": identity,
            "step": step,
            "epoch": epoch,
            "position": position * args.batch_size,
            "history": history,
            "rng": {
                "numpy": "seeded by (seed, epoch) for order, (seed, step) for anchors"
            },
        }

    names = ("loss", "ce", "tv", "conf", "tau")
    running = None
    recent: list[list[float]] = []
    status = "done"
    tic = time.perf_counter()
    with _StopFlag() as stop, _progress(args.quiet) as bar:
        task = bar.add_task("training", total=total, completed=step, metrics="")
        while step < total:
            epoch, position = divmod(step, per_epoch)
            order = np.random.default_rng([args.seed, epoch]).permutation(
                len(sequences)
            )
            indices = order[
                position * args.batch_size : (position + 1) * args.batch_size
            ]
            values = run_step(
                [int(i) for i in indices], np.random.default_rng([args.seed, 1, step])
            )
            step += 1
            recent = (recent + [values])[-max(1, total // 10) :]
            running = (
                values
                if running is None
                else [0.9 * r + 0.1 * v for r, v in zip(running, values, strict=True)]
            )
            if step % args.log_every == 0 or step == total:
                history.append([step, *values])
            shown = "  ".join(
                f"{n} {v:.3f}" for n, v in zip(names, running, strict=True)
            )
            bar.update(task, completed=step, metrics=shown)
            if (
                args.checkpoint_every
                and step % args.checkpoint_every == 0
                and step < total
            ):
                save_checkpoint(ckpt, drafter, optimizer, snapshot(step))
            if stop.requested or (should_stop is not None and should_stop(step)):
                if step < total:
                    status = "interrupted"
                    break
    elapsed = time.perf_counter() - tic
    save_checkpoint(ckpt, drafter, optimizer, snapshot(step))
    final = {
        n: float(np.mean([r[i] for r in recent])) if recent else None
        for i, n in enumerate(names)
    }
    if status == "interrupted":
        print(
            f"stopped at step {step}/{total}; checkpoint saved to {ckpt}; "
            "rerun with --resume to continue",
            file=sys.stderr,
        )
        return TrainResult(status, None, ckpt, step, final, history)

    record = {
        "format": "mlx-dspark training record v1",
        "arguments": asdict(args),
        "target": str(target_path),
        "target_layer_ids": layer_ids,
        "mask_token_id": mask_token_id,
        "inputs": inputs,
        "data": data_hashes,
        "data_report": report.to_dict(),
        "draft_vocab_label_coverage": coverage,
        "steps": step,
        "steps_per_epoch": per_epoch,
        "train_time_s": elapsed,
        "final_metrics": final,
        "history_columns": ["step", *names],
        "history": history,
        "versions": {"mlx": mx.__version__, "mlx_lm": _mlx_lm_version()},
    }
    if out.exists() and args.force:
        shutil.rmtree(out)
    quantize = None
    if args.quantize_bits:
        quantize = (args.quantize_bits, args.quantize_group_size)
    export_drafter(
        out,
        drafter,
        target,
        record,
        args.with_embeddings,
        DTYPES[args.dtype],
        quantize,
    )
    _say(args, f"wrote {out} ({', '.join(f'{n} {v:.3f}' for n, v in final.items())})")
    return TrainResult(status, out, ckpt, step, final, history)


def sha256_text(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()


def _mlx_lm_version() -> str:
    try:
        from mlx_lm import __version__

        return __version__
    except ImportError:
        return "unknown"


# ---------------------------------------------------------------------------- CLI


def _layer_ids(value: str) -> list[int]:
    try:
        return [int(v) for v in value.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers like 1,8,15, got {value!r}"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mlx_dspark.train",
        description="Train a DSpark drafter for an mlx-lm target model.",
    )
    d = TrainArgs(model="", data=[], out="")
    p.add_argument(
        "--model", required=True, help="Target model path or Hugging Face repo."
    )
    p.add_argument(
        "--data",
        nargs="+",
        required=True,
        metavar="FILE",
        help="Text files and/or JSONL files (messages, prompt/completion, text, tokens).",
    )
    p.add_argument(
        "--out", required=True, help="Output drafter directory (DeepSpec format)."
    )
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--layers", type=int, default=d.layers, help="Draft layers.")
    p.add_argument(
        "--markov-head",
        default=d.markov_head,
        choices=["vanilla", "gated", "rnn", "none"],
    )
    p.add_argument("--markov-rank", type=int, default=d.markov_rank)
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="Draft over the N most frequent training tokens only (smaller, faster "
        "drafter; still lossless). Default: the target's whole vocabulary.",
    )
    p.add_argument(
        "--target-layer-ids",
        type=_layer_ids,
        default=None,
        help="Target layers to tap, e.g. 1,8,15 (-1 = embeddings).",
    )
    p.add_argument(
        "--confidence",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Train the confidence head.",
    )
    p.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        help="Mask token id (default: the last vocabulary id).",
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument("--steps", type=int, default=None)
    group.add_argument("--epochs", type=float, default=None)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument(
        "--anchors", type=int, default=d.anchors, help="Blocks per sequence."
    )
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup", type=float, default=d.warmup, help="Warm-up fraction.")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument(
        "--gamma", type=float, default=d.gamma, help="Position-weight decay."
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--resume", action="store_true", help="Continue from the checkpoint."
    )
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    p.add_argument(
        "--cache-features",
        default=None,
        metavar="DIR",
        help="Cache target features on disk (for multi-epoch runs).",
    )
    p.add_argument(
        "--regenerate",
        action="store_true",
        help="First let the target write the responses.",
    )
    p.add_argument("--regenerate-out", default=None, metavar="FILE")
    p.add_argument("--regen-max-tokens", type=int, default=d.regen_max_tokens)
    p.add_argument("--regen-prompt-tokens", type=int, default=d.regen_prompt_tokens)
    p.add_argument("--regen-temperature", type=float, default=d.regen_temperature)
    p.add_argument("--regen-batch-size", type=int, default=d.regen_batch_size)
    p.add_argument(
        "--with-embeddings",
        action="store_true",
        help="Also write embed_tokens/lm_head copies, as DeepSpec does.",
    )
    p.add_argument("--dtype", default=d.dtype, choices=list(DTYPES))
    p.add_argument(
        "--quantize-bits",
        type=int,
        default=None,
        choices=[2, 3, 4, 6, 8],
        help="Write the drafter quantized (MLX format) to this many bits.",
    )
    p.add_argument("--quantize-group-size", type=int, default=d.quantize_group_size)
    p.add_argument("--force", action="store_true", help="Replace an existing output.")
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--quiet", action="store_true")
    return p


def _main() -> None:
    ns = build_parser().parse_args()
    args = TrainArgs(**vars(ns))
    result = train(args)
    if result.status == "interrupted":
        raise SystemExit(130)


def main() -> None:
    run_cli(_main)


if __name__ == "__main__":
    main()
