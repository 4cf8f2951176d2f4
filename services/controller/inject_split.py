"""Large Inject messages go to the injector's owner in bounded pieces.

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

from ..generated import millwheel_pb2 as pb


def split(batch: pb.DeliverBatch, limit: int) -> Iterator[tuple[pb.DeliverBatch, bool]]:
    """(piece, is the message's last piece), in order; the batch itself if small enough."""
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
