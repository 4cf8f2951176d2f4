"""A step's write group applied by a child process while the runner computes the next step.

Opt-in (``LocalRunner(writer_process=True)``, ``millwheel run --writer-process``), SQLite
file stores only. Why a process and not a thread: the SQLite work of a group (building
rows, binding parameters, the inserts, COMMIT) is ~45% of the single-stage loop
(docs/bench.md, "Speed round 2: the second core"), and ``sqlite3`` binds parameters
holding the GIL, so a writer *thread* only traded GIL hand-offs for overlap (0.93-1.04x).
A child process has its own interpreter and its own connection to the same file.

The step's end (:meth:`PipelinedStore.end_step`):

1. Cancel outbox entries written and acked within the group (as
   :class:`~millwheel.runtime.grouped.GroupedStore` does).
2. Wait for the group in flight (at most one): the child's reply is ``None`` (applied,
   committed) or the error that rolled it back. An error, or the child's death (end of
   file on the pipe), is raised here, and every later call raises too: nothing after a
   failed group is ever applied.
3. Encode the group compactly (tuples, no dataclasses) and send it as one message.
   The runner returns to compute the next step; the child applies the group in one
   ``write_group`` transaction, each write still fenced by its own token, and replies.

Why the store still holds a prefix of the synchronous runner's transactions
(grouped.py): groups are applied one at a time in step order, each all-or-none.
kill -9 of the runner: a group is one pipe message, and the child applies a group only
after receiving all of it (``recv_bytes`` raises on a short message), so a partly sent
group is never applied; a fully received one may be committed after the runner died,
which is a prefix too (a runner killed a moment later would have committed it). The
child then reads end of file and exits. A restarted runner first bumps every token
(``acquire``), in a transaction serialised with the orphan's: an orphan group committed
before the bump is part of what the new runner recovers, one after it is refused by
the fence check. kill -9 of the child: its open transaction rolls back (SQLite), the
runner reads end of file at its next wait and stops with :class:`StoreError`; a restart
recovers as from a runner crash at that point.

Reads: any read other than :meth:`contains_ids` first applies the held writes and waits
for the group in flight (the runner's connection then sees them). ``contains_ids`` (the
dedup confirmation on a Bloom maybe-hit, inside a step) answers from the store plus the
in-flight and held checkpoints' IDs: the in-flight group is either committed or not in
the runner's snapshot, and the union is right either way.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Sequence

from millwheel.errors import FencedError, InvalidSpecError, StoreError
from millwheel.record import Record, TimeDomain, Timer
from millwheel.runtime.grouped import GroupedStore, held_ids
from millwheel.state.protocol import Checkpoint, Production, StateStore
from millwheel.state.url_display import redact

MAX_STEPS_HELD = 8  # steps merged into one group at most while the child is busy
SOCKET_BUFFER = 4 << 20  # bytes; the kernel caps it at net.core.wmem_max
_Held = list[Any]  # Checkpoint | ack tuple | callable, as GroupedStore holds them


# -- encoding (runner side) ------------------------------------------------------------
def _encode_checkpoint(cp: Checkpoint) -> tuple[Any, ...]:
    return ("c", cp.computation, cp.range_id, cp.token, cp.now_us, cp.state_writes,
            [(t.key, t.tag, t.time, t.domain.value, t.hold) for t in cp.timer_sets],
            cp.timer_clears,
            [(p.consumer, p.stream, p.record.key, p.record.value, p.record.timestamp,
              p.record.record_id) for p in cp.productions],
            cp.consumed_ids, cp.resolved, cp.counters, cp.errors, cp.buffer_appends,
            cp.buffer_deletes, cp.ids_generation)


def encode(items: _Held, inner: StateStore) -> list[tuple[Any, ...]] | None:
    """The group as plain tuples, or None if a write is not a call the child can make
    (then the runner applies the group itself, after the one in flight)."""
    out: list[tuple[Any, ...]] = []
    for item in items:
        if type(item) is Checkpoint:
            out.append(_encode_checkpoint(item))
        elif type(item) is tuple:
            producer, range_id, token, acked = item
            out.append(("a", producer, range_id, token, list(acked)))
        elif (type(item) is partial and not item.keywords
              and getattr(item.func, "__self__", None) is inner):
            name = item.func.__name__
            if name == "append_log":
                stream, records = item.args
                out.append(("l", stream, [(r.key, r.value, r.timestamp, r.record_id) for r in records]))
            else:
                out.append(("m", name, item.args))
        else:
            return None
    return out


# -- the child -----------------------------------------------------------------------
def _apply(store: Any, group: list[tuple[Any, ...]]) -> None:
    """One group, one transaction (all or none)."""
    with store.write_group():
        for op in group:
            kind = op[0]
            if kind == "c":
                (_, comp, rid, token, now_us, writes, tsets, tclears, prods, ids,
                 resolved, counters, errors, bappends, bdeletes, gen) = op
                store.checkpoint(Checkpoint(
                    comp, rid, token, now_us, writes,
                    [Timer(k, tag, t, TimeDomain(d), h) for k, tag, t, d, h in tsets], tclears,
                    [Production(c, s, Record(k, v, ts, i)) for c, s, k, v, ts, i in prods],
                    ids, resolved, counters, errors, bappends, bdeletes, gen))
            elif kind == "a":
                store.ack(op[1], op[2], op[3], op[4])
            elif kind == "l":
                store.append_log(op[1], [Record(k, v, ts, i) for k, v, ts, i in op[2]])
            else:
                getattr(store, op[1])(*op[2])


def encode_error(exc: BaseException) -> bytes:
    """The child's reply for a failed group: the error, as the runner will raise it."""
    if isinstance(exc, FencedError):  # its __init__ takes fields, not the message
        return pickle.dumps(("F", exc.computation, exc.range_id, exc.token, exc.current))
    try:
        reply = pickle.dumps(("E", exc))
        pickle.loads(reply)
    except Exception:  # noqa: BLE001 - an error that does not survive pickling
        reply = pickle.dumps(("E", StoreError(f"writer process: {exc!r}")))
    return reply


def decode_error(reply: bytes) -> BaseException:
    kind, *fields = pickle.loads(reply)
    if kind == "F":
        return FencedError(*fields)
    error: BaseException = fields[0]
    return error


def _child_main(conn: Connection, url: str) -> None:
    """Apply groups until end of file; after a failed group, reply with its error and
    stop (nothing after it is applied)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the runner's to handle
    from millwheel.state import open_store

    store = open_store(url)
    while True:
        try:
            data = conn.recv_bytes()  # the whole group, or an error: never half of one
        except (EOFError, OSError):
            return
        try:
            _apply(store, pickle.loads(data))
        except BaseException as exc:  # noqa: BLE001 - reported to the runner, then stop
            reply = encode_error(exc)
            try:
                conn.send_bytes(reply)
            except OSError:
                pass  # the runner is gone: nothing to tell
            return
        try:
            conn.send_bytes(b"")
        except OSError:
            return


def start_writer(url: str) -> tuple[Connection, subprocess.Popen[bytes]]:
    """Start a writer process on the SQLite store at ``url``: its connection and process."""
    # A fresh interpreter (not fork: no inherited SQLite connection; not
    # multiprocessing's spawn: that re-runs the caller's __main__), talking over a
    # socket pair with multiprocessing's length-prefixed messages.
    mine, theirs = socket.socketpair()
    # Room for a whole group in the socket: handing it over must not wait until the
    # child is scheduled to read it (on a busy machine that is milliseconds a step).
    for sock in (mine, theirs):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    child = subprocess.Popen(
        [sys.executable, "-m", "millwheel.runtime.writer_process", str(theirs.fileno()), url],
        pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
    theirs.close()
    return Connection(mine.detach()), child


# -- the runner's side ---------------------------------------------------------------
def check_store_url(url: str) -> None:
    """InvalidSpecError unless ``url`` names a SQLite file (the child opens the same
    file); callers check before opening the store, so a wrong one is refused at once."""
    if not url.startswith("sqlite:///") or ":memory:" in url:
        raise InvalidSpecError(f"the writer process needs a sqlite:/// file store, not {redact(url)!r}")



class PipelinedStore(GroupedStore):
    """A :class:`GroupedStore` whose step groups a child process applies (module doc)."""

    def __init__(self, store: StateStore) -> None:
        super().__init__(store)
        url = store.url
        check_store_url(url)
        if self._group is None:
            raise InvalidSpecError(f"the writer process needs a sqlite:/// file store, not {url!r}")
        self._conn, self._child = start_writer(url)
        self._in_flight: _Held | None = None  # held items of the group being applied
        self._failed: BaseException | None = None
        self._steps_held = 0  # steps whose writes wait for the group in flight
        self.groups = 0  # groups the child applied (a sensor for tests)

    # 2. wait for the group in flight
    def _wait(self) -> None:
        if self._failed is not None:
            raise StoreError(f"writer process stopped earlier: {self._failed}") from self._failed
        if self._in_flight is None:
            return
        try:
            reply = self._conn.recv_bytes()
        except (EOFError, OSError) as exc:
            self._failed = StoreError(f"{self.url}: the writer process died "
                                      f"(exit code {self._child.poll()}); restart to recover")
            raise self._failed from exc
        self._in_flight = None
        if reply:
            error = decode_error(reply)
            self._failed = error
            raise error
        self.groups += 1

    def end_step(self) -> None:
        """1-3 of the module doc: hand the step's group to the child, not waiting for it.
        While the child is still applying the previous group, the step's writes stay held
        (up to :data:`MAX_STEPS_HELD` steps) and go with the next step's, one group:
        the runner never blocks on a child that has not been scheduled yet."""
        if self._in_flight is not None and self._steps_held < MAX_STEPS_HELD \
                and self._failed is None and not self._conn.poll():
            self._steps_held += 1
            return
        self._hand_over()

    def _hand_over(self) -> None:
        """Steps 1-3: every held write goes to the child (after the group in flight)."""
        if not self._held and self._failed is None:
            return
        self._steps_held = 0
        held, self._held = self._held, []
        items = self._cancel_acked(held)  # 1
        group = encode(items, self.inner)  # (3, encoded while the child may still work)
        data = None if group is None else pickle.dumps(group, protocol=pickle.HIGHEST_PROTOCOL)
        self._wait()  # 2
        if data is None:  # a write only this process can make: apply the group here
            self._apply(items)
            return
        try:  # 3
            self._conn.send_bytes(data)
        except OSError as exc:
            self._failed = StoreError(f"{self.url}: the writer process died; restart to recover")
            raise self._failed from exc
        self._in_flight = items

    def flush(self) -> None:
        """Apply every held write and wait until the child committed them (before any
        read or unheld write: they see, and come after, everything written so far)."""
        self._hand_over()
        self._wait()

    def contains_ids(self, computation: str, range_id: int, ids: Sequence[str]) -> set[str]:
        """Consumed IDs among ``ids``: the store's plus the in-flight and held groups'."""
        found = super().contains_ids(computation, range_id, ids)
        held_ids(self._in_flight or [], computation, range_id, ids, found)
        return found

    def stop(self) -> None:
        """Wait for the group in flight, then let the child exit (end of file)."""
        try:
            self.flush()
        finally:
            self._conn.close()
            self._child.wait(timeout=10)

    def close(self) -> None:
        self.stop()
        self.inner.close()


def make_pipe(store: StateStore, writer_process: bool) -> GroupedStore:
    """The local runner's store wrapper: a writer process if asked for, else grouping."""
    return PipelinedStore(store) if writer_process else GroupedStore(store)


if __name__ == "__main__":  # python -m millwheel.runtime.writer_process FD URL
    _child_main(Connection(int(sys.argv[1])), sys.argv[2])
