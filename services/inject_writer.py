"""A writer of an injector: records straight to the workers owning their key ranges,
the writer's own watermark to the controller (docs/service.md, "Parallel ingestion").

::

    with ControllerClient() as client, InjectWriter(client, "clicks", stream="clicks") as w:
        w.write(records)          # pb.Record or millwheel.record.Record; IDs given if missing
        w.advance(watermark)      # every record below it is durable first
        w.done()                  # this writer sends no more (the injector closes when all are)

How it goes:

1. ``InjectRoutes`` (at start, and again whenever a worker says a range is not its own or
   a link breaks): the injector's key-range count and each range's owner. It registers
   the injector on first use (``stream``) and this writer, whose watermark then holds
   the injector back.
2. ``write``: every record gets an ID if it has none (``INJECTOR/wWRITER/SESSION/N``, fixed
   before the first send) and its range, ``crc32(key) % key_ranges``; a range's records
   go once ``batch`` of them are queued (filled across ``write`` calls; the rest at
   :meth:`flush`) to the range's owner on a kept-open ``Ingest.Write`` stream per worker,
   up to ``window`` batches unacked per worker. An ack (or a refusal) is read when more
   room is needed or at :meth:`flush`.
3. A batch refused as NOT_OWNER, or lost with its link, is sent again to the range's owner
   as the routes say by then (routes fetched again, waiting while the range has none); a
   BUSY one (the range's outbox is full: the pipeline is slower than its writers) after
   a growing pause. A resend is exactly-once because its records keep their IDs:
   consumers drop an ID they have seen. Past ``timeout_s`` without progress it raises.
4. ``advance(watermark)``: :meth:`flush` (every record written so far acked), then
   ``WriterWatermark``. Watermarks sent more often than every ``watermark_every_s`` are
   coalesced (the last one wins at the next send, or at :meth:`flush`/``done``).
5. A thread sends a keep-alive ``WriterWatermark`` when the writer has been quiet for a
   quarter of the controller's writer expiry: a live writer never expires.
"""

from __future__ import annotations

import hashlib
import random
import secrets
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Iterable, TypeVar

import grpc

from millwheel.errors import MillWheelError
from millwheel.keys import key_range
from millwheel.record import MIN_TIMESTAMP, Record
from millwheel.runtime.routing import record_of

from .client import ControllerClient
from .generated import millwheel_pb2 as pb
from .generated import millwheel_pb2_grpc as pb_grpc
from .rpc.convert import add_records
from .rpc.status import UnavailableError, error_class
from .rpc.worker_link import LinkError, PeerLink

_RAISE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
          grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.PERMISSION_DENIED,
          grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNIMPLEMENTED}


def refused(exc: LinkError) -> MillWheelError:
    """A batch a worker refused for what it is: the error of its status (``.status``), as
    the controller client raises them, with the worker's message."""
    assert exc.code is not None
    err = error_class(exc.code)(f"{exc.details} [{exc.code.name}]")
    err.status = exc.code  # type: ignore[attr-defined]
    return err


Piece = tuple[int, list[Record]]
ACK_TIMEOUT_S = 10.0  #: a batch unacked this long: its link is reset and the batch sent again
T = TypeVar("T")


class InjectWriter:
    """One writer of an injector (see the module docstring). ``writer``: its name, which
    its watermark is kept under (default: a random one); ``key_ranges``: the injector's,
    if this registers it (0: its consumers' most); ``batch``: records per Write message;
    ``window``: messages unacked per worker; ``timeout_s``: how long without progress
    before a write or a controller call gives up."""

    def __init__(
        self, client: ControllerClient, injector: str, *, stream: str = "", writer: str | None = None,
        key_ranges: int = 0, batch: int = 2000, window: int = 8, timeout_s: float = 60.0,
        watermark_every_s: float = 0.2,
    ) -> None:
        self.client = client
        self.injector = injector
        self.stream = stream
        self.name = writer or f"w{secrets.token_hex(6)}"
        self.batch = batch
        self.window = window
        self.timeout_s = timeout_s
        self.watermark_every_s = watermark_every_s
        self.written = 0  # records acked
        self.resent = 0  # batches sent again (moved range, lost link, busy)
        self.route_fetches = 0
        self._key_ranges = key_ranges
        self._owners: list[str] = []
        self._expiry_s = 30.0
        self._links: dict[str, PeerLink] = {}
        self._outstanding: deque[tuple[Piece, Future[Any]]] = deque()
        self._queued: list[list[Record]] = []  # per range: records not sent yet (under ``batch``)
        long_name = len(injector.encode()) + len(self.name.encode()) > 160
        stem = hashlib.sha256(f"{injector}/{self.name}".encode()).hexdigest()[:32] if long_name else \
            f"{injector}/w{self.name}"
        self._prefix = f"{stem}/{secrets.token_hex(6)}/"  # a session: the same writer name later gets other IDs
        self._next_id = 0
        self._wanted: int | None = None  # a watermark not sent yet (coalesced)
        self._sent_at = 0.0
        self.watermark = MIN_TIMESTAMP  # the injector's, as the controller last answered
        self._closed = threading.Event()
        self._contacted = False  # a controller has answered this writer
        self._call_lock = threading.Lock()
        self._routes(first=True)
        self._keepalive = threading.Thread(target=self._keep_alive, name=f"writer-{self.name}", daemon=True)
        self._keepalive.start()

    def __enter__(self) -> InjectWriter:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is not None:  # a failed write: send no watermark past what is not in
            self._shut()
        else:
            self.close()

    # -- routes -------------------------------------------------------------------------
    def _routes(self, first: bool = False) -> None:
        req = pb.InjectRoutesRequest(injector=self.injector, stream=self.stream, writer=self.name,
                                     key_ranges=self._key_ranges if first else 0)
        resp = self._controller(lambda: self.client.inject_routes(req))
        self.route_fetches += 1
        self._key_ranges = resp.key_ranges
        self._owners = [o.worker_address for o in sorted(resp.ranges, key=lambda o: o.range_id)]
        self._expiry_s = resp.writer_expiry_us / 1e6 or 30.0
        self.watermark = resp.watermark

    def _controller(self, call: Callable[[], T]) -> T:
        """A controller call, tried again while no controller leads (a failover, a restart)
        for up to ``timeout_s``, once one has answered this writer."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                answer = call()
                self._contacted = True
                return answer
            except UnavailableError:
                # Before any answer, no service there is the likelier story: said at once.
                if not self._contacted or time.monotonic() > deadline or self._closed.is_set():
                    raise
                time.sleep(0.2)

    def _link(self, address: str) -> PeerLink:
        link = self._links.get(address)
        if link is None:
            sec = self.client.security
            chan = sec.open_channel(address, sec.client_token, [
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.max_send_message_length", 64 * 1024 * 1024)])
            link = self._links[address] = PeerLink(address, self.window, chan=chan,
                                                   open_stream=lambda ch: pb_grpc.IngestStub(ch).Write)
        return link

    # -- records ------------------------------------------------------------------------
    def _with_ids(self, records: Iterable[pb.Record | Record]) -> Iterable[Record]:
        """``records`` as millwheel Records, each with an ID (given here if it had none).
        They are queued as Records and put into a message at send time
        (:func:`~services.rpc.convert.add_records`: half the cost of a ``pb.Record`` each)."""
        for rec in records:
            if not isinstance(rec, Record):
                rec = record_of(rec.key, rec.value, rec.timestamp, rec.id)
            if not rec.record_id:
                rec = record_of(rec.key, rec.value, rec.timestamp, f"{self._prefix}{self._next_id}")
                self._next_id += 1
            yield rec

    def write(self, records: Iterable[pb.Record | Record]) -> None:
        """Queue ``records`` for their ranges' owners (step 2): a range's records go as a
        batch once ``batch`` of them are queued, across calls (small writes still make
        full batches), the rest at :meth:`flush`; durable once :meth:`flush` (or
        :meth:`advance`) returns."""
        n = self._key_ranges
        if len(self._queued) != n:
            self._queued = [[] for _ in range(n)]
        queued = self._queued
        for m in self._with_ids(records):
            r = key_range(m.key, n) if n > 1 else 0
            group = queued[r]
            group.append(m)
            if len(group) >= self.batch:
                queued[r] = []
                self._send((r, group))

    def _send_queued(self) -> None:
        for r, group in enumerate(self._queued):
            if group:
                self._queued[r] = []
                self._send((r, group))

    def _send(self, piece: Piece) -> None:
        while len(self._outstanding) >= self.window * max(1, len(self._links)):
            self._settle_one()
        fut = self._post(piece)
        if fut is None:
            self._resend([piece])
            return
        self._outstanding.append((piece, fut))

    def _owner(self, r: int) -> str:
        """The address range ``r`` is written to as the routes last said ("": none)."""
        return self._owners[r] if r < len(self._owners) else ""

    def _post(self, piece: Piece) -> Future[Any] | None:
        """``piece`` on its range owner's link: the future of its ack, or None when the
        range has no owner or the link no room."""
        r, records = piece
        address = self._owner(r)
        if not address:
            return None
        req = pb.WriteRequest(injector=self.injector, range_id=r)
        add_records(req.records, records)
        return self._link(address).send(req, wait_s=self.timeout_s)

    def _settle_one(self) -> None:
        piece, fut = self._outstanding.popleft()
        if self._ok(piece, fut) is not None:
            rest = [piece]
            self._resend(rest)

    def _ok(self, piece: Piece, fut: Future[Any]) -> str | None:
        """None if the batch was acked OK, else why not (raises for a refusal of what it is)."""
        try:
            ack = fut.result(timeout=ACK_TIMEOUT_S)
        except FutureTimeout:  # a stopped or partitioned worker: its stream is abandoned
            self._reset_link_of(piece, f"no ack within {ACK_TIMEOUT_S:.0f} s")
            return "no ack in time"
        except LinkError as exc:
            if exc.code in _RAISE:
                raise refused(exc) from None
            return str(exc)
        if ack.status == pb.WriteAck.OK:
            self.written += len(piece[1])
            return None
        if ack.status == pb.WriteAck.BUSY:
            return "busy"
        return ack.message or pb.WriteAck.Status.Name(ack.status)

    def _reset_link_of(self, piece: Piece, why: str) -> None:
        link = self._links.get(self._owner(piece[0]))
        if link is not None:
            link.reset(why)

    def _resend(self, pieces: list[Piece]) -> None:
        """Step 3: each piece sent alone until acked, routes fetched again between tries."""
        deadline = time.monotonic() + self.timeout_s
        attempt = 0
        why = ""
        while pieces:
            self.resent += len(pieces)
            attempt += 1
            busy = why == "busy"
            time.sleep(min(1.0, 0.01 * 2 ** min(attempt, 7)) * random.uniform(0.5, 1.0))
            if not busy:
                try:
                    self._routes()
                except MillWheelError as exc:
                    why = str(exc)
            left = []
            for piece in pieces:
                fut = self._post(piece)
                if fut is not None:
                    problem = self._ok(piece, fut)
                elif self._owner(piece[0]):
                    problem = "no room on the link"
                else:
                    problem = f"range {piece[0]} of injector {self.injector!r} has no live owner"
                if problem is not None:
                    why = problem
                    left.append(piece)
                else:
                    deadline = time.monotonic() + self.timeout_s  # progress
                    attempt = 0
            pieces = left
            if pieces and time.monotonic() > deadline:
                raise UnavailableError(f"injector {self.injector!r}: {len(pieces)} batches not written "
                                       f"within {self.timeout_s:.0f} s: {why}")

    def flush(self) -> None:
        """Send what is queued and wait until every record written so far is acked
        (resending what must be)."""
        self._send_queued()
        while self._outstanding:
            self._settle_one()

    # -- watermarks ---------------------------------------------------------------------
    def advance(self, watermark: int, *, now: bool = False) -> None:
        """This writer's records from now on are at or after ``watermark`` (step 4)."""
        self._wanted = watermark if self._wanted is None else max(self._wanted, watermark)
        if now or time.monotonic() - self._sent_at >= self.watermark_every_s:
            self._send_watermark()

    def _send_watermark(self, done: bool = False) -> None:
        self.flush()
        req = pb.WriterWatermarkRequest(injector=self.injector, writer=self.name, done=done)
        if self._wanted is not None and not done:
            req.watermark = self._wanted
        self._call(req)
        self._wanted = None

    def _call(self, req: pb.WriterWatermarkRequest) -> None:
        with self._call_lock:
            resp = self._controller(lambda: self.client.writer_watermark(req))
            self._sent_at = time.monotonic()
            self.watermark = resp.watermark

    def done(self) -> None:
        """Flush; this writer sends no more records (its watermark is +inf). The injector
        closes once every live writer is done."""
        self._send_watermark(done=True)

    def _keep_alive(self) -> None:
        while not self._closed.wait(max(0.05, self._expiry_s / 4)):
            if time.monotonic() - self._sent_at >= self._expiry_s / 4:
                try:
                    self._call(pb.WriterWatermarkRequest(injector=self.injector, writer=self.name))
                except Exception:  # noqa: BLE001 - tried again at the next beat
                    pass

    def close(self) -> None:
        """Flush what was written (and a coalesced watermark), stop the keep-alive, close
        the links. A writer closed without :meth:`done` expires at the controller."""
        try:
            if self._wanted is not None:
                self._send_watermark()
            else:
                self.flush()
        finally:
            self._shut()

    def _shut(self) -> None:
        self._closed.set()
        for link in self._links.values():
            link.close()
