"""Where a production goes and the links it goes over, for both sides of a worker: the
pump sending outboxes (:mod:`services.worker.send`) and a batch's weak productions,
sent before their checkpoint (:mod:`services.worker.receive`).

A production goes to a stream log, or to the consumer range its key falls in
(:func:`route`), as a :func:`batch` over the :class:`PeerLinks` link to that range's
owner when another worker owns it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from millwheel.keys import key_range
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
    return message


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
