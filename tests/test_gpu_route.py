"""The GPU route (examples/gpu): the weight codec against MLX's dequantize
and, where PyTorch is installed, the PyTorch target, generation, drafter,
loss and gradients against mlx-dspark's on a tiny Llama."""

# isort: off
import mlx_dspark  # noqa: F401  (first: it loads a system OpenBLAS before mlx.core)

# isort: on
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from mlx_dspark.proposers.dspark_config import DraftConfig
from mlx_dspark.targets.adapter import TargetAdapter
from mlx_dspark.training.batches import make_batch
from mlx_dspark.training.data import Sequence
from mlx_dspark.training.loss import loss_terms
from mlx_dspark.training.model import new_drafter
from mlx_dspark.training.teacher import OnlineTeacher

GPU_ROUTE = Path(__file__).resolve().parents[1] / "examples" / "gpu"
sys.path.insert(0, str(GPU_ROUTE))
from codec import read_parts  # noqa: E402

VOCAB, MASK, BLOCK = 96, 95, 5


@pytest.mark.parametrize("script", ["pack.py", "install.py"])
def test_the_mlx_steps_start_from_any_directory(tmp_path, script):
    """The route's MLX steps import what they need when run as scripts, as
    its README runs them, from a directory that is not the repository's."""
    run = subprocess.run(
        [sys.executable, str(GPU_ROUTE / script), "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert "usage:" in run.stdout


@pytest.mark.parametrize("bits", [4, 8])
def test_codec_rebuilds_mlx_dequantize_bit_for_bit(tmp_path, bits):
    weight = mx.random.normal((48, 128)).astype(mx.float16)
    packed, scales, biases = mx.quantize(weight, group_size=32, bits=bits)
    if bits == 8:  # Q8_0: symmetric, the bias is -128 scales and is left out
        biases = scales * -128
    expected = mx.dequantize(packed, scales, biases, group_size=32, bits=bits)
    entries = {f"w|w{bits}": np.array(packed), "w|s": np.array(scales)}
    if bits == 4:
        entries["w|b"] = np.array(biases)
    entries["norm"] = np.linspace(0.5, 1.5, 7, dtype=np.float32)
    (tmp_path / "part").mkdir()
    np.savez_compressed(tmp_path / "part" / "weights.npz", **entries)
    rebuilt = read_parts([tmp_path / "part"])
    assert set(rebuilt) == {"w", "norm"}
    got = rebuilt["w"].view(np.uint32)
    assert np.array_equal(got, np.array(expected.astype(mx.float32)).view(np.uint32))
    assert np.array_equal(rebuilt["norm"], entries["norm"])


def test_pack_says_what_each_device_call_carries(tmp_path, capsys):
    import pack

    for folder, size in (("part-a", 65 * 2**20), ("part-b", 1000), ("data", 10)):
        (tmp_path / folder).mkdir()
        with open(tmp_path / folder / "blob", "wb") as f:
            f.truncate(size)  # sparse: the size counts, no disk is used
    pack.report_calls(tmp_path)
    lines = capsys.readouterr().out.splitlines()
    tree = pack.tree_bytes()
    assert tree is not None and tree > 0
    assert lines[0].startswith(
        f"first call (part-a): {(tree + 65 * 2**20) / 2**20:.1f}"
    )
    assert lines[1].startswith("warning: the first call (part-a) would carry more")
    assert lines[2].startswith(
        f"second call (part-b, data): {(tree + 1010) / 2**20:.1f}"
    )
    assert len(lines) == 3


try:
    import torch
    import torch_drafter as td
    from torch_target import Target, generate
except ImportError:  # PyTorch is the device's, not a dependency
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="PyTorch is not installed")


@needs_torch
def test_a_lost_stash_is_named_as_such(tmp_path):
    """A second call that lands on a fresh machine finds no stashed part-a:
    it stops with one sentence that says why and what to run, not a traceback."""
    lost = tmp_path / "no-part-b"
    stashed = f"/tmp/gpu-stash/part-a-{tmp_path.name}"
    run = subprocess.run(
        [sys.executable, str(GPU_ROUTE / "train.py"), "--parts", f"{stashed},{lost}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    assert f"{stashed} is gone: the machine" in run.stderr
    assert "run the --stash call again" in run.stderr
    elsewhere = subprocess.run(
        [sys.executable, str(GPU_ROUTE / "train.py"), "--parts", str(lost)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert elsewhere.returncode == 2
    assert "not a folder of pack.py's output" in elsewhere.stderr


@pytest.fixture(scope="module")
def tiny():
    """A tiny tied-embedding Llama (with a peaked head, so greedy has clear
    margins), its PyTorch twin and a one-layer drafter over a reduced vocabulary."""
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=96,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        vocab_size=VOCAB, rope_theta=10000.0, tie_word_embeddings=True,
    )  # fmt: skip
    model = llama.Model(args)
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 3
    mx.eval(model.parameters())
    config = DraftConfig.from_dict(
        {
            "architectures": ["Qwen3DSparkModel"], "hidden_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
            "vocab_size": VOCAB, "block_size": BLOCK, "mask_token_id": MASK,
            "target_layer_ids": [0, 2], "markov_rank": 8,
            "markov_head_type": "vanilla", "enable_confidence_head": True,
            "confidence_head_with_markov": True, "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5, "draft_vocab_size": 40,
        }
    )  # fmt: skip
    adapter = TargetAdapter(model, config.target_layer_ids)
    ids = np.sort(np.random.default_rng(0).choice(VOCAB, 40, replace=False))
    drafter = new_drafter(config, adapter, seed=3, draft_ids=ids)
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    twin = Target(weights, vars(args), tuple(config.target_layer_ids))
    return model, adapter, drafter, twin, ids


@needs_torch
def test_torch_target_matches_mlx(tiny):
    _, adapter, _, twin, _ = tiny
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 23))
    hidden, features = adapter.hidden(mx.array(tokens), adapter.make_cache())
    logits = adapter.lm_head(hidden)
    got_hidden, got_taps = twin(torch.tensor(tokens))
    assert np.allclose(got_hidden.numpy(), np.array(hidden), atol=1e-4)
    assert np.allclose(got_taps.numpy(), np.array(features), atol=1e-4)
    assert np.allclose(twin.logits(got_hidden).numpy(), np.array(logits), atol=1e-3)


@needs_torch
def test_batched_left_padded_generation_is_greedy_decoding(tiny):
    model, _, _, twin, _ = tiny
    prompts = [[3, 17, 5], [40, 2, 9, 11, 60, 7, 1], [8], [22, 23, 24, 25, 26]]
    stop = 7
    width = max(len(p) for p in prompts)
    padded = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    real = torch.tensor([[False] * (width - len(p)) + [True] * len(p) for p in prompts])
    positions = (real.cumsum(1) - 1).clamp(min=0)
    hidden, _ = twin(padded, positions, real, twin.make_cache(len(prompts), width))
    for row, prompt in enumerate(prompts):
        alone, _ = twin(torch.tensor([prompt]))
        assert np.allclose(hidden[row, -1].numpy(), alone[0, -1].numpy(), atol=1e-5)
    answers = generate(twin, prompts, 12, 0.0, {stop}, batch_size=3)
    for prompt, answer in zip(prompts, answers, strict=True):
        tokens, expected = list(prompt), []
        for _ in range(12):
            token = int(mx.argmax(model(mx.array([tokens]))[0, -1]))
            expected.append(token)
            tokens.append(token)
            if token == stop:
                break
        assert answer == expected, (prompt, answer, expected)


@needs_torch
def test_torch_drafter_loss_and_gradients_match_mlx(tiny):
    _, adapter, drafter, twin, ids = tiny
    rng = np.random.default_rng(2)
    sequences = []
    for length, start in ((30, 6), (19, 3), (26, 0)):
        tokens = rng.integers(0, VOCAB - 1, length).astype(np.int32)
        mask = np.arange(length) >= start
        sequences.append(Sequence(tokens, mask))
    to_draft = np.full(VOCAB, -1, np.int32)
    to_draft[ids] = np.arange(len(ids))
    batch = make_batch(
        sequences, 8, BLOCK, MASK, 4.0, np.random.default_rng(5), to_draft, 32
    )
    mine = td.make_batch(
        [(s.tokens, s.loss_mask) for s in sequences], 8, BLOCK, MASK, 4.0,
        np.random.default_rng(5), to_draft.astype(np.int64), 32,
    )  # fmt: skip
    for name, value in mine.items():
        assert np.array_equal(value, np.array(getattr(batch, name))), name

    taught = OnlineTeacher(adapter, ids)([0, 1, 2], batch)
    loss, terms = loss_terms(drafter, *taught, batch)
    grads = dict(
        tree_flatten(nn.value_and_grad(drafter, loss_terms)(drafter, *taught, batch)[1])
    )
    twin_drafter = td.Drafter(
        drafter.config.to_dict(),
        {k: np.array(v) for k, v in tree_flatten(drafter.parameters())},
        twin.embed,
    )
    assert set(twin_drafter.numpy_weights()) == {
        k for k, _ in tree_flatten(drafter.trainable_parameters())
    }
    tensors = td.to_device(mine, "cpu")
    got_taught = td.teacher(
        twin, tensors["tokens"], twin_drafter.draft_ids, tensors["positions"]
    )
    for got, expected in zip(got_taught, taught, strict=True):
        assert np.allclose(got.numpy(), np.array(expected), atol=1e-5)
    got_loss, got_terms = td.loss_terms(twin_drafter, *got_taught, tensors)
    got_loss.backward()
    assert abs(got_loss.item() - loss.item()) < 1e-4
    for got, expected in zip(got_terms, terms, strict=True):
        assert abs(got.item() - expected.item()) < 1e-4
    assert (
        terms[3].item() > 1.0 and terms[1].item() > 0.1
    )  # a loss with something to learn
    for name, grad in grads.items():
        got = twin_drafter.w(name).grad.numpy()
        assert np.allclose(got, np.array(grad), atol=1e-5), name
