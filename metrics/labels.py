"""The label sets that say which process a sample comes from. Each process's metrics carry its
own identity, so a scrape read directly (``curl /metrics``) names its source as well as one that
went through Prometheus; the discovery document gives Prometheus the same labels."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class FrontendLabels:
    model: str
    frontend: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class RankLabels:
    model: str
    role: str
    group: str
    rank: str  # the rank's name, e.g. ``decode0-r1``
    incarnation: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class ControllerLabels:
    model: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)
