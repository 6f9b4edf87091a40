"""Hardware-aware prefix scheduling (DSpark Algorithm 1), the threshold rule and
the scheduler's environment settings.

Losslessness. Whether draft k of a request is verified may depend on anything
the drafter knew *before sampling draft k* (its confidence c_k uses x_{k-1}, so
a_k = prod_{i<=k} c_i is a function of x_1..x_{k-1}) and on other requests, but
not on x_k itself; otherwise the verify/bonus split at position k would be
correlated with the token being tested and the committed distribution would no
longer equal the target's. Algorithm 1 visits candidates in descending a with a
stable tie-break on position, so when (r, k) is visited the running state only
contains candidates with a >= a_{r,k} that come earlier in that order: for
request r those are positions 1..k-1 only. Stopping at the FIRST candidate that
does not raise Theta therefore decides position k from a_{r,1..k} and other
requests alone. An unconstrained search over all prefix lengths (e.g. "pick the
best total length") would look at a_{r,k+1}, which depends on x_k, and is not
lossless (the paper's asynchronous variant escapes this by using confidences
from two steps earlier).

Optimality. Sorting makes the admitted a-sum S(B) concave in the number of
admitted drafts B. When the round time 1/rate(B) is convex in B (true for any
concave positive SPS curve, for affine latency and for a roofline max(c, s*B)),
Theta(B) = (R + S(B)) / time(R + B) is quasi-concave, so the first
non-improving step is the global optimum over all B. With a non-convex time
curve (e.g. tile-quantised GPU steps) the greedy can stop before a later, better
length; that is the price of the early stop.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from ..errors import DSparkError


@dataclass
class StepRateCurve:
    """Measured target step rate SPS(B) (forward passes per second at B query
    tokens) plus the drafter's cost per block.

    Between measured points the step *time* 1/SPS is interpolated linearly;
    beyond the largest measured B it is extrapolated with the last measured slope
    (never decreasing); below the smallest it is held constant.
    """

    batch_sizes: list[int]
    steps_per_second: list[float]
    draft_seconds: float = 0.0
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        b = [int(x) for x in self.batch_sizes]
        s = [float(x) for x in self.steps_per_second]
        if not b or len(b) != len(s):
            raise ValueError(
                "batch_sizes and steps_per_second must be equal-length, non-empty"
            )
        if any(x <= 0 for x in s) or any(x < 1 for x in b):
            raise ValueError("batch sizes must be >= 1 and step rates > 0")
        order = np.argsort(b, kind="stable")
        self.batch_sizes = [b[i] for i in order]
        self.steps_per_second = [s[i] for i in order]
        if len(set(self.batch_sizes)) != len(self.batch_sizes):
            raise ValueError("duplicate batch sizes in step-rate curve")

    @classmethod
    def from_measurements(
        cls,
        measurements: Mapping[int, list[float] | float],
        draft_seconds: float = 0.0,
        meta: dict | None = None,
    ) -> StepRateCurve:
        """Build from {B: seconds per forward (one timing or several)}; the median
        of repeated timings is used (robust to the noisy machines)."""
        b = sorted(int(k) for k in measurements)
        sps = [1.0 / float(np.median(np.atleast_1d(measurements[k]))) for k in b]
        return cls(b, sps, float(draft_seconds), dict(meta or {}))

    @classmethod
    def linear(
        cls,
        base_seconds: float,
        per_token_seconds: float,
        b_max: int = 64,
        draft_seconds: float = 0.0,
    ) -> StepRateCurve:
        """Affine latency model t(B) = base + per_token * B (tests, defaults)."""
        b = list(range(1, b_max + 1))
        return cls(
            b, [1.0 / (base_seconds + per_token_seconds * x) for x in b], draft_seconds
        )

    def step_seconds(self, b: int | float) -> float:
        xs = np.asarray(self.batch_sizes, dtype=np.float64)
        ts = 1.0 / np.asarray(self.steps_per_second, dtype=np.float64)
        if b <= xs[-1] or xs.size == 1:
            return float(np.interp(b, xs, ts))
        slope = max(0.0, (ts[-1] - ts[-2]) / (xs[-1] - xs[-2]))
        return float(ts[-1] + slope * (b - xs[-1]))

    def sps(self, b: int | float) -> float:
        """Target forward passes per second at b query tokens."""
        return 1.0 / self.step_seconds(b)

    def round_rate(self, b: int | float) -> float:
        """Speculative rounds per second: one draft block plus one verify of b tokens."""
        return 1.0 / (self.step_seconds(b) + self.draft_seconds)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> StepRateCurve:
        return cls(**json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> StepRateCurve:
        try:
            return cls.from_json(Path(path).read_text())
        except FileNotFoundError:
            raise DSparkError(f"Step-rate profile {path} does not exist.") from None
        except (ValueError, TypeError, KeyError):
            raise DSparkError(
                f"Step-rate profile {path} is not a valid profile."
            ) from None


def expected_throughput(
    survival: list[np.ndarray], lengths: list[int], sps: StepRateCurve
) -> float:
    """Theta = (sum over requests of 1 + admitted a) * rate(total query tokens)."""
    tokens = sum(1 + int(n) for n in lengths)
    committed = sum(
        1.0 + float(np.sum(np.asarray(a, dtype=np.float64)[: int(n)]))
        for a, n in zip(survival, lengths, strict=True)
    )
    return committed * sps.round_rate(tokens)


def schedule(
    survival: list[np.ndarray], sps: StepRateCurve, caps: list[int]
) -> list[int]:
    """Algorithm 1: number of drafts to verify per request.

    ``survival[r][j-1]`` is request r's calibrated prefix survival a_{r,j};
    ``caps[r]`` bounds its verify length (n_draft cap, drafts available). Every
    request always verifies its anchor. Candidates are visited by descending a
    (stable on request, then position) and admitted while each admission
    strictly raises Theta; the first one that does not ends the search.
    The rate includes ``sps.draft_seconds``; with 0 it is exactly SPS(B).
    """
    if len(survival) != len(caps):
        raise ValueError("survival and caps must have one entry per request")
    r_count = len(survival)
    if r_count == 0:
        return []
    cand_a: list[float] = []
    cand_r: list[int] = []
    for r, (a, cap) in enumerate(zip(survival, caps, strict=True)):
        # Non-increasing by construction (products of c <= 1); enforcing it keeps
        # a_k a function of a_1..a_k, so the lossless argument is unchanged.
        a = np.minimum.accumulate(np.asarray(a, dtype=np.float64).ravel())
        n = max(0, min(int(cap), a.size))
        cand_a.extend(a[:n].tolist())
        cand_r.extend([r] * n)
    order = np.argsort(-np.asarray(cand_a), kind="stable")
    lengths = [0] * r_count
    tokens = r_count
    committed = float(r_count)
    theta = committed * sps.round_rate(tokens)
    for i in order:
        new_theta = (committed + cand_a[i]) * sps.round_rate(tokens + 1)
        if not new_theta > theta:
            break
        theta = new_theta
        committed += cand_a[i]
        tokens += 1
        lengths[cand_r[i]] += 1
    return lengths


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")

# (settings field, environment variable, type, what a valid value is)
_ENV = (
    (
        "enabled",
        "DSPARK_SCHEDULER_ENABLED",
        bool,
        "a boolean (1/0, true/false, yes/no, on/off)",
    ),
    (
        "confidence_threshold",
        "DSPARK_CONFIDENCE_THRESHOLD",
        float,
        "a number between 0 and 1",
    ),
    ("n_draft_min", "DSPARK_N_DRAFT_MIN", int, "a non-negative integer"),
    ("n_draft_max", "DSPARK_N_DRAFT_MAX", int, "a positive integer"),
    (
        "interval_ms",
        "DSPARK_SCHEDULER_INTERVAL_MS",
        float,
        "a positive number of milliseconds",
    ),
    ("warmup_steps", "DSPARK_WARMUP_STEPS", int, "a non-negative integer"),
    (
        "memory_warning_fraction",
        "DSPARK_MEMORY_WARNING_FRACTION",
        float,
        "a fraction between 0 and 1",
    ),
    (
        "memory_critical_fraction",
        "DSPARK_MEMORY_CRITICAL_FRACTION",
        float,
        "a fraction between 0 and 1",
    ),
)
ENV_VARS = {fld: name for fld, name, _, _ in _ENV}


def _parse(raw: str, name: str, kind: type, what: str) -> bool | int | float:
    raw = raw.strip()
    try:
        if kind is bool:
            if raw.lower() in _TRUE:
                return True
            if raw.lower() in _FALSE:
                return False
            raise ValueError
        value = kind(raw)
        if kind is float and not np.isfinite(value):
            raise ValueError
        return value
    except ValueError:
        raise DSparkError(f"{name}={raw!r} is not {what}.") from None


@dataclass(frozen=True)
class SchedulerSettings:
    """Scheduler and memory-guard knobs. Callers build one; DSPARK_* variables
    override the fields not given explicitly (see
    :func:`~mlx_dspark.policy.settings.build_settings`). ``n_draft_max=None`` means the drafter's block size.

    Memory fractions are the share of the memory budget in use at which the
    guard reports WARNING / CRITICAL.
    """

    enabled: bool = False
    confidence_threshold: float = 0.0
    n_draft_min: int = 1
    n_draft_max: int | None = None
    interval_ms: float = 500.0
    warmup_steps: int = 2
    memory_warning_fraction: float = 0.80
    memory_critical_fraction: float = 0.95

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        base: SchedulerSettings | None = None,
        keep: Collection[str] = (),
    ) -> SchedulerSettings:
        """``base`` (defaults if None) with every DSPARK_* variable present in
        ``env`` (os.environ if None) applied, except for the fields in ``keep``
        (given explicitly); invalid values raise DSparkError."""
        env = os.environ if env is None else env
        updates = {
            fld: _parse(env[name], name, kind, what)
            for fld, name, kind, what in _ENV
            if name in env and fld not in keep
        }
        settings = replace(base or cls(), **updates)
        settings.validate()
        return settings

    def n_max(self, block_size: int) -> int:
        """Largest draft count per round for a drafter proposing ``block_size``."""
        n = (
            block_size
            if self.n_draft_max is None
            else min(self.n_draft_max, block_size)
        )
        return max(n, 0)

    def n_min(self, block_size: int) -> int:
        return min(self.n_draft_min, self.n_max(block_size))

    def validate(self) -> None:
        v = ENV_VARS
        if not 0.0 <= self.confidence_threshold <= 1.0:
            raise DSparkError(f"{v['confidence_threshold']} must be between 0 and 1.")
        if self.n_draft_min < 0:
            raise DSparkError(f"{v['n_draft_min']} must be a non-negative integer.")
        if self.n_draft_max is not None and self.n_draft_max < max(1, self.n_draft_min):
            raise DSparkError(
                f"{v['n_draft_max']} must be at least 1 and at least "
                f"{v['n_draft_min']} ({self.n_draft_min})."
            )
        if not self.interval_ms > 0:
            raise DSparkError(
                f"{v['interval_ms']} must be a positive number of milliseconds."
            )
        if self.warmup_steps < 0:
            raise DSparkError(f"{v['warmup_steps']} must be a non-negative integer.")
        for fld in ("memory_warning_fraction", "memory_critical_fraction"):
            if not 0.0 < getattr(self, fld) <= 1.0:
                raise DSparkError(f"{v[fld]} must be a fraction in (0, 1].")
        if self.memory_critical_fraction < self.memory_warning_fraction:
            raise DSparkError(
                f"{v['memory_critical_fraction']} must not be below "
                f"{v['memory_warning_fraction']}."
            )
