"""Structured outputs' masks (xgrammar) on the demo model's byte-level vocabulary: what a guide
allows, that a matcher rebuilt from a request's tokens (another rank, a migration) allows what
the one fed token by token does, and the errors of a spec that does not compile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.engine.colocated import ColocatedEngine
from tandem.model.grammar import GrammarCompiler, GuidedRows, encoded_vocab
from tandem.model.sampler import sample
from tandem.model.tokenizer import Tokenizer
from tandem.wire.request_params import Guide, GuideKind, InvalidRequestError, SamplingParams

DEMO = Path(__file__).resolve().parents[2] / "model" / "demo"
VOCAB = 258
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DEMO)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB)


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return [i for i in tokenizer.encode(text) if i != tokenizer.bos_token_id]


def _allowed_text(tokenizer: Tokenizer, mask: torch.Tensor) -> set[bytes]:
    return {tokenizer.token_bytes(i) for i in mask.nonzero().flatten().tolist()}


def test_special_tokens_are_never_in_the_vocabulary_a_grammar_sees(tokenizer: Tokenizer) -> None:
    vocab = encoded_vocab(tokenizer, VOCAB + 6)  # a model's padding ids past the tokenizer's
    assert vocab[256] == vocab[257] == b"" and vocab[-1] == b""
    assert vocab[ord("{")] == b"{"


def test_a_schema_allows_its_opening_then_only_eos_once_complete(
    tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    rows = GuidedRows(compiler, tokenizer.eos_token_id)
    guide = Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA))
    first = rows.allowed([("r", guide, [])])[0]
    assert _allowed_text(tokenizer, first) == {b"{"}
    done = _ids(tokenizer, '{"name": "Ab", "age": 7}')
    last = rows.allowed([("r", guide, done)])[0]
    assert last.nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    # in the middle of the integer: digits, or the closing brace
    mid = rows.allowed([("r2", guide, _ids(tokenizer, '{"name": "Ab", "age": 1'))])[0]
    assert _allowed_text(tokenizer, mid) == {b"}", *(str(d).encode() for d in range(10))}


def test_a_matcher_rebuilt_from_the_tokens_allows_what_the_fed_one_does(
    tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    """The decode rank that takes a request on, or one it migrates to, builds its matcher from
    the outputs so far: at every position it must allow what the rank that fed them one at a
    time allows."""
    guide = Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA))
    outputs = _ids(tokenizer, '{"name": "Abner", "age": 42}')
    fed = GuidedRows(compiler, tokenizer.eos_token_id)
    for n in range(len(outputs) + 1):
        incremental = fed.allowed([("r", guide, outputs[:n])])
        rebuilt = GuidedRows(compiler, tokenizer.eos_token_id).allowed([("r", guide, outputs[:n])])
        assert torch.equal(incremental, rebuilt), f"position {n}"
    assert fed.rebuilt == 0  # fed one token a step, never rebuilt


def test_a_length_bounded_string_admits_no_raw_control_character(
    tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    """JSON has no raw control characters in strings; xgrammar's own length-bounded strings
    let them through, so they are compiled as a pattern."""
    rows = GuidedRows(compiler, tokenizer.eos_token_id)
    schema = {"type": "object", "properties": {"w": {"type": "string", "maxLength": 3}}, "required": ["w"]}
    for guide in (
        Guide(GuideKind.JSON_SCHEMA, json.dumps(schema)),
        Guide(GuideKind.STRUCTURAL_TAG, json.dumps({"type": "structural_tag", "format": {
            "type": "json_schema", "json_schema": schema}})),
    ):  # fmt: skip
        mask = rows.allowed([(guide.kind.value, guide, _ids(tokenizer, '{"w": "a'))])[0]
        assert not mask[:0x20].any() and mask[ord("b")] and mask[ord('"')]
        full = rows.allowed([(guide.kind.value, guide, _ids(tokenizer, '{"w": "abc'))])[0]
        assert _allowed_text(tokenizer, full) == {b'"'}


def test_a_request_id_seen_with_other_outputs_starts_over(
    tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    rows = GuidedRows(compiler, tokenizer.eos_token_id)
    guide = Guide(GuideKind.REGEX, "(yea|nay)")
    assert _allowed_text(tokenizer, rows.allowed([("r", guide, _ids(tokenizer, "ye"))])[0]) == {b"a"}
    # the same id, another history (a request id reused): its own state, not the old one's
    assert _allowed_text(tokenizer, rows.allowed([("r", guide, _ids(tokenizer, "n"))])[0]) == {b"a"}
    assert rows.rebuilt == 2


def test_an_output_the_grammar_refuses_leaves_only_eos(
    tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    rows = GuidedRows(compiler, tokenizer.eos_token_id)
    mask = rows.allowed([("r", Guide(GuideKind.REGEX, "yes"), _ids(tokenizer, "no"))])[0]
    assert mask.nonzero().flatten().tolist() == [tokenizer.eos_token_id]


@pytest.mark.parametrize(
    ("guide", "says"),
    [
        (Guide(GuideKind.JSON_SCHEMA, '{"type": "nonsense"}'), "nonsense"),
        (Guide(GuideKind.JSON_SCHEMA, "[1, 2"), "not JSON"),
        (Guide(GuideKind.REGEX, "(ab"), "parenthesis"),
        (Guide(GuideKind.GRAMMAR, "root ::= "), "EBNF"),
        (Guide(GuideKind.STRUCTURAL_TAG, '{"type": "nope"}'), "structural_tag does not compile"),
    ],
)
def test_a_spec_that_does_not_compile_names_the_field_and_is_remembered(
    compiler: GrammarCompiler, guide: Guide, says: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(guide, "response_format.json_schema.schema")
    assert info.value.field == "response_format.json_schema.schema"
    assert says in info.value.message and "/project/" not in info.value.message
    compiled = compiler.compiled
    with pytest.raises(InvalidRequestError) as again:  # asked again: the same error, not compiled again
        compiler.compile(guide, "tools")
    assert again.value.field == "tools" and again.value.message == info.value.message
    assert compiler.compiled == compiled


def test_a_guide_is_compiled_once_and_off_the_callers_thread(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, VOCAB)
    guide = Guide(GuideKind.REGEX, "[a-z]{2,5}")
    future = compiler.prepare(guide)
    assert compiler.prepare(guide) is future
    future.result(timeout=30)
    compiler.compile(guide)
    assert compiler.compiled == 1


def test_the_sampler_draws_only_allowed_tokens_whatever_the_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    mask = torch.zeros(2, VOCAB, dtype=torch.bool)
    mask[0, [5, 9]] = True
    mask[1, 200] = True
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    for index in range(20):
        tokens = sample(logits, params, [1, 2, 3], [index] * 3, allowed=([0, 2], mask))
        assert tokens[0] in (5, 9) and tokens[2] == 200
    greedy = sample(logits[:1], [SamplingParams()], [0], [0], allowed=([0], mask[1:]))
    assert greedy == [200]


def test_guide_shapes_are_checked_where_sampling_is() -> None:
    with pytest.raises(InvalidRequestError, match="needs its spec"):
        SamplingParams(guide=Guide(GuideKind.REGEX)).validate()
    with pytest.raises(InvalidRequestError, match="at most"):
        SamplingParams(guide=Guide(GuideKind.GRAMMAR, "x" * (64 * 1024 + 1))).validate()
    SamplingParams(guide=Guide(GuideKind.JSON_OBJECT)).validate()
    assert SamplingParams(guide=Guide(GuideKind.JSON_OBJECT)).needs_history


def test_seeded_guided_requests_give_valid_json_and_the_same_tokens_in_any_batch() -> None:
    engine = ColocatedEngine.from_model_dir(DEMO)
    assert engine.tokenizer is not None
    prompt = engine.tokenizer.encode("And the LORD said")
    guide = Guide(GuideKind.JSON_SCHEMA, json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, guide=guide) for s in range(4)]
    together = engine.generate([prompt] * 4, params)
    alone = engine.generate([prompt], params[2])
    for out in together:
        value = json.loads(out.text)
        assert set(value) == {"name", "age"} and len(value["name"]) <= 8 and 0 <= value["age"] <= 120
    assert alone[0].token_ids == together[2].token_ids
    assert len({o.text for o in together}) > 1  # the seeds matter
    assert len(engine.runner.guides or []) == 0  # every finished request's matcher dropped


def test_a_guide_that_does_not_compile_on_a_rank_ends_its_request_not_the_step(
    tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    """The edges compile a guide before any rank sees it; one sent around them gets only EOS
    (its request ends) and the other rows of the step are masked as usual."""
    rows = GuidedRows(compiler, tokenizer.eos_token_id)
    bad, good = Guide(GuideKind.REGEX, "(ab"), Guide(GuideKind.REGEX, "ab")
    masks = rows.allowed([("bad", bad, []), ("good", good, [])])
    assert masks[0].nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert _allowed_text(tokenizer, masks[1]) == {b"a"}
    again = rows.allowed([("bad", bad, [tokenizer.eos_token_id])])  # and it stays so
    assert again[0].nonzero().flatten().tolist() == [tokenizer.eos_token_id]


def test_the_colocated_engine_refuses_a_guide_that_does_not_compile() -> None:
    engine = ColocatedEngine.from_model_dir(DEMO)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request([1, 2, 3], SamplingParams(guide=Guide(GuideKind.REGEX, "(ab")))
    assert info.value.field == "guide" and "parenthesis" in info.value.message
    assert not engine.scheduler.has_unfinished_requests()
