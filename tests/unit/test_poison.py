"""The error policy (millwheel.runtime.poison, its bookkeeping millwheel.runtime.failures):
a record or timer whose code raises is retried up to max_attempts, isolated from its
batch, and then dead-lettered (exactly once, in the checkpoint of its consumed ID),
skipped, or left failing (on_error fail)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from millwheel.clock import ManualClock
from millwheel.errors import UserCodeError
from millwheel.record import Record, timer_cause
from millwheel.runtime import failures, poison
from millwheel.runtime.context import RangeTransaction
from millwheel.runtime.crash import CrashSchedule, SimulatedCrash
from millwheel.runtime.local_runner import LocalRunner
from millwheel.runtime.range_worker import RangeWorker
from millwheel.runtime.routing import Router
from millwheel.sensors import CountingSensors
from millwheel.sources import ListSource
from millwheel.state.sqlite_store import SQLiteStore
from millwheel.topology import (
    CodeRef,
    ComputationSpec,
    ErrorPolicy,
    InjectorSpec,
    InputSpec,
    Options,
    Topology,
)
from tests.support.faulty import Doubler, Flaky

S = 1_000_000
DOUBLER = CodeRef("tests.support.faulty:Doubler")
Rows = list[tuple[str, bytes, int, str]]


def amounts(n: int, bad: dict[int, object] | None = None) -> list[Record]:
    """``n`` records, keys k0..k3; those listed in ``bad`` carry that amount instead."""
    bad = bad or {}
    return [Record(f"k{i % 4}", json.dumps({"amount": bad.get(i, i)}).encode(), i * S, f"r{i}")
            for i in range(n)]


def topology(code: CodeRef = DOUBLER, outputs: tuple[str, ...] = ("doubled",), key: str = "key",
             **options: object) -> Topology:
    opts = Options(key_ranges=2, **options)  # type: ignore[arg-type]
    return Topology(
        (ComputationSpec("calc", (InputSpec("in", poison_key(key)),), outputs, code, opts),),
        (InjectorSpec("src", "in"),),
    )


def poison_key(spec: str):  # type: ignore[no-untyped-def]
    from millwheel.keys import KeyExtractor

    return KeyExtractor(spec)


def run(path: Path, topo: Topology, records: list[Record], crash=None) -> SQLiteStore:  # type: ignore[no-untyped-def]
    store = SQLiteStore(path)
    kwargs = {"crash": crash} if crash else {}
    LocalRunner(topo, store, {"src": ListSource(records, 0)}, batch_size=7, **kwargs).run()
    return store


def log_of(store: SQLiteStore, stream: str) -> Rows:
    return sorted((r.key, r.value, r.timestamp, r.record_id) for _s, r in store.read_log(stream, 0, 10**6))


def letters(store: SQLiteStore, stream: str = "calc.dead_letters") -> list[dict[str, object]]:
    return [json.loads(r.value) for _s, r in store.read_log(stream, 0, 10**6)]


Errors = tuple[dict[str, int], dict[str, int], list[dict[str, object]]]


def errors(store: SQLiteStore, computation: str = "calc") -> Errors:
    attempts: dict[str, int] = {}
    counters: dict[str, int] = {}
    recent: list[dict[str, object]] = []
    for r in range(2):
        report = store.read_errors(computation, r)
        attempts.update({i: n for i, (n, _e) in report.attempts.items()})
        for name, n in report.counters.items():
            counters[name] = counters.get(name, 0) + n
        recent += [json.loads(e) for e in report.recent]
    return attempts, counters, recent


# -- records -----------------------------------------------------------------------------

def test_a_poison_record_is_dead_lettered_once_and_the_rest_equals_a_run_without_it(tmp_path: Path) -> None:
    records = amounts(30, bad={11: "abc"})
    store = run(tmp_path / "a.db", topology(), records)
    clean = run(tmp_path / "b.db", topology(), [r for r in records if r.record_id != "r11"])
    assert log_of(store, "doubled") == log_of(clean, "doubled")
    [letter] = letters(store)
    assert letter["record_id"] == "r11" and letter["key"] == "k3" and letter["timestamp"] == 11 * S
    assert letter["value"] == '{"amount": "abc"}' and letter["attempts"] == 3
    assert letter["exception_type"] == "ValueError" and "abc" in str(letter["message"])
    assert letter["computation"] == "calc" and letter["traceback"]
    assert "faulty.py" in str(letter["traceback"][-1])  # type: ignore[index]
    [(dl_id)] = [r.record_id for _s, r in store.read_log("calc.dead_letters", 0, 10)]
    assert dl_id == failures.dead_letter_id("calc", "r11")
    attempts, counters, recent = errors(store)
    assert attempts == {}  # resolved in the dead letter's checkpoint
    assert counters == {"dead_lettered": 1}
    assert [(e["record_id"], e["attempts"], e["outcome"]) for e in recent] == [("r11", 3, "dead_letter")]


def test_a_failing_expression_is_recorded_under_its_own_error(tmp_path: Path) -> None:
    """A filter expression is the user's code: 1 / 0 on one record's data is a
    ZeroDivisionError (as in Python code), not an invalid spec."""
    filt = CodeRef("filter", {"expr": "100 / (json['amount'] - 5) > 0"})
    store = run(tmp_path / "a.db", topology(filt, outputs=("kept",)), amounts(8))
    [letter] = letters(store)
    assert letter["record_id"] == "r5" and letter["exception_type"] == "ZeroDivisionError"
    assert letter["message"] == "filter expr \"100 / (json['amount'] - 5) > 0\" failed on record r5: division by zero"
    assert sorted(json.loads(r[1])["amount"] for r in log_of(store, "kept")) == [6, 7]


def test_a_non_utf8_value_is_kept_in_base64(tmp_path: Path) -> None:
    records = [*amounts(5), Record("k9", b"\xff\xfe", 7 * S, "bin")]
    store = run(tmp_path / "a.db", topology(), records)
    [letter] = letters(store)
    assert letter["value_base64"] == "//4=" and "value" not in letter
    assert failures.letter_record(letter) == records[-1]


def range_worker(store: SQLiteStore, code: object, **options: object) -> RangeWorker:
    topo = topology(**options)
    spec = topo.computations[0]
    return RangeWorker(spec, 0, store, code, Router(topo), ManualClock(1_000), CountingSensors())  # type: ignore[arg-type]


def test_good_records_are_checkpointed_before_the_poison_record_is_retried(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "s.db")
    rw = range_worker(store, Doubler())
    commits: list[RangeTransaction] = []

    def commit(txn: RangeTransaction) -> None:
        commits.append(txn)
        rw.commit(txn)

    batch = [r for r in amounts(12, bad={5: "x"})]
    poison.process_batch(rw, batch, 0, commit)
    good = [r.record_id for r in batch if r.record_id != "r5"]
    # first checkpoint: every good record, nothing of the poison one
    assert commits[0].consumed_ids == good and len(commits[0].productions) == len(good)
    assert "r5" not in commits[0].resolved
    # last checkpoint: the poison record given up, consumed and dead-lettered together
    last = commits[-1]
    assert (last.consumed_ids, last.resolved, last.counters) == (["r5"], ["r5"], {"dead_lettered": 1})
    assert [p.stream for p in last.productions] == ["calc.dead_letters"]
    assert len(commits) == 2
    # sent again (the ack was lost): all duplicates, no second dead letter
    commits.clear()
    poison.process_batch(rw, batch, 0, commit)
    assert all(not c.productions for c in commits)


def test_a_transient_failure_succeeds_on_retry_and_clears_its_count(tmp_path: Path) -> None:
    Flaky.runs.clear()
    code = CodeRef("tests.support.faulty:Flaky", {"flaky_ids": ["r4"], "failures": 2})
    store = run(tmp_path / "a.db", topology(code), amounts(10))
    clean = run(tmp_path / "b.db", topology(), amounts(10))
    assert log_of(store, "doubled") == log_of(clean, "doubled")
    assert letters(store) == []
    assert Flaky.runs["r4"] == 3
    assert errors(store)[0] == {}


def test_skip_drops_and_counts(tmp_path: Path) -> None:
    records = amounts(20, bad={3: "?", 9: None})
    store = run(tmp_path / "a.db", topology(on_error=ErrorPolicy.SKIP, max_attempts=2), records)
    clean = run(tmp_path / "b.db", topology(), [r for r in records if r.record_id not in ("r3", "r9")])
    assert log_of(store, "doubled") == log_of(clean, "doubled")
    assert "calc.dead_letters" not in topology(on_error=ErrorPolicy.SKIP).logged_streams()
    assert log_of(store, "calc.dead_letters") == []
    attempts, counters, recent = errors(store)
    assert counters == {"skipped": 2} and attempts == {}
    assert sorted((e["record_id"], e["attempts"], e["outcome"]) for e in recent) == [
        ("r3", 2, "skipped"), ("r9", 2, "skipped")]


def test_fail_stops_and_counts_every_attempt(tmp_path: Path) -> None:
    topo = topology(on_error=ErrorPolicy.FAIL)
    with pytest.raises(UserCodeError, match="record r2"):
        run(tmp_path / "a.db", topo, amounts(6, bad={2: "no"}))
    with pytest.raises(UserCodeError, match="record r2"):  # a restart fails again, counted on
        run(tmp_path / "a.db", topo, amounts(6, bad={2: "no"}))
    store = SQLiteStore(tmp_path / "a.db")
    attempts, counters, _ = errors(store)
    assert attempts == {"r2": 2} and counters == {}
    assert log_of(store, "calc.dead_letters") == []


def test_a_custom_dead_letter_stream_and_max_attempts_one(tmp_path: Path) -> None:
    Flaky.runs.clear()
    code = CodeRef("tests.support.faulty:Flaky", {"flaky_ids": ["r1"], "failures": 5})
    store = run(tmp_path / "a.db", topology(code, dead_letter_stream="bad", max_attempts=1), amounts(4))
    assert [(x["record_id"], x["attempts"]) for x in letters(store, "bad")] == [("r1", 1)]
    assert Flaky.runs["r1"] == 1


def test_a_record_the_watchdog_counted_out_is_dead_lettered_without_running(tmp_path: Path) -> None:
    """The seam for a batch killed mid-run: its attempts are counted from outside; below
    max_attempts the record runs again, at max_attempts the range gives it up with that
    cause, its code never running again."""
    store = SQLiteStore(tmp_path / "s.db")
    Flaky.runs.clear()
    rw = range_worker(store, Flaky(["r2", "r3"], failures=0))  # would succeed: counts runs
    r0, r1, r2, r3 = amounts(4)
    poison.record_failure(store, "calc", 0, rw.token, "r2", key="k2", exc_type="DeadlineExceeded",
                          message="ran over max_batch_seconds")
    rw.rollback()  # (a new owner reads the counts when it takes the range)
    assert rw.failing == {"r2": 1}
    poison.process_batch(rw, [r0, r2], 0, rw.commit)
    assert Flaky.runs["r2"] == 1 and rw.failing == {}  # ran, succeeded: count cleared
    assert store.read_errors("calc", 0).attempts == {}
    assert poison.record_failure(store, "calc", 0, rw.token, "r3", key="k3", exc_type="DeadlineExceeded",
                                 message="ran over max_batch_seconds alone", at_least=3) == 3
    rw.rollback()
    poison.process_batch(rw, [r1, r3], 0, rw.commit)
    assert Flaky.runs["r3"] == 0
    last = store.read_outbox("calc", 0)[-1]
    assert last.stream == "calc.dead_letters"
    letter = json.loads(last.record.value)
    assert (letter["record_id"], letter["exception_type"], letter["message"], letter["attempts"]) == (
        "r3", "DeadlineExceeded", "ran over max_batch_seconds alone", 3)
    assert [p.record.record_id for p in store.read_outbox("calc", 0)].count(last.record.record_id) == 1


def test_late_records_dropped_by_the_late_policy_are_counted(tmp_path: Path) -> None:
    from millwheel.topology import LatePolicy

    records = amounts(40)
    late = [Record("k1", b'{"amount": 1}', 0, f"late-{i}") for i in range(3)]  # far behind the watermark
    source = ListSource([*records, *late], 0)
    store = SQLiteStore(tmp_path / "a.db")
    LocalRunner(topology(late_policy=LatePolicy.DROP), store, {"src": source}, batch_size=40).run()
    assert errors(store)[1] == {"late_dropped": 3, "late:dropped:in": 3}  # the total, and per input


# -- key extraction ------------------------------------------------------------------------

def test_a_record_whose_key_cannot_be_extracted_is_dead_lettered_by_its_consumer(tmp_path: Path) -> None:
    good = [Record("raw", json.dumps({"user": f"u{i % 3}", "amount": i}).encode(), i * S, f"r{i}") for i in range(12)]
    bad = Record("raw", b"not json", 5 * S, "bad")
    store = run(tmp_path / "a.db", topology(key="json:user"), [*good[:6], bad, *good[6:]])
    clean = run(tmp_path / "b.db", topology(key="json:user"), good)
    assert log_of(store, "doubled") == log_of(clean, "doubled")
    [letter] = letters(store)
    assert (letter["record_id"], letter["key"], letter["stage"], letter["attempts"]) == (
        "bad", "raw", "key_extraction", 3)
    assert letter["exception_type"] == "InvalidSpecError" and "'user'" in str(letter["message"])
    assert failures.letter_record(letter) is None  # replay cannot key it either


# -- timers -----------------------------------------------------------------------------------

def test_a_failing_timer_is_dead_lettered_and_the_others_fire(tmp_path: Path) -> None:
    code = CodeRef("tests.support.faulty:TimerPerRecord", {"bad_keys": ["k1"]})
    records = amounts(16)
    store = run(tmp_path / "a.db", topology(code, outputs=("fired",)), records)
    fired = sorted(r.value.decode() for _s, r in store.read_log("fired", 0, 100))
    assert fired == sorted(f"fired:{r.record_id}" for r in records if r.key != "k1")
    got = sorted((x["key"], x["timer"]["tag"], x["attempts"]) for x in letters(store))  # type: ignore[index]
    assert got == sorted(("k1", r.record_id, 3) for r in records if r.key == "k1")
    ids = {r.record_id for _s, r in store.read_log("calc.dead_letters", 0, 100)}
    assert len(ids) == 4
    assert errors(store)[0] == {} and errors(store)[1] == {"dead_lettered": 4}
    from millwheel.record import Timer
    assert failures.dead_letter_id("calc", timer_cause(Timer("k1", "r1", 1 * S))) in ids


# -- crashes while isolating -------------------------------------------------------------------

@pytest.mark.parametrize("point", [
    "after_attempt:1", "after_attempt:2", "after_attempt:3", "after_isolated_commit:1",
    "after_give_up:1", "after_checkpoint:3", "after_checkpoint:4", "after_user_code:3",
])
def test_a_crash_while_isolating_still_gives_exactly_once(tmp_path: Path, point: str) -> None:
    records = amounts(30, bad={11: "abc", 20: "def"})
    topo = topology()
    name, _, n = point.partition(":")
    schedule = CrashSchedule(name, int(n))
    with pytest.raises(SimulatedCrash):
        run(tmp_path / "a.db", topo, records, crash=schedule)
    store = run(tmp_path / "a.db", topo, records)  # a new runner resumes from the store
    want = run(tmp_path / "b.db", topo, records)
    assert log_of(store, "doubled") == log_of(want, "doubled")
    assert [x["record_id"] for x in letters(store)] == [x["record_id"] for x in letters(want)]
    assert sorted(r.record_id for _s, r in store.read_log("calc.dead_letters", 0, 10)) == sorted(
        failures.dead_letter_id("calc", i) for i in ("r11", "r20"))
    assert errors(store)[1] == {"dead_lettered": 2}


# -- logs ---------------------------------------------------------------------------------------

def test_repeated_tracebacks_are_logged_once_a_minute_with_a_count(caplog: pytest.LogCaptureFixture) -> None:
    limiter = failures.RateLimitedLog(logging.getLogger("test.poison"), period_s=60)
    with caplog.at_level(logging.ERROR, logger="test.poison"):
        assert limiter.report(("c", "ValueError", "f.py:1"), "boom", "trace")
        for _ in range(250):
            assert not limiter.report(("c", "ValueError", "f.py:1"), "boom", "trace")
        assert limiter.report(("c", "KeyError", "f.py:1"), "other", "trace")  # a distinct error
        limiter._seen[("c", "ValueError", "f.py:1")].last_full -= 61  # a minute later
        assert limiter.report(("c", "ValueError", "f.py:1"), "boom", "trace")
    assert len(caplog.records) == 3
    assert "and 250 more like it" in caplog.records[-1].getMessage()
