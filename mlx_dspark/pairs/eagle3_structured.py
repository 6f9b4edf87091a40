"""A structured target / EAGLE-3 drafter pair whose drafts are often, not
always, accepted (see :mod:`mlx_dspark.pairs.structured` for the target).

The target's LM head maps each token's code ``e_x`` to ``pi(x)``, and its
random layers perturb that with context. The drafter's ``fc`` passes the
last tapped feature (about ``e_x`` at position ``p``) through, and its MLP
maps ``e_y`` to ``e_{pi(y)}``; with the target's LM head the drafter then
predicts ``pi(pi(x_p)) = x_{p+2}`` at position ``p``, and keeps walking the
chain from its own outputs. Its attention only adds a small perturbation.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np

from ..proposers.eagle3 import Eagle3Drafter
from ..proposers.eagle3_config import Eagle3Config
from .structured import (
    PairSpec,
    _chain_map,
    _codes,
    _save,
    _target_weights,
    _tokenizer_files,
    random_weights,
    target_config,
)

EAGLE3_SPEC = PairSpec(
    vocab_size=24,
    hidden_size=32,
    num_layers=6,
    num_heads=2,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=64,
)


def eagle3_config(spec: PairSpec, ttt_length: int = 7) -> dict:
    """A DeepSpec ``Qwen3Eagle3Model`` config for the target of ``spec``."""
    config = target_config(spec)
    config.update(
        architectures=["Qwen3Eagle3Model"],
        num_hidden_layers=1,
        num_target_layers=spec.num_layers,
        target_layer_ids=eagle3_layer_ids(spec.num_layers),
        ttt_length=ttt_length,
        step_loss_decay=0.8,
        draft_num_hidden_layers=1,
    )
    return config


def eagle3_layer_ids(num_layers: int) -> list[int]:
    """Up to five tapped layers, never the last (as DeepSpec requires)."""
    ids = np.linspace(0, num_layers - 2, num=min(5, num_layers - 1))
    return sorted({int(round(i)) for i in ids})


def eagle3_weights(
    spec: PairSpec,
    target: dict,
    codes: np.ndarray,
    chain: np.ndarray,
    rng: np.random.Generator,
    attention: float = 0.3,
    gain: float = 8.0,
) -> dict[str, np.ndarray]:
    """The drafter's tensors (DeepSpec names), embedding and head copied from
    ``target``; ``attention`` scales the attention's output projection."""
    d, m = spec.hidden_size, spec.code_dims
    config = Eagle3Config.from_deepspec(eagle3_config(spec))
    drafter = Eagle3Drafter(config)
    weights = random_weights(drafter, rng)
    taps = len(config.target_layer_ids)
    fc = 0.05 * weights["fc.weight"]
    fc[:, (taps - 1) * d :] += np.eye(d, dtype=np.float32)
    weights["fc.weight"] = fc
    weights["layers.0.self_attn.o_proj.weight"] *= attention
    # With the code and the constant unit of e_y RMS-normed, code unit y reads
    # at most sqrt(d / 2) (less with the target's perturbation): silu(x) * x
    # there, about 0 elsewhere; ``gain`` overshoots to make up for it.
    x = np.sqrt(d / 2)
    unit = x * x / (1 + np.exp(-x)) / gain
    n = len(chain)
    gate = np.zeros_like(weights["layers.0.mlp.gate_proj.weight"])
    up = np.zeros_like(weights["layers.0.mlp.up_proj.weight"])
    down = np.zeros_like(weights["layers.0.mlp.down_proj.weight"])
    gate[np.arange(n), :m] = codes[:n]
    up[np.arange(n), :m] = codes[:n]
    down[:m, np.arange(n)] = (codes[chain] - codes[:n]).T / unit
    weights["layers.0.mlp.gate_proj.weight"] = gate
    weights["layers.0.mlp.up_proj.weight"] = up
    weights["layers.0.mlp.down_proj.weight"] = down
    weights["embed_tokens.weight"] = np.asarray(target["model.embed_tokens.weight"])
    weights["lm_head.weight"] = np.asarray(target["lm_head.weight"])
    return weights


def build_eagle3_pair(
    directory: str | Path,
    spec: PairSpec = EAGLE3_SPEC,
    attention: float = 0.3,
    gain: float = 8.0,
    dtype: mx.Dtype = mx.float32,
) -> tuple[Path, Path]:
    """Write ``directory/target`` (an mlx-lm model with a tokenizer) and
    ``directory/eagle3`` (a DeepSpec-format EAGLE-3 checkpoint)."""
    rng = np.random.default_rng(spec.seed)
    codes = _codes(spec, rng)
    chain = _chain_map(spec, rng)
    target = _target_weights(spec, codes, chain, rng)
    drafter = eagle3_weights(spec, target, codes, chain, rng, attention, gain)
    directory = Path(directory)
    target_dir, drafter_dir = directory / "target", directory / "eagle3"
    _save(target_dir, target_config(spec), target, dtype)
    for name, text in _tokenizer_files(spec).items():
        (target_dir / name).write_text(text)
    _save(drafter_dir, eagle3_config(spec), drafter, dtype)
    return target_dir, drafter_dir
