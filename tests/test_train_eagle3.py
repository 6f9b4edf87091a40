"""mlx_dspark.train --kind eagle3: the unrolled training forward, learning,
the written drafter, exact resume and bad input."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import test_train
from mlx_lm.generate import generate_step

from mlx_dspark.checkpoints.eagle3 import is_eagle3_path, load_eagle3
from mlx_dspark.errors import DSparkError
from mlx_dspark.proposers.eagle3 import Eagle3Drafter
from mlx_dspark.sampling.processing import SamplingParams
from mlx_dspark.targets.adapter import TargetAdapter
from mlx_dspark.training.data import Sequence
from mlx_dspark.training.eagle3 import (
    eagle3_config,
    eagle3_loss_terms,
    make_eagle3_batch,
    new_eagle3_drafter,
    unrolled_hidden,
)
from mlx_dspark.training.run import TrainArgs, train
from mlx_dspark.training.teacher import OnlineTeacher

# The structured target and its sampled training text (test_train's fixture).
setup = test_train.setup
_checkpoint_weights = test_train._checkpoint_weights
PROMPTS = [[1, 2, 3], [7, 8], [20, 4, 11, 9], [0], [13, 5, 5, 21, 2, 17]]
GREEDY = SamplingParams()


def base_args(setup, out, **changes) -> TrainArgs:
    """test_train's arguments (40 steps of 4 sequences of 64 tokens, one
    layer, float32) for an EAGLE-3 drafter unrolled 4 steps."""
    changes = {"kind": "eagle3", "ttt_length": 4, **changes}
    return test_train.base_args(setup, out, **changes)


def _tiny(model, ttt_length=3, draft_ids=None):
    target = TargetAdapter(model, [0, 1])
    config = eagle3_config(
        {"num_attention_heads": 4, "rope_theta": 10000.0},
        target,
        layers=1,
        ttt_length=ttt_length,
        draft_vocab_size=None if draft_ids is None else len(draft_ids),
    )
    return new_eagle3_drafter(config, target, 0, draft_ids), target


def read_eagle3(path: Path, model) -> Eagle3Drafter:
    """The written drafter through the EAGLE-3 loader (DeepSpec layout)."""
    assert is_eagle3_path(path)
    return load_eagle3(path, model)


def greedy_accepted_length(model, drafter, n=4) -> float:
    """Mean tokens a greedy round commits with ``n`` drafts, drafting by the
    drafter's own API and verifying against the target's greedy tokens."""
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    lengths = []
    for prompt in PROMPTS:
        truth = [*prompt]
        truth += [
            int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=40)
        ]
        tokens = mx.array([truth])
        _, features = target.hidden(tokens, target.make_cache())
        for start in range(len(prompt), len(truth) - n - 1, 3):
            cache = drafter.make_cache()
            drafter.extend(cache, features[:, :start], tokens[:, 1 : start + 1], 0)
            proposal = drafter.draft(cache, tokens[:, start], start, n, GREEDY)
            drafts = proposal.tokens[0].tolist()
            accepted = 0
            while accepted < n and drafts[accepted] == truth[start + 1 + accepted]:
                accepted += 1
            lengths.append(accepted + 1)
    return float(np.mean(lengths))


def test_unrolled_forward_equals_drafting(setup):
    """Step j at position t of the training forward is the drafter's j-th
    drafting step after t (fed the true tokens), cache and all."""
    _, _, model, _, _ = setup
    drafter, target = _tiny(model, ttt_length=3)
    tokens = mx.array([[3, 5, 7, 9, 11, 13, 2, 4, 6, 8, 10, 12], [1] * 12])
    _, features = target.hidden(tokens, target.make_cache())
    steps = unrolled_hidden(drafter, features, tokens, 3)
    for n in range(2):
        for t in (0, 3, 8):
            cache = drafter.make_cache()
            row = tokens[n : n + 1]
            drafter.extend(cache, features[n : n + 1, : t + 1], row[:, 1 : t + 2], 0)
            hidden = cache.hidden
            assert mx.allclose(steps[0][n, t], hidden[0, -1], atol=1e-5)
            for j in (1, 2):
                token = row[:, t + 1 + j : t + 2 + j]
                hidden = drafter(hidden, token, t + j, cache)
                assert mx.allclose(steps[j][n, t], hidden[0, -1], atol=1e-5), (n, t, j)


def test_batch_supervises_training_targets_with_decayed_weights():
    seqs = [
        Sequence(np.arange(10), np.array([0, 0, 0, 1, 1, 1, 1, 1, 0, 0], bool)),
        Sequence(np.arange(4), np.ones(4, bool)),
    ]
    batch = make_eagle3_batch(seqs, 3, decay=0.5, length=12)
    valid = np.array(batch.valid)
    assert batch.tokens.shape == (2, 12) and valid.shape == (2, 12, 3)
    # position t, step j predicts token t + 2 + j; chains stop at the mask.
    assert valid[0, 1].tolist() == [True, True, True]
    assert valid[0, 4].tolist() == [True, True, False]
    assert valid[0, 0].tolist() == [False, False, False]
    assert valid[1, 1].tolist() == [True, False, False]
    assert batch.supervised == int(valid.sum())
    weights = np.array(batch.weights)
    assert weights[0, 1].tolist() == pytest.approx([1 / 20, 0.5 / 20, 0.25 / 20])
    assert weights[1, 0, 0] == pytest.approx(1 / 8)


def test_loss_is_the_decayed_soft_cross_entropy(setup):
    """The loss by hand: every supervised (t, j) once, against the target's
    distribution of token t + 2 + j, with DeepSpec's weights."""
    _, _, model, _, _ = setup
    drafter, target = _tiny(model, ttt_length=2)
    tokens = np.array([[3, 5, 7, 9, 11, 13, 2, 4], [1, 2, 3, 4, 5, 6, 7, 8]])
    seqs = [Sequence(t, np.ones(8, bool)) for t in tokens]
    batch = make_eagle3_batch(seqs, 2)
    features, target_p, outside = OnlineTeacher(target, None)([0, 1], batch)
    loss, (ce, l1, conf, tau, greedy_tau) = eagle3_loss_terms(
        drafter, features, target_p, outside, batch
    )
    hidden = unrolled_hidden(drafter, features, batch.tokens, 2)
    p = np.array(target_p.reshape(2, 8, -1))
    expected = 0.0
    for j in range(2):
        logits = drafter.logits(hidden[j])
        logq = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        for n in range(2):
            for t in range(8 - 2 - j):
                ce_nt = -(p[n, t + 1 + j] * logq[n, t]).sum()
                expected += 0.8**j * ce_nt / (8 * 2)
    assert loss.item() == pytest.approx(expected, rel=1e-4)
    assert conf.item() == 0.0 and 1.0 <= greedy_tau.item() <= 3.0
    assert 1.0 <= tau.item() <= 3.0 and 0.0 <= l1.item() <= 2.0


@pytest.fixture(scope="module")
def eagle3_run(setup):
    return train(base_args(setup, "eagle3"))


def test_training_learns_and_the_written_drafter_loads_and_drafts(setup, eagle3_run):
    _, _, model, _, _ = setup
    result = eagle3_run
    assert result.status == "done"
    first, last = result.history[0], result.history[-1]
    assert last[1] < 0.7 * first[1], (first, last)  # total loss
    assert last[6] > first[6]  # teacher-forced greedy length
    out = result.out
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3Eagle3Model"]
    assert config["ttt_length"] == 4 and config["step_loss_decay"] == 0.8
    assert config["tie_word_embeddings"] is False
    names = set(mx.load(str(out / "model.safetensors")))
    assert {"fc.weight", "norm.weight", "layers.0.hidden_norm.weight"} <= names
    assert "layers.0.self_attn.q_proj.weight" in names
    assert "embed_tokens.weight" not in names
    record = json.loads((out / "training_record.json").read_text())
    assert record["arguments"]["kind"] == "eagle3" and record["steps"] == 40
    assert 0 < record["block_positions"] <= 40 * 4 * 64 * 4

    drafter = read_eagle3(out, model)
    config = eagle3_config(
        json.loads((out / "config.json").read_text()),
        TargetAdapter(model, drafter.config.target_layer_ids),
        layers=1,
        ttt_length=4,
    )
    untrained = new_eagle3_drafter(
        config, TargetAdapter(model, drafter.config.target_layer_ids), 0
    )
    before = greedy_accepted_length(model, untrained)
    after = greedy_accepted_length(model, drafter)
    assert after > before + 0.5, (before, after)


def test_reduced_draft_vocabulary(setup):
    _, _, model, _, _ = setup
    result = train(base_args(setup, "eagle3-reduced", draft_vocab=12, steps=10))
    config = json.loads((result.out / "config.json").read_text())
    assert config["draft_vocab_size"] == 12
    weights = mx.load(str(result.out / "model.safetensors"))
    assert weights["lm_head.weight"].shape[0] == 12
    assert weights["draft_to_target"].shape == (12,)
    drafter = read_eagle3(result.out, model)
    target = TargetAdapter(model, drafter.config.target_layer_ids)
    tokens = mx.array([[1, 2, 3, 4]])
    _, features = target.hidden(tokens, target.make_cache())
    cache = drafter.make_cache()
    drafter.extend(cache, features, mx.array([[2, 3, 4, 5]]), 0)
    proposal = drafter.draft(cache, mx.array([5]), 4, 3, GREEDY)
    allowed = set(np.array(weights["draft_to_target"]).tolist())
    assert set(proposal.tokens[0].tolist()) <= allowed


def test_quantized_export_drafts_as_the_float_one_nearly(setup, eagle3_run):
    _, _, model, _, _ = setup
    args = base_args(setup, "eagle3-q8", quantize_bits=8, quantize_group_size=32)
    result = train(args)
    config = json.loads((result.out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8}
    weights = mx.load(str(result.out / "model.safetensors"))
    assert "fc.scales" in weights and "layers.0.self_attn.q_proj.scales" in weights
    quantized = greedy_accepted_length(model, read_eagle3(result.out, model))
    full = greedy_accepted_length(model, read_eagle3(eagle3_run.out, model))
    assert quantized == pytest.approx(full, abs=0.3)


def test_resume_equals_uninterrupted(setup):
    whole = train(
        base_args(setup, "e-whole", steps=8, checkpoint_every=3, keep_checkpoint=True)
    )
    parts = base_args(
        setup, "e-parts", steps=8, checkpoint_every=3, keep_checkpoint=True
    )
    stopped = train(parts, should_stop=lambda step: step == 5)
    assert stopped.status == "interrupted" and stopped.step == 5
    resumed = train(replace(parts, resume=True))
    assert resumed.status == "done" and resumed.step == 8
    a, b = _checkpoint_weights(whole), _checkpoint_weights(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert mx.array_equal(a[name], b[name]).item(), name
    assert whole.history == resumed.history
    with pytest.raises(DSparkError, match="differ: .*ttt_length"):
        train(replace(parts, resume=True, ttt_length=3, force=True))


def test_validation_measures_held_out_sequences(setup):
    result = train(base_args(setup, "e-val", steps=4, val_sequences=4, val_every=2))
    record = json.loads((result.out / "training_record.json").read_text())
    steps = [row[0] for row in record["validation"]]
    assert steps == [2, 4]
    tau = record["validation_columns"].index("tau")
    assert all(1.0 <= row[tau] <= 5.0 for row in record["validation"])


def test_teacher_store_is_shared_with_dspark(setup, tmp_path):
    """One store serves both kinds (same data, taps and vocabulary)."""
    store = tmp_path / "store"
    train(base_args(setup, "e-store", steps=2, teacher_store=str(store)))
    train(
        base_args(
            setup, "d-store", kind="dspark", steps=2, anchors=8, markov_rank=8,
            teacher_store=str(store),
        )
    )  # fmt: skip
    assert len(list(store.iterdir())) == 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--ttt-length", "0"], "--ttt-length must be at least 1"),
        (["--init-from-target"], "--init-from-target is for DSpark drafters"),
        (["--kind", "medusa"], "--kind: invalid choice"),
    ],
)
def test_bad_input_is_one_sentence(setup, tmp_path, flags, message):
    _, target_dir, _, _, data = setup
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_dspark.train", "--model", str(target_dir),
         "--data", str(data), "--out", str(out), "--kind", "eagle3", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()
