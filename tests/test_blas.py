"""The BLAS loader's decisions (no library needed) and its effect in a process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlx_dspark.blas import ENV_VAR, choose_blas

LIB = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
OTHER = "/usr/lib64/libopenblasp.so.0"


def decide(env=None, platform="linux", imported=False, present=(LIB,), mapped=()):
    return choose_blas(
        env or {},
        platform,
        imported,
        [LIB, OTHER],
        lambda path: path in present,
        mapped,
    )


def test_loads_the_first_library_present():
    assert (decide().action, decide().library) == ("load", LIB)
    choice = decide(present=(OTHER,))
    assert (choice.action, choice.library) == ("load", OTHER)


def test_absent_library_changes_nothing():
    assert decide(present=()).action == "skip"


def test_mlx_imported_first_warns_with_the_fix():
    choice = decide(imported=True)
    assert choice.action == "warn"
    assert "import mlx_dspark first" in choice.reason
    assert f"LD_PRELOAD={LIB}" in choice.reason
    assert decide(imported=True, present=()).action == "skip"


def test_already_loaded_is_left_alone():
    assert decide(imported=True, mapped=[os.path.realpath(LIB)]).action == "skip"
    assert decide(env={"LD_PRELOAD": LIB}).action == "skip"


@pytest.mark.parametrize("value", ["reference", "REFERENCE", "off"])
def test_turned_off(value):
    assert decide(env={ENV_VAR: value}).action == "skip"


def test_explicit_path():
    choice = decide(env={ENV_VAR: OTHER}, present=(LIB, OTHER))
    assert (choice.action, choice.library) == ("load", OTHER)
    missing = decide(env={ENV_VAR: "/nowhere/libopenblas.so"})
    assert missing.action == "warn" and "does not exist" in missing.reason


def test_not_linux():
    assert decide(platform="darwin").action == "skip"


PROBE = """
import json, sys, pathlib
{first}
import mlx.core as mx
maps = pathlib.Path("/proc/self/maps").read_text()
print(json.dumps("openblas-pthread/libopenblas" in maps))
"""


def probe(first: str, env: dict | None = None) -> tuple[bool, str]:
    environ = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(first=first)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, **(env or {})},
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and Path(LIB).exists()),
    reason="needs Debian's OpenBLAS on Linux",
)
def test_import_loads_openblas_before_mlx():
    loaded, stderr = probe("import mlx_dspark")
    assert loaded and stderr == ""
    loaded, _ = probe("import mlx_dspark", {ENV_VAR: "reference"})
    assert not loaded
    loaded, stderr = probe("import mlx.core\nimport mlx_dspark")
    assert not loaded
    assert "imported before mlx_dspark" in stderr and len(stderr.splitlines()) == 1
