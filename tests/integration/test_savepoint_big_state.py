"""Savepoints whatever a key's state size (issue 34, item 4), on real services.

One key's state over ~12 MiB made every savepoint fail (no item was split across
frames), and with ``--stop`` the stop was stored before the failure: the service
refused every Inject for good and there was no file to restore. Here one key grows to
~45 MiB (fifteen records each appending 3 MiB); a savepoint is taken without and then
with ``--stop``, restored into a fresh service of the same store kind (SQLite, then a
real redis-server), every key's state compared byte for byte with the source store's,
and the restored service fed on: its outputs continue exactly where the cut was. A
stop with savepoint that fails for another reason (the controller cannot write its
spool) stops nothing: Inject is accepted, and a restarted controller finds no stop.
A state over the limit a key may hold is refused where it is set, under the
computation's error policy, naming the key.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import resource
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from millwheel.computation import Computation, Context
from millwheel.errors import ResourceLimitError
from millwheel.keys import key_range
from millwheel.limits import MAX_STATE_BYTES
from millwheel.record import Record
from millwheel.savepoint.format import frames
from millwheel.state import open_store
from millwheel.testing import PipelineTest
from millwheel.topology import CodeRef, ComputationSpec, ErrorPolicy, InjectorSpec, InputSpec, Options, Topology
from services.rpc.status import PreconditionError, UnavailableError
from tests.support.redis_server import RedisServer
from tests.support.savepoints import log_entries, run_cli
from tests.support.service_cluster import ROOT, Cluster, wait_for

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

MiB = 1 << 20
GROW = 3 * MiB  #: bytes the big key's state grows by per record
CODE = "tests.integration.test_savepoint_big_state"
RANGES = 2


def growth(value: bytes) -> bytes:
    """What a record appends to its key's state: ``grow`` bytes derived from the record
    (so a record applied twice, dropped or applied out of order changes the state)."""
    return hashlib.shake_256(value).digest(int(json.loads(value)["grow"]))


class Grow(Computation):
    """Appends :func:`growth` to the key's state; emits the state's length and SHA-256."""

    def process_record(self, ctx: Context, record: Record) -> None:
        state = (ctx.state or b"") + growth(record.value)
        ctx.set_state(state)
        ctx.produce("sizes", ctx.key, summary(state), record.timestamp)


class Oversize(Computation):
    """Sets a state one byte over the limit for a record asking for it."""

    def process_record(self, ctx: Context, record: Record) -> None:
        if record.value == b"huge":
            ctx.set_state(bytes(MAX_STATE_BYTES + 1))
        else:
            ctx.set_state(record.value)
        ctx.produce("out", ctx.key, record.value, record.timestamp)


def summary(state: bytes) -> bytes:
    return json.dumps({"len": len(state), "sha256": hashlib.sha256(state).hexdigest()}).encode()


def topology() -> Topology:
    return Topology(
        computations=(ComputationSpec("grow", (InputSpec("events"),), ("sizes",), CodeRef(f"{CODE}:Grow"),
                                      Options(key_ranges=RANGES)),),
        injectors=(InjectorSpec("events", "events"),),
        log_streams=("sizes",))


class Feed:
    """The records fed so far and what each key's state must be after them."""

    def __init__(self) -> None:
        self.n = 0
        self.states: dict[str, bytes] = {}
        self.outputs: list[tuple[str, bytes]] = []  # (key, value), as emitted (each value is unique)

    def record(self, key: str, grow: int) -> Record:
        self.n += 1
        rec = Record(key, json.dumps({"grow": grow, "i": self.n}).encode(), self.n * 1000, f"r{self.n}")
        self.states[key] = self.states.get(key, b"") + growth(rec.value)
        self.outputs.append((key, summary(self.states[key])))
        return rec


def emitted(c: Cluster, after: int = 0) -> list[tuple[str, bytes]]:
    return [(r[0], r[1]) for seq, r in log_entries(c, "sizes") if seq > after]


def feed(c: Cluster, f: Feed, key: str, grow: int, count: int, after: int = 0, before: int = 0) -> None:
    """``count`` records of ``key``, one at a time (each key's records in order), each
    waited for until its output is in ``c``'s log past position ``after`` (the
    ``before`` outputs of ``f`` were emitted up to it)."""
    for _ in range(count):
        rec = f.record(key, grow)
        wait_for(lambda rec=rec: injected(c, rec), 60, f"{rec.record_id} accepted")  # type: ignore[misc]
        want = len(f.outputs) - before
        wait_for(lambda want=want: len(emitted(c, after)) >= want, 120,  # type: ignore[misc]
                 f"the output of {rec.record_id}")


def injected(c: Cluster, rec: Record) -> bool:
    """Inject ``rec``; False while no controller leads yet, or while a stop is being
    undone (a retry is a no-op: its ID). Where a refusal is meant, tests inject directly."""
    try:
        c.client.inject_records("events", [rec])
    except (UnavailableError, PreconditionError):
        return False
    return True


def stored_states(url: str) -> dict[str, bytes]:
    """Every key's state of ``grow`` as the store at ``url`` holds it."""
    store = open_store(url)
    try:
        keys = store.list_keys("grow", None, 10_000)
        out: dict[str, bytes] = {}
        for k in keys:
            out.update(store.read_state("grow", [k], key_range(k, RANGES)))
        return out
    finally:
        store.close()


def file_states(path: Path) -> dict[str, bytes]:
    """Every key's state of ``grow`` as the savepoint file holds it (values reassembled)."""
    out: dict[str, bytes] = {}
    with open(path, "rb") as fh:
        for fr in frames(fh):
            if fr["t"] == "state" and fr["node"] == "grow":
                for k, v in fr["items"]:
                    out[k] = v if isinstance(v, bytes) else base64.b64decode(v)
    return out


@pytest.fixture(params=["sqlite", "redis"])
def urls(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Two empty stores of one kind: the service's and the one it is restored into."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/src.db", f"sqlite:///{tmp_path}/dst.db"
        return
    with RedisServer() as a, RedisServer() as b:
        yield a.url, b.url


def start(tmp: Path, name: str, url: str) -> Cluster:
    d = tmp / name
    d.mkdir()
    c = Cluster(d, store_url=url, allow_code=CODE)
    try:
        return c.start(1)
    except BaseException:
        c.stop()
        raise


def test_a_45_mib_state_survives_savepoint_stop_and_restore_exactly(tmp_path: Path, urls: tuple[str, str]) -> None:
    src_url, dst_url = urls
    f = Feed()
    src = start(tmp_path, "src", src_url)
    try:
        src.register(topology())
        src.wait_balanced()
        for key in ("a", "b", "c"):
            feed(src, f, key, 100, 2)
        feed(src, f, "big", GROW, 14)  # 42 MiB: over the old ~12 MiB limit more than three times
        assert emitted(src) == f.outputs

        # Without --stop: the file holds every state; the service runs on.
        plain = tmp_path / "plain.mwsp"
        code, out, err = run_cli("savepoint", "create", str(plain), "--controller", src.address, "--json")
        assert code == 0, err
        assert not json.loads(out)["stopped"]
        assert file_states(plain) == f.states
        feed(src, f, "big", GROW, 1)  # 45 MiB
        assert emitted(src) == f.outputs

        # With --stop: the stop holds, and the file holds the state at the cut.
        path = tmp_path / "stop.mwsp"
        code, out, err = run_cli("savepoint", "create", str(path), "--stop", "--controller", src.address, "--json")
        assert code == 0, err
        assert json.loads(out)["stopped"]
        with pytest.raises(PreconditionError, match="stopped with a savepoint"):
            src.client.inject_records("events", [Record("a", b'{"grow": 1}', 1, "refused")])
        code, out, err = run_cli("savepoint", "inspect", str(path), "--json")
        assert code == 0, err
        counts = json.loads(out)["counts"]  # (an injector keeps state too)
        assert counts["state"] >= len(f.states) and "part" not in counts
    finally:
        src.stop()
    at_cut = stored_states(src_url)
    assert at_cut == f.states and len(at_cut["big"]) == 15 * GROW
    assert file_states(path) == at_cut

    dst = start(tmp_path, "dst", dst_url)
    try:
        code, out, err = run_cli("savepoint", "restore", str(path), "--controller", dst.address, "--json")
        assert code == 0, err
        mark = json.loads(out)["restored_log_last"]["sizes"]
        assert stored_states(dst_url) == at_cut  # every key's state, byte for byte
        assert emitted(dst)[:mark] == f.outputs  # the log up to the cut, as it was
        dst.wait_balanced()
        before = len(f.outputs)
        feed(dst, f, "big", GROW, 2, after=mark, before=before)  # 51 MiB
        feed(dst, f, "a", 100, 1, after=mark, before=before)
        # The outputs go on exactly from the cut: each record once, from the restored state.
        assert emitted(dst, mark) == f.outputs[before:]
        assert stored_states(dst_url) == f.states
    finally:
        dst.stop()


class SpoolLimited(Cluster):
    """A cluster whose controller may write files of at most ``fsize`` bytes
    (RLIMIT_FSIZE): its savepoint spool fails past that, as on a full disk."""

    fsize = 0

    def _spawn(self, name: str, args: list[str], env_extra: dict[str, str] | None = None
               ) -> subprocess.Popen[bytes]:
        if name != "controller" or not self.fsize:
            return super()._spawn(name, args, env_extra)
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115 (closed by stop)
        self._logs.append(log)
        limit = self.fsize

        def limited() -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env, **(env_extra or {})}
        return subprocess.Popen([sys.executable, "-m", "services.cli", *args], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=limited)


def test_a_stop_with_savepoint_that_fails_stops_nothing(tmp_path: Path) -> None:
    f = Feed()
    with RedisServer() as redis:  # (the controller writes no store file then, only its spool)
        c = SpoolLimited(tmp_path, store_url=redis.url, allow_code=CODE)
        c.fsize = 8 * MiB
        try:
            c.start(1)
            c.register(topology())
            c.wait_balanced()
            feed(c, f, "big", GROW, 4)  # 12 MiB of state: the spool cannot hold it
            path = tmp_path / "failed.mwsp"
            code, _out, err = run_cli("savepoint", "create", str(path), "--stop", "--controller", c.address)
            assert code != 0 and "File too large" in err, err
            assert not path.exists() and not Path(f"{path}.partial").exists()
            # Nothing was stopped: the ranges run again and Inject is accepted and processed.
            wait_for(lambda: all(r.worker_id for r in c.client.status().ranges), 30, "the ranges placed again")
            feed(c, f, "big", GROW, 1)
            feed(c, f, "a", 100, 1)
            assert emitted(c) == f.outputs
            # No stop was stored either: a controller started afresh (without the limit)
            # takes records, and a stop with savepoint now succeeds.
            assert c.controller is not None
            c.controller.kill()
            c.controller.wait(10)
            c.fsize = 0
            c.start_controller()
            wait_for(lambda: all(r.worker_id for r in c.client.status().ranges), 30, "the ranges placed")
            feed(c, f, "big", GROW, 1)
            code, out, err = run_cli("savepoint", "create", str(path), "--stop", "--controller", c.address)
            assert code == 0, err
            assert file_states(path) == f.states
        finally:
            c.stop()


def test_a_stop_with_savepoint_whose_client_leaves_mid_transfer_stops_nothing(tmp_path: Path) -> None:
    """The stop is stored once the whole file went out: a client that takes one chunk
    and cancels leaves the service running (it has no file to restore)."""
    from services.generated import millwheel_pb2 as pb

    f = Feed()
    c = start(tmp_path, "svc", f"sqlite:///{tmp_path}/svc.db")
    try:
        c.register(topology())
        c.wait_balanced()
        feed(c, f, "big", GROW, 8)  # a 24 MiB state: 33 MiB of file, 1 MiB a message
        call = c.client.stub.CreateSavepoint(pb.CreateSavepointRequest(stop=True), timeout=120)
        for msg in call:
            if msg.chunk:
                break  # the cut is taken and the file is being sent: the client goes away
        call.cancel()
        # (Refused only until the call's end is seen.) The ranges run again, Inject is taken.
        wait_for(lambda: all(r.worker_id for r in c.client.status().ranges), 30, "the ranges placed again")
        feed(c, f, "big", GROW, 1)
        assert emitted(c) == f.outputs
        assert "stop with savepoint undone" in c.log("controller")
        # Nothing stored: a controller started afresh on the store takes records.
        assert c.controller is not None
        c.controller.kill()
        c.controller.wait(10)
        c.start_controller()
        feed(c, f, "a", 100, 1)
    finally:
        c.stop()


def test_a_state_over_the_limit_is_refused_where_it_is_set_under_the_error_policy() -> None:
    topo = Topology(
        computations=(ComputationSpec("big", (InputSpec("in"),), ("out",), CodeRef(f"{CODE}:Oversize"),
                                      Options(key_ranges=1, on_error=ErrorPolicy.DEAD_LETTER)),),
        injectors=(InjectorSpec("in", "in"),), log_streams=("out",))
    with PipelineTest(topo) as t:
        t.add("in", [Record("k", b"small", 1, "r1"), Record("k", b"huge", 2, "r2"), Record("j", b"ok", 3, "r3")])
        t.run()
        assert [r.value for r in t.output("out")] == [b"small", b"ok"]
        assert t.state("big", "k") == b"small"  # the refused write wrote nothing
        letters = [json.loads(r.value) for r in t.output("big.dead_letters")]
        assert [(d["record_id"], d["key"], d["exception_type"]) for d in letters] == [
            ("r2", "k", ResourceLimitError.__name__)]
        assert f"key 'k': state of {MAX_STATE_BYTES + 1} bytes, over the limit of {MAX_STATE_BYTES}" \
            in letters[0]["message"]

