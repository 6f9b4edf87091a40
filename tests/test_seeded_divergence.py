"""examples/seeded_divergence.py: the key it computes for a token is the key
mlx-lm drew that token with, and it runs on a pair."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate as mlx_lm_stream_generate
from mlx_lm.sample_utils import make_sampler

from mlx_dspark import load
from mlx_dspark.pairs.structured import build_structured_pair

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "seeded_divergence.py"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_structured_pair(tmp_path_factory.mktemp("divergence"))


def _script():
    spec = importlib.util.spec_from_file_location("seeded_divergence", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_key_of_each_token_draws_mlx_lms_token(pair):
    target, _ = pair
    model, tokenizer, _ = load(target)
    prompt = [3, 1, 4, 1, 5]
    mx.random.seed(7)
    reference = list(
        mlx_lm_stream_generate(
            model, tokenizer, mx.array(prompt), max_tokens=24,
            sampler=make_sampler(1.5),
        )
    )  # fmt: skip
    explain = _script().explain
    for index in range(len(reference)):
        gap, drawn, _ = explain(model, prompt, reference, index, 7, 1.5)
        assert drawn[0] == reference[index].token, index
        assert gap < 1e-3


def test_first_difference():
    first_difference = _script().first_difference
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) is None


def test_runs_on_a_pair(pair, tmp_path):
    target, drafter = pair
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one two three\nfour five six\n")
    command = [
        sys.executable, str(SCRIPT), "--model", str(target), "--draft-model",
        str(drafter), "--prompts", str(prompts), "--max-tokens", "16",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("prompt ") == 2
    assert "identical" in result.stdout
