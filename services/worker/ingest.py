"""The worker's public data plane: writers send an injector's records straight to the
worker owning their key range (docs/service.md, "Parallel ingestion").

The controller hands out where each range of an injector lives (``InjectRoutes``) and
keeps the writers' watermarks (``WriterWatermark``); the records themselves never pass
through it. A ``Write`` batch is checked whole against the same limits as the
controller's ``Inject`` (services/inject_limits.py), then checkpointed into the outbox of
the injector's range under its owner's token (:meth:`Receiver.inject`), exactly as a
batch the controller hands over: the ack says it is durable; a zombie's checkpoint is
fenced (NOT_OWNER) and the writer asks for the routes again.

Who may call it: the client token opens this service (not the cluster secret alone), on a
listener of its own (``worker --ingest-port``) whose threads are admitted per client
(services/rpc/admission.py: streams per client and in total, idle streams ended), so a
client holding streams open takes no thread from the Worker service; and it reaches
injector ranges only; a batch naming a computation, a sink or an injector this
worker does not know is refused and changes nothing. Record IDs are required: the writer
gives every record its ID before the first send, so a batch resent after a lost ack (or to
the range's next owner) is dropped downstream as the duplicate it is.
"""

from __future__ import annotations

from typing import Any, Iterator

import grpc

from millwheel.errors import InvalidSpecError, MillWheelError
from millwheel.nodes import injector_node
from millwheel.record import MAX_TIMESTAMP

from ..generated import millwheel_pb2 as pb
from ..inject_limits import InjectLimits
from ..rpc import convert
from ..rpc.admission import Admission, AdmissionLimits
from ..rpc.security import process
from ..rpc.server import ListenError, Malformed, start_server
from ..rpc.status import PreconditionError, code_for
from .receive import Receiver
from .shared import Shared

_STATUS = {pb.DeliverAck.OK: pb.WriteAck.OK, pb.DeliverAck.NOT_OWNER: pb.WriteAck.NOT_OWNER,
           pb.DeliverAck.BUSY: pb.WriteAck.BUSY, pb.DeliverAck.FAILED: pb.WriteAck.FAILED}


class IngestServicer:
    """``millwheel.v1.Ingest``: Write batches in, one ack per batch, in order."""

    def __init__(self, receiver: Receiver, shared: Shared, limits: InjectLimits) -> None:
        self.receiver = receiver
        self.shared = shared
        self.limits = limits

    def write(self, batch: Any, index: int) -> pb.WriteAck:
        """One batch checked and checkpointed; raises a MillWheelError for a bad one."""
        where = f"write batch {index} (batch_id {batch.batch_id})"
        if not batch.injector:
            raise InvalidSpecError(f"{where}: 'injector' is required")
        spec = self.shared.topology.injector(batch.injector)
        if spec is None:
            return pb.WriteAck(batch_id=batch.batch_id, status=pb.WriteAck.NOT_OWNER, message=(
                f"{self.shared.worker_id} knows no injector {batch.injector[:100]!r} (registry version "
                f"{self.shared.version}): InjectRoutes again"))
        if not 0 <= batch.range_id < spec.key_ranges:
            raise InvalidSpecError(f"{where}: range_id {batch.range_id} is not a range of injector "
                       f"{spec.name!r} (it has {spec.key_ranges})")
        if not batch.records:
            return pb.WriteAck(batch_id=batch.batch_id, status=pb.WriteAck.OK)
        missing = self.limits.check_message(batch, index, self.receiver.clock.now_us(), where=where)
        if missing:
            raise InvalidSpecError(f"{where} record {missing[0]}: every record needs an 'id' (the writer's: "
                       "a resent batch is dropped downstream by it)")
        node = injector_node(spec.name)
        owned = self.shared.units.get((node, batch.range_id))
        if owned is not None and owned.injector_wm >= MAX_TIMESTAMP:
            raise PreconditionError(f"{where}: injector {spec.name!r} is closed: its writers said done, so "
                                    "its watermark is +inf and these records would be late for every "
                                    "computation; send them through an injector of another name")
        records = convert.records_from_proto(batch.records)
        ack = self.receiver.inject(node, batch.range_id, records, None)
        return pb.WriteAck(batch_id=batch.batch_id, status=_STATUS[ack.status], message=ack.message)

    def Write(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Iterator[pb.WriteAck]:
        for index, batch in enumerate(request_iterator):
            if isinstance(batch, Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {batch.what} message: {batch.error}")
            try:
                ack = self.write(batch, index)
            except MillWheelError as exc:
                context.abort(code_for(exc), str(exc))
            yield ack


def start_ingest(host: str, port: int, servicer: IngestServicer,
                 limits: AdmissionLimits) -> tuple[grpc.Server, int, Admission]:
    """The Ingest listener: its own server and threads, client admission under ``limits``."""
    admission = Admission(limits, process().cluster_secret)
    try:
        server, bound, _health = start_server(f"{host}:{port}", {"Ingest": servicer}, admission=admission,
                                              probes=False, pool_name="ingest")
    except ListenError as exc:
        admission.close()
        raise ListenError(f"{exc} (--ingest-port)") from None
    return server, bound, admission
