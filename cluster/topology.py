"""Topologies: how many prefill and decode groups, of which DEP size, with which per-rank limits.

A topology is a YAML file (``deploy/presets/*.yaml`` or the operator's own), validated here with
every field described and defaulted; ``--preset NAME`` names a file in ``deploy/presets``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tandem.autoscaler.config import AutoscalingConfig, PoolLimits
from tandem.engine.speculation import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from tandem.kvtransfer.bind_guard import is_loopback

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
    prefill_chunk_tokens: int | None = Field(
        None,
        ge=1,
        description="the most prompt tokens one request computes in a step (none: the step's budget)",
    )
    host_cache_pages: int = Field(
        0,
        ge=0,
        description="host-memory KV pages per prefill (or colocated) rank: the tier evicted device "
        "pages go to (pinned memory on a GPU); 0 = none",
    )
    max_jobs: int | None = Field(
        None,
        ge=1,
        description="prefill pool: jobs one rank holds at most (queued, computing or sending); one "
        "more is refused at once and its decode rank frees the job's pages and retries it; "
        "null = no limit",
    )

    @property
    def ranks(self) -> int:
        return self.groups * self.dep


class SpeculativeSpec(BaseModel):
    """``speculative:`` of a topology: speculative decoding on the decode (or colocated) ranks
    (``engine/speculation.py``); ``tandem serve --speculative-tokens K --drafter D`` overrides."""

    model_config = ConfigDict(extra="forbid")

    tokens: int = Field(
        0, ge=0, le=MAX_SPECULATIVE_TOKENS, description="draft tokens per request per step (K); 0 = off"
    )
    drafter: Literal["ngram", "mtp"] = Field(
        "ngram",
        description="ngram: prompt lookup in the request's own tokens; mtp: the checkpoint's "
        "multi-token-prediction layer, run K times chained",
    )
    ngram_min: int = Field(1, ge=1, description="shortest suffix prompt lookup matches")
    ngram_max: int = Field(4, ge=1, description="longest suffix prompt lookup matches")

    @model_validator(mode="after")
    def _ngram_order(self) -> SpeculativeSpec:
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min: {self.ngram_min} > ngram_max {self.ngram_max}")
        return self

    def config(self) -> SpeculativeConfig:
        return SpeculativeConfig(
            num_tokens=self.tokens, drafter=self.drafter, ngram_min=self.ngram_min, ngram_max=self.ngram_max
        )


class StoreSpec(BaseModel):
    """``store:`` of a topology: the shared KV store (Mooncake Store) every prefill rank reads
    and writes and every decode rank writes finished requests to. Without ``master`` the
    deployment starts ``mooncake_master`` on ``host`` and stops it with the deployment."""

    model_config = ConfigDict(extra="forbid")

    master: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.:-]+:[0-9]+$", description="HOST:PORT of a running master"
    )
    metadata: str | None = Field(
        None,
        description="its metadata server's URL (default: the master's own HTTP one, http://HOST:8080/metadata)",
    )
    host: str = Field(
        "127.0.0.1", description="address the deployment's own master binds (a node address on a cluster)"
    )
    segment_mb: int = Field(256, ge=1, description="MiB of memory each rank's client lends the store")
    secret_file: str | None = Field(
        None,
        description="a file holding the secret that signs and keys the store's blocks (16 bytes or more); "
        "deployments that share a store name the same one (default: $TANDEM_KV_STORE_SECRET, else a "
        "random secret of this deployment's own)",
    )
    trusted_network: bool = Field(
        False,
        description=(
            "the network between the deployment's nodes is its own: Mooncake's store clients serve "
            "unauthenticated reads and writes of each rank's memory on the node's address, and its "
            "master its RPC, metadata and metrics ports on host; needed when either is not loopback"
        ),
    )

    @model_validator(mode="after")
    def _exposure_is_explicit(self) -> StoreSpec:
        if not self.trusted_network and not is_loopback(self.host):
            raise ValueError(
                f"host: {self.host} is reached from the network and the master serves the store's "
                "index unauthenticated; set trusted_network: true if only the deployment's hosts reach it"
            )
        return self

    @model_validator(mode="after")
    def _metadata_with_master(self) -> StoreSpec:
        if self.metadata is not None and self.master is None:
            raise ValueError(
                "metadata: give master too (the deployment's own master has its own metadata server)"
            )
        return self


class PoolBounds(BaseModel):
    model_config = ConfigDict(extra="forbid")

    min_groups: int = Field(1, ge=1, description="the autoscaler never drains the pool below this")
    max_groups: int = Field(4, ge=1, description="nor grows it past this")


class AutoscalingSpec(BaseModel):
    """``autoscaling:`` of a topology: the pools' bounds, the rank budget both share, the SLOs
    and the policy's pace (see ``autoscaler/policy.py``)."""

    model_config = ConfigDict(extra="forbid")

    prefill: PoolBounds = Field(default_factory=lambda: PoolBounds(), description="prefill pool bounds")
    decode: PoolBounds = Field(default_factory=lambda: PoolBounds(), description="decode pool bounds")
    rank_budget: int = Field(16, ge=2, description="ranks both pools may hold together")
    ttft_slo_s: float = Field(1.0, gt=0, description="time to first token, p90 over the window")
    itl_slo_s: float = Field(0.1, gt=0, description="inter-token latency, p90 over the window")
    prefill_queue_target_s: float = Field(0.5, gt=0, description="mean prefill queue time that is pressure")
    decode_queue_target_s: float = Field(0.5, gt=0, description="mean reservation wait that is pressure")
    kv_usage_target: float = Field(0.8, gt=0, le=1, description="decode KV usage that is pressure")
    interval_s: float = Field(5.0, gt=0, description="seconds between two decisions")
    window: str = Field("1m", pattern=r"^[0-9]+(ms|s|m|h)$", description="PromQL window of the signals")
    upscale_ticks: int = Field(2, ge=1, description="ticks of pressure before a group is added")
    downscale_ticks: int = Field(6, ge=1, description="calm ticks before a group is drained")
    settle_ticks: int = Field(2, ge=0, description="ticks ignored after an action (windows lag)")
    margin: float = Field(0.2, ge=0, lt=1, description="headroom a drain must leave under the SLO")

    def config(self, prefill_dep: int, decode_dep: int) -> AutoscalingConfig:
        fields = self.model_dump(exclude={"prefill", "decode", "window"})
        return AutoscalingConfig(
            prefill=PoolLimits(**self.prefill.model_dump(), ranks_per_group=prefill_dep),
            decode=PoolLimits(**self.decode.model_dump(), ranks_per_group=decode_dep),
            **fields,
        )


class PlacementSpec(BaseModel):
    """``placement:`` of a topology: which Ray nodes each pool's groups may use, by node label
    (``ray start --labels tandem.io/role=prefill``). See ``cluster/node_roles.py``."""

    model_config = ConfigDict(extra="forbid")

    label_key: str = Field(
        "tandem.io/role",
        pattern=r"^([a-z0-9.-]+/)?[A-Za-z0-9_.-]+$",
        description="the node label naming a role",
    )
    prefill_label: str = Field("prefill", pattern=r"^[A-Za-z0-9_.-]+$", description="value for prefill nodes")
    decode_label: str = Field("decode", pattern=r"^[A-Za-z0-9_.-]+$", description="value for decode nodes")
    unlabelled_nodes: Literal["auto", "any", "never"] = Field(
        "auto",
        description="whether a node without the role label takes groups of either role: any (yes), "
        "never (no), auto (only while no live node carries a role label)",
    )

    @model_validator(mode="after")
    def _distinct(self) -> PlacementSpec:
        if self.prefill_label == self.decode_label:
            raise ValueError(f"decode_label: {self.decode_label!r} is the prefill_label too")
        return self


class Topology(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field("custom", description="a name for logs and metrics")
    prefill: PoolSpec = Field(default_factory=lambda: PoolSpec(), description="the prefill pool")
    decode: PoolSpec = Field(default_factory=lambda: PoolSpec(), description="the decode pool")
    colocated: PoolSpec | None = Field(
        None,
        description="DEP groups that both prefill and decode, over one KV pool each, with no transfer; "
        "when set, the deployment has this pool instead of prefill and decode",
    )
    kv_transfer: str = Field("layerwise", pattern="^(layerwise|whole)$", description="layerwise or whole")
    kv_timeout_s: float = Field(30.0, gt=0, description="deadline of one request's KV transfer")
    speculative: SpeculativeSpec = Field(
        default_factory=lambda: SpeculativeSpec(), description="speculative decoding (off by default)"
    )
    pin_cores_per_rank: int | None = Field(
        None,
        ge=1,
        description="pin each rank's process to this many of its node's cores, ranks in deployment "
        "order (group by group) wrapping around the cores; configurations compared on one machine then "
        "run on the same cores",
    )
    frontend_cores: list[int] | None = Field(
        None,
        min_length=1,
        description="pin each frontend's process to these of its node's cores; kept apart from the "
        "ranks' cores (pin_cores_per_rank), a frontend woken by a token push does not preempt a step loop",
    )
    cpus_per_rank: float = Field(0.05, gt=0, description="CPU share of a rank on machines without GPUs")
    kv_preconnect: bool = Field(
        True,
        description="when the membership changes, every rank connects its KV transport to the ranks "
        "of the other role (metadata, descriptors, wire-up) ahead of the first transfer; false = at "
        "first contact",
    )
    start_concurrency: int | None = Field(
        None,
        ge=1,
        description="DEP groups started at once (placement, rank processes, model load, rendezvous); "
        "null = every group of the deployment side by side, 1 = one after another",
    )
    gpu_memory_gib: float | None = Field(
        None,
        gt=0,
        description="memory of each rank's GPU in GiB: serve then sizes every rank's KV pool from the "
        "memory plan (`tandem plan memory`; the pools' num_pages unused) and refuses a topology whose "
        "ranks cannot hold the model; null = each pool's num_pages as given",
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0,
        le=1,
        description="the fraction of gpu_memory_gib the plan gives weights, workspace and KV pages (the "
        "rest: the CUDA context, allocator fragments, NCCL buffers)",
    )
    autoscaling: AutoscalingSpec | None = Field(None, description="bounds and SLOs for `serve --autoscale`")
    store: StoreSpec | None = Field(None, description="the shared KV store (off by default)")
    placement: PlacementSpec = Field(
        default_factory=lambda: PlacementSpec(), description="which Ray nodes each pool uses (node labels)"
    )

    @field_validator("frontend_cores")
    @classmethod
    def _cores_listed_once(cls, cores: list[int] | None) -> list[int] | None:
        if cores is not None:
            if any(c < 0 for c in cores):
                raise ValueError(f"a core is a number from 0, got {min(cores)}")
            if len(set(cores)) != len(cores):
                raise ValueError(f"each core once, got {cores}")
        return cores

    @model_validator(mode="after")
    def _autoscaling_fits(self) -> Topology:
        spec = self.autoscaling
        if self.colocated is not None:
            given = sorted({"prefill", "decode"} & self.model_fields_set)
            if given:
                raise ValueError(f"{given[0]}: a topology with a colocated pool has no {given[0]} pool")
            if spec is not None:
                raise ValueError("autoscaling: the autoscaler sizes prefill and decode pools, not colocated")
            if self.speculative.tokens:
                raise ValueError("speculative: drafts are verified on decode ranks, not on a colocated pool")
        if self.decode.host_cache_pages:
            raise ValueError(
                "decode.host_cache_pages: the host tier is a prefill rank's (decode ranks write to the store)"
            )
        if spec is None:
            return self
        for name in ("prefill", "decode"):
            bounds, pool = getattr(spec, name), getattr(self, name)
            if bounds.min_groups > bounds.max_groups:
                raise ValueError(
                    f"autoscaling.{name}: min_groups {bounds.min_groups} > max_groups {bounds.max_groups}"
                )
            if not bounds.min_groups <= pool.groups <= bounds.max_groups:
                raise ValueError(
                    f"autoscaling.{name}: the pool starts with {pool.groups} groups, outside "
                    f"[{bounds.min_groups}, {bounds.max_groups}]"
                )
        if self.prefill.ranks + self.decode.ranks > spec.rank_budget:
            raise ValueError(
                f"autoscaling.rank_budget: {spec.rank_budget} ranks, but the pools start with "
                f"{self.prefill.ranks + self.decode.ranks}"
            )
        return self

    def autoscaling_config(self) -> AutoscalingConfig:
        """The policy's configuration (the defaults when the topology has no ``autoscaling:``)."""
        spec = self.autoscaling or AutoscalingSpec(
            prefill=PoolBounds(min_groups=self.prefill.groups, max_groups=max(4, self.prefill.groups)),
            decode=PoolBounds(min_groups=self.decode.groups, max_groups=max(4, self.decode.groups)),
            rank_budget=max(16, self.prefill.ranks + self.decode.ranks),
        )
        return spec.config(self.prefill.dep, self.decode.dep)

    @property
    def pools(self) -> tuple[PoolSpec, ...]:
        """The pools it starts: colocated, or prefill and decode."""
        return (self.colocated,) if self.colocated is not None else (self.prefill, self.decode)

    @property
    def ranks(self) -> int:
        return sum(p.ranks for p in self.pools)

    def describe(self) -> str:
        """E.g. ``local: 1xDEP2 prefill + 1xDEP2 decode`` or ``colocated: 2xDEP2 colocated``."""
        if self.colocated is not None:
            return f"{self.name}: {self.colocated.groups}xDEP{self.colocated.dep} colocated"
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
            message = first["msg"].removeprefix("Value error, ")
            raise TopologyError(str(path), f"{field}: {message}" if field else message) from None

    @staticmethod
    def preset(name: str) -> Topology:
        path = PRESETS_DIR / f"{name}.yaml"
        if not path.is_file():
            known = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
            raise TopologyError("--preset", f"no preset {name!r}; presets: {', '.join(known)}")
        return Topology.load(path)
