"""The drafter for training: configuration, initialisation, training forward."""

from __future__ import annotations

from dataclasses import asdict, is_dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..checkpoints.loading import load_drafter
from ..checkpoints.weights import dequantize
from ..errors import DSparkError
from ..proposers.dspark import (
    DraftAttention,
    DraftLayer,
    DSparkDrafter,
    Gemma4DraftLayer,
)
from ..proposers.dspark_config import DraftConfig
from ..proposers.dspark_heads import GatedMarkovHead
from ..targets.adapter import TargetAdapter


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
    *,
    layers: int,
    block_size: int,
    markov_head: str,
    markov_rank: int,
    anchors: int,
    confidence: bool,
    mask_token_id: int,
    draft_vocab_size: int | None = None,
) -> DraftConfig:
    """The target's config plus the DSpark keys, as DeepSpec writes it.

    A Gemma-4 target gets a ``Gemma4DSparkModel`` (see :func:`gemma4_config`)."""
    rank = 0 if markov_head == "none" else markov_rank
    dspark = dict(
        num_hidden_layers=layers,
        num_target_layers=adapter.num_layers,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=list(adapter.layer_ids),
        num_anchors=anchors,
        markov_rank=rank,
        markov_head_type=markov_head if rank else "vanilla",
        enable_confidence_head=confidence,
        confidence_head_with_markov=bool(confidence and rank),
        tie_word_embeddings=False,
        layer_types=["full_attention"] * layers,
    )
    if draft_vocab_size is not None:
        dspark["draft_vocab_size"] = draft_vocab_size
    if adapter.model_type in ("gemma4_text", "gemma4"):
        return gemma4_config(target_config, adapter, dspark)
    config = target_text_config(target_config, adapter)
    config.update(architectures=["Qwen3DSparkModel"], **dspark)
    return DraftConfig.from_dict(config)


def target_text_config(target_config: dict, adapter: TargetAdapter) -> dict:
    """The target's text-model config as a Qwen3-style drafter inherits it:
    mlx-lm's arguments fill what the config leaves to defaults (multimodal
    wrappers such as gemma3 and qwen3_5 keep it in ``text_config``), with an
    explicit ``head_dim``, ``rope_theta`` and ``rms_norm_eps``."""
    args = getattr(adapter.text, "args", None)
    config = {
        **(asdict(args) if is_dataclass(args) else {}),
        **target_config,
        **(target_config.get("text_config") or {}),
    }
    for key in _NOT_DRAFTER_KEYS:
        config.pop(key, None)
    config["head_dim"] = config.get("head_dim") or (
        adapter.hidden_size // config["num_attention_heads"]
    )
    config.setdefault("rope_theta", 10000.0)
    config.setdefault("rms_norm_eps", 1e-6)
    return config


_NOT_DRAFTER_KEYS = (
    "quantization",
    "quantization_config",
    "layer_types",
    "text_config",
    "vision_config",
)

# What DeepSpec's Gemma-4 drafter reads from the text config beyond mlx-lm's
# arguments, with the values of Hugging Face's Gemma-4 text config.
_GEMMA4_HF_DEFAULTS = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_activation": "gelu_pytorch_tanh",
    "initializer_range": 0.02,
}


def gemma4_config(
    target_config: dict, adapter: TargetAdapter, dspark: dict
) -> DraftConfig:
    """DeepSpec's ``Gemma4DSparkModel`` config for a Gemma-4 target: the
    target's text config (with mlx-lm's defaults filled in, so that global
    head dim, RoPE parameters and soft-capping are explicit), dense layers of
    full attention without per-layer inputs, and the DSpark keys ``dspark``."""
    text = target_config
    if adapter.model_type == "gemma4":
        text = target_config.get("text_config") or {}
    args = getattr(adapter.text, "args", None)
    config = {
        **_GEMMA4_HF_DEFAULTS,
        **text,
        **(asdict(args) if is_dataclass(args) else {}),
    }
    for key in _NOT_DRAFTER_KEYS:
        config.pop(key, None)
    config.update(
        architectures=["Gemma4DSparkModel"],
        target_model_type=adapter.model_type,
        target_text_model_type=config.get("model_type", "gemma4_text"),
        enable_moe_block=False,
        hidden_size_per_layer_input=0,
        **dspark,
    )
    return DraftConfig.from_dict(config)


def new_drafter(
    config: DraftConfig,
    target: TargetAdapter,
    seed: int,
    draft_ids: np.ndarray | None = None,
    init_from_target: bool = False,
) -> DSparkDrafter:
    """A freshly initialised drafter sharing the target's frozen embedding/head.

    With a reduced draft vocabulary (``draft_ids``, target ids) the LM head is
    the drafter's own: the target head's rows for those ids, also frozen.
    ``init_from_target`` starts the draft layers from the target's top
    decoder layers (see :func:`copy_target_layers`).
    """
    mx.random.seed(seed)
    drafter = DSparkDrafter(config)
    use_target_embeddings(drafter, target, draft_ids)
    if config.is_gemma4:
        # DeepSpec's layer_scalar is a buffer of ones, never trained.
        for layer in drafter.layers:
            layer.freeze(keys=["layer_scalar"], recurse=False)
    if init_from_target:
        copy_target_layers(drafter, target)
    drafter.update(
        tree_unflatten(
            [
                (k, v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v)
                for k, v in tree_flatten(drafter.parameters())
            ]
        )
    )
    start_norm_from_target(drafter, target)
    mx.eval(drafter.parameters())
    return drafter


def use_target_embeddings(
    drafter: nn.Module, target: TargetAdapter, draft_ids: np.ndarray | None
) -> None:
    """Share the target's embedding and LM head with the drafter; with a
    reduced draft vocabulary (``draft_ids``, target ids) the LM head is the
    drafter's own: the target head's rows for those ids, frozen."""
    if drafter.config.reduced_vocab:
        drafter.share_embeddings(target.embed, None)
        drafter.own_embeddings(embed=False, head=True)
        ids = mx.array(draft_ids)
        drafter.lm_head.weight = head_weight(target)[ids]
        drafter.draft_to_target = ids
        drafter.freeze(keys=["lm_head"], recurse=True)
    else:
        drafter.share_embeddings(target.embed, target.lm_head)


def start_norm_from_target(drafter: nn.Module, target: TargetAdapter) -> None:
    """Set ``drafter.norm`` to the target's final-norm scale.

    The drafter's output feeds the target's LM head: from the target's scale
    the first logits are on the target's scale, when that norm scales by its
    weight as the drafter's does. Gemma's ``1 + weight`` final norm
    (Gemma-3-270M: up to 301 on a few features) leaves the drafter at ones:
    from its scale, a random draft layer's logits were so peaked that after 16
    steps the cross-entropy was still 65 (ones: 5.9; docs/gemma3-pair.md).
    """
    norm = getattr(target.inner, "norm", None)
    scale = norm_scale(norm, drafter.norm.weight)
    if scale is not None:
        weight = norm.weight.astype(mx.float32)
        if mx.allclose(scale, weight, rtol=1e-4, atol=1e-5).item():
            drafter.norm.weight = weight


def norm_scale(norm: nn.Module | None, like: mx.array) -> mx.array | None:
    """The per-feature scale a target RMS norm applies, shaped like ``like``
    (float32), or None when it has no such scale: its output on a vector of
    ones, so that Gemma's ``1 + weight`` norms give ``1 + weight``."""
    weight = getattr(norm, "weight", None)
    if weight is None or weight.shape != like.shape:
        return None
    return norm(mx.ones(like.shape, weight.dtype)).astype(mx.float32)


def trained_drafter(path: Path, target: nn.Module) -> DSparkDrafter:
    """A drafter written earlier (by this trainer or a converter), with float
    weights, to start a run from (``--init-from``)."""
    drafter = load_drafter(path, target)
    if any(k.endswith(".scales") for k, _ in tree_flatten(drafter.parameters())):
        dequantize(drafter)
    return drafter


def copy_trained_weights(
    drafter: DSparkDrafter, source: DSparkDrafter, target: TargetAdapter
) -> None:
    """``source``'s value of every trainable weight of ``drafter`` (float32);
    the frozen embedding and LM head stay the target's.

    A drafter with more layers than ``source`` grows it: the layers ``source``
    lacks go on top, started from the target's layers (as
    :func:`copy_target_layers` places them) with their attention and MLP
    output projections zeroed, so that each adds nothing to the residual
    stream and the grown drafter drafts exactly what ``source`` did until
    training moves them. A larger Markov rank grows a vanilla head alike:
    ``source``'s factors fill the leading columns, ``W1``'s new columns keep
    their fresh initialisation and ``W2``'s, like the confidence head's
    weights on them, start at zero. A vanilla head grows into a gated head of
    the same factors: its gate starts at ``sigmoid(0) = 1/2`` everywhere (the
    gate's projection zeroed) and ``W2`` doubles, which biases the drafts
    exactly as before.
    """
    theirs = dict(tree_flatten(source.parameters()))
    grown = len(source.layers)
    weights = []
    for name, fresh in tree_flatten(drafter.trainable_parameters()):
        if name in theirs:
            weight = theirs[name].astype(mx.float32)
            if weight.shape != fresh.shape:
                weight = _widened(name, weight, fresh)
            weights.append((name, weight))
    drafter.load_weights(weights, strict=False)
    head = drafter.markov_head
    if (
        isinstance(head, GatedMarkovHead)
        and source.config.markov_head_type == "vanilla"
    ):
        head.gate_proj.weight = mx.zeros_like(head.gate_proj.weight)
        head.gate_proj.bias = mx.zeros_like(head.gate_proj.bias)
        head.markov_w2.weight = head.markov_w2.weight * 2
    if len(drafter.layers) > grown:
        copy_target_layers(drafter, target, first=grown)
        for layer in drafter.layers[grown:]:
            for path in ("self_attn.o_proj", "mlp.down_proj"):
                projection = _module(layer, path)
                projection.weight = mx.zeros_like(projection.weight)
    mx.eval(drafter.parameters())


def _widened(name: str, weight: mx.array, fresh: mx.array) -> mx.array:
    """``weight`` with ``fresh``'s extra last-axis columns: fresh ones for
    the Markov head's token embedding, zeros elsewhere."""
    extra = fresh[..., weight.shape[-1] :]
    if name != "markov_head.markov_w1.weight":
        extra = mx.zeros_like(extra)
    return mx.concatenate([weight, extra], axis=-1)


_SHAPE_FLAGS = {
    "num_hidden_layers": "--layers",
    "block_size": "--block-size",
    "markov_head_type": "--markov-head",
    "markov_rank": "--markov-rank",
    "draft_vocab_size": "--draft-vocab",
    "target_layer_ids": "--target-layer-ids",
    "mask_token_id": "--mask-token-id",
    "enable_confidence_head": "--confidence",
}


_TARGET_SHAPE = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "num_target_layers",
)


def check_same_shape(config: DraftConfig, trained: DraftConfig, path: Path) -> None:
    """Refuse to start from a drafter of another shape than the flags ask for
    (more layers than it has, or from a vanilla Markov head a larger rank or
    a gated head, are fine: see :func:`copy_trained_weights`)."""
    mine, theirs = config.to_dict(), trained.to_dict()
    differ = [
        k for k in (*_SHAPE_FLAGS, *_TARGET_SHAPE) if mine.get(k) != theirs.get(k)
    ]
    if mine["num_hidden_layers"] > theirs["num_hidden_layers"]:
        differ.remove("num_hidden_layers")
    if theirs.get("markov_head_type") == "vanilla" and theirs["markov_rank"] > 0:
        if mine["markov_rank"] > theirs["markov_rank"]:
            differ.remove("markov_rank")
        if mine["markov_head_type"] == "gated":
            differ.remove("markov_head_type")
    if len(mine["target_layer_ids"]) == len(theirs["target_layer_ids"]):
        differ = [k for k in differ if k != "target_layer_ids"]
    if not differ:
        return
    flags = [
        f"{_SHAPE_FLAGS[k]} ({theirs.get(k)}, not {mine.get(k)})"
        for k in differ
        if k in _SHAPE_FLAGS
    ]
    if len(flags) < len(differ):
        raise DSparkError(
            f"--init-from {path} is a drafter for another target "
            f"({', '.join(k for k in differ if k not in _SHAPE_FLAGS)} differ)."
        )
    raise DSparkError(
        f"--init-from {path} was trained with other settings; pass its "
        f"{', '.join(flags)}."
    )


_LAYER_PARTS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "self_attn.q_norm",
    "self_attn.k_norm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
    "input_layernorm",
    "post_attention_layernorm",
)
# Gemma-4's sandwich norms (its layer_scalar stays DeepSpec's ones).
_GEMMA4_LAYER_PARTS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def copy_target_layers(
    drafter: DSparkDrafter, target: TargetAdapter, first: int = 0
) -> None:
    """Start draft layer ``i`` of ``n`` from target layer ``L - n + i``
    (for ``i >= first``).

    Every weight of the same shape is copied (dequantized); parts the target
    layer lacks (``q_norm``/``k_norm`` in Llama; ``k_proj``/``v_proj`` in
    Gemma-4's KV-shared layers) or holds in another shape (Gemma-4's
    sliding-window attention, whose heads are narrower than the drafter's
    global ones) keep their initialisation.
    """
    layers = drafter.layers
    sources = target.layers[len(target.layers) - len(layers) :]
    if len(sources) < len(layers):
        raise DSparkError("--init-from-target needs as many target layers as drafts.")
    parts = _LAYER_PARTS
    if drafter.config.is_gemma4:
        parts = _LAYER_PARTS + _GEMMA4_LAYER_PARTS
    copied = 0
    for layer, source in list(zip(layers, sources, strict=True))[first:]:
        for path in parts:
            mine, theirs = _module(layer, path), _module(source, path)
            if mine is None or theirs is None:
                continue
            weight = dense_weight(theirs)
            if weight.shape != mine.weight.shape:
                continue
            mine.weight = weight.astype(mx.float32)
            bias = theirs.get("bias") if isinstance(theirs, nn.Module) else None
            if bias is not None and "bias" in mine:
                mine.bias = bias.astype(mx.float32)
            copied += 1
    if copied == 0:
        raise DSparkError(
            "--init-from-target found no target weights of the drafter's shapes."
        )


def _module(root: nn.Module, path: str) -> nn.Module | None:
    for name in path.split("."):
        root = getattr(root, name, None)
        if root is None:
            return None
    return root if hasattr(root, "weight") else None


def head_weight(target: TargetAdapter) -> mx.array:
    """The target's LM head matrix ``[vocab, hidden]`` (tied or not), dense;
    a Gemma-4 wrapper's is its text model's."""
    return dense_weight(target.head)


def dense_weight(module: nn.Module) -> mx.array:
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

    The context keys/values are computed once per sequence and shared by its
    A blocks: every query scores its sequence's whole context (the anchor
    masks what it may not see) and its own block, in one softmax.
    """
    N, S, _ = features.shape
    A, B = blocks.shape[1], blocks.shape[2]
    offsets = anchors.reshape(-1).astype(mx.int32)
    visible = mx.arange(S)[None, None, :] < anchors[..., None]  # [N, A, S]
    context = drafter.hidden_norm(drafter.fc(features))
    h = drafter.embed(blocks.reshape(N * A, B))
    block = _gemma4_layer if drafter.config.is_gemma4 else _layer
    for layer in drafter.layers:
        h = block(layer, h, offsets, context, visible)
    return drafter.norm(h)


def _layer(
    layer: DraftLayer,
    x: mx.array,
    offsets: mx.array,
    context: mx.array,
    visible: mx.array,
) -> mx.array:
    h = x + _attention(
        layer.self_attn, layer.input_layernorm(x), offsets, context, visible
    )
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _gemma4_layer(
    layer: Gemma4DraftLayer,
    x: mx.array,
    offsets: mx.array,
    context: mx.array,
    visible: mx.array,
) -> mx.array:
    """``Gemma4DraftLayer``: sandwich norms and ``layer_scalar``; its attention
    (K = V, value norm, scale 1) is in the layer's own ``key_values``/``scale``."""
    h = _attention(layer.self_attn, layer.input_layernorm(x), offsets, context, visible)
    h = x + layer.post_attention_layernorm(h)
    h = h + layer.post_feedforward_layernorm(
        layer.mlp(layer.pre_feedforward_layernorm(h))
    )
    return h * layer.layer_scalar


def _attention(
    attn: DraftAttention,
    x: mx.array,
    offsets: mx.array,
    context: mx.array,
    visible: mx.array,
) -> mx.array:
    """``DraftAttention`` for ``[N * A, B]`` blocks over N shared contexts."""
    NA, B, _ = x.shape
    N, S, _ = context.shape
    A = NA // N
    H, Hkv = attn.n_heads, attn.n_kv_heads
    G = H // Hkv  # query heads per key/value head
    queries = attn.rope(attn.q_norm(attn._heads(attn.q_proj(x), H)), offset=offsets)
    keys, values = attn.key_values(x, offsets)  # [NA, Hkv, B, hd]
    ctx_keys, ctx_values = attn.key_values(context, 0)  # [N, Hkv, S, hd]
    D = queries.shape[-1]
    queries = (queries * attn.scale).reshape(N, A, Hkv, G * B, D)
    # Context scores, one product per sequence: [N, Hkv, A * G * B, S].
    per_seq = queries.transpose(0, 2, 1, 3, 4).reshape(N, Hkv, A * G * B, D)
    ctx_scores = (per_seq @ ctx_keys.swapaxes(-1, -2)).reshape(N, Hkv, A, G * B, S)
    ctx_scores = mx.where(
        visible[:, None, :, None, :], ctx_scores, mx.array(-mx.inf, ctx_scores.dtype)
    )
    # Block scores, one product per block: [N, Hkv, A, G * B, B].
    blk_scores = queries.reshape(NA, Hkv, G * B, D) @ keys.swapaxes(-1, -2)
    blk_scores = blk_scores.reshape(N, A, Hkv, G * B, B).transpose(0, 2, 1, 3, 4)
    probs = mx.softmax(
        mx.concatenate([ctx_scores, blk_scores], axis=-1), axis=-1, precise=True
    )
    ctx_out = probs[..., :S].reshape(N, Hkv, A * G * B, S) @ ctx_values
    ctx_out = ctx_out.reshape(N, Hkv, A, G * B, D).transpose(0, 2, 1, 3, 4)
    blk_probs = probs[..., S:].transpose(0, 2, 1, 3, 4).reshape(NA, Hkv, G * B, B)
    out = ctx_out.reshape(NA, Hkv, G * B, D) + blk_probs @ values
    out = out.reshape(NA, H, B, D).transpose(0, 2, 1, 3).reshape(NA, B, H * D)
    return attn.o_proj(out)
