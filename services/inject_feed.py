"""What one Inject call of :class:`services.client.ControllerClient` sends, kept for a
resend; and the messages themselves (:func:`inject_messages`)."""

from __future__ import annotations

import hashlib
import secrets
import threading
from typing import Iterable, Iterator, cast

from millwheel.record import MIN_TIMESTAMP, Record

from .generated import millwheel_pb2 as pb


class CallFeed:
    """Feeds one Inject call from ``source``, up to ``limit`` messages, keeping what it
    handed out (for a resend) and whether the source ended or failed.

    gRPC pulls the messages on a thread of its own; the feed is an iterator with a lock,
    so that after a failed call the caller can take the rest (:meth:`finish`) while
    that thread may still be inside it. :meth:`stop` makes that thread read nothing
    more and waits until it is out of ``source``: a process that exits while that
    thread holds stdin's buffer lock aborts at interpreter shutdown
    (``Fatal Python error: _enter_buffered_busy``)."""

    _END = object()

    def __init__(self, source: Iterator[pb.InjectRequest], limit: int) -> None:
        self.source = source
        self.limit = limit
        self.sent: list[pb.InjectRequest] = []
        self.failed: BaseException | None = None
        self.ended = False
        self._stopped = False
        self._lock = threading.Lock()

    def __iter__(self) -> CallFeed:
        return self

    def __next__(self) -> pb.InjectRequest:
        with self._lock:
            if self._stopped or self.ended or self.failed is not None or len(self.sent) >= self.limit:
                raise StopIteration
            try:
                msg = next(self.source, self._END)
            except BaseException as exc:
                self.failed = exc
                raise
            if msg is self._END:
                self.ended = True
                raise StopIteration
            self.sent.append(cast(pb.InjectRequest, msg))
            return cast(pb.InjectRequest, msg)

    def finish(self) -> None:
        """Take every message this call still has to send (they join the resend)."""
        for _ in self:
            pass

    def stop(self, wait_s: float = 5.0) -> None:
        self._stopped = True
        if self._lock.acquire(timeout=wait_s):
            self._lock.release()

    def resume(self, start: int) -> Iterator[pb.InjectRequest]:
        """What a new call sends after an idle one was ended: the messages handed out
        from ``start`` on (one may still be on its way to the ended call, from a thread
        blocked in the source), then on from the source, without reading ahead."""
        i = start
        while True:
            while i < len(self.sent):
                yield self.sent[i]
                i += 1
            try:
                next(self)  # appends to self.sent
            except StopIteration:
                if i >= len(self.sent):
                    return


def inject_messages(
    injector: str, stream: str, records: Iterable[Record], batch: int = 500,
    max_disorder_us: int | None = 0, done: bool = False,
) -> Iterator[pb.InjectRequest]:
    """Batches of records as Inject messages. Each message carries the watermark
    ``max timestamp so far - max_disorder_us`` (none if ``max_disorder_us`` is None);
    ``done`` ends with ``done=true`` (no more records, ever: the injector is closed).

    Every record without an ID gets one here, ``INJECTOR/cSESSION/MESSAGE/INDEX``
    (SESSION random per call of this function), fixed before anything is sent: a
    message :meth:`services.client.ControllerClient.inject` resends after a controller failed mid-call
    carries the same IDs, and consumers, which drop record IDs they have already seen,
    make the resend a no-op. Records keep the IDs they have. (The same records injected
    again by another call get other IDs: give your own for exactly-once across calls.)"""
    session = secrets.token_hex(6)
    # Record IDs are at most 256 bytes: a long injector name is replaced by its digest.
    name = injector if len(injector.encode()) <= 160 else hashlib.sha256(injector.encode()).hexdigest()[:32]
    prefix = f"{name}/c{session}/"
    max_seen = MIN_TIMESTAMP
    buf: list[pb.Record] = []
    index = 0

    def message(final: bool) -> pb.InjectRequest:
        msg = pb.InjectRequest(injector=injector, stream=stream, records=buf)
        if final and done:
            msg.done = True
        elif max_disorder_us is not None and max_seen > MIN_TIMESTAMP:
            msg.watermark = max_seen - max_disorder_us
        return msg

    for rec in records:
        buf.append(pb.Record(key=rec.key, value=rec.value, timestamp=rec.timestamp,
                             id=rec.record_id or f"{prefix}{index}/{len(buf)}"))
        max_seen = max(max_seen, rec.timestamp)
        if len(buf) >= batch:
            yield message(False)
            buf = []
            index += 1
    yield message(True)
