"""Two runtimes believe they own the same key ranges: only the current token writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from millwheel.errors import FencedError
from millwheel.runtime.local_runner import LocalRunner
from millwheel.state.sqlite_store import SQLiteStore
from tests.support import pipelines

RECORDS = pipelines.workload(n=1200)


def runner(store: SQLiteStore) -> LocalRunner:
    return LocalRunner(pipelines.topology(), store, pipelines.sources(RECORDS), batch_size=50)


def test_zombie_writes_nothing_and_new_owner_matches_failure_free_run(tmp_path: Path) -> None:
    reference = SQLiteStore(tmp_path / "ref.db")
    runner(reference).run()

    path = tmp_path / "s.db"
    zombie_store, owner_store = SQLiteStore(path), SQLiteStore(path)  # two processes' connections
    zombie = runner(zombie_store)
    for _ in range(5):
        zombie.step()
    before = pipelines.outputs(owner_store), {
        c: pipelines.final_state(owner_store, c) for c in ("counts", "totals")
    }
    owner = runner(owner_store)  # takes every range: tokens bumped
    # The zombie keeps going; its first write for any range is refused, and it stops.
    with pytest.raises(FencedError):
        for _ in range(50):
            zombie.step()
    after = pipelines.outputs(owner_store), {c: pipelines.final_state(owner_store, c) for c in ("counts", "totals")}
    assert after == before, "a fenced zombie changed visible state"
    owner.run()
    assert pipelines.outputs(owner_store) == pipelines.outputs(reference)
    for comp in ("parse", "counts", "totals"):
        assert pipelines.final_state(owner_store, comp) == pipelines.final_state(reference, comp)


def test_every_token_guarded_write_of_the_zombie_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    zombie = runner(SQLiteStore(path))
    zombie.step()
    runner(SQLiteStore(path))
    worker = zombie.workers["counts"][0]
    with pytest.raises(FencedError):
        zombie.store.report_watermark("counts", 0, worker.token, 10**12)
    with pytest.raises(FencedError):
        worker.outbox.ack(worker.token, [("totals", "x")])
    with pytest.raises(FencedError):
        zombie.store.expire_ids("counts", 0, worker.token, 10**18)
