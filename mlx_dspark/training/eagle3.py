"""Training an EAGLE-3 drafter: DeepSpec's EAGLE-3 objective in MLX.

The training-time test (TTT) unrolls the drafter ``ttt_length`` times over
every position of a sequence at once. Step 0 reads ``fc`` of the target's
features; step ``j`` reads the drafter's own outputs of step ``j - 1``, so
that training sees what drafting sees. Position ``t`` at step ``j`` is fed
token ``t + 1 + j`` at RoPE position ``t + j`` and predicts token
``t + 2 + j``; it attends to the step-0 keys of positions ``0 .. t`` and to
its own keys of steps ``1 .. j`` - exactly the keys
:meth:`~mlx_dspark.proposers.eagle3.Eagle3Drafter.draft` holds when it drafts its
``j``-th token after position ``t``. The loss per step is the soft
cross-entropy against the target's distribution, summed over supervised
positions and divided by the sequence length (DeepSpec's per-sequence
"local mean"), step ``j`` weighted by ``step_loss_decay ** j`` (0.8).

The target's features and distributions come from the same teacher store
as DSpark's (:mod:`.teacher`); with a reduced draft vocabulary the target's
distribution is renormalised over it for the cross-entropy, while the
reported total variation counts the mass outside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..errors import DSparkError
from ..proposers.eagle3 import Eagle3Drafter
from ..proposers.eagle3_config import Eagle3Config
from ..targets.adapter import TargetAdapter
from .data import Sequence
from .model import start_norm_from_target, target_text_config, use_target_embeddings

STEP_LOSS_DECAY = 0.8


@dataclass
class Eagle3Batch:
    """Sequences of a step and which (position, TTT step) pairs are supervised."""

    tokens: mx.array  # [N, S]
    positions: mx.array  # [N, S, 1] every row: the teacher's rows as they are
    weights: mx.array  # [N, S, J] decay ** j / (length * N) where supervised
    valid: mx.array  # [N, S, J] token t + 2 + j is a training target
    supervised: int
    denominators: mx.array | None = None  # unused: one process only

    def arrays(self) -> list[mx.array]:
        return [self.tokens, self.positions, self.weights, self.valid]


def make_eagle3_batch(
    sequences: list[Sequence],
    ttt_length: int,
    decay: float = STEP_LOSS_DECAY,
    length: int | None = None,
) -> Eagle3Batch:
    """The batch of ``sequences``, padded to ``length`` (default: the longest).

    A prediction is supervised while the tokens it and the steps before it
    predict are training targets (a chain stops where the supervised text
    does, as a DSpark block does)."""
    N = len(sequences)
    S = max([len(s) for s in sequences] + [length or 0])
    J = ttt_length
    tokens = np.zeros((N, S), dtype=np.int32)
    loss_mask = np.zeros((N, S + J + 2), dtype=bool)
    lengths = np.ones(N, dtype=np.float32)
    for n, seq in enumerate(sequences):
        tokens[n, : len(seq)] = seq.tokens
        loss_mask[n, : len(seq)] = seq.loss_mask
        lengths[n] = max(len(seq), 1)
    label = np.arange(S)[:, None] + np.arange(J)[None, :] + 2  # [S, J]
    valid = np.cumprod(loss_mask[:, label], axis=-1).astype(bool)  # [N, S, J]
    scale = (decay ** np.arange(J))[None, None, :] / (lengths[:, None, None] * N)
    positions = np.broadcast_to(np.arange(S, dtype=np.int32)[None, :, None], (N, S, 1))
    return Eagle3Batch(
        mx.array(tokens),
        mx.array(positions),
        mx.array((valid * scale).astype(np.float32)),
        mx.array(valid),
        int(valid.sum()),
    )


def eagle3_config(
    target_config: dict,
    adapter: TargetAdapter,
    *,
    layers: int,
    ttt_length: int,
    draft_vocab_size: int | None = None,
) -> Eagle3Config:
    """DeepSpec's ``Qwen3Eagle3Model`` config for the target: its text config
    with the EAGLE-3 keys, as DeepSpec's ``build_draft_config`` writes them."""
    if adapter.model_type in ("gemma4_text", "gemma4"):
        raise DSparkError(
            "Training EAGLE-3 drafters for Gemma-4 targets is not supported yet; "
            "train a DSpark drafter (--kind dspark)."
        )
    config = target_text_config(target_config, adapter)
    config.update(
        architectures=["Qwen3Eagle3Model"],
        num_target_layers=adapter.num_layers,
        num_hidden_layers=layers,
        draft_num_hidden_layers=layers,
        layer_types=["full_attention"] * layers,
        target_layer_ids=list(adapter.layer_ids),
        ttt_length=ttt_length,
        step_loss_decay=STEP_LOSS_DECAY,
        tie_word_embeddings=False,
    )
    if draft_vocab_size is not None:
        config["draft_vocab_size"] = draft_vocab_size
    return Eagle3Config.from_deepspec(config)


def new_eagle3_drafter(
    config: Eagle3Config,
    target: TargetAdapter,
    seed: int,
    draft_ids: np.ndarray | None = None,
) -> Eagle3Drafter:
    """A fresh float32 drafter on the target's frozen embedding and LM head
    (a reduced vocabulary: the head's rows for ``draft_ids``, frozen)."""
    mx.random.seed(seed)
    drafter = Eagle3Drafter(config)
    use_target_embeddings(drafter, target, draft_ids)
    if config.reduced_vocab:
        drafter.lm_head.weight = drafter.lm_head.weight.astype(mx.float32)
    start_norm_from_target(drafter, target)
    mx.eval(drafter.parameters())
    return drafter


def unrolled_hidden(
    drafter: Eagle3Drafter, features: mx.array, tokens: mx.array, steps: int
) -> list[mx.array]:
    """The drafter's hidden states ``[N, S, d]`` at each of ``steps`` TTT steps
    (see the module docstring), through the drafter's own forward: step
    ``j`` appends its keys to the cache and attends with the step-0 causal
    mask beside ``j`` diagonal ones."""
    N, S = tokens.shape
    cache = drafter.make_cache()
    hidden = drafter.project(features)
    causal = mx.arange(S)[None, :] <= mx.arange(S)[:, None]
    diagonal = mx.eye(S, dtype=mx.bool_)
    padded = mx.concatenate([tokens, mx.zeros((N, steps + 1), tokens.dtype)], axis=1)
    out = []
    for j in range(steps):
        mask = mx.concatenate([causal, *([diagonal] * j)], axis=1)
        hidden = drafter(hidden, padded[:, j + 1 : j + 1 + S], j, cache, mask)
        out.append(hidden)
    return out


def eagle3_loss_terms(
    drafter: Eagle3Drafter,
    features: mx.array,
    target_p: mx.array,
    outside: mx.array,
    batch: Eagle3Batch,
) -> tuple[mx.array, tuple[mx.array, ...]]:
    """The loss and the terms of :data:`~.trainer.METRICS` after it: the
    soft cross-entropy per step (undecayed mean), total variation, 0 for the
    confidence term (EAGLE-3 has none), and the expected accepted length at
    T=1 and greedy, per starting position, over the unrolled steps.

    ``target_p`` ``[N * S, 1, V]`` and ``outside`` ``[N * S, 1]`` are the
    teacher's rows as they are (``batch.positions``): row ``r`` is the
    target's distribution of token ``r + 1``."""
    N, S = batch.tokens.shape
    J = batch.valid.shape[-1]
    p = target_p.reshape(N, S, -1).astype(mx.float32)
    rest = outside.reshape(N, S).astype(mx.float32)
    pad_p = mx.zeros((N, J + 1, p.shape[-1]), mx.float32)
    p = mx.concatenate([p, pad_p], axis=1)
    rest = mx.concatenate([rest, mx.zeros((N, J + 1), mx.float32)], axis=1)
    valid = batch.valid.astype(mx.float32)
    weights = batch.weights
    count = mx.maximum(valid.sum(), 1.0)
    hidden = unrolled_hidden(drafter, features, batch.tokens, J)
    loss = mx.array(0.0)
    ce_sum = l1_sum = mx.array(0.0)
    accepts, kept = [], []
    for j, h in enumerate(hidden):
        logits = drafter.logits(h).astype(mx.float32)
        target = p[:, j + 1 : j + 1 + S]  # the distribution of token t + 2 + j
        mass_out = rest[:, j + 1 : j + 1 + S]
        logq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        inside = mx.maximum(1.0 - mass_out, 1e-6)[..., None]
        ce = -((target / inside) * logq).sum(axis=-1)
        l1 = mx.abs(mx.exp(logq) - target).sum(axis=-1) + mass_out
        loss = loss + (ce * weights[..., j]).sum()
        ce_sum = ce_sum + (ce * valid[..., j]).sum()
        l1_sum = l1_sum + (l1 * valid[..., j]).sum()
        accept = mx.stop_gradient(mx.clip(1.0 - 0.5 * l1, 0.0, 1.0))
        accepts.append(accept * valid[..., j])
        best = mx.argmax(target, axis=-1)
        known = mx.take_along_axis(target, best[..., None], axis=-1)[..., 0] >= mass_out
        match = (mx.argmax(logits, axis=-1) == best) & known
        kept.append(match.astype(mx.float32) * valid[..., j])
    starts = valid[..., 0]
    blocks = mx.maximum(starts.sum(), 1.0)
    tau = 1.0 + (mx.cumprod(mx.stack(accepts, -1), -1).sum(-1) * starts).sum() / blocks
    greedy = mx.cumprod(mx.stack(kept, -1), -1).sum(-1)
    greedy_tau = 1.0 + (greedy * starts).sum() / blocks
    return loss, (ce_sum / count, l1_sum / count, mx.array(0.0), tau, greedy_tau)
