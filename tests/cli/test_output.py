"""A command's stdout is its output alone: what other threads print to ``sys.stdout`` while it
runs (Ray's log monitor prints raylet warnings there) goes to stderr."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from tandem.client.output import command_output, emit


def test_log_lines_printed_meanwhile_go_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    def log_monitor() -> None:  # looks sys.stdout up when it prints, as Ray's does
        print("(raylet) WARNING: 8 PYTHON worker processes have been started", file=sys.stdout)

    with command_output():
        thread = threading.Thread(target=log_monitor)
        thread.start()
        thread.join()
        emit(json.dumps({"outputs": []}))
        emit("chunk", end="")
    out, err = capsys.readouterr()
    assert out == '{"outputs": []}\nchunk' and "(raylet) WARNING" in err
    print("after")  # the command is over: stdout is stdout again
    assert capsys.readouterr().out == "after\n"


LATE = """
import atexit, os, sys
from tandem.cli.main import main
# what Ray does after a command's output: its exit prints, and a process it started writes to fd 1
atexit.register(lambda: print("(raylet) WARNING: 12 PYTHON worker processes have been started", flush=True))
atexit.register(lambda: os.system("echo child process line"))
sys.argv = ["tandem", "generate", "--prompt-ids", "5,6,7", "--max-tokens", "2", "--json"]
sys.exit(main())
"""


def test_the_command_prints_its_json_alone_whatever_is_printed_after_it() -> None:
    done = subprocess.run([sys.executable, "-c", LATE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)  # one document, nothing after it
    assert len(document["outputs"]) == 1 and done.stdout.count("\n") == 1
    assert "(raylet) WARNING" in done.stderr and "child process line" in done.stderr
