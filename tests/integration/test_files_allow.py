"""Files are the operator's to hand out (issue 34, item 6), against a real controller
and worker on loopback.

A client holding the service's token used to make a worker read any file it could: a
0600 file reached the client's stream, and dead letters told other files' names and
line lengths. Now a files source reads only under ``--allow-source-path`` (none by
default):

* outside it (a path, ``..`` traversal, a link pointing out; existing or not) the
  registration is PERMISSION_DENIED naming the path and the flag, through
  RegisterTopology and RegisterInjector, the same whether the file exists, and nothing
  is registered;
* inside it the source reads end to end;
* a link put in a read file's place, or among the files its glob matches, after
  registration, is not read: that source is failing in ClusterStatus (with the flag in
  its message), the worker lives on, and a canary pipeline keeps flowing;
* a hard link among its files to a file outside is not read either, the same way;
* a worker whose list is narrower than the controller's refuses too (its own check);
* ``millwheel register`` refuses an injector's ``file:`` and a source-less
  ``max_disorder_us`` by name (it used to drop them), carries ``max_disorder_us`` with a
  ``source:``, and ``millwheel run`` still reads the same spec's file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any, Iterator

import grpc
import pytest

from millwheel.errors import MillWheelError
from millwheel.spec import spec_parts
from millwheel.topology import InjectorSpec
from services.client import ControllerClient
from services.generated import millwheel_pb2 as pb
from services.rpc.convert import injector_request_to_proto
from services.rpc.security import Security
from tests.support.canary_pipeline import Canary
from tests.support.redis_server import free_port
from tests.support.service_cluster import ROOT, Cluster, wait_for

pytestmark = pytest.mark.timeout(300)
SECRET = b'{"key": "root", "value": "the secret", "timestamp": 1}\n'


def lines(prefix: str, n: int) -> str:
    return "".join(json.dumps({"key": f"{prefix}{i}", "value": i, "timestamp": 1_000 + i}) + "\n" for i in range(n))


class Site:
    """The cluster and the directories: ``allowed`` (controller and worker), ``wide``
    (the controller only), ``private/secret.jsonl`` (0600, allowed nowhere)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.allowed, self.wide, private = tmp / "allowed", tmp / "wide", tmp / "private"
        for d in (self.allowed, self.wide, private):
            d.mkdir()
        self.secret = private / "secret.jsonl"
        self.secret.write_bytes(SECRET)
        self.secret.chmod(0o600)
        self.cluster = Cluster(tmp, controller_args=["--allow-source-path", str(self.allowed),
                                                     "--allow-source-path", str(self.wide)],
                               worker_args=["--allow-source-path", str(self.allowed)])
        self.canary = Canary(self.cluster.client)

    def snapshot(self) -> Any:
        """What a registration would change: the registry as listed, the ranges' nodes."""
        listed = self.cluster.client.computations()
        status = self.cluster.client.status()
        return (sorted((i.name, i.stream, i.source_json) for i in listed.injectors),
                sorted(c.spec.name for c in listed.computations),
                sorted({(r.node, r.range_id) for r in status.ranges}))

    def failure(self, injector: str) -> pb.RangeFailure | None:
        for r in self.cluster.client.status().ranges:
            if r.node == f"injector:{injector}" and r.HasField("failure"):
                return r.failure
        return None

    def stream(self, name: str) -> list[bytes]:
        """What injector ``name`` delivered, as its pass-through computation logged it."""
        return [rec.value for _seq, rec in self.cluster.client.subscribe(f"{name}-kept")]

    def register(self, *injectors: InjectorSpec) -> None:
        register_kept(self.cluster.client, *injectors)


def register_kept(client: ControllerClient, *injectors: InjectorSpec) -> None:
    """The injectors, each with a pass-through computation whose output is logged (what
    :meth:`Site.stream` reads)."""
    keep = [pb.ComputationSpec(name=f"{i.name}-keep", inputs=[pb.InputStream(stream=i.stream)],
                               outputs=[f"{i.name}-kept"],
                               code=pb.Code(name="filter", params_json=json.dumps({"expr": "True"})))
            for i in injectors]
    client.register_topology(keep, list(injectors), log_streams=[f"{i.name}-kept" for i in injectors])


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    s = Site(tmp_path_factory.mktemp("files-allow"))
    try:
        s.cluster.start(workers=1)
        s.canary.register()
        s.canary.round()
        yield s
    finally:
        s.cluster.stop()


def fresh() -> str:
    """A name part of this attempt's own (a rerun registers its injectors anew)."""
    return uuid.uuid4().hex[:8]


def files_injector(name: str, path: str | Path, **extra: Any) -> InjectorSpec:
    item = {"name": name, "stream": name, "source": {"type": "files", "path": str(path), **extra}}
    return spec_parts({"injectors": [item]})[1][0]


def refusal(call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(MillWheelError) as err:
        call(*args, **kwargs)
    assert getattr(err.value, "status", None) == grpc.StatusCode.PERMISSION_DENIED, err.value
    return str(err.value)


def test_a_files_source_outside_the_allowed_directories_is_refused(site: Site) -> None:
    client, allowed, secret = site.cluster.client, site.allowed / fresh(), site.secret
    allowed.mkdir()
    (allowed / "link.jsonl").symlink_to(secret)
    (allowed / "door").symlink_to(secret.parent, target_is_directory=True)
    before = site.snapshot()
    for path in (secret, f"{allowed}/../../private/secret.jsonl", allowed / "link.jsonl",
                 allowed / "door" / "*.jsonl", secret.parent / "absent.jsonl", "secret.jsonl"):
        text = refusal(client.register_topology, [], [files_injector("probe", path)])
        assert f"injector 'probe' source.path {str(path)!r}" in text and "--allow-source-path" in text, text
        assert "the secret" not in text and (str(path) == str(secret) or str(secret) not in text), text
        req = pb.RegisterInjectorRequest(spec=injector_request_to_proto(files_injector("single", path)))
        assert "--allow-source-path" in refusal(client._unary, "RegisterInjector", req, 30)
    assert site.snapshot() == before, "a refused registration registered something"
    # Whether the file exists is not told: a missing file is refused in the same words.
    there = refusal(client.register_topology, [], [files_injector("probe", secret)])
    absent = refusal(client.register_topology, [], [files_injector("probe", secret.parent / "absent.jsonl")])
    assert there.replace(str(secret), "P") == absent.replace(str(secret.parent / "absent.jsonl"), "P")
    site.canary.round()


def test_a_files_source_inside_reads_and_a_link_swapped_in_later_is_not_read(site: Site) -> None:
    allowed, secret = site.allowed / fresh(), site.secret  # fresh: names of this attempt's own
    allowed.mkdir()
    feed, one = allowed / "feed", allowed / "one.jsonl"
    feed.mkdir()
    (feed / "a.jsonl").write_text(lines("a", 30))
    one.write_text(lines("o", 5))
    names = {"feed": f"feed-{allowed.name}", "one": f"one-{allowed.name}"}
    site.register(files_injector(names["feed"], feed / "*.jsonl"), files_injector(names["one"], one))
    wait_for(lambda: len(site.stream(names["feed"])) == 30 and len(site.stream(names["one"])) == 5, 60,
             "both sources read")
    site.canary.round()

    # After registration: a link to the secret among the glob's files, and the single
    # file replaced by a link to it. Neither is read; each is its source's failure.
    (feed / "b.jsonl").symlink_to(secret)
    (allowed / "swap").symlink_to(secret)
    os.replace(allowed / "swap", one)
    for name, words in ((names["feed"], "is a symbolic link"), (names["one"], "not under a directory")):
        failure = wait_for(lambda n=name: site.failure(n), 60, f"source {name} shown failing")  # type: ignore[misc]
        assert failure.stage == "source" and words in failure.message and \
            "--allow-source-path" in failure.message, failure
        assert str(secret) not in failure.message and "the secret" not in failure.message, failure
    site.canary.round()  # the rest of the service flows
    assert site.cluster.workers[0].poll() is None, "the worker died"
    assert b"the secret" not in b"".join(site.stream(names["feed"]) + site.stream(names["one"]))
    assert len(site.stream(names["feed"])) == 30 and len(site.stream(names["one"])) == 5


def test_a_hard_link_to_a_file_outside_is_not_read(site: Site) -> None:
    """A hard link in the allowed directory to the 0600 secret: the ordinary file beside
    it is read, the link is refused (its source failing, as for a symbolic link) and
    nothing of the secret reaches the stream."""
    allowed, secret = site.allowed / fresh(), site.secret
    allowed.mkdir()
    (allowed / "a.jsonl").write_text(lines("h", 10))
    os.link(secret, allowed / "b.jsonl")
    name = f"hard-{allowed.name}"
    site.register(files_injector(name, allowed / "*.jsonl"))
    failure = wait_for(lambda: site.failure(name), 60, f"source {name} shown failing")
    assert failure.stage == "source" and "b.jsonl" in failure.message and "hard links: a file" in failure.message \
        and "copy it instead" in failure.message and "--allow-source-path" in failure.message, failure
    assert str(secret) not in failure.message and "the secret" not in failure.message, failure
    wait_for(lambda: len(site.stream(name)) == 10, 60, "the ordinary file read")
    site.canary.round()  # the rest of the service flows
    assert site.cluster.workers[0].poll() is None, "the worker died"
    assert b"the secret" not in b"".join(site.stream(name))


def test_a_worker_checks_again_where_its_list_is_narrower(site: Site) -> None:
    """The controller allows ``wide``, the worker does not: the worker refuses to read it
    (as it would a registry restored or written before the check)."""
    name = f"wide-{fresh()}"
    (site.wide / f"{name}.jsonl").write_text(lines("w", 3))
    site.register(files_injector(name, site.wide / f"{name}.jsonl"))
    failure = wait_for(lambda: site.failure(name), 60, f"source {name} shown failing")
    assert "--allow-source-path" in failure.message and str(site.allowed) in failure.message, failure
    assert site.stream(name) == []
    site.canary.round()


KEEP = """computations:
  - name: keep
    inputs: [clicks]
    outputs: [kept]
    code: {name: filter, params: {expr: "True"}}
"""


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)


def test_register_keeps_every_injector_field_or_refuses_it_by_name(site: Site, tmp_path: Path) -> None:
    address = site.cluster.address
    (tmp_path / "clicks.jsonl").write_text(lines("c", 4))
    filed = "injectors:\n  - {name: clicks, stream: clicks, file: clicks.jsonl, max_disorder_us: 2000000}\n"
    sourceless = "injectors:\n  - {name: clicks, stream: clicks, max_disorder_us: 2000000}\n"
    before = site.snapshot()
    for text, words in ((filed, ["injectors[0] 'clicks': 'file' is read by `millwheel run`",
                                 "millwheel inject clicks.jsonl --injector clicks --max-disorder-us 2000000 --done",
                                 "--allow-source-path"]),
                        (sourceless, ["injectors[0] 'clicks': 'max_disorder_us' sets nothing in the service",
                                      "--max-disorder-us N"])):
        (tmp_path / "spec.yaml").write_text(text)
        reg = cli("register", "spec.yaml", "--controller", address, cwd=tmp_path)
        assert reg.returncode == 2, (reg.stdout, reg.stderr)
        for w in words:
            assert w in reg.stderr, reg.stderr
    assert site.snapshot() == before, "a refused register registered something"

    # The spec `register` refuses is one `run` reads whole (its own machine, its own file).
    (tmp_path / "spec.yaml").write_text(filed + KEEP)
    run = cli("run", "spec.yaml", "--store", f"sqlite:///{tmp_path / 'run.db'}", "--print", "kept", "--quiet",
              cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert sorted(json.loads(line)["key"] for line in run.stdout.splitlines()) == ["c0", "c1", "c2", "c3"]

    # With a source, max_disorder_us is the source's and travels with it.
    (site.allowed / "dis.jsonl").write_text(lines("d", 2))
    name = f"dis-{fresh()}"
    (tmp_path / "spec.yaml").write_text(
        f"injectors:\n  - {{name: {name}, stream: {name}, max_disorder_us: 2000000, "
        f"source: {{type: files, path: {site.allowed / 'dis.jsonl'}}}}}\n")
    reg = cli("register", "spec.yaml", "--controller", address, cwd=tmp_path)
    assert reg.returncode == 0, reg.stderr
    listed = {i.name: i for i in site.cluster.client.computations().injectors}
    assert json.loads(listed[name].source_json)["max_disorder_us"] == 2_000_000


def test_up_hands_its_directories_to_the_controller_and_the_workers(tmp_path: Path) -> None:
    """``millwheel up --allow-source-path DIR`` (relative to where it runs): a source
    inside is read by its worker, one outside refused by its controller."""
    (tmp_path / "inputs").mkdir()
    (tmp_path / "inputs" / "a.jsonl").write_text(lines("u", 4))
    (tmp_path / "elsewhere.jsonl").write_text(lines("e", 1))
    port = free_port()
    with open(tmp_path / "up.log", "wb") as log:
        up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--workers", "1", "--port", str(port),
                               "--metrics-port", "-1", "--no-auth", "--store", f"sqlite:///{tmp_path}/s.db",
                               "--allow-source-path", "inputs"], cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=log)
    client = ControllerClient(f"127.0.0.1:{port}", timeout_s=10, security=Security())
    try:
        wait_for(lambda: any(w.alive for w in client.status().workers), 60, "up's worker to join")
        text = refusal(client.register_topology, [], [files_injector("out", tmp_path / "elsewhere.jsonl")])
        assert str(tmp_path / "inputs") in text, text  # the directory, resolved where up runs
        register_kept(client, files_injector("in", tmp_path / "inputs" / "*.jsonl"))
        wait_for(lambda: len(list(client.subscribe("in-kept"))) == 4, 60, "the worker to read the source")
    finally:
        client.close()
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(10)
