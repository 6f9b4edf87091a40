"""mlx_dspark.train on Gemma-4 targets: the Gemma-4 DSpark drafter it writes
(DeepSpec's ``Gemma4DSparkModel`` layout), a training forward equal to the
inference forward, learning, and lossless decoding with the written drafter."""

import json
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import HEADS, head_id
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler
from test_drafter import randomize
from test_gemma4 import VOCAB, WINDOW, plain_greedy, text_config, tiny_gemma4
from test_train import _reference_hidden as reference_hidden

from mlx_dspark import load, stream_generate
from mlx_dspark.checkpoints.loading import load_drafter
from mlx_dspark.decoding.loop import GenerationStats, speculative_generate_step
from mlx_dspark.pairs.structured import PairSpec, _tokenizer_files
from mlx_dspark.proposers.copying import pair_proposer
from mlx_dspark.sampling.processing import SamplingParams
from mlx_dspark.targets.adapter import TargetAdapter
from mlx_dspark.training.loss import draft_logits
from mlx_dspark.training.model import drafter_config, new_drafter, training_hidden
from mlx_dspark.training.run import TrainArgs, train

TAPS = [0, 3]
PROMPTS = [[1, 2, 3], [5, 7, 1, 2, 9, 3, 4, 0, 2, 11, 6]]
# What DeepSpec's Gemma-4 drafter asserts on its config (text fields and its
# own), besides the common DSpark keys.
DEEPSPEC_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_global_key_value_heads", "global_head_dim",
    "attention_bias", "attention_dropout", "attention_k_eq_v", "enable_moe_block",
    "head_dim", "hidden_activation", "hidden_size_per_layer_input",
    "initializer_range", "max_position_embeddings", "num_key_value_heads",
    "num_kv_shared_layers", "rms_norm_eps", "rope_parameters", "use_double_wide_mlp",
    "target_layer_ids", "mask_token_id", "num_anchors", "enable_confidence_head",
    "markov_rank", "block_size", "final_logit_softcapping",
)  # fmt: skip

TARGETS = {
    "gemma4_text": ({}, False),
    "gemma4": ({}, True),
    "k_eq_v": ({"attention_k_eq_v": True, "num_global_key_value_heads": 2}, False),
}
K_EQ_V = TARGETS["k_eq_v"][0]
# Only trained on, not in the forward-parity matrix.
TRAINED = {**TARGETS, "gemma4_k_eq_v": (K_EQ_V, True)}


def target_config(name: str) -> dict:
    overrides, wrapper = TRAINED[name]
    text = text_config(**overrides)
    if wrapper:
        return {"model_type": "gemma4", "text_config": text, "vocab_size": VOCAB}
    return text


def tiny_target(name: str, seed: int = 0):
    overrides, wrapper = TRAINED[name]
    return tiny_gemma4(seed=seed, wrapper=wrapper, **overrides)


def gemma_drafter(name, head="vanilla", draft_vocab=None, layers=2, seed=0):
    model = tiny_target(name)
    target = TargetAdapter(model, TAPS)
    config = drafter_config(
        target_config(name), target, layers=layers, block_size=5,
        markov_head=head or "none", markov_rank=8, anchors=4, confidence=True,
        mask_token_id=VOCAB - 1, draft_vocab_size=draft_vocab,
    )  # fmt: skip
    ids = None if draft_vocab is None else np.arange(0, 2 * draft_vocab, 2)
    drafter = new_drafter(config, target, seed=3, draft_ids=ids)
    return model, target, drafter


def test_drafter_config_is_deepspecs_gemma4_layout():
    _, target, drafter = gemma_drafter("k_eq_v")
    config = drafter.config.to_dict()
    assert config["architectures"] == ["Gemma4DSparkModel"]
    missing = [k for k in DEEPSPEC_FIELDS if k not in config]
    assert not missing, missing
    assert config["layer_types"] == ["full_attention"] * 2
    assert config["num_hidden_layers"] == 2 and config["num_target_layers"] == 6
    assert config["enable_moe_block"] is False
    assert config["hidden_size_per_layer_input"] == 0
    assert config["attention_k_eq_v"] is True and config["global_head_dim"] == 16
    assert config["final_logit_softcapping"] == 4.0
    assert config["rope_parameters"]["full_attention"]["rope_type"] == "proportional"
    assert "v_proj" not in drafter.layers[0].self_attn
    # DeepSpec's layer_scalar is a buffer: kept, never trained.
    names = {k for k, _ in tree_flatten(drafter.trainable_parameters())}
    assert "layers.0.layer_scalar" not in names
    assert "layers.0.layer_scalar" in dict(tree_flatten(drafter.parameters()))
    json.dumps(config)
    # The multimodal wrapper's text config is the drafter's.
    _, _, wrapped = gemma_drafter("gemma4")
    assert wrapped.config.is_gemma4
    assert wrapped.config.to_dict()["target_model_type"] == "gemma4"


@pytest.mark.parametrize("name", TARGETS)
@pytest.mark.parametrize("head", HEADS, ids=head_id)
def test_training_forward_equals_inference_forward(name, head):
    """Hidden states and (soft-capped, sequential-head) logits of the
    training forward equal the inference drafter's with a fresh cache, block
    by block, for contexts longer than the target's window."""
    draft_vocab = 6 if head == "gated" else None
    _, target, drafter = gemma_drafter(name, head, draft_vocab)
    # Non-trivial norms and layer scalars, so that every term shows.
    randomize(drafter, np.random.default_rng(1))
    if draft_vocab:
        drafter.draft_to_target = mx.arange(0, 2 * draft_vocab, 2)
    tokens = mx.array([[3, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10, 12, 1, 0], [1] * 14])
    _, features = target.hidden(tokens, target.make_cache())
    anchors = mx.array([[0, 1, 7, 12], [2, 3, 9, 13]])
    blocks = mx.stack(
        [drafter.block_tokens(mx.take(tokens[n], anchors[n])) for n in range(2)]
    )
    hidden = training_hidden(drafter, features, anchors, blocks)
    for n in range(2):
        for a, anchor in enumerate(anchors[n].tolist()):
            context = features[n : n + 1, :anchor] if anchor else None
            block = blocks[n : n + 1, a]
            expected = drafter(block, anchor, context, drafter.make_cache())
            got = hidden[n * 4 + a : n * 4 + a + 1]
            assert mx.allclose(got, expected, atol=1e-4).item(), (n, anchor)
            proposal = drafter.propose(expected, block[:, 0], 5, SamplingParams(), None)
            prev = mx.concatenate([block[:, :1], proposal.tokens[:, :-1]], axis=1)
            logits = draft_logits(drafter, got, prev)
            want = proposal.logits
            if draft_vocab:
                want = mx.take(want, drafter.draft_to_target, axis=-1)
            assert mx.allclose(logits, want, atol=1e-4).item(), (n, anchor)
            # Soft-capped: the target's cap bounds the base logits.
            assert mx.abs(drafter.logits(got)).max().item() <= 4.0 + 1e-5


@pytest.mark.parametrize("name", ["gemma4_text", "k_eq_v"])
def test_shared_context_gradients_equal_the_straightforward_ones(name):
    """The Gemma-4 training forward (context K/V shared through the mask)
    gives the values and gradients of per-block copies of the context run
    through the inference layers; the frozen layer scalars get none."""
    _, target, drafter = gemma_drafter(name, "rnn")
    randomize(drafter, np.random.default_rng(2))
    tokens = mx.array([[3, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10, 12], [1] * 12])
    _, features = target.hidden(tokens, target.make_cache())
    anchors = mx.array([[0, 1, 4, 10], [2, 3, 5, 6]])
    blocks = mx.stack(
        [drafter.block_tokens(mx.take(tokens[n], anchors[n])) for n in range(2)]
    )
    weights = mx.random.normal((8, 5, 32), key=mx.random.key(0))

    def objective(forward):
        def f(model, feats):
            return (forward(model, feats, anchors, blocks) * weights).sum()

        return nn.value_and_grad(drafter, f)

    fast, fast_grads = objective(training_hidden)(drafter, features)
    slow, slow_grads = objective(reference_hidden)(drafter, features)
    assert mx.allclose(fast, slow, rtol=1e-5, atol=1e-4), (fast, slow)
    fast_grads, slow_grads = (
        dict(tree_flatten(fast_grads)),
        dict(tree_flatten(slow_grads)),
    )
    assert fast_grads.keys() == slow_grads.keys() and len(fast_grads) > 10
    assert not any("layer_scalar" in k for k in fast_grads)
    for key, grad in fast_grads.items():
        scale = mx.maximum(mx.abs(grad).max(), 1e-3)
        error = mx.abs(grad - slow_grads[key]).max() / scale
        assert error.item() < 1e-4, (key, error)


def test_init_from_target_copies_the_top_layers():
    """Draft layer i starts from target layer L - n + i wherever shapes
    match. Four draft layers over six target layers (sliding, sliding, full,
    repeated; the last two KV-shared): draft 0 <- target 2 (full attention,
    its own K/V: everything matches), draft 1 <- target 3 (sliding window:
    narrower heads, so only the MLP and norms match), drafts 2, 3 <- targets
    4, 5 (KV-shared, no K/V; double-wide MLPs, as DeepSpec's drafter has them
    in its last ``num_kv_shared_layers`` layers)."""
    model = tiny_target("gemma4_text", seed=5)
    target = TargetAdapter(model, TAPS)
    config = drafter_config(
        target_config("gemma4_text"), target, layers=4, block_size=5,
        markov_head="vanilla", markov_rank=8, anchors=4, confidence=True,
        mask_token_id=VOCAB - 1,
    )  # fmt: skip
    copied = new_drafter(config, target, 0, init_from_target=True).layers
    fresh = new_drafter(config, target, 0).layers
    mlp = ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    parts = {
        0: ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
            "self_attn.o_proj", *mlp],
        1: mlp,
        2: mlp,
        3: ["self_attn.q_proj", "self_attn.o_proj", *mlp],
    }  # fmt: skip
    kept = {
        1: ["self_attn.q_proj", "self_attn.k_proj"],
        2: ["self_attn.q_proj", "self_attn.k_proj"],
        3: ["self_attn.k_proj", "self_attn.v_proj"],
    }

    def weight(root, name):
        for part in name.split("."):
            root = getattr(root, part)
        return root.weight

    for i in range(4):
        top = model.layers[2 + i]
        for name in parts[i]:
            mine = weight(copied[i], name)
            assert mx.array_equal(mine, weight(top, name)), (i, name)
            assert not mx.array_equal(mine, weight(fresh[i], name)), (i, name)
        for name in kept.get(i, []):
            assert mx.array_equal(weight(copied[i], name), weight(fresh[i], name))
        for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            assert mx.array_equal(weight(copied[i], name), weight(top, name))
        assert mx.array_equal(copied[i].layer_scalar, mx.ones((1,))).item()
    assert [layer.mlp.down_proj.weight.shape[-1] for layer in copied] == [
        64,
        64,
        128,
        128,
    ]


# ------------------------------------------------------------------ train runs


def save_target(directory, name: str, seed: int):
    model = tiny_target(name, seed)
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(target_config(name)))
    mx.save_safetensors(
        str(directory / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    for file, text in _tokenizer_files(PairSpec(vocab_size=VOCAB)).items():
        (directory / file).write_text(text)
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Tiny Gemma-4 targets on disk (text model; multimodal wrapper with
    K = V) and training sequences sampled from the text model (several
    windows long)."""
    root = tmp_path_factory.mktemp("gemma_train")
    model = save_target(root / "target", "gemma4_text", seed=0)
    save_target(root / "wrapped", "gemma4_k_eq_v", seed=0)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(24):
        prompt = rng.integers(0, VOCAB - 2, size=3).tolist()
        mx.random.seed(i)
        sampled = generate_step(
            mx.array(prompt), model, max_tokens=45, sampler=make_sampler(0.5)
        )
        tokens = [*prompt, *(int(t) for t, _ in sampled)]
        lines.append(json.dumps({"tokens": tokens, "loss_start": 3}))
    data = root / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return root, model, data


def base_args(setup, out, **changes) -> TrainArgs:
    root, _, data = setup
    args = TrainArgs(
        model=str(root / "target"),
        data=[str(data)],
        out=str(root / out),
        steps=40,
        batch_size=4,
        anchors=8,
        seq_len=64,
        block_size=5,
        layers=1,
        markov_rank=8,
        target_layer_ids=TAPS,
        lr=3e-3,
        dtype="float32",
        quiet=True,
        log_every=5,
    )
    return replace(args, **changes)


def assert_lossless(target_dir, drafter_dir):
    model, tokenizer, drafter = load(target_dir, drafter_dir)
    assert drafter.config.is_gemma4
    eos = tokenizer.eos_token_ids
    for prompt in PROMPTS:
        expected = plain_greedy(model, prompt, 4 * WINDOW)
        stop = next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))
        got = [
            r.token
            for r in stream_generate(
                model, tokenizer, drafter, prompt, max_tokens=4 * WINDOW,
                num_draft=drafter.block_size,
            )
        ]  # fmt: skip
        assert got == expected[:stop], prompt
    return model, drafter


def mean_accepted_length(model, drafter) -> float:
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    rounds = []
    for prompt in [*PROMPTS, [4, 4, 8], [0, 13, 2]]:
        stats = GenerationStats()
        for _ in speculative_generate_step(
            mx.array(prompt), target, pair_proposer(drafter), num_draft=drafter.block_size,
            max_tokens=40, stats=stats,
        ):  # fmt: skip
            pass
        rounds.extend(stats.rounds)
    return float(np.mean([r.accepted + 1 for r in rounds]))


def test_training_learns_and_writes_a_lossless_gemma4_drafter(setup):
    root, model, _ = setup
    result = train(base_args(setup, "vanilla", log_every=1))
    assert result.status == "done"
    # Per-step losses are noisy (4 sequences a step): compare a few.
    tv = [row[3] for row in result.history]
    assert np.mean(tv[-5:]) < 0.9 * np.mean(tv[:5]), tv
    config = json.loads((result.out / "config.json").read_text())
    assert config["architectures"] == ["Gemma4DSparkModel"]
    assert config["target_layer_ids"] == TAPS
    weights = mx.load(str(result.out / "model.safetensors"))
    assert "layers.0.layer_scalar" in weights and "embed_tokens.weight" not in weights
    assert mx.array_equal(weights["layers.0.layer_scalar"], mx.ones((1,))).item()
    loaded, drafter = assert_lossless(root / "target", result.out)
    assert drafter.shares_embeddings
    untrained = new_drafter(
        drafter.config, TargetAdapter(loaded, drafter.config.target_layer_ids), 0
    )
    before = mean_accepted_length(loaded, untrained)
    after = mean_accepted_length(loaded, drafter)
    assert after > before + 0.8, (before, after)
    # The loaded drafter is the trained one: same hidden states as a drafter
    # built on the target and given the written weights.
    again = load_drafter(result.out, loaded)
    features = mx.array(np.random.default_rng(0).standard_normal((1, 7, 64)))
    block = drafter.block_tokens(mx.array([3]))
    a = drafter(block, 7, features.astype(mx.float32), drafter.make_cache())
    b = again(block, 7, features.astype(mx.float32), again.make_cache())
    assert mx.array_equal(a, b).item()


def test_wrapper_target_with_every_option(setup):
    """The multimodal wrapper (K = V): reduced draft vocabulary, gated head,
    init from the target, embeddings written and 4-bit export, teacher store;
    the drafter loads, shares the target's embedding and stays lossless."""
    root, _, _ = setup
    args = base_args(
        setup, "wrapped-drafter", model=str(root / "wrapped"), steps=6,
        markov_head="gated", draft_vocab=10, init_from_target=True,
        with_embeddings=True, quantize_bits=4, quantize_group_size=32,
        dtype="bfloat16", teacher_store=str(root / "store"),
    )  # fmt: skip
    result = train(args)
    config = json.loads((result.out / "config.json").read_text())
    assert config["architectures"] == ["Gemma4DSparkModel"]
    assert config["target_model_type"] == "gemma4"
    assert config["attention_k_eq_v"] is True and config["draft_vocab_size"] == 10
    assert config["quantization"] == {"group_size": 32, "bits": 4}
    weights = mx.load(str(result.out / "model.safetensors"))
    assert "embed_tokens.weight" in weights and "lm_head.weight" in weights
    assert "layers.0.self_attn.v_proj.weight" not in weights
    _, drafter = assert_lossless(root / "wrapped", result.out)
    assert drafter.shares_embeddings and drafter.config.reduced_vocab


def test_resume_equals_uninterrupted_and_written_embeddings_are_the_targets(setup):
    """An interrupted Gemma-4 run resumes to the uninterrupted weights (the
    frozen layer scalars included); the embedding and LM head written with
    ``--with-embeddings`` are the wrapper's text model's, so the loader
    shares them with the target."""
    root, _, _ = setup
    args = base_args(
        setup, "g-whole", model=str(root / "wrapped"), steps=6, checkpoint_every=2,
        keep_checkpoint=True, with_embeddings=True,
    )  # fmt: skip
    whole = train(args)
    parts = replace(args, out=str(root / "g-parts"))
    stopped = train(parts, should_stop=lambda step: step == 3)
    assert stopped.status == "interrupted"
    resumed = train(replace(parts, resume=True))
    assert resumed.status == "done" and resumed.history == whole.history
    a = mx.load(str(whole.checkpoint / "drafter.safetensors"))
    b = mx.load(str(resumed.checkpoint / "drafter.safetensors"))
    assert a.keys() == b.keys() and "layers.0.layer_scalar" in a
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    model, _, drafter = load(root / "wrapped", whole.out)
    weights = mx.load(str(whole.out / "model.safetensors"))
    head = model.language_model.lm_head.weight
    assert mx.array_equal(weights["lm_head.weight"], head).item()
    assert drafter.shares_embeddings


def test_regenerate_then_train_on_a_gemma4_target(setup):
    """``--regenerate`` on the wrapper: mlx-lm's batched generation over
    prompts longer than the window gives the target's greedy answers (at
    temperature 0), and the drafter trains on them."""
    root, _, _ = setup
    prompts = root / "prompts.jsonl"
    words = [
        " ".join(f"t{(i * j + 1) % 13}" for j in range(2 + 2 * i)) for i in range(6)
    ]
    prompts.write_text("\n".join(json.dumps({"prompt": w}) for w in words) + "\n")
    args = base_args(
        setup, "g-regen", model=str(root / "wrapped"), data=[str(prompts)], steps=3,
        regenerate=True, regen_max_tokens=16, regen_batch_size=3,
        regen_temperature=0.0,
    )  # fmt: skip
    result = train(args)
    assert result.status == "done"
    model, tokenizer, drafter = load(root / "wrapped", result.out)
    assert drafter.config.is_gemma4
    lines = (root / "g-regen.regenerated.jsonl").read_text().splitlines()
    assert len(lines) == 6
    for line in lines:
        record = json.loads(line)
        start, tokens = record["loss_start"], record["tokens"]
        expected = plain_greedy(model, tokens[:start], 16)
        eos = tokenizer.eos_token_id
        if eos in expected:
            expected = expected[: expected.index(eos) + 1]
        assert tokens[start:] == expected
