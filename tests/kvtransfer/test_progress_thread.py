"""NIXL's busy progress thread: on for pools in GPU memory, off for host-memory pools (where it
would take a core from the rank's model), and the operator's setting decides when given."""

from __future__ import annotations

import pytest

from tandem.kvtransfer.nixl_transport import progress_thread_enabled


def test_the_default_follows_where_the_pool_lives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_NIXL_PROGRESS_THREAD", raising=False)
    assert progress_thread_enabled("VRAM") and not progress_thread_enabled("DRAM")


@pytest.mark.parametrize(("value", "on"), [("1", True), ("0", False)])
def test_the_operator_decides(monkeypatch: pytest.MonkeyPatch, value: str, on: bool) -> None:
    monkeypatch.setenv("TANDEM_NIXL_PROGRESS_THREAD", value)
    assert progress_thread_enabled("VRAM") is on and progress_thread_enabled("DRAM") is on


def test_a_bad_setting_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_NIXL_PROGRESS_THREAD", "on")
    with pytest.raises(ValueError, match="TANDEM_NIXL_PROGRESS_THREAD: expected 0 or 1"):
        progress_thread_enabled("DRAM")
