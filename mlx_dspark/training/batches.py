"""Anchors, blocks and labels of a training step; the draft vocabulary."""

from __future__ import annotations

from dataclasses import dataclass, fields

import mlx.core as mx
import numpy as np

from .data import Sequence


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
    supervised: int  # block positions with a label (valid.sum())
    # One rank's share of a step (:func:`shard`): the loss denominators
    # (weight sum, block count) of the whole step, divided by the ranks.
    denominators: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        """The per-sequence arrays, in field order."""
        scalars = ("supervised", "denominators")
        return [getattr(self, f.name) for f in fields(self) if f.name not in scalars]


def shard(batch: Batch, rank: int, size: int) -> Batch:
    """Rank ``rank``'s share of a step's batch: every ``size``-th sequence.

    Its loss is normalised by the whole batch's weight sum and block count
    divided by ``size``, so the mean of the ranks' losses (and gradients) is
    the whole batch's. ``supervised`` stays the whole step's count, which is
    what the loop reports as throughput.
    """
    arrays = [a[rank::size] for a in batch.arrays()]
    denominators = mx.array(
        [batch.weights.sum().item(), batch.valid[..., 0].sum().item()]
    )
    return Batch(*arrays, batch.supervised, denominators / size)


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
    length: int | None = None,
) -> Batch:
    """Anchors, blocks and labels; ``target_to_draft`` maps target ids to a
    reduced draft vocabulary (-1: not in it). Sequences are padded to
    ``length`` (default: the longest), so that every step has one shape."""
    N = len(sequences)
    S = max([len(s) for s in sequences] + [length or 0])
    tokens = np.zeros((N, S), dtype=np.int32)
    loss_mask = np.zeros((N, S + block_size + 1), dtype=bool)
    for n, seq in enumerate(sequences):
        tokens[n, : len(seq)] = seq.tokens
        loss_mask[n, : len(seq)] = seq.loss_mask
    anchors, keep = sample_anchors(sequences, count, rng)
    k = np.arange(block_size)
    label_pos = anchors[..., None] + k + 1
    rows = np.arange(N)[:, None, None]
    valid = loss_mask[rows, label_pos] & keep[..., None]
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
        int(valid.sum()),
    )


def training_labels(sequences: list[Sequence]) -> np.ndarray:
    return np.concatenate([s.tokens[s.loss_mask] for s in sequences]).astype(np.int64)


def frequent_tokens(labels: np.ndarray, count: int, vocab_size: int) -> np.ndarray:
    """The ``count`` most frequent labels (ties by lower id), sorted by id."""
    counts = np.bincount(labels, minlength=vocab_size)
    return np.sort(np.argsort(-counts, kind="stable")[:count]).astype(np.int32)


@dataclass
class DraftVocabulary:
    """A reduced draft vocabulary: its target ids and the inverse map."""

    ids: np.ndarray  # [V] target ids, sorted
    target_to_draft: np.ndarray  # [vocab] draft id or -1
    coverage: float  # fraction of the training labels inside it


def draft_vocabulary(
    sequences: list[Sequence],
    count: int,
    vocab_size: int,
    ids: np.ndarray | None = None,
) -> DraftVocabulary:
    """The ``count`` most frequent training labels, or the given ``ids`` (a
    drafter's own vocabulary), with their coverage of the labels."""
    labels = training_labels(sequences)
    if ids is None:
        ids = frequent_tokens(labels, count, vocab_size)
    target_to_draft = np.full(vocab_size, -1, dtype=np.int32)
    target_to_draft[ids] = np.arange(len(ids), dtype=np.int32)
    coverage = float(np.mean(target_to_draft[labels] >= 0))
    return DraftVocabulary(ids, target_to_draft, coverage)
