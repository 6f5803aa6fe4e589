"""Bytes a prefill-to-decode transfer moves per prompt token, DeepSeek-V4 against DeepSeek-V3,
from their layouts (torch-free): for each prompt length, the pages the prompt lies on of every
kind the transfer writes, plus V4's one slot of bounded state (the sliding window's last tokens,
the compressors' open windows and overlaps), in bfloat16.

    V3      a page is every layer's latent (kv_lora_rank + rope dims) of page_size tokens
    V4      a page is its compressed entries (one per ``rate`` tokens on CSA and HCA layers) and
            CSA's indexer keys; the window's KV crosses only for its last sliding_window - 1
            tokens, in the slot

The tiny models' figures are what ``tests/integration/test_v4_cluster.py`` sees in each bill
(its bytes equal this layout's, to the byte); the published configs' are what a transfer of
theirs would move. ``python -m tandem.bench.v4_transfer_bytes [--lengths 1024,8192,...] [--json]``

A second table: what a cached token moves when it is loaded from the host tier or the store
(``engine/tier_copier.py``): V3's latent; V4's entries, and on the share of pages that keep it
(``--window-share``, the pools' default) the page's boundary state, its window KV and overlap. The
router and each rank price a load by these bytes against recomputing: the store rate at which a
load breaks even with a prefill rate scales with them.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from tandem.model.config import ModelConfig
from tandem.model.family import read_config
from tandem.model.v4.config import V4Config
from tandem.model.v4.kv_layout import WINDOW_SHARE, slot_bytes, v4_page_kinds, v4_page_size

ROOT = Path(__file__).resolve().parents[1]
BF16 = 2
V3_PAGE = 64  # the presets' page; V4's is made a multiple of its rates (128 on V4-Flash)


@dataclass(frozen=True)
class Row:
    model: str
    prompt_tokens: int
    bytes: int
    per_token: float


def transfer_bytes(
    cfg: ModelConfig | V4Config, tokens: int, page_size: int = V3_PAGE, item_bytes: int = BF16
) -> int:
    """What one request's transfer moves for a prompt of ``tokens``, in a model of
    ``item_bytes`` a number."""
    if isinstance(cfg, V4Config):
        size = v4_page_size(cfg, page_size)
        kinds = v4_page_kinds(cfg, size, prefix_caching=False)
        per_page = sum(k.page_bytes(item_bytes) for k in kinds)
        return math.ceil(tokens / size) * per_page + slot_bytes(cfg, item_bytes)
    return math.ceil(tokens / page_size) * cfg.num_hidden_layers * page_size * cfg.kv_cache_dim * item_bytes


def tier_bytes_per_token(
    cfg: ModelConfig | V4Config,
    page_size: int = V3_PAGE,
    window_share: float = WINDOW_SHARE,
    item_bytes: int = BF16,
) -> tuple[float, float]:
    """What loading one cached token moves from the host tier or the store: a page's entries
    per token, and with the boundary state of ``window_share`` of the pages (the average a
    rank prices loads by, ``KVTiers.page_price_bytes``). V3's two are its latent's."""
    if not isinstance(cfg, V4Config):
        per = float(cfg.num_hidden_layers * cfg.kv_cache_dim * item_bytes)
        return per, per
    size = v4_page_size(cfg, page_size)
    kinds = v4_page_kinds(cfg, size, prefix_caching=True, window_share=window_share)
    entries = sum(k.page_bytes(item_bytes) for k in kinds if not k.in_slots)
    boundary = sum(k.page_bytes(item_bytes) for k in kinds if k.in_slots)
    return entries / size, (entries + window_share * boundary) / size


def _tiny(arch: str) -> ModelConfig | V4Config:
    from tandem.model.make_tiny import tiny_config_dict
    from tandem.model.v4.tiny import tiny_v4_config_dict

    if arch == "v4":
        return V4Config.from_dict(tiny_v4_config_dict(0, 1))
    return ModelConfig.from_dict(tiny_config_dict())


def rows(lengths: list[int]) -> list[Row]:
    models = {
        "tiny V3": _tiny("v3"),
        "tiny V4": _tiny("v4"),
        "DeepSeek-V3": read_config(ROOT / "deploy/models/deepseek-v3"),
        "DeepSeek-V4-Flash": read_config(ROOT / "deploy/models/deepseek-v4-flash"),
    }
    out = []
    for name, cfg in models.items():
        for tokens in lengths:
            if name.startswith("tiny") and tokens > cfg.max_position_embeddings:
                continue  # the published models' layouts hold at any length (V3's context is 160K)
            moved = transfer_bytes(cfg, tokens)
            out.append(Row(name, tokens, moved, moved / tokens))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.v4_transfer_bytes", description=__doc__)
    parser.add_argument(
        "--lengths", default="1024,8192,131072,1048576", help="prompt lengths, comma-separated"
    )
    parser.add_argument(
        "--window-share", type=float, default=WINDOW_SHARE, help="pages keeping their window KV (0-1]"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if not 0 < args.window_share <= 1:
        parser.error(f"--window-share: in (0, 1], got {args.window_share}")
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths: comma-separated integers, got {args.lengths!r}")
    if any(n < 1 for n in lengths):
        parser.error("--lengths: each at least 1")
    table = rows(lengths)
    if args.json:
        tiers = {
            name: tier_bytes_per_token(
                read_config(ROOT / f"deploy/models/{name}"), window_share=args.window_share
            )
            for name in ("deepseek-v3", "deepseek-v4-flash")
        }
        print(json.dumps({"rows": [asdict(r) for r in table], "tier_bytes_per_token": tiers}, indent=2))
        return 0
    by = {(r.model, r.prompt_tokens): r for r in table}
    print("| model | prompt tokens | bytes moved | per prompt token | V4 / V3 |")
    print("|---|---|---|---|---|")
    for r in table:
        pair = {"tiny V4": "tiny V3", "DeepSeek-V4-Flash": "DeepSeek-V3"}.get(r.model)
        base = by.get((pair, r.prompt_tokens)) if pair else None
        ratio = f"{r.bytes / base.bytes:.3f}" if base else ""
        print(f"| {r.model} | {r.prompt_tokens:,} | {r.bytes:,} | {r.per_token:,.1f} B | {ratio} |")
    print()
    print(
        "| model | a cached token's entries "
        f"| with the boundary state of {args.window_share:g} of pages | / V3 |"
    )
    print("|---|---|---|---|")
    v3 = tier_bytes_per_token(read_config(ROOT / "deploy/models/deepseek-v3"))[1]
    for name in ("DeepSeek-V3", "DeepSeek-V4-Flash"):
        cfg = read_config(ROOT / f"deploy/models/{name.lower()}")
        entries, priced = tier_bytes_per_token(cfg, window_share=args.window_share)
        print(f"| {name} | {entries:,.0f} B | {priced:,.0f} B | {priced / v3:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
