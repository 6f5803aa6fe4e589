"""A short-horizon forecast of a pool's demand: what it must carry by the time a group started
now would serve.

The forecast at ``ahead_s`` is the largest of three readings of the recent past:

- the trend: a least-squares line over the last ``trend_ticks`` samples, extrapolated;
- the recent peak: the largest sample within ``peak_window_s`` (demand that just fell may
  return before a drained group could be started again);
- the current level plus the ``rise_quantile`` of the rises seen over any ``ahead_s`` within
  ``rise_history_s`` (how fast this load has grown before, so a step up is met, not chased).
  A rise counts at most ``max_rise`` times the level it started from, and none from zero: a
  start from nothing does not read as the load's usual growth, and a pool that is idle now
  plans for no load. Levels and rises are read off the mean of the last
  ``rise_smoothing_ticks`` samples, so a noisy gauge (the sequences running at one instant)
  does not read as growth.

Each is cheap and robust; their maximum errs towards capacity, which the SLO prefers, and the
scale-down rules keep it from costing more than a peak window's worth.

:class:`BurstHeadroom` reads what none of these can: bursts shorter than a group's start, which
only capacity already serving absorbs. Each tick it takes the arrival rate's short-range peak
(its largest rate over a few seconds) over the arrival level (the mean rate of the last
``level_ticks`` windows); the ``quantile`` of those ratios over the history, times the current
level, is the peak to be ready for. As a multiple of the level, it follows the load's swing (a
burst in the trough asks less than one at the peak), and both figures come from the same
arrivals, so neither a pool that computes less than arrives nor a load that grows reads as a
burst of its own.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field


@dataclass
class TrendForecast:
    trend_ticks: int = 12
    peak_window_s: float = 120.0
    rise_history_s: float = 1800.0
    rise_quantile: float = 0.9
    max_rise: float = 3.0
    rise_smoothing_ticks: int = 6
    samples: deque[tuple[float, float]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if not isinstance(self.trend_ticks, int) or self.trend_ticks < 2:
            raise ValueError(f"trend_ticks: must be an integer >= 2, got {self.trend_ticks!r}")
        if not isinstance(self.rise_smoothing_ticks, int) or self.rise_smoothing_ticks < 1:
            raise ValueError(
                f"rise_smoothing_ticks: must be an integer >= 1, got {self.rise_smoothing_ticks!r}"
            )
        if not 0 <= self.rise_quantile <= 1:
            raise ValueError(f"rise_quantile: must be in [0, 1], got {self.rise_quantile!r}")
        for name in ("peak_window_s", "rise_history_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: must be a number of seconds >= 0, got {value!r}")

    def observe(self, t_s: float, value: float) -> None:
        if self.samples and t_s <= self.samples[-1][0]:
            raise ValueError(f"t_s: {t_s} is not after the last sample's {self.samples[-1][0]}")
        self.samples.append((t_s, value))
        keep = max(self.rise_history_s, self.peak_window_s)
        while len(self.samples) > self.trend_ticks and self.samples[0][0] < t_s - keep:
            self.samples.popleft()

    def predict(self, ahead_s: float) -> float | None:
        """The demand expected within ``ahead_s``; ``None`` before any sample."""
        if not self.samples:
            return None
        now, latest = self.samples[-1]
        smooth = self._smoothed()
        level = smooth[-1][1]
        rise = level + self._rise(smooth, ahead_s) if level > 0 else None
        readings = [latest, self._trend(now + ahead_s), self._peak(now), rise]
        return max(0.0, *(r for r in readings if r is not None))

    def _trend(self, at_s: float) -> float | None:
        recent = list(self.samples)[-self.trend_ticks :]
        if len(recent) < 2:
            return None
        mean_t = sum(t for t, _ in recent) / len(recent)
        mean_v = sum(v for _, v in recent) / len(recent)
        var = sum((t - mean_t) ** 2 for t, _ in recent)
        if var <= 0:
            return None
        slope = sum((t - mean_t) * (v - mean_v) for t, v in recent) / var
        return mean_v + slope * (at_s - mean_t)

    def _peak(self, now: float) -> float:
        return max(v for t, v in self.samples if t >= now - self.peak_window_s)

    def _smoothed(self) -> list[tuple[float, float]]:
        """The samples' moving mean over ``rise_smoothing_ticks`` (fewer at the start), each
        summed afresh: a running sum's rounding leaves a residue (1e-11) after a burst, which
        would read an idle pool as busy and add the history's rises to it."""
        values = [v for _, v in self.samples]
        n = self.rise_smoothing_ticks
        return [
            (t, math.fsum(values[max(0, i + 1 - n) : i + 1]) / min(i + 1, n))
            for i, (t, _) in enumerate(self.samples)
        ]

    def _rise(self, points: list[tuple[float, float]], ahead_s: float) -> float:
        """The ``rise_quantile`` of ``value(t + ahead_s) - value(t)`` (at most ``max_rise *
        value(t)``; ``value(t) > 0`` only) over the smoothed history: 0 when it is shorter than
        ``ahead_s`` or never rose."""
        rises = []
        j = 0
        for t, v in points:
            while j < len(points) and points[j][0] < t + ahead_s:
                j += 1
            if j == len(points):
                break
            if v > 0:
                rises.append(min(points[j][1] - v, self.max_rise * v))
        if not rises:
            return 0.0
        rises.sort()
        at = min(len(rises) - 1, max(0, math.ceil(self.rise_quantile * len(rises)) - 1))
        return max(0.0, rises[at])


@dataclass
class BurstHeadroom:
    """``level_ticks`` windows make the level; ratios older than ``history_s`` are dropped."""

    level_ticks: int = 12
    quantile: float = 0.9
    history_s: float = 1800.0
    levels: deque[float] = field(default_factory=deque)
    ratios: deque[tuple[float, float]] = field(default_factory=deque)  # (time, peak / level)

    def __post_init__(self) -> None:
        if not isinstance(self.level_ticks, int) or self.level_ticks < 1:
            raise ValueError(f"level_ticks: must be an integer >= 1, got {self.level_ticks!r}")
        if not 0 <= self.quantile <= 1:
            raise ValueError(f"burst_quantile: must be in [0, 1], got {self.quantile!r}")

    def observe(self, t_s: float, rate: float | None, peak: float | None) -> None:
        """One tick's arrival ``rate`` over the window and its short-range ``peak`` within it
        (``None`` or not finite: not read; no rate counts as no arrivals)."""
        self.levels.append(rate if rate is not None and math.isfinite(rate) else 0.0)
        while len(self.levels) > self.level_ticks:
            self.levels.popleft()
        level = self.level()
        if peak is not None and math.isfinite(peak) and level > 0:
            self.ratios.append((t_s, max(peak, 0.0) / level))
        while self.ratios and self.ratios[0][0] < t_s - self.history_s:
            self.ratios.popleft()

    def level(self) -> float:
        return math.fsum(self.levels) / len(self.levels) if self.levels else 0.0

    def peak(self) -> float | None:
        """The short-range peak to be ready for at the current level; ``None`` before any tick
        with arrivals."""
        if not self.ratios:
            return None
        ordered = sorted(r for _, r in self.ratios)
        at = min(len(ordered) - 1, max(0, math.ceil(self.quantile * len(ordered)) - 1))
        return self.level() * ordered[at]
