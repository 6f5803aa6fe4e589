"""What integration tests share: an embedded Ray, started once per module and shut down after."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tandem.cluster.ray_bootstrap import init_ray, shutdown_ray


@pytest.fixture(scope="module")
def ray_started() -> Iterator[None]:
    init_ray()
    yield
    shutdown_ray()
