"""Fixtures shared by the service tests; a test module may define its own ``cluster``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.service_cluster import PIPELINE_CODE, Cluster


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A running controller on a fresh SQLite store; tests start their own workers."""
    c = Cluster(tmp_path, allow_code=PIPELINE_CODE)
    c.start_controller()
    try:
        yield c
    finally:
        c.stop()
