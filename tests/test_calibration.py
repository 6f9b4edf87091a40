import itertools
import json
import math
import subprocess
import sys

import numpy as np
import pytest

from mlx_dspark.errors import DSparkError
from mlx_dspark.policy.calibration import (
    CalibrationRecord,
    CalibrationResult,
    OffsetFit,
    _logistic,
    apply_sts,
    calibrate,
    evaluate,
    expected_calibration_error,
    fit_sts,
    fit_sts_offset,
    prefix_labels,
    records_to_arrays,
    roc_auc,
    sigmoid,
)

T_TRUE = np.array([2.5, 0.5, 1.5, 1.0])


def synthetic_rounds(n, t_true, seed):
    """Raw logits z; draft k survives (given 1..k-1 did) with p = sigmoid(z/T_k)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(3.0, 3.0, size=(n, len(t_true)))
    accepted = rng.random(z.shape) < sigmoid(z / np.asarray(t_true))
    return z, prefix_labels(accepted)


def brute_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    total = sum(
        1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg)
    )
    return total / (len(pos) * len(neg))


def test_auc_simple_cases():
    assert roc_auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert roc_auc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == 0.0
    assert roc_auc([0.5, 0.5, 0.5, 0.5], [0, 1, 0, 1]) == 0.5
    assert math.isnan(roc_auc([0.1, 0.2], [1, 1]))
    assert math.isnan(roc_auc([0.1, 0.2], [0, 0]))


@pytest.mark.parametrize("seed", range(5))
def test_auc_matches_pairwise_brute_force_with_ties(seed):
    rng = np.random.default_rng(seed)
    scores = rng.integers(0, 6, size=40) / 5.0  # many ties
    labels = rng.random(40) < 0.4
    assert roc_auc(scores, labels) == pytest.approx(
        brute_auc(scores, labels), abs=1e-12
    )


def test_ece_simple_cases():
    assert expected_calibration_error([1.0, 1.0], [1, 1]) == 0.0
    assert expected_calibration_error([0.0, 0.0], [1, 1]) == 1.0
    # one bin holding 0.3 and 0.5, outcomes 1 and 0: |0.4 - 0.5| = 0.1
    assert expected_calibration_error([0.3, 0.5], [1, 0], n_bins=1) == pytest.approx(
        0.1
    )
    # two bins: |0.2 - 0| * 1/2 + |0.9 - 1| * 1/2
    assert expected_calibration_error([0.2, 0.9], [0, 1], n_bins=2) == pytest.approx(
        0.15
    )


def test_records_mark_unreached_as_zero_and_uncut_as_unknown():
    recs = [
        CalibrationRecord(np.arange(4.0), n_verified=4, n_accepted=1),  # fail at 2
        CalibrationRecord(np.arange(4.0), n_verified=2, n_accepted=2),  # cut after 2
        CalibrationRecord(np.arange(4.0), n_verified=2, n_accepted=0),  # fail at 1
    ]
    logits, survived, valid = records_to_arrays(recs)
    assert logits.shape == (3, 4)
    assert survived.astype(int).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert valid.astype(int).tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]]


def test_apply_sts_products():
    z = np.array([[0.0, 2.0, -2.0]])
    c, a = apply_sts(z, [1.0, 2.0, 0.5])
    assert c[0].tolist() == pytest.approx([0.5, sigmoid(1.0), sigmoid(-4.0)])
    assert a[0].tolist() == pytest.approx(np.cumprod(c[0]).tolist())
    c1, a1 = apply_sts(z[0, :2], [1.0, 2.0, 0.5])  # one round, fewer positions
    assert a1.tolist() == pytest.approx(a[0, :2].tolist())
    with pytest.raises(ValueError):
        apply_sts(np.zeros(4), [1.0])


def test_sts_recovers_temperatures_and_calibrates():
    z, survived = synthetic_rounds(20_000, T_TRUE, seed=0)
    result = calibrate(z, survived)
    temps = np.array(result.temperatures)
    # Relative error |log(T / T_true)|: positions 1-3 within 15 %, position 4
    # (only ~40 % of rounds reach it) within 25 %; seeds 0-9 stay inside both.
    rel = np.abs(np.log(temps / T_TRUE))
    assert rel[:3].max() < 0.15 and rel[3] < 0.25, temps
    assert max(result.ece_after) < 0.03
    assert result.ece_before[0] > 0.1  # T_1 = 2.5: raw scores badly over-confident
    assert all(a < b for a, b in zip(result.ece_after, result.ece_before, strict=True))
    # held-out rounds: fitted temperatures stay calibrated
    z2, s2 = synthetic_rounds(20_000, T_TRUE, seed=1)
    held = evaluate(z2, s2, temps)
    assert max(held.ece_after) < 0.03
    assert result.n_rounds == 20_000


def test_sts_is_sequential():
    """Changing position 3's data must not change T_1, T_2."""
    z, survived = synthetic_rounds(5_000, T_TRUE, seed=2)
    t_a = fit_sts(z, survived)
    z_b = z.copy()
    z_b[:, 2] *= 3.0
    t_b = fit_sts(z_b, survived)
    assert t_a[:2].tolist() == t_b[:2].tolist()
    assert t_a[2] != t_b[2]


def test_sts_respects_valid_mask():
    z, survived = synthetic_rounds(5_000, T_TRUE, seed=3)
    valid = np.ones_like(survived)
    valid[:, 3] = False
    temps = fit_sts(z, survived, valid=valid)
    assert temps[3] == 1.0  # no data: left at identity
    assert temps[:3].tolist() == fit_sts(z[:, :3], survived[:, :3]).tolist()


W_TRUE, B_TRUE = np.array([1.5, 0.0, 1.0, 0.5]), np.array([-1.0, 0.5, -0.5, 0.0])


def biased_rounds(n, seed):
    """Logits z and top log-probabilities t; draft k survives (given 1..k-1
    did) with p = sigmoid(z/T_k + w_k t_k + b_k)."""
    rng = np.random.default_rng(seed)
    z = rng.normal(2.0, 2.0, size=(n, len(T_TRUE)))
    t = -rng.exponential(1.0, size=z.shape)
    p = sigmoid(z / T_TRUE + W_TRUE * t + B_TRUE)
    return z, t, prefix_labels(rng.random(z.shape) < p)


def test_offset_fit_recovers_the_parameters_and_removes_a_bias_sts_cannot():
    z, t, survived = biased_rounds(40_000, seed=0)
    temps, weights, offsets, *_ = fit_sts_offset(z, t, survived)
    # Positions 1-3 within 0.2 of every parameter (1 / T for the temperature),
    # position 4 (fewer rounds reach it) within 0.35; seeds 0-9 stay within
    # 0.14 and 0.17.
    scale_error = np.abs(1 / temps - 1 / T_TRUE)
    error = np.maximum.reduce([scale_error, np.abs(weights - W_TRUE),
                               np.abs(offsets - B_TRUE)])  # fmt: skip
    assert error[:3].max() < 0.2 and error[3] < 0.35, (temps, weights, offsets)
    z2, t2, s2 = biased_rounds(40_000, seed=1)
    extended = evaluate(z2, s2, temps, tops=t2, top_weights=weights, offsets=offsets)
    plain = evaluate(z2, s2, fit_sts(z, survived))
    assert max(extended.ece_after) < 0.02
    assert plain.ece_after[0] > 0.1  # a temperature cannot absorb b_1 and w_1 t_1
    assert extended.auc_after[0] > plain.auc_after[0] + 0.03
    assert extended.top_weights == weights.tolist()


def copied_rounds(rng, n, copy_true, logit_true, top_true):
    """``biased_rounds`` where a draft whose row carried a context-copy bias
    (40% of them) survives with its own offset and slopes on z and t."""
    z, t, _ = biased_rounds(n, seed=int(rng.integers(1 << 30)))
    c = rng.random(z.shape) < 0.4
    x = z / T_TRUE + W_TRUE * t + B_TRUE
    p = sigmoid(x + c * (copy_true + logit_true * z + top_true * t))
    return z, t, c, prefix_labels(rng.random(z.shape) < p), p


def copied_error(fit, z, t, c, p):
    """Mean |fitted - true| survival chance of copied drafts at positions 1-3."""
    fitted = apply_sts(z, tops=t, copied=c, **fit._asdict())[0]
    return max(np.abs(fitted - p)[c[:, k], k].mean() for k in range(3))


def test_copy_flags_get_their_own_weight():
    """Rows that carried a context-copy bias survive at their own rate: the
    fit recovers their chance, and a calibration that reads the flags is
    calibrated where one that does not is not."""
    rng = np.random.default_rng(3)
    copy_true = np.array([1.5, 1.0, -0.5, 0.0])
    zero = np.zeros(4)
    z, t, c, survived, p = copied_rounds(rng, 40_000, copy_true, zero, zero)
    fit = fit_sts_offset(z, t, survived, copied=c)
    assert copied_error(fit, z, t, c, p) < 0.02, fit
    blind = fit_sts_offset(z, t, survived)
    z2, t2, c2, s2, _ = copied_rounds(rng, 40_000, copy_true, zero, zero)
    seeing = evaluate(z2, s2, tops=t2, copied=c2, **fit._asdict())
    unseeing = evaluate(z2, s2, blind.temperatures, tops=t2,
                        top_weights=blind.top_weights, offsets=blind.offsets)  # fmt: skip
    assert seeing.auc_after[0] > unseeing.auc_after[0] + 0.01
    assert seeing.copy_weights == fit.copy_weights.tolist()
    survival = seeing.survival(z2[0], t2[0], c2[0])
    assert np.allclose(
        survival, apply_sts(z2[0], tops=t2[0], copied=c2[0], **fit._asdict())[1]
    )


def test_copied_drafts_get_their_own_slopes():
    """Where the head's logit and the drafter's top log-probability say less
    of a copied draft than of the drafter's own, the fit gives copied drafts
    their own slopes: recovered, and the copied drafts' survival is then
    calibrated on fresh rounds, where a shared slope leaves it off."""
    rng = np.random.default_rng(4)
    copy_true = np.array([0.5, 0.5, 0.0, 0.0])
    logit_true = -0.8 / T_TRUE  # copied drafts: the head says a fifth as much
    top_true = np.array([-1.0, -0.5, 0.0, 0.0])
    z, t, c, survived, p = copied_rounds(rng, 40_000, copy_true, logit_true, top_true)
    fit = fit_sts_offset(z, t, survived, copied=c)
    assert copied_error(fit, z, t, c, p) < 0.02, fit
    z2, t2, c2, s2, _ = copied_rounds(rng, 40_000, copy_true, logit_true, top_true)
    labels = prefix_labels(s2)[:, 0]
    copied = c2[:, 0]
    own_slopes = apply_sts(z2, tops=t2, copied=c2, **fit._asdict())[1][:, 0]
    shared = _shared_slope_fit(z, t, c, survived)
    shared_slope = apply_sts(z2, tops=t2, copied=c2, **shared._asdict())[1][:, 0]
    own_ece = expected_calibration_error(own_slopes[copied], labels[copied])
    shared_ece = expected_calibration_error(shared_slope[copied], labels[copied])
    assert own_ece < 0.02 and shared_ece > 2 * own_ece, (own_ece, shared_ece)


def _shared_slope_fit(z, t, c, survived):
    """Position 1 fitted as before copied drafts had their own slopes: one
    logistic regression on (z, t, copied)."""
    w = _logistic(np.stack([z[:, 0], t[:, 0], c[:, 0]], 1), survived[:, 0], 1.0)
    ones, zeros = np.ones(4), np.zeros(4)
    return OffsetFit(
        ones * 1 / w[0], ones * w[1], ones * w[3], ones * w[2], zeros, zeros
    )


def test_offset_fit_reads_only_rounds_that_reached_each_position():
    """Position k is fitted on rounds whose prefix 1..k-1 was accepted: what
    happens after a rejection cannot move it, and an unreached position
    keeps the identity."""
    z, t, survived = biased_rounds(5_000, seed=2)
    fitted = fit_sts_offset(z, t, survived)
    z_b, t_b = z.copy(), t.copy()
    after_rejection = ~prefix_labels(survived)[:, 0]
    z_b[after_rejection, 1:] = 50.0
    t_b[after_rejection, 1:] = -50.0
    refitted = fit_sts_offset(z_b, t_b, survived)
    assert all(np.allclose(a, b) for a, b in zip(fitted, refitted, strict=True))
    valid = np.ones_like(survived)
    valid[:, 3] = False
    temps, weights, offsets, *_ = fit_sts_offset(z, t, survived, valid=valid)
    assert (temps[3], weights[3], offsets[3]) == (1.0, 0.0, 0.0)


def test_a_plain_sts_file_still_calibrates_as_sts(tmp_path):
    """A calibration written before offsets and top weights existed loads
    and gives plain STS survival; an extended one needs the top log-probs."""
    z, survived = synthetic_rounds(2_000, T_TRUE, seed=5)
    data = json.loads(json.dumps(calibrate(z, survived).__dict__))
    for key in ("top_weights", "offsets"):
        del data[key]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = CalibrationResult.load(path)
    assert np.allclose(old.survival(z[0]), apply_sts(z[0], old.temperatures)[1])
    extended = CalibrationResult(**{**data, "top_weights": [1.0] * 4,
                                    "offsets": [0.5] * 4})  # fmt: skip
    tops = np.full(4, -0.5)
    expected = np.cumprod(sigmoid(z[0] / np.array(old.temperatures) + 1.0 * tops + 0.5))
    assert np.allclose(extended.survival(z[0], tops), expected)
    with pytest.raises(ValueError, match="top log-probabilities"):
        extended.survival(z[0])


def test_result_save_load_roundtrip(tmp_path):
    z, survived = synthetic_rounds(2_000, T_TRUE, seed=4)
    result = calibrate(z, survived)
    result.auc_after[0] = float("nan")
    path = tmp_path / "sts.json"
    result.save(path)
    json.loads(path.read_text())  # strict JSON (no NaN tokens)
    assert "NaN" not in path.read_text()
    loaded = CalibrationResult.load(path)
    assert loaded.temperatures == result.temperatures
    assert loaded.ece_after == result.ece_after
    assert math.isnan(loaded.auc_after[0])
    assert loaded.n_rounds == result.n_rounds
    assert len(loaded.reliability_after) == 4


def test_load_errors_are_user_errors(tmp_path):
    with pytest.raises(DSparkError, match="does not exist"):
        CalibrationResult.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(DSparkError, match="not a valid"):
        CalibrationResult.load(bad)


def test_reliability_diagram(tmp_path):
    z, survived = synthetic_rounds(2_000, T_TRUE, seed=5)
    result = calibrate(z, survived)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(DSparkError, match="matplotlib"):
            result.reliability_diagram(tmp_path / "rel.png")
    else:
        out = result.reliability_diagram(tmp_path / "rel.png")
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reliability_diagram_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    z, survived = synthetic_rounds(500, T_TRUE, seed=6)
    with pytest.raises(DSparkError, match=r"mlx-dspark\[plot\]"):
        calibrate(z, survived).reliability_diagram(tmp_path / "rel.png")
    assert not (tmp_path / "rel.png").exists()


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--max-tokens", "-5", "--max-tokens must be at least 2"),
        ("--rounds", "0", "--rounds must be at least 1"),
        ("--temp", "-1", "--temp must be >= 0"),
    ],
)
def test_calibrate_cli_checks_flags_before_loading(tmp_path, flag, value, message):
    missing = str(tmp_path / "missing")
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_dspark.calibrate", "--model", missing]
        + ["--draft-model", missing, flag, value],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_calibrate_table_fits_a_terminal_and_shows_copied_drafts():
    """The result tables fit 80 columns uncut; copied drafts' parameters get
    a table of their own, and a calibration without copies has none."""
    from rich.console import Console

    from mlx_dspark.cli.calibrate import render_result

    rng = np.random.default_rng(5)
    z, t, c, survived, _ = copied_rounds(
        rng, 4_000, np.ones(4), np.zeros(4), np.zeros(4)
    )
    fit = fit_sts_offset(z, t, survived, copied=c)
    console = Console(record=True, width=80)
    render_result(evaluate(z, survived, tops=t, copied=c, **fit._asdict()), console)
    text = console.export_text()
    assert "Copied drafts add" in text and "…" not in text
    assert f"{fit.copy_top_weights[0]:.3f}" in text
    plain = Console(record=True, width=80)
    render_result(calibrate(z, survived), plain)
    assert "Copied" not in plain.export_text()
