"""``tandem serve`` and ``tandem client`` as processes: the README's main job, end to end."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tandem.cluster.serve import demo_model_dir
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.wire.request_params import SamplingParams

CLI = [sys.executable, "-m", "tandem.cli"]


def _tandem(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preset", "no-such-preset"], "no preset 'no-such-preset'"),
        (["--model", "/no/such/model"], "--model: /no/such/model holds no config.json"),
        (["--port", "70000"], "--port: must be in [0, 65535]"),
        (["--metrics-port", "-1"], "--metrics-port: must be in [0, 65535]"),
        (["--port", "9400", "--metrics-port", "9400"], "--metrics-port: 9400 is the gRPC port"),
        (["--prometheus-url", "http://h:9090"], "--prometheus-url: only applies with --autoscale"),
        (["--autoscale", "--prometheus-url", "h:9090"], "--prometheus-url: expected http://HOST:PORT"),
        (["--tls-cert", "cert.pem"], "--tls-key"),
        (["--auth-token-file", "/no/such/token"], "--auth-token-file: cannot read /no/such/token"),
        (["--detach"], "--detach: needs --address"),
        (
            ["--metrics-port", "0", "--metrics-token-file", "/no/such/token"],
            "--metrics-token-file: cannot read /no/such/token",
        ),
        (["--metrics-port", "0", "--metrics-tls-cert", "c.pem"], "--metrics-tls-key: --metrics-tls-cert and"),
        (
            ["--metrics-token-file", "pyproject.toml"],
            "--metrics-token-file: pyproject.toml must hold one token",
        ),
        (["--frontends", "0"], "--frontends: must be at least 1"),
        (["--prefill-chunk-tokens", "0"], "--prefill-chunk-tokens: must be at least 1, got 0"),
        (["--migration-wait", "-1"], "--migration-wait: must be in [0, 86400] seconds, got -1.0"),
        (["--migration-wait", "nan"], "--migration-wait: must be in [0, 86400] seconds, got nan"),
        (["--port", "65535", "--frontends", "2"], "--frontends: ports 65535..65536 pass 65535"),
        (["--name", "Bad_Name"], "--name: expected lower-case letters, digits and '-'"),
        (
            ["--detach", "--address", "127.0.0.1:1", "--autoscale"],
            "--prometheus-url: --detach --autoscale needs the cluster's Prometheus",
        ),
    ],
)
def test_serve_refuses_bad_arguments_before_starting(args: list[str], message: str) -> None:
    result = _tandem("serve", *args, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and result.stderr.startswith("tandem: error:")


def test_serve_checks_the_model_files_and_ports_before_starting_anything(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """A model directory without its tokenizer, without its weights, or whose weights do not fit
    its config; a TLS file that is not there; a port in use: each is one line on stderr and exit
    code 2, from the command itself (no Ray, no rank, no traceback)."""

    def broken(name: str, change: Callable[[Path], None]) -> Path:
        model = tmp_path / name
        shutil.copytree(tiny_dir, model)
        change(model)
        return model

    def wider(model: Path) -> None:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 48}))

    no_tokenizer = broken("no-tokenizer", lambda m: (m / "tokenizer.json").unlink())
    no_weights = broken("no-weights", lambda m: (m / "model.safetensors").unlink())
    mismatched = broken("mismatched", wider)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (["--model", str(no_tokenizer)], "tokenizer.json not found"),
            (["--model", str(no_weights)], "no model.safetensors"),
            (["--model", str(mismatched)], "shape"),
            (
                ["--tls-cert", str(tmp_path / "cert.pem"), "--tls-key", str(tmp_path / "key.pem")],
                "--tls-cert: ",
            ),
            (["--port", str(port)], f"--port: 127.0.0.1:{port} is in use"),
            # --port 0 (any free port): the metrics port's check, whatever holds 50051 right now
            (["--port", "0", "--metrics-port", str(port)], f"--metrics-port: 127.0.0.1:{port} is in use"),
        ]
        for args, message in cases:
            result = _tandem("serve", *args, timeout=60)
            assert result.returncode == 2, (args, result.stderr)
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("tandem: error:") and message in lines[0], (
                args,
                lines,
            )
            assert result.stdout == ""  # nothing was served or announced


def test_autoscale_of_a_colocated_preset_is_refused_in_one_line() -> None:
    result = _tandem("serve", "--preset", "colocated", "--autoscale", timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "tandem: error: --autoscale: colocated has a colocated pool; the autoscaler sizes prefill and "
        "decode pools"
    ]


def test_autoscale_without_a_prometheus_says_so_in_one_line() -> None:
    result = _tandem("serve", "--autoscale", env=os.environ | {"PATH": "/nonexistent"}, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "tandem: error: --autoscale: no prometheus binary on PATH: install it (apt-get install "
        "prometheus) or pass --prometheus-url"
    ]


def test_serve_streams_to_the_client_and_shuts_down_cleanly(tmp_path: Path) -> None:
    server = subprocess.Popen(
        [*CLI, "serve", "--preset", "local", "--port", "0", "--dtype", "float64"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in server.stdout or []], daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        seen = []
        while not any("tandem: serving" in line for line in seen):
            assert server.poll() is None and time.monotonic() < deadline, "".join(seen)
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=1))
        bound = re.search(r"on 127\.0\.0\.1:(\d+) ", seen[-1])  # port 0: the OS chose one
        assert bound is not None and "serving demo on" in seen[-1], seen[-1]  # the default model
        port = int(bound.group(1))
        assert 0 < port < 65536
        addr = ["--addr", f"127.0.0.1:{port}"]

        prompts = tmp_path / "prompts.jsonl"
        rows = [{"prompt": f"turn {i}: hello"} for i in range(4)] + [{"prompt_ids": [5, 6, 7], "seed": 3}]
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out = _tandem(
            "client", "generate", "--prompts-file", str(prompts), "--max-tokens", "5", "--ignore-eos",
            "--temperature", "0.7", "--seed", "11", "--concurrency", "5", "--json", *addr,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        outputs = json.loads(out.stdout)["outputs"]
        engine = ColocatedEngine.from_model_dir(demo_model_dir(), torch.float64, EngineConfig())
        texts = [r.get("prompt") for r in rows]
        token_ids = [engine.tokenizer.encode(t) if t else [5, 6, 7] for t in texts]
        seeds = [11, 11, 11, 11, 3]
        sampling = [SamplingParams(max_tokens=5, temperature=0.7, seed=s, ignore_eos=True) for s in seeds]
        expected = engine.generate(token_ids, sampling)
        assert [o["token_ids"] for o in outputs] == [e.token_ids for e in expected]
        for o in outputs:
            assert o["finish_reason"] == "length" and o["prompt_tokens"] == o["bill"]["prompt_tokens"]
            assert (
                o["placement"]["prefill_group"] == "prefill0" and o["placement"]["decode_group"] == "decode0"
            )
            assert o["bill"]["output_tokens"] == 5 and o["bill"]["latency"]["ttft_s"] > 0

        streamed = _tandem("client", "generate", "hello", "--max-tokens", "3", "--stream", *addr)
        assert streamed.returncode == 0, streamed.stderr
        assert "finish=" in streamed.stdout and "prefill=prefill0-r" in streamed.stdout

        bad = _tandem("client", "generate", "hello", "--max-tokens", "3", "--top-p", "2", *addr)
        assert bad.returncode == 2 and "top_p" in bad.stderr

        status = _tandem("client", "status", "--check-integrity", *addr)
        assert status.returncode == 0, status.stderr
        ranks = [r for g in json.loads(status.stdout)["groups"] for r in g["ranks"]]
        assert len(ranks) == 4 and all(r["integrity"] == "ok" for r in ranks)
    finally:
        server.send_signal(signal.SIGINT)
        try:
            code = server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
    rest = []
    while not lines.empty():
        rest.append(lines.get())
    assert code == 0, "".join(rest)
    assert any("shutting down" in line for line in rest)
