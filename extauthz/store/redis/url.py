"""Redis URLs -> a redis-py client (single, Cluster or Sentinel), see ``docs/redis.md``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import parse_url
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

__all__ = ["Client", "Connection", "connect"]

Client = Redis | RedisCluster


@dataclass(frozen=True, slots=True)
class Connection:
    """What :func:`connect` built for a URL (no connection is opened yet)."""

    client: Client
    #: ``redis``, ``redis-cluster`` or ``redis-sentinel``
    name: str
    batching: bool
    sentinel: Sentinel | None = None


def connect(url: str, *, deadline: float, batching: bool | None, **kw: Any) -> Connection:
    """A client for ``url``::

        redis://[[user]:password@]host:port[/db][?ssl_...=...]        rediss:// = TLS
        redis+cluster://[[user]:password@]host:port[,host:port...]    rediss+cluster://
        redis+sentinel://[[user]:password@]host:port[,host:port...]/service[/db]

    Socket timeouts are a modest multiple of ``deadline`` (the engine's ``asyncio.timeout``
    is the real deadline; the socket timeout only bounds how long an abandoned call may hold
    a connection). Retries are off: a dead Redis fails fast. ``batching`` None: the URL
    query option ``batching=`` (ours, removed before redis-py sees the URL), default on.
    ``kw`` goes to the redis-py client.
    """
    timeout = max(0.25, 50 * deadline)
    url, from_query = _pop_query_option(url, "batching")
    if batching is None:
        batching = from_query is None or from_query.lower() not in ("0", "false", "no", "off")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a Redis URL: {url!r}")
    base, _, topology = scheme.lower().partition("+")
    if (base, topology) != ("unix", "") and (
        base not in ("redis", "rediss") or topology not in ("", "cluster", "sentinel")
    ):
        raise ValueError(
            f"unsupported Redis URL scheme {scheme!r}: use redis://, rediss://, "
            "redis+cluster://, rediss+cluster://, redis+sentinel:// or rediss+sentinel://"
        )
    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
    }
    if not topology:
        return Connection(Redis.from_url(url, **{**options, **kw}), "redis", batching)

    parts = urlsplit(f"{base}://{rest}")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    nodes = [_host_port(item) for item in hostlist.split(",") if item]
    if not nodes:
        raise ValueError(f"no host in Redis URL {url!r}")
    # redis-py's own parser for credentials, TLS and query options (one host).
    auth = f"{userinfo}@" if userinfo else ""
    single = parse_url(f"{base}://{auth}{hostlist.split(',')[0]}/?{parts.query}")
    conn: dict[str, Any] = {
        k: v for k, v in single.items() if k not in ("host", "port", "db", "connection_class")
    }
    if base == "rediss":
        conn["ssl"] = True

    if topology == "cluster":
        opts = {**options, **conn, **kw}
        cluster = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes], **opts)
        return Connection(cluster, "redis-cluster", batching)

    path = [unquote(p) for p in parts.path.split("/") if p]
    if not path or len(path) > 2:
        raise ValueError(f"Sentinel URL {url!r}: expected .../service_name[/db]")
    service = path[0]
    db = int(path[1]) if len(path) > 1 else 0
    sentinel_kwargs: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
    }
    sentinel_password = conn.pop("sentinel_password", None)
    if sentinel_password:
        sentinel_kwargs["password"] = sentinel_password
    opts = {**options, **conn, **kw}
    sentinel = Sentinel(nodes, sentinel_kwargs=sentinel_kwargs, **opts)  # type: ignore[no-untyped-call]
    client = sentinel.master_for(service, db=db)
    return Connection(client, "redis-sentinel", batching, sentinel)


def _pop_query_option(url: str, name: str) -> tuple[str, str | None]:
    """``url`` without the query option ``name`` (ours, not redis-py's), and its value."""
    base, sep, query = url.partition("?")
    if not sep:
        return url, None
    value: str | None = None
    kept = []
    for item in query.split("&"):
        key, _, val = item.partition("=")
        if key == name:
            value = val
        elif item:
            kept.append(item)
    return (f"{base}?{'&'.join(kept)}" if kept else base), value


def _host_port(item: str) -> tuple[str, int]:
    host, sep, port = item.rpartition(":")
    if not sep or not port.isdigit():
        return item.strip("[]"), 6379
    return host.strip("[]"), int(port)
