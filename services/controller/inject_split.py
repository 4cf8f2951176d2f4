"""Large Inject messages go to the injector's owner in bounded pieces (and, for an
injector of several key ranges, one piece per range its records' keys fall in).

One client message may hold many records (up to the documented per-message limit).
Handed to a worker whole, it would be one checkpoint of that size and one batch of
that size downstream: long enough to starve everything else the worker does. The
controller cuts it into pieces of at most ``limit`` records, in order; each piece is
its own step of the call's in-order protocol (``inject_seq``), and only the last
piece carries the message's watermark, so the injector's watermark moves once the
whole message is in. A message counts as accepted (``accepted-messages``) only when
its last piece is; pieces of a refused message that got in are deduplicated by
record ID when the client resends the message (records the client gave no ID get
fresh ones on a resend: give IDs for exactly-once across retries).
"""

from __future__ import annotations

from typing import Iterator

from millwheel.keys import key_range

from ..generated import millwheel_pb2 as pb


def split(batch: pb.DeliverBatch, limit: int, key_ranges: int = 1) -> Iterator[tuple[pb.DeliverBatch, bool]]:
    """(piece, is the message's last piece), in order; the batch itself if small enough
    and the injector has one range. With several ranges every range gets a piece (an
    empty one carries the watermark: each range holds the injector's watermark)."""
    if key_ranges > 1:
        yield from _by_range(batch, limit, key_ranges)
        return
    n = len(batch.records)
    if n <= limit:
        yield batch, True
        return
    for start in range(0, n, limit):
        piece = pb.DeliverBatch(computation=batch.computation, range_id=batch.range_id,
                                topology_version=batch.topology_version,
                                inject_session=batch.inject_session)
        piece.records.extend(batch.records[start:start + limit])
        last = start + limit >= n
        if last and batch.HasField("watermark"):
            piece.watermark = batch.watermark
        yield piece, last


def _by_range(batch: pb.DeliverBatch, limit: int, key_ranges: int) -> Iterator[tuple[pb.DeliverBatch, bool]]:
    groups: list[list[pb.Record]] = [[] for _ in range(key_ranges)]
    for m in batch.records:
        groups[key_range(m.key, key_ranges)].append(m)
    has_wm = batch.HasField("watermark")
    pieces: list[pb.DeliverBatch] = []
    for r, records in enumerate(groups):
        if not records and not has_wm:
            continue
        one = pb.DeliverBatch(computation=batch.computation, range_id=r,
                              topology_version=batch.topology_version, inject_session=batch.inject_session)
        one.records.extend(records)
        if has_wm:
            one.watermark = batch.watermark
        pieces.extend(p for p, _ in split(one, limit))
    if not pieces:  # no records and no watermark: still one (empty) step of the call
        pieces.append(pb.DeliverBatch(computation=batch.computation, range_id=0,
                                      topology_version=batch.topology_version,
                                      inject_session=batch.inject_session))
    for i, piece in enumerate(pieces):
        yield piece, i == len(pieces) - 1
