"""Pytest plugin: real Redis topologies, started once per session, flushed per test.

Enable with ``pytest_plugins = ["tests.infra.fixtures"]`` in ``tests/conftest.py`` (or
``-p tests.infra.fixtures``).

Session fixtures (one server set each, started on first use): ``redis_single``,
``redis_cluster``, ``redis_sentinel``. Function fixtures ``redis_single_clean``,
``redis_cluster_clean``, ``redis_sentinel_clean`` return the same handle after undoing what an
earlier test may have left (paused or killed processes) and FLUSHALL.

Nothing here skips: without redis-server the fixtures error with an install hint.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from testinfra.redis_servers import (
    RedisCluster,
    RedisSentinel,
    RedisSingle,
    start_cluster,
    start_sentinel,
    start_single,
)


@pytest.fixture(scope="session")
def redis_single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSingle]:
    handle = start_single(tmp_path_factory.mktemp("redis-single"))
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    handle = start_cluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSentinel]:
    handle = start_sentinel(tmp_path_factory.mktemp("redis-sentinel"))
    try:
        yield handle
    finally:
        handle.stop()


@pytest.fixture
def redis_single_clean(redis_single: RedisSingle) -> RedisSingle:
    redis_single.ensure_up()
    redis_single.flushall()
    return redis_single


@pytest.fixture
def redis_cluster_clean(redis_cluster: RedisCluster) -> RedisCluster:
    redis_cluster.ensure_up()
    redis_cluster.flushall()
    return redis_cluster


@pytest.fixture
def redis_sentinel_clean(redis_sentinel: RedisSentinel) -> RedisSentinel:
    redis_sentinel.ensure_up()
    redis_sentinel.flushall()
    return redis_sentinel
