"""The release path's decode cost: Envoy's gRPC access log vs its fluentd logger (issue 24 item 2).

    .venv/bin/python -m bench.accesslog_decode                    # wall clock, 5 interleaved rounds
    .venv/bin/python -m bench.accesslog_decode --instructions     # + instruction counts (callgrind)

What the server does with one finished request's log entry, before any store call, in each of
the two encodings Envoy can send it in:

  grpc     ``envoy.access_loggers.http_grpc``: a ``StreamAccessLogsMessage`` of ``--batch``
           full ``HTTPAccessLogEntry`` messages (protobuf, upb); per entry the fields
           ``StreamAccessLogs`` reads (intermediate flag, request id, the ext_authz dynamic
           metadata's lease id, leases and ticket, the unauthorized flag)
  fluentd  ``envoy.access_loggers.fluentd``: one Forward-mode msgpack frame
           ``[tag, [[time, record], ...]]`` of ``--batch`` records holding only what the
           ``record`` setting asks for (request id, ``%DYNAMIC_METADATA(envoy.filters.http.
           ext_authz)%`` as a map, ``%RESPONSE_FLAGS%``), fed to a ``msgpack.Unpacker`` as a
           socket's bytes would be; the same fields read per entry

The entries are built like a real one (addresses, timings, headers bytes, two lease keys of a
real check's length). The release itself (the store call) is in none of these figures.

``--transport`` adds the receiving side: a server process (uvloop, as ``extauthz serve``) takes
``--entries`` entries in frames of ``--batch``, either on a ``grpc.aio`` ``StreamAccessLogs``
stream (one long-lived stream, as Envoy keeps per worker) or on a plain TCP socket read by an
``asyncio.Protocol`` feeding a ``msgpack.Unpacker``, and decodes them as above; the figure is
the server process's CPU time (``/proc``) per entry, median of ``--rounds`` interleaved rounds.

Wall clock: per entry, the minimum over ``--rounds`` interleaved rounds (the machine is shared:
the minimum is the least disturbed). ``--instructions`` runs each codec under ``valgrind
--tool=callgrind`` twice (the same frames built, then decoded or not) and prints the difference
per entry: instruction counts do not move with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from extauthz.engine.answers import LEASE_ID_FIELD, LEASE_TICKET_FIELD, LEASES_FIELD
from extauthz.envoy.records import EXT_AUTHZ_NAMESPACE
from extauthz.proto import accesslog_data_pb2, accesslog_pb2

CODECS = ("grpc", "fluentd")
TAG = "extauthz.release"
#: the fluentd logger's ``record`` setting the frames model (Envoy sends the metadata
#: namespace as a nested map: tests/bench/test_accesslog_decode.py checks it through Envoy)
FLUENTD_RECORD = {"request_id": "%REQ(X-REQUEST-ID)%",
                  "ext_authz": f"%DYNAMIC_METADATA({EXT_AUTHZ_NAMESPACE})%",
                  "response_flags": "%RESPONSE_FLAGS%"}
#: two lease keys of the length a check writes (hashed identity, limiter, slot) and a lease id
LEASE_KEYS = ",".join(f"ea:{{u:{'ab12' * 8}}}:user-concurrency:{i}:leases" for i in range(2))
LEASE_ID = "0f3c9a7d2b6e4f8a9c1d3e5f7a9b1c3d"
TICKET = "v1." + "9f" * 32


def _entry(i: int) -> Any:
    e = accesslog_data_pb2.HTTPAccessLogEntry()
    c = e.common_properties
    c.sample_rate = 1.0
    c.downstream_remote_address.socket_address.address = "10.1.2.3"
    c.downstream_remote_address.socket_address.port_value = 40000 + i % 20000
    c.downstream_local_address.socket_address.address = "10.0.0.5"
    c.downstream_local_address.socket_address.port_value = 10000
    c.upstream_remote_address.socket_address.address = "10.0.9.9"
    c.upstream_remote_address.socket_address.port_value = 8080
    c.start_time.seconds, c.start_time.nanos = 1_790_000_000 + i, 123_456_000
    for name in ("time_to_last_rx_byte", "time_to_first_upstream_tx_byte", "time_to_last_upstream_tx_byte",
                 "time_to_first_upstream_rx_byte", "time_to_last_upstream_rx_byte",
                 "time_to_first_downstream_tx_byte", "time_to_last_downstream_tx_byte", "duration"):
        getattr(c, name).nanos = 150_000 + i
    c.upstream_cluster = "upstream"
    c.route_name = "default"
    c.upstream_request_attempt_count = 1
    c.downstream_wire_bytes_sent, c.downstream_wire_bytes_received = 180, 260
    md = c.metadata.filter_metadata[EXT_AUTHZ_NAMESPACE]
    md.fields[LEASE_ID_FIELD].string_value = f"{LEASE_ID[:-6]}{i:06d}"
    md.fields[LEASES_FIELD].string_value = LEASE_KEYS
    md.fields[LEASE_TICKET_FIELD].string_value = TICKET
    e.protocol_version = accesslog_data_pb2.HTTPAccessLogEntry.HTTP11
    r = e.request
    r.request_method = 1  # GET
    r.scheme, r.authority, r.path = "http", "api.example.com", f"/v1/items/{i}"
    r.user_agent = "wrk"
    r.request_id = f"5b0a7c1e-3f2d-4c8a-9e6b-{i:012d}"
    r.request_headers_bytes = 120
    e.response.response_code.value = 200
    e.response.response_headers_bytes, e.response.response_body_bytes = 90, 2
    e.response.response_code_details = "direct_response"
    return e


def grpc_message(batch: int, start: int = 0) -> bytes:
    msg = accesslog_pb2.StreamAccessLogsMessage()
    msg.http_logs.log_entry.extend(_entry(start + i) for i in range(batch))
    return bytes(msg.SerializeToString())


def fluentd_frame(batch: int, start: int = 0) -> bytes:
    import msgpack

    records = []
    for i in range(start, start + batch):
        records.append([1_790_000_000 + i, {
            "request_id": f"5b0a7c1e-3f2d-4c8a-9e6b-{i:012d}",
            "ext_authz": {LEASE_ID_FIELD: f"{LEASE_ID[:-6]}{i:06d}", LEASES_FIELD: LEASE_KEYS,
                          LEASE_TICKET_FIELD: TICKET},
            "response_flags": "-",
        }])
    return bytes(msgpack.packb([TAG, records]))


def decode_grpc(frames: list[bytes]) -> int:
    """Entries with a lease, read as ``StreamAccessLogs`` reads them."""
    found = 0
    parse = accesslog_pb2.StreamAccessLogsMessage.FromString
    for frame in frames:
        for entry in parse(frame).http_logs.log_entry:
            common = entry.common_properties
            if common.intermediate_log_entry:
                continue
            rid = entry.request.request_id
            fm = common.metadata.filter_metadata
            if EXT_AUTHZ_NAMESPACE in fm:
                fields = fm[EXT_AUTHZ_NAMESPACE].fields
                lid, keys, ticket = fields.get(LEASE_ID_FIELD), fields.get(LEASES_FIELD), fields.get(LEASE_TICKET_FIELD)
                if lid is not None and keys is not None and ticket is not None and rid \
                        and not common.response_flags.HasField("unauthorized_details"):
                    found += bool(lid.string_value and keys.string_value and ticket.string_value)
    return found


def decode_fluentd(frames: list[bytes]) -> int:
    """The same fields from Forward-mode frames, through a streaming unpacker."""
    import msgpack

    found = 0
    unpacker = msgpack.Unpacker(raw=False)
    for frame in frames:
        unpacker.feed(frame)
        for _tag, entries, *_options in unpacker:
            for _time, record in entries:
                md = record.get("ext_authz")
                rid = record.get("request_id")
                if md and rid and record.get("response_flags") != "UAEX":
                    lid, keys, ticket = md.get(LEASE_ID_FIELD), md.get(LEASES_FIELD), md.get(LEASE_TICKET_FIELD)
                    found += bool(lid and keys and ticket)
    return found


DECODERS: dict[str, Callable[[list[bytes]], int]] = {"grpc": decode_grpc, "fluentd": decode_fluentd}
ENCODERS: dict[str, Callable[[int, int], bytes]] = {"grpc": grpc_message, "fluentd": fluentd_frame}


def frames(codec: str, entries: int, batch: int) -> list[bytes]:
    return [ENCODERS[codec](min(batch, entries - start), start) for start in range(0, entries, batch)]


def wall_clock(entries: int, batch: int, rounds: int) -> dict[str, dict[str, Any]]:
    data = {codec: frames(codec, entries, batch) for codec in CODECS}
    per_entry: dict[str, list[float]] = {codec: [] for codec in CODECS}
    for _ in range(rounds):
        for codec in CODECS:
            t0 = time.process_time()
            found = DECODERS[codec](data[codec])
            per_entry[codec].append((time.process_time() - t0) / entries * 1e6)
            if found != entries:
                raise SystemExit(f"{codec}: {found} of {entries} entries read back")
    return {codec: {"us_per_entry": min(v), "rounds_us": [round(x, 2) for x in v],
                    "bytes_per_entry": sum(len(f) for f in data[codec]) / entries} for codec, v in per_entry.items()}


def _callgrind_ir(codec: str, entries: int, batch: int, decode: bool) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg.out"
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-m",
             "bench.accesslog_decode", "--decode-only", codec, "--entries", str(entries), "--batch", str(batch),
             *([] if decode else ["--no-decode"])],
            capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=900)
        match = re.search(r"Collected : (\d+)", proc.stderr) or re.search(r"refs:\s+([\d,]+)", proc.stderr)
        if proc.returncode != 0 or match is None:
            raise SystemExit(f"callgrind failed:\n{proc.stderr[-2000:]}")
        return int(match.group(1).replace(",", ""))


def instructions(entries: int, batch: int) -> dict[str, float]:
    """Instructions per entry: callgrind's total with the frames decoded minus without
    (start-up, imports and building the frames are in both)."""
    out = {}
    for codec in CODECS:
        decoded = _callgrind_ir(codec, entries, batch, decode=True)
        built = _callgrind_ir(codec, entries, batch, decode=False)
        out[codec] = (decoded - built) / entries
    return out


# -- the receiving side (--transport): a server process per codec, CPU per entry from /proc


def _serve(codec: str, port_file: Path) -> None:
    """Receive frames on a free port until the client is done (run in a child process)."""
    import asyncio
    import socket

    import uvloop

    async def grpc_server() -> None:
        import grpc

        from extauthz.proto import accesslog_pb2_grpc

        done = asyncio.Event()

        class Servicer(accesslog_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
            async def StreamAccessLogs(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
                found = 0
                async for message in request_iterator:
                    found += _read_grpc_message(message)
                port_file.with_suffix(".count").write_text(str(found))
                return accesslog_pb2.StreamAccessLogsResponse()

        server = grpc.aio.server()
        accesslog_pb2_grpc.add_AccessLogServiceServicer_to_server(Servicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_file.write_text(str(port))  # noqa: ASYNC240 - a bench child, before any load
        await done.wait()

    async def tcp_server() -> None:
        import msgpack

        loop = asyncio.get_running_loop()

        class Receiver(asyncio.Protocol):
            def connection_made(self, transport: Any) -> None:
                self.transport = transport
                self.unpacker = msgpack.Unpacker(raw=False)
                self.found = 0

            def data_received(self, data: bytes) -> None:
                self.unpacker.feed(data)
                for _tag, entries, *_options in self.unpacker:
                    self.found += _read_fluentd_entries(entries)

            def eof_received(self) -> bool:
                self.transport.write(f"{self.found}\n".encode())
                self.transport.close()
                return True

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = await loop.create_server(Receiver, sock=sock)
        port_file.write_text(str(sock.getsockname()[1]))  # noqa: ASYNC240 - before any load
        await server.serve_forever()

    uvloop.run(grpc_server() if codec == "grpc" else tcp_server())


def _read_grpc_message(message: Any) -> int:
    found = 0
    for entry in message.http_logs.log_entry:
        common = entry.common_properties
        if common.intermediate_log_entry:
            continue
        fm = common.metadata.filter_metadata
        if EXT_AUTHZ_NAMESPACE in fm and entry.request.request_id \
                and not common.response_flags.HasField("unauthorized_details"):
            fields = fm[EXT_AUTHZ_NAMESPACE].fields
            found += LEASE_ID_FIELD in fields and LEASES_FIELD in fields and LEASE_TICKET_FIELD in fields
    return found


def _read_fluentd_entries(entries: list[Any]) -> int:
    found = 0
    for _time, record in entries:
        md = record.get("ext_authz")
        if md and record.get("request_id") and record.get("response_flags") != "UAEX":
            found += bool(md.get(LEASE_ID_FIELD) and md.get(LEASES_FIELD) and md.get(LEASE_TICKET_FIELD))
    return found


def _proc_cpu(pid: int) -> float:
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _send(codec: str, port: int, data: list[bytes], count_file: Path) -> int:
    if codec == "grpc":
        import grpc

        from extauthz.proto import accesslog_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = accesslog_pb2_grpc.AccessLogServiceStub(channel)
            messages = [accesslog_pb2.StreamAccessLogsMessage.FromString(f) for f in data]
            stub.StreamAccessLogs(iter(messages), timeout=300)
        return int(count_file.read_text())
    import socket

    with socket.create_connection(("127.0.0.1", port)) as sock:
        for frame in data:
            sock.sendall(frame)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while not reply.endswith(b"\n"):
            chunk = sock.recv(64)
            if not chunk:
                break
            reply += chunk
    return int(reply or b"0")


def transport(entries: int, batch: int, rounds: int) -> dict[str, dict[str, Any]]:
    """Server CPU per entry received and decoded, per codec (median over rounds)."""
    import statistics

    data = {codec: frames(codec, entries, batch) for codec in CODECS}
    per_entry: dict[str, list[float]] = {codec: [] for codec in CODECS}
    root = Path(__file__).resolve().parents[1]
    for _ in range(rounds):
        for codec in CODECS:
            with tempfile.TemporaryDirectory() as tmp:
                port_file = Path(tmp) / "port"
                proc = subprocess.Popen([sys.executable, "-m", "bench.accesslog_decode", "--serve", codec,
                                         "--port-file", str(port_file)], cwd=root)
                try:
                    deadline = time.monotonic() + 60
                    while not port_file.exists() or not port_file.read_text():
                        if proc.poll() is not None or time.monotonic() > deadline:
                            raise SystemExit(f"the {codec} receiver did not start")
                        time.sleep(0.05)
                    port = int(port_file.read_text())
                    if codec == "grpc":  # connect and warm the stream machinery first
                        _send(codec, port, data[codec][:2], port_file.with_suffix(".count"))
                    time.sleep(0.2)
                    before = _proc_cpu(proc.pid)
                    found = _send(codec, port, data[codec], port_file.with_suffix(".count"))
                    used = _proc_cpu(proc.pid) - before
                finally:
                    proc.terminate()
                    proc.wait(timeout=30)
            if found != entries:
                raise SystemExit(f"{codec} receiver: {found} of {entries} entries read")
            per_entry[codec].append(used / entries * 1e6)
    return {codec: {"server_cpu_us_per_entry": statistics.median(v), "rounds_us": [round(x, 2) for x in v]}
            for codec, v in per_entry.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.accesslog_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", type=int, default=20_000)
    p.add_argument("--batch", type=int, default=16, help="entries per gRPC message / fluentd frame")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--instructions", action="store_true", help="also count instructions (valgrind)")
    p.add_argument("--instruction-entries", type=int, default=4_000)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--transport", action="store_true", help="also the receiving side's server CPU per entry")
    p.add_argument("--transport-entries", type=int, default=100_000)
    p.add_argument("--decode-only", choices=CODECS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--no-decode", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--serve", choices=CODECS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port-file", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve:
        _serve(a.serve, a.port_file)
        return 0
    if a.decode_only:  # the measured child of --instructions: build the frames, decode them once
        data = frames(a.decode_only, a.entries, a.batch)
        if not a.no_decode:
            DECODERS[a.decode_only](data)
        return 0
    result: dict[str, Any] = {"entries": a.entries, "batch": a.batch,
                              "wall_clock": wall_clock(a.entries, a.batch, a.rounds)}
    for codec, fig in result["wall_clock"].items():
        print(f"{codec:8} {fig['us_per_entry']:6.2f} us/entry (min of {a.rounds} rounds {fig['rounds_us']}), "
              f"{fig['bytes_per_entry']:.0f} bytes/entry, batches of {a.batch}")
    if a.instructions:
        if shutil.which("valgrind") is None:
            raise SystemExit("--instructions needs valgrind")
        result["instructions"] = instructions(a.instruction_entries, a.batch)
        for codec, n in result["instructions"].items():
            print(f"{codec:8} {n:8,.0f} instructions/entry (callgrind, {a.instruction_entries:,} entries)")
    if a.transport:
        result["transport"] = transport(a.transport_entries, a.batch, a.rounds)
        for codec, fig in result["transport"].items():
            print(f"{codec:8} {fig['server_cpu_us_per_entry']:6.2f} us server CPU/entry received "
                  f"(median of {a.rounds} rounds {fig['rounds_us']}, {a.transport_entries:,} entries)")
    g, f = result["wall_clock"]["grpc"]["us_per_entry"], result["wall_clock"]["fluentd"]["us_per_entry"]
    print(f"fluentd / grpc decode: {f / g:.2f} (wall clock)" + (
        f", {result['instructions']['fluentd'] / result['instructions']['grpc']:.2f} (instructions)"
        if a.instructions else ""))
    if a.json is not None:
        a.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
