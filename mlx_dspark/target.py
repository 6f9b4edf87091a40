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

Gemma-4 (``gemma4_text`` and the text model of ``gemma4``) runs as
Gemma4TextModel does: scaled embeddings, per-layer inputs, sliding-window
and full-attention masks, KV-shared layers and soft-capped logits. Its
sliding-window layers keep a :class:`WindowKVCache` instead of mlx-lm's
rotating cache so that rejected drafts roll back exactly; tree verification
is refused for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_causal_mask
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache
from mlx_lm.models.gemma4_text import logit_softcap

from .errors import DSparkError
from .metal.dispatch import tree_attention
from .metal.numpy_reference import ancestor_bitmask

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral", "gemma4_text", "gemma4")
GEMMA4_TYPES = ("gemma4_text", "gemma4")
# What the Gemma-4 path reads from mlx-lm's Gemma4TextModel.
_GEMMA4_PARTS = (
    "embed_scale",
    "window_size",
    "previous_kvs",
    "hidden_size_per_layer_input",
    "_get_per_layer_inputs",
    "_project_per_layer_inputs",
    "_make_masks",
)
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


class WindowKVCache:
    """A sliding-window layer's cache that can be rolled back exactly.

    mlx-lm keeps sliding-window layers in a ``RotatingKVCache``, which
    overwrites the oldest slot in place and so cannot be trimmed once it has
    wrapped. This cache instead keeps, in temporal order, the ``window - 1``
    tokens before the last update plus everything that update added (the
    window and the largest block), dropping older tokens only when it grows
    its buffer. Rolling back up to the whole last update therefore restores
    exactly the window plain decoding would hold. ``offset`` is the absolute
    position (RoPE reads it), ``start`` the position of the first kept token.
    :meth:`update_and_fetch` returns only the keys the new queries may see
    (from ``offset - window + 1`` on) and :meth:`make_mask` the matching
    causal sliding-window mask, so attention sees what mlx-lm's would. The
    buffer grows in steps of ``window`` tokens, so it holds at most about two
    windows plus the update and copies one window per ``window`` tokens.
    """

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = window
        self.step = window
        self.keys = None
        self.values = None
        self.offset = 0
        self.start = 0

    def _visible(self, offset: int) -> int:
        """Index of the first kept token a query at ``offset`` may attend to."""
        return max(offset - self.window + 1, self.start) - self.start

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        prev, n = self.offset, keys.shape[2]
        used = prev - self.start
        if self.keys is None or used + n > self.keys.shape[2]:
            drop = max(0, used - (self.window - 1))
            size = (used - drop + n + self.step - 1) // self.step * self.step
            B, H, _, dk = keys.shape
            new_k = mx.zeros((B, H, size, dk), keys.dtype)
            new_v = mx.zeros((B, H, size, values.shape[3]), values.dtype)
            if used > drop:
                new_k[..., : used - drop, :] = self.keys[..., drop:used, :]
                new_v[..., : used - drop, :] = self.values[..., drop:used, :]
            self.keys, self.values = new_k, new_v
            self.start += drop
            used -= drop
        self.keys[..., used : used + n, :] = keys
        self.values[..., used : used + n, :] = values
        self.offset = prev + n
        first = self._visible(prev)
        return (
            self.keys[..., first : used + n, :],
            self.values[..., first : used + n, :],
        )

    def make_mask(
        self, N: int, window_size: int | None = None, return_array: bool = False
    ):
        """The mask of the next update of ``N`` queries over what it returns."""
        window = window_size or self.window
        if window != self.window:
            raise ValueError(f"mask window {window} != cache window {self.window}")
        past = self.offset - self.start - self._visible(self.offset)
        if N == 1:
            return None
        if return_array or past + N > window:
            return create_causal_mask(N, past, window_size=window)
        return "causal"

    def window_state(self) -> tuple[mx.array, mx.array]:
        """The last ``window`` tokens' keys and values in temporal order: what
        mlx-lm's ``RotatingKVCache`` holds after plain decoding."""
        first = max(self.offset - self.window, self.start) - self.start
        used = self.offset - self.start
        return self.keys[..., first:used, :], self.values[..., first:used, :]

    @property
    def state(self):
        used = self.offset - self.start
        return self.keys[..., :used, :], self.values[..., :used, :]

    def size(self) -> int:
        return min(self.offset, self.window)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        if self.start > max(self.offset - n - self.window + 1, 0):
            raise DSparkError(
                f"This sliding-window cache no longer holds the window {n} tokens "
                "back; it rolls back at most the tokens of its last update."
            )
        self.offset -= n
        return n

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class BatchRow:
    """A request's row in a :class:`RequestBatch`: what a batched request
    holds instead of its own cache (:meth:`TargetAdapter.rollback` takes
    either)."""

    def __init__(self, batch: RequestBatch):
        self.batch = batch


class RequestBatch:
    """The running requests' target caches, kept as one left-padded batch.

    :meth:`TargetAdapter.forward_batch` copies every request's cache into a
    batch buffer and its new keys back out, every step. Here the caches live
    in one mlx-lm ``BatchKVCache`` per layer, which a step reads and appends
    to in place (:meth:`TargetAdapter.forward_rows`). A request joins after
    its prefill and leaves when done, each a copy of the batch, as mlx-lm's
    own batched generation does. Rows may keep different numbers of a step's
    new tokens: the rejected ones are only counted, and the next use of the
    batch trims what every row rejected and rolls each row's remainder into
    its left padding.
    """

    def __init__(self):
        self.layers: list[BatchKVCache] = []
        self.rows: list[BatchRow] = []
        self.rejected: list[int] = []

    def join(self, cache: list) -> BatchRow:
        """Move a prefilled request's cache into the batch, as its last row."""
        self.settle()
        merged = [BatchKVCache.merge([layer]) for layer in cache]
        if self.rows:
            for layer, joining in zip(self.layers, merged, strict=True):
                layer.extend(joining)
        else:
            self.layers = merged
        row = BatchRow(self)
        self.rows.append(row)
        self.rejected.append(0)
        return row

    def leave(self, row: BatchRow) -> None:
        """Drop a request's row (and the padding only it needed)."""
        self.settle()
        i = self.rows.index(row)
        del self.rows[i], self.rejected[i]
        if not self.rows:
            self.layers = []
            return
        keep = mx.array([j for j in range(len(self.rows) + 1) if j != i])
        for layer in self.layers:
            layer.filter(keep)

    def reject(self, row: BatchRow, n: int) -> None:
        self.rejected[self.rows.index(row)] += n

    def settle(self) -> None:
        """Drop every row's rejected tokens from the end of its cache."""
        if not any(self.rejected):
            return
        common = min(self.rejected)
        rest = [n - common for n in self.rejected]
        for layer in self.layers:
            layer.trim(common)
            if any(rest):
                layer.prepare(right_padding=rest)
                layer.finalize()
        self.rejected = [0] * len(self.rows)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


class TargetAdapter:
    """Hidden-state taps, cache rollback and embeddings of an mlx-lm model.

    ``layer_ids`` use DeepSpec indexing: -1 is the embedding output and ``i``
    the output of layer ``i``.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int] = ()):
        model_type = getattr(model, "model_type", None) or getattr(
            getattr(model, "args", None), "model_type", None
        )
        # Gemma-4's multimodal wrapper holds the text model as language_model.
        text = (
            getattr(model, "language_model", model) if model_type == "gemma4" else model
        )
        inner = getattr(text, "model", None)
        if model_type not in SUPPORTED_MODEL_TYPES or not all(
            hasattr(inner, name) for name in ("embed_tokens", "layers", "norm")
        ):
            raise DSparkError(
                f"Target model type {model_type!r} is not supported; "
                f"supported families are {', '.join(SUPPORTED_MODEL_TYPES)}."
            )
        self.model = model
        self.model_type = model_type
        self.text = text
        self.inner = inner
        self.layers = inner.layers
        self.is_gemma4 = model_type in GEMMA4_TYPES
        self.layer_ids = [int(i) for i in layer_ids]
        last = len(self.layers) - 1
        for i in self.layer_ids:
            if not -1 <= i <= last:
                raise DSparkError(
                    f"target_layer_ids {self.layer_ids} must lie in -1..{last} "
                    f"for a target with {len(self.layers)} layers."
                )
        if self.is_gemma4:
            if not all(hasattr(inner, name) for name in _GEMMA4_PARTS):
                raise DSparkError(
                    "This mlx-lm version's Gemma-4 model lacks what the adapter "
                    "runs; use the mlx-lm version this package pins."
                )
        elif any(getattr(layer, "use_sliding", False) for layer in self.layers):
            raise DSparkError(
                "The target uses sliding-window attention, whose cache cannot be "
                "rolled back after rejected drafts."
            )

    @property
    def hidden_size(self) -> int:
        """The model width, read from the embedding module (a quantized
        embedding packs its weight, so its shape is not the width)."""
        embed = self.inner.embed_tokens
        return getattr(embed, "dims", None) or embed.weight.shape[-1]

    @property
    def vocab_size(self) -> int:
        embed = self.inner.embed_tokens
        return getattr(embed, "num_embeddings", None) or embed.weight.shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def embedding(self) -> nn.Module:
        """The token embedding module (its weights, e.g. for sharing)."""
        return self.inner.embed_tokens

    @property
    def tied_head(self) -> bool:
        """Whether the LM head is the embedding matrix (no ``lm_head`` module)."""
        return "lm_head" not in self.text

    @property
    def head(self) -> nn.Module:
        """The module holding the LM head matrix: ``lm_head``, or the embedding
        when tied. Logits come from :meth:`lm_head`."""
        return self.embedding if self.tied_head else self.text.lm_head

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens)

    def lm_head(self, hidden: mx.array) -> mx.array:
        """Logits as the model's own call makes them (Gemma-4: soft-capped)."""
        if "lm_head" in self.text:
            logits = self.text.lm_head(hidden)
        else:
            logits = self.inner.embed_tokens.as_linear(hidden)
        cap = getattr(self.text, "final_logit_softcapping", None)
        return logit_softcap(cap, logits) if cap else logits

    def make_cache(self) -> list:
        """One cache per layer that keeps its own keys and values. Gemma-4's
        sliding-window layers get a :class:`WindowKVCache` instead of mlx-lm's
        rotating cache; its KV-shared layers have none (they read an earlier
        layer's)."""
        if self.is_gemma4:
            kinds = [
                layer.self_attn.is_sliding
                for layer in self.layers
                if layer.self_attn.has_kv
            ]
            window = self.inner.window_size
            return [
                WindowKVCache(window) if sliding else KVCache() for sliding in kinds
            ]
        cache = make_prompt_cache(self.model)
        if not all(isinstance(c, KVCache) for c in cache):
            kinds = sorted({type(c).__name__ for c in cache})
            raise DSparkError(
                f"The target's cache ({', '.join(kinds)}) cannot be rolled back "
                "after rejected drafts."
            )
        return cache

    def snapshot(
        self, cache: list | BatchRow
    ) -> list[tuple[mx.array, mx.array]] | None:
        """A copy of every layer's cached keys and values, evaluated, to be
        reused by later requests (:meth:`restore`); None for Gemma-4, whose
        sliding windows keep only their last tokens."""
        if self.is_gemma4:
            return None
        if isinstance(cache, BatchRow):
            batch = cache.batch
            batch.settle()
            r = batch.rows.index(cache)
            start = int(batch.layers[0].left_padding[r].item())
            kv = [
                (
                    c.keys[r : r + 1, :, start : c._idx],
                    c.values[r : r + 1, :, start : c._idx],
                )
                for c in batch.layers
            ]
        else:
            kv = [
                (c.keys[..., : c.offset, :], c.values[..., : c.offset, :])
                for c in cache
            ]
        kv = [(mx.contiguous(k), mx.contiguous(v)) for k, v in kv]
        mx.eval(kv)
        return kv

    def restore(self, kv: list[tuple[mx.array, mx.array]], n: int) -> list:
        """A new cache holding the first ``n`` tokens of a :meth:`snapshot`."""
        cache = self.make_cache()
        for c, (keys, values) in zip(cache, kv, strict=True):
            c.update_and_fetch(keys[..., :n, :], values[..., :n, :])
        return cache

    def rollback(self, cache: list | BatchRow, n: int) -> None:
        """Drop the last ``n`` tokens from every layer's cache."""
        if n <= 0:
            return
        if isinstance(cache, BatchRow):
            cache.batch.reject(cache, n)
            return
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
        """Whether every layer has the block structure :meth:`tree_forward` runs.

        Not Gemma-4: its sliding windows, KV-shared layers and per-layer
        inputs are not in the tree forward."""
        return not self.is_gemma4 and all(
            all(hasattr(layer, name) for name in _TREE_BLOCK_PARTS)
            and all(hasattr(layer.self_attn, name) for name in _TREE_ATTENTION_PARTS)
            for layer in self.layers
        )

    def check_tree(self) -> None:
        if self.is_gemma4:
            raise DSparkError(
                "Tree verification does not support Gemma-4 targets (sliding-window "
                "and KV-shared layers); use chain drafting (tree budget 0)."
            )
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
        normed, features = self._finish(h, taps)
        return self.lm_head(normed), features

    def _finish(
        self, h: mx.array, taps: list[mx.array]
    ) -> tuple[mx.array, mx.array | None]:
        """The final normalised state and the tapped features. DeepSpec taps
        Hugging Face's ``hidden_states[i + 1]``, which for the last layer is
        that normalised state, so its tap (always the last) is replaced by it."""
        normed = self.inner.norm(h)
        if len(self.layers) - 1 in self.layer_ids:
            taps[-1] = normed
        return normed, mx.concatenate(taps, axis=-1) if taps else None

    def hidden(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array | None]:
        """Final normalised hidden states ``[B, L, d]`` (``lm_head`` input) and
        tapped features ``[B, L, len(ids) * d]``."""
        if self.is_gemma4:
            return self._gemma4_hidden(tokens, cache)
        h = self.embed(tokens)
        mask = create_attention_mask(h, cache[0])
        taps = [h] if -1 in self.layer_ids else []
        for i, (layer, c) in enumerate(zip(self.layers, cache, strict=True)):
            h = layer(h, mask, c)
            if i in self.layer_ids:
                taps.append(h)
        return self._finish(h, taps)

    def _gemma4_hidden(
        self, tokens: mx.array, cache: list
    ) -> tuple[mx.array, mx.array | None]:
        """Gemma4TextModel's forward, step for step, with taps: scaled
        embeddings, per-layer inputs, per-type masks, and KV-shared layers fed
        the keys, values and RoPE offset of the earlier layer they share."""
        inner = self.inner
        embeddings = inner.embed_tokens(tokens)
        h = embeddings * inner.embed_scale
        per_layer = [None] * len(self.layers)
        if inner.hidden_size_per_layer_input:
            inputs = inner._get_per_layer_inputs(tokens, embeddings)
            inputs = inner._project_per_layer_inputs(h, inputs)
            per_layer = [inputs[:, :, i, :] for i in range(len(self.layers))]
        cache = list(cache) + [None] * (len(self.layers) - len(cache))
        masks = inner._make_masks(h, cache)
        taps = [h] if -1 in self.layer_ids else []
        shared = [(None, None)] * len(self.layers)
        for i, layer in enumerate(self.layers):
            kvs, offset = shared[inner.previous_kvs[i]]
            h, kvs, offset = layer(
                h,
                masks[i],
                cache[i],
                per_layer_input=per_layer[i],
                shared_kv=kvs,
                offset=offset,
            )
            shared[i] = (kvs, offset)
            if i in self.layer_ids:
                taps.append(h)
        return self._finish(h, taps)

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
        self,
        tokens: Sequence[Sequence[int]],
        caches: Sequence[list],
        last_only: bool = False,
    ) -> list[tuple[mx.array, mx.array | None]]:
        """One forward for R requests, each with its own single-request cache.

        Request r's cached keys/values are left-padded to the longest context
        and its new tokens right-padded to the longest query; a padding mask
        and per-request RoPE offsets make every real row equal to a forward of
        that request alone. Each request's new keys/values (all its rows) are
        appended to its own cache; roll back rejected ones with
        :meth:`rollback`. Returns ``(logits [1, L_r, V], features [1, L_r, F])``
        per request; with ``last_only`` (a prefill) the logits are only the
        last token's, ``[1, 1, V]``.
        """
        if len(caches) != len(tokens):
            raise ValueError("one token list per cache is required")
        lengths, padded = _right_padded(tokens)
        width = padded.shape[1]
        offsets = [c[0].offset for c in caches]
        batch_cache = [
            _batch_cache([_past(cache[layer]) for cache in caches], offsets, width)
            for layer in range(len(caches[0]))
        ]
        hidden, features = self.hidden(padded, batch_cache)
        if last_only:
            last = hidden[mx.arange(len(lengths)), mx.array(lengths) - 1]
            logits = self.lm_head(last[:, None])
        else:
            logits = self.lm_head(hidden)
        out = []
        for r, (cache, n) in enumerate(zip(caches, lengths, strict=True)):
            for layer, stacked in zip(cache, batch_cache, strict=True):
                k, v = stacked.keys_and_values()
                end = k.shape[2] - width + n
                layer.update_and_fetch(
                    k[r : r + 1, :, end - n : end], v[r : r + 1, :, end - n : end]
                )
            feats = None if features is None else features[r : r + 1, :n]
            out.append((logits[r : r + 1, : 1 if last_only else n], feats))
        return out

    def forward_rows(
        self, tokens: Sequence[Sequence[int]], rows: Sequence[BatchRow]
    ) -> list[tuple[mx.array, mx.array | None]]:
        """One forward for every row of a :class:`RequestBatch`, in place:
        row r's tokens, right-padded to the longest (the padding counts as
        rejected at once). Returns what :meth:`forward_batch` returns."""
        batch = rows[0].batch
        if list(rows) != batch.rows:
            raise ValueError("tokens are required for every row, in the batch's order")
        if len(tokens) != len(rows):
            raise ValueError("one token list per row is required")
        batch.settle()
        lengths, padded = _right_padded(tokens)
        hidden, features = self.hidden(padded, batch.layers)
        logits = self.lm_head(hidden)
        batch.rejected = [padded.shape[1] - n for n in lengths]
        return [
            (
                logits[r : r + 1, :n],
                None if features is None else features[r : r + 1, :n],
            )
            for r, n in enumerate(lengths)
        ]


def _right_padded(tokens: Sequence[Sequence[int]]) -> tuple[list[int], mx.array]:
    """Each list's length, and the lists right-padded to the longest."""
    lengths = [len(t) for t in tokens]
    if min(lengths, default=0) < 1:
        raise ValueError("every token list must be non-empty")
    width = max(lengths)
    return lengths, mx.array([list(t) + [0] * (width - len(t)) for t in tokens])


def _batch_cache(
    past: Sequence[tuple[mx.array, mx.array] | None],
    offsets: Sequence[int],
    width: int,
) -> BatchKVCache:
    """The requests' cached keys/values (``None``: nothing cached yet),
    left-padded into one buffer with room for ``width`` new tokens.

    Written straight into a buffer of the exact final length: one copy of each
    request's cache, and attention reads the whole (contiguous) buffer.
    Padding and concatenating, then ``update_and_fetch`` into an empty
    ``BatchKVCache`` (which allocates in steps of 256 tokens), copied it three
    times and made attention read a slice. When no request has a cache yet
    (prompts prefilled together), the buffer is the forward's own.
    """
    sizes = [0 if p is None else p[0].shape[2] for p in past]
    longest = max(sizes)
    cache = BatchKVCache([longest - size for size in sizes])
    present = [p for p in past if p is not None]
    if present:
        k0, v0 = present[0]
        shape = (len(past), k0.shape[1], longest + width)
        keys = mx.zeros((*shape, k0.shape[3]), k0.dtype)
        values = mx.zeros((*shape, v0.shape[3]), v0.dtype)
        for r, (p, size) in enumerate(zip(past, sizes, strict=True)):
            if size:
                keys[r : r + 1, :, longest - size : longest] = p[0]
                values[r : r + 1, :, longest - size : longest] = p[1]
        cache.keys, cache.values, cache._idx = keys, values, longest
    # A sliding-window layer passes on only its window: RoPE must still see
    # each request's absolute position.
    cache.offset = mx.array(offsets)
    return cache


def _past(cache) -> tuple[mx.array, mx.array] | None:
    """The cached keys and values a next query may attend to, oldest first;
    ``None`` before the cache's first update."""
    if cache.keys is None:
        return None
    if isinstance(cache, WindowKVCache):
        first = cache._visible(cache.offset)
        keys, values = cache.state
        return keys[..., first:, :], values[..., first:, :]
    keys, values = cache.state[:2]
    return keys[..., : cache.offset, :], values[..., : cache.offset, :]
