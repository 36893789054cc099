"""A small keep-alive HTTP/1.1 client for the demo, e2e tests and drills.

urllib opens and closes a connection per request (``Connection: close``); this keeps one
connection per thread and target, and closes them all on :meth:`HttpClient.close`.
"""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self
from urllib.parse import urlsplit


@dataclass
class Result:
    status: int
    #: the ``tier`` the upstream echoed (the ``x-extauthz-tier`` header it received).
    tier: str | None = None
    #: the limiter named in a problem+json refusal.
    limiter: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: str = ""

    def json(self) -> object:
        return json.loads(self.body)


class HttpClient:
    def __init__(self, timeout: float = 10.0) -> None:
        self.timeout = timeout
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def _connection(self, base: str) -> http.client.HTTPConnection:
        conns: dict[str, http.client.HTTPConnection] = self._local.__dict__.setdefault("conns", {})
        conn = conns.get(base)
        if conn is None:
            parts = urlsplit(base)
            conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=self.timeout)
            conns[base] = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def send(self, url: str, method: str = "GET", headers: dict[str, str] | None = None) -> Result:
        parts = urlsplit(url)
        base = f"{parts.scheme}://{parts.netloc}"
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        body = b"{}" if method in ("POST", "PUT", "PATCH") else None
        for attempt in (1, 2):
            conn = self._connection(base)
            try:
                conn.request(method, target, body=body, headers=headers or {})
                resp = conn.getresponse()
                text = resp.read().decode()
                break
            except (ConnectionError, http.client.HTTPException):
                conn.close()
                self._local.conns.pop(base, None)
                if attempt == 2:
                    raise
        hdrs = {k.lower(): v for k, v in resp.getheaders()}
        ctype = hdrs.get("content-type", "")
        if resp.status == 200 and ctype.startswith("application/json"):
            return Result(200, tier=json.loads(text).get("tier"), headers=hdrs, body=text)
        limiter = json.loads(text).get("limiter") if ctype.startswith("application/problem+json") else None
        return Result(resp.status, limiter=limiter, headers=hdrs, body=text)

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
