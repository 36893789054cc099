"""The gRPC front door's own floor: what serving a no-op ``Check`` costs per call, for
grpc.aio and its knobs and for other ways to speak Envoy's gRPC protocol from Python.

Every candidate parses the CheckRequest (the project's ``auth_pb2``) and answers one
constant OK CheckResponse: what is left is the front door itself. The load is ``h2load``
(another process, C) sending a fixed number of raw gRPC frames of a realistic CheckRequest
(12 headers, route metadata) over one HTTP/2 connection, ``--streams`` at a time (Envoy keeps
one connection per worker and multiplexes its checks on it).

Two figures per candidate, both per check and over the measured checks only (a warm-up
first, not counted):

* instructions: the server under ``valgrind --tool=callgrind``, counters zeroed after the
  warm-up (``callgrind_control -z``) and dumped after the measured checks (``-d``): every
  thread of the process, wall-clock free (the machine is shared; ``perf stat`` is not
  available on these VMs);
* CPU microseconds: the server without valgrind, user + system time from ``/proc`` before
  and after the measured checks.

Candidates (``--candidates``, default all):

  aio           grpc.aio, asyncio's default loop
  aio-uvloop    grpc.aio on uvloop: what ``extauthz serve`` runs today
  aio-knobs     aio-uvloop with compression off, ``so_reuseport`` off, 64 KiB message
                bounds, BDP probing off, 1,000 concurrent streams
  aio-poll      aio-uvloop with ``GRPC_POLL_STRATEGY=poll`` (the core's poller)
  aio-no-ee     aio-uvloop with the core's EventEngine experiments off (``GRPC_EXPERIMENTS``)
  aio-exp       aio-uvloop with TCP experiments on (frame size tuning, rcvlowat, pollset
                alternative)
  aio-bytes     aio-uvloop without protobuf (bytes in, the answer's bytes out): the
                protobuf share
  sync          grpc.server on a thread pool (16 threads)
  grpclib       grpclib (pure Python on h2) on uvloop
  h2            a hand-rolled asyncio protocol on the ``h2`` library (uvloop)
  h2-lean       HTTP/2 framing by hand (``hpack`` for the request headers, the answer's
                header blocks precomputed), one write per read: how low Python can go
  h2-server     the server ``serve --grpc-server asyncio`` runs (server/grpc_h2.py on
                server/h2conn.py, with every bound), uvloop

    python -m bench.grpc_floor [--checks 2000] [--streams 8] [--candidates aio-uvloop,h2]
                               [--no-callgrind] [--no-cpu]
    python -m bench.grpc_floor --profile aio-uvloop [--seconds 10]

``--profile`` records one candidate under load with ``py-spy record --native --threads`` and
prints where its samples are: per thread, waiting in epoll (idle) or not, and the innermost
frames (system calls show as their libc function).

Needs h2load (Debian's nghttp2-client), valgrind, and for the last two ``pip install
grpclib h2`` (the bench extra). Prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from extauthz.devtools.stack import free_port

CHECK_PATH = "/envoy.service.auth.v3.Authorization/Check"
CANDIDATES = ("aio", "aio-uvloop", "aio-knobs", "aio-poll", "aio-no-ee", "aio-exp", "aio-bytes", "sync",
              "grpclib", "h2", "h2-lean", "h2-server")
#: gRPC core settings by environment (the core reads them at start)
ENV = {
    "aio-poll": {"GRPC_POLL_STRATEGY": "poll"},
    # the core's EventEngine off for the listener, the endpoints and the completion queue
    "aio-no-ee": {"GRPC_EXPERIMENTS": "-event_engine_listener,-event_engine_for_all_other_endpoints,"
                                      "-event_engine_callback_cq"},
    # off-by-default experiments on the TCP path
    "aio-exp": {"GRPC_EXPERIMENTS": "tcp_frame_size_tuning,tcp_rcv_lowat,pollset_alternative"},
}
NEEDS = {"grpclib": "grpclib", "h2": "h2", "h2-lean": "hpack", "h2-server": "hpack"}


# ---- the request and the answer ----------------------------------------------------------


def check_request() -> bytes:
    """A realistic CheckRequest as Envoy sends it (serialized)."""
    from extauthz.proto import auth_pb2

    req = auth_pb2.CheckRequest()
    attrs = req.attributes
    attrs.source.address.socket_address.address = "10.1.2.3"
    attrs.source.address.socket_address.port_value = 54321
    attrs.destination.address.socket_address.address = "10.0.0.1"
    attrs.destination.address.socket_address.port_value = 8080
    http = attrs.request.http
    http.id = "14375627239837216810"
    http.method = "POST"
    http.path = "/v1/charges?expand=customer"
    http.host = "api.example.com"
    http.scheme = "http"
    http.protocol = "HTTP/1.1"
    http.headers.update({
        ":authority": "api.example.com", ":method": "POST", ":path": "/v1/charges?expand=customer",
        ":scheme": "http", "x-api-key": "sk_live_0123456789abcdef", "user-agent": "wrk/4.2",
        "accept": "application/json", "content-type": "application/x-www-form-urlencoded",
        "x-request-id": "8b0e9c42-4f1d-4d2e-9a1c-0c7f3d2b1a90", "x-forwarded-proto": "http",
        "x-forwarded-for": "10.1.2.3", "x-envoy-expected-rq-timeout-ms": "15000",
    })
    attrs.route_metadata_context.filter_metadata["extauthz"].update({"tier": "critical"})
    return req.SerializeToString()


def ok_response() -> Any:
    from extauthz.proto import auth_pb2

    resp = auth_pb2.CheckResponse()
    resp.status.code = 0
    header = resp.ok_response.headers.add()
    header.header.key = "x-extauthz-tier"
    header.header.value = "critical"
    return resp


def grpc_frame(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


# ---- the candidates (each runs in its own process: --serve NAME PORT) -------------------


def _grpc_handler(raw: bool) -> Any:
    import grpc

    from extauthz.proto import auth_pb2

    if raw:
        answer = ok_response().SerializeToString()

        def check_raw(request: bytes, context: Any) -> bytes:
            return answer
        sync_handler: Any = check_raw
    else:
        answer_msg = ok_response()

        def check(request: Any, context: Any) -> Any:
            return answer_msg
        sync_handler = check
    return grpc.method_handlers_generic_handler("envoy.service.auth.v3.Authorization", {
        "Check": grpc.unary_unary_rpc_method_handler(
            sync_handler,
            request_deserializer=None if raw else auth_pb2.CheckRequest.FromString,
            response_serializer=None if raw else auth_pb2.CheckResponse.SerializeToString)})


def _aio_handler(raw: bool) -> Any:
    import grpc

    from extauthz.proto import auth_pb2

    answer: Any = ok_response().SerializeToString() if raw else ok_response()

    async def check(request: Any, context: Any) -> Any:
        return answer
    return grpc.method_handlers_generic_handler("envoy.service.auth.v3.Authorization", {
        "Check": grpc.unary_unary_rpc_method_handler(
            check,
            request_deserializer=None if raw else auth_pb2.CheckRequest.FromString,
            response_serializer=None if raw else auth_pb2.CheckResponse.SerializeToString)})


async def _serve_aio(port: int, name: str) -> None:
    import grpc

    options: list[tuple[str, Any]] = [("grpc.so_reuseport", 0)]
    kw: dict[str, Any] = {}
    if name == "aio-knobs":
        options += [("grpc.max_receive_message_length", 65536), ("grpc.max_send_message_length", 65536),
                    ("grpc.http2.bdp_probe", 0), ("grpc.max_concurrent_streams", 1000)]
        kw["compression"] = grpc.Compression.NoCompression
    server = grpc.aio.server(options=options, **kw)
    server.add_generic_rpc_handlers((_aio_handler(name == "aio-bytes"),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def _serve_sync(port: int) -> None:
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    server = grpc.server(ThreadPoolExecutor(max_workers=16), options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((_grpc_handler(False),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


async def _serve_grpclib(port: int) -> None:
    from grpclib.const import Cardinality, Handler
    from grpclib.server import Server

    from extauthz.proto import auth_pb2

    answer = ok_response()

    class Authorization:
        async def check(self, stream: Any) -> None:
            await stream.recv_message()
            await stream.send_message(answer)

        def __mapping__(self) -> dict[str, Handler]:
            return {CHECK_PATH: Handler(self.check, Cardinality.UNARY_UNARY,
                                        auth_pb2.CheckRequest, auth_pb2.CheckResponse)}

    server = Server([Authorization()])
    await server.start("127.0.0.1", port)
    await server.wait_closed()


async def _serve_h2(port: int) -> None:
    """Envoy's gRPC unary call on the h2 state machine: headers, one length-prefixed message,
    trailers with grpc-status. Enough for a measurement, not a server (no deadlines, no
    message-size bound, no per-stream flow-control accounting beyond acknowledging data)."""
    from h2.config import H2Configuration
    from h2.connection import H2Connection
    from h2.events import ConnectionTerminated, DataReceived, RequestReceived, StreamEnded, StreamReset

    from extauthz.proto import auth_pb2

    parse = auth_pb2.CheckRequest.FromString
    answer = ok_response()
    head = [(b":status", b"200"), (b"content-type", b"application/grpc")]
    trailers = [(b"grpc-status", b"0")]
    config = H2Configuration(client_side=False, header_encoding=None)

    class Protocol(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            self.conn = H2Connection(config=config)
            self.conn.initiate_connection()
            self.bodies: dict[int, bytes] = {}
            transport.write(self.conn.data_to_send())

        def data_received(self, data: bytes) -> None:
            conn = self.conn
            for event in conn.receive_data(data):
                if isinstance(event, DataReceived):
                    sid = event.stream_id
                    self.bodies[sid] = self.bodies.get(sid, b"") + event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, sid)
                elif isinstance(event, StreamEnded):
                    sid = event.stream_id
                    body = self.bodies.pop(sid, b"")
                    parse(body[5:])
                    conn.send_headers(sid, head)
                    conn.send_data(sid, grpc_frame(answer.SerializeToString()))
                    conn.send_headers(sid, trailers, end_stream=True)
                elif isinstance(event, RequestReceived):
                    self.bodies[event.stream_id] = b""
                elif isinstance(event, StreamReset):
                    self.bodies.pop(event.stream_id, None)
                elif isinstance(event, ConnectionTerminated):
                    self.transport.close()
            out = conn.data_to_send()
            if out:
                self.transport.write(out)

    loop = asyncio.get_running_loop()
    server = await loop.create_server(Protocol, "127.0.0.1", port)
    await server.serve_forever()


async def _serve_h2_lean(port: int) -> None:
    """Just enough HTTP/2 for unary gRPC calls from one client: frames parsed by hand, the
    request header blocks decoded by ``hpack`` (its dynamic table must follow the client's),
    the answer's header blocks constant bytes (static-table references and literals without
    indexing, so they touch no table). A measurement, not a server: no stream state checks,
    no limits, no GOAWAY, no per-stream flow control beyond the connection window."""
    from hpack import Decoder

    from extauthz.proto import auth_pb2

    parse = auth_pb2.CheckRequest.FromString
    answer = grpc_frame(ok_response().SerializeToString())

    def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload

    def literal(name: bytes, value: bytes) -> bytes:  # without indexing, new name
        return b"\x00" + bytes((len(name),)) + name + bytes((len(value),)) + value

    head_block = b"\x88" + b"\x0f\x10" + bytes((16,)) + b"application/grpc"  # :status 200, content-type
    trailer_block = literal(b"grpc-status", b"0")
    window = 1 << 30
    preface = (frame(4, 0, 0, (7).to_bytes(2, "big") + window.to_bytes(4, "big"))  # SETTINGS
               + frame(8, 0, 0, (window - 65535).to_bytes(4, "big")))  # WINDOW_UPDATE, connection

    class Protocol(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            self.buf = b""
            self.started = False
            self.decoder = Decoder()
            self.bodies: dict[int, bytes] = {}
            self.received = 0
            transport.write(preface)

        def data_received(self, data: bytes) -> None:
            buf = self.buf + data
            pos = 0
            if not self.started:
                if len(buf) < 24:
                    self.buf = buf
                    return
                pos, self.started = 24, True
            out: list[bytes] = []
            bodies = self.bodies
            while len(buf) - pos >= 9:
                length = int.from_bytes(buf[pos:pos + 3], "big")
                if len(buf) - pos < 9 + length:
                    break
                kind, flags = buf[pos + 3], buf[pos + 4]
                stream = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                payload = buf[pos + 9:pos + 9 + length]
                pos += 9 + length
                if kind == 0:  # DATA
                    self.received += length
                    if flags & 0x8:  # padded
                        payload = payload[1:len(payload) - payload[0]]
                    bodies[stream] = bodies.get(stream, b"") + payload
                elif kind == 1:  # HEADERS (no CONTINUATION from this client)
                    if flags & 0x8:
                        payload = payload[1:len(payload) - payload[0]]
                    if flags & 0x20:
                        payload = payload[5:]
                    self.decoder.decode(payload, raw=True)
                    bodies[stream] = b""
                elif kind == 4 and not flags & 0x1:  # SETTINGS: acknowledged
                    out.append(frame(4, 1, 0, b""))
                elif kind == 6 and not flags & 0x1:  # PING
                    out.append(frame(6, 1, 0, payload))
                elif kind == 3:  # RST_STREAM
                    bodies.pop(stream, None)
                if kind in (0, 1) and flags & 0x1:  # END_STREAM: answer
                    body = bodies.pop(stream, b"")
                    parse(body[5:])
                    out.append(frame(1, 0x4, stream, head_block) + frame(0, 0, stream, answer)
                               + frame(1, 0x5, stream, trailer_block))
            self.buf = buf[pos:]
            if self.received > window // 2:
                out.append(frame(8, 0, 0, self.received.to_bytes(4, "big")))
                self.received = 0
            if out:
                self.transport.write(b"".join(out))

    loop = asyncio.get_running_loop()
    server = await loop.create_server(Protocol, "127.0.0.1", port)
    await server.serve_forever()


async def _serve_h2_server(port: int) -> None:
    """The asyncio gRPC server of ``serve --grpc-server asyncio`` with the same handler."""
    import grpc

    from extauthz.proto import auth_pb2
    from extauthz.server.grpc_h2 import GrpcH2Server

    answer = ok_response()

    async def check(request: Any, context: Any) -> Any:
        return answer

    server = GrpcH2Server()
    server.add_registered_method_handlers("envoy.service.auth.v3.Authorization", {
        "Check": grpc.unary_unary_rpc_method_handler(
            check, request_deserializer=auth_pb2.CheckRequest.FromString,
            response_serializer=auth_pb2.CheckResponse.SerializeToString)})
    await server.start(f"127.0.0.1:{port}")
    await asyncio.Event().wait()


def serve(name: str, port: int) -> None:
    if name == "sync":
        _serve_sync(port)
        return
    if name == "aio":
        asyncio.run(_serve_aio(port, name))
        return
    import uvloop

    if name == "grpclib":
        uvloop.run(_serve_grpclib(port))
    elif name == "h2":
        uvloop.run(_serve_h2(port))
    elif name == "h2-lean":
        uvloop.run(_serve_h2_lean(port))
    elif name == "h2-server":
        uvloop.run(_serve_h2_server(port))
    else:
        uvloop.run(_serve_aio(port, name))


# ---- the driver -------------------------------------------------------------------------


def cpu_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of the process (every thread), from /proc (its rusage)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


#: more request headers h2load sends (``--grpc-timeout``: the ``grpc-timeout`` Envoy sends)
EXTRA_HEADERS: list[str] = []


def h2load(port: int, body: Path, checks: int, streams: int) -> None:
    cmd = ["h2load", "-n", str(checks), "-c", "1", "-m", str(streams), "-d", str(body),
           "-H", "content-type: application/grpc", "-H", "te: trailers",
           *(a for h in EXTRA_HEADERS for a in ("-H", h)),
           f"http://127.0.0.1:{port}{CHECK_PATH}"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True).stdout
    m = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded", out)
    if m is None or int(m.group(2)) != checks:
        raise RuntimeError(f"h2load: not every check succeeded:\n{out}")


def wait_serving(port: int, body: Path, within: float) -> None:
    deadline = time.monotonic() + within
    while True:
        try:
            h2load(port, body, 1, 1)
            return
        except (subprocess.CalledProcessError, RuntimeError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def start(name: str, port: int, prefix: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(ENV.get(name, {}))
    cmd = [*prefix, sys.executable, "-m", "bench.grpc_floor", "--serve", name, str(port)]
    with log.open("wb") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                cwd=Path(__file__).resolve().parent.parent)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cpu_per_check(proc: subprocess.Popen[bytes], load: Callable[[int], None], checks: int,
                  warmup: int) -> tuple[float, float]:
    """Server CPU microseconds per check over ``checks`` (after ``warmup`` not counted),
    user and system."""
    load(warmup)
    user, system = cpu_seconds(proc.pid)
    load(checks)
    user2, system2 = cpu_seconds(proc.pid)
    return (user2 - user) / checks * 1e6, (system2 - system) / checks * 1e6


CALLGRIND = ["valgrind", "--tool=callgrind", "--dump-instr=no", "--compress-strings=no"]


def instructions_per_check(proc: subprocess.Popen[bytes], out: Path, load: Callable[[int], None],
                           checks: int, warmup: int) -> float:
    """User-space instructions per check of a server started under :data:`CALLGRIND` with
    ``--callgrind-out-file=out``: zeroed after the warm-up, dumped after ``checks``; stops it."""
    try:
        load(warmup)
        subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
        load(checks)
        subprocess.run(["callgrind_control", "-d", "measured", str(proc.pid)], check=True,
                       capture_output=True)
    finally:
        stop(proc)
    dumps = sorted(out.parent.glob(f"{out.name}.*"))
    measured = [d for d in dumps if "measured" in d.read_text(errors="replace")[:4000]]
    if not measured:
        raise RuntimeError(f"no callgrind dump: {[d.name for d in dumps]}")
    return callgrind_total(measured[-1]) / checks


def measure_cpu(name: str, body: Path, checks: int, streams: int, warmup: int,
                tmp: Path) -> tuple[float, float]:
    """Server CPU microseconds per check, user and system (no valgrind)."""
    port = free_port()
    proc = start(name, port, [], tmp / f"{name}.cpu.log")
    try:
        wait_serving(port, body, 30)
        return cpu_per_check(proc, lambda n: h2load(port, body, n, streams), checks, warmup)
    finally:
        stop(proc)


def callgrind_total(out_file: Path) -> int:
    for line in out_file.read_text().splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {out_file}")


def measure_instructions(name: str, body: Path, checks: int, streams: int, warmup: int,
                         tmp: Path) -> float:
    """Server instructions per check: callgrind, zeroed after the warm-up, dumped after."""
    port = free_port()
    out = tmp / f"callgrind.{name}.out"
    proc = start(name, port, [*CALLGRIND, f"--callgrind-out-file={out}"], tmp / f"{name}.callgrind.log")
    try:
        wait_serving(port, body, 300)
    except BaseException:
        stop(proc)
        raise
    return instructions_per_check(proc, out, lambda n: h2load(port, body, n, streams), checks, warmup)


def profile(name: str, seconds: float, streams: int, tmp: Path) -> None:
    import collections

    from .profile import _py_spy

    port = free_port()
    body = tmp / "check.bin"
    proc = start(name, port, [], tmp / f"{name}.profile.log")
    raw = tmp / "profile.raw"
    try:
        wait_serving(port, body, 30)
        load = subprocess.Popen(["h2load", "-D", str(round(seconds) + 4), "-c", "1", "-m", str(streams),
                                 "-d", str(body), "-H", "content-type: application/grpc", "-H", "te: trailers",
                                 *(a for h in EXTRA_HEADERS for a in ("-H", h)),
                                 f"http://127.0.0.1:{port}{CHECK_PATH}"], stdout=subprocess.PIPE, text=True)
        time.sleep(1.0)
        subprocess.run([_py_spy(), "record", "--pid", str(proc.pid), "--native", "--threads", "--rate", "200",
                        "--duration", str(round(seconds)), "--format", "raw", "--output", str(raw)],
                       capture_output=True, check=True)
        out, _ = load.communicate()
    finally:
        stop(proc)
    m = re.search(r"finished in [^,]+, ([\d.]+) req/s", out)
    leaves: collections.Counter[tuple[str, str]] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        thread = "main" if "MainThread" in frames[0] else frames[0].split(":", 1)[-1].strip()[:30]
        leaf = frames[-1].split(" (")[0]
        if leaf.startswith("0x") and len(frames) > 2:  # an unnamed native frame: name its caller
            leaf = frames[-2].split(" (")[0]
        leaves[(thread, leaf)] += int(count)
        total += int(count)
    idle = sum(n for (_, leaf), n in leaves.items() if leaf.startswith("epoll"))
    busy = max(1, total - idle)
    print(f"{name}: {m.group(1) if m else '?'} checks/s during the recording, {total} samples, "
          f"{100 * idle / max(1, total):.0f} % of them waiting in epoll\n")
    print("| thread | innermost frame | share of samples not waiting in epoll |")
    print("|---|---|---:|")
    for (thread, leaf), n in leaves.most_common(16):
        if not leaf.startswith("epoll"):
            print(f"| {thread} | {leaf} | {100 * n / busy:.1f} % |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", nargs=2, metavar=("NAME", "PORT"), help=argparse.SUPPRESS)
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--checks", type=int, default=2000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--streams", type=int, default=8, help="checks in flight on the connection")
    ap.add_argument("--no-callgrind", action="store_true")
    ap.add_argument("--no-cpu", action="store_true")
    ap.add_argument("--profile", metavar="CANDIDATE", help="py-spy profile of one candidate under load")
    ap.add_argument("--seconds", type=float, default=10.0, help="--profile: seconds recorded")
    ap.add_argument("--grpc-timeout", type=int, metavar="MS",
                    help="send grpc-timeout (milliseconds) with each check, as Envoy's ext_authz does")
    args = ap.parse_args(argv)
    if args.grpc_timeout is not None:
        if args.grpc_timeout <= 0:
            raise SystemExit("--grpc-timeout: a positive number of milliseconds")
        EXTRA_HEADERS.append(f"grpc-timeout: {args.grpc_timeout}m")
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return 0
    if args.profile:
        with tempfile.TemporaryDirectory(prefix="grpc-floor-") as d:
            (Path(d) / "check.bin").write_bytes(grpc_frame(check_request()))
            profile(args.profile, args.seconds, args.streams, Path(d))
        return 0
    for tool in ("h2load", *(() if args.no_callgrind else ("valgrind", "callgrind_control"))):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found")
    names = [n for n in args.candidates.split(",") if n]
    unknown = set(names) - set(CANDIDATES)
    if unknown:
        raise SystemExit(f"unknown candidates {sorted(unknown)}; known: {', '.join(CANDIDATES)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="grpc-floor-") as d:
        tmp = Path(d)
        body = tmp / "check.bin"
        body.write_bytes(grpc_frame(check_request()))
        for name in names:
            if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
                print(f"{name}: skipped (pip install {NEEDS[name]})", file=sys.stderr)
                continue
            ins = None if args.no_callgrind else measure_instructions(
                name, body, args.checks, args.streams, args.warmup, tmp)
            cpu = None if args.no_cpu else measure_cpu(name, body, args.checks, args.streams,
                                                       args.warmup, tmp)
            rows.append((name, ins, cpu))
            print(f"{name}: {'-' if ins is None else f'{ins:,.0f}'} instructions/check, "
                  f"{'-' if cpu is None else f'{sum(cpu):.1f}'} us CPU/check", file=sys.stderr)
    base = next((r for r in rows if r[0] == "aio-uvloop"), None)
    print(f"\n{args.checks} checks, {args.streams} in flight on one HTTP/2 connection (h2load), "
          f"after {args.warmup} not counted\n")
    print("| candidate | user-space instructions per check | x aio-uvloop | server CPU us per check "
          "(user + system) | x aio-uvloop |")
    print("|---|---:|---:|---:|---:|")
    for name, ins, cpu in rows:
        ratio = "" if base is None or base[1] is None or ins is None else f"{base[1] / ins:.2f}"
        cpu_ratio = ("" if base is None or base[2] is None or cpu is None or not sum(cpu)
                     else f"{sum(base[2]) / sum(cpu):.2f}")
        print(f"| {name} | {'-' if ins is None else f'{ins:,.0f}'} | {ratio} | "
              f"{'-' if cpu is None else f'{sum(cpu):.0f} ({cpu[0]:.0f} + {cpu[1]:.0f})'} | {cpu_ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
