"""The DSpark loss (DeepSpec ``loss.py``, paper section 3.3).

CE (0.1) + total variation L1 between the draft and target distributions
(0.9) + BCE of the confidence head against ``1 - L1 / 2`` (1.0), block
position ``k`` weighted by ``exp(-k / gamma)``. The sequential head is
teacher-forced with the true previous tokens.

mlx-dspark adds an optional greedy term (``greedy_weight``, 0 = DeepSpec's
loss): CE against the target's most likely token, the draft a greedy target
keeps. Beside the expected accepted length of sampling at T=1 (``tau``,
``1 - L1 / 2`` per position), the terms report the teacher-forced greedy one
(``greedy_tau``): positions count while the draft's most likely token is the
target's.

With a reduced draft vocabulary the draft puts no mass outside it, so the
target's mass there (``outside``) adds to the L1 distance as it is: the loss
is the full-vocabulary one, computed from the target's distribution over the
draft vocabulary plus one number per position. That is all the teacher store
keeps (:mod:`.teacher`).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..proposers.dspark import DSparkDrafter
from ..proposers.dspark_heads import MarkovHead
from .batches import Batch
from .model import training_hidden

CE_WEIGHT = 0.1
TV_WEIGHT = 0.9
CONFIDENCE_WEIGHT = 1.0


def draft_logits(drafter: DSparkDrafter, hidden: mx.array, prev: mx.array) -> mx.array:
    """Teacher-forced logits ``[..., B, V]`` (float32) over the output vocabulary."""
    logits = drafter.logits(hidden).astype(mx.float32)
    head = drafter.markov_head
    if head is None:
        return logits
    if type(head) is MarkovHead:  # position-independent: one product for all
        bias = head.markov_w2(head.prev_embeddings(prev))
    else:
        bias = head.block_bias(prev, hidden)
    return logits + bias.astype(mx.float32)


def loss_terms(
    drafter: DSparkDrafter,
    features: mx.array,
    target_p: mx.array,
    outside: mx.array,
    batch: Batch,
    greedy_weight: float = 0.0,
) -> tuple[mx.array, tuple[mx.array, ...]]:
    """The loss and its terms (ce, l1, confidence BCE, expected length at T=1
    and greedy).

    ``target_p`` ``[N * A, B, V]`` is the target's distribution over the
    drafter's output vocabulary at each block position and ``outside``
    ``[N * A, B]`` its mass outside that vocabulary (zero for a full one).
    A rank's share of a step (``batch.denominators``) is normalised by the
    whole step's weight sum and block count. The target's most likely token
    counts as known where it is inside the draft vocabulary for certain (its
    probability at least the mass outside); elsewhere it may lie outside,
    where no draft can match it: the greedy term skips the position and the
    greedy length counts it as a miss.
    """
    hidden = training_hidden(drafter, features, batch.anchors, batch.blocks)
    NA, B, _ = hidden.shape
    prev = batch.prev.reshape(NA, B)
    logits = draft_logits(drafter, hidden, prev)
    q = mx.softmax(logits, axis=-1, precise=True)  # the one exp pass over V
    weights = batch.weights.reshape(NA, B)
    valid = batch.valid.reshape(NA, B).astype(mx.float32)
    if batch.denominators is None:
        total, blocks_total = weights.sum(), valid[:, 0].sum()
    else:
        total, blocks_total = batch.denominators[0], batch.denominators[1]
    total = mx.maximum(total, 1e-6)
    labels = batch.labels.reshape(NA, B, 1)
    label_q = mx.take_along_axis(q, labels, axis=-1).squeeze(-1)
    ce = -mx.log(mx.maximum(label_q, 1e-30)) * batch.in_vocab.reshape(NA, B)
    target_p = target_p.astype(mx.float32)
    l1 = mx.abs(q - target_p).sum(axis=-1) + outside
    ce_loss = (ce * weights).sum() / total
    l1_loss = (l1 * weights).sum() / total
    accept = mx.stop_gradient(mx.clip(1.0 - 0.5 * l1, 0.0, 1.0))
    loss = CE_WEIGHT * ce_loss + TV_WEIGHT * l1_loss
    best = mx.argmax(target_p, axis=-1, keepdims=True)
    known = mx.take_along_axis(target_p, best, axis=-1).squeeze(-1) >= outside
    best = best.squeeze(-1)
    if greedy_weight:
        best_q = mx.take_along_axis(q, best[..., None], axis=-1).squeeze(-1)
        greedy_ce = -mx.log(mx.maximum(best_q, 1e-30)) * known
        loss = loss + greedy_weight * (greedy_ce * weights).sum() / total
    confidence = drafter.confidence(hidden, prev)
    if confidence is not None:
        bce = nn.losses.binary_cross_entropy(confidence, accept, reduction="none")
        conf_loss = (bce * weights).sum() / total
        loss = loss + CONFIDENCE_WEIGHT * conf_loss
    else:
        conf_loss = mx.array(0.0)
    blocks = valid[:, 0]
    expected = mx.cumprod(accept * valid, axis=-1).sum(axis=-1) + 1.0
    tau = (expected * blocks).sum() / mx.maximum(blocks_total, 1e-6)
    kept = ((mx.argmax(logits, axis=-1) == best) & known).astype(mx.float32)
    greedy = mx.cumprod(kept * valid, axis=-1).sum(axis=-1) + 1.0
    greedy_tau = (greedy * blocks).sum() / mx.maximum(blocks_total, 1e-6)
    return loss, (ce_loss, l1_loss, conf_loss, tau, greedy_tau)
