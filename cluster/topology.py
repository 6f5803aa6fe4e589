"""Topologies: how many prefill and decode groups, of which DEP size, with which per-rank limits.

A topology is a YAML file (``deploy/presets/*.yaml`` or the operator's own), validated here with
every field described and defaulted; ``--preset NAME`` names a file in ``deploy/presets``.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

PRESETS_DIR = Path(__file__).resolve().parent.parent / "deploy" / "presets"


class TopologyError(ValueError):
    def __init__(self, source: str, message: str) -> None:
        super().__init__(f"{source}: {message}")
        self.source, self.message = source, message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.source, self.message))


class PoolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    groups: int = Field(1, ge=1, description="number of DEP groups in the pool")
    dep: int = Field(
        2, ge=1, description="ranks per DEP group (data-parallel attention, expert-parallel MoE)"
    )
    num_pages: int = Field(256, ge=1, description="KV pool pages per rank")
    page_size: int = Field(64, ge=1, description="tokens per KV page")
    max_num_seqs: int = Field(64, ge=1, description="requests in one rank's batch at most")
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget of one rank's step")

    @property
    def ranks(self) -> int:
        return self.groups * self.dep


class Topology(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("custom", description="a name for logs and metrics")
    prefill: PoolSpec = Field(default_factory=lambda: PoolSpec(), description="the prefill pool")
    decode: PoolSpec = Field(default_factory=lambda: PoolSpec(), description="the decode pool")
    kv_transfer: str = Field("layerwise", pattern="^(layerwise|whole)$", description="layerwise or whole")
    kv_timeout_s: float = Field(30.0, gt=0, description="deadline of one request's KV transfer")
    cpus_per_rank: float = Field(0.05, gt=0, description="CPU share of a rank on machines without GPUs")

    def describe(self) -> str:
        """E.g. ``local: 1xDEP2 prefill + 1xDEP2 decode``."""
        p, d = self.prefill, self.decode
        return f"{self.name}: {p.groups}xDEP{p.dep} prefill + {d.groups}xDEP{d.dep} decode"

    @staticmethod
    def load(path: Path) -> Topology:
        try:
            raw = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise TopologyError(str(path), f"cannot read: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise TopologyError(str(path), f"not valid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise TopologyError(str(path), "expected a mapping at the top level")
        try:
            return Topology.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            raise TopologyError(str(path), f"{field}: {first['msg']}") from None

    @staticmethod
    def preset(name: str) -> Topology:
        path = PRESETS_DIR / f"{name}.yaml"
        if not path.is_file():
            known = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
            raise TopologyError("--preset", f"no preset {name!r}; presets: {', '.join(known)}")
        return Topology.load(path)
