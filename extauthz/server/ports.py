"""The HTTP ports (admin, metrics): ``HOST:PORT`` parsing, starting an aiohttp app on the
server's event loop, and stopping them all. The gRPC port is :mod:`extauthz.server.app`'s.

Both run on the event loop rather than in a thread of their own (prometheus-client's
``start_http_server``): the scrape-time collectors then read engine state from the thread
that writes it, and start/stop follow the server's lifecycle.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ..core.settings import OFF, off, parse_listen  # parsed in one place (re-exported here)

__all__ = ["OFF", "HttpPorts", "metrics_app", "off", "parse_listen"]

log = logging.getLogger("extauthz.server")

def metrics_app(registry: CollectorRegistry) -> web.Application:
    """``GET /metrics`` (and ``/``) in the Prometheus text format."""
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", metrics)
    return app


class HttpPorts:
    """The server's HTTP ports; none may be a public Check port (gRPC or HTTP authorization)."""

    def __init__(self, public: str | Sequence[str]) -> None:
        self.public = [public] if isinstance(public, str) else list(public)
        self._runners: list[web.AppRunner] = []

    def check(self, what: str, listen: str | None) -> None:
        """Refuse ``listen`` when it is a public Check port (a fixed port, not 0)."""
        if listen is None:
            return
        port = parse_listen(listen)[1]
        for public in self.public:
            if port != 0 and port == parse_listen(public)[1]:
                raise ValueError(f"the {what} port must not be the public Check port ({public})")

    async def start(self, app: web.Application, listen: str, flag: str = "") -> int:
        """Serve ``app`` on ``listen``; the port bound (``:0`` picks a free one). A taken
        port raises an OSError naming ``flag`` (``--admin-listen``)."""
        host, port = parse_listen(listen)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            where = f"{listen} ({flag})" if flag else listen
            raise OSError(exc.errno, f"cannot listen on {where}: {exc.strerror or exc}") from None
        except BaseException:
            await runner.cleanup()
            raise
        self._runners.append(runner)
        return int(runner.addresses[0][1] if runner.addresses else port)

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()
        self._runners.clear()
