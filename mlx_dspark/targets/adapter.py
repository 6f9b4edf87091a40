"""The target adapter: the one place that knows mlx-lm model internals.

The adapter runs the target's own forward (its inner model's ``__call__``) on
a shallow copy of that inner model whose ``layers`` list holds thin probes
around the same layer modules: a probe records a layer's output (the hidden
states after ``target_layer_ids``) and, for a recurrent layer, what it needs
to roll its state back. The weights are shared and the user's model is left
alone, so every family mlx-lm builds that way runs as mlx-lm runs it.

Rejected drafts roll back exactly for every cache kind mlx-lm gives the
supported families: full-attention ``KVCache`` is trimmed; sliding-window
layers keep a :class:`WindowKVCache` instead of mlx-lm's ``RotatingKVCache``;
linear-attention layers (``ArraysCache``: conv and gated-delta state) keep a
:class:`RecurrentCache`, which remembers the state before the last update and
replays the layer over the kept tokens.

Tree verification (:meth:`TargetAdapter.tree_forward`) needs what mlx-lm's
``Model.__call__`` cannot take: an ancestor mask and a position per node. For
the families whose layers are plain pre-norm blocks (``q/k/v/o_proj``,
optional ``q_norm``/``k_norm``, ``rope``, ``scale``) with full-attention
caches the adapter runs those blocks itself: the layer's own projections and
norms, its own ``rope`` called with per-node offsets (tokens moved into the
batch axis, where ``mx.fast.rope`` takes one offset per row), the layer's own
KV cache, and :func:`mlx_dspark.metal.tree_attention` for the attention.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.models.gemma4_text import logit_softcap

from ..errors import DSparkError
from ..metal.dispatch import tree_attention
from ..metal.numpy_reference import ancestor_bitmask


@dataclass(frozen=True)
class Family:
    """What the adapter knows of one mlx-lm model type.

    ``tree``: its decoder layers are the plain pre-norm blocks
    :meth:`TargetAdapter.tree_forward` runs (a family with sliding-window or
    recurrent layers is refused there by its caches anyway). ``note``: what
    stands in the way of trees, for the refusal.
    """

    tree: bool
    note: str = ""


FAMILIES: dict[str, Family] = {
    "llama": Family(tree=True),
    "mistral": Family(tree=True),
    "qwen2": Family(tree=True),
    "qwen3": Family(tree=True),
    "qwen3_moe": Family(tree=True),
    "phi3": Family(tree=False, note="its fused qkv projection"),
    "gemma3_text": Family(tree=False, note="sliding-window and sandwich-norm layers"),
    "gemma3": Family(tree=False, note="sliding-window and sandwich-norm layers"),
    "gemma4_text": Family(tree=False, note="sliding-window and KV-shared layers"),
    "gemma4": Family(tree=False, note="sliding-window and KV-shared layers"),
    "gpt_oss": Family(tree=False, note="sliding-window layers and attention sinks"),
    "qwen3_next": Family(tree=False, note="linear-attention layers"),
    "qwen3_5": Family(tree=False, note="linear-attention layers"),
    "qwen3_5_moe": Family(tree=False, note="linear-attention layers"),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

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


def model_type_of(model: nn.Module) -> str | None:
    return getattr(model, "model_type", None) or getattr(
        getattr(model, "args", None), "model_type", None
    )


def unsupported_reason(model_type: str | None) -> str | None:
    """One sentence on why a model type cannot be a target, or None."""
    if model_type in FAMILIES:
        return None
    return (
        f"Target model type {model_type!r} is not supported: the adapter has no "
        "entry for it (its layer taps and cache rollback are untested); "
        f"supported types are {', '.join(SUPPORTED_MODEL_TYPES)}."
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


class RecurrentCache(ArraysCache):
    """A linear-attention layer's state (mlx-lm's ``ArraysCache``: conv and
    gated-delta state) that can be rolled back within its last update.

    A recurrent state cannot be un-appended, so the adapter's probe hands the
    cache, at each update, the state before it and a replay: the same layer
    called again over the first ``k`` tokens of that update. Rolling back
    ``n`` of the update's ``L`` tokens restores the earlier state and replays
    ``L - n`` tokens; only this layer runs, and only its state is evaluated.
    (Keeping the state after every token instead needs the recurrence run one
    token at a time during verification; ``examples/recurrent_rollback_ab.py``
    measures both.)
    """

    def __init__(self, size: int):
        super().__init__(size)
        self._before: list | None = None
        self._replay: Callable[[int], None] | None = None
        self._length = 0

    def remember(
        self, before: list, replay: Callable[[int], None], length: int
    ) -> None:
        """The state before an update of ``length`` tokens, and its replay."""
        self._before, self._replay, self._length = before, replay, length

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        if n <= 0:
            return 0
        if self._before is None or n > self._length:
            raise DSparkError(
                "A linear-attention state rolls back at most the tokens of its "
                "last update."
            )
        self.cache = list(self._before)
        self._length -= n
        if self._length:
            self._replay(self._length)
        return n


def _rollbackable(cache):
    """The cache the adapter keeps in place of one mlx-lm makes for a layer."""
    if isinstance(cache, KVCache):
        return cache
    if isinstance(cache, RotatingKVCache) and cache.keep == 0:
        return WindowKVCache(cache.max_size)
    if type(cache) is ArraysCache:
        return RecurrentCache(len(cache.cache))
    raise DSparkError(
        f"The target's {type(cache).__name__} layers cannot be rolled back after "
        "rejected drafts."
    )


class _KeptKeys:
    """A full-attention layer's keys and values of every cached token: cut
    back to any shorter prefix."""

    def __init__(self, keys: mx.array, values: mx.array):
        self.keys, self.values = keys, values

    @property
    def arrays(self) -> list[mx.array]:
        return [self.keys, self.values]

    def shortest(self, length: int) -> int:
        return 0

    def restore_into(self, cache, length: int, n: int) -> None:
        if n:
            cache.update_and_fetch(self.keys[..., :n, :], self.values[..., :n, :])


class _WindowKeys(_KeptKeys):
    """A sliding-window layer's kept keys and values, of the tokens from
    ``start`` on: a prefix of ``n`` tokens can be restored while the window
    of its last token is among them."""

    def __init__(self, keys: mx.array, values: mx.array, start: int, window: int):
        super().__init__(keys, values)
        self.start, self.window = start, window

    def shortest(self, length: int) -> int:
        return 0 if self.start == 0 else self.start + self.window - 1

    def restore_into(self, cache, length: int, n: int) -> None:
        if n:
            used = n - self.start
            cache.keys = self.keys[..., :used, :]
            cache.values = self.values[..., :used, :]
            cache.start, cache.offset = self.start, n


class _RecurrentState:
    """A recurrent layer's state after the snapshot's last token: restored
    only there (a state cannot be un-appended)."""

    def __init__(self, arrays: list):
        self.state = list(arrays)

    @property
    def arrays(self) -> list[mx.array]:
        return [a for a in self.state if a is not None]

    def shortest(self, length: int) -> int:
        return length

    def restore_into(self, cache, length: int, n: int) -> None:
        cache.cache = list(self.state)


@dataclass
class CacheState:
    """A request's target cache as :meth:`TargetAdapter.snapshot` keeps it:
    ``length`` tokens, restorable to any prefix of ``shortest`` tokens or
    more (0 when every layer keeps all its keys, ``length`` when a layer
    keeps a recurrent state)."""

    layers: list
    length: int
    shortest: int

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for layer in self.layers for a in layer.arrays)


def _kept(cache):
    """What :meth:`TargetAdapter.snapshot` keeps of one layer's cache."""
    if isinstance(cache, WindowKVCache):
        if cache.keys is None:
            keys = values = mx.zeros((1, 1, 0, 1))
        else:
            keys, values = (mx.contiguous(a) for a in cache.state)
        return _WindowKeys(keys, values, cache.start, cache.window)
    if isinstance(cache, RecurrentCache):
        return _RecurrentState(cache.cache)
    keys = cache.keys[..., : cache.offset, :] if cache.keys is not None else None
    if keys is None:
        return _KeptKeys(mx.zeros((1, 1, 0, 1)), mx.zeros((1, 1, 0, 1)))
    values = cache.values[..., : cache.offset, :]
    return _KeptKeys(mx.contiguous(keys), mx.contiguous(values))


class _Probe:
    """A layer as the inner model sees it, recording what the adapter needs.

    It records the layer's input (``input_tap``: DeepSpec's tap -1 is the
    first layer's input) and/or output (``output_tap``) into ``taps``, and
    gives a :class:`RecurrentCache` its state before the call and a replay.
    Attribute reads go to the layer, so the inner model's own code (layer
    types, ``is_linear``, ...) sees the layer itself.
    """

    def __init__(
        self,
        layer: nn.Module,
        index: int,
        taps: dict[int, mx.array],
        input_tap: bool,
        output_tap: bool,
    ):
        self.layer, self.index, self.taps = layer, index, taps
        self.input_tap, self.output_tap = input_tap, output_tap

    def __getattr__(self, name: str):
        return getattr(self.layer, name)

    def __call__(self, x: mx.array, mask=None, cache=None, **kwargs):
        if self.input_tap:
            self.taps[-1] = x
        before = list(cache.cache) if isinstance(cache, RecurrentCache) else None
        out = self.layer(x, mask, cache, **kwargs)
        if before is not None:
            layer = self.layer

            def replay(k: int) -> None:
                head = mask[..., :k] if isinstance(mask, mx.array) else mask
                layer(x[:, :k], head, cache, **kwargs)

            cache.remember(before, replay, x.shape[1])
        if self.output_tap:
            self.taps[self.index] = out[0] if isinstance(out, tuple) else out
        return out


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
        model_type = model_type_of(model)
        reason = unsupported_reason(model_type)
        # Multimodal wrappers (gemma3, gemma4, qwen3_5) hold the text model.
        text = getattr(model, "language_model", model)
        inner = getattr(text, "model", None)
        if reason is None and not all(
            hasattr(inner, name) for name in ("embed_tokens", "layers", "norm")
        ):
            reason = (
                f"This mlx-lm version's {model_type} model lacks the embedding, "
                "layers and final norm the adapter reads; use the mlx-lm version "
                "this package pins."
            )
        if reason is not None:
            raise DSparkError(reason)
        self.model = model
        self.model_type = model_type
        self.family = FAMILIES[model_type]
        self.text = text
        self.inner = inner
        self.layers = inner.layers
        self.layer_ids = [int(i) for i in layer_ids]
        last = len(self.layers) - 1
        for i in self.layer_ids:
            if not -1 <= i <= last:
                raise DSparkError(
                    f"target_layer_ids {self.layer_ids} must lie in -1..{last} "
                    f"for a target with {len(self.layers)} layers."
                )
        self.cache_kinds = tuple(type(c) for c in self.make_cache())

    @property
    def plain_kv(self) -> bool:
        """Whether every layer keeps a full-attention ``KVCache``: what batched
        verification across requests and trees need, and what lets a cached
        prompt be cut back to any shorter prefix."""
        return all(issubclass(kind, KVCache) for kind in self.cache_kinds)

    @property
    def rollback_kinds(self) -> list[str]:
        """How each kind of layer this target has rolls back, for users."""
        names = {
            KVCache: "trim",
            WindowKVCache: "sliding window un-appended",
            RecurrentCache: "state restored and replayed",
        }
        return sorted({names[kind] for kind in self.cache_kinds})

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
        return "lm_head" not in self.text or bool(
            getattr(self.text, "tie_word_embeddings", False)
        )

    @property
    def head(self) -> nn.Module:
        """The module holding the LM head matrix: ``lm_head``, or the embedding
        when tied. Logits come from :meth:`lm_head`."""
        return self.embedding if self.tied_head else self.text.lm_head

    def embed(self, tokens: mx.array) -> mx.array:
        return self.inner.embed_tokens(tokens)

    def input_embedding(self, tokens: mx.array) -> mx.array:
        """The embedding of ``tokens`` as the model's own forward scales it
        before its first layer (Gemma's ``embed_scale``)."""
        return self.inner.embed_tokens(tokens) * getattr(self.inner, "embed_scale", 1.0)

    def lm_head(self, hidden: mx.array) -> mx.array:
        """Logits as the model's own call makes them from the final normalised
        state (soft-capped where the family caps them)."""
        if self.tied_head:
            logits = self.inner.embed_tokens.as_linear(hidden)
        else:
            logits = self.text.lm_head(hidden)
        cap = getattr(self.text, "final_logit_softcapping", None)
        return logit_softcap(cap, logits) if cap else logits

    def make_cache(self) -> list:
        """mlx-lm's caches for this model, each replaced by one that rolls back
        exactly: sliding-window layers get a :class:`WindowKVCache`, linear-
        attention layers a :class:`RecurrentCache` (KV-shared layers have none:
        they read an earlier layer's)."""
        return [_rollbackable(c) for c in make_prompt_cache(self.model)]

    def snapshot(self, cache: list | BatchRow) -> CacheState:
        """An evaluated copy of a request's target cache, to be reused by later
        requests (:meth:`restore`): every key of a full-attention layer, the
        kept keys of a sliding-window layer (its window back from each of the
        last update's tokens) and a recurrent layer's state."""
        if isinstance(cache, BatchRow):
            batch = cache.batch
            batch.settle()
            r = batch.rows.index(cache)
            start = int(batch.layers[0].left_padding[r].item())
            layers = [
                _KeptKeys(
                    mx.contiguous(c.keys[r : r + 1, :, start : c._idx]),
                    mx.contiguous(c.values[r : r + 1, :, start : c._idx]),
                )
                for c in batch.layers
            ]
            length = batch.layers[0]._idx - start
        else:
            layers = [_kept(c) for c in cache]
            # Recurrent layers count no tokens; hybrids have attention layers.
            length = next(c.offset for c in cache if hasattr(c, "offset"))
        mx.eval([a for layer in layers for a in layer.arrays])
        shortest = max((layer.shortest(length) for layer in layers), default=0)
        return CacheState(layers, length, shortest)

    def restore(self, state: CacheState, n: int) -> list:
        """A new cache holding the first ``n`` tokens of a :meth:`snapshot`
        (``state.shortest <= n <= state.length``)."""
        if not state.shortest <= n <= state.length:
            raise ValueError(
                f"this snapshot restores {state.shortest}..{state.length} tokens, "
                f"not {n}"
            )
        cache = self.make_cache()
        for c, layer in zip(cache, state.layers, strict=True):
            layer.restore_into(c, state.length, n)
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

    def attention_kv(self, cache: list) -> dict[str, tuple[mx.array, mx.array]]:
        """The keys and values a Gemma-4 assistant drafter attends to, per
        layer kind (``"full_attention"``, ``"sliding_attention"``): those of
        the last layer of that kind that keeps a cache (the layer the target's
        KV-shared layers read), over the positions a query at the next
        position (the anchor, not yet run) would see, without the anchor's
        own: every cached position for full attention, the last
        ``window - 1`` for a sliding window. Keys ``[1, H, L, D]`` in
        temporal order, RoPE applied, as the layer cached them."""
        kinds = [getattr(layer, "layer_type", None) for layer in self.layers]
        if None in kinds:
            raise DSparkError(
                f"A {self.model_type} target does not share its attention "
                "keys and values by layer kind; the Gemma-4 assistant drafter "
                "needs a Gemma-4 target."
            )
        source: dict[str, int] = {}
        for i, c in enumerate(cache):
            if c is not None:
                source[kinds[i]] = i
        out = {}
        for kind, i in source.items():
            c = cache[i]
            if isinstance(c, WindowKVCache):
                first = max(c.offset - c.window + 1, c.start) - c.start
                used = c.offset - c.start
                out[kind] = c.keys[..., first:used, :], c.values[..., first:used, :]
            else:
                out[kind] = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
        return out

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
        """Whether :meth:`tree_forward` can run this target: a family of plain
        pre-norm blocks, full-attention caches, and every layer built so."""
        return (
            self.family.tree
            and self.plain_kv
            and all(
                all(hasattr(layer, name) for name in _TREE_BLOCK_PARTS)
                and all(
                    hasattr(layer.self_attn, name) for name in _TREE_ATTENTION_PARTS
                )
                for layer in self.layers
            )
        )

    def check_tree(self) -> None:
        if self.supports_tree:
            return
        if not self.plain_kv:
            why = "layers that keep a sliding window or a recurrent state"
        else:
            why = self.family.note or "its layer structure"
        raise DSparkError(
            f"Tree verification does not support {self.model_type} targets "
            f"({why}); use chain drafting (tree budget 0)."
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
        normed, features = self._finish(self.inner.norm(h), taps)
        return self.lm_head(normed), features

    def _finish(
        self, normed: mx.array, taps: list[mx.array]
    ) -> tuple[mx.array, mx.array | None]:
        """The final normalised state and the tapped features. DeepSpec taps
        Hugging Face's ``hidden_states[i + 1]``, which for the last layer is
        that normalised state, so its tap (always the last) is replaced by it."""
        if len(self.layers) - 1 in self.layer_ids:
            taps[-1] = normed
        return normed, mx.concatenate(taps, axis=-1) if taps else None

    def hidden(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array | None]:
        """Final normalised hidden states ``[B, L, d]`` (``lm_head`` input) and
        tapped features ``[B, L, len(ids) * d]``, from the inner model's own
        forward over probed layers."""
        taps: dict[int, mx.array] = {}
        layers = list(self.inner.layers)
        for i, layer in enumerate(layers):
            recurrent = i < len(cache) and isinstance(cache[i], RecurrentCache)
            input_tap = i == 0 and -1 in self.layer_ids
            if recurrent or input_tap or i in self.layer_ids:
                layers[i] = _Probe(layer, i, taps, input_tap, i in self.layer_ids)
        probed = copy.copy(self.inner)
        probed.layers = layers
        normed = probed(tokens, cache=cache)
        return self._finish(normed, [taps[i] for i in sorted(self.layer_ids)])

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
        last token's, ``[1, 1, V]``. Targets with recurrent layers run one
        forward per request.
        """
        if len(caches) != len(tokens):
            raise ValueError("one token list per cache is required")
        if RecurrentCache in self.cache_kinds:
            # A recurrent state cannot be padded: one forward per request.
            out = []
            for request, cache in zip(tokens, caches, strict=True):
                hidden, features = self.hidden(mx.array([list(request)]), cache)
                logits = self.lm_head(hidden[:, -1:] if last_only else hidden)
                out.append((logits, features))
            return out
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
