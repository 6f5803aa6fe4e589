"""The gRPC server's standard services beside Tandem's own: health (``grpc.health.v1``: ``Check``,
``Watch`` and ``List``) and server reflection under both names clients ask for.

Reflection: current clients (grpcurl, Postman, grpcui) ask for ``grpc.reflection.v1`` first and
fall back to ``v1alpha``. The two protos differ in their package only, field for field, so one
servicer answers both: the ``v1alpha`` one, also registered under the ``v1`` name with the same
(wire-identical) messages. The services listed are those whose descriptors the servicer can give.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


class ListingHealthServicer(health.aio.HealthServicer):
    """grpc's health servicer with ``List``: every service's status as last set."""

    def __init__(self) -> None:
        super().__init__()
        self._statuses: dict[str, Any] = {"": health_pb2.HealthCheckResponse.SERVING}

    async def set(self, service: str, status: Any) -> None:
        self._statuses[service] = status
        await super().set(service, status)

    async def List(self, request: Any, context: Any) -> Any:
        statuses = {name: health_pb2.HealthCheckResponse(status=s) for name, s in self._statuses.items()}
        return health_pb2.HealthListResponse(statuses=statuses)


def add_health(server: grpc.aio.Server) -> ListingHealthServicer:
    servicer = ListingHealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


def add_reflection(server: grpc.aio.Server, service_names: Sequence[str]) -> None:
    """Reflection over ``service_names`` (with the health and reflection services), as both
    ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``."""
    names = (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.method_handlers_generic_handler(
        REFLECTION_V1,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((v1,))
