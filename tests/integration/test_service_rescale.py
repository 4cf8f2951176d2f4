"""Rescaling a running computation (RescaleComputation, ``millwheel rescale``) on a real
controller and two real workers (subprocesses, gRPC on loopback).

A window count downstream of a ``map`` is rescaled 2 -> 8 -> 3 while records are
injected: its output must equal the failure-free run's record by record (every window
once, with its exact count), also with a worker killed -9 during a rescale, and with
the controller killed -9 before and after the rescale's commit (the run ends in the old
layout or the new, and goes on). Refused rescales change nothing.
"""

from __future__ import annotations

import contextlib
import io
import signal
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from millwheel.errors import InvalidSpecError, NotFoundError
from millwheel.record import Record
from millwheel.sources import ListSource
from services.cli import main as cli
from services.rpc.status import PreconditionError, UnavailableError
from tests.support import tagged_counts
from tests.support.redis_server import RedisServer
from tests.support.service_cluster import Cluster, alongside, expected_outputs, sigkill_after, wait_for
from tests.support.tagged_counts import topology

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
N = 1600
BATCH = 40
KEYS = 23


def records() -> list[Record]:
    return tagged_counts.records(N, KEYS)


def ranges_of(c: Cluster, node: str) -> list[int]:
    return sorted(r.range_id for r in c.client.status().ranges if r.node == node)


def run(c: Cluster, tmp_path: Path, steps: dict[int, Callable[[], None]]) -> None:
    """Inject every record (``steps[i]`` runs after message i), then compare the window
    counts with the failure-free run's, record by record."""
    topo = topology()
    c.register(topo)
    c.wait_balanced()
    recs = records()

    def between(i: int) -> None:
        time.sleep(0.02)
        if i in steps:
            steps[i]()

    c.inject("events", "events", recs, batch=BATCH, done=True, between=between)
    c.wait_watermark("counts", timeout=120)
    want = expected_outputs(tmp_path, topo, {"events": ListSource(recs)}, ("counts",))["counts"]
    got = c.outputs("counts")
    assert len(got) == len(want) and len({r[3] for r in got}) == len(got), "a window is missing or twice"
    assert got == want


def rescale(c: Cluster, n: int, during: Callable[[], None] | None = None) -> Any:
    with alongside(during):
        resp = c.client.rescale("counts", n)
    assert resp.changed and resp.computation.spec.options.key_ranges == n
    wait_for(lambda: ranges_of(c, "counts") == list(range(n)), 30, f"counts to have {n} ranges")
    return resp


def test_rescale_2_8_3_mid_stream_exact(two_workers: Cluster, tmp_path: Path) -> None:
    answers: list[Any] = []
    run(two_workers, tmp_path, {12: lambda: answers.append(rescale(two_workers, 8)),
                                25: lambda: answers.append(rescale(two_workers, 3))})
    up, down = answers
    assert (up.previous_key_ranges, down.previous_key_ranges) == (2, 8)
    assert up.keys > 0 and up.timers > 0 and down.keys > 0  # open windows moved with their keys
    assert up.computation.version == 2 and down.computation.version == 3
    info = two_workers.client.describe("counts")
    assert info.spec.options.key_ranges == 3 and len(info.ranges) == 3


def test_rescale_on_redis_where_state_lives_per_range(tmp_path: Path) -> None:
    """Redis keeps a key's state under its range: a key read or written in the wrong
    range would be missing, so the exact output shows every key was moved."""
    with RedisServer() as redis:
        c = Cluster(tmp_path, store_url=redis.url)
        try:
            c.start()
            run(c, tmp_path, {12: lambda: rescale(c, 8), 25: lambda: rescale(c, 3)})
        finally:
            c.stop()


def test_rescale_with_a_worker_killed_during_it(two_workers: Cluster, tmp_path: Path) -> None:
    victim = two_workers.workers[0]
    kill = sigkill_after(victim, 0.02)  # 20 ms in, the call is under way: ranges fenced, data moving
    run(two_workers, tmp_path, {12: lambda: rescale(two_workers, 8, during=kill),
                                25: lambda: rescale(two_workers, 3)})
    assert victim.wait(10) == -signal.SIGKILL


@pytest.mark.parametrize("point,layout", [("rescale_staged", 2), ("rescale_copied", 8)])
def test_controller_killed_mid_rescale_ends_in_one_layout(tmp_path: Path, point: str, layout: int) -> None:
    """Killed before the commit: the old layout runs on; after it (the new ranges half
    written): the next controller completes the new one. Either way the output is exact."""
    c = Cluster(tmp_path, env={"MILLWHEEL_CRASH_AT": f"{point}:1"})
    try:
        c.start()

        def crash_and_restart() -> None:
            with pytest.raises(UnavailableError):  # the controller dies under the call
                c.client.rescale("counts", 8)
            assert c.controller is not None and c.controller.wait(20) == -signal.SIGKILL
            c.env.pop("MILLWHEEL_CRASH_AT")
            c.start_controller()
            wait_for(lambda: ranges_of(c, "counts") == list(range(layout)), 60, f"counts in {layout} ranges")
            assert c.client.describe("counts").spec.options.key_ranges == layout
            assert not any(r.node.startswith("rescale:") for r in c.client.status().ranges)

        run(c, tmp_path, {12: crash_and_restart})
    finally:
        c.stop()


def view(c: Cluster) -> list[tuple[str, int, int]]:
    return [(i.spec.name, i.spec.options.key_ranges, i.version) for i in c.client.computations().computations]


def settled(c: Cluster) -> bytes | None:
    """k1's state once nothing is pending anywhere and it stays the same for a while."""
    if any(r.pending for r in c.client.status().ranges):
        return None
    first = c.client.state("counts", "k1").state
    time.sleep(1.0)
    return first if c.client.state("counts", "k1").state == first else None


def test_refused_rescales_change_nothing(two_workers: Cluster) -> None:
    c = two_workers
    c.register(topology())
    c.wait_balanced()
    c.inject("events", "events", records()[:200], batch=50)
    wait_for(lambda: c.client.state("counts", "k1").state, 60, "open windows in counts")
    state = wait_for(lambda: settled(c), 60, "the records injected to be processed")
    before = view(c)
    for cls, name, n, needle in [(NotFoundError, "nobody", 4, "nobody"),
                                 (PreconditionError, "events", 4, "injector"),
                                 (PreconditionError, "injector:events", 4, "injector"),
                                 (InvalidSpecError, "counts", 0, "1..4096"),
                                 (InvalidSpecError, "counts", 4097, "1..4096"),
                                 (InvalidSpecError, "counts", -3, "1..4096")]:
        with pytest.raises(cls) as err:
            c.client.rescale(name, n)
        assert needle in str(err.value), str(err.value)
        assert view(c) == before
    same = c.client.rescale("counts", 2)  # the current count: nothing to do
    assert not same.changed and view(c) == before
    assert ranges_of(c, "counts") == [0, 1] and c.client.state("counts", "k1").state == state

    out, errs = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(errs):
        code = cli(["rescale", "counts", "--key-ranges", "5", "--controller", c.address])
    assert code == 0 and "2 -> 5 key ranges" in out.getvalue(), errs.getvalue()
    assert c.client.state("counts", "k1").state == state  # the key's open windows went along
    assert view(c) == [(n, 5 if n == "counts" else k, v + (n == "counts")) for n, k, v in before]
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli(["rescale", "--help"])
    assert "one layout, never a mix" in out.getvalue()
