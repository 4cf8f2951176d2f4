"""Stream-log retention in a running service (issue 27, item 3), against real processes:
a controller and a worker over one SQLite file, records flowing the whole time.

* A sink with ``log_retention_us`` of 2 s is trimmed by the leading controller while
  records keep arriving; a Subscribe from position 0 gets OUT_OF_RANGE naming the
  oldest available position (so does ``millwheel subscribe --after 0``), never a
  silent gap; a Subscribe from that position gets every record still kept, in log
  order, exactly the tail a subscriber that followed from the start saw.
* The dead-letter stream likewise: ``millwheel dead-letters replay`` after retention
  removed some dead letters replays those kept and says up to where they went.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from millwheel.errors import LogTrimmedError
from millwheel.keys import KeyExtractor
from millwheel.record import Record
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology
from services.client import ControllerClient, inject_messages
from tests.support.service_cluster import ROOT, Cluster, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
S = 1_000_000
RETENTION_US = 2 * S
DEAD_LETTER_RETENTION_US = 5 * S  # long enough for a replay to start before the new ones go


def echo_topology() -> Topology:
    return Topology(
        computations=(ComputationSpec(
            "echo", (InputSpec("events"),), ("out",), CodeRef("filter", {"expr": "ts >= 0"}),
            Options(key_ranges=2, log_retention_us=RETENTION_US)),),
        injectors=(InjectorSpec("events", "events"),),
    )


def cli(cluster: Cluster, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args, "--controller", cluster.address],
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)


class Follower:
    """A subscriber that follows the stream from position 0 as it is written: it keeps
    up, so it sees every record before retention removes it (the reference)."""

    def __init__(self, address: str, stream: str) -> None:
        self.client = ControllerClient(address, timeout_s=10)
        self.seen: list[tuple[int, str]] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream: str) -> None:
        try:
            for seq, rec in self.client.subscribe(stream, 0, follow=True):
                self.seen.append((seq, rec.value.decode()))
        except BaseException as exc:  # noqa: BLE001 - ends with close(); kept for the test to see
            self.error = exc

    def close(self) -> None:
        self.client.close()
        self._thread.join(10)


def keep_injecting(address: str, stop: threading.Event, sent: list[str]) -> None:
    """400 records a second, with IDs of their own, until ``stop`` (its own client)."""
    with ControllerClient(address, timeout_s=30) as client:
        i = 0
        while not stop.is_set():
            batch = [Record(f"k{j % 7}", f"v{j}".encode(), 1_000 * S + j, f"ev-{j:06d}") for j in range(i, i + 40)]
            client.inject(inject_messages("events", "events", batch, batch=40))
            sent += [r.value.decode() for r in batch]
            i += 40
            time.sleep(0.1)


def oldest_named(message: str) -> int:
    found = re.search(r"through position (\d+), the oldest available position", message)
    assert found, message
    return int(found.group(1))


def test_subscribe_from_a_trimmed_position_is_out_of_range_and_the_rest_is_whole(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    stop = threading.Event()
    sent: list[str] = []
    follower: Follower | None = None
    injector = threading.Thread(target=keep_injecting, args=(cluster.address, stop, sent), daemon=True)
    try:
        cluster.start_controller()
        cluster.start_worker()
        cluster.register(echo_topology())
        follower = Follower(cluster.address, "out")
        injector.start()

        def trimmed() -> LogTrimmedError | None:
            try:
                next(iter(cluster.client.subscribe("out", 0)))
            except LogTrimmedError as exc:
                return exc
            return None

        exc = wait_for(trimmed, 60, "the controller to trim the log of 'out'")
        assert injector.is_alive()  # trimmed while records keep flowing
        assert exc.status == grpc.StatusCode.OUT_OF_RANGE  # type: ignore[attr-defined]
        message = str(exc)
        oldest = oldest_named(message)
        assert oldest > 0 and f"--after {oldest}" in message and "from_oldest" in message

        # From the oldest available position: every record kept, in log order (it may
        # have moved on meanwhile: then the answer names the new one, never a gap).
        while True:
            try:
                kept = list(cluster.client.subscribe("out", oldest))
                break
            except LogTrimmedError as moved:
                oldest = oldest_named(str(moved))
        assert kept, "records are flowing: the log is not empty"
        assert kept[0][0] > oldest and [s for s, _r in kept] == sorted({s for s, _r in kept})
        wait_for(lambda: follower is not None and follower.seen and follower.seen[-1][0] >= kept[-1][0], 30,
                 "the follower to catch up")
        reference = [(s, value) for s, value in follower.seen if oldest < s <= kept[-1][0]]
        assert [(s, r.value.decode()) for s, r in kept] == reference
        assert follower.seen[0][0] <= oldest  # it saw what was removed before it went

        # The CLI says so and exits 2; --from-oldest reads what is kept.
        done = cli(cluster, "subscribe", "out", "--after", "0")
        assert done.returncode == 2
        assert "OUT_OF_RANGE" in done.stderr and "oldest available position" in done.stderr, done.stderr
        done = cli(cluster, "subscribe", "out", "--after", "0", "--from-oldest", "--json")
        assert done.returncode == 0, done.stderr
        printed = [json.loads(line) for line in done.stdout.splitlines()]
        assert printed and printed[0]["seq"] > oldest
        stop.set()
        injector.join(30)
        assert follower.error is None
        # Every record sent was logged once (the follower saw each, before it was removed).
        wait_for(lambda: len(follower.seen) >= len(sent), 30, "every record to reach the log")  # type: ignore[union-attr]
        assert sorted(value for _s, value in follower.seen) == sorted(sent)
        assert "log retention pass failed" not in cluster.log("controller")
    finally:
        stop.set()
        if follower is not None:
            follower.close()
        cluster.stop()


def bad_sums_topology() -> Topology:
    return Topology(
        computations=(ComputationSpec(
            "sums", (InputSpec("events", KeyExtractor("json:user")),), ("sums",),
            CodeRef("window_aggregate", {"size_us": 10 * S, "aggregation": "sum", "field": "amount"}),
            Options(key_ranges=1, max_attempts=1, log_retention_us=DEAD_LETTER_RETENTION_US)),),
        injectors=(InjectorSpec("events", "events"),),
    )


def bad(first: int, n: int) -> list[Record]:
    return [Record("raw", json.dumps({"user": "u", "amount": f"x{i}"}).encode(), 1_000 * S + i, f"bad-{i}")
            for i in range(first, first + n)]


def test_dead_letters_removed_by_retention_are_reported_and_the_kept_ones_replayed(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    try:
        cluster.start_controller()
        cluster.start_worker()
        cluster.register(bad_sums_topology())
        stream = "sums.dead_letters"
        cluster.inject("events", "events", bad(0, 20))
        wait_for(lambda: len(list(cluster.client.subscribe(stream))) == 20, 60, "20 dead letters")

        def gone() -> LogTrimmedError | None:
            try:
                list(cluster.client.subscribe(stream, 0))
            except LogTrimmedError as exc:
                return exc
            return None

        exc = wait_for(gone, 60, "retention to remove the first dead letters")
        assert "sums.dead_letters" in str(exc) and "oldest available position" in str(exc)
        cluster.inject("events", "events", bad(20, 5))

        def kept_with_new() -> list[str] | None:
            letters = [json.loads(r.value)["record_id"] for _s, r in cluster.client.subscribe(stream, from_oldest=True)]
            return letters if {f"bad-{i}" for i in range(20, 25)} <= set(letters) else None

        kept = wait_for(kept_with_new, 30, "the new dead letters")
        assert "bad-0" not in kept
        done = cli(cluster, "dead-letters", "replay", "sums", "--json")
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["expired_through"] > 0
        assert 5 <= result["replayed"] <= len(kept)  # the kept ones (the last 5 at least), once each
        done = cli(cluster, "dead-letters", "replay", "sums")
        assert done.returncode == 0 and "removed by the dead-letter stream's log retention" not in done.stdout
    finally:
        cluster.stop()
