"""Server reflection under both protocol versions: ``grpc.reflection.v1`` (what current
clients such as grpcurl and grpc-js reflection clients ask first) and the older
``grpc.reflection.v1alpha``.

grpcio-reflection ships only v1alpha. The two versions are the same messages under
another package name, so the same servicer answers both: v1 requests parse as v1alpha
messages on the wire. The v1 service's own descriptor is added to the descriptor pool
(a copy of v1alpha's with the package renamed) so a client can discover it too.

Descriptors are served with the proto's comments: the Python stubs carry no source
info, so files generated with it (``services/generated/*.desc``, made beside the stubs
by scripts/gen_proto.py) replace them in every answer. A client then shows what each
service, RPC, message and field means.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from grpc_reflection.v1alpha import reflection_pb2_grpc as rpb_grpc

V1_PACKAGE = "grpc.reflection.v1"
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
V1ALPHA_SERVICE_NAME: str = v1alpha.SERVICE_NAME
GENERATED = Path(__file__).resolve().parents[1] / "generated"


def documented_files() -> dict[str, bytes]:
    """File name -> serialized FileDescriptorProto with source info (comments)."""
    out: dict[str, bytes] = {}
    for path in sorted(GENERATED.glob("*.desc")):
        for fdp in descriptor_pb2.FileDescriptorSet.FromString(path.read_bytes()).file:
            out[fdp.name] = fdp.SerializeToString()
    return out


class DocumentedReflectionServicer(v1alpha.ReflectionServicer):
    """The stock servicer, answering with the documented form of our proto files."""

    def __init__(self, service_names: list[str], documented: dict[str, bytes]) -> None:
        super().__init__(service_names)
        self._documented = documented

    def _with_docs(self, response: Any) -> Any:
        if response.HasField("file_descriptor_response"):
            protos = response.file_descriptor_response.file_descriptor_proto
            for i, raw in enumerate(protos):
                name = descriptor_pb2.FileDescriptorProto.FromString(raw).name
                if name in self._documented:
                    protos[i] = self._documented[name]
        return response

    def _file_by_filename(self, request: Any, filename: str) -> Any:
        return self._with_docs(super()._file_by_filename(request, filename))  # type: ignore[misc]

    def _file_containing_symbol(self, request: Any, fully_qualified_name: str) -> Any:
        return self._with_docs(super()._file_containing_symbol(  # type: ignore[misc]
            request, fully_qualified_name))


def v1_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """v1alpha's reflection.proto with its package renamed to ``grpc.reflection.v1``."""
    fdp = descriptor_pb2.FileDescriptorProto()
    rpb.DESCRIPTOR.CopyToProto(fdp)
    old = f".{fdp.package}."
    fdp.name = "grpc/reflection/v1/reflection.proto"
    fdp.package = V1_PACKAGE
    for msg in fdp.message_type:
        for field in msg.field:
            if field.type_name:  # assigning even "" would mark a scalar field as typed
                field.type_name = field.type_name.replace(old, f".{V1_PACKAGE}.")
    for service in fdp.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, f".{V1_PACKAGE}.")
            method.output_type = method.output_type.replace(old, f".{V1_PACKAGE}.")
    return fdp


def _register_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName("grpc/reflection/v1/reflection.proto")
    except KeyError:
        pool.Add(v1_file_descriptor())


def enable(server: grpc.Server, service_names: Iterable[str]) -> list[str]:
    """Serve reflection (v1 and v1alpha) for ``service_names`` plus both reflection
    services; returns every service name now reflected."""
    _register_v1_descriptor()
    names = [*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME]
    servicer = DocumentedReflectionServicer(names, documented_files())
    rpb_grpc.add_ServerReflectionServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=rpb.ServerReflectionRequest.FromString,
        response_serializer=rpb.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": handler}),)
    )
    return names
