"""NATS JetStream: a source reading a stream by sequence, a sink publishing to a subject
(nats-py, imported only here; its asyncio loop runs in a thread of its own, so the
runtime calls it as it calls any blocking client).

Source: an ephemeral pull consumer on ``stream`` filtered by ``subject``, started just
after the checkpointed stream sequence (``DeliverPolicy.BY_START_SEQUENCE``), no acks:
the position is the injector's checkpoint, not the server's. A message body is a JSON
object ``{"key", "value", "timestamp", "id"?}`` (``fields:`` maps other names); without
``id`` the record ID is ``nats:STREAM:SEQUENCE``. Messages the stream's limits removed
before they were read are lost to it.

Sink: each record is published with ``Nats-Msg-Id`` = its record ID (JetStream drops a
repeat within the stream's duplicate window), a ``Mw-Position`` header (the stream log
position) and ``Nats-Expected-Last-Subject-Sequence``: JetStream refuses a publish when
another writer published to the subject since, so a zombie's publish fails once the new
owner wrote (it reopens, and keeps failing until its worker learns it lost the range),
and an owner resumes after the position in the subject's last message. The subject must
be the sink's alone. Batches are not transactions: a crash mid-batch leaves a prefix
written, which the retry skips by position.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any, Coroutine, Sequence, TypeVar

import nats
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.js import api
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError

from millwheel.connectors import Entry
from millwheel.connectors.envelope import json_entry
from millwheel.errors import ConnectorError
from millwheel.record import Record
from millwheel.state.url_display import redact

T = TypeVar("T")
TIMEOUT_S = 10.0
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code for a failed expected-last-sequence check


class _Loop:
    """An asyncio loop in its own thread; blocking calls into it with a deadline."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="nats", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = TIMEOUT_S) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except (NatsError, OSError, TimeoutError) as exc:
            future.cancel()
            raise ConnectorError(f"{self.what}: {type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


async def _connect(url: str) -> Any:
    return await nats.connect(url, connect_timeout=3, max_reconnect_attempts=2, allow_reconnect=True)


class _Connected:
    """What the source and the sink share: a connection on a loop thread of its own,
    closed the same way (the connection first, with a deadline, then the loop)."""

    loop: _Loop | None
    nc: Any

    def close(self) -> None:
        if self.loop is not None:
            try:
                if self.nc is not None:
                    self.loop.run(self.nc.close(), 5)
            except ConnectorError:
                pass
            self.loop.close()
            self.loop = None


class JetStreamSource(_Connected):
    def __init__(self, settings: dict[str, Any]) -> None:
        self.url = settings["url"]
        self.stream = settings["stream"]
        self.subject = settings["subject"]
        self.until_end = settings.get("until") == "end"
        self.what = f"nats-jetstream source {redact(self.url)} stream {self.stream!r}"
        self.loop: _Loop | None = None
        self.nc: Any = None
        self.sub: Any = None
        self.last = 0
        self.end: int | None = None

    def open(self, position: str | None) -> None:
        self.loop = _Loop(self.what)
        self.last = int(position or 0)
        self.loop.run(self._open())

    async def _open(self) -> None:
        self.nc = await _connect(self.url)
        js = self.nc.jetstream()
        if self.until_end:
            info = await js.stream_info(self.stream)
            self.end = int(info.state.last_seq)
        config = api.ConsumerConfig(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
                                    opt_start_seq=self.last + 1, ack_policy=api.AckPolicy.NONE,
                                    inactive_threshold=300.0)
        self.sub = await js.pull_subscribe(self.subject, stream=self.stream, config=config)

    def read_batch(self, max_records: int, wait_s: float) -> list[Entry]:
        if self.finished():
            return []
        assert self.loop is not None
        msgs = self.loop.run(self._fetch(max_records, max(wait_s, 0.05)))
        entries: list[Entry] = []
        for msg in msgs:
            seq = int(msg.metadata.sequence.stream)
            if seq <= self.last or (self.end is not None and seq > self.end):
                continue
            entries.append(json_entry(str(seq), msg.data))
            self.last = seq
        return entries

    async def _fetch(self, n: int, wait_s: float) -> list[Any]:
        try:
            return list(await self.sub.fetch(n, timeout=wait_s))
        except TimeoutError:
            return []

    def record_id(self, entry: Entry) -> str:
        return f"nats:{self.stream}:{entry.position}"

    def finished(self) -> bool:
        return self.end is not None and self.last >= self.end



class JetStreamSink(_Connected):
    def __init__(self, settings: dict[str, Any]) -> None:
        self.url = settings["url"]
        self.subject = settings["subject"]
        self.jetstream = settings.get("jetstream")
        self.what = f"nats-jetstream sink {redact(self.url)} subject {self.subject!r}"
        self.loop: _Loop | None = None
        self.nc: Any = None
        self.js: Any = None
        self.last_seq = 0  # the subject's last stream sequence as we know it
        self.position = 0
        self.sink, self.range_id = "", 0

    def open(self, sink: str, range_id: int, token: int) -> int:
        self.sink, self.range_id = sink, range_id
        self.close()
        self.loop = _Loop(self.what)
        return self.loop.run(self._open())

    async def _open(self) -> int:
        self.nc = await _connect(self.url)
        self.js = self.nc.jetstream()
        name = self.jetstream
        if name is not None:
            try:
                await self.js.stream_info(name)
            except NotFoundError:
                await self.js.add_stream(name=name, subjects=[self.subject])
        else:
            name = await self.js.find_stream_name_by_subject(self.subject)
        self.stream_name = name
        try:
            last = await self.js.get_last_msg(name, self.subject)
        except NotFoundError:
            self.last_seq, self.position = 0, 0
            return 0
        self.last_seq = int(last.seq)
        self.position = int((last.headers or {}).get("Mw-Position", 0))
        return self.position

    def write_batch(self, records: Sequence[tuple[int, Record]], token: int) -> int:
        assert self.loop is not None
        return self.loop.run(self._write([(p, r) for p, r in records if p > self.position], token),
                             TIMEOUT_S + len(records) * 0.5)

    async def _write(self, records: list[tuple[int, Record]], token: int) -> int:
        for pos, rec in records:
            body = json.dumps({"key": rec.key, "value": rec.value.decode("utf-8", "replace"),
                               "timestamp": rec.timestamp, "id": rec.record_id}).encode()
            headers = {"Nats-Msg-Id": rec.record_id, "Mw-Position": str(pos), "Mw-Token": str(token),
                       "Nats-Expected-Last-Subject-Sequence": str(self.last_seq)}
            try:
                ack = await self.js.publish(self.subject, body, headers=headers, timeout=TIMEOUT_S)
            except (NoStreamResponseError, NoRespondersError):
                raise ConnectorError(f"{self.what}: no JetStream stream captures the subject (name one "
                                     "with `jetstream:` and the sink creates it)") from None
            except APIError as exc:
                if exc.err_code == WRONG_LAST_SEQUENCE:
                    # Another writer published since: a zombie (then the new owner wrote), or
                    # a zombie wrote after we opened (then we read the new end and go on).
                    raise ConnectorError(f"{self.what}: another writer published to the subject "
                                         f"(token {token}); reopening at its last message") from None
                raise ConnectorError(f"{self.what}: {exc}") from None
            if not ack.duplicate:
                self.last_seq = int(ack.seq)
            self.position = pos
        return self.position

