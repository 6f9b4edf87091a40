"""The Tiny Sequential Head (Markov / gated / RNN) and the confidence head.

A sequential head adds a transition bias to the backbone's base logits, one
block position at a time: ``logits_k = base_k + bias_k(x_{k-1}, h_k, state)``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from .dspark_config import DraftConfig


class MarkovHead(nn.Module):
    """Vanilla Markov head: ``bias = W2 . W1[x_{k-1}]``.

    ``W1`` is indexed by target token ids; ``W2`` projects onto the drafter's
    output vocabulary (``out_vocab_size``: the target's, or a reduced draft
    vocabulary).
    """

    def __init__(self, vocab_size: int, rank: int, out_vocab_size: int | None = None):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, out_vocab_size or vocab_size, bias=False)

    def prev_embeddings(self, tokens: mx.array) -> mx.array:
        return self.markov_w1(tokens)

    def initial_state(self, batch_shape: tuple[int, ...]) -> mx.array | None:
        return None

    def step(
        self, state: mx.array | None, prev_tokens: mx.array, hidden: mx.array
    ) -> tuple[mx.array | None, mx.array]:
        """One position: returns the new state and the logit bias."""
        return state, self.markov_w2(self.prev_embeddings(prev_tokens))

    def block_bias(self, prev_tokens: mx.array, hidden: mx.array) -> mx.array:
        """Teacher-forced biases for a whole block: ``[..., K] -> [..., K, V]``."""
        state = self.initial_state(prev_tokens.shape[:-1])
        biases = []
        for k in range(prev_tokens.shape[-1]):
            state, bias = self.step(state, prev_tokens[..., k], hidden[..., k, :])
            biases.append(bias)
        return mx.stack(biases, axis=-2)


class GatedMarkovHead(MarkovHead):
    """The rank-r embedding is gated by ``sigmoid(gate_proj([h_k ; W1[x]]))``."""

    def __init__(
        self,
        vocab_size: int,
        rank: int,
        hidden_size: int,
        out_vocab_size: int | None = None,
    ):
        super().__init__(vocab_size, rank, out_vocab_size)
        self.gate_proj = nn.Linear(hidden_size + rank, rank)

    def step(self, state, prev_tokens, hidden):
        emb = self.prev_embeddings(prev_tokens)
        gate = mx.sigmoid(self.gate_proj(mx.concatenate([hidden, emb], axis=-1)))
        return state, self.markov_w2(gate.astype(emb.dtype) * emb)


class RNNHead(MarkovHead):
    """GRU-like state over ``[s_{k-1} ; W1[x_{k-1}] ; h_k]``."""

    def __init__(
        self,
        vocab_size: int,
        rank: int,
        hidden_size: int,
        out_vocab_size: int | None = None,
    ):
        super().__init__(vocab_size, rank, out_vocab_size)
        self.rank = rank
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def initial_state(self, batch_shape):
        # The state takes the embeddings' dtype at the first step; W1 may be
        # quantized (integer weight), so it cannot tell the dtype here.
        return mx.zeros((*batch_shape, self.rank), dtype=mx.float32)

    def step(self, state, prev_tokens, hidden):
        emb = self.prev_embeddings(prev_tokens)
        state = state.astype(emb.dtype)
        joint = self.joint_proj(mx.concatenate([state, emb, hidden], axis=-1))
        gate, candidate, output = mx.split(joint, 3, axis=-1)
        gate = mx.sigmoid(gate)
        state = gate * state + (1.0 - gate) * mx.tanh(candidate)
        return state, self.markov_w2(mx.tanh(output))


class ConfidenceHead(nn.Module):
    """Logit of the probability that a draft survives, given its prefix did."""

    def __init__(self, input_dim: int):
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    def __call__(self, features: mx.array) -> mx.array:
        return self.proj(features).squeeze(-1)


def build_markov_head(config: DraftConfig) -> MarkovHead | None:
    rank = config.markov_rank
    if rank == 0:
        return None
    out = config.output_vocab_size
    if config.markov_head_type == "gated":
        return GatedMarkovHead(config.vocab_size, rank, config.hidden_size, out)
    if config.markov_head_type == "rnn":
        return RNNHead(config.vocab_size, rank, config.hidden_size, out)
    return MarkovHead(config.vocab_size, rank, out)
