"""CreateSavepoint and RestoreSavepoint: a consistent cut of the whole service as one
file (millwheel/savepoint/), and that file restored into an empty service on any store.

**The cut** (:meth:`Savepoints._cut`). Under the controller's lock, every key range
(computations' and injectors') gets a fresh sequencer token from the store for *no
owner* and is held (``Assigner.held``: placed nowhere, not re-issued). From that store
write on, no worker can write anything of any range: a checkpoint, an ack, a
watermark, an attempt count under the old token is fenced. The lock is then released
and everything is read from the store without it (issue 22: a cut of 1M keys held it
85 s, no heartbeat answered): the store is the cut. What a batch checkpointed just
before is in it whole (its state, timers, productions, consumed IDs); what it had not
is not, and its records are still pending in their producers' outboxes (their acks
were fenced), so they are delivered again (here after the cut, there after a restore)
and the consumer's consumed IDs drop what was already taken. Log appends are not
fenced, but every entry appended late is still in the outbox it came from, and
appending it again in the restored service is a no-op (by record ID). Under the lock
again, the ranges are placed back on the workers that ran them (with ``stop``: on
none). With a stop, Inject is refused from the fence on, but the stop is stored only once the
file is complete and sent (:class:`_StopGate`, issue 34, item 4): after its last chunk
was taken by the call, before the "done" answer. A cut that fails (the store, the
spool's disk) stops nothing and places the ranges again; a call that ends before the
whole file went out (the client gone, cancelled, its deadline passed), during the cut
or during the transfer, undoes the stop the same way (the client keeps no file: it
keeps one only with the "done" answer); a controller killed before the stop is stored
leaves no stop (the next leader places the ranges: the service runs on, and there is
no file either). Once stored, a new leader keeps it. The hold is the leader's memory: a controller killed during the
read leaves the ranges fenced for nobody, and the next leader places them as usual. The registry's lock is held for the
whole cut, so registrations, updates, unregistrations and rescales wait for it.

A rescale copying a computation's data (services/controller/rescale.py: off the lock,
its ranges fenced) is waited for before the cut: the cut would otherwise read a half
moved layout, and its fresh tokens would fence the rescale's writes.

The file is written to a temporary file during the cut, and sent after the ranges are
placed again: processing is paused for the fence and the reads, not for the transfer.

**Restore** (:meth:`Savepoints.restore`): one at a time per controller (another is
refused before a byte of it is read). The upload is checked as it arrives (issue 34,
item 7: it was spooled whole before any check): magic, format version and an empty
registry on its first bytes, before a spool is opened; each chunk's frames
(format.Verifier) and the total against ``max_restore_bytes`` (--max-restore-bytes)
before the chunk is spooled; the first refusal ends the call and closes (removes) the
spool. Then its checksum, every frame checked, its registry admitted as a registration
(nothing imported), and only then, in an empty service (nothing ever registered, no
state under the file's names), written range by range under fresh tokens; the
registry last, in one write, so workers see nothing before it is complete.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import tempfile
import threading
import time
from typing import IO, Any, Callable, Iterator

import grpc

from millwheel.errors import InvalidSpecError, ResourceLimitError
from millwheel.nodes import sink_node
from millwheel.savepoint import capture, restore
from millwheel.savepoint.format import (
    DEFAULT_MAX_RESTORE_BYTES,
    MAX_FILE_BYTES,
    SavepointFileError,
    Verifier,
    Writer,
    frames,
)

from ..generated import millwheel_pb2 as pb
from ..rpc.status import PreconditionError, UnavailableError
from .assign import STOPPED_KEY
from .drain import HandOver, drain, drained
from .ha import Leadership
from .plane import ControlPlane
from .rescale_journal import COPYING
from .savepoint_registry import CarriedRegistry, admit, registry_dict

log = logging.getLogger("millwheel.controller")

LAST_KEY = "savepoint/last"  # what the console shows of the last savepoint taken
RESTORING_KEY = "savepoint/restoring"  # sha256 of a restore under way (a retry of it may go on)
CHUNK = 1 << 20
MAX_SINK_TOKEN = 1_000_000  #: a restored sink's token floor (reached by as many store bumps) at most
PROGRESS_EVERY_S = 0.5
RESCALE_POLL_S = 0.2  #: how often a cut waiting for a rescale's copy looks again


class Savepoints:
    """CreateSavepoint (with its drain) and RestoreSavepoint, on the plane; a standby
    redirects them to the leader (``leadership``); a drain closes injectors through
    ``hand_over`` (services/controller/inject.py)."""

    def __init__(self, plane: ControlPlane, leadership: Leadership, hand_over: HandOver,
                 max_restore_bytes: int = DEFAULT_MAX_RESTORE_BYTES) -> None:
        if not 0 < max_restore_bytes <= MAX_FILE_BYTES:
            raise InvalidSpecError(f"--max-restore-bytes must be 1..{MAX_FILE_BYTES} (the format's limit), "
                                   f"got {max_restore_bytes}")
        self.plane = plane
        self.leadership = leadership
        self.hand_over = hand_over
        self.max_restore_bytes = max_restore_bytes
        self._restoring = threading.Lock()  # held for a whole RestoreSavepoint: one at a time

    # -- create ----------------------------------------------------------------------------
    def create(self, request: Any, context: grpc.ServicerContext) -> Iterator[pb.CreateSavepointResponse]:
        if not self.plane.leading():
            raise self.leadership.redirect(context)
        spool = tempfile.TemporaryFile(prefix="millwheel-savepoint-")  # noqa: SIM115 (closed below)
        updates: queue.Queue[tuple[str, int, str] | BaseException | pb.SavepointSummary] = queue.Queue()
        gate = _StopGate(self.plane)
        if not context.add_callback(gate.end):  # the call is over already
            gate.end()
        worker = threading.Thread(target=self._cut_thread, args=(bool(request.stop), spool, updates, request, gate),
                                  name="savepoint", daemon=True)
        worker.start()
        try:
            while True:
                try:
                    item = updates.get(timeout=PROGRESS_EVERY_S)
                except queue.Empty:
                    continue
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, pb.SavepointSummary):
                    summary = item
                    break
                yield pb.CreateSavepointResponse(phase=item[0], items=item[1], detail=item[2])
            spool.seek(0)
            sent = 0
            while context.is_active():
                data = spool.read(CHUNK)
                if not data:
                    break
                sent += len(data)
                yield pb.CreateSavepointResponse(phase="sending", chunk=data)
            if sent != summary.bytes or not context.is_active():
                return  # the client is gone without the file: the stop is undone (finally)
            gate.store()  # every byte is out: now the stop holds
            yield pb.CreateSavepointResponse(phase="done", summary=summary)
        finally:
            worker.join()
            gate.undo("the call ended before the file was sent whole")  # (nothing once stored)
            with contextlib.suppress(OSError):  # (a full disk fails the flush again: the cut's error is the one)
                spool.close()

    def _cut_thread(self, stop: bool, spool: IO[bytes], updates: queue.Queue[Any], request: Any,
                    gate: _StopGate) -> None:
        try:
            if request.drain:  # services/controller/drain.py; then stop with savepoint
                drain(self.plane, self.hand_over, request.drain_timeout_ms / 1000,
                      lambda phase, n, text: updates.put((phase, n, text)))
                stop = True
            summary = self._cut(stop, spool, lambda phase, n: updates.put((phase, n, "")), gate)
            summary.drained = bool(request.drain) and drained(dict(summary.counts))
            updates.put(summary)
        except BaseException as exc:  # handed to the RPC's thread, which raises it
            updates.put(exc)

    def _cut(self, stop: bool, spool: IO[bytes], report: Callable[[str, int], None],
             gate: _StopGate) -> pb.SavepointSummary:
        """Fence every range, read everything into ``spool``, let the workers go on (with
        ``stop``: none; the stop is ``gate``'s to store or undo)."""
        items = 0
        last = [0.0]

        def progress(_kind: str, n: int) -> None:
            nonlocal items
            items += n
            if time.monotonic() - last[0] >= PROGRESS_EVERY_S:
                last[0] = time.monotonic()
                report("reading", items)

        p = self.plane
        store = p.store
        with self._between_rescales(report):  # the registry's lock: no registration, update, rescale
            started = time.monotonic()
            report("fencing", 0)
            with p.lock:
                a = p.assigner
                was_stopped = a.stopped
                fence: dict[tuple[str, int], str | None] = {}
                try:
                    fence = self._fence_all(stop)
                    created = p.clock.now_us()
                    reg = registry_dict(p.registry)
                    carried = CarriedRegistry(p.registry.topology, {}, {})
                    # Sinks' tokens: an external system keeps the last one that wrote it, and
                    # refuses lower ones; a restore starts the sinks above these.
                    sink_tokens = {sink_node(s.name): store.current_token(sink_node(s.name), 0)
                                   for s in p.registry.topology.sinks}
                except Exception:  # the store failed: whatever was fenced is placed again
                    a.stopped = was_stopped
                    a.release(fence)
                    raise
            fenced_s = time.monotonic() - started
            whole = False
            try:  # off the controller's lock: every range is fenced for nobody, so the store is the cut
                writer = Writer(spool)
                writer.frame({"t": "header", "created_us": created, "stopped": stop, "registry": reg,
                              "source_store": store.url.split(":", 1)[0], "sink_tokens": sink_tokens})
                counts: dict[str, int] = {}
                capture.capture_nodes(store, carried.nodes(), writer, counts, progress)
                logs = capture.capture_logs(store, sorted(carried.streams()), writer, counts, progress)
                digest = writer.finish()
                spool.flush()
                whole = True
            finally:
                with p.lock:
                    if not whole:  # the cut failed: it stops nothing, its ranges are placed again
                        a.stopped = was_stopped
                    placing = time.monotonic()
                    moves = a.release(fence)  # back on their owners (none with stop)
                    lock_s = fenced_s + time.monotonic() - placing
                    held_by_another = p.assigner is not a or not p.leading()
                if whole and stop and not was_stopped:
                    gate.cut(a)  # stored once the file is sent whole (or undone now: the call is over)
            pause_us = int((time.monotonic() - started) * 1e6)
            if held_by_another:  # deposed during the read: a new leader may have let workers write
                raise UnavailableError("savepoint: this controller stopped leading while the cut was read "
                                       "(its file may not be one cut); nothing was written: take it again")
        topo = p.registry.topology
        store.put_meta(LAST_KEY, json.dumps({"created_us": created, "bytes": writer.bytes, "sha256": digest,
                                                  "stopped": stop, "pause_us": pause_us}).encode())
        log.warning("savepoint taken%s: %d bytes, %d ranges, cut paused processing %.3f s (the controller's lock "
                    "held %.3f s of it; %d ranges placed again)", " (service stopped)" if stop else "",
                    writer.bytes, counts.get("ranges", 0), pause_us / 1e6, lock_s, moves)
        return pb.SavepointSummary(sha256=digest, bytes=writer.bytes, created_us=created, pause_us=pause_us,
                                   stopped=stop, counts=counts, computations=len(topo.computations),
                                   injectors=len(topo.injectors),
                                   log_last={s: last_seq for s, (_start, last_seq) in logs.items()})

    def _fence_all(self, stop: bool) -> dict[tuple[str, int], str | None]:
        """Every range (computations', injectors', sinks') given a fresh token for nobody,
        here and now (the caller holds the lock; range moves take theirs off it): from
        each acquire on, whoever ran the range can write nothing of it. Without ``stop``
        the ranges are held (placed nowhere, not re-issued) until :meth:`Assigner.release`
        places them again; returns who ran each. With ``stop`` the service counts as
        stopped from here on (Inject and replays refused, nothing placed); the stop is
        stored only once the cut is read whole (:meth:`_cut`)."""
        a = self.plane.assigner
        if stop:
            a.stopped = True
        previous = {unit: owner.worker_id for unit, owner in a.units.items()}
        a.held.update(a.units)
        for unit in sorted(a.units):
            a.move_now(unit, None)
        return previous

    @contextlib.contextmanager
    def _between_rescales(self, report: Callable[[str, int], None]) -> Iterator[None]:
        """The registry's lock (``Registry.changing``), taken when no rescale is copying
        data (its ranges' data is half moved and their tokens are the rescale's:
        services/controller/rescale.py), and held for the whole cut: a registration, an
        update, an unregistration or a rescale asked for meanwhile waits for the cut (none
        of them changes what is read). The cut waits for a copy to end, not refused: a
        drain before it has already stopped the intake. Checked every RESCALE_POLL_S, the
        lock released in between."""
        logged = False
        while True:
            changing = self.plane.registry.changing  # (a new election replaces the registry)
            changing.acquire()
            with self.plane.lock:
                copying = sorted(n for n, phase in self.plane.assigner.rescaling.items() if phase == COPYING)
            if not copying:
                break
            changing.release()
            if not logged:
                log.warning("savepoint: waiting for the rescale of %s to finish its copy", ", ".join(copying))
                logged = True
            report("waiting for a rescale", 0)
            time.sleep(RESCALE_POLL_S)
        try:
            yield
        finally:
            changing.release()

    # -- restore ---------------------------------------------------------------------------
    def restore(self, request_iterator: Iterator[Any], context: grpc.ServicerContext
                ) -> pb.RestoreSavepointResponse:
        if not self.plane.leading():
            raise self.leadership.redirect(context)
        if not self._restoring.acquire(blocking=False):  # one at a time: refused before a byte is read
            raise PreconditionError("restore: another RestoreSavepoint is under way on this controller (one "
                                    "at a time); this one was refused before any of it was read (nothing "
                                    "was written)")
        try:
            with contextlib.ExitStack() as closing:
                spool, size, digest = self._receive(request_iterator, closing)
                return self._restore(spool, size, digest)
        finally:
            self._restoring.release()

    def _receive(self, chunks: Iterator[Any], closing: contextlib.ExitStack) -> tuple[IO[bytes], int, str]:
        """The upload checked as it arrives and spooled to a temporary file (closed, so
        removed, by ``closing`` whatever happens): the magic, the format version and
        that the service is empty once the header's bytes are in, before the spool is
        opened; each frame's length as it comes (format.Verifier); the size against
        --max-restore-bytes. The first refusal ends the call: nothing more is read."""
        check = Verifier()
        spool: IO[bytes] | None = None
        head = bytearray()  # the bytes before the header is whole (fewer than HEAD)
        size = 0
        for msg in chunks:
            data = msg.chunk
            size += len(data)
            if size > self.max_restore_bytes:
                raise ResourceLimitError(
                    f"restore: the upload is over this controller's --max-restore-bytes of {self.max_restore_bytes} "
                    f"bytes (at {size} bytes); nothing was written (its spool is removed): start the controller "
                    "with a larger --max-restore-bytes to restore a larger file")
            check.feed(data)
            if spool is None:
                head += data
                if not check.headed:
                    continue
                with self.plane.lock:
                    self._check_registry_empty()
                spool = closing.enter_context(self._open_spool())
                data = bytes(head)
            spool.write(data)
        digest = check.finish()
        if spool is None:  # (finish refused a file without its header)
            raise SavepointFileError("savepoint file: empty")
        spool.flush()
        spool.seek(0)
        return spool, size, digest

    def _open_spool(self) -> IO[bytes]:
        return tempfile.TemporaryFile(prefix="millwheel-restore-")  # noqa: SIM115 (the caller closes it)

    def _restore(self, spool: IO[bytes], size: int, digest: str) -> pb.RestoreSavepointResponse:
        """Check everything (nothing written), then write it into this empty service;
        ``spool``: the file :meth:`_receive` checked, ``digest`` its SHA-256."""
        started = time.monotonic()
        header = next(frames(spool), None)
        if header is None or header.get("t") != "header" or not isinstance(header.get("created_us"), int):
            raise SavepointFileError("savepoint file: its first frame is not a header")
        p = self.plane
        store = p.store
        carried = admit(header.get("registry"), p.allow_code)
        floors = _sink_tokens(header.get("sink_tokens", {}), carried)
        nodes, streams = carried.nodes(), carried.streams()
        summary = restore.check(spool, nodes, streams)
        missing = sorted(set((n, r) for n, c in nodes.items() for r in range(c)) - summary.ranges)
        if missing:
            raise SavepointFileError(f"savepoint file: {len(missing)} key ranges of its registry are missing "
                                     f"from it (first: {missing[0][0][:200]}/{missing[0][1]})")
        with p.lock:
            self._check_empty(carried, digest)
            store.put_meta(RESTORING_KEY, digest.encode())
            restore.apply(store, spool, nodes, streams, int(header["created_us"]),
                          store.acquire, lambda _k, _n: None)
            for node, floor in floors.items():  # the store has no "set": bumped to it, once per restore
                while store.acquire(node, 0) < floor:
                    pass
            p.registry._commit(carried.topology, carried.versions, carried.previous)  # one write: it appears
            p.registry_changed()
            store.put_meta(RESTORING_KEY, None)
            for w in p.assigner.workers.values():
                p.assigner.touch(w.worker_id)
        took = int((time.monotonic() - started) * 1e6)
        log.warning("savepoint %s restored: %d bytes, %d computations, %d ranges, in %.3f s", digest[:16], size,
                    len(carried.topology.computations), len(summary.ranges), took / 1e6)
        counts = {**summary.counts, "ranges": len(summary.ranges)}
        counts.pop("range", None)
        return pb.RestoreSavepointResponse(
            summary=pb.SavepointSummary(sha256=digest, bytes=size, created_us=int(header["created_us"]),
                                        pause_us=took, stopped=bool(header.get("stopped")), counts=counts,
                                        computations=len(carried.topology.computations),
                                        injectors=len(carried.topology.injectors),
                                        log_last={s: v[1] for s, v in summary.streams.items()}),
            log_last={s: store.log_end(s)[0] for s in summary.streams})

    def _check_registry_empty(self) -> None:
        """FAILED_PRECONDITION unless nothing was ever registered here (also checked on
        the upload's first bytes, before anything is spooled)."""
        registry = self.plane.registry
        topo = registry.topology
        if registry.version != 0 or topo.computations or topo.injectors:
            raise PreconditionError(
                f"restore needs an empty service: this one has {len(topo.computations)} computations and "
                f"{len(topo.injectors)} injectors registered (registry version {registry.version}); "
                "start a controller on a new store (nothing was written)")

    def _check_empty(self, carried: CarriedRegistry, digest: str) -> None:
        """FAILED_PRECONDITION unless nothing was ever registered here and nothing is
        stored under the savepoint's names (a restore of the same file cut short may
        go on: it writes the same again)."""
        store = self.plane.store
        self._check_registry_empty()
        if store.get_meta(RESTORING_KEY) == digest.encode():
            return
        for node in carried.nodes():
            if store.list_keys(node, None, 1) or store.current_token(node, 0):
                raise PreconditionError(f"restore needs an empty service: the store already holds key range "
                                        f"data of {node[:200]!r} (nothing was written)")
        for stream in carried.streams():
            if store.log_end(stream)[0]:
                raise PreconditionError(f"restore needs an empty service: the store already has a log of "
                                        f"stream {stream[:200]!r} (nothing was written)")



def _sink_tokens(raw: Any, carried: CarriedRegistry) -> dict[str, int]:
    """The header's ``sink_tokens`` (sink node -> its token at the cut), checked: each a
    sink of the carried registry, a token of at most MAX_SINK_TOKEN."""
    names = {sink_node(s.name) for s in carried.topology.sinks}
    if not isinstance(raw, dict) or not set(raw) <= names or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_SINK_TOKEN for v in raw.values()):
        raise SavepointFileError(f"savepoint file: its header's sink_tokens must map sinks of its registry to "
                                 f"tokens in 0..{MAX_SINK_TOKEN}")
    return dict(raw)


class _StopGate:
    """A stop with savepoint between its cut and its file's last byte (issue 34, item 4):
    the cut leaves the service stopped in the controller's memory only (Inject refused,
    no range placed); :meth:`store` makes it durable once every byte of the file went out
    on the call; :meth:`undo` (the call ended first, or anything failed) lets the service
    run on, its ranges placed again. Whichever comes first wins; the other does nothing.
    The call's end may come before the cut is over: the cut then undoes it at once."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self._lock = threading.Lock()
        self._assigner: Any = None  # the assigner the cut stopped (None: no stop to settle)
        self._ended = False  # the call is over
        self._settled = False  # stored or undone

    def cut(self, assigner: Any) -> None:
        """The cut stopped ``assigner``'s service and its file is whole in the spool."""
        with self._lock:
            self._assigner = assigner
            ended = self._ended
        if ended:
            self.undo("the call ended during the cut")

    def end(self) -> None:
        """The call is over (gRPC's callback: done, cancelled, or past its deadline)."""
        with self._lock:
            self._ended = True
        self.undo("the call ended before the file was sent whole")

    def store(self) -> None:
        """The stop made durable: a restarted or new leader keeps it. UNAVAILABLE if it
        was undone meanwhile (the call ended as the last bytes went out)."""
        with self._lock:
            if self._assigner is None or self._settled:
                if self._settled:
                    raise UnavailableError("savepoint: the call ended before the file was sent whole; the stop "
                                           "was undone (the service runs on): take it again")
                return
            self.plane.store.put_meta(STOPPED_KEY, json.dumps({"at_us": self.plane.clock.now_us()}).encode())
            self._settled = True

    def undo(self, why: str) -> None:
        """Unless stored: the service is not stopped after all, its ranges placed again."""
        with self._lock:
            if self._assigner is None or self._settled:
                return
            self._settled = True
            a = self._assigner
        p = self.plane
        with p.lock:
            if p.assigner is not a:  # another election since: its assigner never saw the stop
                return
            a.stopped = False
            moves = a.rebalance()
        log.warning("savepoint: stop with savepoint undone (%s): the service runs on, %d ranges placed again",
                    why, moves)
