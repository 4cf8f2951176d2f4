"""RestoreSavepoint checks the upload as it arrives (issue 34, item 7): it used to spool
the whole of it to the controller's disk before any check (up to 64 GiB a call, 32
calls a client), and a file of empty frames kept its check loop busy for a minute.

Real controllers in this process over real SQLite stores, gRPC on loopback. Each
refusal is asserted by its status and message, and for each: the upload was not read
to its end, no spool file is left (the spool is a named file in a folder of the test,
so what is left shows), the service is still empty, and the good file restores after it.
"""

from __future__ import annotations

import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any, Iterator

import grpc
import pytest

from millwheel.errors import InvalidSpecError, ResourceLimitError
from millwheel.savepoint.format import FORMAT_VERSION, MAGIC
from services.cli import build_parser
from services.client import ControllerClient
from services.controller.service import serve
from services.generated import millwheel_pb2 as pb
from services.rpc.security import Security
from services.rpc.status import PreconditionError
from tests.support import pipelines
from tests.support.savepoints import run_cli

pytestmark = pytest.mark.timeout(120)
MiB = 1 << 20
HEAD = MAGIC + struct.pack(">I", FORMAT_VERSION)


class Service:
    """A controller (no workers) whose restore spool is a named file under ``spool_dir``."""

    def __init__(self, tmp: Path, name: str, **kwargs: Any) -> None:
        self.server, port, _m, self.controller = serve(
            f"sqlite:///{tmp}/{name}.db", port=0, metrics_port=None, allow_code=pipelines.__name__, **kwargs)
        self.address = f"127.0.0.1:{port}"
        self.client = ControllerClient(self.address, timeout_s=30, security=Security())
        self.spool_dir = tmp / f"{name}-spool"
        self.spool_dir.mkdir()
        self.spools: list[IO[bytes]] = []
        self.spool_opened = threading.Event()

        def open_spool() -> IO[bytes]:
            f = tempfile.NamedTemporaryFile(dir=self.spool_dir, prefix="millwheel-restore-")  # noqa: SIM115
            self.spools.append(f)
            self.spool_opened.set()
            return f

        self.controller.savepoints._open_spool = open_spool  # type: ignore[method-assign]

    def restore(self, chunks: Iterator[bytes]) -> pb.RestoreSavepointResponse:
        try:
            return self.client.stub.RestoreSavepoint(
                (pb.RestoreSavepointRequest(chunk=c) for c in chunks), timeout=60)
        except grpc.RpcError as exc:
            raise self.client.error(exc) from None

    def assert_unchanged(self) -> None:
        """Empty, no spool file left, every spool opened closed."""
        assert not self.client.computations().computations
        assert not self.client.status().ranges
        assert list(self.spool_dir.iterdir()) == []
        assert all(f.closed for f in self.spools)

    def close(self) -> None:
        self.client.close()
        self.controller.close()
        self.server.stop(0)


class Upload:
    """Chunks handed to the client as it asks for them; counts how many it took."""

    def __init__(self, first: bytes, then: bytes = b"", more: int = 0) -> None:
        self.first, self.then, self.more = first, then, more
        self.taken = 0

    def __iter__(self) -> Iterator[bytes]:
        self.taken += 1
        yield self.first
        for _ in range(self.more):
            self.taken += 1
            yield self.then

    @property
    def whole(self) -> bool:
        return self.taken == self.more + 1


@pytest.fixture
def good(tmp_path: Path) -> bytes:
    """A real savepoint of the pipelines topology (taken from a service with no workers)."""
    src = Service(tmp_path, "src")
    try:
        src.client.register(pipelines.topology(key_ranges=2))
        path = tmp_path / "good.mwsp"
        code, _out, err = run_cli("savepoint", "create", str(path), "--controller", src.address)
        assert code == 0, err
        return path.read_bytes()
    finally:
        src.close()


@pytest.fixture
def dst(tmp_path: Path) -> Iterator[Service]:
    s = Service(tmp_path, "dst")
    try:
        yield s
    finally:
        s.close()


def restores_after(s: Service, good: bytes) -> None:
    """The service was left as it was: the good file still restores into it."""
    s.assert_unchanged()
    answer = s.restore(iter([good[:100], good[100:]]))
    assert answer.summary.computations == 3
    assert sorted(c.spec.name for c in s.client.computations().computations) == ["counts", "parse", "totals"]
    assert list(s.spool_dir.iterdir()) == [] and all(f.closed for f in s.spools)


def test_a_foreign_or_newer_file_is_refused_on_its_first_chunk(dst: Service, good: bytes) -> None:
    foreign = Upload(b"PK\x03\x04 this is a zip, not a savepoint" + bytes(MiB), bytes(MiB), more=64)
    with pytest.raises(InvalidSpecError, match=r"not a millwheel savepoint: .*not b'MWSAVEPOINT\\x00'"):
        dst.restore(iter(foreign))
    assert not foreign.whole and not dst.spools  # refused at once: nothing spooled
    # The magic is checked on what has arrived, before the whole header is in.
    with pytest.raises(InvalidSpecError, match="not a millwheel savepoint"):
        dst.restore(iter([b"MWX", HEAD[3:]]))
    newer = Upload(MAGIC + struct.pack(">I", 9) + bytes(MiB), bytes(MiB), more=64)
    with pytest.raises(InvalidSpecError, match="format version 9: this millwheel reads version 1 only"):
        dst.restore(iter(newer))
    assert not newer.whole and not dst.spools
    restores_after(dst, good)


def test_a_service_not_empty_is_refused_on_the_first_chunk(dst: Service, good: bytes) -> None:
    dst.client.register(pipelines.topology(key_ranges=2))
    upload = Upload(good[:64 * 1024], bytes(MiB), more=64)
    with pytest.raises(PreconditionError, match="restore needs an empty service: this one has 3 computations"):
        dst.restore(iter(upload))
    assert not upload.whole and not dst.spools
    assert list(dst.spool_dir.iterdir()) == []
    assert len(dst.client.computations().computations) == 3  # still serving what it had


def test_a_file_of_empty_frames_is_refused_at_its_first_frame(dst: Service, good: bytes) -> None:
    """It kept the check loop busy 65 s for 300 MiB: the format writes no empty frame."""
    upload = Upload(HEAD, bytes(MiB), more=300)  # the header alone: a spool is opened, then removed
    started = time.monotonic()
    with pytest.raises(InvalidSpecError, match="frame 0 at byte 16 is 0 bytes, shorter than any frame"):
        dst.restore(iter(upload))
    assert time.monotonic() - started < 10
    assert not upload.whole and len(dst.spools) == 1
    restores_after(dst, good)


def test_the_upload_is_bounded_by_max_restore_bytes(tmp_path: Path, good: bytes) -> None:
    s = Service(tmp_path, "small", max_restore_bytes=2 * MiB)
    try:
        frame = b'{"t":"ids","items":["' + b"x" * (MiB - 32) + b'"]}'
        chunk = struct.pack(">I", len(frame)) + frame  # well-formed frames: only the size refuses it
        upload = Upload(HEAD + chunk, chunk, more=64)
        with pytest.raises(ResourceLimitError, match=r"over this controller's --max-restore-bytes of 2097152 "
                                                     r"bytes .*nothing was written \(its spool is removed\)"):
            s.restore(iter(upload))
        assert not upload.whole and len(s.spools) == 1
        restores_after(s, good)
    finally:
        s.close()


def test_one_restore_at_a_time(dst: Service, good: bytes) -> None:
    """A second RestoreSavepoint while one is receiving is refused and changes nothing;
    the first goes on and restores."""
    go_on = threading.Event()

    def slow() -> Iterator[bytes]:
        yield good[:100]
        go_on.wait(30)
        yield good[100:]

    answers: list[Any] = []
    first = threading.Thread(target=lambda: answers.append(dst.restore(slow())))
    first.start()
    try:
        assert dst.spool_opened.wait(30)
        second = Upload(good, b"", 0)
        with pytest.raises(PreconditionError, match="another RestoreSavepoint is under way on this controller "
                                                    r"\(one at a time\)"):
            dst.restore(iter(second))
        assert len(dst.spools) == 1 and not dst.client.computations().computations
    finally:
        go_on.set()
        first.join(60)
    assert answers and answers[0].summary.computations == 3
    assert len(dst.client.computations().computations) == 3
    assert list(dst.spool_dir.iterdir()) == []
    with pytest.raises(PreconditionError, match="empty service"):  # the lock was let go: refused as usual
        dst.restore(iter([good]))


def test_max_restore_bytes_is_a_controller_flag() -> None:
    parse = build_parser().parse_args
    assert parse(["controller"]).max_restore_bytes == 16 << 30
    assert parse(["controller", "--max-restore-bytes", "1000"]).max_restore_bytes == 1000
