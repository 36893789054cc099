"""The ``extauthz`` command: subcommands listed, check-policies exit codes and messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from extauthz.commands.cli import main

from ..conftest import FIXTURES, ROOT


def test_help_lists_the_subcommands() -> None:
    out = subprocess.run([sys.executable, "-m", "extauthz", "--help"], capture_output=True, text=True, check=True)
    for command in ("serve", "check-policies", "schema", "switch", "report", "override", "history", "demo",
                    "simulate"):
        assert command in out.stdout


def test_output_into_a_closed_pipe_ends_without_a_traceback() -> None:
    # `extauthz schema | head -1`: the reader has gone; the pipe's read end is closed
    # before the command writes, so every run hits the broken pipe.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        out = subprocess.run([sys.executable, "-m", "extauthz", "schema"], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr, out.stderr


def test_every_subcommand_help_says_what_it_does() -> None:
    # `extauthz COMMAND --help` opens with a description, not a bare usage line.
    for command in ("serve", "check-policies", "schema", "envoy-allowed-headers", "demo",
                    "switch", "report", "status", "override", "history"):
        out = subprocess.run([sys.executable, "-m", "extauthz", command, "--help"],
                             capture_output=True, text=True, check=True).stdout
        blocks = out.split("\n\n")
        assert not blocks[1].startswith(("positional arguments", "options")), (command, out)


def test_check_policies_ok(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-policies", str(ROOT / "policies")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"ok: {ROOT / 'policies'} (version ")
    assert "user-rate (request_rate, enforce)" in out


def test_check_policies_reports_every_bad_path_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    bad = FIXTURES / "policies" / "bad" / "unknown_key.yaml"
    assert main(["check-policies", str(ROOT / "policies"), str(bad)]) == 1
    captured = capsys.readouterr()
    assert "ok: " in captured.out  # the good one is still checked and reported
    assert f"error: {bad}:6: limiters[0].burts: unknown field" in captured.err


def test_schema_prints_the_published_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads((ROOT / "docs" / "policy.schema.json").read_text())


def test_envoy_allowed_headers_lists_policy_and_edge_headers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["envoy-allowed-headers", str(ROOT / "policies")]) == 0
    out = capsys.readouterr().out
    listed = [line.split("exact: ")[1].rstrip("}") for line in out.splitlines() if "exact:" in line]
    assert listed[:2] == ["x-api-key", "x-test-mode"]  # the policy's (authorization: Envoy always sends it)
    assert "authorization" not in listed
    assert {"x-request-id", "x-forwarded-for", "x-extauthz-route-tier", "x-jwt-payload",
            "x-forwarded-client-cert"} <= set(listed)


def test_envoy_allowed_headers_for_the_grpc_protocol(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["envoy-allowed-headers", "--protocol", "grpc", str(ROOT / "policies")]) == 0
    out = capsys.readouterr().out
    assert "grpc_service" in out
    listed = [line.split("exact: ")[1].rstrip("}") for line in out.splitlines() if "exact:" in line]
    # the policy's headers, Authorization included (gRPC sends only what is listed), and the
    # request id the access log pairs leases with; nothing the HTTP edge alone reads
    assert listed == ["authorization", "x-api-key", "x-test-mode", "x-request-id"]


def test_envoy_allowed_headers_adds_the_headers_key_parts_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nidentity: [{header: x-api-key}]\nlimiters:\n"
                      "  - {name: per-org, type: quota, limit: 5, period: day,\n"
                      "     key: [{header: X-Org}, {header: x-team, strip_prefix: 't-'}, {method: true}]}\n")
    assert main(["envoy-allowed-headers", "--protocol", "grpc", str(policy)]) == 0
    out = capsys.readouterr().out
    listed = [line.split("exact: ")[1].rstrip("}") for line in out.splitlines() if "exact:" in line]
    assert listed == ["x-api-key", "x-org", "x-team", "x-request-id"]


def test_envoy_config_for_http_warns_of_key_parts_the_protocol_cannot_carry(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nidentity: [{header: x-api-key}]\nlimiters:\n"
                      "  - {name: per-route, type: request_rate, rate: 1, burst: 1,\n"
                      "     key: [{identity: true}, {route: true}]}\n")
    common = ["envoy-config", "--upstream", "127.0.0.1:8080", "--policies", str(policy)]
    assert main([*common, "--protocol", "http"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "warning: limiter 'per-route': key part route yields nothing on the HTTP protocol (no route "
        "metadata or context extensions there): use the gRPC protocol, or a header the route sets"]
    assert yaml.safe_load(captured.out)["static_resources"]  # the config is still written
    assert main([*common, "--protocol", "grpc"]) == 0
    assert capsys.readouterr().err == ""  # gRPC carries the route's metadata


def test_envoy_allowed_headers_bad_policy_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    bad = FIXTURES / "policies" / "bad" / "unknown_key.yaml"
    assert main(["envoy-allowed-headers", str(bad)]) == 1
    assert "unknown field" in capsys.readouterr().err


def test_serve_and_demo_take_the_http_options() -> None:
    from extauthz.commands.cli import build_parser

    args = build_parser().parse_args(["serve", "--listen", "off", "--http-listen", "127.0.0.1:9003"])
    assert (args.listen, args.http_listen) == ("off", "127.0.0.1:9003")
    assert build_parser().parse_args(["demo", "--protocol", "http"]).protocol == "http"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo", "--protocol", "smtp"])


def test_http_listen_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from extauthz.commands.cli import build_parser

    monkeypatch.setenv("EXTAUTHZ_HTTP_LISTEN", "0.0.0.0:9003")
    monkeypatch.setenv("EXTAUTHZ_LISTEN", "off")
    args = build_parser().parse_args(["serve"])
    assert (args.http_listen, args.listen) == ("0.0.0.0:9003", "off")


def test_the_bound_options_from_flags_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from extauthz.commands.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.http_max_connections is None  # derived from the file limit at start
    assert args.policy_max_bytes == 1 << 20
    monkeypatch.setenv("EXTAUTHZ_HTTP_MAX_CONNECTIONS", "500")
    monkeypatch.setenv("EXTAUTHZ_POLICY_MAX_BYTES", "64K")
    args = build_parser().parse_args(["serve"])
    assert (args.http_max_connections, args.policy_max_bytes) == (500, 64 << 10)
    args = build_parser().parse_args(["serve", "--http-max-connections", "9", "--policy-max-bytes", "2M"])
    assert (args.http_max_connections, args.policy_max_bytes) == (9, 2 << 20)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--http-max-connections", "0"])


def test_fluentd_listen_is_off_unless_given(monkeypatch: pytest.MonkeyPatch) -> None:
    from extauthz.commands.cli import build_parser

    assert build_parser().parse_args(["serve"]).fluentd_listen is None
    monkeypatch.setenv("EXTAUTHZ_FLUENTD_LISTEN", "127.0.0.1:9004")
    assert build_parser().parse_args(["serve"]).fluentd_listen == "127.0.0.1:9004"
    assert build_parser().parse_args(["serve", "--fluentd-listen", "127.0.0.1:0"]).fluentd_listen == "127.0.0.1:0"
