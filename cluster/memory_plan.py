"""How each rank's GPU memory divides: weights, activation workspace, KV pages (torch-free).

For every rank of a topology (pools in the order ``serve`` starts them, then groups, then ranks)::

    usable     = gpu_memory_gib x 2**30 x utilization      (the rest: CUDA context, allocator
                                                              fragments, NCCL buffers, graphs)
    kv_pages   = floor((usable - weight_bytes - workspace_bytes) / kv_page_bytes), at least 0
    fits       = kv_pages >= the pages of one request at the model's whole context

``weight_bytes`` is ``model/rank_weights.py``'s count of what the rank's ``DeepseekV3`` holds
(its expert slice; the MTP layer when its role loads it). ``kv_page_bytes`` is one page of
every layer of the rank's pool: ``layers x page_size x (kv_lora_rank + qk_rope_head_dim) x
dtype bytes``, ``layers`` one more than the decoder layers when the pool holds the MTP layer's
KV. A rank's context is the model's ``max_position_embeddings`` (the prefill and decode roles
use it; a colocated rank's ``EngineConfig`` has no ``max_model_len``).

With ``Topology.gpu_memory_gib`` set, ``serve`` sizes each pool with :func:`sized_topology`:
every rank of a pool gets the pool's smallest ``kv_pages`` (one role spec serves the pool), and
a topology with a rank that does not fit is refused naming it, before anything starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.cluster.memory_plan_v4 import v4_mtp_state_bytes, v4_workspace_bytes
from tandem.cluster.topology import PoolSpec, Topology, TopologyError
from tandem.engine.admission import max_kv_pages
from tandem.model.config import ModelConfig
from tandem.model.rank_weights import dtype_bytes, rank_weight_bytes
from tandem.model.v4.config import V4Config
from tandem.model.v4.kv_layout import (
    KindBytes,
    page_bytes,
    request_bytes,
    slot_bytes,
    transfer_slots,
    v4_kinds,
    v4_page_size,
)
from tandem.model.v4.rank_weights import v4_rank_weight_bytes
from tandem.wire.messages import Role

GIB = 1 << 30
FLOAT32_BYTES = 4


class MemoryPlanError(TopologyError):
    """A rank of the topology cannot hold the model and one request at its whole context."""


@dataclass(frozen=True)
class RankMemory:
    role: Role
    group: str  # the group's id as the controller names it: prefill0, decode0, colocated0
    rank: int
    weight_bytes: int
    workspace_bytes: int
    kv_page_bytes: int
    kv_pages: int
    request_pages: int  # pages one request at the model's whole context holds
    page_size: int
    state_bytes: int = 0  # V4: what the running requests hold beside their pages, max_num_seqs of them
    kinds: tuple[KindBytes, ...] = ()  # V4: each kind of KV state's bytes

    @property
    def fits(self) -> bool:
        return self.kv_pages >= self.request_pages

    @property
    def name(self) -> str:
        return f"{self.group}/{self.rank}"


@dataclass(frozen=True)
class MemoryPlan:
    topology: str  # its description: name, pools
    dtype: str
    gpu_memory_bytes: int
    utilization: float
    ranks: tuple[RankMemory, ...]

    @property
    def usable_bytes(self) -> int:
        return math.floor(self.gpu_memory_bytes * self.utilization)

    @property
    def fits(self) -> bool:
        return all(r.fits for r in self.ranks)

    def misfits(self) -> list[RankMemory]:
        return [r for r in self.ranks if not r.fits]

    def pool_pages(self, role: Role) -> int:
        """The pages every rank of the pool can have: its ranks' fewest."""
        return min(r.kv_pages for r in self.ranks if r.role is role)


@dataclass(frozen=True)
class _Pool:
    role: Role
    spec: PoolSpec
    mtp: bool  # the rank loads the MTP layer and its pool holds that layer's KV
    rows: int  # hidden-state rows of the rank's largest step
    sampling_rows: int  # rows whose logits one step computes, at most ``rows``

    @property
    def logit_rows(self) -> int:
        return min(self.rows, self.sampling_rows)


def _pools(topology: Topology) -> list[_Pool]:
    """The pools as ``cluster/pools.py`` builds their roles."""
    c = topology.colocated
    if c is not None:
        return [_Pool(Role.COLOCATED, c, False, c.max_num_batched_tokens, c.max_num_seqs)]
    spec = topology.speculative.config()
    mtp = spec.enabled and spec.drafter == "mtp"
    p, d = topology.prefill, topology.decode
    decode_rows = d.max_num_seqs * (1 + spec.num_tokens)  # each request's row and its drafts
    return [
        _Pool(Role.PREFILL, p, mtp, p.max_num_batched_tokens, p.max_num_seqs),
        _Pool(Role.DECODE, d, mtp, decode_rows, decode_rows),
    ]


def kv_page_bytes(cfg: ModelConfig, dtype: str, page_size: int, mtp: bool = False) -> int:
    """One page of every layer of a rank's pool (``model/kv_pool.py``: ``[layer, page, slot,
    latent | rope]``, in the model dtype)."""
    layers = cfg.num_hidden_layers + (1 if mtp else 0)
    return layers * page_size * cfg.kv_cache_dim * dtype_bytes(dtype)


def workspace_bytes(cfg: ModelConfig, dtype: str, rows: int, logit_rows: int) -> int:
    """An estimate of the memory a step's activations take beside the weights and the pool.

    Per hidden-state row (``rows``: a prefill or colocated rank's ``max_num_batched_tokens``,
    a decode rank's ``max_num_seqs x (1 + draft tokens)``), in the model dtype: the hidden state
    and the residual (``2 x hidden``), plus the largest of one layer's intermediates:

    - attention: the query (``heads x qk_head_dim``), the larger of the extend form's per-head
      keys and values (``heads x (qk_nope + v)``) and the absorbed decode form's latent query and
      output (``heads x 2 x kv_lora_rank``), and the heads' output (``heads x v_head_dim``);
    - a dense MLP: gate, up and their product (``3 x intermediate_size``);
    - an MoE layer, at balanced routing: each of the row's ``k`` routed copies sent, received
      and returned by the all-to-all (``3 x k x hidden``), its gate, up and product in the
      grouped GEMM (``3 x k x moe_intermediate_size``), and the shared experts' (``3 x
      n_shared x moe_intermediate_size``). A step whose routing is skewed receives more.

    Plus ``logit_rows`` rows of logits (the rows that sample: one per request in a prefill or
    colocated step, every row of a decode step) in the model dtype and two float32 copies
    (the logits and the probabilities the sampler works on), and the float32 RoPE table
    (``cos``, ``sin``: ``max_position_embeddings x qk_rope_head_dim / 2`` each). Not counted:
    prompt logprobs' logit slices, the CUDA graphs' pools, kernels' scratch; the utilization
    fraction leaves room for them.
    """
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    attention = heads * (
        cfg.qk_head_dim + max(cfg.qk_nope_head_dim + cfg.v_head_dim, 2 * cfg.kv_lora_rank) + cfg.v_head_dim
    )
    dense = 3 * cfg.intermediate_size if cfg.first_k_dense_replace > 0 else 0
    moe_inter = cfg.moe_intermediate_size
    moe = cfg.num_experts_per_tok * 3 * (h + moe_inter) + 3 * cfg.n_shared_experts * moe_inter
    if cfg.first_k_dense_replace >= cfg.num_hidden_layers:
        moe = 0
    per_row = 2 * h + max(attention, dense, moe)
    item = dtype_bytes(dtype)
    logits = logit_rows * cfg.vocab_size * (item + 2 * FLOAT32_BYTES)
    rope_table = cfg.max_position_embeddings * cfg.qk_rope_head_dim * FLOAT32_BYTES
    return rows * per_row * item + logits + rope_table


def plan_memory(
    topology: Topology,
    cfg: ModelConfig | V4Config,
    dtype: str,
    gpu_memory_gib: float,
    utilization: float = 0.9,
) -> MemoryPlan:
    """Every rank's share of ``gpu_memory_gib`` (see the module docstring; a V4 model's in
    ``cluster/memory_plan_v4.py``)."""
    if not gpu_memory_gib > 0:
        raise ValueError(f"gpu_memory_gib: must be > 0, got {gpu_memory_gib}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization: must be in (0, 1], got {utilization}")
    gpu_bytes = math.floor(gpu_memory_gib * GIB)
    usable = math.floor(gpu_bytes * utilization)
    context = cfg.max_position_embeddings
    ranks: list[RankMemory] = []
    for pool in _pools(topology):
        spec = pool.spec
        figures = _PoolFigures.of(cfg, pool, dtype)
        request_pages = max_kv_pages(context, 0, context, figures.page_size)
        per_rank = []
        for r in range(spec.dep):
            weights = figures.weights(r)
            pages = max(0, (usable - weights - figures.workspace - figures.state) // figures.page_bytes)
            per_rank.append((weights, pages))
        for g in range(spec.groups):  # every group of a pool holds the same slices
            for r, (weights, pages) in enumerate(per_rank):
                rank = RankMemory(
                    role=pool.role,
                    group=f"{pool.role.value}{g}",
                    rank=r,
                    weight_bytes=weights,
                    workspace_bytes=figures.workspace,
                    kv_page_bytes=figures.page_bytes,
                    kv_pages=pages,
                    request_pages=request_pages,
                    page_size=figures.page_size,
                    state_bytes=figures.state,
                    kinds=figures.kinds,
                )
                ranks.append(rank)
    return MemoryPlan(topology.describe(), dtype, gpu_bytes, utilization, tuple(ranks))


@dataclass(frozen=True)
class _PoolFigures:
    """A pool's page, workspace and per-request state, by the model's family."""

    cfg: ModelConfig | V4Config
    pool: _Pool
    dtype: str
    page_size: int
    page_bytes: int
    workspace: int
    state: int = 0
    kinds: tuple[KindBytes, ...] = ()

    @staticmethod
    def of(cfg: ModelConfig | V4Config, pool: _Pool, dtype: str) -> _PoolFigures:
        spec = pool.spec
        if isinstance(cfg, V4Config):
            item = dtype_bytes(dtype)
            size = v4_page_size(cfg, spec.page_size)
            kinds = tuple(v4_kinds(cfg, item, size, prefix_caching=True))
            workspace = v4_workspace_bytes(cfg, dtype, pool.rows, pool.logit_rows)
            per_request = request_bytes(list(kinds)) + (v4_mtp_state_bytes(cfg, item) if pool.mtp else 0)
            state = per_request * spec.max_num_seqs
            if pool.role is not Role.COLOCATED:  # and the state slots of its transfers in flight
                slots = transfer_slots(pool.role is Role.PREFILL, spec.max_num_seqs)
                state += slots * slot_bytes(cfg, item, pool.mtp)
            return _PoolFigures(
                cfg, pool, dtype, size, page_bytes(list(kinds), size), workspace, state, kinds
            )
        page = kv_page_bytes(cfg, dtype, spec.page_size, pool.mtp)
        workspace = workspace_bytes(cfg, dtype, pool.rows, pool.logit_rows)
        return _PoolFigures(cfg, pool, dtype, spec.page_size, page, workspace)

    def weights(self, rank: int) -> int:
        dep = self.pool.spec.dep
        if isinstance(self.cfg, V4Config):
            return v4_rank_weight_bytes(
                self.cfg, self.dtype, rank, dep, quantized=True, mtp=self.pool.mtp
            ).total_bytes
        return rank_weight_bytes(self.cfg, self.dtype, rank, dep, mtp=self.pool.mtp).total_bytes


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def misfit_line(plan: MemoryPlan, rank: RankMemory) -> str:
    """One line: the rank that cannot hold the model, and its numbers."""
    need = rank.request_pages * rank.kv_page_bytes
    return (
        f"rank {rank.name} ({rank.role.value}) cannot hold the model and one request of its whole context: "
        f"{gib(plan.usable_bytes)} usable ({plan.gpu_memory_bytes / GIB:g} GiB x {plan.utilization:g}) - "
        f"{gib(rank.weight_bytes)} of weights - {gib(rank.workspace_bytes)} of workspace"
        f"{f' - {gib(rank.state_bytes)} of running requests' if rank.state_bytes else ''} leaves "
        f"{rank.kv_pages} KV pages; one request needs {rank.request_pages} ({gib(need)})"
    )


def sized_topology(topology: Topology, cfg: ModelConfig | V4Config, dtype: str) -> Topology:
    """``topology`` with each pool's ``num_pages`` from the plan of ``topology.gpu_memory_gib``
    (``topology`` as it is when that is unset). :class:`MemoryPlanError` names the first rank
    that does not fit."""
    if topology.gpu_memory_gib is None:
        return topology
    plan = plan_memory(topology, cfg, dtype, topology.gpu_memory_gib, topology.gpu_memory_utilization)
    misfits = plan.misfits()
    if misfits:
        raise MemoryPlanError("gpu_memory_gib", misfit_line(plan, misfits[0]))
    if topology.colocated is not None:
        pool = topology.colocated.model_copy(update={"num_pages": plan.pool_pages(Role.COLOCATED)})
        return topology.model_copy(update={"colocated": pool})
    prefill = topology.prefill.model_copy(update={"num_pages": plan.pool_pages(Role.PREFILL)})
    decode = topology.decode.model_copy(update={"num_pages": plan.pool_pages(Role.DECODE)})
    return topology.model_copy(update={"prefill": prefill, "decode": decode})
