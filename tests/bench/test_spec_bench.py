"""``tandem bench speculative``'s options and its per-point figures (the runs themselves start
deployments: a benchmark, run by hand)."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.bench.spec_bench import _points, parse_configs
from tandem.wire.request_params import InvalidRequestError


def test_configs_parse_and_bad_ones_name_the_flag() -> None:
    configs = parse_configs("off,mtp:3,ngram:5")
    assert [(n, c.tokens, c.drafter) for n, c in configs.items()] == [
        ("off", 0, "ngram"),
        ("mtp:3", 3, "mtp"),
        ("ngram:5", 5, "ngram"),
    ]
    for bad in ("mtp:3", "off", "off,eagle:3", "off,mtp:17", "off,mtp:x"):
        with pytest.raises(InvalidRequestError, match="--configs"):
            parse_configs(bad)


def _point(c: int, user: float, steps: int, accepted: int) -> dict[str, Any]:
    return {
        "concurrency": c,
        "interactivity_tokens_per_s": user,
        "speculation": {
            "acceptance_length": (steps + accepted) / steps,
            "acceptance_rate": accepted / max(1, 3 * steps),
        },
        "itl_ms": {"p50": 10.0},
        "tpot_ms": {"p50": 1000.0 / user},
        "ttft_ms": {"p50": 50.0},
        "output_tokens_per_s": user * c,
        "failed": 0,
    }


def test_each_ratio_is_taken_within_its_round() -> None:
    runs = {
        "off": [{"points": [_point(1, 40.0, 10, 0)], "decode_step": {"step_ms": 2.0}}] * 2,
        "mtp:3": [
            {"points": [_point(1, 80.0, 10, 15)], "decode_step": {"step_ms": 3.0, "draft_ms": 1.0}},
            {"points": [_point(1, 30.0, 10, 5)], "decode_step": {"steps": 0}},
        ],
    }
    off, mtp = _points(runs)
    assert off["ratio_to_off"] == 1.0 and off["acceptance_rate"] is None
    assert mtp["ratios_to_off"] == [2.0, 0.75] and mtp["ratio_to_off"] == pytest.approx(1.375)
    assert mtp["decode_step_ms"] == 1.5 and mtp["decode_draft_ms"] == 0.5
    assert mtp["tokens_per_s_per_user"] == 55.0 and mtp["acceptance_length"] == pytest.approx(2.0)
