"""The target adapter: the one place that knows mlx-lm model internals.

It runs the target's own layers so that the hidden states after
``target_layer_ids`` come out of the same forward that produces the logits,
and it rolls the KV cache back after rejected drafts.

Tree verification (:meth:`TargetAdapter.tree_forward`) needs what mlx-lm's
``Model.__call__`` cannot take: an ancestor mask and a position per node. The
adapter therefore runs the decoder blocks of the supported families itself
(pre-norm residual blocks whose attention has ``q/k/v/o_proj``, optional
``q_norm``/``k_norm``, ``rope``, ``scale``): the layer's own projections and
norms, its own ``rope`` called with per-node offsets (tokens moved into the
batch axis, where ``mx.fast.rope`` takes one offset per row), the layer's own
KV cache, and :func:`mlx_dspark.metal.tree_attention` for the attention. No
mlx-lm class, module or instance is modified.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache

from .errors import DSparkError
from .metal.dispatch import tree_attention
from .metal.numpy_reference import ancestor_bitmask

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")
_TREE_BLOCK_PARTS = ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp")
_TREE_ATTENTION_PARTS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "rope",
    "scale",
    "n_heads",
    "n_kv_heads",
)


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Depth of each node; a node whose parent is -1 follows the prefix (depth 0)."""
    depths: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p}: parents must precede their children")
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


class TargetAdapter:
    """Hidden-state taps, cache rollback and embeddings of an mlx-lm model.

    ``layer_ids`` use DeepSpec indexing: -1 is the embedding output and ``i``
    the output of layer ``i``.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int] = ()):
        model_type = getattr(model, "model_type", None) or getattr(
            getattr(model, "args", None), "model_type", None
        )
        inner = getattr(model, "model", None)
        if model_type not in SUPPORTED_MODEL_TYPES or not all(
            hasattr(inner, name) for name in ("embed_tokens", "layers", "norm")
        ):
            raise DSparkError(
                f"Target model type {model_type!r} is not supported; "
                f"supported families are {', '.join(SUPPORTED_MODEL_TYPES)}."
            )
        self.model = model
        self.model_type = model_type
        self.inner = inner
        self.layers = inner.layers
        self.layer_ids = [int(i) for i in layer_ids]
        last = len(self.layers) - 1
        for i in self.layer_ids:
            if not -1 <= i < last:
                raise DSparkError(
                    f"target_layer_ids {self.layer_ids} must lie in -1..{last - 1} "
                    f"for a target with {len(self.layers)} layers (not its last layer)."
                )
        if any(getattr(layer, "use_sliding", False) for layer in self.layers):
            raise DSparkError(
                "The target uses sliding-window attention, whose cache cannot be "
                "rolled back after rejected drafts."
            )

    @property
    def hidden_size(self) -> int:
        return self.inner.embed_tokens.weight.shape[-1]

    @property
    def vocab_size(self) -> int:
        return self.inner.embed_tokens.weight.shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens)

    def lm_head(self, hidden: mx.array) -> mx.array:
        if "lm_head" in self.model:
            return self.model.lm_head(hidden)
        return self.inner.embed_tokens.as_linear(hidden)

    def make_cache(self) -> list:
        cache = make_prompt_cache(self.model)
        if not all(isinstance(c, KVCache) for c in cache):
            kinds = sorted({type(c).__name__ for c in cache})
            raise DSparkError(
                f"The target's cache ({', '.join(kinds)}) cannot be rolled back "
                "after rejected drafts."
            )
        return cache

    def rollback(self, cache: list, n: int) -> None:
        """Drop the last ``n`` tokens from every layer's cache."""
        if n > 0:
            for c in cache:
                c.trim(n)

    def commit_path(self, cache: list, start: int, path: Sequence[int]) -> None:
        """Keep only the nodes ``path`` of the last tree forward, contiguously.

        ``start`` is the cache length before that forward and ``path`` the
        indices (into its nodes) of the kept nodes in order; their keys and
        values move to slots ``start ..`` and everything after is dropped.
        """
        path = [int(i) for i in path]
        end = start + len(path)
        if path != list(range(len(path))):
            rows = mx.array([start + i for i in path])
            for c in cache:
                keys = mx.take(c.keys, rows, axis=2)
                values = mx.take(c.values, rows, axis=2)
                mx.eval(keys, values)
                c.keys[:, :, start:end, :] = keys
                c.values[:, :, start:end, :] = values
        self.rollback(cache, cache[0].offset - end)

    @property
    def supports_tree(self) -> bool:
        """Whether every layer has the block structure :meth:`tree_forward` runs."""
        return all(
            all(hasattr(layer, name) for name in _TREE_BLOCK_PARTS)
            and all(hasattr(layer.self_attn, name) for name in _TREE_ATTENTION_PARTS)
            for layer in self.layers
        )

    def check_tree(self) -> None:
        if not self.supports_tree:
            raise DSparkError(
                f"Tree verification does not support this {self.model_type} model's "
                "layer structure; use chain drafting (tree budget 0)."
            )

    def _tree_block(
        self,
        layer: nn.Module,
        x: mx.array,
        cache,
        positions: mx.array,
        bitmask: mx.array,
        force_reference: bool,
    ) -> mx.array:
        attn = layer.self_attn
        B, L, _ = x.shape
        h = layer.input_layernorm(x)
        queries = attn.q_proj(h).reshape(B, L, attn.n_heads, -1)
        keys = attn.k_proj(h).reshape(B, L, attn.n_kv_heads, -1)
        values = attn.v_proj(h).reshape(B, L, attn.n_kv_heads, -1)
        if hasattr(attn, "q_norm"):
            queries, keys = attn.q_norm(queries), attn.k_norm(keys)

        def rope(t: mx.array) -> mx.array:
            # [1, L, H, D] -> [L, H, 1, D]: one offset per batch row (node).
            return attn.rope(t.transpose(1, 2, 0, 3), offset=positions).transpose(
                2, 1, 0, 3
            )

        queries, keys = rope(queries), rope(keys)
        keys, values = cache.update_and_fetch(keys, values.transpose(0, 2, 1, 3))
        out = tree_attention(
            queries, keys, values, bitmask, attn.scale, force_reference=force_reference
        )
        x = x + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def tree_forward(
        self,
        tokens: mx.array,
        parents: Sequence[int],
        cache: list,
        *,
        force_reference: bool = False,
    ) -> tuple[mx.array, mx.array | None]:
        """One forward over a token tree appended to the cache.

        ``tokens`` is ``[1, N]`` in topological order; ``parents[i]`` is the
        index of node i's parent or -1 for a node that follows the cached
        prefix directly. Node i sits at position ``cache length + depth`` and
        attends to the prefix, its ancestors and itself. Returns logits
        ``[1, N, V]`` and features as :meth:`__call__`; all N nodes enter the
        cache (see :meth:`commit_path`).
        """
        if tokens.ndim != 2 or tokens.shape != (1, len(parents)):
            raise ValueError(f"tokens {tokens.shape} do not match {len(parents)} nodes")
        self.check_tree()
        offset = cache[0].offset
        positions = mx.array([offset + d for d in tree_depths(parents)])
        bitmask = mx.array(ancestor_bitmask(list(parents)))
        h = self.embed(tokens)
        taps = [h] if -1 in self.layer_ids else []
        for i, (layer, c) in enumerate(zip(self.layers, cache, strict=True)):
            h = self._tree_block(layer, h, c, positions, bitmask, force_reference)
            if i in self.layer_ids:
                taps.append(h)
        logits = self.lm_head(self.inner.norm(h))
        features = mx.concatenate(taps, axis=-1) if taps else None
        return logits, features

    def hidden(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array | None]:
        """Final normalised hidden states ``[B, L, d]`` (``lm_head`` input) and
        tapped features ``[B, L, len(ids) * d]``."""
        h = self.embed(tokens)
        mask = create_attention_mask(h, cache[0])
        taps = [h] if -1 in self.layer_ids else []
        for i, (layer, c) in enumerate(zip(self.layers, cache, strict=True)):
            h = layer(h, mask, c)
            if i in self.layer_ids:
                taps.append(h)
        features = mx.concatenate(taps, axis=-1) if taps else None
        return self.inner.norm(h), features

    def __call__(
        self, tokens: mx.array, cache: list
    ) -> tuple[mx.array, mx.array | None]:
        """Logits ``[B, L, V]`` and tapped features ``[B, L, len(ids) * d]``."""
        hidden, features = self.hidden(tokens, cache)
        return self.lm_head(hidden), features

    def self_check(
        self, tokens: Sequence[int] = (1, 2, 3, 4, 5), atol: float = 1e-2
    ) -> None:
        """Refuse a model whose forward here differs from its own."""
        vocab = self.vocab_size
        ids = mx.array([[t % vocab for t in tokens]])
        ours, _ = self(ids, self.make_cache())
        theirs = self.model(ids, cache=make_prompt_cache(self.model))
        ours, theirs = ours.astype(mx.float32), theirs.astype(mx.float32)
        scale = mx.maximum(mx.abs(theirs).max(), 1.0)
        error = (mx.abs(ours - theirs).max() / scale).item()
        if self.supports_tree:
            chain = list(range(-1, ids.shape[1] - 1))
            tree, _ = self.tree_forward(ids, chain, self.make_cache())
            tree = tree.astype(mx.float32)
            error = max(error, (mx.abs(tree - theirs).max() / scale).item())
        if not error <= atol:
            raise DSparkError(
                f"The target adapter does not reproduce this {self.model_type} model's "
                f"logits (relative error {error:.3g}); its mlx-lm version may be unsupported."
            )

    def forward_batch(
        self, tokens: Sequence[Sequence[int]], caches: Sequence[list]
    ) -> list[tuple[mx.array, mx.array | None]]:
        """One forward for R requests, each with its own single-request cache.

        Request r's cached keys/values are left-padded to the longest context
        and its new tokens right-padded to the longest query; a padding mask
        and per-request RoPE offsets make every real row equal to a forward of
        that request alone. Each request's new keys/values (all its rows) are
        appended to its own cache; roll back rejected ones with
        :meth:`rollback`. Returns ``(logits [1, L_r, V], features [1, L_r, F])``
        per request.
        """
        lengths = [len(t) for t in tokens]
        if len(caches) != len(lengths) or min(lengths, default=0) < 1:
            raise ValueError("one non-empty token list per cache is required")
        width = max(lengths)
        contexts = [c[0].offset for c in caches]
        longest = max(contexts)
        batch_cache = []
        for layer in range(len(self.layers)):
            keys, values = [], []
            for cache, context in zip(caches, contexts, strict=True):
                k, v = cache[layer].state[:2]
                pad = [(0, 0), (0, 0), (longest - context, 0), (0, 0)]
                keys.append(mx.pad(k[..., :context, :], pad))
                values.append(mx.pad(v[..., :context, :], pad))
            stacked = BatchKVCache([longest - c for c in contexts])
            if longest:
                stacked.update_and_fetch(
                    mx.concatenate(keys, axis=0), mx.concatenate(values, axis=0)
                )
            batch_cache.append(stacked)
        padded = mx.array([list(t) + [0] * (width - len(t)) for t in tokens])
        logits, features = self(padded, batch_cache)
        out = []
        for r, (cache, n) in enumerate(zip(caches, lengths, strict=True)):
            for layer, stacked in zip(cache, batch_cache, strict=True):
                k, v = stacked.keys_and_values()
                layer.update_and_fetch(
                    k[r : r + 1, :, longest : longest + n],
                    v[r : r + 1, :, longest : longest + n],
                )
            feats = None if features is None else features[r : r + 1, :n]
            out.append((logits[r : r + 1, :n], feats))
        return out
