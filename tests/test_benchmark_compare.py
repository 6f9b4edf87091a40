"""mlx_dspark.benchmark --compare: several drafters for one target, side by side."""

import json

import pytest
from test_benchmark import run_cli

from mlx_dspark.benchmark import REPORT_SCHEMA, validate
from mlx_dspark.benchmark.compare import parse_contender
from mlx_dspark.pairs.structured import PairSpec, build_structured_pair
from mlx_dspark.training.run import TrainArgs, train


@pytest.fixture(scope="module")
def drafters(tmp_path_factory):
    """A structured target with its DSpark drafter, a DFlash drafter (no
    Markov or confidence head) and an EAGLE-3 drafter trained for it."""
    root = tmp_path_factory.mktemp("compare")
    target_dir, dspark_dir = build_structured_pair(root / "pair", PairSpec())
    data = root / "data.txt"
    data.write_text(" ".join(f"t{(7 * i) % 30}" for i in range(400)) + "\n")
    common = dict(
        model=str(target_dir), data=[str(data)], steps=3, batch_size=2, seq_len=64,
        layers=1, dtype="float32", quiet=True,
    )  # fmt: skip
    dflash = train(
        TrainArgs(
            **common,
            out=str(root / "dflash"),
            markov_head="none",
            confidence=False,
            anchors=8,
        )  # fmt: skip
    ).out
    eagle3 = train(TrainArgs(**common, out=str(root / "eagle3"), kind="eagle3")).out
    return target_dir, dspark_dir, dflash, eagle3


def compare(target_dir, named, tmp_path, capsys, *more):
    path = tmp_path / "compare.json"
    argv = ["--model", str(target_dir), "--max-tokens", "16", "--trials", "1"]
    for name, directory in named:
        argv += ["--compare", f"{name}={directory}"]
    code, out, err = run_cli([*argv, "--json", str(path), *more], capsys)
    return code, out, err, path


def test_dspark_and_dflash_side_by_side(drafters, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    target_dir, dspark_dir, dflash_dir, _ = drafters
    named = [("dspark", dspark_dir), ("dflash", dflash_dir)]
    code, out, err, path = compare(target_dir, named, tmp_path, capsys)
    assert code == 0, err
    report = json.loads(path.read_text())
    assert validate(report, REPORT_SCHEMA) == []
    rows = [(r["drafter"], r["temperature"]) for r in report["records"]]
    assert rows == [
        ("target", 0.0), ("dspark", 0.0), ("dflash", 0.0),
        ("target", 1.0), ("dspark", 1.0), ("dflash", 1.0),
    ]  # fmt: skip
    for r in report["records"]:
        assert r["lossless"] is True, r  # greedy and seeded sampling alike
        if r["drafter"] != "target":
            assert r["num_draft"] == 7 and r["rounds"] > 0
            assert len(r["acceptance_by_position"]) == 7
            assert r["speedup"] > 0
    by = {(r["drafter"], r["temperature"]): r for r in report["records"]}
    # The structured drafter knows the target's map; 3 steps of DFlash do not.
    assert by["dspark", 1.0]["mean_accepted_length"] > 2.5
    assert (
        by["dspark", 1.0]["mean_accepted_length"]
        > by["dflash", 1.0]["mean_accepted_length"] + 1.0
    )
    assert "dflash" in out and "mean acc. len" in out and "BLAS" in out


def test_compare_n_and_temperatures(drafters, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    target_dir, dspark_dir, *_ = drafters
    code, _, err, path = compare(
        target_dir, [("d", dspark_dir)], tmp_path, capsys,
        "--compare-n", "3", "--temperatures", "0.7",
    )  # fmt: skip
    assert code == 0, err
    records = json.loads(path.read_text())["records"]
    assert [(r["drafter"], r["temperature"]) for r in records] == [
        ("target", 0.7),
        ("d", 0.7),
    ]
    assert records[1]["num_draft"] == 3 and records[1]["lossless"] is True


def test_eagle3_beside_dspark_and_dflash(drafters, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    target_dir, dspark_dir, dflash_dir, eagle3_dir = drafters
    named = [("dspark", dspark_dir), ("dflash", dflash_dir), ("eagle3", eagle3_dir)]
    code, _, err, path = compare(target_dir, named, tmp_path, capsys)
    assert code == 0, err
    records = json.loads(path.read_text())["records"]
    eagle3 = [r for r in records if r["drafter"] == "eagle3"]
    assert [r["temperature"] for r in eagle3] == [0.0, 1.0]
    assert all(r["lossless"] is True and r["num_draft"] == 7 for r in eagle3)


@pytest.mark.parametrize(
    "more, message",
    [
        (["--compare-n", "0"], "--compare-n must be at least 1"),
        (["--temperatures", "-1"], "--temperatures must be numbers >= 0"),
        (["--profile"], "--compare runs on its own; drop --profile."),
    ],
)
def test_bad_flags_are_one_sentence(drafters, tmp_path, capsys, more, message):
    target_dir, dspark_dir, *_ = drafters
    code, _, err, _ = compare(target_dir, [("d", dspark_dir)], tmp_path, capsys, *more)
    assert code != 0 and message in err and "Traceback" not in err


def test_a_missing_drafter_is_one_sentence(drafters, tmp_path, capsys):
    target_dir, *_ = drafters
    missing = tmp_path / "nowhere"
    code, _, err, _ = compare(target_dir, [("x", missing)], tmp_path, capsys)
    assert code != 0 and "Traceback" not in err and str(missing) in err


def test_contender_names():
    assert parse_contender("dflash=/tmp/a") == ("dflash", "/tmp/a")
    assert parse_contender("/runs/eagle3/") == ("eagle3", "/runs/eagle3/")
    assert parse_contender("runs/a=b") == ("a=b", "runs/a=b")
