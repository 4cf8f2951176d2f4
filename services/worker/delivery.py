"""Where a production goes and the links it goes over, for both sides of a worker: the
pump sending outboxes (:mod:`services.worker.send`) and a batch's weak productions,
sent before their checkpoint (:mod:`services.worker.receive`).

A production goes to a stream log, or to the consumer range its key falls in
(:func:`route`), as a :func:`batch` over the :class:`PeerLinks` link to that range's
owner when another worker owns it. A batch names the input streams its records came on
(:func:`inputs`; one stream, the usual case, costs nothing per record) and its receiver
processes it in one part per stream (:class:`Inputs`), so late records are counted per
input (:mod:`millwheel.late`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Container, Iterable, Sequence

from millwheel.keys import key_range
from millwheel.record import Record
from millwheel.runtime.routing import LOG_PREFIX
from millwheel.state.protocol import Production
from millwheel.topology import Topology

from ..generated import millwheel_pb2 as pb
from ..metrics import PrometheusSensors
from ..rpc import convert
from ..rpc.worker_link import PeerLink
from .units import OwnerInfo

Unit = tuple[str, int]


def route(topology: Topology, entries: list[Production]
          ) -> tuple[dict[str, list[Production]], dict[Unit, list[Production]], list[Production]]:
    """(stream-log entries by stream, entries by consumer range, entries of consumers
    not registered here: they stay until the consumer is back)."""
    logs: dict[str, list[Production]] = defaultdict(list)
    groups: dict[Unit, list[Production]] = defaultdict(list)
    unknown: list[Production] = []
    for p in entries:
        if p.consumer.startswith(LOG_PREFIX):
            logs[p.consumer[len(LOG_PREFIX):]].append(p)
        else:
            try:
                ranges = topology.computation(p.consumer).options.key_ranges
            except Exception:
                unknown.append(p)
                continue
            groups[(p.consumer, key_range(p.record.key, ranges))].append(p)
    return logs, groups, unknown


def batch(producer: str, consumer: str, range_id: int, items: list[Production], version: int
          ) -> pb.DeliverBatch:
    """The Deliver message of ``items`` for one consumer range, under registry ``version``."""
    message = pb.DeliverBatch(producer=producer, computation=consumer, range_id=range_id,
                              topology_version=version)
    convert.add_records(message.records, (p.record for p in items))
    streams, stream_of = inputs(items)
    message.streams.extend(streams)
    if stream_of:
        message.stream_of.extend(stream_of)
    return message


def inputs(items: list[Production]) -> tuple[list[str], list[int]]:
    """The streams ``items`` came on, each once, and, only when there are several, the
    index of each item's among them (``DeliverBatch.streams`` and ``stream_of``)."""
    if not items:
        return [], []
    first = items[0].stream
    for p in items:
        if p.stream != first:
            break
    else:
        return [first], []
    index: dict[str, int] = {}
    stream_of = [index.setdefault(p.stream, len(index)) for p in items]
    return list(index), stream_of


class Inputs:
    """Which input stream each record of a delivered batch came on (the receiver's side
    of :func:`inputs`): a stream that is not one of ``known`` (the computation's inputs),
    and every stream of a batch whose ``stream_of`` does not fit it, count as not known
    (""), so what a sender names never becomes a counter or a metric label unchecked."""

    def __init__(self, records: Sequence[Record], streams: Sequence[str], stream_of: Sequence[int],
                 known: Container[str]) -> None:
        names = [s if s in known else "" for s in streams]
        if stream_of and (len(stream_of) != len(records) or max(stream_of) >= len(names)):
            names, stream_of = [], []
        self.only = names[0] if names and not stream_of else ""
        self.of = {id(r): names[i] for r, i in zip(records, stream_of, strict=True)} if stream_of else None

    def split(self, records: list[Record]) -> list[tuple[str, list[Record]]]:
        """``records`` (some of the batch's) as one part per input stream, each in order."""
        if self.of is None:
            return [(self.only, records)]
        of = self.of
        parts: dict[str, list[Record]] = {}
        for r in records:
            stream = of.get(id(r), "")
            part = parts.get(stream)
            if part is None:
                parts[stream] = [r]
            else:
                part.append(r)
        return list(parts.items())


class PeerLinks:
    """This worker's links to other workers, one per address, opened on first use."""

    def __init__(self, max_inflight: int, sensors: PrometheusSensors) -> None:
        self.max_inflight = max_inflight
        self.sensors = sensors
        self.links: dict[str, PeerLink] = {}

    def link(self, address: str) -> PeerLink:
        link = self.links.get(address)
        if link is None:
            link = self.links[address] = PeerLink(address, self.max_inflight, self.sensors)
        return link

    def sweep(self, owners: Iterable[OwnerInfo]) -> list[str]:
        """Close the links (channel, reader thread, metric series) to addresses that own
        no range now and wait for no ack; returns those addresses. A worker restarted
        comes back at another port, so without this every address ever sent to would
        keep its link for the life of the process."""
        live = {o.address for o in owners}
        gone = [a for a, link in list(self.links.items()) if a not in live and link.idle()]
        for address in gone:
            self.links.pop(address).close()
            self.sensors.forget_destination(address)
        return gone

    def close(self) -> None:
        for link in self.links.values():
            link.close()
