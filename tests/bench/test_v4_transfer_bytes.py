"""``python -m tandem.bench.v4_transfer_bytes``: the bytes a transfer moves per prompt token, V4
against V3, from their layouts. V4-Flash's fall with the prompt towards its entries' and indexer
keys' 6,880 B a token (the slot of bounded state spread over more tokens), a tenth of V3's
70,272 B by 128K tokens; the tiny V4's are what its bills report
(``tests/integration/test_v4_cluster.py``)."""

from __future__ import annotations

import json

import pytest

from tandem.bench.v4_transfer_bytes import ROOT, main, rows, tier_bytes_per_token
from tandem.model.family import read_config


def test_v4_flash_moves_a_tenth_of_v3s_bytes_at_long_prompts() -> None:
    table = {(r.model, r.prompt_tokens): r for r in rows([1024, 131072, 1048576])}
    assert table[("DeepSeek-V3", 131072)].per_token == 61 * 576 * 2
    flash = [table[("DeepSeek-V4-Flash", n)].per_token for n in (1024, 131072, 1048576)]
    assert flash == sorted(flash, reverse=True)
    entries = 21 * 512 * 2 / 4 + 20 * 512 * 2 / 128 + 21 * 128 * 2 / 4  # compressed + indexer keys
    assert entries == 6880.0 and entries < flash[-1] < 1.01 * entries
    assert 0.09 < flash[1] / table[("DeepSeek-V3", 131072)].per_token < 0.11
    assert ("tiny V4", 1048576) not in table  # past the tiny model's context


def test_the_command_prints_the_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--lengths", "2048"]) == 0
    out = capsys.readouterr().out
    assert "| DeepSeek-V4-Flash | 2,048 | 31,161,344 | 15,215.5 B | 0.217 |" in out
    assert main(["--lengths", "2048", "--json"]) == 0
    assert {r["model"] for r in json.loads(capsys.readouterr().out)["rows"]} >= {"tiny V4", "DeepSeek-V3"}
    with pytest.raises(SystemExit):
        main(["--lengths", "x"])


def test_a_cached_v4_token_is_priced_by_the_bytes_its_rank_loads() -> None:
    """What the table says a loaded token moves is what a rank's tiers price it by: a V4 pool's
    page entries, and its boundary state on the pools' share of the pages."""
    import torch

    from tandem.engine.kv_tiers import KVTiers, TierConfig
    from tandem.engine.tier_copier import boundary_bytes, boundary_share, page_bytes, pool_block_layout
    from tandem.model.v4.config import V4Config
    from tandem.model.v4.pages import v4_pool
    from tandem.model.v4.tiny import tiny_v4_config_dict

    cfg = V4Config.from_dict(tiny_v4_config_dict(0, 1))
    pool = v4_pool(cfg, 8, 16, torch.bfloat16, prefix_caching=True)
    layout, entries, boundary = pool_block_layout(pool), page_bytes(pool), boundary_bytes(pool)
    tiers = KVTiers(
        TierConfig(
            4, None, "tiny", layout, entries, boundary_bytes=boundary, boundary_share=boundary_share(pool)
        )
    )
    alone, priced = tier_bytes_per_token(cfg, 16)
    assert alone * 16 == entries and boundary > entries
    assert tiers.page_price_bytes == round(priced * 16) and tiers.stats().kv_bytes_per_token == int(priced)
    flash = tier_bytes_per_token(read_config(ROOT / "deploy/models/deepseek-v4-flash"))
    assert flash == (6880.0, 6880.0 + 0.25 * (44032 + 3360))
