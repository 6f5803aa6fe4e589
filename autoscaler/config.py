"""What the autoscaler may do and what it aims for: per-pool bounds, one rank budget shared by
both pools, the SLOs, and how many ticks a signal must last before it acts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.wire.messages import Role


@dataclass(frozen=True, kw_only=True)
class PoolLimits:
    min_groups: int = 1
    max_groups: int = 4
    ranks_per_group: int = 2  # the pool's DEP size

    def __post_init__(self) -> None:
        for name in ("min_groups", "max_groups", "ranks_per_group"):
            value = getattr(self, name)
            if (
                not isinstance(value, int)
                or isinstance(value, bool)
                or value < (0 if name == "min_groups" else 1)
            ):
                raise ValueError(
                    f"{name}: must be an integer >= {0 if name == 'min_groups' else 1}, got {value!r}"
                )
        if self.min_groups > self.max_groups:
            raise ValueError(f"min_groups ({self.min_groups}) exceeds max_groups ({self.max_groups})")


@dataclass(frozen=True, kw_only=True)
class AutoscalingConfig:
    """``ttft_slo_s`` and ``itl_slo_s`` bound the p90s over the metric window. A pool acts on
    pressure that lasted ``upscale_ticks`` ticks (so one spike does not scale), and drains a
    group only after ``downscale_ticks`` calm ticks and when its demand on one group fewer stays
    under ``1 - margin`` of what a group has been seen to carry within its SLO. After an action
    completes, ``settle_ticks`` ticks of samples are ignored: their windows still hold the time
    before it."""

    prefill: PoolLimits = PoolLimits()
    decode: PoolLimits = PoolLimits()
    rank_budget: int = 8
    ttft_slo_s: float = 1.0
    itl_slo_s: float = 0.1
    prefill_queue_target_s: float = 0.5
    decode_queue_target_s: float = 0.5
    kv_usage_target: float = 0.8
    interval_s: float = 5.0
    upscale_ticks: int = 2
    downscale_ticks: int = 6
    settle_ticks: int = 2
    margin: float = 0.2

    def __post_init__(self) -> None:
        for name in (
            "ttft_slo_s",
            "itl_slo_s",
            "prefill_queue_target_s",
            "decode_queue_target_s",
            "interval_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name}: must be a positive number of seconds, got {value!r}")
        for name in ("upscale_ticks", "downscale_ticks", "rank_budget"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        if not isinstance(self.settle_ticks, int) or self.settle_ticks < 0:
            raise ValueError(f"settle_ticks: must be an integer >= 0, got {self.settle_ticks!r}")
        if not 0 < self.kv_usage_target <= 1:
            raise ValueError(f"kv_usage_target: must be in (0, 1], got {self.kv_usage_target!r}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin: must be in [0, 1), got {self.margin!r}")
        floor = sum(p.min_groups * p.ranks_per_group for p in (self.prefill, self.decode))
        if floor > self.rank_budget:
            raise ValueError(
                f"rank_budget: {self.rank_budget} ranks cannot hold both pools' minimum ({floor})"
            )

    def limits(self, pool: Role) -> PoolLimits:
        return self.prefill if pool is Role.PREFILL else self.decode

    def slo_s(self, pool: Role) -> float:
        return self.ttft_slo_s if pool is Role.PREFILL else self.itl_slo_s

    def queue_target_s(self, pool: Role) -> float:
        return self.prefill_queue_target_s if pool is Role.PREFILL else self.decode_queue_target_s
