"""``tandem generate`` and ``tandem model make-tiny``: outputs, and one-line errors with exit code 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.cli.main import main
from tandem.engine.colocated import ColocatedEngine
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.wire.request_params import SamplingParams


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cli") / "tiny", seed=0, max_position_embeddings=64)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_prompts_file_runs_concurrently_in_input_order(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        {"prompt": "Hello"},
        {"prompt_ids": [10, 11, 12, 13, 14, 15, 16, 17]},
        {"prompt": "a much longer prompt than the others", "max_tokens": 3},
        {"prompt_ids": [40, 41], "temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 5},
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    code, out, err = _run(
        [
            "generate",
            "--model",
            str(tiny),
            "--prompts-file",
            str(path),
            "--max-tokens",
            "6",
            "--ignore-eos",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    outputs = json.loads(out)["outputs"]
    assert [len(o["token_ids"]) for o in outputs] == [6, 6, 3, 6]
    keys = {"token_ids", "text", "prompt_tokens", "cached_tokens", "cached_tokens_by_tier", "finish_reason"}
    assert set(outputs[0]) == keys
    # the engine in this process has its device pages only: every cached token is there
    for o in outputs:
        assert o["cached_tokens_by_tier"] == {"device": o["cached_tokens"], "host": 0, "store": 0}
    assert outputs[1]["prompt_tokens"] == 8 and outputs[0]["finish_reason"] == "length"

    engine = ColocatedEngine.from_model_dir(tiny)
    assert (
        outputs[0]["token_ids"]
        == engine.generate([engine.tokenizer.encode("Hello")], SamplingParams(6, ignore_eos=True))[
            0
        ].token_ids
    )  # type: ignore[union-attr]
    # the seeded line alone gives the tokens it gave in the batch
    alone = engine.generate(
        [[40, 41]], SamplingParams(6, temperature=0.8, top_p=0.9, top_k=20, seed=5, ignore_eos=True)
    )
    assert alone[0].token_ids == outputs[3]["token_ids"]
    assert outputs[0]["text"] == engine.tokenizer.decode(outputs[0]["token_ids"])  # type: ignore[union-attr]


def test_prefill_chunk_tokens_gives_the_same_tokens(tiny: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 40-token prompt computed 3 tokens a step gives the tokens of one chunk."""
    prompt = ",".join(str(10 + i) for i in range(40))
    base = [
        "generate",
        "--model",
        str(tiny),
        "--prompt-ids",
        prompt,
        "--max-tokens",
        "8",
        "--ignore-eos",
        "--json",
    ]
    code, whole, err = _run(base, capsys)
    assert code == 0, err
    code, chunked, err = _run([*base, "--prefill-chunk-tokens", "3"], capsys)
    assert code == 0, err
    tokens = [json.loads(out)["outputs"][0]["token_ids"] for out in (whole, chunked)]
    assert tokens[0] == tokens[1] and len(tokens[0]) == 8


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (["--prompt", "hi", "--max-tokens", "-3"], "max_tokens"),
        (["--prompt", "", "--max-tokens", "4"], "prompt"),
        (["--prompt-ids", "1,2,258", "--max-tokens", "4"], "outside the vocabulary"),
        (["--prompt-ids", "1,x", "--max-tokens", "4"], "--prompt-ids"),
        (["--prompt-ids", ",".join(["5"] * 64), "--max-tokens", "4"], "context"),
        (["--prompt", "hi", "--max-tokens", "4", "--top-p", "0"], "top_p"),
        (["--prompt", "hi", "--max-tokens", "4", "--temperature", "-1"], "temperature"),
        (["--prompt", "hi", "--max-tokens", "4", "--regex", "(ab"], "guide: regex does not compile"),
        (["--prompt", "hi", "--max-tokens", "4", "--prefill-chunk-tokens", "0"], "--prefill-chunk-tokens"),
        (
            ["--prompt", "hi", "--max-tokens", "4", "--json-schema", "/nonexistent.json"],
            "--json-schema: cannot",
        ),
    ],
)
def test_bad_requests_exit_2_with_one_line(
    tiny: Path, args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _run(["generate", "--model", str(tiny), *args], capsys)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and needle in err


def test_bad_prompts_file_names_the_line(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": "x", "temprature": 1}\n')
    code, _, err = _run(
        ["generate", "--model", str(tiny), "--prompts-file", str(path), "--max-tokens", "2"], capsys
    )
    assert code == 2 and f"{path}:2" in err and "temprature" in err


def test_missing_model_and_other_architecture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(
        ["generate", "--model", str(tmp_path / "absent"), "--prompt", "x", "--max-tokens", "2"], capsys
    )
    assert code == 2 and "does not exist" in err and err.count("\n") == 1
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    code, _, err = _run(["generate", "--model", str(llama), "--prompt", "x", "--max-tokens", "2"], capsys)
    assert code == 2 and "LlamaForCausalLM" in err and err.count("\n") == 1


def test_console_script_end_to_end(tmp_path: Path) -> None:
    tiny_dir = tmp_path / "tiny"
    cli = [sys.executable, "-m", "tandem.cli"]
    made = subprocess.run(
        [*cli, "model", "make-tiny", str(tiny_dir), "--seed", "1"], capture_output=True, text=True
    )
    assert made.returncode == 0, made.stderr
    gen = subprocess.run(
        [
            *cli,
            "generate",
            "--model",
            str(tiny_dir),
            "--prompt",
            "Hi",
            "--max-tokens",
            "5",
            "--ignore-eos",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert gen.returncode == 0, gen.stderr
    assert len(json.loads(gen.stdout)["outputs"][0]["token_ids"]) == 5
    again = subprocess.run(
        [*cli, "model", "make-tiny", str(tiny_dir), "--seed", "2"], capture_output=True, text=True
    )
    assert again.returncode == 2 and again.stderr.count("\n") == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--speculative-tokens", "17"], "--speculative-tokens: must be in 0..16, got 17"),
        (["--speculative-tokens", "-1"], "--speculative-tokens: must be in 0..16"),
        (["--speculative-tokens", "3", "--drafter", "eagle"], "--drafter: must be one of ngram, mtp"),
        (["--speculative-tokens", "3", "--drafter", "mtp"], "has no multi-token-prediction layer"),
    ],
)
def test_bad_speculation_is_refused_before_anything_starts(
    tiny: Path, args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for command in (
        ["serve", "--port", "0"],
        ["generate", "--preset", "local", "--prompt", "x", "--max-tokens", "2"],
    ):
        code, out, err = _run([*command, "--model", str(tiny), *args], capsys)
        assert code == 2 and out == "" and err.count("\n") == 1 and needle in err, (command, err)


def test_a_regex_on_the_command_line_guides_the_output(
    tiny: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["generate", "--model", str(tiny), "--prompt", "hi", "--max-tokens", "24", "--temperature", "1",
            "--seed", "3", "--regex", "(yea|nay), [a-z]{3,8}[.]", "--json"]  # fmt: skip
    code, out, _ = _run(args, capsys)
    assert code == 0
    (line,) = [json.loads(x) for x in out.splitlines() if x.strip()]
    text = line["text"] if "text" in line else line["outputs"][0]["text"]
    assert re.fullmatch(r"(yea|nay), [a-z]{3,8}[.]", text), text
