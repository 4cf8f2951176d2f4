"""Inject backpressure: a pipeline slower than its injector slows the injector down.

The injector's outbox is bounded (``worker --max-injector-outbox``): while it is full,
Inject holds the client's stream; past ``controller --inject-wait`` it answers
RESOURCE_EXHAUSTED with a retry hint, which the client honours. Nothing is dropped,
nothing is doubled, and the outbox never grows far past its bound. Every message
carries the injector watermark and the stage drops late records, so a message taken
out of order (after a later one's watermark) would lose records.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from millwheel.computation import Computation, Context
from millwheel.record import Record
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, LatePolicy, Options, Topology
from services.client import inject_messages
from tests.support.service_cluster import Cluster, wait_for

pytestmark = pytest.mark.timeout(180)
LIMIT = 100  # injector outbox bound, records
BATCH = 50  # records per Inject message
N = 1200


class Slow(Computation):
    """Forwards each record after 2 ms of "work": ~500 records/s, far below injection."""

    def process_record(self, ctx: Context, record: Record) -> None:
        time.sleep(0.002)
        ctx.produce("out", record.key, record.value, record.timestamp)


def topology() -> Topology:
    return Topology(
        computations=(ComputationSpec("slow", (InputSpec("events"),), ("out",),
                                      CodeRef(f"{__name__}:Slow"),
                                      Options(key_ranges=1, late_policy=LatePolicy.DROP)),),
        injectors=(InjectorSpec("events", "events"),),
    )


@pytest.fixture
def cluster(tmp_path: Path):
    c = Cluster(tmp_path, controller_args=["--inject-wait", "0.1"], allow_code=__name__)
    c.start_controller()
    c.start_worker("--max-injector-outbox", str(LIMIT), "--batch-size", "100")
    c.register(topology())
    c.wait_balanced()
    try:
        yield c
    finally:
        c.stop()


def records(n: int, prefix: str = "r") -> list[Record]:
    return [Record(f"k{i % 7}", f"{prefix}{i}".encode(), 1_000_000 + i, f"{prefix}{i}") for i in range(n)]


def out_ids(c: Cluster) -> list[str]:
    """The input record each output came from (outputs carry their input's value)."""
    return [r.value.decode() for _seq, r in c.client.subscribe("out")]


def test_slow_pipeline_slows_its_injector_and_loses_nothing(cluster: Cluster) -> None:
    sent = records(N)
    started = time.monotonic()
    resp = cluster.client.inject(inject_messages("events", "events", sent, BATCH, 0, done=True))
    took = time.monotonic() - started
    assert resp.accepted == N
    # The injector was held back to the pipeline's pace: when Inject returned, all but
    # about one outbox's worth of records had been processed downstream.
    assert len(out_ids(cluster)) >= N - LIMIT - BATCH
    assert took > 1.0  # 1200 records at ~500/s; unthrottled injection takes ~0.1 s
    assert cluster.client.busy_retries > 0  # refused past --inject-wait, then resent
    cluster.wait_watermark("slow", timeout=60)
    assert sorted(out_ids(cluster)) == sorted(r.record_id for r in sent)  # none lost or doubled
    metrics = _metrics(cluster)
    assert 'millwheel_backpressure_seconds_total{destination="injector:events"}' in metrics


def test_refusal_says_retry_after_and_how_many_messages_got_in(cluster: Cluster) -> None:
    msgs = list(inject_messages("events", "events", records(600, "x"), BATCH, 0))
    with pytest.raises(grpc.RpcError) as info:
        cluster.client.stub.Inject(iter(msgs), timeout=30)
    err = info.value
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "is busy" in err.details() and f"limit {LIMIT}" in err.details()
    meta = dict(err.trailing_metadata())
    accepted = int(meta["accepted-messages"])
    assert int(meta["retry-after-ms"]) > 0
    assert 0 < accepted < len(msgs)
    # Exactly the acknowledged messages got in; resending the rest completes the input.
    rest = cluster.client.inject(msgs[accepted:])
    assert rest.accepted == sum(len(m.records) for m in msgs[accepted:])
    wait_for(lambda: len(out_ids(cluster)) == 600, 60, "all 600 records downstream")
    assert sorted(out_ids(cluster)) == sorted(f"x{i}" for i in range(600))


def _metrics(c: Cluster) -> str:
    """The controller's /metrics (its port is in its log line)."""
    import re
    import urllib.request

    port = re.search(r"metrics port (\d+)", c.log("controller"))
    assert port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics", timeout=5) as resp:
        return str(resp.read().decode())
