"""Per-round scheduling records and their Prometheus text exposition."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass
class RoundRecord:
    """One speculative round of one request.

    cap: draft cap in force (n_max or the memory guard's); admitted: drafts
    sent to verification; expected_accepted: sum of the admitted calibrated
    survivals a_j (what the scheduler predicted); accepted: drafts the target
    accepted; verify_ms: latency of the verification forward (nan if unknown);
    predicted: how many of the admitted drafts the confidence head predicted
    (0: a round without a prediction, such as a plain round or a copy
    verified as it is, which no drafter ran for).
    """

    cap: int
    admitted: int
    expected_accepted: float
    accepted: int
    verify_ms: float = float("nan")
    predicted: int = 0


@dataclass
class Telemetry:
    """Running totals (exact since creation) plus the last ``window`` rounds.

    The loop sets the gauges it owns directly: ``n_current``, ``ece``,
    ``speedup_ratio``, ``memory_pressure_level``, ``memory_active_bytes``.
    """

    window: int = 1024
    policy: str = ""  # the draft policy that ran: adaptive, off, threshold, auto
    note: str | None = None  # why, when it is not what was asked for
    calibration: str | None = None  # the STS calibration file in use
    profile: str | None = None  # the cached cost profile in use
    n_current: int = 0
    ece: float = float("nan")
    speedup_ratio: float = float("nan")
    memory_pressure_level: int = 0
    memory_active_bytes: int = 0
    recent: deque = field(default_factory=deque)
    n_rounds: int = 0
    drafts_admitted: int = 0
    drafts_accepted: int = 0
    expected_accepted: float = 0.0
    verify_ms_sum: float = 0.0
    verify_count: int = 0
    length_counts: dict[int, int] = field(default_factory=dict)
    # The confidence head's check, over the rounds it predicted only: those
    # rounds, the survival it predicted and the drafts accepted among the
    # positions it predicted.
    predicted_rounds: int = 0
    predicted_expected: float = 0.0
    predicted_accepted: int = 0

    def __post_init__(self) -> None:
        self.recent = deque(self.recent, maxlen=self.window)

    def record(self, rec: RoundRecord) -> None:
        self.recent.append(rec)
        self.n_rounds += 1
        self.drafts_admitted += int(rec.admitted)
        self.drafts_accepted += int(rec.accepted)
        self.expected_accepted += float(rec.expected_accepted)
        n = int(rec.admitted)
        self.length_counts[n] = self.length_counts.get(n, 0) + 1
        if math.isfinite(rec.verify_ms):
            self.verify_ms_sum += float(rec.verify_ms)
            self.verify_count += 1
        if rec.predicted > 0:
            self.predicted_rounds += 1
            self.predicted_expected += float(rec.expected_accepted)
            self.predicted_accepted += min(int(rec.accepted), int(rec.predicted))

    def record_round(
        self,
        cap: int,
        admitted: int,
        expected_accepted: float,
        accepted: int,
        verify_ms: float = float("nan"),
        predicted: int = 0,
    ) -> RoundRecord:
        rec = RoundRecord(
            cap, admitted, expected_accepted, accepted, verify_ms, predicted
        )
        self.record(rec)
        return rec

    @property
    def predicted_check(self) -> tuple[float, float] | None:
        """The confidence head's calibration check: expected and accepted
        drafts per round over the rounds it predicted (None before any)."""
        if self.predicted_rounds == 0:
            return None
        n = self.predicted_rounds
        return self.predicted_expected / n, self.predicted_accepted / n

    @property
    def acceptance_rate(self) -> float:
        """Accepted / verified draft tokens since creation (nan before any)."""
        if self.drafts_admitted == 0:
            return float("nan")
        return self.drafts_accepted / self.drafts_admitted

    @property
    def mean_accepted_length(self) -> float:
        """tau: committed tokens per round (accepted drafts + bonus)."""
        if self.n_rounds == 0:
            return float("nan")
        return 1.0 + self.drafts_accepted / self.n_rounds

    @property
    def mean_verify_ms(self) -> float:
        if self.verify_count == 0:
            return float("nan")
        return self.verify_ms_sum / self.verify_count


def _fmt(value: float) -> str:
    value = float(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def _labels(labels: Mapping[str, str], extra: Mapping[str, str] | None = None) -> str:
    items = {**labels, **(extra or {})}
    if not items:
        return ""

    def esc(v: str) -> str:
        return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in items.items()) + "}"


def render_prometheus(
    telemetry: Telemetry, labels: Mapping[str, str] | None = None
) -> str:
    """Prometheus text exposition format (version 0.0.4) of a Telemetry."""
    labels = dict(labels or {})
    t = telemetry
    out: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        for suffix, extra, value in samples:
            out.append(f"{name}{suffix}{_labels(labels, extra)} {_fmt(value)}")

    def gauge(name: str, help_text: str, value: float) -> None:
        # A gauge not measured yet (NaN) has no sample, rather than a NaN one.
        samples = [] if math.isnan(float(value)) else [("", None, value)]
        metric(name, "gauge", help_text, samples)

    gauge(
        "dspark_draft_acceptance_rate",
        "Fraction of verified draft tokens accepted by the target.",
        t.acceptance_rate,
    )
    buckets = []
    cumulative = 0
    for n in range(max(t.length_counts, default=0) + 1):
        cumulative += t.length_counts.get(n, 0)
        buckets.append(("_bucket", {"le": str(n)}, cumulative))
    buckets.append(("_bucket", {"le": "+Inf"}, t.n_rounds))
    buckets.append(("_sum", None, t.drafts_admitted))
    buckets.append(("_count", None, t.n_rounds))
    metric(
        "dspark_draft_length_tokens",
        "histogram",
        "Draft tokens sent to verification per round.",
        buckets,
    )
    gauge(
        "dspark_confidence_head_ece",
        "Expected calibration error of the calibrated prefix survival.",
        t.ece,
    )
    gauge(
        "dspark_scheduler_n_current",
        "Current cap on draft tokens per round.",
        t.n_current,
    )
    metric(
        "dspark_verification_latency_ms",
        "summary",
        "Latency of the target verification forward in milliseconds.",
        [("_sum", None, t.verify_ms_sum), ("_count", None, t.verify_count)],
    )
    gauge(
        "dspark_speedup_ratio",
        "Speculative tokens per second over plain decoding tokens per second.",
        t.speedup_ratio,
    )
    gauge(
        "dspark_memory_pressure_level",
        "Memory pressure: 0 normal, 1 warning, 2 critical.",
        t.memory_pressure_level,
    )
    gauge(
        "dspark_memory_active_bytes",
        "MLX active memory in bytes.",
        t.memory_active_bytes,
    )
    metric(
        "dspark_rounds_total",
        "counter",
        "Speculative rounds recorded.",
        [("", None, t.n_rounds)],
    )
    metric(
        "dspark_draft_tokens_accepted_total",
        "counter",
        "Draft tokens accepted by the target.",
        [("", None, t.drafts_accepted)],
    )
    metric(
        "dspark_draft_tokens_expected_total",
        "counter",
        "Draft tokens the scheduler expected to be accepted (sum of admitted survival).",
        [("", None, t.expected_accepted)],
    )
    return "\n".join(out) + "\n"
