"""OpenTelemetry traces: one span per Check, the child of Envoy's span.

Configured from the standard ``OTEL_*`` variables, and OFF unless they ask for it:
tracing is on when ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp`` or ``console``) or
``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set, and
``OTEL_SDK_DISABLED`` is not ``true``. Off means no tracer at all: the server then installs
neither the traced servicer nor this observer, so a check pays nothing.

When on: the OTLP/gRPC exporter (it reads ``OTEL_EXPORTER_OTLP_*``: endpoint, headers,
``INSECURE``, timeout), a batch span processor (``OTEL_BSP_*``), the sampler from
``OTEL_TRACES_SAMPLER`` (default ``parentbased_always_on``: Envoy's sampling decision is
followed), and the resource from ``OTEL_SERVICE_NAME`` (default ``extauthz``) and
``OTEL_RESOURCE_ATTRIBUTES``.

The parent is the W3C ``traceparent`` Envoy sends in the gRPC metadata of the Check call.
Span attributes come from :class:`TracingObserver`, which the engine calls inside the span;
the store call is a child span (:func:`extauthz.observe.metrics.instrument_store_check`);
shadow would-denials are span events. Identities are the classifier's keyed hash.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..core.context import RequestContext
from ..core.verdict import Decision, Outcome
from ..policy.model import Policy

TRACER_NAME = "extauthz"
CHECK_SPAN = "extauthz.check"
SHADOW_EVENT = "extauthz.shadow_denied"
ROUTE_MAX = 100

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_KEYS = ("traceparent", "tracestate")


def tracing_requested(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def _exporter(env: Mapping[str, str]) -> SpanExporter:
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "otlp").split(",") if n.strip()]
    name = names[0] if names else "otlp"
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        raise ValueError(f"OTEL_TRACES_EXPORTER={name!r}: extauthz supports 'otlp', 'console' or 'none'")
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))
    if protocol.strip().lower() != "grpc":
        raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: extauthz exports OTLP over gRPC only")
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def provider_from_env(env: Mapping[str, str] | None = None) -> TracerProvider | None:
    """A tracer provider as the ``OTEL_*`` variables say, or None when tracing is off."""
    env = os.environ if env is None else env
    if not tracing_requested(env):
        return None
    attrs: dict[str, Any] = {}
    if not env.get("OTEL_SERVICE_NAME"):
        attrs["service.name"] = "extauthz"
    provider = TracerProvider(resource=Resource.create(attrs))
    provider.add_span_processor(BatchSpanProcessor(_exporter(env)))
    return provider


def parent_context(metadata: Iterable[tuple[str, Any]] | None) -> Context | None:
    """The remote parent named by ``traceparent``/``tracestate`` in gRPC metadata."""
    carrier: dict[str, str] = {}
    for key, value in metadata or ():
        if key in _TRACE_KEYS:
            carrier[key] = value.decode() if isinstance(value, bytes) else str(value)
    return _PROPAGATOR.extract(carrier) if carrier else None


class TracingObserver:
    """Puts the decision on the current span (the Check span): attributes and events."""

    def __init__(self) -> None:
        self._keys: dict[str, tuple[str, str]] = {}

    def _limiter_keys(self, name: str) -> tuple[str, str]:
        keys = self._keys.get(name)
        if keys is None:
            keys = self._keys[name] = (f"extauthz.limiter.{name}.outcome", f"extauthz.limiter.{name}.remaining")
        return keys

    def decided(self, ctx: RequestContext, decision: Decision, policy: Policy) -> None:
        span = trace.get_current_span()
        if not span.is_recording():
            return
        attrs: dict[str, Any] = {
            "extauthz.tier": ctx.tier.value,
            "extauthz.tier_source": ctx.tier_source,
            "extauthz.identity": ctx.identity,
            "extauthz.identity_source": ctx.identity_source,
            "extauthz.plan": ctx.plan,
            "extauthz.plan_source": ctx.plan_source,
            "extauthz.decision": "allowed" if decision.allowed else "denied",
            "extauthz.http_status": decision.http_status,
            "extauthz.policy_version": policy.version,
            "http.request.method": ctx.method,
            "url.path": ctx.path[:ROUTE_MAX],
        }
        if ctx.request_id:
            attrs["extauthz.request_id"] = ctx.request_id
        if decision.denied_by is not None:
            attrs["extauthz.denied_by"] = decision.denied_by.limiter
            attrs["extauthz.reason"] = decision.denied_by.reason
        if decision.failures:
            attrs["extauthz.store_failures"] = list(decision.failures)
        for v in decision.verdicts:
            outcome_key, remaining_key = self._limiter_keys(v.limiter)
            attrs[outcome_key] = v.outcome.value
            if v.remaining is not None:
                attrs[remaining_key] = v.remaining
            if v.outcome is Outcome.SHADOW_DENIED:
                event: dict[str, Any] = {"extauthz.limiter": v.limiter, "extauthz.reason": v.reason}
                if v.remaining is not None:
                    event["extauthz.remaining"] = v.remaining
                if v.limit is not None:
                    event["extauthz.limit"] = v.limit
                if v.retry_after is not None:
                    event["extauthz.retry_after"] = v.retry_after
                span.add_event(SHADOW_EVENT, event)
        span.set_attributes(attrs)

    def store_failed(self, reason: str) -> None:
        span = trace.get_current_span()
        if span.is_recording():
            span.add_event("extauthz.store_failed", {"extauthz.reason": reason})


class Tracing:
    """The server's tracer and its provider (flushed on stop)."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer(TRACER_NAME)

    def shutdown(self) -> None:
        self.provider.force_flush(2000)
        self.provider.shutdown()
