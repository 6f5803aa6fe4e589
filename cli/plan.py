"""``tandem plan memory``: each rank's GPU memory for a model on a topology, before anything
starts (``cluster/memory_plan.py``). Torch-free: it reads the model's ``config.json`` only."""

from __future__ import annotations

import argparse
import json
from itertools import groupby
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.client.output import emit
from tandem.model.dtype_names import AUTO, resolved_dtype
from tandem.model.family import read_config
from tandem.model.rank_weights import DTYPE_BYTES
from tandem.wire.request_params import InvalidRequestError

if TYPE_CHECKING:
    from tandem.cluster.memory_plan import MemoryPlan, RankMemory

MIB = 1 << 20


def add_plan_parsers(sub: Any) -> None:
    from tandem.cli.serving_parsers import add_speculative_arguments

    plan = sub.add_parser("plan", help="plan a deployment before it starts").add_subparsers(
        dest="plan_command", required=True
    )
    mem = plan.add_parser(
        "memory", help="each rank's GPU memory: weights, workspace, KV pages, and whether the model fits"
    )
    mem.add_argument("--model", type=Path, required=True, help="model directory, or its config.json")
    src = mem.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", default=None, help="topology preset of deploy/presets")
    src.add_argument("--topology", type=Path, default=None, help="topology file")
    mem.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="memory of each rank's GPU, GiB (default: the topology's gpu_memory_gib)",
    )
    mem.add_argument(
        "--utilization",
        type=float,
        default=None,
        help="the fraction of it for weights, workspace and KV pages (default: the topology's, 0.9)",
    )
    mem.add_argument(
        "--dtype",
        choices=[AUTO, *DTYPE_BYTES],
        default=AUTO,
        help="the model dtype, as serve's --dtype (auto: bfloat16, a GPU's)",
    )
    add_speculative_arguments(mem)
    mem.add_argument("--json", action="store_true", help="print one JSON object")


def run_plan_memory(args: argparse.Namespace) -> int:
    """The plan as a table (or ``--json``); exit 0 whether or not it fits."""
    from tandem.cli.serving import with_speculative
    from tandem.cluster.memory_plan import plan_memory
    from tandem.cluster.topology import Topology

    topology = Topology.load(args.topology) if args.topology else Topology.preset(args.preset)
    topology = with_speculative(args, topology)
    cfg = read_config(args.model)
    gpu_gib = args.gpu_memory_gib if args.gpu_memory_gib is not None else topology.gpu_memory_gib
    if gpu_gib is None:
        raise InvalidRequestError("--gpu-memory-gib", f"{topology.name} sets no gpu_memory_gib: give one")
    if not gpu_gib > 0:
        raise InvalidRequestError("--gpu-memory-gib", f"must be > 0, got {gpu_gib}")
    utilization = args.utilization if args.utilization is not None else topology.gpu_memory_utilization
    if not 0 < utilization <= 1:
        raise InvalidRequestError("--utilization", f"must be in (0, 1], got {utilization}")
    if cfg.max_position_embeddings < 2:
        raise InvalidRequestError("--model", f"max_position_embeddings {cfg.max_position_embeddings} < 2")
    plan = plan_memory(topology, cfg, resolved_dtype(args.dtype, on_gpu=True), gpu_gib, utilization)
    model = args.model.parent.name if args.model.is_file() else args.model.name
    if args.json:
        emit(json.dumps(plan_json(plan, model), indent=2))
    else:
        emit(plan_table(plan, model))
    return 0


def plan_json(plan: MemoryPlan, model: str) -> dict[str, object]:
    return {
        "model": model,
        "topology": plan.topology,
        "dtype": plan.dtype,
        "gpu_memory_bytes": plan.gpu_memory_bytes,
        "utilization": plan.utilization,
        "usable_bytes": plan.usable_bytes,
        "fits": plan.fits,
        "ranks": [
            {
                "role": r.role.value,
                "group": r.group,
                "rank": r.rank,
                "weight_bytes": r.weight_bytes,
                "workspace_bytes": r.workspace_bytes,
                "kv_page_bytes": r.kv_page_bytes,
                "kv_pages": r.kv_pages,
                "request_pages": r.request_pages,
                "page_size": r.page_size,
                "state_bytes": r.state_bytes,
                "kinds": [
                    {
                        "kind": k.kind,
                        "layers": k.layers,
                        "bytes_per_token": k.per_token,
                        "bytes_per_request": k.per_request,
                    }
                    for k in r.kinds
                ],
                "fits": r.fits,
            }
            for r in plan.ranks
        ],
    }


def _span(numbers: list[int]) -> str:
    """``0-15`` for a run, ``0,2`` otherwise."""
    if len(numbers) > 1 and numbers == list(range(numbers[0], numbers[-1] + 1)):
        return f"{numbers[0]}-{numbers[-1]}"
    return ",".join(str(n) for n in numbers)


def plan_table(plan: MemoryPlan, model: str) -> str:
    """One row per run of ranks of a group with the same numbers, groups of a pool with the
    same rows folded into one (``prefill0-8``, ranks ``0-1``)."""
    from tandem.cluster.memory_plan import GIB, misfit_line

    def numbers(r: RankMemory) -> tuple[object, ...]:
        return (r.role, r.weight_bytes, r.workspace_bytes, r.kv_page_bytes, r.kv_pages, r.request_pages)

    # runs of a group's ranks with the same numbers, then the groups with the same runs
    rows: dict[tuple[object, ...], tuple[list[int], list[int], RankMemory]] = {}
    for _, same in groupby(plan.ranks, key=lambda r: (r.group, numbers(r))):
        run = list(same)
        first = run[0]
        indices = [r.rank for r in run]
        groups, _, _ = rows.setdefault((*numbers(first), *indices), ([], indices, first))
        groups.append(int(first.group.removeprefix(first.role.value)))
    first_rank = plan.ranks[0]
    lines = [
        f"memory plan: {model} on {plan.topology}, {plan.dtype}",
        f"  {plan.gpu_memory_bytes / GIB:g} GiB a GPU x {plan.utilization:g} = "
        f"{plan.usable_bytes / GIB:.1f} GiB usable; one request of the whole context "
        f"holds {first_rank.request_pages} pages of {first_rank.page_size} tokens",
    ]
    header = ("role", "groups", "ranks", "weights", "workspace", "KV page", "KV pages", "KV tokens", "fits")
    table = [header]
    for groups, indices, r in rows.values():
        table.append(
            (
                r.role.value,
                f"{r.role.value}{_span(groups)}",
                _span(indices),
                f"{r.weight_bytes / GIB:.2f} GiB",
                f"{r.workspace_bytes / GIB:.2f} GiB",
                f"{r.kv_page_bytes / MIB:.2f} MiB",
                str(r.kv_pages),
                str(r.kv_pages * r.page_size),
                "yes" if r.fits else "no",
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    lines += _kind_lines(plan)
    misfits = plan.misfits()
    lines.append("fits: yes" if not misfits else f"fits: no; {misfit_line(plan, misfits[0])}")
    return "\n".join(lines)


def _kind_lines(plan: MemoryPlan) -> list[str]:
    """A model with kinds of KV state (DeepSeek-V4): each kind's bytes per token or per running
    request, and what a pool's rank holds of it at its pages and ``max_num_seqs``."""
    from tandem.cluster.memory_plan import GIB

    out = []
    for role in dict.fromkeys(r.role for r in plan.ranks):
        rank = next(r for r in plan.ranks if r.role is role)
        if not rank.kinds:
            continue
        tokens = rank.kv_pages * rank.page_size
        seqs = rank.state_bytes // max(1, sum(k.per_request for k in rank.kinds))
        held_by = f"{tokens} tokens, {seqs} running requests"
        out.append(f"  {role.value} KV state, {rank.page_size}-token pages ({held_by}):")
        for k in rank.kinds:
            if k.per_token:
                held = f"{k.per_token:,.1f} B a token, {k.per_token * tokens / GIB:.2f} GiB"
            else:
                held = f"{k.per_request / MIB:,.2f} MiB a request, {k.per_request * seqs / GIB:.2f} GiB"
            out.append(f"    {k.kind:<13} {k.layers:>3} layers  {held}")
    return out
