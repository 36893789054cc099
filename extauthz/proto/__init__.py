"""Wire-compatible protobuf/gRPC classes for the Envoy APIs the server speaks.

These replace the ``xds-protos`` package, which cannot be a run-time dependency: it
overwrites ``opentelemetry-proto``'s files and breaks the OTLP exporter. The ``.proto``
sources in ``protos/extauthz_wire/`` keep Envoy's protobuf package names, message names
and field numbers/types for the fields we use; protobuf skips unknown fields, so they
decode what Envoy sends and Envoy decodes what we send. Regenerate the modules in
``extauthz/proto/extauthz_wire/`` with ``scripts/gen_protos.sh`` (never edit them).

Usage::

    from extauthz.proto import auth_pb2, auth_pb2_grpc, core_pb2, http_status_pb2, status_pb2

Short aliases (module -> protobuf package, main contents):

``auth_pb2``
    ``envoy.service.auth.v3``: CheckRequest, AttributeContext (.Peer, .Request,
    .HttpRequest, .TLSSession), CheckResponse, DeniedHttpResponse, OkHttpResponse.
``auth_pb2_grpc``
    ``Authorization`` service: AuthorizationServicer, AuthorizationStub,
    add_AuthorizationServicer_to_server.
``accesslog_pb2``
    ``envoy.service.accesslog.v3``: StreamAccessLogsMessage (.Identifier,
    .HTTPAccessLogEntries, .TCPAccessLogEntries), StreamAccessLogsResponse.
``accesslog_pb2_grpc``
    ``AccessLogService`` service: AccessLogServiceServicer, AccessLogServiceStub,
    add_AccessLogServiceServicer_to_server.
``accesslog_data_pb2``
    ``envoy.data.accesslog.v3``: HTTPAccessLogEntry, AccessLogCommon (``metadata``
    carries ``filter_metadata["envoy.filters.http.ext_authz"]``), HTTPRequestProperties,
    HTTPResponseProperties, ResponseFlags, AccessLogType.
``core_pb2``
    ``envoy.config.core.v3``: Address, SocketAddress, Pipe, Metadata, HeaderValue,
    HeaderValueOption, HeaderMap, QueryParameter, Node, RequestMethod.
``http_status_pb2``
    ``envoy.type.v3``: HttpStatus, StatusCode (e.g. ``http_status_pb2.TooManyRequests``).
``rls_pb2``
    ``envoy.service.ratelimit.v3``: RateLimitRequest, RateLimitResponse (.Code,
    .RateLimit, .DescriptorStatus): what Envoy's ratelimit filter sends and reads.
``rls_pb2_grpc``
    ``RateLimitService`` service: RateLimitServiceServicer, RateLimitServiceStub,
    add_RateLimitServiceServicer_to_server.
``ratelimit_common_pb2``
    ``envoy.extensions.common.ratelimit.v3``: RateLimitDescriptor (.Entry,
    .RateLimitOverride).
``ratelimit_unit_pb2``
    ``envoy.type.v3``: RateLimitUnit.
``rlqs_pb2``
    ``envoy.service.rate_limit_quota.v3`` as Envoy 1.40.0 speaks it (pinned by Envoy
    version, docs/rlqs.md): RateLimitQuotaUsageReports (.BucketQuotaUsage),
    RateLimitQuotaResponse (.BucketAction, .QuotaAssignmentAction, .AbandonAction), BucketId.
``rlqs_pb2_grpc``
    ``RateLimitQuotaService`` service: RateLimitQuotaServiceServicer, RateLimitQuotaServiceStub,
    add_RateLimitQuotaServiceServicer_to_server.
``ratelimit_strategy_pb2``
    ``envoy.type.v3``: RateLimitStrategy (.BlanketRule), TokenBucket.
``status_pb2``
    ``google.rpc``: Status. This is googleapis-common-protos' ``google.rpc.status_pb2``
    (a second definition of ``google.rpc.Status`` would clash in the descriptor pool).

Do not import ``xds-protos`` modules in the same process: both define the same
``envoy.*`` message names and the descriptor pool rejects duplicates.
"""

from google.rpc import status_pb2

from extauthz.proto.extauthz_wire import (
    accesslog_data_pb2,
    accesslog_pb2,
    accesslog_pb2_grpc,
    auth_pb2,
    auth_pb2_grpc,
    core_pb2,
    http_status_pb2,
    ratelimit_common_pb2,
    ratelimit_strategy_pb2,
    ratelimit_unit_pb2,
    rlqs_pb2,
    rlqs_pb2_grpc,
    rls_pb2,
    rls_pb2_grpc,
)

__all__ = [
    "accesslog_data_pb2",
    "accesslog_pb2",
    "accesslog_pb2_grpc",
    "auth_pb2",
    "auth_pb2_grpc",
    "core_pb2",
    "http_status_pb2",
    "ratelimit_common_pb2",
    "ratelimit_strategy_pb2",
    "ratelimit_unit_pb2",
    "rlqs_pb2",
    "rlqs_pb2_grpc",
    "rls_pb2",
    "rls_pb2_grpc",
    "status_pb2",
]
