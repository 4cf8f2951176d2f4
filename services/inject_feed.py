"""What one Inject call of :class:`services.client.ControllerClient` sends, kept for a resend."""

from __future__ import annotations

import threading
from typing import Iterator, cast

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
