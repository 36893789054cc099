"""A gRPC health probe as Kubernetes runs it (``grpc_health_probe``, or the kubelet's own
``grpc`` probe): a fresh connection per probe, ``grpc.health.v1.Health/Check`` with a short
deadline, the answer's status by name; grpcio's client, plaintext or TLS."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def health_probe(target: str, credentials: grpc.ChannelCredentials | None = None, *, service: str = "",
                 timeout: float = 1.0, server_name: str | None = None) -> str:
    """``SERVING``, ``NOT_SERVING``, ... or the RPC's failure code name (``UNAVAILABLE``)."""
    options = [("grpc.primary_user_agent", "grpc_health_probe")]
    if server_name is not None:
        options.append(("grpc.ssl_target_name_override", server_name))
    channel = (grpc.insecure_channel(target, options=options) if credentials is None
               else grpc.secure_channel(target, credentials, options=options))
    with channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            return str(exc.code().name)  # type: ignore[attr-defined]
    return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
