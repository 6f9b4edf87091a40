"""EAGLE-3 drafters against DeepSpec's own code and speculators' own classes.

The fixtures in tests/data/eagle3/ were written by
examples/make_eagle3_fixtures.py from DeepSpec's ``Qwen3Eagle3Model`` /
``Gemma4Eagle3Model`` and its greedy evaluator loop, and from speculators'
``Eagle3DraftModel``.
"""

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from eagle3_chain import generate_chain
from mlx_dspark.convert.__main__ import main as convert_main
from mlx_dspark.convert.eagle3 import convert_eagle3
from mlx_lm.utils import load_model
from test_sampling import chi_square, chi_square_critical, exact_joint
from test_seed import PROMPT, SEEDS, SETTINGS, mlx_lm_tokens

from mlx_dspark.checkpoints.eagle3 import (
    build_eagle3,
    is_eagle3,
    is_eagle3_path,
    load_eagle3,
    read_eagle3_config,
)
from mlx_dspark.checkpoints.loading import load_drafter
from mlx_dspark.errors import DSparkError
from mlx_dspark.pairs.eagle3_structured import EAGLE3_SPEC, build_eagle3_pair
from mlx_dspark.proposers.eagle3 import Eagle3Drafter
from mlx_dspark.sampling.processing import SamplingParams
from mlx_dspark.targets.adapter import TargetAdapter

DATA = Path(__file__).parent / "data" / "eagle3"
ROUNDS = json.loads((DATA / "qwen3_rounds.json").read_text())
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def target():
    model, _ = load_model(DATA / "target")
    return model


def scripted(drafter, script) -> tuple[np.ndarray, list[int]]:
    """The fixture's session: extend, draft four, extend two committed
    positions, draft three (the draft rows and tokens)."""
    n = int(script["prompt_positions"])
    features = mx.array(script["features"])
    tokens = mx.array(script["tokens"])
    cache = drafter.make_cache()
    drafter.extend(cache, features[:, :n], tokens[:, :n], 0)
    first = drafter.draft(cache, tokens[:, n - 1], n, 4, GREEDY)
    assert cache.length == n and cache.keys[0].shape[2] == n
    drafter.extend(cache, features[:, n:], tokens[:, n:], n)
    second = drafter.draft(cache, tokens[:, -1], n + 2, 3, GREEDY)
    rows = mx.concatenate([first.logits[0], second.logits[0]])
    drafts = first.tokens[0].tolist() + second.tokens[0].tolist()
    return np.array(rows), drafts


@pytest.mark.parametrize("flavour", ["qwen3", "gemma4"])
def test_draft_logits_match_deepspec(flavour):
    script = np.load(DATA / f"{flavour}_script.npz")
    drafter = load_eagle3(DATA / flavour)
    assert drafter.config.flavour == flavour
    rows, drafts = scripted(drafter, script)
    np.testing.assert_allclose(rows, script["logits"], atol=2e-4, rtol=1e-4)
    assert drafts == script["drafts"].tolist()


def test_greedy_rounds_match_deepspec_evaluator(target):
    drafter = load_eagle3(DATA / "qwen3", target)
    # The checkpoint's copies equal the target's: both are shared.
    assert "embed_tokens" not in drafter and "lm_head" not in drafter
    expected_logits = np.load(DATA / "qwen3_round_logits.npy")
    for index, run in enumerate(ROUNDS["runs"]):
        rounds = []
        out, lengths = generate_chain(
            target,
            drafter,
            run["prompt"],
            ROUNDS["max_new_tokens"],
            ROUNDS["ttt_length"],
            rounds=rounds,
        )
        rows = [np.array(proposal.logits[0]) for proposal, _ in rounds]
        drafts = [proposal.tokens[0].tolist() for proposal, _ in rounds]
        assert out[: ROUNDS["max_new_tokens"]] == run["output"]
        assert lengths == run["acceptance_lengths"]
        assert drafts == run["drafts"]
        if index == 0:
            np.testing.assert_allclose(rows[:2], expected_logits, atol=2e-4)
    every = [n for run in ROUNDS["runs"] for n in run["acceptance_lengths"]]
    # Drafts are often, not always, accepted.
    assert 2 < np.mean(every) < ROUNDS["ttt_length"] and min(every) == 1


def test_speculators_checkpoint_drafts_as_the_deepspec_one(target):
    raw = json.loads((DATA / "speculators_qwen3" / "config.json").read_text())
    assert is_eagle3(raw) and is_eagle3_path(DATA / "speculators_qwen3")
    drafter = load_eagle3(DATA / "speculators_qwen3", target)
    config = drafter.config
    assert config.reduced_vocab and config.draft_vocab_size == 23
    assert config.target_layer_ids == [0, 1, 2, 3, 4]
    eos = 22
    expected = [i for i in range(24) if i != eos]
    assert drafter.draft_to_target.tolist() == expected
    assert drafter.lm_head.weight.shape == (23, 32)
    reference = load_eagle3(DATA / "qwen3", target)
    for run in ROUNDS["runs"]:
        out, lengths = generate_chain(
            target, drafter, run["prompt"], ROUNDS["max_new_tokens"], 7
        )
        assert out[:40] == run["output"] and lengths == run["acceptance_lengths"]
    # The same rows on the draft vocabulary, nothing outside it.
    cache, ref_cache = drafter.make_cache(), reference.make_cache()
    features = mx.random.normal((1, 4, 160), key=mx.random.key(3))
    tokens = mx.array([[3, 4, 2, 16]])
    drafter.extend(cache, features, tokens, 0)
    reference.extend(ref_cache, features, tokens, 0)
    ours = np.array(drafter.draft(cache, tokens[:, -1], 4, 3, GREEDY).logits[0])
    theirs = np.array(reference.draft(ref_cache, tokens[:, -1], 4, 3, GREEDY).logits[0])
    assert np.all(np.isneginf(ours[:, eos]))
    np.testing.assert_allclose(ours[:, expected], theirs[:, expected], atol=1e-5)


def test_speculators_llama_layers_match_the_package():
    reference = np.load(DATA / "speculators_llama.npz")
    drafter = load_eagle3(DATA / "speculators_llama")
    config = drafter.config
    assert config.flavour == "llama" and config.norm_before_residual and config.fc_norm
    assert config.target_layer_ids == [0, 2, 5] and len(drafter.layers) == 2
    assert not drafter.layers[1].eagle
    assert drafter.draft_to_target.tolist() == reference["draft_to_target"].tolist()
    hidden = drafter(
        drafter.project(mx.array(reference["features"])),
        mx.array(reference["tokens"]),
        0,
    )
    logits = np.array(drafter.logits(hidden)[0])
    np.testing.assert_allclose(logits, reference["logits"], atol=2e-4, rtol=1e-4)


def reduced_copy(source: Path, out: Path, dropped: list[int]) -> Path:
    """``source`` (DeepSpec layout) with a reduced draft vocabulary in our own
    layout: ``draft_vocab_size`` and a ``draft_to_target`` tensor."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    weights = mx.load(str(out / "model.safetensors"))
    keep = [i for i in range(config["vocab_size"]) if i not in dropped]
    weights["lm_head.weight"] = weights["lm_head.weight"][mx.array(keep)]
    weights["draft_to_target"] = mx.array(keep, dtype=mx.int32)
    config["draft_vocab_size"] = len(keep)
    (out / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


SMALL = replace(EAGLE3_SPEC, vocab_size=10, sharpness=0.8, seed=1)
SAMPLING_PROMPT = [3, 1, 4]
SAMPLING_SEEDS = 800


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    directory = tmp_path_factory.mktemp("small")
    target_dir, drafter_dir = build_eagle3_pair(directory, SMALL)
    model, _ = load_model(target_dir)
    return model, drafter_dir


@pytest.mark.parametrize(
    "params,reduced",
    [
        (SamplingParams(temperature=1.0), False),
        (SamplingParams(temperature=0.7, top_p=0.9, top_k=6), True),
    ],
)
def test_sampling_is_exact(small_pair, tmp_path, params, reduced):
    model, drafter_dir = small_pair
    if reduced:
        drafter_dir = reduced_copy(drafter_dir, tmp_path / "reduced", [2, 7])
    drafter = load_eagle3(drafter_dir, model)
    assert drafter.config.reduced_vocab == reduced
    samples, accepted = Counter(), []
    for seed in range(SAMPLING_SEEDS):
        out, lengths = generate_chain(
            model, drafter, SAMPLING_PROMPT, 2, 3, params, seed=seed
        )
        samples[tuple(out[:3])] += 1
        accepted.append(lengths[0])
    joint = exact_joint(model, params, SAMPLING_PROMPT)
    stat, dof = chi_square(samples, joint, SAMPLING_SEEDS)
    assert stat < chi_square_critical(dof), (stat, dof)
    # The speculative path was taken: drafts kept in some rounds, not all.
    assert 1 < np.mean(accepted) < 4


@pytest.mark.parametrize("name", ["t1", "t0.8-minp-k"])
def test_seeded_coupled_output_is_mlx_lm_own(target, name):
    """Coupled sampling with EAGLE-3 drafts commits mlx-lm's own tokens."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(DATA / "target")
    drafter = load_eagle3(DATA / "qwen3", target)
    params = SETTINGS[name]
    kept = 0
    for seed in SEEDS:
        expected = mlx_lm_tokens(target, tokenizer, params, seed)
        out, lengths = generate_chain(
            target, drafter, PROMPT, len(expected), 7, params, seed, coupled=True
        )
        assert out[: len(expected)] == expected, seed
        kept += sum(lengths) - len(lengths)
    assert kept > 0


class FlatRows:
    """A drafter whose proposals claim uniform rows, not the ones drawn from."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.config = drafter.config
        self.make_cache, self.extend = drafter.make_cache, drafter.extend

    def draft(self, *args, **kwargs):
        proposal = self.drafter.draft(*args, **kwargs)
        proposal.logits = mx.zeros_like(proposal.logits)
        return proposal


def test_a_biased_draft_row_fails_the_sampling_test(small_pair):
    """The test above can fail: verifying against rows other than the ones
    the drafts were drawn from biases the output."""
    model, drafter_dir = small_pair
    drafter = FlatRows(load_eagle3(drafter_dir, model))
    params = SamplingParams(temperature=1.0)
    samples, seeds = Counter(), SAMPLING_SEEDS // 2
    for seed in range(seeds):
        out, _ = generate_chain(
            model, drafter, SAMPLING_PROMPT, 2, 3, params, seed=seed
        )
        samples[tuple(out[:3])] += 1
    stat, dof = chi_square(samples, exact_joint(model, params, SAMPLING_PROMPT), seeds)
    assert stat > chi_square_critical(dof)


def test_speculators_config_defaults_are_vllm_s():
    """Without taps the config takes speculators' default layers (2, L/2,
    L-3 in its counting), and without norm_before_residual vLLM's True."""
    raw = json.loads((DATA / "speculators_llama" / "config.json").read_text())
    del raw["eagle_aux_hidden_state_layer_ids"], raw["norm_before_residual"]
    with pytest.raises(DSparkError, match="load it with its target"):
        read_eagle3_config(raw)
    config = read_eagle3_config(raw, num_target_layers=12)
    assert config.target_layer_ids == [1, 5, 8] and config.norm_before_residual
    assert config.ttt_length == 7 and config.num_target_layers == 12


def test_dspark_configs_are_not_eagle3():
    assert not is_eagle3({"architectures": ["Qwen3DSparkModel"]})
    assert not is_eagle3({"speculators_model_type": "dspark"})
    assert is_eagle3({"architectures": ["Gemma4Eagle3Model"]})


def test_bad_checkpoints_get_one_sentence(tmp_path, target):
    broken = tmp_path / "missing"
    shutil.copytree(DATA / "qwen3", broken)
    weights = mx.load(str(broken / "model.safetensors"))
    del weights["layers.0.hidden_norm.weight"]
    mx.save_safetensors(str(broken / "model.safetensors"), weights)
    with pytest.raises(DSparkError, match="missing tensors: layers.0.hidden_norm"):
        load_eagle3(broken)
    config = json.loads((DATA / "qwen3" / "config.json").read_text())
    wrong = tmp_path / "wrong"
    shutil.copytree(DATA / "qwen3", wrong)
    (wrong / "config.json").write_text(json.dumps({**config, "hidden_size": 48}))
    with pytest.raises(DSparkError, match="hidden size 48"):
        load_eagle3(wrong, target)
    del config["target_layer_ids"]
    (wrong / "config.json").write_text(json.dumps(config))
    with pytest.raises(DSparkError, match="missing target_layer_ids"):
        load_eagle3(wrong)
    no_map = tmp_path / "no_map"
    shutil.copytree(DATA / "speculators_qwen3", no_map)
    weights = mx.load(str(no_map / "model.safetensors"))
    del weights["d2t"]
    mx.save_safetensors(str(no_map / "model.safetensors"), weights)
    with pytest.raises(DSparkError, match="has no d2t"):
        load_eagle3(no_map, target)
    with pytest.raises(DSparkError, match="not an EAGLE-3 drafter"):
        load_eagle3(DATA / "target")
    for source in ("qwen3", "speculators_qwen3"):  # the pair's loader takes them
        assert isinstance(load_drafter(DATA / source, target), Eagle3Drafter)


@pytest.mark.parametrize(
    "source,bits,tolerance",
    [("qwen3", 8, 0.05), ("speculators_qwen3", 4, 0.5), ("gemma4", 4, 0.5)],
)
def test_quantized_conversion_loads_back(tmp_path, source, bits, tolerance):
    out = tmp_path / "quantized"
    result = convert_eagle3(DATA / source, out, quantize=True, bits=bits, group_size=32)
    assert result.bits == bits and "fc" in result.quantized
    assert "layers.0.self_attn.q_proj" in result.quantized
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": bits}
    assert is_eagle3(config) and "speculators_config" not in config
    quantized = load_eagle3(out, dequantize=False)
    assert isinstance(quantized.fc, nn.QuantizedLinear)
    assert isinstance(quantized.layers[0].mlp.gate_proj, nn.QuantizedLinear)
    assert quantized.config.reduced_vocab == (source == "speculators_qwen3")
    script = np.load(DATA / f"{source.split('_')[-1]}_script.npz")
    rows, drafts = scripted(load_eagle3(out), script)
    reference, reference_drafts = scripted(load_eagle3(DATA / source), script)
    finite = np.isfinite(reference)
    assert np.array_equal(finite, np.isfinite(rows))
    error = np.abs(rows[finite] - reference[finite]).max()
    assert error < tolerance * np.abs(reference[finite]).max()
    if bits == 8:
        assert drafts == reference_drafts
        # Re-converting the quantized output to float is lossless from there.
        again = convert_eagle3(out, tmp_path / "float")
        assert again.bits is None
        np.testing.assert_allclose(
            scripted(load_eagle3(tmp_path / "float"), script)[0], rows, atol=1e-5
        )


def test_convert_cli_writes_an_eagle3_draft(tmp_path, target, capsys):
    out = tmp_path / "cli"
    convert_main(
        [
            "--draft-model",
            str(DATA / "speculators_llama"),
            "--out",
            str(out),
            "-q",
            "--q-group-size",
            "32",
        ]
    )
    assert "4-bit MLX EAGLE-3 drafter, llama" in capsys.readouterr().out
    drafter = load_eagle3(out)
    assert drafter.config.flavour == "llama" and drafter.config.norm_before_residual
    assert not drafter.layers[1].eagle
    with pytest.raises(SystemExit):
        convert_main(
            [
                "--draft-model",
                str(DATA / "qwen3"),
                "--out",
                str(out),
                "--to",
                "speculators",
            ]
        )
    assert "does not apply to EAGLE-3" in capsys.readouterr().err


def test_loads_from_a_hugging_face_repo_id(tmp_path):
    """A repo id resolves through the hub cache (offline here), as DSpark
    drafters' do."""
    snapshot = tmp_path / "models--org--eagle3-tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(DATA / "speculators_llama", snapshot)
    (tmp_path / "models--org--eagle3-tiny" / "refs").mkdir()
    (tmp_path / "models--org--eagle3-tiny" / "refs" / "main").write_text("0" * 40)
    code = (
        "from mlx_dspark.checkpoints.eagle3 import load_eagle3;"
        "print(load_eagle3('org/eagle3-tiny').config.flavour)"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert result.stdout.strip() == "llama", result.stderr


def test_gemma4_drafter_shares_a_gemma4_target_s_embedding_and_head():
    """Sharing the target's (scaled) embedding and (soft-capped) head gives
    the drafts own copies of them give."""
    from test_gemma4 import tiny_gemma4

    model = tiny_gemma4(seed=3)
    adapter = TargetAdapter(model, [0, 1, 2, 3, 4])
    raw = json.loads((DATA / "gemma4" / "config.json").read_text())
    raw.update(vocab_size=16, num_target_layers=6, final_logit_softcapping=4.0)
    config = read_eagle3_config(raw)
    weights = dict(mx.load(str(DATA / "gemma4" / "model.safetensors")))
    weights["embed_tokens.weight"] = adapter.embedding.weight
    weights["lm_head.weight"] = adapter.head.weight
    shared = build_eagle3(config, dict(weights), adapter)
    assert "embed_tokens" not in shared and "lm_head" not in shared
    own = build_eagle3(config, dict(weights), None)
    features = mx.random.normal((1, 5, 160), key=mx.random.key(1))
    tokens = mx.array([[3, 9, 1, 4, 12]])
    rows = []
    for drafter in (shared, own):
        cache = drafter.make_cache()
        drafter.extend(cache, features, tokens, 0)
        rows.append(np.array(drafter.draft(cache, tokens[:, -1], 5, 4, GREEDY).logits))
    np.testing.assert_allclose(rows[0], rows[1], atol=1e-5)
    assert np.abs(rows[0]).max() <= 4.0


def test_eagle31_feeds_back_normed_outputs_as_the_package():
    """norm_before_fc and norm_output (EAGLE 3.1): at every position, the
    first draft and the draft after the next true token equal the two
    training-time-test steps of speculators' own forward."""
    reference = np.load(DATA / "speculators_eagle31.npz")
    drafter = load_eagle3(DATA / "speculators_eagle31")
    config = drafter.config
    assert config.norm_before_fc and config.norm_output and not config.reduced_vocab
    features = mx.array(reference["features"])
    tokens = mx.array(reference["tokens"])
    first, second = [], []
    for p in range(tokens.shape[1] - 1):
        cache = drafter.make_cache()
        drafter.extend(cache, features[:, : p + 1], tokens[:, : p + 1], 0)
        first.append(mx.argmax(drafter.logits(cache.hidden)).item())
        hidden = drafter(cache.hidden, tokens[:, p + 1 : p + 2], p + 1, cache)
        second.append(mx.argmax(drafter.logits(hidden)).item())
    assert first == reference["drafts"][0, :-1].tolist()
    assert second == reference["drafts"][1, :-1].tolist()
