"""The acceptance rule, prompt lookup, the speculative config, and the distribution a verify
step samples from: with drafts that are right only as often as chance allows, every token a
request gets is still distributed as the target's softmax (a chi-square test over a fixed set
of seeds), and it is the very token the request gets with speculation off."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tandem.engine.drafters import make_drafter
from tandem.engine.ngram_drafter import lookup
from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner
from tandem.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from tandem.engine.speculation import SpeculativeConfig, accept
from tandem.wire.request_params import SamplingParams


def test_accept_keeps_the_targets_samples_up_to_the_first_wrong_draft() -> None:
    assert accept((), (7,)) == (7,)
    assert accept((1, 2, 3), (1, 2, 3, 4)) == (1, 2, 3, 4)  # all right: the bonus token too
    assert accept((1, 9, 3), (1, 2, 3, 4)) == (1, 2)  # the target's own token where it differs
    assert accept((9, 2), (1, 2, 3)) == (1,)
    with pytest.raises(ValueError, match="2 drafts need 3 target samples"):
        accept((1, 2), (1, 2))


def test_lookup_drafts_what_followed_the_latest_earlier_occurrence() -> None:
    assert lookup([1, 2, 3, 9, 1, 2, 3], 3, 1, 4) == (9, 1, 2)
    assert lookup([5, 1, 2, 8, 1, 2, 9, 1, 2], 2, 1, 3) == (9, 1)  # the latest of two
    assert lookup([4, 7, 1, 2, 3, 4, 1, 2], 2, 2, 2) == (3, 4)
    assert lookup([1, 2, 3], 3, 1, 4) == ()  # nothing repeats
    assert lookup([7, 7], 3, 1, 4) == (7,)
    assert lookup([1, 2, 1, 2], 0, 1, 4) == ()
    # ids past one byte: a match must start on a token, not inside one
    assert lookup([0x0102, 0x0300, 5, 0x0201, 0x03], 2, 1, 1) == ()
    assert lookup([256, 1, 65536, 1], 1, 1, 1) == (65536,)


def test_the_ngram_drafter_respects_each_requests_limit() -> None:
    drafter = make_drafter(SpeculativeConfig(num_tokens=4, drafter="ngram"))
    a = Request("a", [1, 2, 3, 1, 2], SamplingParams())
    b = Request("b", [5, 6, 7], SamplingParams())
    assert drafter.propose([a, b], {"a": 2, "b": 4}) == {"a": (3, 1)}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_tokens": 17}, "speculative-tokens: must be an integer in 0..16"),
        ({"num_tokens": -1}, "speculative-tokens"),
        ({"drafter": "eagle"}, "drafter: must be one of ngram, mtp"),
        ({"ngram_min": 3, "ngram_max": 2}, "ngram_min"),
    ],
)
def test_config_names_the_bad_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**fields)  # type: ignore[arg-type]


# -- the distribution ------------------------------------------------------------------------------

VOCAB = 6
LOGITS = torch.tensor([2.0, 1.2, 0.7, 0.0, -0.5, -1.5], dtype=torch.float64)
PROBS = torch.softmax(LOGITS, dim=0).tolist()


class _FixedLogits:
    """A target whose next-token logits are the same at every position: each output token is
    then an independent draw from ``softmax(LOGITS)``, whatever the drafts were."""

    device = torch.device("cpu")

    def forward(self, ids: torch.Tensor, *_: object) -> torch.Tensor:
        return torch.zeros((ids.shape[0], 1), dtype=torch.float64)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return LOGITS.expand(hidden.shape[0], VOCAB)


@dataclass
class _Pool:
    page_size: int = 16


def _chi_square(counts: list[int]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, PROBS, strict=True))


CHI2_DF5_P001 = 20.515  # the 0.999 quantile of chi-square with 5 degrees of freedom


def test_verified_tokens_follow_the_target_distribution_over_fixed_seeds() -> None:
    runner = ModelRunner(_FixedLogits(), _Pool())  # type: ignore[arg-type]
    drafts = (0, 0, 0)  # the most likely token: right about 45% of the time
    seeds = range(4000)
    chunks = tuple(
        ScheduledChunk(
            request_id=f"r{seed}", token_ids=(1, *drafts), start_position=3, page_ids=(seed,), sample=True,
            sampling=SamplingParams(temperature=1.0, max_tokens=64, seed=seed), output_index=1,
            draft_token_ids=drafts,
        )
        for seed in seeds
    )  # fmt: skip
    verified = runner.verify(SchedulerOutput(chunks, sum(len(c.token_ids) for c in chunks), ()))
    plain = runner.run(
        SchedulerOutput(
            tuple(
                ScheduledChunk(
                    request_id=f"r{seed}", token_ids=(1,), start_position=3, page_ids=(seed,), sample=True,
                    sampling=SamplingParams(temperature=1.0, max_tokens=64, seed=seed), output_index=1,
                )
                for seed in seeds
            ),
            len(seeds),
            (),
        )
    )  # fmt: skip
    # the first token of each step is the one plain decoding samples, draft or no draft
    assert all(verified[f"r{s}"][0] == plain[f"r{s}"] for s in seeds)
    accepted_drafts = sum(len(tokens) - 1 for tokens in verified.values())
    assert 0.3 * len(seeds) < accepted_drafts < 0.9 * len(seeds)  # drafts are right, and wrong
    for position in range(4):  # output index 1 + position, over the requests that reached it
        counts = [0] * VOCAB
        for tokens in verified.values():
            if len(tokens) > position:
                counts[tokens[position]] += 1
        assert sum(counts) > 100
        assert _chi_square(counts) < CHI2_DF5_P001, (position, counts)
