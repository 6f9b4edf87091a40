"""The ``mlx_dspark <command>`` family: same commands as the dotted scripts,
one-sentence errors, and command-line code only in ``mlx_dspark/cli/``."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import mlx_dspark.convert
import pytest

import mlx_dspark
from mlx_dspark.cli.main import COMMANDS
from mlx_dspark.pairs.structured import PairSpec, build_structured_pair

BIN = Path(sys.executable).parent


def run(argv, stdin=None):
    return subprocess.run(
        argv,
        input=stdin,
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "120"},
        timeout=300,
    )


def family(*args, stdin=None):
    return run([sys.executable, "-m", "mlx_dspark", *args], stdin)


def dotted(command, *args, stdin=None):
    return run([sys.executable, "-m", f"mlx_dspark.{command}", *args], stdin)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return [str(p) for p in build_structured_pair(tmp_path_factory.mktemp("fam"))]


def test_help_lists_every_command():
    result = family("--help")
    assert result.returncode == 0, result.stderr
    for name in ["generate", "convert", "calibrate", "train", "benchmark", "doctor"]:
        assert name in COMMANDS and f" {name} " in result.stdout
    bare = family()
    assert "generate" in bare.stdout + bare.stderr
    if (BIN / "mlx_dspark").exists():
        script = run([str(BIN / "mlx_dspark"), "--help"])
        assert script.returncode == 0 and " doctor " in script.stdout


def test_unknown_command_is_refused():
    one_sentence_error(family("no-such-command"), "no-such-command")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["doctor", "--no-such-flag"], "--no-such-flag"),
        (
            ["calibrate", "--model", "m", "--draft-model", "d", "--rounds", "x"],
            "--rounds",
        ),
        (["calibrate", "--draft-model", "d"], "--model"),
        (
            ["train", "--model", "m", "--data", "d", "--out", "o", "--steps", "x"],
            "--steps",
        ),
        (["benchmark", "--trials", "x"], "--trials"),
        (["convert", "--gguf", "a", "--draft-model", "b"], "Give one of"),
        (["convert", "--draft-model", "b", "--to", "onnx"], "--to must be one of"),
        (["generate", "--max-tokens", "x"], "--max-tokens"),
    ],
)
def test_bad_flags_are_one_sentence(argv, message):
    one_sentence_error(family(*argv), message)
    one_sentence_error(dotted(argv[0], *argv[1:]), message)


def test_a_negative_draft_count_names_the_flag_not_a_block_size(pair):
    target, drafter = pair
    args = ["--model", target, "--draft-model", drafter, "-p", "t1"]
    result = family("generate", *args, "--dspark-n-draft", "-3")
    one_sentence_error(result, "--dspark-n-draft must be at least 0, got -3")
    assert str(sys.maxsize) not in result.stderr


def test_convert_help_names_the_fast_cpu_dtype():
    result = family("convert", "--help")
    help_text = " ".join(result.stdout.split())
    assert "float16 (faster on CPU)" not in help_text
    assert "float32 runs fastest on CPU" in help_text


def test_first_run_says_it_measures_the_cost_profile(pair, tmp_path):
    target, drafter = pair
    args = ["--model", target, "--draft-model", drafter, "-p", "t1 t2", "-m", "4"]
    env = {**os.environ, "MLX_DSPARK_CACHE": str(tmp_path)}
    first = subprocess.run(
        [sys.executable, "-m", "mlx_dspark", "generate", *args],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    assert "Measuring this pair's cost profile" in first.stderr  # not a terminal
    again = subprocess.run(
        [sys.executable, "-m", "mlx_dspark", "generate", *args],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert "cost profile" not in again.stderr  # cached: nothing measured


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_command_help_is_the_commands_own(command):
    result = family(command, "--help")
    assert result.returncode == 0, result.stderr
    assert f"mlx_dspark {command}" in result.stdout
    assert "<bool>" not in result.stdout  # no placeholder beside a plain switch
    own = dotted(command, "--help")
    assert own.returncode == 0, own.stderr
    # The same flags, whichever way the command is run.
    flags = {w.strip("[],") for w in result.stdout.split() if w.startswith("--")}
    own_flags = {w.strip("[],") for w in own.stdout.split() if w.startswith("--")}
    assert flags == own_flags


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["--temp", "0.8", "--seed", "3", "--top-p", "0.9"],
        ["--num-draft-tokens", "2", "--verbose", "false"],
    ],
)
def test_family_generate_is_the_dotted_generate(pair, extra):
    target, drafter = pair
    args = ["--model", target, "--draft-model", drafter, "-p", "t1 t2 t3"]
    args += ["--max-tokens", "12", *extra]
    one = family("generate", *args)
    two = dotted("generate", *args)
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr

    def text(out):
        # The text must be equal; the summary after it may differ (timings, the
        # kinds of rounds a timing-driven policy chose, and only the run that
        # measured the cost profile names its file).
        lines = out.splitlines()
        ends = [i for i, line in enumerate(lines) if line == "=" * 10]
        return lines[: ends[1] + 1] if len(ends) > 1 else lines

    assert text(one.stdout) == text(two.stdout)
    assert "=" * 10 in one.stdout or extra[-1:] == ["false"]


def test_family_generate_reads_stdin_and_negative_values(pair):
    target, drafter = pair
    args = ["--model", target, "--draft-model", drafter, "-p", "-", "-m", "6"]
    one = family("generate", *args, stdin="t1 t2")
    two = dotted("generate", *args, stdin="t1 t2")
    assert one.returncode == two.returncode == 0, one.stderr
    assert one.stdout.split("=" * 10)[1] == two.stdout.split("=" * 10)[1]
    bad = family("generate", *args, "--temp", "-1", stdin="t1")
    assert bad.returncode == 1 and "--temp must be >= 0" in bad.stderr


def one_sentence_error(result, message):
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert message in lines[0], result.stderr


def test_errors_stay_one_sentence(pair, tmp_path):
    target, drafter = pair
    missing = str(tmp_path / "none")
    other_target, other_drafter = build_structured_pair(
        tmp_path / "other", PairSpec(hidden_size=48, head_dim=12)
    )
    for runner in (lambda *a: family(a[0], *a[1:]), dotted):
        # A missing model.
        one_sentence_error(
            runner("generate", "--model", missing, "-p", "t1"), "does not exist"
        )
        one_sentence_error(
            runner("calibrate", "--model", missing, "--draft-model", drafter),
            "does not exist",
        )
        one_sentence_error(
            runner("train", "--model", missing, "--data", missing, "--out", missing),
            "does not exist",
        )
        # A mismatched pair.
        one_sentence_error(
            runner(
                "generate",
                "--model",
                target,
                "--draft-model",
                str(other_drafter),
                "-p",
                "t1",
            ),  # fmt: skip
            "does not match",
        )
        # A bad flag value.
        one_sentence_error(
            runner(
                "calibrate",
                "--model",
                target,
                "--draft-model",
                drafter,
                "--rounds",
                "0",
            ),  # fmt: skip
            "--rounds must be at least 1",
        )
        one_sentence_error(
            runner(
                "benchmark",
                "--model",
                target,
                "--draft-model",
                drafter,
                "--max-tokens",
                "0",
            ),  # fmt: skip
            "--max-tokens",
        )
        # A plain model where a DSpark drafter is required.
        one_sentence_error(
            runner("calibrate", "--model", target, "--draft-model", target),
            "DSpark drafter",
        )
    assert other_target.exists()


def _package_files():
    roots = [Path(mlx_dspark.__file__).parent, Path(mlx_dspark.convert.__file__).parent]
    cli = Path(mlx_dspark.__file__).parent / "cli"
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if cli not in path.parents:
                yield path


CLI_ONLY = {"typer", "argparse", "rich.console", "click"}


def test_no_command_line_code_outside_the_cli_package():
    offenders = []
    for path in _package_files():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
                if node.module == "rich":
                    names += [f"rich.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                if any(name == m or name.startswith(m + ".") for m in CLI_ONLY):
                    offenders.append(f"{path.name}:{node.lineno} imports {name}")
    assert not offenders, offenders
    assert len(list(_package_files())) > 20


def test_library_reports_progress_through_callbacks(
    pair_factory, tmp_path, monkeypatch, capsys
):
    from mlx_dspark.policy.calibrate import calibrate_pair
    from mlx_dspark.policy.profile import get_profile

    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    model, tokenizer, drafter, *_ = pair_factory()
    calls = []
    get_profile(
        model, drafter, "refresh", contexts=(8,), repeats=1,
        progress=lambda done, total: calls.append((done, total)),
    )  # fmt: skip
    total = calls[-1][1]
    assert calls == [(done, total) for done in range(1, total + 1)]
    rounds = []
    calibrate_pair(
        model, tokenizer, drafter, prompts=["t1 t2 t3"], rounds=5, max_tokens=16,
        out=tmp_path / "calibration.json", plot=False,
        progress=lambda done, total: rounds.append((done, total)),
    )  # fmt: skip
    assert rounds and rounds[-1] == (5, 5)
    assert (tmp_path / "calibration.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    out, err = capsys.readouterr()
    assert out == "" and err == ""  # the library draws nothing


def test_train_progress_in_a_log_reports_every_stage(capsys):
    from mlx_dspark.cli.train import stage_progress

    with stage_progress(log_every=2, quiet=False) as progress:
        for done in range(8, 81, 8):
            progress("teacher store", min(done, 75), 75, "")
        for step in range(1, 4):
            progress("training", step, 3, "tau 1.0")
    lines = capsys.readouterr().out.splitlines()
    store = [line for line in lines if line.startswith("teacher store")]
    assert store[0] == "teacher store: 8/75" and store[-1] == "teacher store: 75/75"
    assert len(store) == 10
    assert [line for line in lines if line.startswith("step")] == [
        "step 2/3  tau 1.0",
        "step 3/3  tau 1.0",
    ]
