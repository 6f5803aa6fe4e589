"""Compile, check and time every Triton kernel against its torch reference.

For each kernel at DeepSeek-V3 shapes (one rank of a DEP group: all 128 heads, kv_lora_rank 512,
rope 64, hidden 7168, 256 routed experts of which a DEP8 rank holds 32): run the Triton kernel and
the torch reference on the same random inputs, check them against each other, then time the
kernel (median of ``triton.testing.do_bench`` on a GPU; wall-clock median on a CPU, where the
kernels run in Triton's interpreter and only ``--shapes tiny`` is practical) and print what it
achieved against its roofline: the time its bytes at the GPU's HBM bandwidth or its FLOPs at the
GPU's dense bf16 (FP8 for FP8 x FP8 dots) peak would take, whichever is longer, over the time it
took, with the peaks of ``model/kernels/roofline.py`` for this GPU (the H200's off a GPU). MLA
decode runs with the default tiles and with this GPU's tuned ones (``model/kernels/tuning.py``).
Rows with a target (MLA decode at B=64 over 4,096 tokens: 0.6 of HBM bandwidth; the FP8 x FP8
grouped expert GEMM: 0.5 of FP8 peak) say whether they met it; a missed target is a figure, not a
failed check. DeepSeek-V4's kernels follow at V4-Flash shapes (``gpu_check_v4.py``).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tandem.model.kernels.backend import KernelBackend

from tandem.model.kernels.roofline import PEAKS, Peaks, roofline_fraction


@dataclass(frozen=True)
class Shapes:
    heads: int = 128
    latent: int = 512
    rope: int = 64
    nope: int = 128
    v: int = 128
    page_size: int = 64
    hidden: int = 7168
    experts: int = 256
    local_experts: int = 32
    n_group: int = 8
    topk_group: int = 4
    top_k: int = 8
    moe_inter: int = 2048
    decode_batch: int = 64
    decode_len: int = 4096
    long_len: int = 32768
    extend_requests: int = 4
    extend_prefix: int = 2048
    extend_new: int = 1024
    tokens: int = 8192
    moe_tokens: int = 4096


TINY = Shapes(
    heads=4, latent=32, rope=8, nope=16, v=16, page_size=8, hidden=64, experts=16, local_experts=8,
    n_group=4, topk_group=2, top_k=4, moe_inter=32, decode_batch=3, decode_len=40, long_len=100,
    extend_requests=2, extend_prefix=12, extend_new=9, tokens=24, moe_tokens=24,
)  # fmt: skip


@dataclass
class Row:
    kernel: str
    shape: str
    max_rel_err: float
    time_s: float
    bytes_moved: float = 0.0
    flops: float = 0.0
    fp8: bool = False  # FP8 tensor-core work: its FLOPs are held against the FP8 peak
    target: float | None = None  # the fraction of its roofline it should reach

    def fraction(self, peaks: Peaks) -> float:
        return roofline_fraction(peaks, self.time_s, self.bytes_moved, self.flops, self.fp8)

    def cells(self, peaks: Peaks) -> list[str]:
        peak_flops = peaks.fp8_flops if self.fp8 else peaks.bf16_flops
        flop_bound = self.flops / peak_flops if peak_flops else 0.0
        if self.flops and flop_bound >= self.bytes_moved / peaks.hbm_bytes_per_s:
            achieved = f"{self.flops / self.time_s / 1e12:.1f} TFLOP/s" + (" FP8" if self.fp8 else "")
        else:
            achieved = f"{self.bytes_moved / self.time_s / 1e9:.0f} GB/s"
        target = ""
        if self.target is not None:
            target = f"{self.target:.2f}: " + ("met" if self.fraction(peaks) >= self.target else "missed")
        return [
            self.kernel,
            self.shape,
            f"{self.time_s * 1e6:.1f} us",
            achieved,
            f"{self.fraction(peaks):.1%}",
            target,
            f"{self.max_rel_err:.1e}",
        ]


def _time(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, return_mode="median")) / 1e3
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def _paged(
    s: Shapes, seq_lens: list[int], dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> tuple[torch.Tensor, list[list[int]]]:
    """A pool with every request's pages shuffled over it, plus spare pages."""
    pages_needed = [-(-n // s.page_size) for n in seq_lens]
    total = sum(pages_needed) + 4
    order = torch.randperm(total, generator=gen).tolist()
    tables, at = [], 0
    for n in pages_needed:
        tables.append(order[at : at + n])
        at += n
    pool = torch.randn(total, s.page_size, s.latent + s.rope, generator=gen).to(device, dtype)
    return pool, tables


class _Checks:
    """The rows of one run: each kernel's output against its torch reference, and its time."""

    def __init__(self, s: Shapes, device: torch.device, dtype: torch.dtype) -> None:
        from tandem.model.kernels.registry import get_backend

        self.s, self.device, self.dtype = s, device, dtype
        self.tri = get_backend(device, "triton")
        self.gen = torch.Generator().manual_seed(0)
        self.item = torch.empty((), dtype=dtype).element_size()
        self.rows: list[Row] = []

    def rand(self, *shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(*shape, generator=self.gen)).to(self.device, self.dtype)

    def add(
        self,
        name: str,
        shape: str,
        out: Any,
        ref: Any,
        fn: Callable[[], Any],
        nbytes: float = 0.0,
        flops: float = 0.0,
        target: float | None = None,
        err: float | None = None,
    ) -> None:
        """A row: ``out`` against ``ref`` (the largest relative error of their tensors), or the
        ``err`` given; ``fn`` timed."""
        if err is None:
            outs = out if isinstance(out, tuple) else (out,)
            refs = ref if isinstance(ref, tuple) else (ref,)
            err = max(_rel_err(o, r) for o, r in zip(outs, refs, strict=True))
        self.rows.append(Row(name, shape, err, _time(fn, self.device), nbytes, flops, target=target))


def check_all(s: Shapes, device: torch.device, dtype: torch.dtype) -> list[Row]:
    checks = _Checks(s, device, dtype)
    _check_attention(checks)
    _check_pointwise(checks)
    _check_moe(checks)
    from tandem.bench.gpu_check_v4 import V4_FLASH, V4_TINY, check_v4

    check_v4(checks, V4_TINY if s == TINY else V4_FLASH)
    return checks.rows


def _check_attention(c: _Checks) -> None:
    """Decode attention: a batch at one length, and one very long request, with the default
    tiles and with this GPU kind's (when they differ); extend attention over cached prefixes."""
    from tandem.model.attention_metadata import AttentionMetadata
    from tandem.model.kernels.mla_attention import decode_attention_torch, extend_attention_torch
    from tandem.model.kernels.mla_decode_triton import _num_sms, choose_num_kv_splits, decode_attention_splits
    from tandem.model.kernels.tuning import DEFAULT_MLA_DECODE, mla_decode_tiles

    s, device, dtype, gen, tri, rand = c.s, c.device, c.dtype, c.gen, c.tri, c.rand
    scale = (s.nope + s.rope) ** -0.5
    narrow = dtype in (torch.bfloat16, torch.float16)
    tilings = {DEFAULT_MLA_DECODE["narrow" if narrow else "wide"], mla_decode_tiles(narrow)}
    for batch, length in [(s.decode_batch, s.decode_len), (1, s.long_len)]:
        pool, tables = _paged(s, [length] * batch, dtype, device, gen)
        meta = AttentionMetadata.build(s.page_size, [1] * batch, [length] * batch, tables, device)
        q_lat, q_pe = rand(batch, s.heads, s.latent), rand(batch, s.heads, s.rope)
        ref = decode_attention_torch(q_lat, q_pe, pool, meta, scale)
        kv_bytes = batch * length * (s.latent + s.rope) * c.item
        for tiles in sorted(tilings, key=lambda t: t.block_h):
            splits = choose_num_kv_splits(length, batch, s.heads, _num_sms(device), tiles.block_h)
            decode = functools.partial(
                decode_attention_splits, q_lat, q_pe, pool, meta, scale, splits, tiles=tiles
            )
            target = 0.6 if (batch, length) == (64, 4096) else None
            c.add(f"mla_decode[{tiles.block_h}h x {tiles.block_n}]", f"B={batch} len={length} H={s.heads}",
                  decode(), ref, decode, nbytes=kv_bytes, target=target)  # fmt: skip

    n, pre, new = s.extend_requests, s.extend_prefix, s.extend_new
    pool, tables = _paged(s, [pre + new] * n, dtype, device, gen)
    meta = AttentionMetadata.build(s.page_size, [new] * n, [pre + new] * n, tables, device)
    q = rand(n * new, s.heads, s.nope + s.rope)
    w_kv_b = rand(s.heads * (s.nope + s.v), s.latent, std=s.latent**-0.5)
    args = (q, pool, meta, w_kv_b, s.heads, s.nope, s.v, scale)
    out = tri.extend_attention(*args)
    ref = extend_attention_torch(*args)
    keys = n * sum(pre + i + 1 for i in range(new))
    flops = 2 * keys * s.heads * (2 * s.latent + s.rope) + 2 * n * new * s.heads * s.latent * (s.nope + s.v)
    c.add("mla_extend", f"{n}x(prefix {pre} + new {new}) H={s.heads}", out, ref,
          lambda: tri.extend_attention(*args), flops=flops)  # fmt: skip


def _check_pointwise(c: _Checks) -> None:
    """The KV store, RMSNorm with residual, RoPE (YaRN table), and latent norm + RoPE + KV
    store fused on the strided views MLAttention passes (against the torch backend's three
    reference calls)."""
    from tandem.model.kernels.mla_attention import kv_store_torch
    from tandem.model.kernels.norm import rms_norm_torch
    from tandem.model.kernels.registry import get_backend
    from tandem.model.kernels.rope import apply_rope_torch

    s, gen, tri, rand, item = c.s, c.gen, c.tri, c.rand, c.item
    t = s.tokens
    pool_a = rand(-(-t // s.page_size) + 2, s.page_size, s.latent + s.rope)
    pool_b = pool_a.clone()
    slots = torch.randperm(pool_a.shape[0] * s.page_size, generator=gen)[:t].to(c.device)
    latent, k_pe = rand(t, s.latent), rand(t, s.rope)
    tri.kv_store(pool_a, slots, latent, k_pe)
    kv_store_torch(pool_b, slots, latent, k_pe)
    c.add("kv_store", f"T={t} dim={s.latent + s.rope}", pool_a, pool_b,
          lambda: tri.kv_store(pool_a, slots, latent, k_pe),
          nbytes=2 * t * (s.latent + s.rope) * item)  # fmt: skip

    x, res, w = rand(t, s.hidden), rand(t, s.hidden), 1 + rand(s.hidden, std=0.1)
    c.add("rms_norm+residual", f"T={t} D={s.hidden}", tri.rms_norm(x, w, 1e-6, res),
          rms_norm_torch(x, w, 1e-6, res), lambda: tri.rms_norm(x, w, 1e-6, res),
          nbytes=4 * t * s.hidden * item)  # fmt: skip

    q_pe, k_pe = rand(t, s.heads, s.rope), rand(t, s.rope)
    cos, sin = rand(t, s.rope // 2), rand(t, s.rope // 2)
    c.add("rope", f"T={t} H={s.heads} R={s.rope}", tri.rope(q_pe, k_pe, cos, sin, True),
          apply_rope_torch(q_pe, k_pe, cos, sin, True), lambda: tri.rope(q_pe, k_pe, cos, sin, True),
          nbytes=2 * t * (s.heads + 1) * s.rope * item)  # fmt: skip

    q_full, kv_a = rand(t, s.heads, s.nope + s.rope), rand(t, s.latent + s.rope)
    lat, k_raw = kv_a.split([s.latent, s.rope], dim=-1)
    fused = (q_full[..., s.nope :], k_raw, lat, 1 + rand(s.latent, std=0.1), 1e-6, cos, sin, True)
    pool_a = rand(-(-t // s.page_size) + 2, s.page_size, s.latent + s.rope)
    pool_b = pool_a.clone()
    out = tri.rope_kv_store(*fused, pool_a, slots)
    ref = get_backend(c.device, "torch").rope_kv_store(*fused, pool_b, slots)
    # q_pe read and written, latent and k_pe read, pool rows written, cos/sin read, slots read
    fused_bytes = (2 * t * s.heads * s.rope + 2 * t * (s.latent + s.rope) + t * s.rope) * item + 8 * t
    c.add("rope_kv_store", f"T={t} H={s.heads} R={s.rope} L={s.latent}", (out, pool_a), (ref, pool_b),
          lambda: tri.rope_kv_store(*fused, pool_a, slots), nbytes=fused_bytes)  # fmt: skip


def _check_moe(c: _Checks) -> None:
    """MoE routing, the gate's fused routing, and the fused experts on this rank's slice (in the
    run's dtype and in FP8)."""
    from tandem.model.kernels.moe import fused_experts_torch, grouped_topk_torch

    s, device, gen, tri, rand = c.s, c.device, c.gen, c.tri, c.rand
    logits = torch.randn(s.moe_tokens, s.experts, generator=gen).to(device)
    bias = (0.1 * torch.randn(s.experts, generator=gen)).to(device)
    route = (s.top_k, s.n_group, s.topk_group, True, 2.5)
    w_tri, ids_tri = tri.moe_route(logits, bias, *route)
    w_ref, ids_ref = grouped_topk_torch(logits, bias, *route)
    same = torch.equal(ids_tri.sort(-1).values, ids_ref.sort(-1).values)
    err = _rel_err(w_tri.sort(-1).values, w_ref.sort(-1).values) if same else float("inf")
    route_s = _time(lambda: tri.moe_route(logits, bias, *route), device)
    c.rows.append(Row("moe_route", f"T={s.moe_tokens} E={s.experts} k={s.top_k}", err, route_s,
                      bytes_moved=s.moe_tokens * s.experts * 4))  # fmt: skip
    c.rows.extend(check_gate_route(s, tri, device, c.dtype))

    x = rand(s.moe_tokens, s.hidden)
    w13 = rand(s.local_experts, 2 * s.moe_inter, s.hidden, std=s.hidden**-0.5)
    w2 = rand(s.local_experts, s.hidden, s.moe_inter, std=s.moe_inter**-0.5)
    first = s.local_experts  # the second slice of experts
    out = tri.moe_experts(x, w_ref, ids_ref, w13, w2, first)
    ref = fused_experts_torch(x, w_ref, ids_ref, w13, w2, first)
    pairs = int(((ids_ref >= first) & (ids_ref < first + s.local_experts)).sum())
    shape = f"T={s.moe_tokens} pairs={pairs} E_local={s.local_experts} D={s.hidden} I={s.moe_inter}"
    c.add("moe_experts", shape, out, ref, lambda: tri.moe_experts(x, w_ref, ids_ref, w13, w2, first),
          flops=6 * pairs * s.hidden * s.moe_inter)  # fmt: skip
    limit = 0.5  # DeepSeek-V4's clipped SwiGLU, at a limit most of these gates and ups pass
    c.add("moe_experts_clipped", shape,
          tri.moe_experts(x, w_ref, ids_ref, w13, w2, first, swiglu_limit=limit),
          fused_experts_torch(x, w_ref, ids_ref, w13, w2, first, swiglu_limit=limit),
          lambda: tri.moe_experts(x, w_ref, ids_ref, w13, w2, first, swiglu_limit=limit),
          flops=6 * pairs * s.hidden * s.moe_inter)  # fmt: skip
    c.rows.extend(check_fp8_experts(s, tri, device, x, w_ref, ids_ref))
    c.rows.extend(check_fp4_experts(s, tri, device, c.dtype))


def check_fp8_experts(
    s: Shapes,
    tri: KernelBackend,
    device: torch.device,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> list[Row]:
    """The same experts as FP8 with block scales (128x128 at DeepSeek-V3 shapes), in both
    activation modes, each against its torch reference: ``dequant`` against the dequantised
    experts, ``quant`` against the emulation that quantises as the kernels do. Timed as a
    fraction of the GPU's dense FP8 peak (``roofline.PEAKS``; the H200's off a GPU)."""
    from tandem.model.kernels.fp8 import FP8_MODES, quantize_fp8_block
    from tandem.model.kernels.moe import ExpertScales, fused_experts_torch

    gen = torch.Generator().manual_seed(1)
    block = (128, 128) if s.hidden >= 1024 else (32, 32)

    def fp8(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8_block(torch.randn(rows, cols, generator=gen) * cols**-0.5, block)

    w13, w2, s13, s2 = [], [], [], []
    for _ in range(s.local_experts):  # gate and up quantised apart, as a checkpoint holds them
        (gate, sg), (up, su) = fp8(s.moe_inter, s.hidden), fp8(s.moe_inter, s.hidden)
        down, sd = fp8(s.hidden, s.moe_inter)
        w13.append(torch.cat([gate, up]).to(device))
        s13.append(torch.cat([sg, su]).to(device))
        w2.append(down.to(device))
        s2.append(sd.to(device))
    experts = (torch.stack(w13), torch.stack(w2))
    first = s.local_experts
    pairs = int(((ids >= first) & (ids < first + s.local_experts)).sum())
    shape = f"T={s.moe_tokens} pairs={pairs} E_local={s.local_experts} D={s.hidden} I={s.moe_inter} "
    shape += f"block {block[0]}"
    rows = []
    for mode in FP8_MODES:
        scales = ExpertScales(torch.stack(s13), torch.stack(s2), block, mode)
        args = (x, weights, ids, *experts, first, scales)
        err = _rel_err(tri.moe_experts(*args), fused_experts_torch(*args))
        seconds = _time(lambda args=args: tri.moe_experts(*args), device)  # type: ignore[misc]
        # dequant mode multiplies in x's dtype: its fraction is of the bf16 peak
        flops = 6 * pairs * s.hidden * s.moe_inter
        quant = mode == "quant"
        target = 0.5 if quant else None
        rows.append(
            Row(f"moe_experts_fp8_{mode}", shape, err, seconds, flops=flops, fp8=quant, target=target)
        )
    return rows


def check_fp4_experts(s: Shapes, tri: KernelBackend, device: torch.device, dtype: torch.dtype) -> list[Row]:
    """The same slice of experts in FP4 (DeepSeek-V4's routed experts: e2m1 bytes with an E8M0
    scale a 32, dequantised per tile in registers), clipped as V4's are, against the torch
    reference, at the MoE batch (held against the dense peak of the activations' dtype) and at
    the decode batch (held against HBM: the FP4 bytes of the experts it reads, half a byte a
    weight and a scale byte a 32, plus its rows in and out)."""
    from tandem.model.kernels.fp4 import quantize_fp4
    from tandem.model.kernels.moe import ExpertScales, fused_experts_torch

    gen = torch.Generator().manual_seed(3)
    w13, w2, s13, s2 = [], [], [], []
    for _ in range(s.local_experts):  # gate and up quantised apart, as a checkpoint holds them
        gate = quantize_fp4(torch.randn(s.moe_inter, s.hidden, generator=gen) * s.hidden**-0.5)
        up = quantize_fp4(torch.randn(s.moe_inter, s.hidden, generator=gen) * s.hidden**-0.5)
        down = quantize_fp4(torch.randn(s.hidden, s.moe_inter, generator=gen) * s.moe_inter**-0.5)
        w13.append(torch.cat([gate[0], up[0]]))
        s13.append(torch.cat([gate[1], up[1]]))
        w2.append(down[0])
        s2.append(down[1])
    experts = (torch.stack(w13).to(device), torch.stack(w2).to(device))
    scales = ExpertScales.fp4(torch.stack(s13).to(device), torch.stack(s2).to(device))
    first, item = s.local_experts, torch.empty((), dtype=dtype).element_size()
    rows = []
    for tokens in sorted({s.decode_batch, s.moe_tokens}):
        x = torch.randn(tokens, s.hidden, generator=gen).to(device, dtype)
        ids = torch.randint(0, s.experts, (tokens, s.top_k), generator=gen).to(device)
        weights = torch.rand(tokens, s.top_k, generator=gen).to(device)
        args = (x, weights, ids, *experts, first, scales, 0.5)
        err = _rel_err(tri.moe_experts(*args), fused_experts_torch(*args))
        seconds = _time(lambda args=args: tri.moe_experts(*args), device)  # type: ignore[misc]
        local = (ids >= first) & (ids < first + s.local_experts)
        pairs, used = int(local.sum()), int(ids[local].unique().numel())
        weight_bytes = used * 3 * s.moe_inter * s.hidden * (1 / 2 + 1 / 32)
        shape = f"T={tokens} pairs={pairs} E_local={s.local_experts} D={s.hidden} I={s.moe_inter} e2m1/32"
        rows.append(Row("moe_experts_fp4", shape, err, seconds,
                        bytes_moved=weight_bytes + 2 * tokens * s.hidden * item,
                        flops=6 * pairs * s.hidden * s.moe_inter))  # fmt: skip
    return rows


def check_gate_route(s: Shapes, tri: KernelBackend, device: torch.device, dtype: torch.dtype) -> list[Row]:
    """The router GEMM fused with the routing (``moe_gate_route``) against the torch backend's two
    steps (float32 GEMM of the widened activations, then ``grouped_topk_torch``), at the MoE batch
    and at the decode batch, and beside it those two steps with the Triton ``moe_route`` (what the
    model ran before), timed on the same inputs. Ids sorted per row must agree on all but one row
    in a thousand (two sums of ``D`` products in different orders can round a near-tie apart; the
    shape cell counts such rows); weights are compared on the rows that agree. The dot is IEEE
    float32 on CUDA cores, so its FLOPs are held against a tensor-core peak it cannot reach."""
    from tandem.model.kernels.registry import get_backend

    ref_ops = get_backend(device, "torch")
    gen = torch.Generator().manual_seed(2)
    gate_weight = (s.hidden**-0.5 * torch.randn(s.experts, s.hidden, generator=gen)).to(device)
    bias = (0.1 * torch.randn(s.experts, generator=gen)).to(device)
    route = (s.top_k, s.n_group, s.topk_group, True, 2.5)
    item = torch.empty((), dtype=dtype).element_size()

    def two_steps(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tri.moe_route(torch.nn.functional.linear(x.float(), gate_weight), bias, *route)

    rows = []
    for tokens in sorted({s.decode_batch, s.moe_tokens}):
        x = torch.randn(tokens, s.hidden, generator=gen).to(device, dtype)
        w_tri, ids_tri = tri.moe_gate_route(x, gate_weight, bias, *route)
        w_ref, ids_ref = ref_ops.moe_gate_route(x, gate_weight, bias, *route)
        (ids_tri, order), (ids_ref, ref_order) = ids_tri.sort(-1), ids_ref.sort(-1)
        same = (ids_tri == ids_ref).all(-1)
        flips = int((~same).sum())
        err = float("inf")
        if flips <= tokens // 1000:
            err = _rel_err(w_tri.gather(1, order)[same], w_ref.gather(1, ref_order)[same])
        nbytes = tokens * s.hidden * item + s.experts * (s.hidden + 1) * 4 + tokens * s.top_k * (4 + 8)
        flops = 2 * tokens * s.experts * s.hidden
        shape = f"T={tokens} D={s.hidden} E={s.experts} k={s.top_k}"
        fused_s = _time(lambda x=x: tri.moe_gate_route(x, gate_weight, bias, *route), device)  # type: ignore[misc]
        rows.append(
            Row("moe_gate_route", f"{shape} flips={flips}", err, fused_s, bytes_moved=nbytes, flops=flops)
        )
        # the two steps also write the float32 copy of x and the logits, and read both back
        w_two, ids_two = two_steps(x)
        same_two = torch.equal(ids_two.sort(-1).values, ids_ref)
        err = _rel_err(w_two.sort(-1).values, w_ref.sort(-1).values) if same_two else float("inf")
        two_steps_s = _time(lambda x=x: two_steps(x), device)  # type: ignore[misc]
        nbytes += 2 * tokens * (s.hidden + s.experts) * 4
        rows.append(Row("moe_gate_route_two_steps", shape, err, two_steps_s, bytes_moved=nbytes, flops=flops))
    return rows


def gpu_peaks() -> tuple[str, Peaks]:
    """This GPU's kind and peaks (``roofline.PEAKS``); the H200's off a GPU or for a kind not there."""
    from tandem.model.kernels.tuning import gpu_kind

    kind = gpu_kind()
    return (kind, PEAKS[kind]) if kind in PEAKS else ("H200", PEAKS["H200"])


def format_table(rows: list[Row], kind: str, peaks: Peaks) -> str:
    header = ["kernel", "shape", "median", "achieved", f"of {kind} roofline", "target", "max rel err"]
    table = [header, *[r.cells(peaks) for r in rows]]
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |" for line in table
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--shapes", choices=["deepseek-v3", "tiny"], default="deepseek-v3")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--max-rel-err", type=float, default=3e-2)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        os.environ["TRITON_INTERPRET"] = "1"
    shapes = Shapes() if args.shapes == "deepseek-v3" else TINY
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)"
    print(f"device: {name}; dtype {args.dtype}; shapes {args.shapes}", flush=True)
    rows = check_all(shapes, device, dtype)
    kind, peaks = gpu_peaks()
    bandwidth, bf16, fp8 = peaks.hbm_bytes_per_s / 1e12, peaks.bf16_flops / 1e12, peaks.fp8_flops / 1e12
    print(f"roofline: {kind}: HBM {bandwidth:.2f} TB/s, {bf16:.0f} TFLOP/s bf16, {fp8:.0f} TFLOP/s FP8")
    print(format_table(rows, kind, peaks))
    targeted = [r for r in rows if r.target is not None]
    met = [r.kernel for r in targeted if r.fraction(peaks) >= (r.target or 0.0)]
    print(f"targets: {len(met)} of {len(targeted)} met" + (f" ({', '.join(met)})" if met else ""))
    bad = [r.kernel for r in rows if not r.max_rel_err <= args.max_rel_err]
    if bad:
        print(f"FAILED against the torch reference: {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
