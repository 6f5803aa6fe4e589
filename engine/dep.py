"""Expert parallelism inside a DEP group: routed experts split across the ranks, rows moved to
their experts and back with all-to-all in every MoE layer.

Each rank holds a contiguous slice of the experts (:func:`expert_slice`; sizes differ by at most
one, and a rank may hold none). Per MoE layer, on every rank::

    (token, k) pairs sorted by expert  ->  grouped by owner rank (slices are contiguous)
    all-to-all #1: counts [n, E_local]     who sends how many rows for each of my experts
    all-to-all #2: rows   [pairs, D]       hidden states to their owners (uneven splits)
    owner: each received row through its expert (weight 1: the sender weights it)
    all-to-all #3: rows back in the order they were sent
    sender: out[token] += routing weight * row, in ascending expert order (as one process would)

Every rank must call this the same number of times per step, so a rank without tokens still
runs its layers on an empty batch; :func:`any_rank_has_work` decides once per step whether the
group steps at all.

The exchange above sizes its messages by counts the host must read (two ``.tolist()`` a layer):
right for a prefill step, whose rows vary by thousands. A decode step of static shape (every rank
of the group at one agreed bucket of ``T`` rows, ``engine/static_decode.py``) exchanges
fixed-capacity buffers instead, as DeepEP's low-latency mode does, so nothing comes back to the
host and a CUDA graph can hold the whole layer::

    capacity per (sender, owner): C = T * min(top_k, most experts a rank holds)
        (a token's top_k experts are distinct, so it sends an owner at most that many rows)
    send   [n, C, D] rows, [n, C] expert ids (-1: an empty slot)     slot = rank of the pair
                                                                      among those to that owner
    all-to-all of equal splits (rows, then ids)  ->  recv [n * C, D], ids [n * C]
    owner: every slot through its expert; an empty slot's id is no expert here: a zero row
    all-to-all back; sender: out[token] += routing weight * row, pairs in expert order
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from tandem.model.expert_dispatch import ExpertDispatcher, Routed, run_experts
from tandem.model.rank_weights import expert_slice  # torch-free: the memory plan counts slices too

if TYPE_CHECKING:
    from tandem.model.expert_dispatch import ExpertWeights
    from tandem.model.kernels.backend import KernelBackend


@dataclass
class DispatchStats:
    layers: int = 0
    all_to_all_s: float = 0.0
    rows_sent: int = 0
    rows_received: int = 0


class ExpertParallelDispatcher(ExpertDispatcher):
    def __init__(
        self, rank: int, world_size: int, num_experts: int, group: dist.ProcessGroup | None = None
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.num_experts = num_experts
        self.slices = [expert_slice(num_experts, r, world_size) for r in range(world_size)]
        self.local = self.slices[rank]
        self.group = group
        self.stats = DispatchStats()
        self._owner: torch.Tensor | None = None  # expert -> the rank that holds it
        # rows per rank of a static step (every rank of the group the same), while one runs
        self.capacity_tokens: int | None = None

    @property
    def syncs_host(self) -> bool:
        """Whether a layer reads counts back to the host: the split exchange of a group of more
        than one, outside a fixed-capacity step."""
        return self.world_size > 1 and self.capacity_tokens is None

    @contextlib.contextmanager
    def fixed_capacity(self, tokens: int) -> Iterator[None]:
        """Every MoE layer in the block exchanges fixed-capacity buffers for ``tokens`` rows a
        rank; every rank of the group must be in such a block with the same ``tokens``."""
        previous, self.capacity_tokens = self.capacity_tokens, tokens
        try:
            yield
        finally:
            self.capacity_tokens = previous

    def capacity_rows(self, tokens: int, top_k: int) -> int:
        """Rows a sender may put in one owner's slab for ``tokens`` rows of its own."""
        return tokens * min(top_k, max(len(s) for s in self.slices))

    def _owners(self, device: torch.device) -> torch.Tensor:
        if self._owner is None or self._owner.device != device:
            sizes = torch.tensor([len(s) for s in self.slices], device=device)
            self._owner = torch.repeat_interleave(torch.arange(self.world_size, device=device), sizes)
        return self._owner

    def _all_to_all(
        self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int] | None, in_splits: list[int] | None
    ) -> None:
        t0 = time.perf_counter()
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        self.stats.all_to_all_s += time.perf_counter() - t0

    def routed_experts(self, moe: ExpertWeights, routed: Routed, ops: KernelBackend) -> torch.Tensor:
        x, weights, ids = routed.x, routed.weights, routed.ids
        n, per_rank, top_k = self.world_size, len(self.local), ids.shape[1]
        if n == 1:  # a group of one holds every expert: nothing to exchange, no host sync
            return run_experts(moe, routed, ops)
        if self.capacity_tokens is not None:
            return self._fixed_capacity(moe, routed, ops)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # by expert, hence by owner rank
        token_of_pair = order // top_k
        self._owner = self._owners(x.device)
        send_counts = torch.bincount(flat_ids, minlength=self.num_experts)  # per expert, by owner
        recv_counts = send_counts.new_empty((n, per_rank))  # per sender, per local expert
        self._all_to_all(recv_counts.view(-1), send_counts, [per_rank] * n, [len(s) for s in self.slices])

        per_owner = torch.zeros(n, dtype=send_counts.dtype, device=x.device)
        in_splits = per_owner.index_add_(0, self._owner, send_counts).tolist()
        out_splits = recv_counts.sum(1).tolist()
        send_rows = x[token_of_pair]
        recv_rows = x.new_empty((sum(out_splits), x.shape[1]))
        self._all_to_all(recv_rows, send_rows, out_splits, in_splits)

        local_ids = torch.arange(self.local.start, self.local.stop, device=x.device).repeat(n)
        recv_ids = local_ids.repeat_interleave(recv_counts.view(-1))[:, None]
        unit = torch.ones(recv_ids.shape, dtype=torch.float32, device=x.device)
        expert_out = run_experts(moe, Routed(recv_rows, unit, recv_ids), ops)

        back = x.new_empty(send_rows.shape)
        self._all_to_all(back, expert_out, in_splits, out_splits)
        contributions = (back * weights.reshape(-1)[order][:, None]).to(x.dtype)
        out = torch.zeros_like(x)
        out.index_add_(0, token_of_pair, contributions)

        stats = self.stats
        stats.layers += 1
        stats.rows_sent += send_rows.shape[0]
        stats.rows_received += recv_rows.shape[0]
        return out

    def _fixed_capacity(self, moe: ExpertWeights, routed: Routed, ops: KernelBackend) -> torch.Tensor:
        """The exchange of a static step (see the module): shapes fixed by ``capacity_tokens``,
        every index computed on the device."""
        x, weights, ids = routed.x, routed.weights, routed.ids
        n, top_k, device = self.world_size, ids.shape[1], x.device
        tokens = self.capacity_tokens
        assert tokens is not None
        if x.shape[0] > tokens:
            raise ValueError(f"{x.shape[0]} rows in a step of fixed capacity for {tokens}")
        slab = self.capacity_rows(tokens, top_k)
        flat_ids = ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)  # by expert, hence by owner rank
        sorted_ids = flat_ids[order]
        owner = self._owners(device)[sorted_ids]
        per_owner = torch.zeros(n, dtype=torch.int64, device=device)
        per_owner.scatter_add_(0, owner, torch.ones_like(owner))
        first_of_owner = per_owner.cumsum(0) - per_owner
        slot = owner * slab + torch.arange(owner.shape[0], device=device) - first_of_owner[owner]
        token_of_pair = order // top_k

        send_rows = x.new_zeros((n * slab, x.shape[1]))
        send_rows.index_copy_(0, slot, x[token_of_pair])
        send_ids = torch.full((n * slab,), -1, dtype=torch.int64, device=device)
        send_ids.index_copy_(0, slot, sorted_ids)
        recv_rows = torch.empty_like(send_rows)
        recv_ids = torch.empty_like(send_ids)
        self._all_to_all(recv_rows, send_rows, None, None)
        self._all_to_all(recv_ids, send_ids, None, None)

        unit = torch.ones((n * slab, 1), dtype=torch.float32, device=device)
        expert_out = run_experts(moe, Routed(recv_rows, unit, recv_ids[:, None]), ops)
        back = torch.empty_like(expert_out)
        self._all_to_all(back, expert_out, None, None)
        contributions = (back[slot] * weights.reshape(-1)[order][:, None]).to(x.dtype)
        out = torch.zeros_like(x)
        out.index_add_(0, token_of_pair, contributions)

        stats = self.stats
        stats.layers += 1
        stats.rows_sent += n * slab
        stats.rows_received += n * slab
        return out


def any_rank_has_work(
    has_work: bool, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu"
) -> bool:
    """The once-per-step agreement: True on every rank if any rank has work (a group of one
    agrees with itself, without a collective)."""
    if dist.get_world_size(group) == 1:
        return has_work
    flag = torch.tensor([1 if has_work else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
