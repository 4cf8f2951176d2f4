"""Shared fixtures: fresh stores per test, and one real Redis Cluster per session."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from millwheel.state.sqlite_store import SQLiteStore
from tests.support.redis_cluster import RedisClusterNodes


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[SQLiteStore]:
    store = SQLiteStore(tmp_path / "store.db")
    yield store
    store.close()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterNodes]:
    """3 masters + 3 replicas (AOF, appendfsync always), started once per session;
    tests keep apart by key prefix (``?prefix=``), as deployments sharing a cluster do."""
    with RedisClusterNodes() as nodes:
        yield nodes


LOG_TAIL_LINES = 40
LOG_TAIL_FILES = 8


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failing test's report ends with the last lines of each log its services wrote
    into its ``tmp_path`` (controller.log, worker0.log, ...): CI keeps only the report,
    and a flake seen once must be readable from it."""
    outcome = yield
    report = outcome.get_result()
    if not report.failed or call.when != "call":
        return
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if not isinstance(tmp, Path):
        return
    logs = sorted(tmp.rglob("*.log"), key=lambda p: p.stat().st_mtime, reverse=True)[:LOG_TAIL_FILES]
    for path in sorted(logs):
        try:
            lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        except OSError:
            continue
        report.sections.append((f"last {len(lines)} lines of {path.relative_to(tmp)}",
                                "\n".join(line[:300] for line in lines)))
