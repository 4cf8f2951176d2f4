"""session_window, interval_join, window_top, window_join and stream_join in service
mode with a worker killed (kill -9) mid-stream: the outputs equal a failure-free
service run's record by record, and the plain-Python references
(tests/support/operator_refs.py, tests/support/window_refs.py).

The run has two phases, so every output is determined by the data, not by when a
watermark happened to reach a worker: phase 1 injects on-time records (within the
injectors' disorder bound; the kill happens here); once every session ending before
the phase-1 watermark W has been produced and the join's watermark is at W, phase 2
injects late records (within the 60 s lateness of W, many bridging or widening
produced sessions, and some beyond it, routed to the late streams) with no watermark;
once their corrections are visible, both injectors are closed.

Session results carry deterministic IDs (a record's or a timer's), so they are
compared with their IDs. A joined record's ID is that of whichever of its two records
arrived second, which the order of two injectors' deliveries decides in any run:
joined records are compared by key, value and timestamp, and each ID appears once. So
are a window's top records and window-joined pairs produced at its end: their IDs are
the end timer's and their order in it (ties, pairs) is the records' arrival order, which
a redelivery after the kill may change.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from millwheel.record import MAX_TIMESTAMP, Record
from millwheel.topology import CodeRef, ComputationSpec, InjectorSpec, InputSpec, LatePolicy, Options, Topology
from services.generated import millwheel_pb2 as pb
from tests.support import operator_refs as ref
from tests.support import window_refs as wref
from tests.support.operator_refs import DISORDER, LATENESS, S
from tests.support.service_cluster import Cluster, wait_for

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]
GAP, LOWER, UPPER = 5 * S, -5 * S, 10 * S
SIZE = 10 * S  # window_top's and window_join's windows
NODES = ("sess", "join", "top", "wjoin", "sjoin")
UNBOUNDED = 10**18
FAULT_AT = 4  # kill after this many inject messages of phase 1


def topology() -> Topology:
    def opts(late: str) -> Options:
        return Options(key_ranges=3, allowed_lateness_us=LATENESS, late_policy=LatePolicy.ROUTE, late_stream=late)
    return Topology((
        ComputationSpec("sess", (InputSpec("a"),), ("sess-out",),
                        CodeRef("session_window", {"gap_us": GAP, "aggregation": "sum", "field": "x"}),
                        opts("sess-late")),
        ComputationSpec("join", (InputSpec("a"), InputSpec("b")), ("join-out",),
                        CodeRef("interval_join", {"lower_us": LOWER, "upper_us": UPPER}), opts("join-late")),
        ComputationSpec("top", (InputSpec("a"),), ("top-out",),
                        CodeRef("window_top", {"size_us": SIZE, "field": "x"}), opts("top-late")),
        ComputationSpec("wjoin", (InputSpec("a"), InputSpec("b")), ("wjoin-out",),
                        CodeRef("window_join", {"size_us": SIZE}), opts("wjoin-late")),
        ComputationSpec("sjoin", (InputSpec("a"), InputSpec("b")), ("sjoin-out",),
                        CodeRef("stream_join", {}), opts("sjoin-late")),
    ), (InjectorSpec("ia", "a"), InjectorSpec("ib", "b")))


def top_outputs(a1: list[Record], a2: list[Record], wm_a: int
                ) -> tuple[list[tuple[str, bytes, int]], int, set[tuple[str, int]]]:
    """window_top's records (key, value, timestamp), sorted; how many of them are out
    before the injectors close; and the windows left out of both.

    Out before the close: the tops of the windows the phase-1 watermark closed, then
    each accepted late record of such a window at least its maximum so far (the
    operator's rule); at the close, the tops of the others. Left out: windows the
    watermark had closed with no phase-1 record, opened by a late record. What they
    produce depends on how their late records were batched (a batch's records update
    the window before its end timer, already due, fires), so only their final tops
    are compared."""
    fired = {w: v for w, v in wref.tops(a1, SIZE, "x").items() if w[1] < wm_a}
    out = [(w[0], v, w[1]) for w, vs in fired.items() for v in vs]
    top = {w: json.loads(vs[0])["x"] for w, vs in fired.items()}
    opened_late = set()
    for r in a2:
        w = (r.key, wref.start_of(r.timestamp, SIZE) + SIZE - 1)
        x = json.loads(r.value)["x"]
        if w[1] < wm_a and w not in fired:
            opened_late.add(w)
        elif w[1] < wm_a and x >= top[w]:
            top[w] = x
            out.append((r.key, r.value, w[1]))
    before_close = len(out)
    out += [(w[0], v, w[1]) for w, vs in wref.tops(a1 + a2, SIZE, "x").items() if w[1] >= wm_a for v in vs]
    return sorted(out), before_close, opened_late


def without(records: list[Record], windows: set[tuple[str, int]]) -> list[Record]:
    return [r for r in records if (r.key, r.timestamp) not in windows]


def workload() -> tuple[list[Record], list[Record], list[Record], list[Record], int]:
    """(phase-1 A, phase-1 B, phase-2 A, phase-2 B, the phase-1 watermark W)."""
    a1, _ = ref.timeline(11, 400, "a", late=False, beyond_too=False)
    b1, _ = ref.timeline(12, 400, "b", keys=4, late=False, beyond_too=False)
    w = min(max(r.timestamp for r in a1), max(r.timestamp for r in b1)) - DISORDER
    rng = random.Random(13)
    phase2: dict[str, list[Record]] = {"a": [], "b": []}
    for side in ("a", "b"):
        for i in range(40):
            behind = rng.randint(200 * S, 300 * S) if i % 8 == 0 else rng.randint(10 * S, 40 * S)
            phase2[side].append(Record(f"k{rng.randrange(4)}", json.dumps({"x": rng.randint(-50, 50)}).encode(),
                                       w - behind, f"{side}-late-{i}"))
    return a1, b1, phase2["a"], phase2["b"], w


def read(cluster: Cluster, stream: str) -> list[Record]:
    return [r for _seq, r in cluster.client.subscribe(stream)]


def send(cluster: Cluster, injector: str, stream: str, records: list[Record], watermark: bool,
         between: Any = None) -> None:
    cluster.inject(injector, stream, records, batch=40, max_disorder_us=DISORDER if watermark else None,
                   between=between)


def run(tmp_path: Path, kill: bool) -> dict[str, list[Record]]:
    a1, b1, a2, b2, w = workload()
    tmp_path.mkdir()
    cluster = Cluster(tmp_path)
    try:
        cluster.start_controller()
        workers = [cluster.start_worker() for _ in range(3)]
        cluster.register(topology())
        cluster.wait_balanced()
        victim = cluster.worker_id(workers[1])

        def between(i: int) -> None:
            time.sleep(0.05)
            if kill and i == FAULT_AT:
                assert victim is not None and any(
                    node in NODES for node, _r, _t in cluster.ranges_of(victim)), "it runs a range"
                os.kill(workers[1].pid, signal.SIGKILL)

        send(cluster, "ia", "a", a1, True, between)
        send(cluster, "ib", "b", b1, True)
        # Phase 1 is done once every session ending before W is out and the join is at W.
        wm_a = max(r.timestamp for r in a1) - DISORDER  # the session computation's input watermark
        fired = {k for k in ref.sessions(a1, GAP, "sum") if k[2] - 1 < wm_a}
        wait_for(lambda: len(read(cluster, "sess-out")) >= len(fired), 120, "phase-1 sessions")
        assert len(read(cluster, "sess-out")) == len(fired)
        # window_top, the same: every window ending before the phase-1 watermark is out.
        fired_tops = sum(len(v) for w, v in wref.tops(a1, SIZE, "x").items() if w[1] < wm_a)
        wait_for(lambda: len(read(cluster, "top-out")) >= fired_tops, 120, "phase-1 window tops")
        assert len(read(cluster, "top-out")) == fired_tops
        cluster.wait_watermark("join", at_least=w, timeout=120)
        send(cluster, "ia", "a", a2, False)
        send(cluster, "ib", "b", b2, False)
        accepted_a = a1 + [r for r in a2 if r.timestamp + LATENESS >= w]  # phase 1 is on time
        accepted_b = b1 + [r for r in b2 if r.timestamp + LATENESS >= w]
        pairs = ref.joined(accepted_a, accepted_b, LOWER, UPPER)
        all_pairs = ref.joined(accepted_a, accepted_b, -UNBOUNDED, UNBOUNDED)
        window_pairs = wref.window_pairs(accepted_a, accepted_b, SIZE)
        due_window_pairs = [p for p in window_pairs if p[-1] < w]  # windows the watermark W closed
        tops, due_tops, opened_late = top_outputs(a1, accepted_a[len(a1):], wm_a)
        everything = ref.sessions(accepted_a, GAP, "sum")
        due = {k: v for k, v in everything.items() if k[2] - 1 < wm_a}
        # A session ending at or after W is produced when the injectors close: until then
        # what was produced of its parts stands.
        open_ = [k for k in everything if k[2] - 1 >= wm_a]

        def corrected() -> bool:
            got = {k: v for k, v in ref.final_sessions(read(cluster, "sess-out")).items()
                   if not any(k[0] == o[0] and o[1] <= k[1] and k[2] <= o[2] for o in open_)}
            seen.update(joined=len(read(cluster, "join-out")), pairs=len(pairs),
                        sessions_missing=sorted(set(due.items()) - set(got.items()))[:3],
                        sessions_extra=sorted(set(got.items()) - set(due.items()))[:3],
                        tops=(len(without(read(cluster, "top-out"), opened_late)), due_tops),
                        window_pairs=(len(read(cluster, "wjoin-out")), len(due_window_pairs)),
                        all_pairs=(len(read(cluster, "sjoin-out")), len(all_pairs)))
            return (seen["joined"] >= len(pairs) and got == due and seen["tops"][0] >= due_tops
                    and seen["window_pairs"][0] >= len(due_window_pairs)
                    and seen["all_pairs"][0] >= len(all_pairs))

        seen: dict[str, Any] = {}
        try:
            wait_for(corrected, float(os.environ.get('OPS_WAIT', 120)), "phase-2 corrections")
        except AssertionError:
            raise AssertionError(f"phase 2 not as expected: {seen}") from None
        for injector, stream in (("ia", "a"), ("ib", "b")):
            cluster.client.inject([pb.InjectRequest(injector=injector, stream=stream, done=True)])
        for node in NODES:
            cluster.wait_watermark(node, at_least=MAX_TIMESTAMP, timeout=120)
        out = {s: read(cluster, s) for node in NODES for s in (f"{node}-out", f"{node}-late")}
        # Against the reference: every session, every pair, the records beyond lateness routed.
        assert ref.final_sessions(out["sess-out"]) == ref.sessions(accepted_a, GAP, "sum")
        assert ref.join_outputs(out["join-out"]) == pairs
        assert sorted(r.value for r in out["sess-late"]) == sorted(
            r.value for r in a2 if r.timestamp + LATENESS < w)
        assert len(out["join-late"]) == len([r for r in a2 + b2 if r.timestamp + LATENESS < w])
        assert sorted((r.key, r.value, r.timestamp) for r in without(out["top-out"], opened_late)) == tops
        assert wref.final_tops(out["top-out"], "x") == wref.tops(accepted_a, SIZE, "x")
        assert wref.window_join_outputs(out["wjoin-out"]) == window_pairs
        assert ref.join_outputs(out["sjoin-out"]) == all_pairs
        for node in ("top", "wjoin", "sjoin"):
            assert sorted(r.value for r in out[f"{node}-late"]) == sorted(
                r.value for r in (a2 if node == "top" else a2 + b2) if r.timestamp + LATENESS < w), node
        for stream, records in out.items():
            assert len({r.record_id for r in records}) == len(records), stream
        if kill:
            assert workers[1].wait(5) == -signal.SIGKILL
        out["top-out"] = without(out["top-out"], opened_late)  # their final tops are checked above
        return out
    finally:
        cluster.stop()


def test_kill9_mid_stream_equals_a_failure_free_run(tmp_path: Path) -> None:
    clean = run(tmp_path / "clean", kill=False)
    crashed = run(tmp_path / "crash", kill=True)

    def full(records: list[Record]) -> list[tuple[str, bytes, int, str]]:
        return sorted((r.key, r.value, r.timestamp, r.record_id) for r in records)

    def no_ids(records: list[Record]) -> list[tuple[str, bytes, int]]:
        return sorted((r.key, r.value, r.timestamp) for r in records)

    for stream in ("sess-out", "sess-late", "join-late", "top-late", "wjoin-late", "sjoin-late"):
        assert full(crashed[stream]) == full(clean[stream]), stream
    for stream in ("join-out", "top-out", "wjoin-out", "sjoin-out"):
        assert no_ids(crashed[stream]) == no_ids(clean[stream]), stream
    late_tops = len(clean["top-out"]) - sum(len(v) for v in wref.final_tops(clean["top-out"], "x").values())
    assert late_tops > 3, "phase 2 reached produced window maxima"
    corrections = len(clean["sess-out"]) - len(ref.final_sessions(clean["sess-out"]))
    assert corrections > 5, "phase 2 corrected or merged produced sessions"
    print(f"sessions {len(clean['sess-out'])} (corrections {corrections}), joined {len(clean['join-out'])}, "
          f"tops {len(clean['top-out'])} (late {late_tops}), window pairs {len(clean['wjoin-out'])}, "
          f"stream pairs {len(clean['sjoin-out'])}")
