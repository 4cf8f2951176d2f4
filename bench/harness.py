"""What several bench cases share, importing no case: every case imports it, never the reverse.

* :data:`ROOT`: the checkout (cwd and ``PYTHONPATH`` of the processes a case starts);
* :func:`log`, :func:`in_fresh_process` and :func:`run_case`: a case in a fresh spawned
  process (clean peak RSS, no warm caches or leftover threads from the previous case),
  its failure recorded instead of losing the run, one progress line on stderr;
* :class:`Stores`: fresh store URLs, a new SQLite file per case or a flushed private
  ``redis-server`` on a free port (never the system Redis); :func:`private_store`: one
  store of a kind of :data:`STORE_KINDS` for the service cases (SQLite, a private Redis
  with or without AOF, a private Redis Cluster); :func:`free_port`;
* :func:`process_cpu_s`: a running process's CPU seconds (the service cases' per-process figures);
* :func:`closed_windows`: which windows a watermark has just closed (when a service case
  starts its clock for a window result).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Callable

from bench.workload import EPOCH_US, WINDOW_US
from millwheel.record import MAX_TIMESTAMP

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def in_fresh_process(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as ex:
        return ex.submit(fn, *args, **kwargs).result()


class Stores:
    """Fresh store URLs: a new SQLite file per case, flushed private Redis servers."""

    def __init__(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="millwheel-bench-"))
        self._redis: dict[str, Any] = {}
        self._n = 0
        self.redis_error: str | None = None

    def url(self, kind: str) -> str | None:
        self._n += 1
        if kind == "sqlite":
            return f"sqlite:///{self.tmp}/case{self._n}.db"
        server = self._server(kind)
        if server is None:
            return None
        import redis

        client = redis.Redis.from_url(server.url)
        client.flushall()
        client.close()
        return str(server.url)

    def _server(self, kind: str) -> Any:
        if kind in self._redis:
            return self._redis[kind]
        try:
            from tests.support.redis_server import RedisServer

            (self.tmp / kind).mkdir(parents=True, exist_ok=True)
            server = RedisServer(appendonly=kind == "redis-aof", appendfsync="everysec",
                                 data_dir=self.tmp / kind)
        except Exception as exc:  # noqa: BLE001 - recorded as "not available"
            self.redis_error = f"{exc.__class__.__name__}: {exc}"
            server = None
        self._redis[kind] = server
        return server

    def close(self) -> None:
        for server in self._redis.values():
            if server is not None:
                server.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)


def run_case(results: list[dict[str, Any]], label: str, meta: dict[str, Any], fn: Callable[..., Any],
             *args: Any, summary: Callable[[dict[str, Any]], str] = lambda r: "", **kwargs: Any) -> dict[str, Any]:
    started = time.monotonic()
    log(f"  {label} ...")
    try:
        result = in_fresh_process(fn, *args, **kwargs)
        entry = {**meta, "result": result}
        ok = result.get("correct", {}).get("ok", True) if isinstance(result, dict) else True
        log(f"  {label}: {summary(result)}{'' if ok else '  OUTPUT WRONG: ' + result['correct']['detail']}"
            f"  [{time.monotonic() - started:.1f}s]")
    except Exception as exc:  # noqa: BLE001 - one failed case must not lose the run
        entry = {**meta, "error": f"{exc.__class__.__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
        log(f"  {label}: FAILED {exc.__class__.__name__}: {exc}")
    results.append(entry)
    return entry


def commit() -> str:
    """The checkout's short commit, ``-dirty`` when millwheel/ or bench/ have changes."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "millwheel", "bench"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def wait_until(pred: Callable[[], Any], what: str, timeout_s: float, poll_s: float = 0.5) -> None:
    """Poll ``pred`` until it is true (an exception counts as not yet: the service may
    not be up); RuntimeError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if pred():
                return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a running process so far (/proc/PID/stat; 0 if gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Store kinds: SQLite; one redis-server without AOF, AOF everysec, AOF always; a Redis
#: Cluster of 3 masters + 3 replicas with AOF always (tests/support/redis_cluster.py),
#: and the same with ``wait_replicas=1`` (each write waits for its replica: docs/redis.md).
STORE_KINDS = ("sqlite", "redis", "redis-aof", "redis-always", "redis-cluster", "redis-cluster-wait",
               "redis-cluster-noaof")


def private_store(kind: str, tmp: Path) -> tuple[str, Any]:
    if kind not in STORE_KINDS:
        raise ValueError(f"store kind {kind!r} is not one of {', '.join(STORE_KINDS)}")
    if kind == "sqlite":
        return f"sqlite:///{tmp}/service.db", None
    if kind == "redis-cluster-noaof":  # 3 masters, no replicas, no AOF: the store sharded (scale-out)
        from tests.support.redis_cluster import RedisClusterNodes

        nodes = RedisClusterNodes(replicas=0, appendonly=False)
        return nodes.url, nodes
    if kind.startswith("redis-cluster"):  # 3 masters + 3 replicas, AOF always (bench/cases/ha.py)
        from tests.support.redis_cluster import RedisClusterNodes

        nodes = RedisClusterNodes()
        return nodes.url + ("?wait_replicas=1" if kind == "redis-cluster-wait" else ""), nodes
    from tests.support.redis_server import RedisServer

    server = RedisServer(appendonly=kind != "redis", appendfsync="always" if kind == "redis-always" else "everysec")
    return server.url, server


def closed_windows(watermark: int, seen: dict[int, float]) -> list[int]:
    """Window starts the watermark has newly passed the end of (the final, infinite
    watermark of end of input is not a window closing in time: excluded)."""
    if watermark >= MAX_TIMESTAMP:
        return []
    out = []
    start = EPOCH_US - WINDOW_US
    while start + WINDOW_US <= watermark:
        if start not in seen:
            out.append(start)
        start += WINDOW_US
    return out
