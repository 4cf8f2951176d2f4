"""A dead-letter replay is bounded (issue 21, item 6), against real processes.

While the code still fails, each replayed record is dead-lettered again under a new
ID. The replay used to read the dead-letter stream until it found nothing more, so it
read its own new letters back (10 dead letters became 219), and it ran on in the
controller after the client's deadline. Here:

* a replay hands over the dead letters present when it started, exactly once each,
  and returns: 10 letters -> 10 handed over, 20 in the stream afterwards;
* a replay whose deadline passes (or whose call is cancelled) while no worker can take
  the records stops: a worker that joins afterwards receives nothing, and a later
  replay hands over all 10;
* a replay cut off half-way and retried hands over only what the first did not.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from millwheel.errors import MillWheelError
from millwheel.keys import KeyExtractor, key_range
from millwheel.record import Record, derive_record_id
from millwheel.runtime.failures import dead_letter_id
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, Options, Topology
from services.generated import millwheel_pb2 as pb
from services.generated import millwheel_pb2_grpc as pb_grpc
from tests.support.service_cluster import PIPELINE_CODE, Cluster, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
S = 1_000_000
STREAM = "calc.dead_letters"


def failing_topology(tmp_path: Path) -> Topology:
    """Doubler raises on ``"amount": "abc"`` until the flag file exists (it never does here)."""
    code = CodeRef("tests.support.pipelines:Doubler", {"fixed_flag": str(tmp_path / "never-fixed")})
    return Topology(
        computations=(ComputationSpec("calc", (InputSpec("events", KeyExtractor("json:user")),), ("doubled",),
                                      code, Options(key_ranges=2, max_attempts=1)),),
        injectors=(InjectorSpec("events", "events"),),
    )


#: Ten records the code fails on: users u0..u9, six in range 0 and four in range 1.
BAD = [Record("raw", json.dumps({"user": f"u{i}", "amount": "abc"}).encode(), 1_000 * S + i * S, f"bad-{i}")
       for i in range(10)]
FIRST_LETTERS = {dead_letter_id("calc", r.record_id) for r in BAD}


def letters(cluster: Cluster) -> list[tuple[str, dict[str, Any]]]:
    """The dead-letter stream as a user reads it: (letter ID, letter), in log order."""
    return [(r.record_id, json.loads(r.value)) for _seq, r in cluster.client.subscribe(STREAM)]


def second_letters(first: set[str]) -> set[str]:
    """The letters a replay of ``first`` writes while the code still fails: each replayed
    record's ID is derived from its letter's, and its own letter from that ID."""
    return {dead_letter_id("calc", derive_record_id("calc", "replay\x1f" + i, 0)) for i in first}


def ten_letters(cluster: Cluster, tmp_path: Path) -> None:
    cluster.register(failing_topology(tmp_path))
    cluster.wait_balanced()
    cluster.inject("events", "events", BAD, batch=5, done=True)
    wait_for(lambda: len(letters(cluster)) == 10, 60, "the 10 dead letters")
    assert {i for i, _l in letters(cluster)} == FIRST_LETTERS


def stays(cluster: Cluster, n: int, seconds: float) -> list[tuple[str, dict[str, Any]]]:
    """The stream, after checking it holds ``n`` letters throughout ``seconds``."""
    until = time.monotonic() + seconds
    while True:
        now = letters(cluster)
        assert len(now) == n, f"{len(now)} dead letters, expected {n}: the replay went on"
        if time.monotonic() > until:
            return now
        time.sleep(0.25)


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_a_replay_of_still_failing_code_hands_over_what_was_there_once(
        store: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    cluster: Cluster = request.getfixturevalue("cluster" if store == "sqlite" else "redis_service")
    cluster.start_worker()
    ten_letters(cluster, tmp_path)

    started = time.monotonic()
    resp = cluster.client.replay_dead_letters("calc", timeout_s=60)
    took = time.monotonic() - started
    assert (resp.replayed, resp.skipped, resp.remaining) == (10, 0, 0)  # 219 before
    assert took < 30
    wait_for(lambda: len(letters(cluster)) == 20, 30, "the 10 new dead letters")
    now = stays(cluster, 20, 3.0)
    assert {i for i, _l in now} == FIRST_LETTERS | second_letters(FIRST_LETTERS)
    # each new letter is one replayed record failing again, with its original content
    new = [letter for i, letter in now if i not in FIRST_LETTERS]
    assert sorted(letter["key"] for letter in new) == sorted(f"u{i}" for i in range(10))
    assert {letter["record_id"] for letter in new} == {
        derive_record_id("calc", "replay\x1f" + i, 0) for i in FIRST_LETTERS}
    assert cluster.client.describe("calc").dead_lettered == 20

    # a second replay takes the 10 present now, and again only those
    resp = cluster.client.replay_dead_letters("calc", timeout_s=60)
    assert (resp.replayed, resp.remaining) == (10, 0)
    wait_for(lambda: len(letters(cluster)) == 30, 30, "the next 10 dead letters")
    stays(cluster, 30, 2.0)


@pytest.mark.parametrize("ended_by", ["deadline", "cancel"])
def test_a_replay_stops_with_its_call(ended_by: str, cluster: Cluster, tmp_path: Path) -> None:
    worker = cluster.start_worker()
    ten_letters(cluster, tmp_path)
    worker.kill()
    worker.wait(10)
    wait_for(lambda: not any(w.alive for w in cluster.client.status().workers), 20, "the worker to be dead")

    started = time.monotonic()
    if ended_by == "deadline":
        with pytest.raises(MillWheelError) as err:  # no live worker owns the ranges
            cluster.client.replay_dead_letters("calc", timeout_s=2.0)
        assert time.monotonic() - started < 5
        assert "no live worker owns it" in str(err.value) and "10 remain" in str(err.value), err.value
        assert "stopped at its deadline" in cluster.log("controller")
    else:
        stub = cluster.client.link.stub(pb_grpc.ControllerStub, cluster.address)
        call = stub.ReplayDeadLetters.future(pb.ReplayDeadLettersRequest(computation="calc"), timeout=120)
        time.sleep(1.5)
        call.cancel()
        wait_for(lambda: "stopped: the call was cancelled" in cluster.log("controller"), 10,
                 "the controller to end the cancelled replay")

    # a worker that joins after the call ended is handed nothing: the replay ended with it
    cluster.start_worker()
    cluster.wait_balanced()
    stays(cluster, 10, 8.0)  # before: the controller kept trying for 30 s, then handed over
    assert cluster.outputs("doubled") == []

    resp = cluster.client.replay_dead_letters("calc", timeout_s=60)  # the retry does it all, once
    assert (resp.replayed, resp.remaining) == (10, 0)
    wait_for(lambda: len(letters(cluster)) == 20, 30, "the 10 new dead letters")
    assert {i for i, _l in stays(cluster, 20, 2.0)} == FIRST_LETTERS | second_letters(FIRST_LETTERS)


@pytest.fixture
def patient_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """Workers are declared dead only after 60 s: a stopped worker keeps its ranges."""
    c = Cluster(tmp_path, heartbeat_timeout_s=60, allow_code=PIPELINE_CODE)
    c.start_controller()
    try:
        yield c
    finally:
        c.stop()


def test_a_retried_replay_hands_over_nothing_twice(patient_cluster: Cluster, tmp_path: Path) -> None:
    cluster = patient_cluster
    workers = [cluster.start_worker(), cluster.start_worker()]
    ten_letters(cluster, tmp_path)
    [owner1] = [r.worker_id for r in cluster.client.status().ranges if (r.node, r.range_id) == ("calc", 1)]
    [stuck] = [w for w in workers if owner1.endswith(f"/{w.pid}")]
    in_range1 = {dead_letter_id("calc", r.record_id) for r in BAD if key_range(json.loads(r.value)["user"], 2) == 1}
    assert len(in_range1) == 4

    os.kill(stuck.pid, signal.SIGSTOP)  # range 1's owner takes nothing; range 0's does
    try:
        with pytest.raises(MillWheelError) as err:
            cluster.client.replay_dead_letters("calc", timeout_s=4.0)
        assert "calc/1" in str(err.value) and "6 of 10" in str(err.value), err.value
        wait_for(lambda: len(letters(cluster)) == 16, 30, "range 0's 6 replayed records dead-lettered again")
    finally:
        os.kill(stuck.pid, signal.SIGCONT)

    resp = cluster.client.replay_dead_letters("calc", timeout_s=60)
    assert (resp.replayed, resp.remaining) == (4, 0)  # range 1's only, not range 0's again
    wait_for(lambda: len(letters(cluster)) == 20, 30, "range 1's replayed records dead-lettered again")
    assert {i for i, _l in stays(cluster, 20, 3.0)} == FIRST_LETTERS | second_letters(FIRST_LETTERS)
    resp = cluster.client.replay_dead_letters("calc", timeout_s=60)  # the 10 new ones, once
    assert (resp.replayed, resp.remaining) == (10, 0)
