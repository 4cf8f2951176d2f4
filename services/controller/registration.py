"""Registering and unregistering computations, injectors and sinks.

A registration is validated and stored by the registry (services/controller/registry.py)
under ``Registry.changing``, without the controller's lock (heartbeats go on); the new
ranges are then made units and placed (:meth:`ControlPlane.after_registration`, the lock
taken in short holds). The answer describes what is registered, read under the lock.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from millwheel.connectors.spec import SourcePaths
from millwheel.errors import InvalidSpecError

from ..generated import millwheel_pb2 as pb
from ..rpc import convert
from ..rpc.server import check
from . import views
from .plane import ControlPlane
from .rescale_journal import check_not_copying

log = logging.getLogger("millwheel.controller")
Ctx = grpc.ServicerContext


class Registration:
    """RegisterComputation, RegisterTopology, RegisterInjector, UnregisterComputation."""

    def __init__(self, plane: ControlPlane, source_paths: SourcePaths | None = None) -> None:
        self.plane = plane
        #: where a files source may read (--allow-source-path; none by default): checked
        #: before anything is stored, so a refusal (PERMISSION_DENIED) changes nothing
        self.source_paths = source_paths or SourcePaths()

    def register_computation(self, request: Any, context: Ctx) -> pb.RegisterComputationResponse:
        check(request)
        if not request.HasField("spec"):
            raise InvalidSpecError("RegisterComputation: 'spec' is required")
        spec = convert.spec_from_proto(request.spec)
        p = self.plane
        with p.registry.changing:  # validated and stored without the controller's lock
            p.registry.register_computation(spec, tuple(request.log_streams))
            p.after_registration()
        log.info("registered computation %r", spec.name)
        with p.lock:
            return pb.RegisterComputationResponse(computation=views.info(p, spec.name))

    def register_topology(self, request: Any, context: Ctx) -> pb.RegisterTopologyResponse:
        """All of it or nothing: validated whole, stored in one write."""
        check(request)
        comps = [convert.spec_from_proto(s) for s in request.computations]
        injectors = convert.injectors_from_proto(request.injectors)
        sinks = convert.sinks_from_proto(request.sinks)
        self.source_paths.check_sources((i.name, i.source) for i in injectors)
        p = self.plane
        with p.registry.changing:  # validated and stored without the controller's lock
            new_comps, new_injs = p.registry.register_topology(comps, injectors, request.log_streams, sinks)
            if new_comps or new_injs or sinks:
                p.after_registration()
        log.info("registered %s", [*(c.name for c in new_comps), *(i.name for i in new_injs)] or "nothing new")
        with p.lock:
            wms = p.watermarks()
            return pb.RegisterTopologyResponse(
                computations=[views.info(p, c.name, wms) for c in comps],
                injectors=[convert.injector_to_proto(i) for i in injectors],
                registered=[*(c.name for c in new_comps), *(i.name for i in new_injs)])

    def register_injector(self, request: Any, context: Ctx) -> pb.RegisterInjectorResponse:
        check(request)
        spec = convert.injectors_from_proto([request.spec])[0]
        self.source_paths.check_sources([(spec.name, spec.source)])
        p = self.plane
        with p.registry.changing:
            if p.registry.register_injector(spec):
                p.after_registration()
                log.info("registered injector %r -> stream %r", spec.name, spec.stream)
        return pb.RegisterInjectorResponse(injector=convert.injector_to_proto(spec))

    def unregister_computation(self, request: Any, context: Ctx) -> pb.UnregisterComputationResponse:
        check(request)
        p = self.plane
        with p.registry.changing:
            check_not_copying(p.assigner, request.name, "unregistration")
            p.registry.unregister_computation(request.name)
            p.after_registration()
        return pb.UnregisterComputationResponse()
