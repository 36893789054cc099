"""A small OTLP/gRPC trace receiver for tests: collects every exported span."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    events: list[tuple[str, dict[str, Any]]]


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    def Export(self, request: Any, context: Any) -> Any:
        got = []
        for rs in request.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(
                        service=str(service), name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                        parent_span_id=s.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        events=[(e.name, {a.key: _value(a.value) for a in e.attributes}) for e in s.events],
                    ))
        with self._lock:
            self._spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(0)
