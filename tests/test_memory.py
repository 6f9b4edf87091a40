import mlx.core as mx
import pytest

from mlx_dspark.policy.memory import (
    MemoryGuard,
    PressureLevel,
    active_memory_bytes,
    combined_source,
    default_source,
    linux_meminfo_source,
    linux_psi_source,
    mlx_memory_source,
    safe_source,
)
from mlx_dspark.policy.scheduler import SchedulerSettings
from mlx_dspark.policy.telemetry import RoundRecord, Telemetry, render_prometheus

N, W, C = PressureLevel.NORMAL, PressureLevel.WARNING, PressureLevel.CRITICAL


class FakeSource:
    def __init__(self, levels):
        self.levels = list(levels)
        self.calls = 0

    def __call__(self):
        level = self.levels[min(self.calls, len(self.levels) - 1)]
        self.calls += 1
        if isinstance(level, Exception):
            raise level
        return level


def make_guard(levels, interval_ms=100.0, n_min=1, n_max=8):
    source = FakeSource(levels)
    cleared, logged = [], []
    guard = MemoryGuard(
        source=source,
        n_min=n_min,
        n_max=n_max,
        interval_ms=interval_ms,
        clock=lambda: 0.0,
        clear_cache=lambda: cleared.append(1),
        log=logged.append,
    )
    return guard, source, cleared, logged


def test_caps_follow_pressure_levels():
    guard, _, cleared, logged = make_guard([N, W, W, C, C, W, N, C])
    caps = [guard.cap(now=0.2 * i) for i in range(8)]
    assert caps == [8, 4, 4, 1, 1, 4, 8, 1]
    # cache cleared once per transition to a worse level: N->W, W->C, N->C
    assert len(cleared) == 3
    assert len(logged) == 1 and "critical memory pressure" in logged[0]
    assert "\n" not in logged[0]
    guard.reset()
    assert guard.level == N
    assert guard.cap(now=10.0) == 1 and len(logged) == 2  # re-armed per generation


def test_warning_cap_never_below_n_min():
    guard, *_ = make_guard([W], n_min=3, n_max=4)
    assert guard.cap(now=0.0) == 3
    guard, *_ = make_guard([W], n_min=0, n_max=1)
    assert guard.cap(now=0.0) == 0


def test_samples_at_most_every_interval():
    guard, source, *_ = make_guard([W, N, C], interval_ms=100.0)
    assert guard.cap(now=0.0) == 4
    assert guard.cap(now=0.05) == 4 and source.calls == 1  # within interval
    assert guard.cap(now=0.1) == 8 and source.calls == 2
    assert guard.cap(now=0.15) == 8 and source.calls == 2
    guard.clock = lambda: 1.0
    assert guard.cap() == 1 and source.calls == 3  # default clock


def test_raising_source_reads_normal():
    guard, _, cleared, logged = make_guard([RuntimeError("boom"), OSError(), 7, None])
    assert [guard.cap(now=float(i)) for i in range(4)] == [8, 8, 8, 8]
    assert not cleared and not logged
    assert safe_source(lambda: 1 / 0)() == N
    assert combined_source(lambda: W, lambda: 1 / 0, lambda: C)() == C
    assert combined_source()() == N


def test_failing_clear_cache_does_not_crash():
    def bad():
        raise RuntimeError("no cache")

    guard = MemoryGuard(
        source=lambda: C, n_min=1, n_max=8, clear_cache=bad, log=lambda m: None
    )
    assert guard.cap(now=0.0) == 1


def test_warning_logged_once(caplog):
    guard = MemoryGuard(
        source=lambda: C, n_min=2, n_max=8, interval_ms=1.0, clear_cache=lambda: None
    )
    with caplog.at_level("WARNING", logger="mlx_dspark"):
        for i in range(5):
            assert guard.cap(now=float(i)) == 2
    records = [r for r in caplog.records if r.name == "mlx_dspark"]
    assert len(records) == 1 and records[0].levelname == "WARNING"
    assert "critical memory pressure" in records[0].getMessage()


def test_linux_sources(tmp_path):
    psi = tmp_path / "psi"
    psi.write_text(
        "some avg10=12.50 avg60=1.00 avg300=0.00 total=5\n"
        "full avg10=1.00 avg60=0.00 avg300=0.00 total=1\n"
    )
    assert linux_psi_source(10.0, 40.0, path=psi)() == W
    assert linux_psi_source(5.0, 12.0, path=psi)() == C
    assert linux_psi_source(20.0, 40.0, path=psi)() == N
    assert linux_psi_source(path=tmp_path / "missing")() == N
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 1000 kB\nMemFree: 50 kB\nMemAvailable: 150 kB\n")
    assert linux_meminfo_source(0.8, 0.95, path=meminfo)() == W  # 85 % used
    assert linux_meminfo_source(0.8, 0.84, path=meminfo)() == C
    assert linux_meminfo_source(0.9, 0.95, path=meminfo)() == N
    (tmp_path / "garbage").write_text("nonsense\n")
    assert linux_meminfo_source(0.8, 0.9, path=tmp_path / "garbage")() == N


def test_platform_sources_never_raise():
    assert default_source()() in (N, W, C)
    assert mlx_memory_source(0.8, 0.95)() in (N, W, C)
    assert active_memory_bytes() >= 0
    info = mx.device_info()
    if "max_recommended_working_set_size" not in info:
        assert mlx_memory_source(0.0001, 0.0002)() == N


def test_guard_from_settings():
    s = SchedulerSettings(n_draft_min=2, n_draft_max=6, interval_ms=50.0)
    guard = MemoryGuard.from_settings(s, block_size=7, source=lambda: W)
    assert (guard.n_min, guard.n_max, guard.interval_ms) == (2, 6, 50.0)
    assert guard.cap(now=0.0) == 3
    assert MemoryGuard.from_settings(SchedulerSettings(), 7).cap() in (1, 3, 7)


def parse_exposition(text):
    """{metric family: (help, type, {sample line name+labels: value})}."""
    families, current = {}, None
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, help_text = line[7:].split(" ", 1)
            current = name
            families[name] = [help_text, None, {}]
        elif line.startswith("# TYPE "):
            name, kind = line[7:].split(" ")
            assert name == current
            families[name][1] = kind
        else:
            key, value = line.rsplit(" ", 1)
            assert key.startswith(current)
            families[current][2][key] = float(value)
    return families


def test_telemetry_totals_and_prometheus():
    t = Telemetry(window=2)
    t.record_round(cap=7, admitted=4, expected_accepted=2.5, accepted=3, verify_ms=10.0)
    t.record(
        RoundRecord(
            cap=7, admitted=2, expected_accepted=1.5, accepted=0, verify_ms=20.0
        )
    )
    t.record_round(cap=3, admitted=3, expected_accepted=2.0, accepted=3)
    t.n_current, t.ece, t.speedup_ratio = 3, 0.0125, 2.5
    t.memory_pressure_level, t.memory_active_bytes = 1, 123456789
    assert len(t.recent) == 2 and t.n_rounds == 3
    assert t.acceptance_rate == pytest.approx(6 / 9)
    assert t.mean_accepted_length == pytest.approx(3.0)
    assert t.mean_verify_ms == pytest.approx(15.0)

    fam = parse_exposition(render_prometheus(t))
    for name in (
        "dspark_draft_acceptance_rate",
        "dspark_draft_length_tokens",
        "dspark_confidence_head_ece",
        "dspark_scheduler_n_current",
        "dspark_verification_latency_ms",
        "dspark_speedup_ratio",
        "dspark_memory_pressure_level",
        "dspark_memory_active_bytes",
    ):
        assert name in fam and fam[name][0] and fam[name][1]
    assert fam["dspark_draft_acceptance_rate"][1] == "gauge"
    assert fam["dspark_draft_acceptance_rate"][2][
        "dspark_draft_acceptance_rate"
    ] == pytest.approx(6 / 9)
    hist = fam["dspark_draft_length_tokens"]
    assert hist[1] == "histogram"
    assert hist[2]['dspark_draft_length_tokens_bucket{le="1"}'] == 0
    assert hist[2]['dspark_draft_length_tokens_bucket{le="2"}'] == 1
    assert hist[2]['dspark_draft_length_tokens_bucket{le="3"}'] == 2
    assert hist[2]['dspark_draft_length_tokens_bucket{le="4"}'] == 3
    assert hist[2]['dspark_draft_length_tokens_bucket{le="+Inf"}'] == 3
    assert hist[2]["dspark_draft_length_tokens_sum"] == 9
    assert hist[2]["dspark_draft_length_tokens_count"] == 3
    lat = fam["dspark_verification_latency_ms"]
    assert lat[1] == "summary"
    assert lat[2]["dspark_verification_latency_ms_sum"] == 30.0
    assert lat[2]["dspark_verification_latency_ms_count"] == 2
    assert fam["dspark_confidence_head_ece"][2]["dspark_confidence_head_ece"] == 0.0125
    assert fam["dspark_scheduler_n_current"][2]["dspark_scheduler_n_current"] == 3
    assert fam["dspark_speedup_ratio"][2]["dspark_speedup_ratio"] == 2.5
    assert fam["dspark_memory_pressure_level"][2]["dspark_memory_pressure_level"] == 1
    assert (
        fam["dspark_memory_active_bytes"][2]["dspark_memory_active_bytes"] == 123456789
    )
    assert fam["dspark_draft_tokens_expected_total"][1] == "counter"
    assert (
        fam["dspark_draft_tokens_expected_total"][2][
            "dspark_draft_tokens_expected_total"
        ]
        == 6.0
    )


def test_prometheus_empty_and_labels():
    text = render_prometheus(Telemetry(), labels={"model": 'q"w\\en'})
    # A gauge not measured yet has its HELP and TYPE lines and no sample.
    assert "# TYPE dspark_draft_acceptance_rate gauge" in text
    assert "dspark_draft_acceptance_rate{" not in text and "NaN" not in text
    assert 'dspark_draft_length_tokens_bucket{model="q\\"w\\\\en",le="+Inf"} 0' in text
    assert "dspark_memory_active_bytes" in text
