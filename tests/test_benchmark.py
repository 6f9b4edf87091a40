"""mlx_dspark.benchmark: schema-valid records, sane values, parity traces, user errors."""

import copy
import json

import pytest

from mlx_dspark import benchmark
from mlx_dspark.benchmark import (
    RECORD_SCHEMA,
    REPORT_SCHEMA,
    Pair,
    Settings,
    first_divergence,
    measure,
    record_trace,
    records,
    select_variants,
    validate,
)
from mlx_dspark.cli.benchmark import main as benchmark_main

PROMPTS = [[1, 2, 3], [7, 8, 20, 4]]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    from mlx_dspark.loading import load
    from mlx_dspark.pairs.structured import PairSpec, build_structured_pair

    directory = tmp_path_factory.mktemp("bench-pair")
    target_dir, drafter_dir = build_structured_pair(directory, PairSpec(block_size=6))
    model, tokenizer, drafter = load(target_dir, drafter_dir)
    draft, _, _ = load(target_dir)
    pair = Pair(model, tokenizer, drafter, "small", mlx_lm_draft=draft)
    return pair, target_dir, drafter_dir


def run_cli(argv, capsys):
    try:
        benchmark_main(argv)
        code = 0
    except SystemExit as exit:
        code = exit.code
    out, err = capsys.readouterr()
    return code, out, err


def test_every_mode_gives_schema_valid_sane_records(small, tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path))
    pair, *_ = small
    settings = Settings(
        fixed_n=[2, 6], thresholds=[0.5], mlx_lm_num_draft=3, tree_budgets=[6]
    )
    modes = ["fixed", "threshold", "scheduler", "tree", "mlx-lm"]
    variants = select_variants(pair, settings, modes)
    names = [v.name for v in variants]
    assert names == [
        "target",
        "dspark-fixed-2",
        "dspark-fixed-6",
        "dspark-threshold-0.5",
        "dspark-scheduler",
        "dspark-tree-6",
        "mlx-lm-spec-3",
    ]
    results = measure(pair, variants, PROMPTS, MAX_TOKENS, trials=2)
    out = records(results, ceiling=1000.0, synthetic=False)
    for record in out:
        assert validate(record, RECORD_SCHEMA) == [], record
        assert record["speedup"] > 0
        assert record["lossless"] is True, record["mode"]
        assert len(record["tok_per_s_trials"]) == 2
        assert all(0 <= a <= 1 for a in record["acceptance_by_position"])
    by_name = {r["mode"]: r for r in out}
    assert by_name["target"]["speedup"] == 1.0
    assert len(by_name["dspark-fixed-2"]["acceptance_by_position"]) == 2
    assert len(by_name["dspark-fixed-6"]["acceptance_by_position"]) == 6
    assert by_name["dspark-fixed-6"]["mean_accepted_length"] > 1.5
    assert by_name["dspark-fixed-6"]["draft_time_s"] > 0
    # mlx-lm drafting with the target itself accepts every draft
    assert by_name["mlx-lm-spec-3"]["mean_accepted_length"] > 3


def test_validator_rejects_bad_records():
    record = {
        "mode": "x",
        "kind": "dspark",
        "tok_per_s": 0.0,
        "acceptance_by_position": [0.5, 1.5],
        "lossless": "yes",
    }
    errors = validate(record, RECORD_SCHEMA)
    text = "\n".join(errors)
    assert "$.tok_per_s: 0.0 must exceed 0" in text
    assert "$.acceptance_by_position[1]: 1.5 is above 1" in text
    assert "$.lossless: expected boolean or null" in text
    assert "missing 'speedup'" in text
    assert validate(float("nan"), {"type": "number"})


def test_cli_writes_valid_json(small, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    _, target_dir, drafter_dir = small
    path = tmp_path / "report.json"
    code, out, err = run_cli(
        [
            "--model",
            str(target_dir),
            "--draft-model",
            str(drafter_dir),
            "--max-tokens",
            "16",
            "--trials",
            "1",
            "--modes",
            "fixed,threshold",
            "--fixed-n",
            "6",
            "--json",
            str(path),
            "--plot",
            str(tmp_path / "plots"),
        ],
        capsys,
    )
    assert code == 0, err
    report = json.loads(path.read_text())
    assert validate(report, REPORT_SCHEMA) == []
    assert [r["mode"] for r in report["records"]] == [
        "target",
        "dspark-fixed-6",
        "dspark-threshold-0.5",
    ]
    assert all(r["lossless"] for r in report["records"])
    assert report["machine"]["ceiling_tok_per_s"] > 0
    assert "plain-decoding ceiling" in out and "BLAS" in out
    assert_readable_at_80_columns(report)
    try:
        import matplotlib  # noqa: F401

        assert (tmp_path / "plots" / "speed.png").stat().st_size > 0
    except ImportError:
        assert "matplotlib is not installed" in out


def test_parity_passes_same_backend_and_names_an_edited_token(small, tmp_path, capsys):
    _, target_dir, drafter_dir = small
    pair_args = ["--model", str(target_dir), "--draft-model", str(drafter_dir)]
    trace_path = tmp_path / "trace.json"
    code, _, err = run_cli(
        [
            *pair_args,
            "--prompts",
            "math",
            "-m",
            "20",
            "--parity-record",
            str(trace_path),
        ],
        capsys,
    )
    assert code == 0, err
    code, out, err = run_cli([*pair_args, "--parity-check", str(trace_path)], capsys)
    assert code == 0, err
    assert "parity ok" in out

    trace = json.loads(trace_path.read_text())
    prompt = trace["prompts"][1]
    offset = 1 + sum(r["accepted"] + 1 for r in prompt["rounds"][:2])
    prompt["tokens"][offset + 1] = (prompt["tokens"][offset + 1] + 1) % 30
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(trace))
    code, out, err = run_cli([*pair_args, "--parity-check", str(edited)], capsys)
    assert code == 1
    assert "prompt 2, round 3, position 2: expected token" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_first_divergence_in_generation_order(small):
    pair, *_ = small
    trace = record_trace(pair, PROMPTS[:1], 20)["prompts"][0]
    assert first_divergence(trace, copy.deepcopy(trace)) is None
    changed = copy.deepcopy(trace)
    changed["rounds"][1]["checksums"][0][0] += 1.0
    changed["tokens"][-1] += 1  # later than the checksum: not the first
    assert first_divergence(trace, changed).startswith(
        "round 2, position 1: draft logit checksums"
    )
    shorter = copy.deepcopy(trace)
    shorter["rounds"].pop()
    assert "got the end of generation" in first_divergence(trace, shorter)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompts", "poetry"], "Unknown prompt set 'poetry'"),
        (["--prompts", "/no/such/prompts.txt"], "does not exist"),
        (["--parity-check", "/no/such/trace.json"], "does not exist"),
        (["--modes", "fixed,warp"], "Unknown mode 'warp'"),
        (["--synthetic", "70b"], "Unknown synthetic size '70b'"),
        (["--trials", "0"], "--trials must be at least 1"),
    ],
)
def test_bad_input_is_one_sentence(argv, message, capsys):
    code, _, err = run_cli(argv, capsys)
    assert code == 1
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_not_a_trace_is_refused(tmp_path, capsys, small):
    _, target_dir, drafter_dir = small
    path = tmp_path / "x.json"
    path.write_text("[1, 2]")
    code, _, err = run_cli(
        [
            "--model",
            str(target_dir),
            "--draft-model",
            str(drafter_dir),
            "--parity-check",
            str(path),
        ],
        capsys,
    )
    assert code == 1 and "not an mlx-dspark parity trace" in err


def test_profile_splits_a_round_into_every_stage(small, capsys):
    from mlx_dspark.policy.roundprofile import STAGES, profile_rounds

    pair, target_dir, drafter_dir = small
    profile = profile_rounds(pair.adapter, pair.drafter, PROMPTS, MAX_TOKENS, 6)
    assert all(profile[s] >= 0 for s in STAGES if s != "host sync / Python")
    assert profile["round (instrumented)"] == pytest.approx(
        sum(profile[s] for s in STAGES)
    )
    assert profile["target forward"] > 0 and profile["drafter backbone"] > 0
    # Accepted drafts make fewer rounds than tokens.
    assert 0 < profile["rounds"] < len(PROMPTS) * (MAX_TOKENS - 1)
    code, out, err = run_cli(
        [
            "--model",
            str(target_dir),
            "--draft-model",
            str(drafter_dir),
            "--max-tokens",
            "12",
            "--fixed-n",
            "1,6",
            "--profile",
        ],
        capsys,
    )
    assert code == 0, err
    for stage in STAGES:
        assert stage in out
    assert "fixed-1" in out and "fixed-6" in out
    assert "adapter / mlx-lm" in out
    verify = out[out.index("adapter / mlx-lm") :]
    sizes = [line.split("│")[1].strip() for line in verify.splitlines()[2:6]]
    assert sizes == ["1", "2", "4", "8"]


def test_default_mode_fixed_zero_and_a_useless_drafter(
    small, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("MLX_DSPARK_CACHE", str(tmp_path / "cache"))
    _, target_dir, drafter_dir = small
    path = tmp_path / "report.json"
    code, out, err = run_cli(
        [
            "--model",
            str(target_dir),
            "--draft-model",
            str(drafter_dir),
            "--max-tokens",
            "16",
            "--trials",
            "1",
            "--modes",
            "default,fixed",
            "--fixed-n",
            "0",
            "--useless-drafter",
            "--json",
            str(path),
        ],
        capsys,
    )
    assert code == 0, err
    records = {r["mode"]: r for r in json.loads(path.read_text())["records"]}
    assert set(records) == {"target", "dspark-default", "dspark-fixed-0"}
    assert all(r["lossless"] for r in records.values())
    assert records["dspark-fixed-0"]["acceptance_by_position"] == []
    assert "useless (random) drafter" in out


def test_randomized_weights_keep_shapes(small):
    from mlx.utils import tree_flatten

    from mlx_dspark.loading import load

    _, target_dir, drafter_dir = small
    _, _, drafter = load(target_dir, drafter_dir)
    before = dict(tree_flatten(drafter.parameters()))
    benchmark.randomize_weights(drafter)
    after = dict(tree_flatten(drafter.parameters()))
    assert {k: v.shape for k, v in before.items()} == {
        k: v.shape for k, v in after.items()
    }
    changed = [k for k in before if not (before[k] == after[k]).all().item()]
    assert len(changed) >= len(before) - 2


def assert_readable_at_80_columns(report):
    import io

    from rich.console import Console

    from mlx_dspark.cli.benchmark import render

    console = Console(width=80, file=io.StringIO(), record=True)
    render(report, console)
    text = console.export_text()
    assert "\u2026" not in text  # nothing squeezed to an ellipsis
    for r in report["records"]:
        assert f"{r['speedup']:.2f}x" in text and f"{r['mode']}: tok/s" in text
    assert "1 trial," in text and "x ceiling:" in text
    table = [line for line in text.splitlines() if line[:1] in "┏┃┡│└"]
    assert table and max(len(line) for line in table) <= 80
