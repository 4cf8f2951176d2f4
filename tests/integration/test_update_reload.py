"""New code reaches running workers; versions shown; the key-extractor rule over two updates
(issue 34, item 9), on a real controller and real workers on loopback.

* A user class that raises on some records: they are dead-lettered. ``millwheel update``
  of the running spec changes nothing and says how to load new code; the file is fixed
  on the (shared) disk and ``millwheel update --reload`` makes version 2: the workers
  import the module again, the dead letters replayed are processed by the new code,
  every record comes out exactly once, and a built-in canary consumer of the same
  stream keeps flowing. ``millwheel computations`` / ``status`` and DescribeComputation
  show the version.
* A reload whose module has a syntax error: the update answers (the controller never
  imports user code), the ranges keep running the old code, the workers stay up, and
  the failure is in ``millwheel errors`` / ``status`` (outcome reload_failed); fixing
  the file and reloading again brings the new code.
* The key extractor of an input changed in two steps (the input removed, then added
  back with another extractor) is refused like the one-step change, and nothing
  changes; a reload of built-in code is refused.
* DescribeComputation through a standby right after registering through it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

from millwheel.errors import NotFoundError
from millwheel.keys import KeyExtractor
from millwheel.record import Record
from millwheel.spec import computation_to_dict
from millwheel.topology import CodeRef, ComputationSpec, ErrorPolicy, InjectorSpec, InputSpec, Options, Topology
from services.rpc.convert import spec_from_proto, spec_to_proto
from services.rpc.status import PreconditionError
from tests.support.service_cluster import ROOT, Cluster, wait_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
MODULE = "mw_reload_user"
S = 1_000_000

CODE = '''
import json
from millwheel.computation import Computation


class Check(Computation):
    """The user's code, version {tag!r}."""

    def process_record(self, ctx, record):
        n = json.loads(record.value)["n"]
        if {raises} and n % 10 == 3:
            raise ValueError(f"n={{n}} ends in 3")
        ctx.produce("checked", ctx.key, f"{tag}:{{n}}".encode(), record.timestamp)
'''


def write_code(directory: Path, tag: str, raises: bool = False) -> None:
    (directory / f"{MODULE}.py").write_text(CODE.format(tag=tag, raises=raises))


def topology() -> Topology:
    check = ComputationSpec("check", (InputSpec("events"),), ("checked",), CodeRef(f"{MODULE}:Check"),
                            Options(key_ranges=4, on_error=ErrorPolicy.DEAD_LETTER, max_attempts=2))
    canary = ComputationSpec("canary", (InputSpec("events"),), ("copied",), CodeRef("map", {"key": "key"}),
                             Options(key_ranges=2))
    return Topology(computations=(check, canary), injectors=(InjectorSpec("events", "events"),),
                    log_streams=("checked", "copied"))


def records(lo: int, hi: int) -> list[Record]:
    return [Record(f"k{n % 7}", json.dumps({"n": n}).encode(), 1_000 * S + n * 1_000, f"r{n}")
            for n in range(lo, hi)]


@pytest.fixture
def user_cluster(tmp_path: Path) -> Iterator[tuple[Cluster, Path]]:
    """A controller and two workers allowed to run MODULE, found in a directory of the
    test's own (the worker machines' files, which the test edits)."""
    code = tmp_path / "code"
    code.mkdir()
    c = Cluster(tmp_path, allow_code=MODULE, env={"PYTHONPATH": f"{ROOT}:{code}"})
    c.start(workers=2)
    try:
        yield c, code
    finally:
        c.stop()


def cli(c: Cluster, *args: str, ok: bool = True) -> str:
    done = subprocess.run([sys.executable, "-m", "services.cli", *args, "--controller", c.address],
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60)
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    return done.stdout + done.stderr


def checked(c: Cluster) -> dict[int, list[str]]:
    """n -> the tags of its outputs (each must have exactly one)."""
    out: dict[int, list[str]] = {}
    for _key, value, _ts, _rid in c.outputs("checked"):
        tag, _, n = value.decode().partition(":")
        out.setdefault(int(n), []).append(tag)
    return out


def spec_file(tmp: Path, spec: ComputationSpec) -> Path:
    path = tmp / f"{spec.name}.json"
    path.write_text(json.dumps(computation_to_dict(spec)))
    return path


def test_a_fixed_class_reaches_the_workers_and_dead_letters_replay_through_it(
        user_cluster: tuple[Cluster, Path], tmp_path: Path) -> None:
    c, code = user_cluster
    write_code(code, "v1", raises=True)
    topo = topology()
    c.register(topo)
    c.wait_balanced()
    c.inject("events", "events", records(0, 100), batch=20)
    wait_for(lambda: c.client.describe("check").dead_lettered == 10, 60, "the 10 bad records dead-lettered")
    wait_for(lambda: len(checked(c)) == 90, 60, "the 90 good records processed")
    assert all(tags == ["v1"] for tags in checked(c).values())

    # The file is fixed on the workers' disk. The running spec alone changes nothing, and
    # says what to do.
    write_code(code, "v2")
    path = spec_file(tmp_path, topo.computations[0])
    out = cli(c, "update", str(path))
    assert "nothing changed" in out and f"({MODULE})" in out
    assert "millwheel update --reload --computation check" in out
    assert c.client.describe("check").version == 1

    out = cli(c, "update", "--reload", "--computation", "check")
    assert "reloaded computation 'check': version 1 -> 2" in out and MODULE in out
    # The version everywhere a user looks.
    assert c.client.describe("check").version == 2
    listed = cli(c, "computations")
    row = next(line for line in listed.splitlines() if line.startswith("check "))
    assert row.split()[1] == "2", listed
    status = cli(c, "status")
    assert any(line.split()[:2] == ["check", "2"] for line in status.splitlines()), status
    assert {v.name: v.version for v in c.client.status().versions} == {"check": 2, "canary": 1}
    listed_json = json.loads(cli(c, "computations", "--json"))
    assert {x["name"]: x["version"] for x in listed_json["computations"]} == {"check": 2, "canary": 1}

    # Dead letters replayed now run the new code: each bad record once, by v2.
    assert "replayed 10 dead letters" in cli(c, "dead-letters", "replay", "check")
    wait_for(lambda: len(checked(c)) == 100, 60, "the replayed records processed")
    # The pipeline flows on: new records by the new code; the canary saw everything once.
    c.inject("events", "events", records(100, 150), batch=10)
    wait_for(lambda: len(checked(c)) == 150, 60, "the records after the reload")
    wait_for(lambda: len(c.outputs("copied")) == 150, 60, "the canary's copies")
    got = checked(c)
    assert sorted(got) == list(range(150))
    assert all(len(tags) == 1 for tags in got.values()), {n: t for n, t in got.items() if len(t) != 1}
    assert {n for n, tags in got.items() if tags == ["v2"]} >= {n for n in range(100) if n % 10 == 3} | \
        set(range(100, 150))
    assert sorted(v for _k, v, _t, _rid in c.outputs("copied")) == sorted(r.value for r in records(0, 150))
    info = c.client.describe("check")
    assert (info.dead_lettered, len(info.retrying)) == (10, 0)
    assert all(w.alive for w in c.client.status().workers)


def test_a_reload_that_fails_leaves_the_old_code_running_and_says_so(
        user_cluster: tuple[Cluster, Path]) -> None:
    c, code = user_cluster
    write_code(code, "v1")
    c.register(topology())
    c.wait_balanced()
    c.inject("events", "events", records(0, 40), batch=20)
    wait_for(lambda: len(checked(c)) == 40, 60, "the first records")

    (code / f"{MODULE}.py").write_text("class Check(:\n    pass\n")  # a syntax error
    out = cli(c, "update", "--reload", "--computation", "check")
    assert "version 1 -> 2" in out  # accepted: the controller never imports user code

    def reported() -> list[Any]:
        return [e for e in c.client.describe("check").recent_errors if e.outcome == "reload_failed"]
    errors = wait_for(reported, 60, "the failed reload in the computation's errors")
    assert errors[0].exception_type == "SyntaxError" and MODULE in errors[0].message
    assert "runs the code loaded before" in errors[0].message
    assert "reload_failed" in cli(c, "errors", "check")
    assert "check" in cli(c, "status").split("LAST ERROR", 1)[-1]

    # Still running, on the old code, exactly once; the workers are up.
    c.inject("events", "events", records(40, 80), batch=20)
    wait_for(lambda: len(checked(c)) == 80, 60, "records after the failed reload")
    assert all(tags == ["v1"] for tags in checked(c).values())
    assert all(w.alive for w in c.client.status().workers) and all(p.poll() is None for p in c.workers)

    write_code(code, "v3")  # fixed: reload again
    assert "version 2 -> 3" in cli(c, "update", "--reload", "--computation", "check")
    c.inject("events", "events", records(80, 120), batch=20)
    wait_for(lambda: len(checked(c)) == 120, 60, "records after the second reload")
    got = checked(c)
    assert all(len(tags) == 1 for tags in got.values())
    assert all(got[n] == ["v3"] for n in range(80, 120)), got
    wait_for(lambda: len(c.outputs("copied")) == 120, 30, "the canary's copies")


def registry_view(c: Cluster) -> list[tuple[str, Any, int, bool]]:
    return [(i.spec.name, computation_to_dict(spec_from_proto(i.spec)), i.version, i.has_previous)
            for i in c.client.computations().computations]


def test_a_key_extractor_changed_in_two_steps_is_refused(two_workers: Cluster) -> None:
    c = two_workers
    a = ComputationSpec("join", (InputSpec("events", KeyExtractor("json:user")), InputSpec("more")),
                        ("joined",), CodeRef("map", {"key": "key"}), Options(key_ranges=2))
    c.register(Topology(computations=(a,), injectors=(InjectorSpec("events", "events"),
                                                     InjectorSpec("more", "more")), log_streams=("joined",)))
    c.wait_balanced()
    c.inject("events", "events", [Record("x", json.dumps({"user": f"u{i}"}).encode(), (1_000 + i) * S, f"e{i}")
                                  for i in range(20)])
    wait_for(lambda: len(c.outputs("joined")) == 20, 60, "the canary records")

    # One step: refused, as before.
    direct = ComputationSpec("join", (InputSpec("events", KeyExtractor("json:account")), InputSpec("more")),
                             ("joined",), CodeRef("map", {"key": "key"}), Options(key_ranges=2))
    with pytest.raises(PreconditionError, match=r"inputs\['events'\]\.key_extractor changed"):
        c.client.update(spec_to_proto(direct))
    # Two steps: the input removed (allowed: version 2) ...
    without = ComputationSpec("join", (InputSpec("more"),), ("joined",), CodeRef("map", {"key": "key"}),
                              Options(key_ranges=2))
    assert c.client.update(spec_to_proto(without)).computation.version == 2
    before = registry_view(c)
    # ... then added back with another extractor: refused, naming the earlier one.
    again = ComputationSpec("join", (InputSpec("more"), InputSpec("events", KeyExtractor("json:account"))),
                            ("joined",), CodeRef("map", {"key": "key"}), Options(key_ranges=2))
    with pytest.raises(PreconditionError, match="removed by an earlier update") as refused:
        c.client.update(spec_to_proto(again))
    assert "'json:user' -> 'json:account'" in str(refused.value)
    assert registry_view(c) == before  # nothing changed
    # Back with the default extractor ('key'): refused too.
    with pytest.raises(PreconditionError, match="key_extractor changed"):
        c.client.update(spec_to_proto(ComputationSpec(
            "join", (InputSpec("more"), InputSpec("events")), ("joined",), CodeRef("map", {"key": "key"}),
            Options(key_ranges=2))))
    # Added back with its own extractor: allowed.
    same = ComputationSpec("join", (InputSpec("more"), InputSpec("events", KeyExtractor("json:user"))),
                           ("joined",), CodeRef("map", {"key": "key"}), Options(key_ranges=2))
    assert c.client.update(spec_to_proto(same)).computation.version == 3
    # A reload of built-in code: nothing to load, refused; nothing changed.
    before = registry_view(c)
    with pytest.raises(PreconditionError, match="names no user code"):
        c.client.update(spec_to_proto(same), reload=True)
    assert registry_view(c) == before
    # The pipeline flows on.
    c.inject("events", "events", [Record("x", json.dumps({"user": f"u{i}"}).encode(), (2_000 + i) * S, f"f{i}")
                                  for i in range(20)])
    wait_for(lambda: len(c.outputs("joined")) == 40, 60, "records after the refusals")
    assert len({rid for _k, _v, _t, rid in c.outputs("joined")}) == 40


def test_describe_through_a_standby_right_after_registering_through_it(tmp_path: Path) -> None:
    from tests.integration.test_controller_ha import HACluster

    ha = HACluster(tmp_path, n=2)
    try:
        ha.start_controller()
        leader = ha.leader()
        standby = next(i for i, a in enumerate(ha.addresses) if a != leader)
        client = ha.one(standby)
        try:
            client.register_injector("events", "events")
            for i in range(5):
                spec = ComputationSpec(f"c{i}", (InputSpec("events"),), (f"out{i}",),
                                       CodeRef("map", {"key": "key"}), Options(key_ranges=1))
                client.register_computation(spec_to_proto(spec), [])
                info = client.describe(f"c{i}")  # NOT_FOUND before the fix, for ~0.5 s
                assert info.spec.name == f"c{i}" and info.version == 1
            with pytest.raises(NotFoundError):
                client.describe("never-registered")
        finally:
            client.close()
    finally:
        ha.stop()


def test_describe_on_a_standby_looks_again_after_not_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same, deterministically (the standby's periodic pass may win the race above
    on a loaded machine): a NOT_FOUND on a standby re-reads the store's view and looks once more, as
    GetWatermark, GetState and ListKeys do; on the leader NOT_FOUND stands."""
    import threading

    from services.controller import queries, views
    from services.generated import millwheel_pb2 as pb

    views_seen: list[str] = []
    registered = {"leader": False}

    def info(plane: Any, name: str) -> Any:
        views_seen.append(name)
        if not registered["leader"]:
            raise NotFoundError(f"no computation named {name!r}")
        return pb.ComputationInfo(version=1)

    class Leadership:
        def __init__(self, standby: bool) -> None:
            self.standby = standby

        def current_view(self) -> None:  # the registry's version: unchanged here
            pass

        def fresh_view(self) -> bool:
            registered["leader"] = True  # what the store's view holds
            return self.standby

    class Plane:
        lock = threading.Lock()

    monkeypatch.setattr(views, "info", info)
    on_standby = queries.Queries(Plane(), Leadership(standby=True))  # type: ignore[arg-type]
    context: Any = None
    assert on_standby.describe_computation(pb.DescribeComputationRequest(name="c"), context).version == 1
    assert views_seen == ["c", "c"]
    registered["leader"] = False
    on_leader = queries.Queries(Plane(), Leadership(standby=False))  # type: ignore[arg-type]
    with pytest.raises(NotFoundError):
        on_leader.describe_computation(pb.DescribeComputationRequest(name="c"), context)


def test_up_passes_writer_expiry_and_max_restore_bytes_to_its_controller(tmp_path: Path) -> None:
    """`millwheel up` takes the two controller flags (issue 34) and hands them on; a bad
    --max-restore-bytes is refused by up itself, before any process starts."""
    import signal

    from tests.integration.test_up_cleanup import _role, children, processes_mentioning, up
    from tests.support.redis_server import free_port

    port = free_port()
    bad = up(tmp_path, port, "--max-restore-bytes", "0", "--store", f"sqlite:///{tmp_path}/bad.db")
    assert bad.wait(30) == 2 and "--max-restore-bytes must be" in (tmp_path / "up.log").read_text()
    assert not children(port)

    proc = up(tmp_path, port, "--workers", "1", "--ui-port", "-1", "--writer-expiry", "7.5",
              "--max-restore-bytes", "123456", "--store", f"sqlite:///{tmp_path}/s.db")
    try:
        wait_for(lambda: "millwheel is up" in (tmp_path / "up.log").read_text(), 60, "up to start")
        [pid] = [p for p in processes_mentioning(f"--port {port} ") if _role(p) == "controller"]
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert args[args.index(b"--writer-expiry") + 1] == b"7.5"
        assert args[args.index(b"--max-restore-bytes") + 1] == b"123456"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
        wait_for(lambda: not children(port), 10, "no child left behind")


def test_reload_module_in_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a worker's reload does (millwheel.importing.reload_module), in this process:
    the file's new version, even rewritten in the same second with the same size (a
    stale .pyc would pass for fresh); a failed load leaves the module as it was; the
    service's own modules and modules outside the allow-list are never reloaded."""
    import importlib

    from millwheel.errors import PermissionDeniedError
    from millwheel.importing import AllowList, CodeReloadError, reload_module

    name = "mw_reload_inproc"
    path = tmp_path / f"{name}.py"
    path.write_text("VALUE = 'aaa'\ndef f():\n    return VALUE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    allow = AllowList.parse(name)
    assert reload_module(name, allow) is False  # not imported yet: the next import reads the file
    module = importlib.import_module(name)
    old_f = module.f
    try:
        path.write_text("VALUE = 'bbb'\ndef f():\n    return VALUE\n")  # same size, same second
        assert reload_module(name, allow) is True
        assert module.f() == "bbb" and module.f is not old_f

        path.write_text("VALUE = 'ccc'\ndef f(:\n")
        with pytest.raises(CodeReloadError, match="SyntaxError") as failed:
            reload_module(name, allow)
        assert failed.value.exc_type == "SyntaxError"
        assert module.VALUE == "bbb" and module.f() == "bbb"

        path.write_text("VALUE = 'ddd'\nraise RuntimeError('at import')\n")
        with pytest.raises(CodeReloadError, match="RuntimeError"):
            reload_module(name, allow)
        assert module.VALUE == "bbb" and module.f() == "bbb"  # every attribute as before

        with pytest.raises(PermissionDeniedError, match="never reloaded"):
            reload_module("millwheel.record", AllowList.parse("*"))
        with pytest.raises(PermissionDeniedError, match="allow-list"):
            reload_module(name, AllowList.parse("otherpkg.*"))
    finally:
        sys.modules.pop(name, None)


def test_the_key_extractor_record_is_stored_with_the_registry(tmp_path: Path) -> None:
    """The record the two-step rule reads: in the registry's one store entry, read back
    by a new controller (a new leader), kept through a rescale's rewrite, dropped with
    the computation (registered again, it starts afresh)."""
    from millwheel.state.sqlite_store import SQLiteStore
    from services.controller.compat import candidate
    from services.controller.registry import Registry

    store = SQLiteStore(tmp_path / "s.db")
    try:
        reg = Registry(store)
        a = ComputationSpec("j", (InputSpec("events", KeyExtractor("json:user")), InputSpec("more")), ("o",),
                            CodeRef("map", {"key": "key"}), Options(key_ranges=2))
        reg.register_topology([a], [InjectorSpec("events", "events"), InjectorSpec("more", "more")], [])
        b = ComputationSpec("j", (InputSpec("more"),), ("o",), CodeRef("map", {"key": "key"}), Options(key_ranges=2))
        topo, keyed = candidate(reg.topology, b, reg.allow, reg.keyed.get("j"))
        reg.replace_computation(b, topo, 2, a, keyed=keyed)
        assert Registry(store).keyed == {"j": {"events": "json:user", "more": "key"}}
        reg.replace_computation(b, topo, 3, a)  # a rewrite that names no record (rescale) keeps it
        again = Registry(store)
        assert again.keyed == {"j": {"events": "json:user", "more": "key"}}
        c = ComputationSpec("j", (InputSpec("more"), InputSpec("events", KeyExtractor("json:x"))), ("o",),
                            CodeRef("map", {"key": "key"}), Options(key_ranges=2))
        with pytest.raises(PreconditionError, match="removed by an earlier update"):
            candidate(again.topology, c, again.allow, again.keyed.get("j"))
        again.unregister_computation("j")
        assert Registry(store).keyed == {}
    finally:
        store.close()
