"""Tiny models of every supported mlx-lm family, built from mlx-lm's own
classes, saved with a tokenizer, and quantized by ``mlx_lm.convert``.

Their weights make greedy output vary and drafts often but not always
right: the LM head maps each token's embedding to a permuted next token, and
the random layers perturb that with context.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.convert import convert
from mlx_lm.utils import _get_classes, save_model

from mlx_dspark.pairs.structured import PairSpec, _tokenizer_files

VOCAB = 32
WINDOW = 8  # sliding windows, shorter than the generations
LAYERS = 4
TAPS = [0, 2]
SLIDING = ["sliding_attention", "full_attention"] * (LAYERS // 2)

_BASE = {
    "hidden_size": 64,
    "num_hidden_layers": LAYERS,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
_GEMMA3 = {
    "model_type": "gemma3_text",
    "sliding_window": WINDOW,
    "sliding_window_pattern": 2,
    "query_pre_attn_scalar": 16,
    "rope_local_base_freq": 10000.0,
}
_QWEN3_5 = {
    "model_type": "qwen3_5_text",
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
    "rope_parameters": {
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "rope_type": "default",
    },
}

_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 64,
    "moe_intermediate_size": 64,
    "norm_topk_prob": True,
}

# model type -> what its config adds to (or, under text_config, nests) _BASE
CONFIGS: dict[str, dict] = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 64,
        "norm_topk_prob": True,
    },
    "phi3": {},
    "gemma3_text": _GEMMA3,
    "gemma3": {"text_config": _GEMMA3},
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": WINDOW,
        "layer_types": SLIDING,
    },
    "qwen3_5": {"text_config": _QWEN3_5},
    "qwen3_5_moe": {
        "text_config": {**_QWEN3_5, **_MOE, "model_type": "qwen3_5_moe_text"}
    },
    "qwen3_next": {
        **{k: v for k, v in _QWEN3_5.items() if k != "rope_parameters"},
        **_MOE,
        "partial_rotary_factor": 0.25,
        "mlp_only_layers": [],
    },
}
# The families whose caches are not all full attention.
SLIDING_FAMILIES = ("gemma3_text", "gemma3", "gpt_oss")
RECURRENT_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


# How strongly the layers perturb the residual stream (the embedding's map).
PERTURBATION = 0.3
_LAYER_OUTPUTS = ("o_proj.weight", "down_proj.weight", "out_proj.weight")
# Gemma's sandwich norms, which scale what a layer adds.
_GEMMA_POST_NORMS = (
    "post_attention_layernorm.weight",
    "post_feedforward_layernorm.weight",
)


def config_of(model_type: str) -> dict:
    extra = CONFIGS[model_type]
    if "text_config" in extra:
        text = {**_BASE, **extra["text_config"]}
        return {"model_type": model_type, "text_config": text, "vocab_size": VOCAB}
    return {**_BASE, **extra, "model_type": model_type}


def build_model(model_type: str, seed: int = 0):
    """The family's mlx-lm model with the permutation-map weights."""
    config = config_of(model_type)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    rng = np.random.default_rng(seed)
    weights = {}
    # Gemma's norms scale by 1 + weight.
    unit = 0.0 if "gemma" in model_type else 1.0
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("norm.weight") or value.ndim < 2:
            weights[name] = np.full(value.shape, unit if "norm" in name else 0.1)
        else:
            fan_in = value.shape[-1]
            weights[name] = rng.standard_normal(value.shape) / np.sqrt(fan_in)
    for name in weights:
        if name.endswith(_LAYER_OUTPUTS):
            weights[name] = weights[name] * PERTURBATION
        elif name.endswith(_GEMMA_POST_NORMS) and "gemma" in model_type:
            weights[name] = np.full(weights[name].shape, PERTURBATION - 1.0)
    embed_name = next(k for k in weights if k.endswith("embed_tokens.weight"))
    head_name = next(k for k in weights if k.endswith("lm_head.weight"))
    embed = weights[embed_name]
    head = np.zeros_like(embed)
    head[rng.permutation(VOCAB)] = 3 * embed
    weights[head_name] = head
    return _loaded(model, weights), config


def _loaded(model, weights: dict):
    model.load_weights([(k, mx.array(v, mx.float32)) for k, v in weights.items()])
    mx.eval(model.parameters())
    return model


def save_family(directory: Path, model_type: str, seed: int = 0) -> Path:
    """The family's float model saved as mlx-lm saves one, with a tokenizer."""
    model, config = build_model(model_type, seed)
    save_model(directory, model)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    for name, text in _tokenizer_files(PairSpec(vocab_size=VOCAB)).items():
        (directory / name).write_text(text)
    return directory


def quantized_copy(source: Path, directory: Path, bits: int = 4, **recipe) -> Path:
    """``mlx_lm.convert -q`` of a saved family model (``recipe``: convert's
    other quantization arguments: q_group_size, q_mode, quant_predicate)."""
    recipe = {"q_bits": bits, "q_group_size": 32, **recipe}
    convert(str(source), str(directory), quantize=True, **recipe)
    return directory
