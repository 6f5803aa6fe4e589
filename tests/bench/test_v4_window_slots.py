"""The window-slot replay (``bench/v4_window_slots.py``): at equal memory a smaller share holds
more pages; with every page keeping its window no hit is cut; a prompt repeated at once hits its
whole prefix even with few slots, and one whose last page lost its slot is cut to the page
before."""

from __future__ import annotations

import pytest

from tandem.bench.v4_window_slots import FLASH, main, replay
from tandem.model.v4.config import V4Config

GIB = 2**30


def _record(blocks: list[int], length: int) -> dict[str, object]:
    return {"timestamp": 0, "input_length": length, "output_length": 1, "hash_ids": blocks}


def test_a_smaller_share_holds_more_pages_and_every_page_kept_cuts_nothing() -> None:
    cfg = V4Config.from_dir(FLASH)
    records = [_record([1, 2, 3], 1400), _record([1, 2, 4], 1400), _record([1, 2, 3, 5], 1900)]
    whole = replay(records, cfg, 1.0, 2 * GIB)
    eighth = replay(records, cfg, 0.125, 2 * GIB)
    assert eighth.pages > 3 * whole.pages and eighth.page_bytes < whole.page_bytes / 3
    assert whole.cut_tokens == 0
    # the second shares 1,024 tokens (8 pages), the third the first's 1,400 (10 whole pages)
    assert whole.hit_tokens == 1024 + 1280
    assert whole.prompt_tokens == 1400 + 1400 + 1900


def test_few_slots_cut_a_hit_to_the_last_page_that_kept_one() -> None:
    """With slots for only the most recent completions, the prompt repeated next hits whole; one
    that comes after another prompt took the slots is cut, and counted as cut."""
    cfg = V4Config.from_dir(FLASH)
    again = replay([_record([1, 2, 3], 1400), _record([1, 2, 3], 1400)], cfg, 0.0625, 2 * GIB)
    assert again.hit_tokens == 1280 and again.cut_tokens == 0
    others = [_record([1000 + i, 2000 + i], 1000) for i in range(120)]  # 120 prompt ends take slots
    later = replay([_record([1, 2, 3], 1400), *others, _record([1, 2, 3], 1400)], cfg, 0.0625, 2 * GIB)
    assert later.cut_tokens > 0 and later.hit_tokens < 1280


def test_the_command_prints_each_share_of_each_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--kv-gib", "4", "--rank-share", "0.05", "--duration-s", "120"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("long-prompt", "bursty-short"))]
    assert len(rows) == 10 and "0.125" in out
