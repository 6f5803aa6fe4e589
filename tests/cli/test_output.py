"""A command's stdout is its output alone: what other threads print to ``sys.stdout`` while it
runs (Ray's log monitor prints raylet warnings there) goes to stderr."""

from __future__ import annotations

import json
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
