"""The Redis store's stream log: append, read, and what retention needs (measure,
trim, the log's start); a mixin of :class:`millwheel.state.redis_store.RedisStore`.

A stream's keys (millwheel.state.redis_keys) share the hash tag ``{S}``, so every
script touches one slot::

    mw:log:{S}:seq      STRING  sequence counter
    mw:log:{S}:ids      HASH    record ID -> sequence number (idempotent append)
    mw:log:{S}:entries  ZSET    "SEQ:" + framed record, score = SEQ
    mw:log:{S}:start    STRING  the sequence number retention removed the log through

Trimming (millwheel.runtime.retention) reads the oldest entries, then one script
removes them by score, forgets their record IDs (only where the ID still maps to that
entry) and raises ``start``; appends only add higher scores meanwhile.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

from millwheel.record import Record
from millwheel.state.redis_group import RedisGrouping
from millwheel.state.redis_keys import _CHUNK, _frame, _unframe
from millwheel.state.redis_lua import APPEND_LOG, LOG_STATS, TRIM_LOG


class RedisLog(RedisGrouping):
    """Stream log operations (see the module docstring)."""

    def _start_key(self, stream: str) -> str:
        return self._log(stream)[2][: -len("entries")] + "start"

    def append_log(self, stream: str, records: Sequence[Record]) -> int:
        """The number of records new to the log (0 inside a write group: not known yet)."""
        if self._holding():
            assert self._held is not None
            held: list[bytes | str | int] = []
            for r in records:
                held += [r.record_id, _frame([r.record_id, r.key, r.timestamp], r.value)]
            self._held.add_log(stream, held)
            return 0
        seq, ids, entries = self._log(stream)
        added = 0
        for start in range(0, len(records), _CHUNK):
            args: list[bytes | str | int] = []
            for r in records[start : start + _CHUNK]:
                args += [r.record_id, _frame([r.record_id, r.key, r.timestamp], r.value)]
            added += int(self._call(
                f"append_log of {stream!r}", [seq, ids, entries],
                partial(self._script, APPEND_LOG, [seq, ids, entries], args),
            ))
        return added

    def read_log(self, stream: str, after_seq: int, limit: int) -> list[tuple[int, Record]]:
        if limit <= 0:
            return []
        _seq, _ids, entries = self._log(stream)
        members = self._call(
            "read_log", [entries],
            lambda: self._r.zrangebyscore(entries, f"({after_seq}", "+inf", start=0, num=limit),
        )
        return [self._entry(entries, member) for member in members]

    def _entry(self, entries: str, member: bytes) -> tuple[int, Record]:
        try:
            seq_s, _, raw = member.partition(b":")
            (record_id, key, ts), value = _unframe(raw)
            return int(seq_s), Record(str(key), value, int(ts), str(record_id))
        except (ValueError, TypeError) as exc:
            raise self._corrupt(entries, member[:40], f"log entry unreadable: {exc}") from None

    def log_end(self, stream: str, after_seq: int = 0, upto_seq: int | None = None) -> tuple[int, int]:
        """The last entry first, then the count up to it: an append in between is not counted."""
        _seq, _ids, entries = self._log(stream)
        top = self._call("log_end", [entries], lambda: self._r.zrevrangebyscore(
            entries, "+inf" if upto_seq is None else upto_seq, f"({after_seq}", start=0, num=1, withscores=True))
        last = int(top[0][1]) if top else after_seq
        count = self._call("log_end", [entries], lambda: self._r.zcount(entries, f"({after_seq}", last))
        return last, int(count)

    # -- retention ------------------------------------------------------------------
    def log_stats(self, stream: str, after_seq: int, limit: int) -> tuple[int, int, int]:
        if limit <= 0:
            return 0, 0, after_seq
        entries = self._log(stream)[2]
        rows, size, last = self._call(
            f"log_stats of {stream!r}", [entries],
            partial(self._script, LOG_STATS, [entries], [after_seq, limit]),
        )
        return int(rows), int(size), int(last) if int(rows) else after_seq

    def trim_log(self, stream: str, through_seq: int, max_rows: int) -> int:
        if max_rows <= 0:
            return 0
        _seq, ids, entries = self._log(stream)
        members = self._call(
            "trim_log (read)", [entries],
            lambda: self._r.zrangebyscore(entries, "-inf", through_seq, start=0, num=max_rows),
        )
        if not members:
            return 0
        args: list[bytes | str | int] = []
        for member in members:
            seq, record = self._entry(entries, member)
            args += [record.record_id, seq]
        keys = [ids, entries, self._start_key(stream)]
        return int(self._call(
            f"trim_log of {stream!r}", keys,
            partial(self._script, TRIM_LOG, keys, [args[-1], *args]),
        ))

    def log_start(self, stream: str) -> int:
        key = self._start_key(stream)
        raw = self._call("log_start", [key], lambda: self._r.get(key))
        if raw is None:
            return 0
        try:
            return int(raw)
        except ValueError:
            raise self._corrupt(key, None, "not an integer log start") from None
