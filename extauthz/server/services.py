"""gRPC servicers: Authorization/Check and AccessLogService/StreamAccessLogs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from ..engine import Engine
from ..proto import accesslog_pb2, accesslog_pb2_grpc, auth_pb2, auth_pb2_grpc
from .edge import EXT_AUTHZ_NAMESPACE, check_response, lease_release, raw_request

log = logging.getLogger("extauthz.server")


class AuthorizationService(auth_pb2_grpc.AuthorizationServicer):  # type: ignore[misc]
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Check(  # noqa: N802 - gRPC method name
        self, request: auth_pb2.CheckRequest, context: grpc.aio.ServicerContext
    ) -> auth_pb2.CheckResponse:
        engine = self.engine
        snap = engine.snapshot
        try:
            raw = raw_request(request, snap.classifier.needed_headers,
                              snap.policy.route_metadata_namespace)
            ctx = snap.classifier.context(raw)
        except Exception:  # a malformed request is decided safely: allowed, counted
            log.exception("could not read a CheckRequest; allowing it")
            engine.failures["bad_request"] = engine.failures.get("bad_request", 0) + 1
            return auth_pb2.CheckResponse(ok_response=auth_pb2.OkHttpResponse())
        decision = await engine.decide(ctx)
        return check_response(ctx, decision)


class AccessLogService(accesslog_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """Releases the leases of every finished request that Envoy's access log reports."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.entries = 0
        self.released = 0
        self.release_errors = 0

    async def StreamAccessLogs(  # noqa: N802 - gRPC method name
        self,
        request_iterator: AsyncIterator[accesslog_pb2.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext,
    ) -> accesslog_pb2.StreamAccessLogsResponse:
        async for message in request_iterator:
            jobs = []
            for entry in message.http_logs.log_entry:
                self.entries += 1
                common = entry.common_properties
                if common.intermediate_log_entry:
                    continue
                fm = common.metadata.filter_metadata
                if EXT_AUTHZ_NAMESPACE not in fm:
                    continue
                lease = lease_release(fm[EXT_AUTHZ_NAMESPACE])
                if lease is not None:
                    jobs.append(self.engine.release(*lease))
            if jobs:
                for result in await asyncio.gather(*jobs, return_exceptions=True):
                    if isinstance(result, BaseException):
                        # the lease TTL is the backstop; count and go on
                        self.release_errors += 1
                    else:
                        self.released += result
        return accesslog_pb2.StreamAccessLogsResponse()

