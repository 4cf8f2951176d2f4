"""``millwheel savepoint create|restore|inspect``: a consistent cut of a whole service
as one file, and that file restored into an empty service on any store.

The controller takes the cut and checks a restore (services/controller/savepoint.py);
this module moves the file, shows progress on stderr, and checks the file's checksum
before it keeps (create) or sends (restore) one.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import grpc

from millwheel.errors import InvalidSpecError
from millwheel.savepoint.format import frames, verify

from ..generated import millwheel_pb2 as pb
from .output import client_for, client_parser, emit

CHUNK = 1 << 20

DESCRIPTION = """\
Savepoints: a consistent cut of the whole service (registry with versions, every key
range's state, timers, pending productions, consumed record IDs, watermarks and error
counts, every stream log's entries) in one portable, versioned, checksummed file.
Restore it into an EMPTY service on any store (SQLite, Redis, Redis Cluster) and it
goes on exactly where the cut was: no record lost, none processed twice.

The file holds your data (state and records): keep it as secret as the store.
"""

CREATE = DESCRIPTION + """
create takes the cut: every key range is fenced at a checkpoint boundary and read
from the store; processing pauses for that long only (the summary says how long),
then goes on, each range on the worker that ran it. Heartbeats and the console are
answered meanwhile (the controller's lock is held for the fence and the placing only);
registrations, updates and rescales asked for meanwhile wait for the cut. The file
is written to FILE.partial, its checksum checked, then renamed to FILE. With --stop
(stop with savepoint), the service takes no more records at the cut (Inject is
refused) and runs nothing after it: what it emitted is
exactly what precedes the cut, and the restored service emits the rest. The stop holds
only once the whole file was sent: if the cut fails, or this command ends before it has
the file, nothing is stopped (the service runs on).


With --drain (implies --stop), the service first finishes everything in flight: Inject
is refused from the start (FAILED_PRECONDITION), every injector is closed (watermark
+inf: every event-time window closes and fires; a pulled source reads no more), and
the drain waits until every key range's watermark is +inf and every outbox is empty,
then until every connector sink (PostgreSQL, Redis, NATS) has written its stream's
whole log (progress on stderr), then takes the cut with --stop. Then the stream logs
and the sinks' external systems hold every result, including the last windows', and
the file holds no open window and no pending record ("drained" in the summary). A
worker dying meanwhile is an ordinary range move. If it cannot finish within --timeout
(a range that keeps failing holds the watermark, a sink cannot write, say), it exits
with status 2 and the service is left DRAINING, not stopped: Inject refused, injectors
closed, ranges and sinks running, no file written. Run it again to wait longer, or use
--stop to stop with what is pending in the file.
Restoring a drained file gives a service whose injectors are closed: new records need
injectors of other names.

examples:
  millwheel savepoint create nightly.mwsp
  millwheel savepoint create move.mwsp --stop       # then: restore it on the new cluster
  millwheel savepoint create final.mwsp --drain --timeout 300   # end the pipeline: every window fired
"""

RESTORE = DESCRIPTION + """
restore checks the whole file first (here, then again on the controller: size,
SHA-256 checksum, every record in it, its computations admitted as a registration
is, against the controller's --allow-code). A corrupt, truncated or foreign file is
refused with a message saying what is wrong, and nothing is written. The service must
be empty (nothing ever registered on its store): else FAILED_PRECONDITION. Stream
logs are copied entry by entry; their positions are the new store's (the answer maps
each stream's position at the cut to the new one).

examples:
  millwheel savepoint restore move.mwsp --controller new-host:7070
"""

INSPECT = DESCRIPTION + """
inspect checks a file's checksum and prints what it holds (no controller needed).
"""


def add_commands(sub: Any) -> None:
    sp = sub.add_parser("savepoint", help="save a whole service to a file, or restore one (create, restore, inspect)",
                        description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    ssub = sp.add_subparsers(dest="savepoint_command", metavar="ACTION", required=True)
    create = client_parser(ssub, "create", "take a savepoint of the running service into FILE", CREATE)
    create.formatter_class = argparse.RawDescriptionHelpFormatter
    create.add_argument("file", metavar="FILE", help="where to write the savepoint (refused if it exists)")
    create.add_argument("--stop", action="store_true",
                        help="stop with savepoint: the service takes no more records and runs nothing after the cut")
    create.add_argument("--drain", action="store_true",
                        help="first refuse Inject, close every injector (watermark +inf) and wait until every "
                             "window has fired and every record is processed; then stop with savepoint")
    create.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                        help="how long --drain may wait (default 600); past it the service stays draining, "
                             "nothing is written")
    create.add_argument("--force", action="store_true", help="overwrite FILE if it exists")
    create.set_defaults(func=cmd_create)
    rest = client_parser(ssub, "restore", "restore a savepoint FILE into an empty service", RESTORE)
    rest.formatter_class = argparse.RawDescriptionHelpFormatter
    rest.add_argument("file", metavar="FILE", help="a file 'millwheel savepoint create' wrote")
    rest.set_defaults(func=cmd_restore)
    insp = ssub.add_parser("inspect", help="check a savepoint FILE and print what it holds", description=INSPECT,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    insp.add_argument("file", metavar="FILE")
    insp.add_argument("--json", action="store_true", help="print JSON instead of text")
    insp.set_defaults(func=cmd_inspect)


class _Progress:
    """One line on stderr, rewritten at most twice a second (only on a terminal, else
    every few seconds as lines)."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def show(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if self.quiet or (not force and now - self.last < (0.5 if self.tty else 5.0)):
            return
        self.last = now
        print(("\r" + text.ljust(70)) if self.tty else text, end="" if self.tty else "\n", file=sys.stderr,
              flush=True)

    def end(self) -> None:
        if self.tty and not self.quiet and self.last:
            print(file=sys.stderr)


def _summary_data(s: Any) -> dict[str, Any]:
    return {"sha256": s.sha256, "bytes": s.bytes, "created_us": s.created_us, "pause_us": s.pause_us,
            "stopped": s.stopped, "counts": dict(s.counts), "computations": s.computations,
            "injectors": s.injectors, "log_last": dict(s.log_last), "drained": s.drained}


def _owner_only(path: str, flags: int) -> int:
    """Open ``path`` readable and writable by its owner alone (0600, whatever the umask
    and whatever mode a left-over file had): a savepoint holds every key's state, as
    secret as the store (docs/service.md, "Savepoints")."""
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def cmd_create(args: argparse.Namespace) -> int:
    target = Path(args.file)
    if target.exists() and not args.force:
        raise InvalidSpecError(f"{target}: exists (use --force to overwrite it)")
    partial = target.with_name(target.name + ".partial")
    progress = _Progress(args.json)
    summary = None
    with client_for(args) as client, open(partial, "wb", opener=_owner_only) as out:
        if args.drain and args.timeout <= 0:
            raise InvalidSpecError(f"--timeout must be positive, got {args.timeout}")
        request = pb.CreateSavepointRequest(stop=args.stop or args.drain, drain=args.drain,
                                            drain_timeout_ms=int(args.timeout * 1000) if args.drain else 0)
        call = client.stub.CreateSavepoint(request)
        try:
            for msg in call:
                if msg.chunk:
                    out.write(msg.chunk)
                    progress.show(f"savepoint: receiving, {out.tell() / 1e6:.1f} MB")
                elif msg.phase == "done":
                    summary = msg.summary
                elif msg.phase == "draining":
                    progress.show(f"drain: {msg.detail}", force=msg.detail.startswith("drained"))
                else:
                    progress.show(f"savepoint: {msg.phase}, {msg.items} items read", force=msg.phase == "fencing")
        except grpc.RpcError as exc:
            out.close()
            if _whole(partial):  # every byte came, the "done" answer did not: kept, not as FILE
                print(f"millwheel: the whole savepoint was received and checks, but the controller did not "
                      f"confirm it: kept at {partial}, not renamed. Whether the service was stopped "
                      "(--stop), 'millwheel status' says: restore the file elsewhere only if it was.",
                      file=sys.stderr)
            else:
                partial.unlink(missing_ok=True)
            raise client.error(exc) from None
    progress.end()
    if summary is None:
        partial.unlink(missing_ok=True)
        raise InvalidSpecError("savepoint: the controller's answer ended before the file was complete")
    with open(partial, "rb") as f:
        digest = verify(f, os.path.getsize(partial))
    if digest != summary.sha256:
        raise InvalidSpecError(f"savepoint: the file received has checksum {digest}, the controller sent "
                               f"{summary.sha256} (left at {partial})")
    os.replace(partial, target)
    data = {"file": str(target), **_summary_data(summary)}
    counts = ", ".join(f"{v} {k}" for k, v in sorted(summary.counts.items()))
    text = (f"savepoint {target}: {summary.bytes} bytes, sha256 {summary.sha256[:16]}..., "
            f"{summary.computations} computations, {summary.injectors} injectors ({counts}); "
            f"the cut paused processing {summary.pause_us / 1e6:.3f} s")
    if summary.drained:
        text += "\ndrained: every window fired and every record was processed before the cut"
    if summary.stopped:
        text += "\nthe service is stopped: it takes no more records and runs nothing (restore the file elsewhere)"
    return emit(args, data, text)


def _whole(path: Path) -> bool:
    """``path`` holds a whole savepoint file (checksum, end frame)."""
    try:
        with open(path, "rb") as f:
            verify(f, os.path.getsize(path))
    except (OSError, InvalidSpecError):
        return False
    return True


def _check_local(path: Path) -> tuple[str, int]:
    if not path.is_file():
        raise InvalidSpecError(f"{path}: no such file")
    size = path.stat().st_size
    with open(path, "rb") as f:
        try:
            digest = verify(f, size)
        except InvalidSpecError as exc:
            raise type(exc)(f"{path}: {exc} (nothing was sent)") from None
    return digest, size


def _chunks(path: Path, size: int, progress: _Progress) -> Iterator[pb.RestoreSavepointRequest]:
    sent = 0
    with open(path, "rb") as f:
        while data := f.read(CHUNK):
            sent += len(data)
            progress.show(f"restore: sent {sent / 1e6:.1f} of {size / 1e6:.1f} MB")
            yield pb.RestoreSavepointRequest(chunk=data)
    progress.show("restore: the controller is checking and writing it", force=True)


def cmd_restore(args: argparse.Namespace) -> int:
    path = Path(args.file)
    _digest, size = _check_local(path)
    progress = _Progress(args.json)
    with client_for(args) as client:
        try:
            resp = client.stub.RestoreSavepoint(_chunks(path, size, progress))
        except grpc.RpcError as exc:
            progress.end()
            raise client.error(exc) from None
    progress.end()
    s = resp.summary
    data = {"file": str(path), **_summary_data(s), "restored_log_last": dict(resp.log_last)}
    lines = [f"restored {path} ({s.bytes} bytes, taken at {s.created_us} us): {s.computations} computations, "
             f"{s.injectors} injectors, {s.counts.get('ranges', 0)} key ranges, in {s.pause_us / 1e6:.3f} s"]
    for stream in sorted(resp.log_last):
        lines.append(f"  log {stream}: position {s.log_last.get(stream, 0)} at the cut is {resp.log_last[stream]} here")
    return emit(args, data, "\n".join(lines))


def cmd_inspect(args: argparse.Namespace) -> int:
    path = Path(args.file)
    digest, size = _check_local(path)
    counts: dict[str, int] = {}
    header: dict[str, Any] = {}
    with open(path, "rb") as f:
        for i, frame in enumerate(frames(f)):
            if i == 0:
                header = frame
                continue
            n = len(frame["items"]) if isinstance(frame.get("items"), list) else 1
            counts[frame["t"]] = counts.get(frame["t"], 0) + n
    reg = header.get("registry") or {}
    names = [c.get("name") for c in reg.get("computations", []) if isinstance(c, dict)]
    data = {"file": str(path), "sha256": digest, "bytes": size, "created_us": header.get("created_us"),
            "stopped": header.get("stopped"), "computations": names, "versions": reg.get("versions", {}),
            "counts": counts}
    text = (f"{path}: savepoint, {size} bytes, sha256 {digest}, taken at {header.get('created_us')} us"
            f"{' (stop with savepoint)' if header.get('stopped') else ''}\n"
            f"  computations: {', '.join(map(str, names)) or 'none'}\n"
            f"  " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return emit(args, data, text)
