"""The one runner of background jobs (kill-switch poll, policy reload, shadow flush, lease
sampling, utilization samplers): each job is a *tick* run every ``interval`` seconds.

A tick that raises is counted (``extauthz_background_errors_total{job}``), logged
(rate-limited, per job) and the job keeps running; a tick returns :data:`DONE` to end its
job (a sampler whose shedder a reload removed). :meth:`Runner.stop` cancels them all.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Final

from .throttle import LogThrottle

__all__ = ["DONE", "Runner"]

log = logging.getLogger("extauthz.runner")

#: what a tick returns to end its job
DONE: Final = object()

Tick = Callable[[], object | Awaitable[object]]


class Runner:
    def __init__(self) -> None:
        #: job name -> ticks that raised
        self.errors: dict[str, int] = {}
        self._jobs: dict[str, asyncio.Task[None]] = {}
        self._logs: dict[str, LogThrottle] = {}

    def every(self, name: str, interval: float | Callable[[], float], tick: Tick, *,
              first: bool = False) -> None:
        """Run ``tick`` every ``interval`` seconds (a number, or read before each sleep);
        ``first``: once at start too. A job of that name still running is kept."""
        job = self._jobs.get(name)
        if job is not None and not job.done():
            return
        wait = interval if callable(interval) else (lambda: interval)
        self.errors.setdefault(name, 0)
        task = asyncio.get_running_loop().create_task(self._loop(name, wait, tick, first),
                                                      name=f"extauthz-{name}")
        self._jobs[name] = task

    def running(self, name: str) -> bool:
        job = self._jobs.get(name)
        return job is not None and not job.done()

    @property
    def names(self) -> list[str]:
        return sorted(name for name in self._jobs if self.running(name))

    async def _loop(self, name: str, wait: Callable[[], float], tick: Tick, first: bool) -> None:
        if not first:
            await asyncio.sleep(wait())
        while True:
            try:
                result = tick()
                if inspect.isawaitable(result):
                    result = await result
            except Exception as exc:
                self._failed(name, exc)
            else:
                if result is DONE:
                    return
            await asyncio.sleep(wait())

    def _failed(self, name: str, exc: Exception) -> None:
        self.errors[name] = self.errors.get(name, 0) + 1
        throttle = self._logs.get(name)
        if throttle is None:
            throttle = self._logs[name] = LogThrottle(log, interval=60.0)
        throttle.log(logging.WARNING, "background job %s failed (it keeps running): %s: %s",
                     name, type(exc).__name__, exc, exc_info=exc,
                     fields={"event": "background_error", "job": name})

    async def stop(self) -> None:
        jobs = list(self._jobs.values())
        self._jobs.clear()
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
