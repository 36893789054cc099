"""The server's ``/status`` document and scrape-time metrics: one
:class:`~extauthz.engine.state.Panel` of every component's part, in ``/status`` order
(tests/integration/test_operations.py keeps that order). A component with state of its own adds
its part here (or later with ``Panel.add``, as the recorder does)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from .. import __version__
from ..core.runner import Runner
from ..engine.engine import Engine
from ..engine.overload import LoopLag
from ..engine.reload import PolicyWatcher
from ..engine.state import (
    AccessLogPart,
    FailOpenPart,
    GrantsPart,
    LeaseSampler,
    ModesPart,
    OverloadPart,
    Panel,
    PolicyPart,
    ReleasesPart,
    ReloadPart,
    Section,
    ShadowPart,
    ShedPart,
    StorePart,
    UncheckedPart,
    by_label_part,
    classifier_part,
    count_part,
)
from ..observe.setup import Observability
from .fleetstate import FleetState
from .opsports import OperatorPorts
from .services import AccessLogService, AuthorizationService
from .tls import CertificateReloader


class Owners(Protocol):
    """What the panel reads of the server's built owners (server/app.py's Server is one;
    the panel never imports it: the app builds the panel)."""

    engine: Engine
    observe: Observability
    runner: Runner
    accesslog: AccessLogService
    watcher: PolicyWatcher | None
    lag: LoopLag
    auth: AuthorizationService
    fleet: FleetState
    leases: LeaseSampler | None
    tls: CertificateReloader | None
    ports: OperatorPorts
    status_sections: dict[str, Callable[[], Any]]


def status_panel(server: Owners) -> Panel:
    """The parts of the server's built owners, read at each ``/status`` and scrape."""
    engine, observe, runner, accesslog = server.engine, server.observe, server.runner, server.accesslog
    metrics = observe.metrics
    return Panel([
        Section(lambda: {"extauthz": __version__}),
        PolicyPart(engine),
        ReloadPart(engine, server.watcher),
        StorePart(engine),
        Section(lambda: {"checks": metrics.request_counts() if metrics is not None else None}),
        FailOpenPart(engine),
        UncheckedPart(accesslog.finished),
        OverloadPart(server.lag),
        count_part("bad_requests", "extauthz_bad_requests", "CheckRequests the edge could not "
                   "read (answered allowed).", lambda: server.auth.flow.bad_requests),
        by_label_part("background_errors", "extauthz_background_errors", "Background job runs "
                      "that raised (the job keeps running), by job.", "job", lambda: runner.errors),
        ModesPart(engine),
        server.fleet,
        ShedPart(engine),
        server.leases if server.leases is not None else Section(lambda: {"leases_in_flight": None}),
        AccessLogPart(accesslog),
        ReleasesPart(engine),
        ShadowPart(observe.shadow),
        Section(lambda: {
            "decision_log": {"written": observe.decision_log.written,
                             "suppressed": observe.decision_log.suppressed_total},
            "observer_errors": observe.observers.errors,
            "tracing": observe.tracing is not None,
            "tls": server.tls.status() if server.tls is not None else {"enabled": False},
            **server.ports.status(),
            "changes": server.fleet.changes.status(),
            "change_log_errors": server.fleet.changes.errors,
            **{name: section() for name, section in server.status_sections.items()}}),
        GrantsPart(engine),  # batched grants (was the first of status_sections)
        classifier_part(engine),
    ])
