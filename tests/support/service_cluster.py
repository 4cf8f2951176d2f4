"""Real service processes on loopback for the service tests.

A :class:`Cluster` starts ``millwheel controller`` and ``millwheel worker`` as child
processes (exactly what a user runs), on free ports, over one store; tests kill -9,
SIGSTOP/SIGCONT, SIGTERM and restart them, and talk to them only over gRPC.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from millwheel.record import MAX_TIMESTAMP, Record
from millwheel.runtime.local_runner import LocalRunner
from millwheel.spec import computation_to_dict
from millwheel.state import open_store
from millwheel.topology import Topology
from services.client import ControllerClient, UnavailableError, inject_messages
from services.rpc.convert import spec_to_proto
from services.rpc.security import Security
from tests.support.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]
#: The module of the user code the test pipelines name by import path
#: (``tests.support.pipelines:RunningTotal``): what their clusters must allow.
PIPELINE_CODE = "tests.support.pipelines"


class Cluster:
    def __init__(self, tmp: Path, store_url: str | None = None, heartbeat_timeout_s: float = 1.5,
                 controller_args: Iterable[str] = (), worker_args: Iterable[str] = (),
                 allow_code: str = "", env: dict[str, str] | None = None,
                 security: Security | None = None) -> None:
        """``allow_code``: the ``--allow-code`` of controller and workers (default none:
        built-in operators only); tests registering :data:`PIPELINE_CODE` pass it.
        ``env``: extra environment of every process (e.g. tokens, TLS settings);
        ``security``: the test's client settings (default: none)."""
        self.tmp = tmp
        self.env = dict(env or {})
        self.store_url = store_url or f"sqlite:///{tmp}/service.db"
        self.heartbeat_timeout_s = heartbeat_timeout_s
        allow = ["--allow-code", allow_code] if allow_code else []
        self.controller_args = [*allow, *controller_args]
        self.worker_args = [*allow, *worker_args]
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.controller: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        self._logs: list[Any] = []
        self.client = ControllerClient(self.address, timeout_s=10, security=security or Security())

    # -- processes -----------------------------------------------------------------------
    def _spawn(self, name: str, args: list[str], env_extra: dict[str, str] | None = None
               ) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "ab")  # noqa: SIM115
        self._logs.append(log)
        env = {**os.environ, "PYTHONPATH": str(ROOT), **self.env, **(env_extra or {})}
        return subprocess.Popen([sys.executable, "-m", "services.cli", *args], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start_controller(self) -> None:
        self.controller = self._spawn("controller", [
            "controller", "--store", self.store_url, "--port", str(self.port),
            "--heartbeat-timeout", str(self.heartbeat_timeout_s), *self.controller_args])
        wait_for(lambda: _ok(self.client.status), 20, "controller to answer")

    def start(self, workers: int = 2) -> Cluster:
        """The controller and ``workers`` workers, as most service tests run them."""
        self.start_controller()
        for _ in range(workers):
            self.start_worker()
        return self

    def start_worker(self, *extra: str, env: dict[str, str] | None = None,
                     controller: str | None = None) -> subprocess.Popen[bytes]:
        """A worker of this cluster's store; ``controller``: its ``--controller``
        (default this cluster's controller; a comma-separated list is allowed)."""
        n = len(self.workers)
        proc = self._spawn(f"worker{n}", [
            "worker", "--store", self.store_url, "--controller", controller or self.address,
            "--delivery-timeout", "2", "--batch-size", "100", *self.worker_args, *extra], env)
        self.workers.append(proc)
        wait_for(lambda: self.worker_id(proc) is not None, 20, f"worker {n} to join")
        return proc

    def worker_id(self, proc: subprocess.Popen[bytes]) -> str | None:
        for w in self.client.status().workers:
            if w.worker_id.endswith(f"/{proc.pid}") and w.alive:
                return str(w.worker_id)
        return None

    def ranges_of(self, worker_id: str) -> list[tuple[str, int, int]]:
        return [(r.node, r.range_id, r.token) for r in self.client.status().ranges
                if r.worker_id == worker_id]

    def wait_balanced(self, timeout: float = 20) -> None:
        def balanced() -> bool:
            s = self.client.status()
            live = [w for w in s.workers if w.alive]
            return bool(live) and all(r.worker_id for r in s.ranges) and \
                max(w.ranges for w in live) - min(w.ranges for w in live) <= 1
        wait_for(balanced, timeout, "ranges to be balanced")

    def stop(self) -> None:
        for p in [*self.workers, self.controller]:
            if p is not None and p.poll() is None:
                if _stopped(p.pid):
                    os.kill(p.pid, signal.SIGCONT)
                p.kill()
                p.wait(10)
        self.client.close()
        for log in self._logs:
            log.close()

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # -- a user's actions ----------------------------------------------------------------
    def register(self, topology: Topology) -> None:
        for inj in topology.injectors:
            self.client.register_injector(inj.name, inj.stream, inj.key_ranges)
        for spec in topology.computations:
            logged = [s for s in spec.all_outputs() if s in topology.log_streams]
            self.client.register_computation(spec_to_proto(spec), logged)

    def inject(self, injector: str, stream: str, records: list[Record], *, batch: int = 100,
               max_disorder_us: int = 0, done: bool = False,
               between: Callable[[int], None] | None = None) -> None:
        """Inject ``records`` message by message, retrying while the controller is away
        (record ids make a retried message a no-op); ``between(i)`` runs after message i."""
        msgs = list(inject_messages(injector, stream, records, batch, max_disorder_us, done))
        for i, msg in enumerate(msgs):
            deadline = time.monotonic() + 30
            while True:
                try:
                    self.client.inject([msg])
                    break
                except UnavailableError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)
            if between is not None:
                between(i)

    def wait_watermark(self, node: str, at_least: int = MAX_TIMESTAMP, timeout: float = 60) -> None:
        def reached() -> bool:
            wms = _ok(lambda: self.client.watermarks(node))
            return bool(wms) and wms[0].low_watermark >= at_least
        wait_for(reached, timeout, f"watermark of {node} to reach {at_least}")

    def outputs(self, stream: str) -> list[tuple[str, bytes, int, str]]:
        return sorted((r.key, r.value, r.timestamp, r.record_id)
                      for _seq, r in self.client.subscribe(stream))


class WatermarkMonitor:
    """Polls GetWatermark in the background and records any value that went backwards."""

    def __init__(self, client: ControllerClient, interval_s: float = 0.05) -> None:
        self.client = client
        self.last: dict[str, int] = {}
        self.backwards: list[tuple[str, int, int]] = []
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                wms = self.client.watermarks()
            except Exception:
                continue  # the controller may be restarting
            self.samples += 1
            for w in wms:
                prev = self.last.get(w.node)
                if prev is not None and w.low_watermark < prev:
                    self.backwards.append((w.node, prev, w.low_watermark))
                self.last[w.node] = max(prev or w.low_watermark, w.low_watermark)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def start_cluster(tmp: Path, workers: int = 2, **kwargs: Any) -> Cluster:
    """A :class:`Cluster` (``kwargs`` as its constructor's) started with ``workers``
    workers; stopped again if a process fails to start, so nothing is left running."""
    c = Cluster(tmp, **kwargs)
    try:
        return c.start(workers)
    except BaseException:
        c.stop()
        raise


@contextmanager
def alongside(during: Callable[[], None] | None) -> Iterator[None]:
    """Runs ``during`` (if any) in a thread while the block runs, and waits for it after:
    a fault injected while a call (an update, a rescale) is under way."""
    side = threading.Thread(target=during) if during is not None else None
    if side is not None:
        side.start()
    try:
        yield
    finally:
        if side is not None:
            side.join()


def sigkill_after(proc: subprocess.Popen[bytes], delay_s: float) -> Callable[[], None]:
    """A ``during`` for :func:`alongside`: kill -9 ``proc`` ``delay_s`` after it starts."""
    def kill() -> None:
        time.sleep(delay_s)
        os.kill(proc.pid, signal.SIGKILL)
    return kill


def inject_with_a_call(c: Cluster, recs: list[Record], batch: int, at: int, call: Callable[[], None],
                       during: Callable[[], None] | None = None) -> set[int]:
    """Inject ``recs`` into the ``events`` injector, and its end of input, 20 ms between
    messages; after message ``at``, ``call()`` (an update, say) with ``during`` alongside.
    Returns the indices of the records of message ``at + 2`` and later: sent after the
    call had answered."""
    answered = threading.Event()
    after: set[int] = set()

    def between(i: int) -> None:
        time.sleep(0.02)
        if answered.is_set():
            after.update(range((i + 1) * batch, min(len(recs), (i + 2) * batch)))
        if i == at:
            with alongside(during):
                call()
                answered.set()

    c.inject("events", "events", recs, batch=batch, done=True, between=between)
    return after


def expected_outputs(tmp: Path, topology: Topology, sources: dict[str, Any],
                     streams: Iterable[str]) -> dict[str, list[tuple[str, bytes, int, str]]]:
    """The failure-free run: the same topology and records through the local runner."""
    store = open_store(f"sqlite:///{tmp}/expected.db")
    try:
        LocalRunner(topology, store, sources).run()
        return {s: sorted((r.key, r.value, r.timestamp, r.record_id)
                          for _seq, r in store.read_log(s, 0, 10**9)) for s in streams}
    finally:
        store.close()


def spec_dicts(topology: Topology) -> list[dict[str, Any]]:
    return [computation_to_dict(c) for c in topology.computations]


def wait_for(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = pred()
        except Exception:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def _ok(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:
        return None


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "T"
    except OSError:
        return False
