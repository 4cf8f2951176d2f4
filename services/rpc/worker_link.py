"""A sender's link to one destination worker: one bidirectional Deliver stream.

Batches go out on the stream and each is acked by batch id once the receiver has
checkpointed it. At most ``max_inflight`` batches are unacked per destination: a
sender that finds no room keeps its records and tries again when an ack frees room
(backpressure; the time blocked is measured), so a slow stage slows its senders and
nothing is dropped. A broken or stuck stream fails every
pending batch; the caller retries (with backoff) to whoever owns the range by then.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterator

import grpc

from ..generated import millwheel_pb2 as pb
from ..generated import millwheel_pb2_grpc as pb_grpc
from ..metrics import PrometheusSensors
from .server import channel

log = logging.getLogger("millwheel.worker")
_CLOSE = object()


class LinkError(Exception):
    """The stream to a destination broke; pending batches must be retried. ``code``: the
    status the receiver ended the stream with, if it did (None: the link broke)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, details: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.details = details


class PeerLink:
    """``chan``/``open_stream``: another stream of the same shape than the Worker service's
    Deliver (a writer's Ingest.Write, services/inject_writer.py) on its own channel."""

    def __init__(self, address: str, max_inflight: int, sensors: PrometheusSensors | None = None, *,
                 chan: grpc.Channel | None = None,
                 open_stream: Callable[[grpc.Channel], Callable[[Iterator[Any]], Any]] | None = None) -> None:
        self.address = address
        self.sensors = sensors or PrometheusSensors("link")
        self._channel = chan if chan is not None else channel(address)
        self._stub = (open_stream or (lambda ch: pb_grpc.WorkerStub(ch).Deliver))(self._channel)
        self._room = threading.BoundedSemaphore(max_inflight)
        self._lock = threading.Lock()
        self._pending: dict[int, Future[Any]] = {}
        self._ids = itertools.count(1)
        self._queue: queue.Queue[Any] | None = None
        self._call: Any = None
        self._blocked_since: float | None = None
        self._closed = False

    def idle(self) -> bool:
        """No batch is waiting for its ack."""
        with self._lock:
            return not self._pending

    def send(self, batch: Any, wait_s: float) -> Future[Any] | None:
        """Queue ``batch``, waiting up to ``wait_s`` for room; None if none freed up."""
        deadline = time.monotonic() + wait_s
        while True:
            fut = self.try_send(batch)
            if fut is not None or time.monotonic() >= deadline:
                return fut
            if self._room.acquire(timeout=max(0.0, deadline - time.monotonic())):
                self._room.release()

    def try_send(self, batch: Any) -> Future[Any] | None:
        """Queue ``batch``, or None at once if ``max_inflight`` batches are unacked (the
        caller keeps the records and tries again when an ack frees room). The time
        from the first refusal to the next accepted batch counts as backpressure. A
        closed link fails the batch (the caller resends it to the range's owner)."""
        if self._closed:
            failed: Future[Any] = Future()
            failed.set_exception(LinkError(f"link to {self.address} is closed"))
            return failed
        if not self._room.acquire(blocking=False):
            if self._blocked_since is None:
                self._blocked_since = time.monotonic()
            return None
        if self._blocked_since is not None:
            self.sensors.backpressure(self.address, time.monotonic() - self._blocked_since)
            self._blocked_since = None
        fut: Future[Any] = Future()
        with self._lock:
            if self._queue is None:
                self._open()
            batch.batch_id = next(self._ids)
            self._pending[batch.batch_id] = fut
            assert self._queue is not None
            self._queue.put(batch)
            self.sensors.inflight(self.address, len(self._pending))
        return fut

    def _open(self) -> None:
        q: queue.Queue[Any] = queue.Queue()

        def requests() -> Iterator[pb.DeliverBatch]:
            while True:
                item = q.get()
                if item is _CLOSE:
                    return
                yield item

        self._queue = q
        self._call = self._stub(requests())
        threading.Thread(target=self._read, args=(self._call, q), daemon=True,
                         name=f"link-{self.address}").start()

    def _read(self, call: Any, q: queue.Queue[Any]) -> None:
        error: BaseException = LinkError(f"stream to {self.address} ended")
        try:
            for ack in call:
                with self._lock:
                    fut = self._pending.pop(ack.batch_id, None)
                    self.sensors.inflight(self.address, len(self._pending))
                if fut is not None:
                    self._room.release()
                    fut.set_result(ack)
        except grpc.RpcError as exc:
            error = LinkError(f"stream to {self.address} failed: {exc.code().name}: {exc.details()}", exc.code(),
                              str(exc.details()))
        except Exception as exc:  # pragma: no cover - defensive
            error = LinkError(f"stream to {self.address} failed: {exc}")
        self._fail(q, error)

    def _fail(self, q: queue.Queue[Any], error: BaseException) -> None:
        with self._lock:
            if self._queue is not q:
                return
            self._queue = None
            pending, self._pending = self._pending, {}
            self.sensors.inflight(self.address, 0)
        q.put(_CLOSE)
        for fut in pending.values():
            self._room.release()
            if not fut.done():
                fut.set_exception(error)

    def reset(self, reason: str, quiet: bool = False) -> None:
        """Abandon the stream (e.g. a batch is overdue: the receiver may be stopped)."""
        with self._lock:
            q, call = self._queue, self._call
        if q is None:
            return
        if not quiet:
            log.warning("resetting link to %s: %s", self.address, reason)
        if call is not None:
            call.cancel()
        self._fail(q, LinkError(f"link to {self.address} reset: {reason}"))

    def close(self) -> None:
        self._closed = True
        self.reset("closing", quiet=True)
        self._channel.close()
