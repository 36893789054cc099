"""Server processes started together, each with a gRPC Check stub; stopped on exit."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc

from extauthz.devtools.stack import ServerProcess
from extauthz.proto import auth_pb2_grpc


@contextmanager
def replicas(policy: Path, n: int, *, args: Sequence[str], workdir: Path,
             env: dict[str, str] | None = None) -> Iterator[list[auth_pb2_grpc.AuthorizationStub]]:
    procs = [ServerProcess([policy], args=args, env=env, workdir=workdir) for _ in range(n)]
    try:
        with ThreadPoolExecutor(n) as pool:  # start them at once
            list(pool.map(lambda p: p.start(), procs))
        channels = [grpc.insecure_channel(f"127.0.0.1:{p.port}") for p in procs]
        try:
            yield [auth_pb2_grpc.AuthorizationStub(ch) for ch in channels]
        finally:
            for ch in channels:
                ch.close()
    finally:
        for p in procs:
            p.stop()
