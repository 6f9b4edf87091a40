"""Memory-pressure guard for unified memory.

A *source* is a zero-argument callable returning a :class:`PressureLevel`.
Sources never raise: any failure reads as NORMAL, so a missing sysctl, an
unreadable /proc file or an MLX build without device memory info never stops
generation. :class:`MemoryGuard` turns the level into a cap on drafts per round.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path

import mlx.core as mx

from .scheduler import SchedulerSettings


class PressureLevel(IntEnum):
    NORMAL = 0
    WARNING = 1
    CRITICAL = 2


PressureSource = Callable[[], PressureLevel]


def _level_from_fraction(used: float, warning: float, critical: float) -> PressureLevel:
    if used >= critical:
        return PressureLevel.CRITICAL
    if used >= warning:
        return PressureLevel.WARNING
    return PressureLevel.NORMAL


def safe_source(source: PressureSource) -> PressureSource:
    """Wrap a source so that exceptions and odd return values read as NORMAL."""

    def read() -> PressureLevel:
        try:
            return PressureLevel(int(source()))
        except Exception:
            return PressureLevel.NORMAL

    return read


def combined_source(*sources: PressureSource) -> PressureSource:
    """The worst level reported by any source (each one wrapped by safe_source)."""
    wrapped = [safe_source(s) for s in sources]

    def read() -> PressureLevel:
        return max((s() for s in wrapped), default=PressureLevel.NORMAL)

    return read


def macos_pressure_source() -> PressureSource:
    """``kern.memorystatus_vm_pressure_level`` via sysctlbyname: 1 normal,
    2 warning, 4 critical."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)

    def read() -> PressureLevel:
        value = ctypes.c_int(0)
        size = ctypes.c_size_t(ctypes.sizeof(value))
        rc = libc.sysctlbyname(
            b"kern.memorystatus_vm_pressure_level",
            ctypes.byref(value),
            ctypes.byref(size),
            None,
            ctypes.c_size_t(0),
        )
        if rc != 0:
            return PressureLevel.NORMAL
        return {2: PressureLevel.WARNING, 4: PressureLevel.CRITICAL}.get(
            value.value, PressureLevel.NORMAL
        )

    return safe_source(read)


def mlx_memory_source(warning: float, critical: float) -> PressureSource:
    """MLX active memory as a fraction of the device's recommended working set
    (``mx.device_info()['max_recommended_working_set_size']``, Metal only)."""

    def read() -> PressureLevel:
        info = getattr(mx, "device_info", None) or mx.metal.device_info
        budget = info().get("max_recommended_working_set_size", 0)
        if not budget:
            return PressureLevel.NORMAL
        return _level_from_fraction(mx.get_active_memory() / budget, warning, critical)

    return safe_source(read)


def linux_psi_source(
    warning_avg10: float = 10.0,
    critical_avg10: float = 40.0,
    path: str | Path = "/proc/pressure/memory",
) -> PressureSource:
    """Linux pressure-stall information: ``some avg10`` (percent of the last 10 s
    in which some task stalled on memory)."""

    def read() -> PressureLevel:
        for line in Path(path).read_text().splitlines():
            if line.startswith("some "):
                fields = dict(kv.split("=", 1) for kv in line.split()[1:])
                avg10 = float(fields["avg10"])
                if avg10 >= critical_avg10:
                    return PressureLevel.CRITICAL
                if avg10 >= warning_avg10:
                    return PressureLevel.WARNING
        return PressureLevel.NORMAL

    return safe_source(read)


def linux_meminfo_source(
    warning: float, critical: float, path: str | Path = "/proc/meminfo"
) -> PressureSource:
    """Used fraction 1 - MemAvailable / MemTotal from /proc/meminfo."""

    def read() -> PressureLevel:
        info = {}
        for line in Path(path).read_text().splitlines():
            key, _, rest = line.partition(":")
            info[key] = float(rest.split()[0]) if rest.split() else 0.0
        used = 1.0 - info["MemAvailable"] / info["MemTotal"]
        return _level_from_fraction(used, warning, critical)

    return safe_source(read)


def default_source(warning: float = 0.80, critical: float = 0.95) -> PressureSource:
    """The platform's sources combined: macOS sysctl + MLX working set; Linux
    PSI + MemAvailable (+ MLX working set where the backend reports one)."""
    try:
        if sys.platform == "darwin":
            return combined_source(
                macos_pressure_source(), mlx_memory_source(warning, critical)
            )
        if sys.platform.startswith("linux"):
            return combined_source(
                linux_psi_source(),
                linux_meminfo_source(warning, critical),
                mlx_memory_source(warning, critical),
            )
        return combined_source(mlx_memory_source(warning, critical))
    except Exception:
        return combined_source()


def active_memory_bytes() -> int:
    """MLX active memory, 0 when it cannot be read."""
    try:
        return int(mx.get_active_memory())
    except Exception:
        return 0


def _warn(message: str) -> None:
    logging.getLogger("mlx_dspark").warning(message)


@dataclass
class MemoryGuard:
    """Cap on drafts per round driven by memory pressure.

    NORMAL -> n_max; WARNING -> max(n_min, n_max // 2); CRITICAL -> n_min.
    Every transition to a worse level frees MLX's buffer cache once; the first
    CRITICAL also prints one warning line (once per guard; call ``reset`` for a
    new generation). The source is sampled at most every ``interval_ms``.
    """

    source: PressureSource
    n_min: int
    n_max: int
    interval_ms: float = 500.0
    clock: Callable[[], float] = time.monotonic
    clear_cache: Callable[[], None] = mx.clear_cache
    log: Callable[[str], None] = _warn
    level: PressureLevel = PressureLevel.NORMAL
    _last_sample: float | None = field(default=None, init=False, repr=False)
    _warned: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.source = safe_source(self.source)
        self.n_min = max(0, min(self.n_min, self.n_max))

    @classmethod
    def from_settings(
        cls,
        settings: SchedulerSettings,
        block_size: int,
        source: PressureSource | None = None,
    ) -> MemoryGuard:
        """Guard for a ``SchedulerSettings`` and a drafter block size."""
        if source is None:
            source = default_source(
                settings.memory_warning_fraction, settings.memory_critical_fraction
            )
        return cls(
            source=source,
            n_min=settings.n_min(block_size),
            n_max=settings.n_max(block_size),
            interval_ms=settings.interval_ms,
        )

    def cap_for(self, level: PressureLevel) -> int:
        if level == PressureLevel.CRITICAL:
            return self.n_min
        if level == PressureLevel.WARNING:
            return max(self.n_min, self.n_max // 2)
        return self.n_max

    def poll(self, now: float | None = None) -> PressureLevel:
        """Sample the source if the interval has passed; return the current level."""
        now = self.clock() if now is None else now
        if (
            self._last_sample is not None
            and (now - self._last_sample) * 1000.0 < self.interval_ms
        ):
            return self.level
        self._last_sample = now
        new = self.source()
        if new > self.level:
            try:
                self.clear_cache()
            except Exception:
                pass
        if new == PressureLevel.CRITICAL and not self._warned:
            self._warned = True
            self.log(
                "[dspark] warning: critical memory pressure, limiting speculation "
                f"to {self.n_min} draft token(s) per round"
            )
        self.level = new
        return new

    def cap(self, now: float | None = None) -> int:
        """Current draft cap (samples the source at most every interval_ms)."""
        return self.cap_for(self.poll(now))

    def reset(self) -> None:
        """Start a new generation: re-arm the warning and sample on next call."""
        self._warned = False
        self._last_sample = None
        self.level = PressureLevel.NORMAL
