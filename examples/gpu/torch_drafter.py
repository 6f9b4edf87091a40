"""The drafter's training in PyTorch, for the device (no MLX there).

The same computation as ``mlx_dspark.training``: the backbone over many
blocks sharing their sequence's context (``model.training_hidden``), the
DSpark loss and its metrics (``loss.loss_terms``), anchors and blocks
(``batches.make_batch``) and the target's teacher, for drafters of the
default pair's shape (one layer, a vanilla Markov head, a confidence head
that reads it, a reduced draft vocabulary). Parameters keep mlx-dspark's
names, so that ``install.py`` loads them back; ``tests/test_gpu_route.py``
checks loss and gradients against MLX."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from codec import unpack
from torch_target import rms_norm

CE_WEIGHT, TV_WEIGHT, CONF_WEIGHT = 0.1, 0.9, 1.0


def read_drafter(path: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """A drafter directory's config and float32 weights (quantized ones
    dequantized in float32, as MLX does with float32 scales)."""
    from safetensors.numpy import load_file

    config = json.loads((Path(path) / "config.json").read_text())
    raw = load_file(Path(path) / "model.safetensors")
    bits = (config.get("quantization") or {}).get("bits", 4)
    out = {}
    for name, value in raw.items():
        stem = name.removesuffix(".weight")
        if name.endswith((".scales", ".biases")):
            continue
        if f"{stem}.scales" not in raw:
            out[name] = value
            continue
        scales, biases = raw[f"{stem}.scales"], raw[f"{stem}.biases"]
        q = unpack(value, bits).astype(np.float32)
        q = q.reshape(*scales.shape, -1)
        out[name] = (q * scales[..., None] + biases[..., None]).reshape(len(q), -1)
    return config, out


def rope(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """Non-interleaved RoPE of ``x [..., L, D]`` at ``positions [..., L]``."""
    half = x.shape[-1] // 2
    inverse = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float()[..., None] * inverse
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


FROZEN = ("draft_to_target", "lm_head.weight")


class Drafter(torch.nn.Module):
    """Trainable weights by mlx-dspark name; the embedding is the target's
    and the LM head the target's rows of the draft ids, both frozen, as
    ``mlx_dspark.training.model.new_drafter`` makes them."""

    def __init__(
        self, config: dict, weights: dict[str, np.ndarray], embed: torch.Tensor
    ):
        super().__init__()
        if config["num_hidden_layers"] != 1 or config["markov_head_type"] != "vanilla":
            raise ValueError(
                "the GPU route trains one-layer drafters with a vanilla head"
            )
        self.config = config
        self.eps = config["rms_norm_eps"]
        self.weights = torch.nn.ParameterDict(
            {
                name.replace(".", "/"): torch.nn.Parameter(
                    torch.tensor(value, dtype=torch.float32)
                )
                for name, value in weights.items()
                if name not in FROZEN
            }
        )
        ids = torch.tensor(
            np.asarray(weights["draft_to_target"], np.int64), device=embed.device
        )
        self.register_buffer("draft_ids", ids)
        self.register_buffer("embed", embed)
        self.register_buffer("lm_head", embed[ids].clone())

    def w(self, name: str) -> torch.Tensor:
        return self.weights[name.replace(".", "/")]

    def linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        bias = self.weights.get(f"{name}.bias".replace(".", "/"))
        return F.linear(x, self.w(f"{name}.weight"), bias)

    def numpy_weights(self) -> dict[str, np.ndarray]:
        return {
            k.replace("/", "."): v.detach().cpu().numpy()
            for k, v in self.weights.items()
        }

    def hidden(
        self, features: torch.Tensor, anchors: torch.Tensor, blocks: torch.Tensor
    ) -> torch.Tensor:
        """Backbone states ``[N * A, B, d]`` of blocks ``[N, A, B]`` whose
        queries see their sequence's context before the anchor (features
        ``[N, S, F]``) and their whole block, in one softmax."""
        c = self.config
        N, S, _ = features.shape
        A, B = blocks.shape[1:]
        H, Hkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        G = H // Hkv
        base, device = c["rope_theta"], features.device
        context = rms_norm(
            self.linear(features, "fc"), self.w("hidden_norm.weight"), self.eps
        )
        h = self.embed[blocks.reshape(N * A, B)]
        x = rms_norm(h, self.w("layers.0.input_layernorm.weight"), self.eps)
        attn = "layers.0.self_attn."
        block_positions = (anchors.reshape(N * A, 1) + torch.arange(B, device=device))[
            :, None
        ]

        def heads(
            y: torch.Tensor, proj: str, count: int, rows: int, length: int
        ) -> torch.Tensor:
            return (
                self.linear(y, attn + proj)
                .reshape(rows, length, count, hd)
                .transpose(1, 2)
            )

        q = rms_norm(
            heads(x, "q_proj", H, N * A, B), self.w(attn + "q_norm.weight"), self.eps
        )
        q = rope(q, block_positions, base) * hd**-0.5
        k = rms_norm(
            heads(x, "k_proj", Hkv, N * A, B), self.w(attn + "k_norm.weight"), self.eps
        )
        k = rope(k, block_positions, base)
        v = heads(x, "v_proj", Hkv, N * A, B)
        ck = rms_norm(
            heads(context, "k_proj", Hkv, N, S),
            self.w(attn + "k_norm.weight"),
            self.eps,
        )
        ck = rope(ck, torch.arange(S, device=device), base)
        cv = heads(context, "v_proj", Hkv, N, S)
        # Query head kv * G + g reads key/value head kv: [N, Hkv, A, G, B, hd].
        q = q.reshape(N, A, Hkv, G, B, hd).permute(0, 2, 1, 3, 4, 5)
        k = k.reshape(N, A, Hkv, B, hd).permute(0, 2, 1, 3, 4)
        v = v.reshape(N, A, Hkv, B, hd).permute(0, 2, 1, 3, 4)
        visible = torch.arange(S, device=device) < anchors[..., None]  # [N, A, S]
        context_scores = torch.einsum("nkagbd,nksd->nkagbs", q, ck)
        context_scores = context_scores.masked_fill(
            ~visible[:, None, :, None, None, :], float("-inf")
        )
        block_scores = torch.einsum("nkagbd,nkacd->nkagbc", q, k)
        probs = torch.softmax(torch.cat([context_scores, block_scores], dim=-1), dim=-1)
        out = torch.einsum("nkagbs,nksd->nkagbd", probs[..., :S], cv)
        out = out + torch.einsum("nkagbc,nkacd->nkagbd", probs[..., S:], v)
        out = out.permute(0, 2, 4, 1, 3, 5).reshape(N * A, B, H * hd)
        h = h + self.linear(out, attn + "o_proj")
        y = rms_norm(h, self.w("layers.0.post_attention_layernorm.weight"), self.eps)
        mlp = "layers.0.mlp."
        y = F.silu(self.linear(y, mlp + "gate_proj")) * self.linear(y, mlp + "up_proj")
        h = h + self.linear(y, mlp + "down_proj")
        return rms_norm(h, self.w("norm.weight"), self.eps)

    def draft_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits: base logits plus the Markov bias of ``prev``."""
        markov = self.w("markov_head.markov_w1.weight")[prev]
        bias = F.linear(markov, self.w("markov_head.markov_w2.weight"))
        return F.linear(hidden, self.lm_head) + bias

    def confidence(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        markov = self.w("markov_head.markov_w1.weight")[prev]
        return self.linear(torch.cat([hidden, markov], dim=-1), "confidence_head.proj")[
            ..., 0
        ]


def make_batch(
    sequences: list[tuple[np.ndarray, np.ndarray]],
    anchors: int,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    rng: np.random.Generator,
    target_to_draft: np.ndarray,
    length: int,
) -> dict[str, np.ndarray]:
    """``batches.make_batch`` for ``(tokens, loss_mask)`` pairs (same draws
    from ``rng``, so the same anchors)."""
    N = len(sequences)
    S = max([len(t) for t, _ in sequences] + [length])
    tokens = np.zeros((N, S), np.int64)
    loss_mask = np.zeros((N, S + block_size + 1), bool)
    starts = np.zeros((N, anchors), np.int64)
    keep = np.zeros((N, anchors), bool)
    for n, (t, m) in enumerate(sequences):
        tokens[n, : len(t)] = t
        loss_mask[n, : len(t)] = m
        candidates = np.flatnonzero(m[1:])
        if len(candidates) > anchors:
            candidates = np.sort(rng.choice(candidates, anchors, replace=False))
        starts[n, : len(candidates)] = candidates
        keep[n, : len(candidates)] = True
    k = np.arange(block_size)
    label_positions = starts[..., None] + k + 1
    rows = np.arange(N)[:, None, None]
    valid = loss_mask[rows, label_positions] & keep[..., None]
    valid = np.cumprod(valid, axis=-1).astype(bool)
    padded = np.concatenate([tokens, np.zeros((N, block_size + 1), np.int64)], axis=1)
    next_tokens = padded[rows, label_positions]
    anchor_tokens = tokens[np.arange(N)[:, None], starts]
    blocks = np.full((N, anchors, block_size), mask_token_id, np.int64)
    blocks[..., 0] = anchor_tokens
    labels = target_to_draft[next_tokens]
    return {
        "tokens": tokens,
        "anchors": starts,
        "blocks": blocks,
        "labels": np.maximum(labels, 0),
        "in_vocab": labels >= 0,
        "prev": np.concatenate([anchor_tokens[..., None], next_tokens[..., :-1]], -1),
        "weights": (valid * np.exp(-k / gamma)).astype(np.float32),
        "valid": valid,
        "positions": np.minimum(label_positions - 1, S - 1),
    }


def to_device(batch: dict[str, np.ndarray], device) -> dict[str, torch.Tensor]:
    return {
        k: torch.from_numpy(np.ascontiguousarray(v)).to(device)
        for k, v in batch.items()
    }


def gather(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``rows [N, S, ...]`` at ``positions [N, A, B]``: ``[N * A, B, ...]``."""
    N, A, B = positions.shape
    index = torch.arange(N, device=rows.device)[:, None, None]
    return rows[index, positions].reshape(N * A, B, *rows.shape[2:])


def loss_terms(
    drafter: Drafter,
    features: torch.Tensor,
    target_p: torch.Tensor,
    outside: torch.Tensor,
    batch: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The DSpark loss and its terms (ce, tv, confidence BCE, expected length
    at T=1, teacher-forced greedy length), as ``loss.loss_terms`` computes
    them with ``greedy_weight`` 0."""
    hidden = drafter.hidden(features, batch["anchors"], batch["blocks"])
    NA, B, _ = hidden.shape
    prev = batch["prev"].reshape(NA, B)
    logits = drafter.draft_logits(hidden, prev)
    q = torch.softmax(logits, dim=-1)
    weights = batch["weights"].reshape(NA, B)
    valid = batch["valid"].reshape(NA, B).float()
    total = weights.sum().clamp_min(1e-6)
    blocks = valid[:, 0]
    labels = batch["labels"].reshape(NA, B, 1)
    label_q = torch.gather(q, -1, labels)[..., 0]
    ce = -torch.log(label_q.clamp_min(1e-30)) * batch["in_vocab"].reshape(NA, B)
    l1 = (q - target_p).abs().sum(-1) + outside
    accept = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()
    bce = F.binary_cross_entropy_with_logits(
        drafter.confidence(hidden, prev), accept, reduction="none"
    )
    ce_loss, l1_loss, conf_loss = ((t * weights).sum() / total for t in (ce, l1, bce))
    loss = CE_WEIGHT * ce_loss + TV_WEIGHT * l1_loss + CONF_WEIGHT * conf_loss
    with torch.no_grad():
        best = target_p.argmax(-1, keepdim=True)
        known = torch.gather(target_p, -1, best)[..., 0] >= outside
        kept = ((logits.argmax(-1) == best[..., 0]) & known).float()
        count = blocks.sum().clamp_min(1e-6)
        tau = ((torch.cumprod(accept * valid, -1).sum(-1) + 1) * blocks).sum() / count
        greedy = ((torch.cumprod(kept * valid, -1).sum(-1) + 1) * blocks).sum() / count
    return loss, (ce_loss.detach(), l1_loss.detach(), conf_loss.detach(), tau, greedy)


@torch.no_grad()
def teacher(
    target,
    tokens: torch.Tensor,
    draft_ids: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's features ``[N, S, F]``, its probabilities of the draft ids
    ``[N * A, B, V]`` and its mass outside them ``[N * A, B]`` at
    ``positions [N, A, B]`` (the softmax over the whole vocabulary in
    chunks of about 8k rows)."""
    hidden, taps = target(tokens)
    N, S, _ = hidden.shape
    outside_ids = torch.ones(target.embed.shape[0], device=hidden.device)
    outside_ids[draft_ids] = 0.0
    probs = torch.empty(N, S, len(draft_ids), device=hidden.device)
    outside = torch.empty(N, S, device=hidden.device)
    rows = max(1, 8192 // S)
    for i in range(0, N, rows):
        p = torch.softmax(target.logits(hidden[i : i + rows]), dim=-1)
        probs[i : i + rows] = p[..., draft_ids]
        outside[i : i + rows] = p @ outside_ids
    return taps, gather(probs, positions), gather(outside, positions)
