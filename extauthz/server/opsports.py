"""The operator's ports of a server: the admin port (with its lock,
:mod:`extauthz.server.adminauth`) and the metrics port. Their addresses are checked against
the public Check ports when built; :meth:`OperatorPorts.start` serves them on the event loop
(:mod:`extauthz.server.ports`), the admin port on an OS-chosen port when its address is taken
and it was not asked for (two servers on one host)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from .adminauth import AdminGuard, TokenFile, require_token_when_exposed
from .ports import HttpPorts, metrics_app, off, parse_listen

if TYPE_CHECKING:
    from ..core.settings import Settings

log = logging.getLogger("extauthz.server")


class OperatorPorts:
    def __init__(self, listen: str | Sequence[str], admin_listen: str | None, metrics_listen: str | None,
                 *, admin_optional: bool = False, admin_token_file: str | None = None,
                 admin_hosts: Sequence[str] = ()) -> None:
        self.http = HttpPorts(listen)
        self.admin_listen = off(admin_listen)
        self.metrics_listen = off(metrics_listen)
        self.http.check("admin", self.admin_listen)
        self.http.check("metrics", self.metrics_listen)
        # the admin port's lock (server/adminauth.py): no token on a non-loopback address
        # refuses the start; an unreadable token file too
        require_token_when_exposed(self.admin_listen, admin_token_file)
        self.guard = (AdminGuard(self.admin_listen, hosts=admin_hosts,
                                 tokens=TokenFile(admin_token_file) if admin_token_file else None)
                      if self.admin_listen is not None else None)
        #: the admin port was not asked for: when taken, take an OS-chosen one (two servers
        #: on one host) instead of failing the start.
        self.admin_optional = admin_optional
        self.admin_port = 0
        self.metrics_port = 0

    @classmethod
    def from_settings(cls, settings: Settings) -> OperatorPorts:
        """The ports ``settings`` asks for, checked against its public Check ports."""
        return cls([x for x in (off(settings.listen), off(settings.http_listen)) if x is not None],
                   settings.admin_listen, settings.metrics_listen, admin_optional=settings.admin_listen_optional,
                   admin_token_file=settings.admin_token_file, admin_hosts=settings.admin_hosts)

    def status(self) -> Mapping[str, Any]:
        return {"admin": self.guard.status() if self.guard is not None else None}

    async def start(self, admin: Callable[[AdminGuard | None], web.Application],
                    registry: CollectorRegistry | None) -> None:
        """Serve the metrics app on ``registry`` (None: no metrics) and the admin app that
        ``admin`` builds with the lock. The caller stops what started when this raises."""
        if registry is not None and self.metrics_listen is not None:
            self.metrics_port = await self.http.start(metrics_app(registry), self.metrics_listen,
                                                      "--metrics-listen")
        if self.admin_listen is not None:
            self.admin_port = await self._start_admin(admin, self.admin_listen)

    async def _start_admin(self, admin: Callable[[AdminGuard | None], web.Application], listen: str) -> int:
        try:
            return await self.http.start(admin(self.guard), listen, "--admin-listen")
        except OSError as exc:
            if not self.admin_optional:
                raise
            host = parse_listen(listen)[0]
            anywhere = f"[{host}]:0" if ":" in host else f"{host}:0"
            port = await self.http.start(admin(self.guard), anywhere, "--admin-listen")
            log.warning("%s; the admin port is %d instead (not asked for with --admin-listen, so "
                        "not fatal; `extauthz switch --listen HOST:PORT` finds it)", exc, port,
                        extra={"fields": {"event": "admin_port_fallback", "admin_port": port}})
            return port

    async def stop(self) -> None:
        await self.http.stop()
