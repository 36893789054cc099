"""Metrics of the edge's defences, exported at scrape time: TLS certificate rotation on the
gRPC port and access-log entries the release path refused (forged or foreign leases)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


class EdgeCollector:
    def __init__(self, tls: Callable[[], Any], rejected: Callable[[], Mapping[str, int]],
                 reasons: tuple[str, ...] = ()) -> None:
        self.tls = tls
        self.rejected = rejected
        self.reasons = reasons

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        tls = self.tls()
        enabled = GaugeMetricFamily("extauthz_tls_enabled", "1 when the gRPC port speaks TLS "
                                    "(2 with client certificates required: mTLS).")
        enabled.add_metric([], 0 if tls is None else (2 if tls.mtls else 1))
        yield enabled
        if tls is not None:
            yield CounterMetricFamily("extauthz_tls_reloads", "Certificates rotated on disk and "
                                      "loaded without a restart.", value=tls.reloads)
            yield CounterMetricFamily("extauthz_tls_reload_failures", "Rotated certificate files "
                                      "refused (unreadable, mismatched key): the last good certificate "
                                      "is still served.", value=tls.failures)
        rejected = CounterMetricFamily("extauthz_release_rejected", "Access-log lease releases "
                                       "refused before any store call, by reason (forged or altered "
                                       "ticket, keys outside the key space, ...).", labels=["reason"])
        for reason, n in sorted((dict.fromkeys(self.reasons, 0) | dict(self.rejected())).items()):
            rejected.add_metric([reason], n)
        yield rejected
