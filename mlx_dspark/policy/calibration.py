"""Confidence-head calibration: ECE, AUROC and Sequential Temperature Scaling.

Position k's calibrated confidence is c_k = sigmoid(z_k / T_k + w_k t_k + b_k):
STS's temperature T_k on the head's raw logit z_k, plus an offset b_k and a
weight w_k on t_k, the largest log-probability in draft k's own distribution
(w = b = 0 is plain STS). A temperature cannot remove a bias (sigmoid(0) stays
one half), and t_k ranks drafts that will be accepted better than the head
does on the default pair; t_k describes the distribution, not the token drawn
from it, so the scheduler may read it before deciding to verify draft k. A
draft copied from the context adds an offset and slopes of its own on z_k and
t_k (whether a copy holds is not what the head and t_k learned to judge).

Data model. One speculative round gives, for every block position k = 1..K, the
raw confidence logit z_k (pre-sigmoid) and the verification outcome. The label
of position k is "the prefix 1..k was accepted" (DeepSpec's target for the
cumulative product a_k = prod_{i<=k} c_i), so positions after the first
rejection count as 0: they were *not reached*, and a_k should have predicted
that. A position that was never verified because the proposal was cut before
it (scheduler, threshold, EOS) while everything before it was accepted has an
unknown label; it is masked out. Masking on "position k was verified" is
unbiased because the cut is decided from confidences only, never from
outcomes.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..errors import DSparkError
from ..utils import write_text_atomic


def sigmoid(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _bin_index(probs: np.ndarray, n_bins: int) -> np.ndarray:
    return np.clip((probs * n_bins).astype(np.int64), 0, n_bins - 1)


def reliability_bins(
    probs: np.ndarray, outcomes: np.ndarray, n_bins: int = 15
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Equal-width bins on [0, 1]: (mean prediction, mean outcome, count) per bin.

    Empty bins have nan means.
    """
    probs = np.clip(np.asarray(probs, dtype=np.float64).ravel(), 0.0, 1.0)
    outcomes = np.asarray(outcomes, dtype=np.float64).ravel()
    idx = _bin_index(probs, n_bins)
    count = np.bincount(idx, minlength=n_bins).astype(np.float64)
    sum_p = np.bincount(idx, weights=probs, minlength=n_bins)
    sum_y = np.bincount(idx, weights=outcomes, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        return sum_p / count, sum_y / count, count


def expected_calibration_error(
    probs: np.ndarray, outcomes: np.ndarray, n_bins: int = 15
) -> float:
    """Count-weighted mean |mean prediction - mean outcome| over equal-width bins."""
    probs = np.clip(np.asarray(probs, dtype=np.float64).ravel(), 0.0, 1.0)
    outcomes = np.asarray(outcomes, dtype=np.float64).ravel()
    if probs.size == 0:
        return float("nan")
    idx = _bin_index(probs, n_bins)
    diff = np.bincount(idx, weights=probs - outcomes, minlength=n_bins)
    return float(np.abs(diff).sum() / probs.size)


def _ece_grid(probs: np.ndarray, outcomes: np.ndarray, n_bins: int) -> np.ndarray:
    """ECE of every row of probs [G, N] against outcomes [N], vectorised."""
    g, n = probs.shape
    idx = _bin_index(probs, n_bins) + n_bins * np.arange(g)[:, None]
    diff = np.bincount(
        idx.ravel(), weights=(probs - outcomes[None, :]).ravel(), minlength=g * n_bins
    )
    return np.abs(diff.reshape(g, n_bins)).sum(axis=1) / n


def _rankdata(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties get their average rank."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    boundaries = np.flatnonzero(np.diff(xs)) + 1
    starts = np.concatenate(([0], boundaries))
    ends = np.concatenate((boundaries, [xs.size]))
    avg = (starts + ends + 1) / 2.0
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = np.repeat(avg, ends - starts)
    return ranks


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney U); ties count one half.

    Returns nan when only one class is present.
    """
    scores = np.asarray(scores, dtype=np.float64).ravel()
    labels = np.asarray(labels).ravel().astype(bool)
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    ranks = _rankdata(scores)
    u = ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


@dataclass
class CalibrationRecord:
    """One round: confidence logits at every block position and the outcome.

    ``n_verified`` drafts were sent to the target, of which the first
    ``n_accepted`` were accepted (``n_accepted <= n_verified <= len(logits)``);
    ``top_logprobs`` are the drafts' top log-probabilities and ``copied``
    whether their rows carried a context-copy bias, when recorded.
    """

    logits: np.ndarray
    n_verified: int
    n_accepted: int
    top_logprobs: np.ndarray | None = None
    copied: np.ndarray | None = None


def records_to_arrays(
    records: list[CalibrationRecord], n_positions: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stack rounds into (logits, survived, valid), each [rounds, K].

    survived[r, k-1] = 1 iff the prefix 1..k was accepted; valid[r, k-1] = 1 iff
    position k was verified in round r.
    """
    if not records:
        raise ValueError("no calibration records")
    k = n_positions or max(len(r.logits) for r in records)
    logits = np.zeros((len(records), k))
    survived = np.zeros((len(records), k), dtype=bool)
    valid = np.zeros((len(records), k), dtype=bool)
    pos = np.arange(1, k + 1)
    for i, rec in enumerate(records):
        z = np.asarray(rec.logits, dtype=np.float64)[:k]
        logits[i, : z.size] = z
        n_ver = min(int(rec.n_verified), z.size)
        survived[i] = pos <= min(int(rec.n_accepted), n_ver)
        valid[i] = pos <= n_ver
    return logits, survived, valid


def records_per_position(
    records: list[CalibrationRecord],
    name: str,
    n_positions: int | None = None,
) -> np.ndarray | None:
    """A recorded per-draft ``name`` of the rounds (``top_logprobs``,
    ``copied``) as [rounds, K] (0 where none was drafted), or None when a
    round did not record it."""
    if not records or any(getattr(r, name) is None for r in records):
        return None
    k = n_positions or max(len(r.logits) for r in records)
    values = np.zeros((len(records), k))
    for i, rec in enumerate(records):
        t = np.asarray(getattr(rec, name), dtype=np.float64)[:k]
        values[i, : t.size] = t
    return values


def prefix_labels(survived: np.ndarray) -> np.ndarray:
    """Force "prefix accepted" semantics: zero every position after the first 0."""
    return np.minimum.accumulate(np.asarray(survived, dtype=bool), axis=-1)


def apply_sts(
    logits: np.ndarray,
    temperatures: np.ndarray | list[float],
    offsets: np.ndarray | list[float] | None = None,
    tops: np.ndarray | None = None,
    top_weights: np.ndarray | list[float] | None = None,
    copied: np.ndarray | None = None,
    copy_weights: np.ndarray | list[float] | None = None,
    copy_logit_weights: np.ndarray | list[float] | None = None,
    copy_top_weights: np.ndarray | list[float] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Calibrated per-position confidences c_k and prefix survivals a_k.

    ``logits`` (and ``tops``, the drafts' top log-probabilities, needed when
    ``top_weights`` or ``copy_top_weights`` are given, and ``copied``, 1 where
    a draft's row carried a context-copy bias) is [..., K'] with K' <=
    len(temperatures); position k uses temperature, offset and weights k. A
    copied draft adds ``copy_weights`` plus its own slopes on the logit and
    the top log-probability (``copy_logit_weights``, ``copy_top_weights``).
    """
    logits = np.asarray(logits, dtype=np.float64)
    temps = np.asarray(temperatures, dtype=np.float64)
    k = logits.shape[-1]
    if k > temps.size:
        raise ValueError(f"{k} positions but only {temps.size} temperatures")

    def given(values) -> np.ndarray | None:
        if values is None or not len(values):
            return None
        return np.asarray(values, dtype=np.float64)[:k]

    top_weights, copy_top_weights = given(top_weights), given(copy_top_weights)
    if tops is None and (top_weights is not None or copy_top_weights is not None):
        raise ValueError("this calibration reads the drafts' top log-probabilities")
    x = logits / temps[:k]
    if (offsets := given(offsets)) is not None:
        x = x + offsets
    if top_weights is not None:
        x = x + top_weights * np.asarray(tops)
    if copied is not None:
        copied = np.asarray(copied, dtype=np.float64)
        for weights, value in (
            (given(copy_weights), 1.0),
            (given(copy_logit_weights), logits),
            (copy_top_weights, tops),
        ):
            if weights is not None:
                x = x + copied * weights * np.asarray(value)
    c = sigmoid(x)
    return c, np.cumprod(c, axis=-1)


def default_grid() -> np.ndarray:
    return np.geomspace(0.05, 20.0, 241)


def fit_sts(
    logits: np.ndarray,
    survived: np.ndarray,
    grid: np.ndarray | None = None,
    valid: np.ndarray | None = None,
    n_bins: int = 15,
    refine: bool = True,
) -> np.ndarray:
    """Sequential Temperature Scaling: one temperature per position, left to right.

    Position k's temperature is the grid value minimising the ECE of
    a_k = a_{k-1} * sigmoid(z_k / T_k) against "prefix 1..k accepted", with
    T_1..T_{k-1} already fixed. With ``refine`` a second, finer grid is searched
    between the neighbours of the coarse optimum.
    """
    logits = np.asarray(logits, dtype=np.float64)
    labels = prefix_labels(survived).astype(np.float64)
    if valid is None:
        valid = np.ones(logits.shape, dtype=bool)
    valid = np.asarray(valid, dtype=bool)
    grid = np.sort(np.asarray(default_grid() if grid is None else grid, np.float64))
    rounds, k_max = logits.shape
    temps = np.ones(k_max)
    prev = np.ones(rounds)
    for k in range(k_max):
        m = valid[:, k]
        if m.any():
            z, y, p = logits[m, k], labels[m, k], prev[m]

            def search(g: np.ndarray, z=z, y=y, p=p) -> tuple[float, int]:
                ece = _ece_grid(
                    p[None, :] * sigmoid(z[None, :] / g[:, None]), y, n_bins
                )
                i = int(np.argmin(ece))
                return float(g[i]), i

            best, i = search(grid)
            if refine and grid.size > 2:
                lo = grid[max(i - 1, 0)]
                hi = grid[min(i + 1, grid.size - 1)]
                best, _ = search(np.geomspace(lo, hi, 41))
            temps[k] = best
        prev = prev * sigmoid(logits[:, k] / temps[k])
    return temps


def _logistic(x: np.ndarray, y: np.ndarray, ridge: float) -> np.ndarray:
    """Weights (the last one the intercept) minimising the summed log loss of
    sigmoid(x @ w[:-1] + w[-1]) plus ``ridge / 2`` times the squared weights
    but the intercept, by Newton's method."""
    x = np.c_[x, np.ones(len(x))]
    penalty = np.full(x.shape[1], ridge)
    penalty[-1] = 1e-9
    w = np.zeros(x.shape[1])
    for _ in range(50):
        p = sigmoid(x @ w)
        grad = x.T @ (p - y) + penalty * w
        hess = (x * (p * (1 - p))[:, None]).T @ x + np.diag(penalty)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-10:
            break
    return w


class OffsetFit(NamedTuple):
    """Per-position parameters of :func:`fit_sts_offset`, named as
    :func:`apply_sts` and :func:`evaluate` take them."""

    temperatures: np.ndarray
    top_weights: np.ndarray
    offsets: np.ndarray
    copy_weights: np.ndarray
    copy_logit_weights: np.ndarray
    copy_top_weights: np.ndarray


def fit_sts_offset(
    logits: np.ndarray,
    tops: np.ndarray,
    survived: np.ndarray,
    valid: np.ndarray | None = None,
    ridge: float = 1.0,
    copied: np.ndarray | None = None,
) -> OffsetFit:
    """Temperatures, top-log-probability weights and offsets, one each a
    position, and the copied drafts' own weights (zero without ``copied``).

    c_k is the probability that draft k survives given that drafts 1..k-1
    did, so position k is a logistic regression of survival on (z_k, t_k)
    over the rounds whose prefix 1..k-1 was accepted and whose draft k was
    verified; the a_k = c_1 ... c_k are then calibrated when the c_k are. The
    ridge, worth about as much as one round, keeps the late positions, which
    few rounds reach, near a constant. With ``copied`` (1 where draft k's
    row carried a context-copy bias) a copied draft gets its own offset and
    slopes on z_k and t_k: whether a copy holds says little about what the
    head and the drafter's own probability say of a draft they wrote. A
    position no round reached keeps T = 1 and zero weights; where the head
    adds nothing beyond the other inputs, T = 1000.
    """
    logits = np.asarray(logits, dtype=np.float64)
    tops = np.asarray(tops, dtype=np.float64)
    inputs = [tops]
    if copied is not None:
        copied = np.asarray(copied, dtype=np.float64)
        inputs += [copied, copied * logits, copied * tops]
    labels = prefix_labels(survived)
    valid = np.ones(logits.shape, bool) if valid is None else np.asarray(valid, bool)
    k_max = logits.shape[1]
    temps, offsets = np.ones(k_max), np.zeros(k_max)
    weights = np.zeros((4, k_max))
    reached = np.ones(logits.shape[0], dtype=bool)
    for k in range(k_max):
        m = reached & valid[:, k]
        if m.any():
            x = np.stack([logits[m, k], *(v[m, k] for v in inputs)], axis=1)
            fitted = _logistic(x, labels[m, k], ridge)
            scale, offsets[k] = fitted[0], fitted[-1]
            weights[: len(inputs), k] = fitted[1:-1]
            temps[k] = 1.0 / scale if scale > 1e-3 else 1e3
        reached = labels[:, k]
    return OffsetFit(temps, weights[0], offsets, *weights[1:])


def _clean(values: list[float]) -> list[float | None]:
    return [None if (v is None or not math.isfinite(v)) else float(v) for v in values]


def _restore(values: list[float | None]) -> list[float]:
    return [float("nan") if v is None else float(v) for v in values]


_PER_POSITION = (
    "temperatures",
    "top_weights",
    "offsets",
    "copy_weights",
    "copy_logit_weights",
    "copy_top_weights",
    "ece_before",
    "ece_after",
    "auc_before",
    "auc_after",
)


@dataclass
class CalibrationResult:
    """Fitted calibration and before/after metrics per position.

    ``top_weights`` and ``offsets`` are empty in a plain STS calibration (and in
    files written before they existed); the copy weights are empty unless the
    drafter copied from the context while it was measured (and the slopes in
    files written before copied drafts had their own). ``reliability_before``/
    ``reliability_after``: per position, per bin ``[mean prediction, mean
    outcome, count]`` of the cumulative product.
    """

    temperatures: list[float]
    ece_before: list[float]
    ece_after: list[float]
    auc_before: list[float]
    auc_after: list[float]
    n_rounds: int
    n_bins: int = 15
    reliability_before: list[list[list[float]]] = field(default_factory=list)
    reliability_after: list[list[list[float]]] = field(default_factory=list)
    measured_with: str | None = None  # the drafter weights, when converted since
    top_weights: list[float] = field(default_factory=list)
    offsets: list[float] = field(default_factory=list)
    copy_weights: list[float] = field(default_factory=list)
    copy_logit_weights: list[float] = field(default_factory=list)
    copy_top_weights: list[float] = field(default_factory=list)

    def save(self, path: str | Path) -> None:
        data = asdict(self)
        for key in _PER_POSITION:
            data[key] = _clean(data[key])
        for key in ("reliability_before", "reliability_after"):
            data[key] = [[_clean(b) for b in pos] for pos in data[key]]
        write_text_atomic(path, json.dumps(data, indent=1))

    @classmethod
    def load(cls, path: str | Path) -> CalibrationResult:
        try:
            data = json.loads(Path(path).read_text())
            for key in _PER_POSITION:
                if key in data:
                    data[key] = _restore(data[key])
            for key in ("reliability_before", "reliability_after"):
                data[key] = [[_restore(b) for b in pos] for pos in data.get(key, [])]
            return cls(**data)
        except FileNotFoundError:
            raise DSparkError(f"Calibration file {path} does not exist.") from None
        except (ValueError, TypeError, KeyError):
            raise DSparkError(
                f"Calibration file {path} is not a valid calibration result."
            ) from None

    def survival(
        self,
        raw: np.ndarray,
        tops: np.ndarray | None = None,
        copied: np.ndarray | None = None,
    ) -> np.ndarray:
        """Prefix survival a_1..a_K of one round from its raw confidence
        logits (and the drafts' top log-probabilities and copy flags); a
        position past the fitted ones, or with an unusable temperature, stays
        uncalibrated."""
        z = np.asarray(raw, dtype=np.float64).ravel()
        k = min(z.size, len(self.temperatures))

        def known(values: list[float], default: float) -> np.ndarray:
            out = np.full(z.size, default)
            given = np.asarray(values[:k], dtype=np.float64)
            out[: given.size] = given
            return np.where(np.isfinite(out), out, default)

        temps = known(self.temperatures, 1.0)
        temps = np.where(temps > 0, temps, 1.0)

        def weights(values: list[float]) -> np.ndarray | None:
            out = known(values, 0.0)
            return out if out.any() else None

        if copied is not None:
            copied = np.asarray(copied, dtype=np.float64).ravel()
        return apply_sts(
            z,
            temps,
            known(self.offsets, 0.0),
            tops,
            weights(self.top_weights),
            copied,
            weights(self.copy_weights),
            weights(self.copy_logit_weights),
            weights(self.copy_top_weights),
        )[1]

    @property
    def reads_tops(self) -> bool:
        """Whether survival reads the drafts' top log-probabilities."""
        return any(self.top_weights) or any(self.copy_top_weights)

    @property
    def reads_copies(self) -> bool:
        """Whether survival reads the drafts' copy flags."""
        return any(
            any(w)
            for w in (self.copy_weights, self.copy_logit_weights, self.copy_top_weights)
        )

    def acceptance(self) -> list[float]:
        """Conditional acceptance per position measured in the calibration
        rounds (raw reliability counts), smoothed by half a success per
        position so that a handful of rounds cannot say 0 or 1."""
        rates, trials = [], None
        for bins in self.reliability_before:
            rounds = sum(b[2] for b in bins)
            kept = sum(b[1] * b[2] for b in bins if b[2] > 0)  # empty: no rate
            tried = rounds if trials is None else min(trials, rounds)
            rates.append((kept + 0.5) / (tried + 1.0))
            trials = kept
        return rates

    def reliability_diagram(self, path: str | Path) -> Path:
        """Write a PNG of the per-position reliability curves (needs matplotlib)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise DSparkError(
                "Reliability diagrams need matplotlib: pip install 'mlx-dspark[plot]'."
            ) from None
        k = len(self.temperatures)
        ncols = min(4, max(k, 1))
        nrows = max(1, math.ceil(k / ncols))
        fig, axes = plt.subplots(
            nrows, ncols, figsize=(3.6 * ncols, 3.4 * nrows), squeeze=False
        )
        for pos in range(nrows * ncols):
            ax = axes[pos // ncols][pos % ncols]
            if pos >= k:
                ax.axis("off")
                continue
            ax.plot([0, 1], [0, 1], "--", color="0.6", linewidth=1)
            for rel, label, color in (
                (self.reliability_before, "raw", "C3"),
                (self.reliability_after, "calibrated", "C0"),
            ):
                if pos < len(rel):
                    bins = np.asarray(rel[pos], dtype=np.float64)
                    keep = bins[:, 2] > 0
                    ax.plot(
                        bins[keep, 0],
                        bins[keep, 1],
                        "o-",
                        ms=3,
                        color=color,
                        label=label,
                    )
            ax.set_xlim(0, 1)
            ax.set_ylim(0, 1)
            ax.set_title(
                f"k={pos + 1} T={self.temperatures[pos]:.2f} "
                f"ECE {self.ece_before[pos]:.3f}->{self.ece_after[pos]:.3f}",
                fontsize=8,
            )
            ax.set_xlabel("predicted prefix survival", fontsize=7)
            ax.set_ylabel("observed", fontsize=7)
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def _metrics(
    a: np.ndarray, labels: np.ndarray, valid: np.ndarray, n_bins: int
) -> tuple[list[float], list[float], list[list[list[float]]]]:
    eces, aucs, rels = [], [], []
    for k in range(a.shape[1]):
        m = valid[:, k]
        p, y = a[m, k], labels[m, k]
        eces.append(expected_calibration_error(p, y, n_bins))
        aucs.append(roc_auc(p, y))
        mp, my, cnt = reliability_bins(p, y, n_bins)
        rels.append(np.stack([mp, my, cnt], axis=1).tolist())
    return eces, aucs, rels


def calibrate(
    logits: np.ndarray,
    survived: np.ndarray,
    valid: np.ndarray | None = None,
    n_bins: int = 15,
    grid: np.ndarray | None = None,
) -> CalibrationResult:
    """Fit STS and report ECE/AUROC of the cumulative product before and after.

    Evaluate on the fitting data only for a quick look; for honest numbers fit on
    one split and call :func:`evaluate` on another.
    """
    logits = np.asarray(logits, dtype=np.float64)
    valid = np.ones(logits.shape, bool) if valid is None else np.asarray(valid, bool)
    temps = fit_sts(logits, survived, grid=grid, valid=valid, n_bins=n_bins)
    return evaluate(logits, survived, temps, valid=valid, n_bins=n_bins)


def evaluate(
    logits: np.ndarray,
    survived: np.ndarray,
    temperatures: np.ndarray | list[float],
    valid: np.ndarray | None = None,
    n_bins: int = 15,
    tops: np.ndarray | None = None,
    top_weights: np.ndarray | list[float] | None = None,
    offsets: np.ndarray | list[float] | None = None,
    copied: np.ndarray | None = None,
    copy_weights: np.ndarray | list[float] | None = None,
    copy_logit_weights: np.ndarray | list[float] | None = None,
    copy_top_weights: np.ndarray | list[float] | None = None,
    calibrated: np.ndarray | None = None,
) -> CalibrationResult:
    """Metrics of a given calibration against raw scores (T = 1) on some
    rounds. ``calibrated``, when given, holds the prefix survivals to report
    instead of this calibration's own (the cross-validated ones of
    :func:`~mlx_dspark.policy.calibrate.fit_records`)."""
    logits = np.asarray(logits, dtype=np.float64)
    labels = prefix_labels(survived).astype(np.float64)
    valid = np.ones(logits.shape, bool) if valid is None else np.asarray(valid, bool)
    temps = np.asarray(temperatures, dtype=np.float64)
    _, a_raw = apply_sts(logits, np.ones(logits.shape[1]))
    if calibrated is None:
        _, calibrated = apply_sts(
            logits,
            temps,
            offsets,
            tops,
            top_weights,
            copied,
            copy_weights,
            copy_logit_weights,
            copy_top_weights,
        )
    ece_b, auc_b, rel_b = _metrics(a_raw, labels, valid, n_bins)
    ece_a, auc_a, rel_a = _metrics(calibrated, labels, valid, n_bins)

    def listed(values) -> list[float]:
        return [] if values is None else list(map(float, values))

    return CalibrationResult(
        temperatures=temps.tolist(),
        ece_before=ece_b,
        ece_after=ece_a,
        auc_before=auc_b,
        auc_after=auc_a,
        n_rounds=int(logits.shape[0]),
        n_bins=n_bins,
        reliability_before=rel_b,
        reliability_after=rel_a,
        top_weights=listed(top_weights),
        offsets=listed(offsets),
        copy_weights=listed(copy_weights),
        copy_logit_weights=listed(copy_logit_weights),
        copy_top_weights=listed(copy_top_weights),
    )
