"""mlx_dspark.train: the training forward, learning, exact resume, data handling."""

import json
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

from mlx_dspark import load, stream_generate
from mlx_dspark.errors import DSparkError
from mlx_dspark.pairs.structured import PairSpec, build_structured_pair
from mlx_dspark.proposers.dspark_config import DraftConfig
from mlx_dspark.targets.adapter import TargetAdapter
from mlx_dspark.training import teacher as teacher_module
from mlx_dspark.training.batches import (
    DraftVocabulary,
    frequent_tokens,
    make_batch,
    shard,
    training_labels,
)
from mlx_dspark.training.data import load_sequences, regenerate
from mlx_dspark.training.loss import draft_logits, loss_terms
from mlx_dspark.training.model import (
    copy_trained_weights,
    default_layer_ids,
    drafter_config,
    new_drafter,
    trained_drafter,
    training_hidden,
)
from mlx_dspark.training.run import TrainArgs, train
from mlx_dspark.training.teacher import OnlineTeacher, TeacherStore
from mlx_dspark.training.trainer import make_step, make_validation, schedule

PROMPTS = [[1, 2, 3], [7, 8], [20, 4, 11, 9], [0], [13, 5, 5, 21, 2, 17]]


def word(token: int) -> str:
    return "</s>" if token == 30 else f"t{token}"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A structured target and target-sampled training text (JSONL)."""
    root = tmp_path_factory.mktemp("train")
    target_dir, _ = build_structured_pair(root / "pair", PairSpec())
    model, tokenizer, _ = load(target_dir)
    rng = np.random.default_rng(0)
    lines = []
    for i in range(24):
        prompt = rng.integers(0, 30, size=3).tolist()
        mx.random.seed(i)
        sampled = generate_step(
            mx.array(prompt), model, max_tokens=60, sampler=make_sampler(0.7)
        )
        tokens = [*prompt, *(int(t) for t, _ in sampled)]
        lines.append(json.dumps({"text": " ".join(map(word, tokens))}))
    data = root / "data.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return root, target_dir, model, tokenizer, data


def base_args(setup, out, **changes) -> TrainArgs:
    root, target_dir, _, _, data = setup
    args = TrainArgs(
        model=str(target_dir),
        data=[str(data)],
        out=str(root / out),
        steps=40,
        batch_size=4,
        anchors=16,
        seq_len=64,
        layers=1,
        markov_rank=16,
        lr=3e-3,
        dtype="float32",
        quiet=True,
        log_every=5,
    )
    return replace(args, **changes)


def mean_accepted_length(model, tokenizer, drafter) -> float:
    rounds = []
    for prompt in PROMPTS:
        responses = list(
            stream_generate(
                model,
                tokenizer,
                drafter,
                prompt,
                max_tokens=48,
                num_draft=drafter.block_size,  # always draft: measure the drafter
            )
        )
        rounds.extend(responses[-1].stats.rounds)
    return float(np.mean([r.accepted + 1 for r in rounds]))


def test_default_layer_ids():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(2) == [0]
    assert all(0 <= i <= 28 for i in default_layer_ids(30))


def test_training_forward_equals_inference_forward(setup):
    _, _, model, _, _ = setup
    for head in ("vanilla", "rnn"):
        drafter, target, _ = _tiny_drafter(model, head)
        tokens = mx.array([[3, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10, 12], [1] * 12])
        _, features = target.hidden(tokens, target.make_cache())
        anchors = mx.array([[0, 1, 4, 10], [2, 3, 5, 6]])
        blocks = mx.stack(
            [drafter.block_tokens(mx.take(tokens[n], anchors[n])) for n in range(2)]
        )
        hidden = training_hidden(drafter, features, anchors, blocks)
        for n in range(2):
            for a, anchor in enumerate(anchors[n].tolist()):
                context = features[n : n + 1, :anchor] if anchor else None
                expected = drafter(
                    blocks[n : n + 1, a], anchor, context, drafter.make_cache()
                )
                assert mx.allclose(hidden[n * 4 + a], expected[0], atol=1e-5), (
                    head,
                    n,
                    anchor,
                )


@pytest.fixture(scope="module")
def vanilla_run(setup):
    """The default recipe's drafter (vanilla head) trained on the structured target."""
    return train(base_args(setup, "vanilla"))


def test_training_learns_and_output_is_lossless(setup, vanilla_run):
    _, target_dir, model, tokenizer, _ = setup
    result = vanilla_run
    assert result.status == "done"
    first, last = result.history[0], result.history[-1]
    assert last[1] < 0.8 * first[1], (first, last)  # total loss
    assert last[5] > first[5]  # running acceptance estimate

    out = result.out
    names = set(mx.load(str(out / "model.safetensors")))
    assert "fc.weight" in names and "markov_head.markov_w1.weight" in names
    assert "embed_tokens.weight" not in names
    record = json.loads((out / "training_record.json").read_text())
    assert record["data"][0]["sha256"] and record["steps"] == 40
    assert record["final_metrics"]["tau"] > 1.0
    assert 0 < record["block_positions"] <= 40 * 4 * 16 * 7
    assert record["block_positions_per_s"] == pytest.approx(
        record["block_positions"] / record["train_time_s"]
    )

    model2, tokenizer2, drafter = load(target_dir, out)
    config = drafter.config
    untrained = new_drafter(config, TargetAdapter(model, config.target_layer_ids), 0)
    before = mean_accepted_length(model, tokenizer, untrained)
    after = mean_accepted_length(model2, tokenizer2, drafter)
    assert after > before + 0.4, (before, after)
    for prompt in PROMPTS:
        expected = [
            int(t) for t, _ in generate_step(mx.array(prompt), model2, max_tokens=40)
        ]
        got = [
            r.token
            for r in stream_generate(model2, tokenizer2, drafter, prompt, max_tokens=40)
        ]
        assert got == expected


def test_rounds_accept_what_training_measures(setup, vanilla_run):
    """Each greedy round keeps exactly the drafts the training forward predicts
    at its anchor (teacher-forced greedy length, from one target forward over
    the whole output): the loop feeds the drafter the features training does."""
    _, target_dir, _, _, _ = setup
    model, tokenizer, drafter = load(target_dir, vanilla_run.out)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    B = drafter.block_size
    loop_kept, trained_kept = [], []
    for prompt in PROMPTS:
        responses = list(
            stream_generate(
                model,
                tokenizer,
                drafter,
                prompt,
                max_tokens=40,
                num_draft=B,
                scheduler="off",
            )
        )
        tokens = [*prompt, *(r.token for r in responses)]
        anchors, kept = [], []
        anchor = len(prompt)  # the first token comes from the prefill
        for round_ in responses[-1].stats.rounds:
            if anchor + B < len(tokens):  # the whole block lies in the output
                anchors.append(anchor)
                kept.append(round_.accepted)
            anchor += round_.accepted + 1
        _, features = target.hidden(mx.array([tokens]), target.make_cache())
        blocks = drafter.block_tokens(mx.array([tokens[a] for a in anchors]))
        hidden = training_hidden(drafter, features, mx.array([anchors]), blocks[None])
        prev = mx.array([tokens[a : a + B] for a in anchors])
        guesses = drafter.draft_ids_to_target(draft_logits(drafter, hidden, prev))
        labels = np.array([tokens[a + 1 : a + 1 + B] for a in anchors])
        trained_kept += np.cumprod(np.array(guesses) == labels, axis=1).sum(1).tolist()
        loop_kept += kept
    assert loop_kept == trained_kept
    assert 0 in loop_kept and max(loop_kept) >= 3, loop_kept  # kept often, not always


@pytest.mark.parametrize("head", ["gated", "none"])
def test_other_heads_train_and_load(setup, head):
    _, target_dir, model, tokenizer, _ = setup
    result = train(
        base_args(
            setup,
            f"head-{head}",
            markov_head=head,
            steps=6,
            with_embeddings=True,
            confidence=head != "none",
            dtype="bfloat16",
            quantize_bits=4 if head == "gated" else None,
        )
    )
    config = json.loads((result.out / "config.json").read_text())
    if head == "gated":
        assert config["quantization"] == {"group_size": 64, "bits": 4}
        assert "layers.0.mlp.up_proj.scales" in mx.load(
            str(result.out / "model.safetensors")
        )
    names = set(mx.load(str(result.out / "model.safetensors")))
    assert {"embed_tokens.weight", "lm_head.weight"} <= names
    _, _, drafter = load(target_dir, result.out)
    assert drafter.shares_embeddings
    assert (drafter.markov_head is None) == (head == "none")
    assert (drafter.confidence_head is None) == (head == "none")
    prompt = PROMPTS[2]
    expected = [
        int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=24)
    ]
    got = [
        r.token
        for r in stream_generate(model, tokenizer, drafter, prompt, max_tokens=24)
    ]
    assert got == expected


def test_reduced_draft_vocabulary(setup):
    """--draft-vocab: the drafter's own frozen head over the most frequent
    labels; it learns, loads, and stays lossless when the target picks a token
    outside that vocabulary."""
    root, target_dir, model, tokenizer, data = setup
    result = train(base_args(setup, "reduced", draft_vocab=12))
    first, last = result.history[0], result.history[-1]
    assert last[1] < 0.8 * first[1], (first, last)
    config = json.loads((result.out / "config.json").read_text())
    assert config["draft_vocab_size"] == 12
    weights = mx.load(str(result.out / "model.safetensors"))
    assert weights["lm_head.weight"].shape == (12, 64)
    sequences, _ = load_sequences([data], tokenizer, 64)
    labels = np.concatenate([s.tokens[s.loss_mask] for s in sequences])
    counts = np.bincount(labels, minlength=32)
    chosen = np.asarray(weights["draft_to_target"])
    assert counts[chosen].min() >= np.delete(counts, chosen).max()
    record = json.loads((result.out / "training_record.json").read_text())
    assert 0.3 < record["draft_vocab_label_coverage"] < 1.0

    model2, tokenizer2, drafter = load(target_dir, result.out)
    assert drafter.config.reduced_vocab
    assert mean_accepted_length(model2, tokenizer2, drafter) > 1.3
    outside = 0
    for prompt in PROMPTS:
        expected = [
            int(t) for t, _ in generate_step(mx.array(prompt), model2, max_tokens=40)
        ]
        outside += sum(t not in set(chosen.tolist()) for t in expected)
        got = [
            r.token
            for r in stream_generate(model2, tokenizer2, drafter, prompt, max_tokens=40)
        ]
        assert got == expected
    assert outside > 0


def _checkpoint_weights(result):
    return mx.load(str(result.checkpoint / "drafter.safetensors"))


def test_resume_equals_uninterrupted(setup):
    whole = train(
        base_args(setup, "whole", steps=10, checkpoint_every=4, keep_checkpoint=True)
    )
    parts = base_args(
        setup, "parts", steps=10, checkpoint_every=4, keep_checkpoint=True
    )
    stopped = train(parts, should_stop=lambda step: step == 7)
    assert stopped.status == "interrupted" and stopped.step == 7
    assert stopped.out is None and not Path(parts.out).exists()
    with pytest.raises(DSparkError, match="--resume"):
        train(parts)
    moved = Path(parts.out).parent / "moved" / Path(parts.data[0]).name
    moved.parent.mkdir()
    shutil.copy(parts.data[0], moved)
    resumed = train(replace(parts, resume=True, data=[str(moved)]))
    assert resumed.status == "done" and resumed.step == 10
    a, b = _checkpoint_weights(whole), _checkpoint_weights(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert mx.array_equal(a[name], b[name]).item(), name
    assert whole.history == resumed.history
    out_a = mx.load(str(whole.out / "model.safetensors"))
    out_b = mx.load(str(resumed.out / "model.safetensors"))
    assert all(mx.array_equal(out_a[k], out_b[k]).item() for k in out_a)
    with pytest.raises(DSparkError, match="differ"):
        train(replace(parts, resume=True, lr=1e-3, force=True))


def test_feature_cache_multi_epoch(setup, tmp_path):
    args = base_args(setup, "cached", steps=None, epochs=2, teacher_store=str(tmp_path))
    result = train(args)
    files = sorted(tmp_path.rglob("*.npy"))
    assert len(files) == 3
    assert result.step == 12
    assert result.history[-1][1] < result.history[0][1]

    moved = tmp_path / "moved" / Path(args.data[0]).name
    moved.parent.mkdir()
    shutil.copy(args.data[0], moved)
    train(
        replace(args, data=[str(moved)], out=args.out + "-moved", epochs=None, steps=2)
    )
    assert sorted(tmp_path.rglob("*.npy")) == files  # the same data's store, reused


def test_bad_data(setup, tmp_path):
    _, _, _, tokenizer, data = setup
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(DSparkError, match="no usable training sequences"):
        load_sequences([empty], tokenizer, 64)
    with pytest.raises(DSparkError, match="does not exist"):
        load_sequences([tmp_path / "missing.jsonl"], tokenizer, 64)
    mixed = tmp_path / "mixed.jsonl"
    long_text = " ".join(f"t{i % 30}" for i in range(100))
    mixed.write_text(
        "\n".join(
            [
                json.dumps({"text": "t1 t2 t3 t4 t5"}),
                "{not json",
                json.dumps({"unknown": 1}),
                json.dumps({"text": long_text}),
                json.dumps({"prompt": "t1 t2", "completion": "t3 t4 t5"}),
                json.dumps({"tokens": [1, 2, 3, 4], "loss_start": 2}),
                json.dumps({"text": "t1"}),
            ]
        )
    )
    sequences, report = load_sequences([mixed, empty], tokenizer, 64)
    assert len(sequences) == 3
    assert report.invalid_lines == 1
    assert report.unknown_records == 1
    assert report.too_long == 1
    assert report.too_short == 1
    assert report.empty_files == [str(empty)]
    summary = report.summary()
    assert "1 invalid JSONL lines" in summary and "1 empty files" in summary
    prompt_completion = sequences[1]
    assert prompt_completion.loss_mask.tolist() == [
        False,
        False,
        True,
        True,
        True,
        True,
    ]

    plain = tmp_path / "plain.txt"
    plain.write_text(long_text)
    chunks, _ = load_sequences([plain], tokenizer, 64)
    assert [len(c) for c in chunks] == [64, 36]

    # The command line: one sentence, non-zero exit, no traceback.
    root, target_dir, *_ = setup
    env = dict(os.environ)
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_dspark.train", "--model", str(target_dir),
         "--data", str(empty), "--out", str(tmp_path / "o"), "--steps", "2", "--quiet"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_regenerate_is_resumable(setup, tmp_path):
    _, _, model, tokenizer, data = setup
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": f"t{i} t{i + 1}"}) for i in range(5)) + "\n"
    )
    out = tmp_path / "regen.jsonl"
    kwargs = dict(seq_len=64, max_tokens=12, batch_size=2, temperature=0.0)
    path, report = regenerate([prompts], model, tokenizer, out, **kwargs)
    lines = out.read_text().splitlines()
    assert len(lines) == 5
    first = json.loads(lines[0])
    assert first["loss_start"] == 2 and len(first["tokens"]) >= 3
    expected = [
        int(t) for t, _ in generate_step(mx.array([1, 2]), model, max_tokens=12)
    ]
    if 30 in expected:
        expected = expected[: expected.index(30) + 1]
    assert json.loads(lines[1])["tokens"] == [1, 2, *expected]
    # Interrupted mid-way (a truncated last line): the rerun keeps the complete lines.
    out.write_text("\n".join(lines[:3]) + "\n" + lines[3][:10])
    regenerate([prompts], model, tokenizer, out, **kwargs)
    assert out.read_text().splitlines() == lines
    sequences, _ = load_sequences([out], tokenizer, 64)
    assert len(sequences) == 5


def _tiny_drafter(model, head="vanilla", draft_vocab=None):
    config = DraftConfig.from_dict(
        {
            "architectures": ["Qwen3DSparkModel"],
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "intermediate_size": 96,
            "vocab_size": 32,
            "block_size": 5,
            "mask_token_id": 31,
            "target_layer_ids": [-1, 0],
            "markov_rank": 8,
            "markov_head_type": head,
            "enable_confidence_head": True,
            "confidence_head_with_markov": True,
            "rope_theta": 10000.0,
            **({"draft_vocab_size": draft_vocab} if draft_vocab else {}),
        }
    )
    target = TargetAdapter(model, config.target_layer_ids)
    ids = None if draft_vocab is None else np.arange(0, 2 * draft_vocab, 2)
    return new_drafter(config, target, seed=3, draft_ids=ids), target, ids


def _reference_hidden(drafter, features, anchors, blocks):
    """The straightforward training forward: every block gets its own copy of
    its sequence's context keys/values (``mx.repeat``) and a padding mask."""
    N, S, _ = features.shape
    A, B = blocks.shape[1], blocks.shape[2]
    flat = anchors.reshape(-1).astype(mx.int32)
    visible = mx.arange(S)[None, :] < flat[:, None]
    mask = mx.concatenate([visible, mx.ones((N * A, B), dtype=mx.bool_)], axis=1)
    projected = drafter.hidden_norm(drafter.fc(features))
    h = drafter.embed(blocks.reshape(N * A, B))
    for layer in drafter.layers:
        keys, values = layer.self_attn.key_values(projected, 0)
        keys, values = mx.repeat(keys, A, axis=0), mx.repeat(values, A, axis=0)
        h = layer(h, flat, keys, values, mask[:, None, None, :])
    return drafter.norm(h)


def test_shared_context_gradients_equal_the_straightforward_ones(setup):
    """The throughput path (context K/V shared through the mask) gives the
    same values and gradients as per-block copies of the context."""
    _, _, model, _, _ = setup
    drafter, target, _ = _tiny_drafter(model)
    tokens = mx.array([[3, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10, 12], [1] * 12])
    _, features = target.hidden(tokens, target.make_cache())
    anchors = mx.array([[0, 1, 4, 10], [2, 3, 5, 6]])
    blocks = mx.stack(
        [drafter.block_tokens(mx.take(tokens[n], anchors[n])) for n in range(2)]
    )
    weights = mx.random.normal((8, 5, 64), key=mx.random.key(0))

    def objective(forward):
        def f(model, feats):
            return (forward(model, feats, anchors, blocks) * weights).sum()

        return nn.value_and_grad(drafter, f)

    fast, fast_grads = objective(training_hidden)(drafter, features)
    slow, slow_grads = objective(_reference_hidden)(drafter, features)
    assert mx.allclose(fast, slow, rtol=1e-5, atol=1e-4), (fast, slow)
    flat_fast, flat_slow = (
        dict(tree_flatten(fast_grads)),
        dict(tree_flatten(slow_grads)),
    )
    assert flat_fast.keys() == flat_slow.keys() and len(flat_fast) > 10
    for name, g in flat_fast.items():
        assert mx.allclose(g, flat_slow[name], rtol=1e-4, atol=1e-5), name


def _drafter_and_batch(setup, draft_vocab, indices, seed):
    """A tiny drafter (full or reduced vocabulary), the training sequences and
    a batch of 8 anchors in each of ``indices``."""
    _, _, model, tokenizer, data = setup
    drafter, target, ids = _tiny_drafter(model, draft_vocab=draft_vocab)
    sequences, _ = load_sequences([data], tokenizer, 64)
    to_draft = None
    if ids is not None:
        to_draft = np.full(32, -1, dtype=np.int32)
        to_draft[ids] = np.arange(len(ids), dtype=np.int32)
    batch = make_batch(
        [sequences[i] for i in indices], 8, 5, 31, 4.0, np.random.default_rng(seed),
        to_draft,
    )  # fmt: skip
    return drafter, target, ids, sequences, batch


@pytest.mark.parametrize("draft_vocab", [None, 12])
def test_stored_teacher_loss_equals_on_the_fly(setup, tmp_path, draft_vocab):
    """The teacher store (features + target distribution over the draft
    vocabulary + mass outside it) gives the on-the-fly loss: exactly in
    float32, within the stated float16 bound otherwise."""
    indices = [4, 1, 3]
    drafter, target, ids, sequences, batch = _drafter_and_batch(
        setup, draft_vocab, indices, seed=0
    )
    sequences = sequences[:6]
    online = OnlineTeacher(target, ids)
    loss_and_grad = nn.value_and_grad(drafter, loss_terms)
    (expected, terms), grads = loss_and_grad(drafter, *online(indices, batch), batch)
    if ids is not None:
        assert terms[1].item() > 0 and online(indices, batch)[2].max().item() > 0.01
    for dtype, tol in (("float32", 1e-5), ("float16", 2e-3)):
        store = TeacherStore.build(
            tmp_path / dtype, dtype, target, sequences, ids, dtype=dtype, batch_size=4
        )
        assert TeacherStore.complete(tmp_path / dtype, dtype)
        (loss, got_terms), got_grads = loss_and_grad(
            drafter, *store(indices, batch), batch
        )
        assert abs(loss.item() - expected.item()) < tol, (dtype, loss, expected)
        for a, b in zip(got_terms, terms, strict=True):
            assert abs(a.item() - b.item()) < tol, dtype
        if dtype == "float32":
            for name, g in tree_flatten(got_grads):
                assert mx.allclose(g, dict(tree_flatten(grads))[name], atol=1e-5), name


@pytest.mark.parametrize("draft_vocab", [None, 12])
def test_greedy_term_and_greedy_tau(setup, draft_vocab):
    """The greedy term is the weighted CE against the target's most likely
    token where that token is inside the draft vocabulary for certain, and
    ``greedy_tau`` the teacher-forced greedy accepted length, both computed
    here position by position in NumPy."""
    indices = [0, 2, 5]
    drafter, target, ids, _, batch = _drafter_and_batch(
        setup, draft_vocab, indices, seed=1
    )
    features, target_p, outside = OnlineTeacher(target, ids)(indices, batch)
    plain, plain_terms = loss_terms(drafter, features, target_p, outside, batch)
    loss, terms = loss_terms(drafter, features, target_p, outside, batch, 2.0)

    hidden = training_hidden(drafter, features, batch.anchors, batch.blocks)
    NA, B = hidden.shape[:2]
    logits = draft_logits(drafter, hidden, batch.prev.reshape(NA, B))
    q = np.array(mx.softmax(logits, axis=-1, precise=True), dtype=np.float64)
    p, out = np.array(target_p, dtype=np.float64), np.array(outside)
    weights = np.array(batch.weights).reshape(NA, B)
    valid = np.array(batch.valid).reshape(NA, B)
    greedy_ce, lengths = 0.0, []
    for a in range(NA):
        length = 1.0
        for k in range(B):
            best = int(p[a, k].argmax())
            known = p[a, k, best] >= out[a, k]
            if known:
                greedy_ce -= weights[a, k] * np.log(q[a, k, best])
            if length == k + 1 and valid[a, k] and known:
                length += float(q[a, k].argmax() == best)
        if valid[a, 0]:
            lengths.append(length)
    greedy_ce /= weights.sum()
    assert abs((loss - plain).item() - 2.0 * greedy_ce) < 1e-4
    for got, expected in zip(terms[:4], plain_terms[:4], strict=True):
        assert got.item() == expected.item()
    assert abs(terms[4].item() - np.mean(lengths)) < 1e-5
    assert terms[4].item() == plain_terms[4].item()
    if ids is not None:  # some of the target's best tokens are outside
        assert (p.max(axis=-1) < out).any() and (p.max(axis=-1) >= out).any()
    unknown = mx.ones_like(outside)  # no best token inside for certain
    loss, terms = loss_terms(drafter, features, target_p, unknown, batch, 2.0)
    plain, _ = loss_terms(drafter, features, target_p, unknown, batch)
    assert loss.item() == plain.item() and terms[4].item() == 1.0


@pytest.mark.parametrize("draft_vocab", [None, 12])
def test_target_distribution_is_the_softmax_over_the_draft_vocabulary(
    setup, draft_vocab
):
    """The teacher's probabilities of the draft ids and the mass outside them
    are the target's softmax, computed in float64, to float32 precision."""
    _, _, model, tokenizer, data = setup
    _, target, ids = _tiny_drafter(model, draft_vocab=draft_vocab)
    sequences, _ = load_sequences([data], tokenizer, 64)
    tokens = mx.array(np.stack([s.tokens[:40] for s in sequences[:3]]))
    hidden, _ = target.hidden(tokens, target.make_cache())
    probs, outside = teacher_module.target_distribution(target, hidden, ids)
    logits = np.array(target.lm_head(hidden).astype(mx.float32), dtype=np.float64)
    exact = np.exp(logits - logits.max(axis=-1, keepdims=True))
    exact /= exact.sum(axis=-1, keepdims=True)
    inside = np.arange(32) if ids is None else ids
    assert probs.shape == (3, 40, len(inside)) and outside.shape == (3, 40)
    assert np.abs(probs - exact[..., inside]).max() < 1e-6
    assert np.abs(outside - (1.0 - exact[..., inside].sum(axis=-1))).max() < 1e-6
    if ids is not None:
        assert outside.max() > 0.01


def test_interrupted_teacher_store_continues_where_it_stopped(
    setup, tmp_path, monkeypatch
):
    """A build stopped after two batches continues from the third when run
    again, and ends byte for byte as a build that was never stopped; features
    that overflow float16 start the build over in bfloat16."""
    _, _, model, tokenizer, data = setup
    _, target, ids = _tiny_drafter(model, draft_vocab=12)
    sequences, _ = load_sequences([data], tokenizer, 64)
    sequences = sequences[:7]

    def build(directory, progress=None):
        return TeacherStore.build(
            directory, "k", target, sequences, ids, batch_size=2, progress=progress
        )

    def stop_after_two(done, total):
        if done == 4:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build(tmp_path / "resumed", stop_after_two)
    assert not TeacherStore.complete(tmp_path / "resumed", "k")
    reported = []
    resumed = build(tmp_path / "resumed", lambda done, total: reported.append(done))
    assert reported == [6, 7]
    assert not (tmp_path / "resumed" / "progress.json").exists()
    whole = build(tmp_path / "whole")
    for name in ("features", "probs", "outside"):
        assert np.array_equal(getattr(resumed, name), getattr(whole, name)), name
    assert (tmp_path / "resumed" / "meta.json").read_text() == (
        tmp_path / "whole" / "meta.json"
    ).read_text()
    other = TeacherStore.build(
        tmp_path / "resumed", "other", target, sequences, ids, batch_size=2,
        progress=lambda done, total: reported.append(done),
    )  # fmt: skip
    assert reported[2:] == [2, 4, 6, 7] and other.features.shape == whole.features.shape
    monkeypatch.setattr(teacher_module, "F16_MAX", 0.0)
    wide = build(tmp_path / "wide")
    assert wide.feature_dtype == "bfloat16"
    features = mx.array(np.asarray(wide.features)).view(mx.bfloat16)
    assert mx.allclose(features, mx.array(np.asarray(whole.features)), rtol=1e-2)


def test_compiled_step_equals_the_eager_step(setup):
    """The compiled update (forward, backward, clip, AdamW in one graph) moves
    the weights as the eager one does, over steps of different batch shapes."""
    _, _, model, tokenizer, data = setup
    sequences, _ = load_sequences([data], tokenizer, 64)
    weights = {}
    for compiled in (False, True):
        drafter, target, _ = _tiny_drafter(model)
        optimizer = optim.AdamW(learning_rate=schedule(3e-3, 4, 1))
        step = make_step(drafter, optimizer, grad_clip=0.5, compiled=compiled)
        teacher = OnlineTeacher(target, None)
        metrics = []
        for i, chosen in enumerate(([0, 1, 2], [3, 4, 5], [6, 7], [8, 9, 10])):
            batch = make_batch(
                [sequences[j] for j in chosen], 8, 5, 31, 4.0,
                np.random.default_rng(i), None, length=64 if i % 2 else None,
            )  # fmt: skip
            metrics.append(step(*teacher(chosen, batch), batch))
        weights[compiled] = (
            dict(tree_flatten(drafter.trainable_parameters())),
            metrics,
        )
    (eager, eager_metrics), (fast, fast_metrics) = weights[False], weights[True]
    assert np.allclose(eager_metrics, fast_metrics, rtol=1e-4, atol=1e-5)
    start = dict(tree_flatten(_tiny_drafter(model)[0].trainable_parameters()))
    assert len(eager) > 10
    assert not all(mx.array_equal(w, start[name]) for name, w in eager.items())
    for name, w in eager.items():
        assert mx.allclose(w, fast[name], rtol=1e-4, atol=1e-5), name


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_block_logits_equal_stepwise(setup, head):
    """The one-product Markov bias equals the head's step-by-step bias."""
    _, _, model, _, _ = setup
    drafter, _, _ = _tiny_drafter(model, head=head)
    hidden = mx.random.normal((6, 5, 64), key=mx.random.key(1))
    prev = mx.random.randint(0, 32, (6, 5), key=mx.random.key(2))
    expected = drafter.logits(hidden) + drafter.markov_head.block_bias(prev, hidden)
    assert mx.allclose(draft_logits(drafter, hidden, prev), expected, atol=1e-5)


def test_init_from_target_copies_the_top_layer(setup):
    _, target_dir, model, _, _ = setup
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    target = TargetAdapter(model, default_layer_ids(len(model.layers)))
    config = drafter_config(
        target_config, target, layers=1, block_size=5, markov_head="vanilla",
        markov_rank=8, anchors=4, confidence=True, mask_token_id=31,
    )  # fmt: skip
    copied = new_drafter(config, target, 0, init_from_target=True).layers[0]
    fresh = new_drafter(config, target, 0).layers[0]
    top = model.layers[-1]
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
        mine, theirs, other = copied, top, fresh
        for part in name.split("."):
            mine, theirs, other = (getattr(m, part) for m in (mine, theirs, other))
        assert mx.array_equal(mine.weight, theirs.weight.astype(mx.float32)), name
        assert not mx.array_equal(other.weight, mine.weight), name


def test_init_from_a_trained_drafter_continues_it(setup, tmp_path):
    """--init-from starts from an earlier drafter's weights (its 4-bit export
    dequantized), keeps its draft vocabulary on other data, chains the
    training records, and names the flag that does not match."""
    root, target_dir, _, tokenizer, data = setup
    first = train(base_args(setup, "first", steps=6, draft_vocab=12, quantize_bits=4))
    first_ids = np.asarray(
        mx.load(str(first.out / "model.safetensors"))["draft_to_target"]
    )
    other = tmp_path / "other.jsonl"
    other.write_text("".join(data.read_text().splitlines(keepends=True)[:5]))
    sequences, _ = load_sequences([other], tokenizer, 64)
    assert not np.array_equal(
        frequent_tokens(training_labels(sequences), 12, 32), first_ids
    )
    continued = partial(
        base_args, setup, data=[str(other)], draft_vocab=12, init_from=str(first.out)
    )
    stopped = train(continued("stopped", lr=1e-12), should_stop=lambda step: True)
    _, _, loaded = load(target_dir, first.out)
    expected = dict(tree_flatten(loaded.parameters()))
    got = _checkpoint_weights(stopped)
    assert np.array_equal(np.asarray(got["draft_to_target"]), first_ids)
    trainable = [k for k in got if k not in ("lm_head.weight", "draft_to_target")]
    assert len(trainable) > 10
    for name in trainable:
        assert mx.allclose(got[name], expected[name], atol=1e-6), name

    second = train(continued("second", steps=3))
    record = json.loads((second.out / "training_record.json").read_text())
    assert [r["steps"] for r in record["runs"]] == [6, 3]
    assert record["total_steps"] == 9 and record["steps"] == 3
    assert record["runs"][1]["init_from"]["path"] == str(first.out)
    assert record["total_train_time_s"] > record["train_time_s"] > 0
    with pytest.raises(DSparkError, match="--markov-rank \\(16, not 8\\)"):
        train(continued("other_rank", markov_rank=8))


def test_init_from_may_retap_as_many_target_layers(setup):
    """--init-from with other --target-layer-ids of the same count continues
    the drafter on the new taps (the feature projection keeps its shape);
    another count is refused."""
    _, target_dir, model, _, _ = setup
    first = train(base_args(setup, "tapped", steps=4))
    ids = json.loads((first.out / "config.json").read_text())["target_layer_ids"]
    last = len(model.layers) - 1
    retapped = [*ids[:-1], last]
    assert retapped != ids
    result = train(
        base_args(setup, "retapped", steps=2, init_from=str(first.out),
                  target_layer_ids=retapped)
    )  # fmt: skip
    assert load(target_dir, result.out)[2].config.target_layer_ids == retapped
    more = sorted({-1, last, *ids})
    assert len(more) != len(ids)
    with pytest.raises(DSparkError, match="--target-layer-ids"):
        train(
            base_args(setup, "more", steps=2, init_from=str(first.out),
                      target_layer_ids=more)
        )  # fmt: skip


def test_a_finished_run_removes_its_checkpoint_and_follows_the_umask(setup):
    args = base_args(setup, "tidy", steps=4, checkpoint_every=2)
    result = train(args)
    assert result.status == "done" and not result.checkpoint.exists()
    mask = os.umask(0o022)
    os.umask(mask)
    assert stat.S_IMODE(result.out.stat().st_mode) == 0o777 & ~mask
    kept = train(replace(args, out=args.out + "-kept", keep_checkpoint=True))
    assert kept.checkpoint.is_dir()


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--regen-max-tokens", "-5", "--regen-max-tokens must be at least 1"),
        ("--regen-temperature", "-1", "--regen-temperature must be >= 0"),
        ("--warmup", "1.5", "--warmup must be a fraction"),
        ("--log-every", "0", "--log-every must be at least 1"),
    ],
)
def test_bad_values_are_refused_before_anything_is_written(
    setup, tmp_path, flag, value, message
):
    _, target_dir, _, _, data = setup
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_dspark.train", "--model", str(target_dir)]
        + ["--data", str(data), "--out", str(out), "--regenerate", flag, value],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_progress_in_a_log_is_a_plain_line_every_log_every_steps(setup, tmp_path):
    _, target_dir, _, _, data = setup
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_dspark.train", "--model", str(target_dir)]
        + ["--data", str(data), "--out", str(tmp_path / "o"), "--steps", "6"]
        + ["--log-every", "2", "--layers", "1", "--markov-rank", "8", "--seq-len"]
        + ["64", "--anchors", "8", "--dtype", "float32"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/6", "4/6", "6/6"]
    assert all("loss" in line and "pos/s" in line for line in lines)


def test_the_plain_command_builds_the_teacher_store_once_and_reuses_it(
    setup, tmp_path, monkeypatch, capsys
):
    """Default flags: the store is built in the user cache on the first run
    (its progress with a rate), reused by the next run on the same contents
    (no target forward, files untouched), rebuilt for other data or with
    --refresh-teacher-store, and --teacher-store none runs the target."""
    from mlx_dspark.cli.train import main

    _, target_dir, _, _, data = setup
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    forwards = {"store": 0, "online": 0}
    rows, online = teacher_module._teacher_rows, OnlineTeacher.__call__

    def counted_rows(*args):
        forwards["store"] += 1
        return rows(*args)

    def counted_online(*args):
        forwards["online"] += 1
        return online(*args)

    monkeypatch.setattr(teacher_module, "_teacher_rows", counted_rows)
    monkeypatch.setattr(OnlineTeacher, "__call__", counted_online)
    runs = iter(range(100))

    def plain(data_file, *more):
        main(
            ["--model", str(target_dir), "--data", str(data_file), "--steps", "2"]
            + ["--out", str(tmp_path / f"o{next(runs)}"), "--layers", "1"]
            + ["--markov-rank", "8", "--seq-len", "64", "--anchors", "8", *more]
        )
        return dict(forwards)

    def stores():
        files = sorted((tmp_path / "cache" / "teacher").glob("*/*.npy"))
        return {str(f): f.stat().st_mtime_ns for f in files}

    assert plain(data) == {"store": 3, "online": 0}  # 24 sequences, 8 a batch
    built = stores()
    assert len(built) == 3
    out = capsys.readouterr().out
    assert "teacher store: 24/24" in out and "tokens/s" in out
    record = json.loads((tmp_path / "o0" / "training_record.json").read_text())
    assert record["arguments"]["batch_size"] == 10
    if mx.default_device() == mx.cpu:
        assert record["arguments"]["dtype"] == "float32"

    moved = tmp_path / "moved.jsonl"
    shutil.copy(data, moved)
    assert plain(moved) == {"store": 3, "online": 0}  # the same contents
    assert stores() == built
    assert "teacher store: reusing" in capsys.readouterr().out

    changed = tmp_path / "changed.jsonl"
    changed.write_text(data.read_text() + json.dumps({"text": "t1 t2 t3"}) + "\n")
    rebuilt = plain(changed)["store"]
    assert rebuilt > 3
    assert len(stores()) == 6 and all(stores()[f] == t for f, t in built.items())

    assert plain(data, "--refresh-teacher-store")["store"] == rebuilt + 3
    assert len(stores()) == 6 and all(stores()[f] != t for f, t in built.items())

    opted_out = plain(data, "--teacher-store", "none")
    assert opted_out == {"store": rebuilt + 3, "online": 2}
    assert len(stores()) == 6
    with pytest.raises(SystemExit):
        plain(data, "--teacher-store", "none", "--refresh-teacher-store")
    assert "needs a teacher store" in capsys.readouterr().err


def test_the_target_fingerprint_follows_its_files(setup, tmp_path, monkeypatch):
    """A store's key changes with the target's files: small ones by content,
    weights by size and modification time."""
    from mlx_dspark.training.run import target_fingerprint

    target = tmp_path / "target"
    shutil.copytree(setup[1], target)
    first = target_fingerprint(target)
    assert target_fingerprint(target) == first
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "note": 1}))
    assert target_fingerprint(target) != first
    monkeypatch.setattr("mlx_dspark.training.run.FINGERPRINT_BYTES", 0)
    by_time = target_fingerprint(target)
    weights = target / "model.safetensors"
    os.utime(weights, ns=(1, weights.stat().st_mtime_ns + 10**9))
    assert target_fingerprint(target) != by_time


def test_draft_vocab_auto_is_the_recipes_for_a_large_vocabulary(setup):
    """--draft-vocab auto: 4,096 tokens for a target with more than twice as
    many, the whole vocabulary for a small one, the starting drafter's own
    with --init-from; none and numbers are kept, anything else refused."""
    from types import SimpleNamespace

    from mlx_dspark.cli.train import build_parser
    from mlx_dspark.training.run import _resolved_draft_vocab

    args = base_args(setup, "unused")
    big, small = SimpleNamespace(vocab_size=49152), SimpleNamespace(vocab_size=31)
    assert args.draft_vocab == "auto"
    assert _resolved_draft_vocab(args, big, None) == 4096
    assert _resolved_draft_vocab(args, small, None) is None
    assert _resolved_draft_vocab(replace(args, draft_vocab="none"), big, None) is None
    assert _resolved_draft_vocab(replace(args, draft_vocab=100), big, None) == 100

    def start(reduced: bool):
        config = SimpleNamespace(reduced_vocab=reduced, draft_vocab_size=512)
        return SimpleNamespace(drafter=SimpleNamespace(config=config))

    assert _resolved_draft_vocab(args, big, start(True)) == 512
    assert _resolved_draft_vocab(args, big, start(False)) is None

    def parse(value):
        argv = ["--model", "m", "--data", "d", "--out", "o", "--draft-vocab", value]
        return build_parser().parse_args(argv).draft_vocab

    assert parse("none") == "none" and parse("64") == 64
    with pytest.raises(DSparkError, match="auto or none"):
        parse("many")
    with pytest.raises(DSparkError, match="--draft-vocab must be"):
        train(replace(args, draft_vocab="many"))


def test_binary_data_is_refused_before_anything_is_written(setup, tmp_path):
    _, target_dir, _, _, _ = setup
    garbage = tmp_path / "garbage.txt"
    garbage.write_bytes(np.random.default_rng(0).bytes(20_000))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_dspark.train", "--model", str(target_dir)]
        + ["--data", str(garbage), "--out", str(out), "--steps", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and "does not look like text" in lines[-1]
    assert "Traceback" not in proc.stderr and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["garbage.txt"]


def test_validation_sequences_are_held_out_and_measured(setup, monkeypatch):
    import mlx_dspark.training.run as train_module

    seen = []
    make = train_module._make_batch

    def spy(args, sequences, mask_token_id, vocab, indices, rng):
        seen.append(list(indices))
        return make(args, sequences, mask_token_id, vocab, indices, rng)

    monkeypatch.setattr(train_module, "_make_batch", spy)
    args = base_args(setup, "validated", steps=12, val_sequences=5, val_every=4)
    result = train(args)
    train_ids, val_ids = train_module._split(24, 5, args.seed)
    assert len(val_ids) == 5 and not set(val_ids) & set(train_ids)
    validation_batches, training_batches = seen[:2], seen[2:]
    assert sorted(sum(validation_batches, [])) == val_ids
    assert len(training_batches) == 12
    assert not set(sum(training_batches, [])) & set(val_ids)
    record = json.loads((result.out / "training_record.json").read_text())
    rows = record["validation"]
    assert [row[0] for row in rows] == [4, 8, 12]
    assert record["validation_columns"][:2] == ["step", "train_time_s"]
    assert rows[0][1] < rows[1][1] < rows[2][1]
    assert rows[-1][2] < rows[0][2]  # held-out loss falls
    with pytest.raises(DSparkError, match="leaves no training data"):
        train(base_args(setup, "none_left", val_sequences=24))


def test_validation_data_files_are_measured_through_their_own_store(setup, tmp_path):
    """--val-data: the curve is measured on held-out files, through a teacher
    store of their own; its last row is the exported drafter's loss on them."""
    root, target_dir, model, tokenizer, data = setup
    lines = data.read_text().splitlines(keepends=True)
    train_file, val_file = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train_file.write_text("".join(lines[:18]))
    val_file.write_text("".join(lines[18:]))
    store = tmp_path / "store"
    args = base_args(
        setup, "val_data", data=[str(train_file)], val_data=[str(val_file)],
        steps=8, val_every=4, teacher_store=str(store), draft_vocab=12,
    )  # fmt: skip
    result = train(args)
    record = json.loads((result.out / "training_record.json").read_text())
    assert [row[0] for row in record["validation"]] == [4, 8]
    assert [h["path"] for h in record["validation_data"]] == [str(val_file)]
    assert len(list(store.iterdir())) == 2  # training and validation stores

    import mlx_dspark.training.run as train_module

    _, _, drafter = load(target_dir, result.out)
    val_sequences, _ = load_sequences([val_file], tokenizer, 64)
    ids = np.asarray(drafter.draft_to_target)
    to_draft = np.full(32, -1, np.int32)
    to_draft[ids] = np.arange(len(ids))
    vocab = DraftVocabulary(ids, to_draft, 1.0)
    make = partial(train_module._make_batch, args, val_sequences, 31, vocab)
    batches = train_module._validation_batches(
        args, list(range(len(val_sequences))), make
    )
    teacher = OnlineTeacher(TargetAdapter(model, drafter.config.target_layer_ids), ids)
    expected = make_validation(drafter, teacher, batches)()
    assert np.allclose(record["validation"][-1][2:], expected, atol=2e-3)
    with pytest.raises(DSparkError, match="also training data"):
        train(base_args(setup, "same", val_data=[str(data)]))
    with pytest.raises(DSparkError, match="not both"):
        train(base_args(setup, "both", val_data=[str(val_file)], val_sequences=3))


def test_shards_average_to_the_whole_batch(setup):
    """Data parallelism: the mean over ranks of each shard's loss, metrics and
    gradients is the whole batch's."""
    _, _, model, tokenizer, data = setup
    sequences, _ = load_sequences([data], tokenizer, 64)
    drafter, target, _ = _tiny_drafter(model)
    teacher = OnlineTeacher(target, None)
    chosen = [0, 1, 2, 3, 4]
    batch = make_batch(
        [sequences[j] for j in chosen], 8, 5, 31, 4.0, np.random.default_rng(0)
    )
    loss_and_grad = nn.value_and_grad(drafter, loss_terms)

    def run(indices, part):
        (loss, terms), grads = loss_and_grad(drafter, *teacher(indices, part), part)
        return [loss, *terms], dict(tree_flatten(grads))

    whole_metrics, whole_grads = run(chosen, batch)
    shards = [run(chosen[r::2], shard(batch, r, 2)) for r in range(2)]
    assert shard(batch, 1, 2).supervised == batch.supervised  # the step's count
    for i, value in enumerate(whole_metrics):
        mean = (shards[0][0][i] + shards[1][0][i]) / 2
        assert mx.allclose(mean, value, rtol=1e-5, atol=1e-6).item(), i
    for name, grad in whole_grads.items():
        mean = (shards[0][1][name] + shards[1][1][name]) / 2
        assert mx.allclose(mean, grad, rtol=1e-4, atol=1e-6).item(), name
    assert not mx.allclose(shards[0][0][0], whole_metrics[0]).item()


def test_data_parallel_training_equals_one_process(setup, tmp_path):
    """``mlx.launch`` with two processes trains the drafter one process
    trains: each rank takes half of every step, gradients averaged."""
    _, target_dir, _, _, data = setup
    one = train(base_args(setup, str(tmp_path / "one"), steps=6))
    flags = [
        "--model", str(target_dir), "--data", str(data), "--out", str(tmp_path / "two"),
        "--steps", "6", "--batch-size", "4", "--anchors", "16", "--seq-len", "64",
        "--layers", "1", "--markov-rank", "16", "--lr", "3e-3", "--dtype", "float32",
        "--log-every", "5", "--quiet",
    ]  # fmt: skip
    launch = Path(sys.executable).with_name("mlx.launch")
    port = str(20000 + os.getpid() % 20000)
    subprocess.run(
        [str(launch), "-n", "2", "--backend", "ring", "--starting-port", port,
         sys.executable, "-m", "mlx_dspark.train", *flags],
        check=True, timeout=600, capture_output=True,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )  # fmt: skip
    record = json.loads((tmp_path / "two" / "training_record.json").read_text())
    assert record["processes"] == 2 and record["steps"] == 6
    assert (
        record["block_positions"]
        == json.loads((one.out / "training_record.json").read_text())["block_positions"]
    )
    a = mx.load(str(one.out / "model.safetensors"))
    b = mx.load(str(tmp_path / "two" / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert mx.allclose(a[name], b[name], rtol=1e-3, atol=1e-4).item(), name


def grown_from(
    setup, source_dir: Path, layers: int, markov_rank: int, markov_head="vanilla"
):
    """The drafter in ``source_dir`` and a fresh one of a larger shape
    started from it (as ``--init-from`` starts one)."""
    _, target_dir, model, _, _ = setup
    source = trained_drafter(source_dir, model)
    target = TargetAdapter(model, source.config.target_layer_ids)
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    config = drafter_config(
        target_config, target, layers=layers, block_size=source.block_size,
        markov_head=markov_head, markov_rank=markov_rank, anchors=16, confidence=True,
        mask_token_id=source.config.mask_token_id,
    )  # fmt: skip
    grown = new_drafter(config, target, 0)
    copy_trained_weights(grown, source, target)
    return source, grown


def assert_biases_as_before(source, grown):
    """``grown``'s sequential head biases the drafts, and its confidence head
    scores them, as ``source``'s do; returns the inputs and the bias."""
    prev = mx.array([[5, 7, 11, 2, 9]])
    hidden = mx.random.normal((1, 5, grown.config.hidden_size), key=mx.random.key(3))
    want = source.markov_head.block_bias(prev, hidden)
    assert mx.allclose(grown.markov_head.block_bias(prev, hidden), want, atol=1e-5)
    want_confidence = source.confidence(hidden, prev)
    assert mx.allclose(grown.confidence(hidden, prev), want_confidence, atol=1e-5)
    return prev, hidden, want


def test_init_from_a_shallower_drafter_grows_it(setup):
    """--layers above the --init-from drafter's adds layers on top, started
    from the target's with zeroed output projections: the grown drafter
    computes exactly what its source did, and training then moves them."""
    _, target_dir, model, _, _ = setup
    first = train(base_args(setup, "one_layer", steps=6))
    source, grown = grown_from(setup, first.out, layers=2, markov_rank=16)
    new = grown.layers[1]
    top = model.layers[-1]
    assert mx.array_equal(new.self_attn.q_proj.weight, top.self_attn.q_proj.weight)
    assert not mx.any(new.self_attn.o_proj.weight).item()
    assert not mx.any(new.mlp.down_proj.weight).item()
    context = mx.random.normal((1, 9, source.fc.weight.shape[1]), key=mx.random.key(3))
    block = source.block_tokens(mx.array([5]))
    want = source(block, 9, context, source.make_cache())
    got = grown(block, 9, context, grown.make_cache())
    assert mx.allclose(got, want, atol=1e-5)
    new.mlp.down_proj.weight = top.mlp.down_proj.weight
    changed = grown(block, 9, context, grown.make_cache())
    assert not mx.allclose(changed, want, atol=1e-3)

    result = train(
        base_args(setup, "grown", steps=4, layers=2, init_from=str(first.out))
    )
    trained = load(target_dir, result.out)[2]
    assert len(trained.layers) == 2
    assert mx.any(trained.layers[1].mlp.down_proj.weight).item()
    with pytest.raises(DSparkError, match="--layers \\(2, not 1\\)"):
        train(base_args(setup, "shrunk", steps=2, init_from=str(result.out)))


def test_init_from_a_lower_markov_rank_grows_the_head(setup):
    """--markov-rank above the --init-from drafter's widens its vanilla
    Markov head: the grown drafter's biases and confidences are its source's
    until training moves the new columns; a lower rank is refused."""
    target_dir = setup[1]
    first = train(base_args(setup, "rank16", steps=6))
    source, grown = grown_from(setup, first.out, layers=1, markov_rank=32)
    head = grown.markov_head
    assert head.markov_w1.weight.shape[1] == 32
    assert mx.all(head.markov_w1.weight[:, 16:] != 0).item()
    assert not mx.any(head.markov_w2.weight[:, 16:]).item()
    prev, hidden, want_bias = assert_biases_as_before(source, grown)
    kept, new = head.markov_w2.weight[:, :16], head.markov_w2.weight[:, 16:]
    head.markov_w2.weight = mx.concatenate([kept, mx.ones_like(new)], axis=1)
    assert not mx.allclose(head.block_bias(prev, hidden), want_bias, atol=1e-3)

    result = train(
        base_args(setup, "rank32", steps=4, markov_rank=32, init_from=str(first.out))
    )
    trained = load(target_dir, result.out)[2]
    assert mx.any(trained.markov_head.markov_w2.weight[:, 16:]).item()
    with pytest.raises(DSparkError, match="--markov-rank \\(32, not 16\\)"):
        train(base_args(setup, "lowered", steps=2, init_from=str(result.out)))


@pytest.fixture(scope="module")
def vanilla16(setup):
    return train(base_args(setup, "vanilla16", steps=6))


def test_init_from_a_vanilla_head_grows_it_into_a_wider_gated_head(setup, vanilla16):
    """A vanilla head grows into a gated head of a larger rank too (the
    shape check allows both at once): it biases the drafts as before."""
    source, grown = grown_from(setup, vanilla16.out, 1, 32, markov_head="gated")
    assert_biases_as_before(source, grown)


def test_init_from_a_vanilla_head_grows_it_into_a_gated_head(setup, vanilla16):
    """--markov-head gated from a vanilla --init-from drafter keeps its
    factors: the grown head biases the drafts exactly as the vanilla one did,
    training moves the gate, and the way back to vanilla is refused."""
    target_dir = setup[1]
    source, grown = grown_from(setup, vanilla16.out, 1, 16, markov_head="gated")
    assert_biases_as_before(source, grown)

    result = train(
        base_args(
            setup, "gated", steps=4, markov_head="gated", init_from=str(vanilla16.out)
        )
    )
    trained = load(target_dir, result.out)[2].markov_head
    assert mx.any(trained.gate_proj.weight != 0).item()
    with pytest.raises(DSparkError, match="--markov-head \\(gated, not vanilla\\)"):
        train(base_args(setup, "ungated", steps=2, init_from=str(result.out)))
