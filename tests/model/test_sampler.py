from __future__ import annotations

import pytest
import torch

from tandem.model.sampler import apply_penalties, filter_logits, sample
from tandem.wire.request_params import InvalidRequestError, SamplingParams


def _logits(n: int = 3, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_top_k_one_are_argmax() -> None:
    logits = _logits()
    greedy = sample(logits, [SamplingParams()] * 3, [0, 0, 0], [0, 0, 0])
    assert greedy == logits.argmax(-1).tolist()
    hot = SamplingParams(temperature=5.0, top_k=1)
    assert sample(logits, [hot] * 3, [1, 2, 3], [0, 0, 0]) == greedy


def test_seeded_draw_ignores_the_rest_of_the_batch() -> None:
    logits = _logits(6)
    p = SamplingParams(temperature=1.0, seed=11)
    alone = sample(logits[2:3], [p], [11], [4])
    batch = sample(logits, [SamplingParams()] * 2 + [p] * 4, [0, 0, 11, 5, 6, 7], [0, 0, 4, 4, 4, 4])
    assert batch[2] == alone[0]
    assert sample(logits[2:3], [p], [11], [4]) == alone


def test_draws_follow_the_filtered_distribution() -> None:
    row = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    p = SamplingParams(temperature=0.7, top_k=4, top_p=0.9)
    probs = torch.softmax(filter_logits(row[None], [p])[0], -1)
    assert probs[4:].sum() == 0  # top-k removed the tail
    kept = (probs > 0).sum().item()
    assert 1 <= kept <= 4
    n = 4000
    counts = torch.zeros(6)
    for i in range(n):
        counts[sample(row[None], [p], [123], [i])[0]] += 1
    assert torch.allclose(counts / n, probs, atol=0.03)


def test_top_p_keeps_the_smallest_nucleus() -> None:
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = torch.isfinite(filter_logits(row[None], [SamplingParams(temperature=1.0, top_p=0.75)])[0])
    assert kept.tolist() == [True, True, False, False]
    kept = torch.isfinite(filter_logits(row[None], [SamplingParams(temperature=1.0, top_p=0.1)])[0])
    assert kept.tolist() == [True, False, False, False]


def test_mixed_rows_filter_independently() -> None:
    logits = _logits(3, 40, seed=4)
    params = [
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.5, top_p=0.5),
        SamplingParams(temperature=2.0),
    ]
    filtered = filter_logits(logits, params)
    for i, p in enumerate(params):
        assert torch.equal(filtered[i], filter_logits(logits[i : i + 1], [p])[0])
    assert int(torch.isfinite(filtered[0]).sum()) == 3
    assert bool(torch.isfinite(filtered[2]).all())


def test_noise_is_uniform_and_keyed_by_seed_and_index() -> None:
    from tandem.model.sampler import uniform_noise

    u = uniform_noise(torch.tensor([1, 1, 2]), torch.tensor([0, 1, 0]), 20000)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 0.01 and abs(float(u.var()) - 1 / 12) < 0.005
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(u[0], uniform_noise(torch.tensor([1]), torch.tensor([0]), 20000)[0])


def test_temperatures_below_the_greedy_bound_are_argmax_down_to_the_smallest_float() -> None:
    """Dividing float32 logits by a tiny temperature overflows to +-inf, and the draw is then not
    the argmax; every temperature below ``GREEDY_TEMPERATURE`` is greedy instead."""
    from tandem.wire.request_params import GREEDY_TEMPERATURE

    logits = _logits(4, vocab=300, seed=5)
    argmax = logits.argmax(-1).tolist()
    for temperature in (5e-324, 1.4e-45, 1e-38, 1e-20, 1e-8, GREEDY_TEMPERATURE / 2):
        params = SamplingParams(temperature=temperature, seed=9)
        params.validate()
        assert params.greedy and params.canonical().temperature == 0.0
        assert sample(logits, [params] * 4, [9, 10, 11, 12], [0, 1, 2, 3]) == argmax, temperature
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


def test_penalties_follow_vllms_order_on_the_requests_own_tokens() -> None:
    """Repetition over the prompt's and outputs' tokens (a positive logit divided, a negative one
    multiplied), then frequency per output occurrence and presence once, subtracted; a row
    without penalties is left alone, and a penalized row without its tokens is an error."""
    row = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    prompt, outputs = (0, 1), (3, 3, 2)
    out = apply_penalties(torch.stack([row, row]), [p, SamplingParams()], [(prompt, outputs), None])
    expected = torch.tensor([2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.25 - 0.5, 3.0 / 2 - 2 * 0.25 - 0.5, -2.0, 1.0])
    assert torch.allclose(out[0], expected) and torch.equal(out[1], row)
    # greedy with a penalty takes the argmax of the penalized logits: 3 loses to 0 here
    assert sample(row[None], [p], [0], [3], [(prompt, outputs)]) == [0]
    assert sample(row[None], [SamplingParams()], [0], [3]) == [3]
    with pytest.raises(ValueError, match="needs its tokens so far"):
        sample(row[None], [p], [0], [3])


def test_min_p_drops_what_is_less_likely_than_its_share_of_the_likeliest() -> None:
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = filter_logits(row[None], [SamplingParams(temperature=1.0, min_p=0.2)])[0]
    assert torch.isfinite(kept).tolist() == [True, True, True, False]  # 0.05 < 0.2 * 0.5
    assert torch.isfinite(filter_logits(row[None], [SamplingParams(temperature=1.0)])[0]).all()


def test_a_seeded_penalized_draw_depends_on_its_history_not_its_batch() -> None:
    logits = _logits(4)
    p = SamplingParams(temperature=1.0, seed=7, frequency_penalty=1.5, repetition_penalty=1.3)
    history = ((5, 6, 7), tuple(range(10, 30)))
    alone = sample(logits[1:2], [p], [7], [20], [history])
    others = [SamplingParams(), p, SamplingParams(temperature=0.8, seed=1), p]
    histories = [None, history, None, ((1,), ())]
    assert sample(logits, others, [0, 7, 1, 7], [0, 20, 3, 20], histories)[1] == alone[0]


def test_logit_bias_is_added_before_the_penalties_and_bans_or_forces_tokens() -> None:
    """-100 on the likeliest token moves a greedy draw off it, +100 on another forces it (a
    sampled row too); the bias comes before the repetition penalty, which then divides the
    biased logit; rows without a bias are left alone; the logprobs stay the model's."""
    from tandem.model.sampler import apply_logit_bias, logprobs_of

    logits = _logits(2)
    top, other = int(logits[0].argmax()), int(logits[0].argmin())
    banned = SamplingParams(logit_bias=((top, -100.0),))
    assert sample(logits[:1], [banned], [0], [0]) != [top]
    forced = SamplingParams(temperature=1.0, seed=3, logit_bias=((other, 100.0),))
    assert sample(logits, [forced, SamplingParams()], [3, 0], [0, 0]) == [other, int(logits[1].argmax())]
    row = torch.tensor([[2.5, 1.0]])
    both = SamplingParams(logit_bias=((1, 3.0),), repetition_penalty=2.0)
    biased = apply_logit_bias(row, [both])
    assert biased.tolist() == [[2.5, 4.0]] and row.tolist() == [[2.5, 1.0]]
    # (1 + 3) / 2 = 2 < 2.5: the bias before the penalty (after it, 1 / 2 + 3 = 3.5 would win)
    assert sample(row, [both], [0], [0], [((1,), ())]) == [0]
    (entry,) = logprobs_of(logits[:1], [other], [0])
    assert abs(entry.logprob - torch.log_softmax(logits[0], -1)[other].item()) < 1e-6
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias=((50, 1.0),)).validate(vocab_size=50)
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias=((5, 1.0), (5, 2.0))).validate()
