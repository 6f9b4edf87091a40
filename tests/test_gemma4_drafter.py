"""DeepSpec's Gemma-4 DSpark drafter (``Gemma4DSparkModel``) against an
independent numpy reading of its equations, loaded from a DeepSpec-format
checkpoint and run on a tiny Gemma-4 target with every sequential head."""

import itertools
import json
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from conftest import HEADS, head_id
from mlx.utils import tree_flatten
from test_drafter import np_params, randomize, rms, sigmoid
from test_gemma4 import (
    SAMPLING_PROMPT,
    SEEDS,
    VOCAB,
    exact_joint,
    plain_greedy,
    text_config,
    tiny_gemma4,
)
from test_sampling import chi_square, chi_square_critical

from mlx_dspark import load, stream_generate
from mlx_dspark.checkpoints.loading import load_drafter
from mlx_dspark.decoding.loop import GenerationStats, speculative_generate_step
from mlx_dspark.errors import DSparkError
from mlx_dspark.pairs.structured import PairSpec, _tokenizer_files
from mlx_dspark.proposers.copying import pair_proposer
from mlx_dspark.proposers.dspark import DSparkDrafter
from mlx_dspark.proposers.dspark_config import DraftConfig
from mlx_dspark.sampling.processing import SamplingParams
from mlx_dspark.targets.adapter import TargetAdapter

D, HEADS_Q, HEAD_DIM, LAYERS, CAP = 32, 4, 16, 2, 5.0
ROTATED = 0.25  # partial rotary factor of Gemma-4's full attention


def gemma_config(head="vanilla", k_eq_v=False, vocab=40, layers=LAYERS, **extra):
    config = {
        "architectures": ["Gemma4DSparkModel"],
        "model_type": "gemma4_text",
        "hidden_size": D,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS_Q,
        "num_key_value_heads": 2,
        "num_global_key_value_heads": 1,
        "head_dim": 8,
        "global_head_dim": HEAD_DIM,
        "attention_k_eq_v": k_eq_v,
        "intermediate_size": 48,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": CAP,
        "rope_parameters": {
            "full_attention": {
                "partial_rotary_factor": ROTATED,
                "rope_theta": 10000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
        "enable_moe_block": False,
        "hidden_size_per_layer_input": 0,
        "num_kv_shared_layers": 0,
        "use_double_wide_mlp": False,
        "tie_word_embeddings": False,
        "block_size": 5,
        "mask_token_id": vocab - 1,
        "target_layer_ids": [0, 2],
        "num_target_layers": 6,
        "markov_rank": 8 if head else 0,
        "markov_head_type": head,
        "enable_confidence_head": True,
        "confidence_head_with_markov": bool(head),
    }
    config.update(extra)
    return config


def gemma_drafter(seed=0, **kwargs):
    drafter = DSparkDrafter(DraftConfig.from_dict(gemma_config(**kwargs)))
    drafter.own_embeddings()
    randomize(drafter, np.random.default_rng(seed))
    return drafter


def rope(x, positions):
    """Gemma-4 full-attention RoPE: only the first ``ROTATED`` of the
    frequency pairs turn; the rotation pairs dimension i with i + dim/2."""
    dim = x.shape[-1]
    turned = int(dim * ROTATED) // 2
    inv = np.zeros(dim // 2)
    inv[:turned] = 10000.0 ** (-np.arange(turned) * 2.0 / dim)
    angles = positions[:, None] * inv[None]
    cos, sin = np.cos(angles), np.sin(angles)
    a, b = x[..., : dim // 2], x[..., dim // 2 :]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def reference_block(p, block_tokens, start, features, k_eq_v):
    """Numpy forward of DeepSpec's Gemma-4 draft backbone for one block."""
    kv = 1 if k_eq_v else 2
    x = p["embed_tokens.weight"][block_tokens] * np.sqrt(D)
    ctx = rms(features @ p["fc.weight"].T, p["hidden_norm.weight"])
    ctx_pos = np.arange(features.shape[0])
    blk_pos = np.arange(start, start + len(block_tokens))
    for i in range(LAYERS):
        a = f"layers.{i}.self_attn."
        xn = rms(x, p[f"layers.{i}.input_layernorm.weight"])
        q = rms(
            (xn @ p[a + "q_proj.weight"].T).reshape(-1, HEADS_Q, HEAD_DIM),
            p[a + "q_norm.weight"],
        )
        q = np.stack([rope(q[:, h], blk_pos) for h in range(HEADS_Q)], 1)

        def kv_of(h_in, pos, a=a):
            k = (h_in @ p[a + "k_proj.weight"].T).reshape(-1, kv, HEAD_DIM)
            v = k if k_eq_v else (h_in @ p[a + "v_proj.weight"].T).reshape(k.shape)
            k = rms(k, p[a + "k_norm.weight"])
            k = np.stack([rope(k[:, g], pos) for g in range(kv)], 1)
            return k, rms(v, 1.0)

        kc, vc = kv_of(ctx, ctx_pos)
        kb, vb = kv_of(xn, blk_pos)
        keys, values = np.concatenate([kc, kb]), np.concatenate([vc, vb])
        out = np.zeros((len(block_tokens), HEADS_Q, HEAD_DIM))
        for h in range(HEADS_Q):
            g = h // (HEADS_Q // kv)
            scores = q[:, h] @ keys[:, g].T  # attention scale 1
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            out[:, h] = weights @ values[:, g]
        attn = out.reshape(len(block_tokens), -1) @ p[a + "o_proj.weight"].T
        x = x + rms(attn, p[f"layers.{i}.post_attention_layernorm.weight"])
        m = f"layers.{i}.mlp."
        hn = rms(x, p[f"layers.{i}.pre_feedforward_layernorm.weight"])
        mlp = (
            gelu_tanh(hn @ p[m + "gate_proj.weight"].T)
            * (hn @ p[m + "up_proj.weight"].T)
        ) @ p[m + "down_proj.weight"].T
        x = x + rms(mlp, p[f"layers.{i}.post_feedforward_layernorm.weight"])
        x = x * p[f"layers.{i}.layer_scalar"]
    return rms(x, p["norm.weight"])


@pytest.mark.parametrize("k_eq_v", [False, True], ids=["k_v", "k_eq_v"])
def test_backbone_matches_reference(k_eq_v):
    drafter = gemma_drafter(k_eq_v=k_eq_v)
    assert ("v_proj" in drafter.layers[0].self_attn) != k_eq_v
    p = np_params(drafter)
    rng = np.random.default_rng(1)
    features = rng.standard_normal((9, 2 * D)).astype(np.float32)
    cache = drafter.make_cache()
    for begin, end in [(0, 6), (6, 9)]:
        block = drafter.block_tokens(mx.array([int(rng.integers(0, 39))]))
        hidden = drafter(block, end, mx.array(features[None, begin:end]), cache)
        expected = reference_block(
            p, np.array(block[0]), end, features[:end].astype(np.float64), k_eq_v
        )
        error = np.abs(np.array(hidden[0]) - expected).max()
        assert error < 2e-4, error


@pytest.mark.parametrize("head", HEADS, ids=head_id)
def test_draft_logits_are_soft_capped_before_the_sequential_head(head):
    drafter = gemma_drafter(head=head or "vanilla", markov_rank=8 if head else 0)
    p = np_params(drafter)
    rng = np.random.default_rng(2)
    hidden = mx.array(3 * rng.standard_normal((1, 5, D)).astype(np.float32))
    anchor = 7
    proposal = drafter.propose(hidden, mx.array([anchor]), 4, SamplingParams(), None)
    h = np.array(hidden[0], dtype=np.float64)
    base = np.tanh(h @ p["lm_head.weight"].T / CAP) * CAP
    prev, state = anchor, np.zeros(8)
    for k in range(4):
        bias = 0.0
        if head:
            w1, w2 = (
                p["markov_head.markov_w1.weight"],
                p["markov_head.markov_w2.weight"],
            )
            e = w1[prev]
            if head == "vanilla":
                bias = w2 @ e
            elif head == "gated":
                gate = sigmoid(
                    p["markov_head.gate_proj.weight"] @ np.concatenate([h[k], e])
                    + p["markov_head.gate_proj.bias"]
                )
                bias = w2 @ (gate * e)
            else:
                joint = (
                    p["markov_head.joint_proj.weight"]
                    @ np.concatenate([state, e, h[k]])
                    + p["markov_head.joint_proj.bias"]
                )
                g, c, o = np.split(joint, 3)
                g = sigmoid(g)
                state = g * state + (1 - g) * np.tanh(c)
                bias = w2 @ np.tanh(o)
        row = base[k] + bias
        assert np.allclose(np.array(proposal.logits[0, k]), row, atol=1e-3)
        prev = int(np.argmax(row))
        assert int(proposal.tokens[0, k]) == prev


def write_checkpoint(directory, config, drafter):
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    weights = dict(tree_flatten(drafter.parameters()))
    # DeepSpec's layer_scalar buffers may be absent from a checkpoint.
    weights.pop("layers.0.layer_scalar")
    mx.save_safetensors(str(directory / "model.safetensors"), weights)


@pytest.mark.parametrize("head", HEADS, ids=head_id)
def test_checkpoint_loads_and_runs_on_a_gemma4_target(tmp_path, head):
    model = tiny_gemma4(tie_word_embeddings=True)
    target = TargetAdapter(model, [0, 2])
    config = gemma_config(
        head=head,
        vocab=VOCAB,
        global_head_dim=16,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
    )
    source = DSparkDrafter(DraftConfig.from_dict(config))
    source.own_embeddings()
    randomize(source, np.random.default_rng(3))
    # DeepSpec copies the target's embedding and head into the checkpoint.
    table = target.inner.embed_tokens.weight
    source.embed_tokens.weight = table
    source.lm_head.weight = table
    write_checkpoint(tmp_path / "drafter", config, source)
    drafter = load_drafter(tmp_path / "drafter", model)
    assert drafter.shares_embeddings
    tokens = mx.array([[1, 2, 3, VOCAB - 1]])
    assert mx.allclose(
        drafter.embed(tokens), target.embed(tokens) * np.sqrt(D), atol=1e-5
    ).item()
    hidden = mx.array(np.random.default_rng(4).standard_normal((1, 3, D)), mx.float32)
    assert mx.allclose(drafter.logits(hidden), target.lm_head(hidden)).item()
    prompt = [5, 7, 1, 2, 9, 3, 4, 0, 2]
    expected = plain_greedy(model, prompt, 24)
    runs = [(SamplingParams(), n) for n in (1, 2, 4)]
    for params, num_draft in [*runs, (SamplingParams(temperature=1.0), 4)]:
        stats = GenerationStats()
        tokens = [
            t
            for t, _ in speculative_generate_step(
                mx.array(prompt),
                target,
                pair_proposer(drafter),
                params=params,
                num_draft=num_draft,
                max_tokens=24,
                seed=0,
                stats=stats,
            )
        ]
        assert len(tokens) == 24
        if params.greedy:
            assert tokens == expected
    assert stats.rounds


def test_gemma4_drafter_without_its_fields_is_refused():
    config = gemma_config()
    del config["global_head_dim"]
    with pytest.raises(DSparkError, match="Gemma4DSparkModel config is missing"):
        DraftConfig.from_dict(config)
    with pytest.raises(DSparkError, match="per-layer inputs"):
        DraftConfig.from_dict(gemma_config(hidden_size_per_layer_input=4))


@pytest.mark.parametrize("bits", [4, 8])
def test_convert_quantizes_a_gemma4_drafter(tmp_path, bits):
    from mlx_dspark.convert.__main__ import main as convert_main

    model = tiny_gemma4(tie_word_embeddings=True)
    target = TargetAdapter(model, [0, 2])
    config = gemma_config(
        head="gated", vocab=VOCAB, intermediate_size=64, attention_k_eq_v=True
    )
    source = DSparkDrafter(DraftConfig.from_dict(config))
    source.own_embeddings()
    randomize(source, np.random.default_rng(5))
    table = target.inner.embed_tokens.weight
    source.embed_tokens.weight = table
    source.lm_head.weight = table
    write_checkpoint(tmp_path / "drafter", config, source)
    out = tmp_path / f"q{bits}"
    convert_main(
        ["--draft-model", str(tmp_path / "drafter"), "--out", str(out), "-q"]
        + ["--q-bits", str(bits), "--q-group-size", "32"]
    )
    written = json.loads((out / "config.json").read_text())
    assert written["quantization"]["bits"] == bits
    assert written["architectures"] == ["Gemma4DSparkModel"]
    features = mx.array(np.random.default_rng(0).standard_normal((1, 6, 2 * D)))
    logits = []
    for path in (tmp_path / "drafter", out):
        drafter = load_drafter(path, model)
        block = drafter.block_tokens(mx.array([3]))
        hidden = drafter(block, 6, features.astype(mx.float32), drafter.make_cache())
        logits.append(drafter.logits(hidden))
    error = mx.abs(logits[0] - logits[1]).max().item()
    assert 0 < error < (0.1 if bits == 8 else 1.0), error
    # Exported back to a DeepSpec checkpoint (dequantized), it drafts the same.
    back = tmp_path / "back"
    convert_main(["--draft-model", str(out), "--out", str(back), "--to", "deepspec"])
    assert json.loads((back / "config.json").read_text())["architectures"] == [
        "Gemma4DSparkModel"
    ]
    drafter = load_drafter(back, model)
    hidden = drafter(block, 6, features.astype(mx.float32), drafter.make_cache())
    assert mx.allclose(drafter.logits(hidden), logits[1], atol=1e-2).item()


def test_load_and_generate_from_directories(tmp_path):
    """A saved multimodal-wrapper Gemma-4 target and a DeepSpec Gemma-4
    drafter load with ``load`` (self-check included) and generate mlx-lm's
    greedy output."""
    model = tiny_gemma4(seed=13, wrapper=True)
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    config = {"model_type": "gemma4", "text_config": text_config(), "vocab_size": VOCAB}
    (target_dir / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(
        str(target_dir / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    for name, text in _tokenizer_files(PairSpec(vocab_size=VOCAB)).items():
        (target_dir / name).write_text(text)
    target = TargetAdapter(model, [0, 2])
    draft_config = gemma_config(head="rnn", vocab=VOCAB)
    source = DSparkDrafter(DraftConfig.from_dict(draft_config))
    source.own_embeddings()
    randomize(source, np.random.default_rng(7))
    source.embed_tokens.weight = target.inner.embed_tokens.weight
    source.lm_head.weight = target.text.lm_head.weight
    write_checkpoint(tmp_path / "drafter", draft_config, source)

    loaded, tokenizer, drafter = load(target_dir, tmp_path / "drafter")
    assert drafter.shares_embeddings
    prompt = [5, 7, 1, 2, 9, 3, 4, 0, 2]
    expected = plain_greedy(loaded, prompt, 20)
    eos = tokenizer.eos_token_ids
    expected = expected[: next((i for i, t in enumerate(expected) if t in eos), 20)]
    tokens = [
        r.token
        for r in stream_generate(
            loaded, tokenizer, drafter, prompt, max_tokens=20, scheduler="threshold"
        )
    ]
    assert len(expected) >= 8, expected
    assert tokens[: len(expected)] == expected


def test_sampling_is_exact_with_a_gemma4_drafter():
    """Rejection sampling against the soft-capped draft distribution of a
    Gemma-4 drafter with its own head keeps the target's distribution."""
    model = tiny_gemma4(seed=4)
    target = TargetAdapter(model, [0, 2])
    drafter = gemma_drafter(seed=8, head="gated", vocab=VOCAB, block_size=4)
    params = SamplingParams(temperature=1.0)
    joint = exact_joint(model, params)
    samples, stats = Counter(), GenerationStats()
    for seed in range(SEEDS):
        tokens = speculative_generate_step(
            mx.array(SAMPLING_PROMPT),
            target,
            pair_proposer(drafter),
            num_draft=drafter.block_size,
            params=params,
            max_tokens=3,
            seed=seed,
            stats=stats,
        )
        samples[tuple(t for t, _ in itertools.islice(tokens, 3))] += 1
    stat, dof = chi_square(samples, joint, SEEDS)
    assert dof >= 5
    assert stat < chi_square_critical(dof), (stat, dof)
    assert any(r.accepted > 0 for r in stats.rounds)
    assert any(r.accepted < r.verified for r in stats.rounds)
