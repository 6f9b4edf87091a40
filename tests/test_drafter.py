"""The drafter against an independent numpy reading of the DSpark semantics."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlx_dspark.proposers.copying import CopyBias
from mlx_dspark.proposers.dspark import DSparkDrafter
from mlx_dspark.proposers.dspark_config import DraftConfig
from mlx_dspark.sampling.processing import SamplingParams, log_probs, normalised

D, V, LAYERS = 32, 40, 2


def random_drafter(head="vanilla", rank=8, confidence_with_markov=True, seed=0):
    config = DraftConfig.from_dict(
        {
            "architectures": ["Qwen3DSparkModel"],
            "hidden_size": D,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "intermediate_size": 48,
            "vocab_size": V,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-6,
            "block_size": 5,
            "mask_token_id": V - 1,
            "target_layer_ids": [0, 2],
            "markov_rank": rank,
            "markov_head_type": head,
            "enable_confidence_head": True,
            "confidence_head_with_markov": confidence_with_markov,
        }
    )
    drafter = DSparkDrafter(config)
    drafter.own_embeddings()
    randomize(drafter, np.random.default_rng(seed))
    return drafter


def randomize(drafter, rng):
    weights = []
    for name, value in tree_flatten(drafter.parameters()):
        noise = rng.standard_normal(value.shape).astype(np.float32)
        weights.append((name, 1.0 + 0.2 * noise if "norm" in name else 0.3 * noise))
    drafter.update(tree_unflatten([(k, mx.array(v)) for k, v in weights]))


def np_params(drafter):
    return {
        k: np.array(v, dtype=np.float64) for k, v in tree_flatten(drafter.parameters())
    }


def rms(x, w, eps=1e-6):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x, positions, base=10000.0):
    half = x.shape[-1] // 2
    freqs = base ** (-np.arange(half) * 2.0 / x.shape[-1])
    angles = positions[:, None] * freqs[None]
    cos, sin = np.cos(angles), np.sin(angles)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def reference_block(p, block_tokens, start, features):
    """Numpy forward of one block over all context features (positions 0..start-1)."""
    heads, kv, hd = 4, 2, 8
    x = p["embed_tokens.weight"][block_tokens]
    ctx = rms(features @ p["fc.weight"].T, p["hidden_norm.weight"])
    ctx_pos, blk_pos = (
        np.arange(features.shape[0]),
        np.arange(start, start + len(block_tokens)),
    )
    for i in range(LAYERS):
        a = f"layers.{i}.self_attn."
        xn = rms(x, p[f"layers.{i}.input_layernorm.weight"])
        q = rms(
            (xn @ p[a + "q_proj.weight"].T).reshape(-1, heads, hd),
            p[a + "q_norm.weight"],
        )
        q = np.stack([rope(q[:, h], blk_pos) for h in range(heads)], 1)

        def kv_of(h_in, pos, a=a):
            k = rms(
                (h_in @ p[a + "k_proj.weight"].T).reshape(-1, kv, hd),
                p[a + "k_norm.weight"],
            )
            k = np.stack([rope(k[:, g], pos) for g in range(kv)], 1)
            return k, (h_in @ p[a + "v_proj.weight"].T).reshape(-1, kv, hd)

        kc, vc = kv_of(ctx, ctx_pos)
        kb, vb = kv_of(xn, blk_pos)
        keys, values = np.concatenate([kc, kb]), np.concatenate([vc, vb])
        out = np.zeros((len(block_tokens), heads, hd))
        for h in range(heads):
            g = h // (heads // kv)
            scores = q[:, h] @ keys[:, g].T / np.sqrt(hd)
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            out[:, h] = weights @ values[:, g]
        x = x + out.reshape(len(block_tokens), -1) @ p[a + "o_proj.weight"].T
        m = f"layers.{i}.mlp."
        hn = rms(x, p[f"layers.{i}.post_attention_layernorm.weight"])
        gate = hn @ p[m + "gate_proj.weight"].T
        x = (
            x
            + ((gate / (1 + np.exp(-gate))) * (hn @ p[m + "up_proj.weight"].T))
            @ p[m + "down_proj.weight"].T
        )
    return rms(x, p["norm.weight"])


def test_backbone_matches_reference_and_cache_holds_only_committed_tokens():
    drafter = random_drafter()
    p = np_params(drafter)
    rng = np.random.default_rng(1)
    features = rng.standard_normal((11, 2 * D)).astype(np.float32)
    cache = drafter.make_cache()
    # Three rounds: commit 6, then 2, then 3 context tokens.
    for begin, end in [(0, 6), (6, 8), (8, 11)]:
        block = drafter.block_tokens(mx.array([int(rng.integers(0, V - 1))]))
        hidden = drafter(block, end, mx.array(features[None, begin:end]), cache)
        assert cache.length == end
        assert all(k.shape[2] == end for k in cache.keys)
        expected = reference_block(
            p, np.array(block[0]), end, features[:end].astype(np.float64)
        )
        assert np.allclose(np.array(hidden[0]), expected, atol=2e-4), np.abs(
            np.array(hidden[0]) - expected
        ).max()


def test_context_must_continue_the_cache():
    drafter = random_drafter()
    cache = drafter.make_cache()
    drafter(drafter.block_tokens(mx.array([1])), 3, mx.zeros((1, 3, 2 * D)), cache)
    with pytest.raises(ValueError, match="draft cache holds 3"):
        drafter(drafter.block_tokens(mx.array([1])), 6, mx.zeros((1, 2, 2 * D)), cache)


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn", None])
@pytest.mark.parametrize("with_markov", [True, False])
def test_sequential_head_and_confidence_match_the_formulas(head, with_markov):
    rank = 8 if head else 0
    drafter = random_drafter(head or "vanilla", rank, with_markov)
    p = np_params(drafter)
    rng = np.random.default_rng(2)
    hidden = mx.array(rng.standard_normal((1, 5, D)).astype(np.float32))
    anchor = 7
    proposal = drafter.propose(hidden, mx.array([anchor]), 4, SamplingParams(), None)
    h = np.array(hidden[0], dtype=np.float64)
    base = h @ p["lm_head.weight"].T
    prev, state, tokens = anchor, np.zeros(rank), []
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
        features = h[k]
        if head and with_markov:
            features = np.concatenate([h[k], p["markov_head.markov_w1.weight"][prev]])
        confidence = (
            p["confidence_head.proj.weight"][0] @ features
            + p["confidence_head.proj.bias"][0]
        )
        assert np.isclose(float(proposal.confidence[0, k]), confidence, atol=1e-3)
        prev = int(np.argmax(row))
        tokens.append(prev)
    assert np.array(proposal.tokens[0]).tolist() == tokens


# ------------------------------------------------------------ fast drafting


def reduced_drafter(head, seed=0):
    """A random drafter whose reduced draft vocabulary maps to target ids out
    of order, so that ties and id mapping are exercised."""
    drafter = random_drafter(head or "vanilla", rank=8 if head else 0, seed=seed)
    config = DraftConfig.from_dict({**drafter.config.to_dict(), "draft_vocab_size": 16})
    reduced = DSparkDrafter(config)
    reduced.own_embeddings()
    rng = np.random.default_rng(seed)
    randomize(reduced, rng)
    reduced.draft_to_target = mx.array(rng.permutation(V - 1)[:16].astype(np.int32))
    return reduced


def head_drafter(head, reduced, seed):
    """A random drafter with sequential ``head`` (None: none), its vocabulary
    the target's or a reduced one."""
    if reduced:
        return reduced_drafter(head, seed)
    return random_drafter(head or "vanilla", rank=8 if head else 0, seed=seed)


def two_blocks(drafter):
    """The backbone's hidden states of two requests' blocks, and their anchors."""
    anchor = mx.array([3, 11])
    block = mx.stack([drafter.block_tokens(anchor[i : i + 1])[0] for i in range(2)])
    return drafter(block, 0, None, drafter.make_cache()), anchor


def full_row_greedy(drafter, hidden, anchor, n):
    """Greedy drafts as argmax over full target-vocabulary rows."""
    base = drafter.logits(hidden[:, :n])
    head = drafter.markov_head
    if head is None:
        return mx.argmax(drafter.to_target(base), axis=-1), drafter.to_target(base)
    state, prev, tokens, rows = head.initial_state(anchor.shape), anchor, [], []
    for k in range(n):
        state, bias = head.step(state, prev, hidden[:, k])
        row = drafter.to_target(base[:, k] + bias)
        prev = mx.argmax(row, axis=-1)
        tokens.append(prev)
        rows.append(row)
    return mx.stack(tokens, axis=1), mx.stack(rows, axis=1)


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced"])
@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn", None])
def test_fast_greedy_drafts_equal_full_row_argmax(head, reduced):
    for seed in range(4):
        drafter = head_drafter(head, reduced, seed)
        hidden, anchor = two_blocks(drafter)
        proposal = drafter.propose(hidden, anchor, 5, SamplingParams(), None)
        tokens, rows = full_row_greedy(drafter, hidden, anchor, 5)
        assert np.array(proposal.tokens).tolist() == np.array(tokens).tolist()
        assert proposal.logits.shape == rows.shape
        assert np.allclose(np.array(proposal.logits), np.array(rows))
        no_confidence = drafter.propose(
            hidden, anchor, 5, SamplingParams(), None, confidence=False
        )
        assert no_confidence.confidence is None
        assert mx.array_equal(no_confidence.tokens, proposal.tokens)


@pytest.mark.parametrize("temperature", [0.0, 0.5])
@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced"])
@pytest.mark.parametrize("head", ["vanilla", "rnn", None])
def test_top_logprob_is_the_largest_log_probability_of_each_draft_row(
    head, reduced, temperature
):
    """The calibration's second input: max log-softmax of the rows the drafts
    were drawn from, greedy or sampled, whatever the temperature."""
    drafter = head_drafter(head, reduced, 0)
    hidden, anchor = two_blocks(drafter)
    params = SamplingParams(temperature=temperature)
    key = None if params.greedy else mx.random.key(0)
    proposal = drafter.propose(hidden, anchor, 5, params, key)
    # Sampled rows are the processed weights: at T=0.5 the logits times 2.
    rows = np.array(proposal.logits, dtype=np.float64) * (temperature or 1.0)
    top = -np.log(np.exp(rows - rows.max(-1, keepdims=True)).sum(-1))
    assert proposal.top_logprob.shape == (2, 5)
    assert np.allclose(np.array(proposal.top_logprob), top, atol=1e-5)
    assert np.all(np.array(proposal.top_logprob) <= 0.0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.2, top_p=0.7),
        SamplingParams(temperature=1.0, min_p=0.1, min_tokens_to_keep=20),
        SamplingParams(temperature=0.9, top_k=20),
        SamplingParams(temperature=0.8, top_k=3),
        SamplingParams(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.02),
        SamplingParams(
            temperature=1.0,
            xtc_probability=1.0,
            xtc_threshold=0.02,
            xtc_special_tokens=(0, 1, 2, 3, 4, 5),
        ),
    ],
    ids=["temp", "top-p", "min-p-keep", "top-k-wide", "top-k", "xtc", "xtc-special"],
)
@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced"])
def test_sampled_rows_are_the_processed_distribution_of_the_drafts_logits(
    params, reduced
):
    """A reduced drafter processes its short rows; what it draws from is the
    distribution processing the full target-vocabulary rows gives (XTC's
    special tokens inside and outside the draft vocabulary, a top-k and a
    min-p keep wider than it)."""
    drafter = head_drafter(None, reduced, 3)
    hidden, anchor = two_blocks(drafter)
    proposal = drafter.propose(hidden, anchor, 4, params, mx.random.key(0))
    full = drafter.to_target(drafter.logits(hidden[:, :4]))
    expected = np.exp(np.array(log_probs(full, params), dtype=np.float64))
    assert np.allclose(normalised(proposal.logits), expected, atol=1e-6)
    if reduced:
        ids = set(np.array(drafter.draft_to_target).tolist())
        assert ids & {0, 1, 2, 3, 4, 5} and {0, 1, 2, 3, 4, 5} - ids


@pytest.mark.parametrize("reduced", [False, True], ids=["full-vocab", "reduced"])
@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_compiled_and_plain_greedy_chains_give_identical_drafts(head, reduced):
    """With and without copying, at copy biases changed after compiling."""
    drafter = head_drafter(head, reduced, 1)
    hidden, anchor = two_blocks(drafter)
    ids = np.array(drafter.draft_ids())
    copy = mx.array(ids[[[3, 5, 7, 9, 11], [2, 2, 4, 4, 6]]])
    outputs = {}
    for compiled in (False, True):
        drafter.compile_greedy_chain(compiled)
        for bias in (None, 0.0, 2.0, 1e3):
            for n in (5, 2, 5, 1):
                for rows in (slice(0, 2), slice(1, 2)):
                    toward = None
                    if bias is not None:
                        toward = CopyBias(copy[rows], mx.array(bias, mx.float32))
                    outputs[compiled, bias, n, rows.start] = drafter.propose(
                        hidden[rows], anchor[rows], n, SamplingParams(), None,
                        bias=toward,
                    )  # fmt: skip
    assert drafter._compiled_chain is not None
    for (_, bias, n, start), proposal in outputs.items():
        plain = outputs[False, bias, n, start]
        assert proposal.tokens.shape == (2 - start, n)
        assert mx.array_equal(proposal.tokens, plain.tokens)
        assert mx.array_equal(proposal.logits, plain.logits)
    followed = outputs[True, 1e3, 5, 0].tokens
    assert mx.array_equal(followed, copy)
    assert not mx.array_equal(outputs[True, 0.0, 5, 0].tokens, followed)
    assert mx.array_equal(
        outputs[True, 0.0, 5, 0].tokens, outputs[True, None, 5, 0].tokens
    )


def test_loaded_drafters_run_the_compiled_chain(pair_factory):
    from mlx_dspark.checkpoints.loading import load_drafter

    model, _, _, _, drafter_dir, _ = pair_factory(block_size=6)
    drafter = load_drafter(drafter_dir, model)
    assert drafter._compiled_chain is not None
    anchor = mx.array([4])
    hidden = drafter(drafter.block_tokens(anchor), 0, None, drafter.make_cache())
    outputs = []
    for update in (False, True):
        if update:  # new weights after the first trace reach the compiled graph
            randomize(drafter.markov_head, np.random.default_rng(5))
        compiled = drafter.propose(hidden, anchor, 6, SamplingParams(), None)
        chain, drafter._compiled_chain = drafter._compiled_chain, None
        plain = drafter.propose(hidden, anchor, 6, SamplingParams(), None)
        drafter._compiled_chain = chain
        assert mx.array_equal(compiled.tokens, plain.tokens)
        assert mx.array_equal(compiled.logits, plain.logits)
        outputs.append(plain.tokens)
    assert not mx.array_equal(*outputs)


def test_draft_ids_to_target_breaks_ties_like_argmax_over_full_rows():
    drafter = reduced_drafter("vanilla")
    table = np.array(drafter.draft_to_target)
    rows = np.zeros((3, 16), dtype=np.float32)
    rows[0, [2, 9, 14]] = 5.0  # a three-way tie
    rows[1] = -1.0  # every draft id ties
    rows[2, 7] = 1.0
    rows = mx.array(rows)
    expected = mx.argmax(drafter.to_target(rows), axis=-1)
    assert mx.array_equal(drafter.draft_ids_to_target(rows), expected)
    assert int(drafter.draft_ids_to_target(rows)[0]) == min(table[[2, 9, 14]])


def test_fast_greedy_drafts_on_a_structured_pair(pair_factory):
    model, _, drafter, *_ = pair_factory(block_size=6)
    anchor = mx.array([4])
    hidden = drafter(drafter.block_tokens(anchor), 0, None, drafter.make_cache())
    proposal = drafter.propose(hidden, anchor, 6, SamplingParams(), None)
    tokens, _ = full_row_greedy(drafter, hidden, anchor, 6)
    assert np.array(proposal.tokens).tolist() == np.array(tokens).tolist()


def test_quantized_checkpoint_is_dequantized_on_cpu_with_the_same_drafts(
    pair_factory,
):
    import mlx.nn as nn

    from mlx_dspark.checkpoints.loading import build_drafter
    from mlx_dspark.checkpoints.weights import read_config, read_weights
    from mlx_dspark.targets.adapter import TargetAdapter

    model, _, _, _, drafter_dir, _ = pair_factory(block_size=6)
    config = DraftConfig.from_dict(read_config(drafter_dir))
    target = TargetAdapter(model, config.target_layer_ids)

    def quantizable(path, module):
        return isinstance(module, nn.Linear) and module.weight.shape[-1] % 64 == 0

    reference = build_drafter(config, read_weights(drafter_dir), target)
    nn.quantize(reference, group_size=64, bits=4, class_predicate=quantizable)
    quantized = {k: v for k, v in tree_flatten(reference.parameters())}
    assert any(k.endswith(".scales") for k in quantized)
    q_config = DraftConfig.from_dict(
        {**read_config(drafter_dir), "quantization": {"group_size": 64, "bits": 4}}
    )
    loaded = build_drafter(q_config, dict(quantized), target)
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    assert not any(isinstance(m, kinds) for _, m in loaded.named_modules())
    anchor = mx.array([4])
    outputs = []
    for drafter in (reference, loaded):
        hidden = drafter(drafter.block_tokens(anchor), 0, None, drafter.make_cache())
        outputs.append(drafter.propose(hidden, anchor, 6, SamplingParams(), None))
    assert mx.array_equal(outputs[0].tokens, outputs[1].tokens)
    assert np.allclose(
        np.array(outputs[0].logits), np.array(outputs[1].logits), rtol=1e-4, atol=1e-4
    )
