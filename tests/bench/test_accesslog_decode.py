"""bench/accesslog_decode.py: both codecs read back every lease entry and only those; the
receiving-side run produces its figures. No timing assertions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("msgpack")

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
