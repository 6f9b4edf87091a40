"""Structured target/drafter pairs whose drafts are often, not always, accepted.

Random weights give near-zero acceptance and test nothing about the accept
path, so tests, the demo and the benchmarks build pairs by construction:

* every token ``x`` has a code vector ``e_x``; the target's LM head maps
  ``e_x`` to ``pi(x)`` for a fixed permutation ``pi`` (the identity when the
  drafter has no sequential head), and its random layers add a
  context-dependent perturbation that sometimes wins;
* the drafter's attention copies the anchor's code into every block position,
  so its base logits predict ``pi(anchor)``; its Markov head encodes ``pi``,
  so the sequential head walks the chain ``pi(anchor), pi^2(anchor), ...``.

A drafter without a sequential head can only propose a position-independent
continuation, which is why its target repeats tokens instead.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3

from ..proposers.dspark import DSparkDrafter
from ..proposers.dspark_config import DraftConfig
from ..utils import cache_dir


@dataclass
class PairSpec:
    vocab_size: int = 32
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    draft_layers: int = 1
    block_size: int = 7
    markov_head_type: str | None = "vanilla"
    confidence_with_markov: bool = True
    # Markov rank; None = ``code_dims``. A larger rank pads W1/W2 with zero
    # columns, e.g. to a multiple of a quantization group size so that the
    # sequential head can be quantized too.
    markov_rank: int | None = None
    sharpness: float = 1.5
    perturbation: float = 0.26
    seed: int = 0
    # Width of the token codes (and of the Markov rank); None = as wide as fits.
    code_size: int | None = None

    @property
    def code_dims(self) -> int:
        widest = min(self.hidden_size, self.num_kv_heads * self.head_dim) - 1
        if self.code_size is None:
            return widest
        if not 0 < self.code_size <= widest:
            raise ValueError(f"code_size must be in 1..{widest}, got {self.code_size}")
        return self.code_size

    @property
    def rank(self) -> int:
        if not self.markov_head_type:
            return 0
        return max(self.markov_rank or 0, self.code_dims)

    @property
    def mask_token_id(self) -> int:
        return self.vocab_size - 1

    @property
    def eos_token_id(self) -> int:
        return self.vocab_size - 2


def _codes(spec: PairSpec, rng: np.random.Generator) -> np.ndarray:
    m, v = spec.code_dims, spec.vocab_size
    if v <= m:
        return np.eye(v, m, dtype=np.float32)
    codes = rng.standard_normal((v, m)).astype(np.float32)
    return codes / np.linalg.norm(codes, axis=1, keepdims=True)


def _chain_map(spec: PairSpec, rng: np.random.Generator) -> np.ndarray:
    chain = spec.vocab_size - 2
    if spec.markov_head_type is None:
        return np.arange(chain)
    return rng.permutation(chain)


def target_config(spec: PairSpec) -> dict:
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": 32768,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": False,
        "eos_token_id": spec.eos_token_id,
    }


def drafter_config(spec: PairSpec) -> dict:
    config = target_config(spec)
    rank = spec.rank
    config.update(
        architectures=["Qwen3DSparkModel"],
        num_hidden_layers=spec.draft_layers,
        num_target_layers=spec.num_layers,
        block_size=spec.block_size,
        mask_token_id=spec.mask_token_id,
        target_layer_ids=sorted({0, max(spec.num_layers - 2, 0)}),
        num_anchors=512,
        markov_rank=rank,
        markov_head_type=spec.markov_head_type or "vanilla",
        enable_confidence_head=True,
        confidence_head_with_markov=bool(rank) and spec.confidence_with_markov,
    )
    return config


PERTURBED = ("o_proj.weight", "down_proj.weight")


def random_weights(module, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Float32 tensors for every parameter of ``module``: norms at one, the
    rest normal with variance 1 / fan-in."""
    weights = {}
    for name, value in tree_flatten(module.parameters()):
        if name.endswith("norm.weight"):
            weights[name] = np.ones(value.shape, np.float32)
        else:
            fan_in = value.shape[-1]
            weights[name] = rng.standard_normal(value.shape).astype(
                np.float32
            ) / np.sqrt(fan_in)
    return weights


def _target_weights(
    spec: PairSpec, codes: np.ndarray, chain: np.ndarray, rng, store=np.float32
) -> dict:
    d, m, v = spec.hidden_size, spec.code_dims, spec.vocab_size
    model = qwen3.Model(qwen3.ModelArgs.from_dict(target_config(spec)))
    weights = random_weights(model, rng)
    scale = spec.perturbation / np.sqrt(spec.num_layers)
    for name, value in weights.items():
        if not name.endswith("norm.weight"):
            if name.endswith(PERTURBED):
                value *= scale
            weights[name] = value.astype(store, copy=False)
    embed = np.zeros((v, d), np.float32)
    embed[:, :m] = codes
    embed[: v - 1, m] = 1.0
    weights["model.embed_tokens.weight"] = embed
    head = np.zeros((v, d), np.float32)
    head[chain, :m] = spec.sharpness * np.sqrt(d) / 4 * codes[: len(chain)]
    weights["lm_head.weight"] = head
    return weights


def _drafter_weights(
    spec: PairSpec, target: dict, codes: np.ndarray, chain: np.ndarray, rng
) -> dict:
    d, m, v = spec.hidden_size, spec.code_dims, spec.vocab_size
    config = DraftConfig.from_dict(drafter_config(spec))
    drafter = DSparkDrafter(config)
    weights = {}
    for name, value in tree_flatten(drafter.parameters()):
        if name.endswith("norm.weight"):
            weights[name] = np.ones(value.shape, np.float32)
        elif name.endswith(".bias"):
            weights[name] = np.zeros(value.shape, np.float32)
        else:
            weights[name] = 0.02 * rng.standard_normal(value.shape).astype(np.float32)
    hd, heads, kv = spec.head_dim, spec.num_heads, spec.num_kv_heads
    slow = hd // 2 - 1
    mask_code = codes[spec.mask_token_id]
    for i in range(spec.draft_layers):
        p = f"layers.{i}.self_attn."
        q = np.zeros((heads * hd, d), np.float32)
        k = np.zeros((kv * hd, d), np.float32)
        val = np.zeros((kv * hd, d), np.float32)
        o = np.zeros((d, heads * hd), np.float32)
        for h in range(heads):
            q[h * hd + slow, :m] = mask_code
        for g in range(kv):
            k[g * hd + slow, m] = 1.0
        val[np.arange(m), np.arange(m)] = 1.0
        group = heads // kv
        for h in range(heads):
            g = h // group
            for j in range(hd):
                if g * hd + j < m:
                    o[g * hd + j, h * hd + j] = 0.5 / group
        weights[p + "q_proj.weight"], weights[p + "k_proj.weight"] = q, k
        weights[p + "v_proj.weight"], weights[p + "o_proj.weight"] = val, o
        weights[p + "q_norm.weight"] = np.full(hd, 3.0, np.float32)
        weights[p + "k_norm.weight"] = np.full(hd, 3.0, np.float32)
    fc = weights["fc.weight"]
    fc[m] = 0.0
    if spec.markov_head_type:
        beta = 4.0 * spec.sharpness * np.sqrt(d)
        r = spec.rank
        w1 = np.zeros((v, r), np.float32)
        w1[:, :m] = codes
        weights["markov_head.markov_w1.weight"] = w1
        w2 = np.zeros((v, r), np.float32)
        w2[chain, :m] = beta * codes[: len(chain)]
        weights["markov_head.markov_w2.weight"] = w2
        if spec.markov_head_type == "gated":
            weights["markov_head.gate_proj.bias"] = np.full(r, 6.0, np.float32)
        if spec.markov_head_type == "rnn":
            joint = weights["markov_head.joint_proj.weight"]
            joint[2 * r :, r : 2 * r] = 8.0 * np.eye(r, dtype=np.float32)
            weights["markov_head.joint_proj.weight"] = joint
    conf = rng.standard_normal(weights["confidence_head.proj.weight"].shape)
    weights["confidence_head.proj.weight"] = (conf / np.sqrt(conf.size)).astype(
        np.float32
    ) * 4
    weights["confidence_head.proj.bias"] = np.array([1.0], np.float32)
    weights["embed_tokens.weight"] = target["model.embed_tokens.weight"]
    weights["lm_head.weight"] = target["lm_head.weight"]
    return weights


def _tokenizer_files(spec: PairSpec) -> dict[str, str]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(spec.vocab_size - 2)}
    vocab["</s>"] = spec.eos_token_id
    vocab["<mask>"] = spec.mask_token_id
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<mask>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "</s>",
        "unk_token": "<mask>",
        "model_max_length": 32768,
    }
    return {
        "tokenizer.json": tokenizer.to_str(),
        "tokenizer_config.json": json.dumps(config),
    }


def _save(directory: Path, config: dict, weights: dict, dtype: mx.Dtype) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    arrays = {k: mx.array(v).astype(dtype) for k, v in weights.items()}
    mx.save_safetensors(
        str(directory / "model.safetensors"), arrays, metadata={"format": "mlx"}
    )


def build_structured_pair(
    directory: str | Path, spec: PairSpec | None = None, dtype: mx.Dtype = mx.float32
) -> tuple[Path, Path]:
    """Write ``directory/target`` (an mlx-lm model) and ``directory/drafter``
    (a DeepSpec-format checkpoint); returns both paths."""
    spec = spec or PairSpec()
    rng = np.random.default_rng(spec.seed)
    codes = _codes(spec, rng)
    chain = _chain_map(spec, rng)
    # Big float16 pairs are stored as such from the start, to halve the memory.
    store = np.float16 if dtype == mx.float16 else np.float32
    target = _target_weights(spec, codes, chain, rng, store)
    drafter = _drafter_weights(spec, target, codes, chain, rng)
    directory = Path(directory)
    target_dir, drafter_dir = directory / "target", directory / "drafter"
    _save(target_dir, target_config(spec), target, dtype)
    for name, text in _tokenizer_files(spec).items():
        (target_dir / name).write_text(text)
    _save(drafter_dir, drafter_config(spec), drafter, dtype)
    return target_dir, drafter_dir


def rescale_perturbation(model, old: float, new: float) -> None:
    """Turn a loaded target built with perturbation ``old`` into one built with
    ``new``: the perturbation only scales the layers' output projections."""
    if old == new:
        return
    factor = new / old
    updates = [
        (name, value * factor)
        for name, value in tree_flatten(model.parameters())
        if name.endswith(PERTURBED)
    ]
    model.load_weights(updates, strict=False)
    mx.eval(model.parameters())


def cached_pair(
    name: str, spec: PairSpec, dtype: mx.Dtype = mx.float32
) -> tuple[Path, Path]:
    """Build a structured pair once into the user cache and return its paths."""
    final = cache_dir() / name
    if not final.exists():
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{name}-"))
        try:
            build_structured_pair(staging, spec, dtype)
            staging.rename(final)
        except FileExistsError:
            pass
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return final / "target", final / "drafter"


def demo_pair() -> tuple[Path, Path]:
    """The built-in demo pair, built into the user cache on first use."""
    return cached_pair(
        "demo-pair-v1", PairSpec(vocab_size=32, hidden_size=64, num_layers=4)
    )
