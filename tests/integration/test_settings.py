"""The options of extauthz/core/settings.py through the installed console script (``extauthz``)."""

from __future__ import annotations

import sys
from pathlib import Path

import grpc
import pytest

from extauthz.devtools.stack import ServerProcess
from extauthz.proto import auth_pb2, auth_pb2_grpc

from ..conftest import ROOT

CONSOLE_SCRIPT = Path(sys.executable).parent / "extauthz"


@pytest.mark.parametrize("how", ["flag", "variable"])
def test_health_listen_off_turns_the_port_off_like_every_listen_option(tmp_path: Path, how: str) -> None:
    """``--health-listen off`` (or EXTAUTHZ_HEALTH_LISTEN=off) starts a server without the
    plaintext health port; it used to fail with "cannot listen on off"."""
    assert CONSOLE_SCRIPT.exists(), "the package's console script is installed beside the interpreter"
    proc = ServerProcess([ROOT / "policies"], workdir=tmp_path,
                         args=["--health-listen", "off"] if how == "flag" else [],
                         env={"EXTAUTHZ_HEALTH_LISTEN": "off"} if how == "variable" else {})
    proc.cmd[:3] = [str(CONSOLE_SCRIPT)]  # `extauthz serve ...`, not `python -m extauthz`
    with proc, grpc.insecure_channel(f"127.0.0.1:{proc.port}") as ch:
        check = auth_pb2.CheckRequest()
        check.attributes.request.http.method = "GET"
        check.attributes.request.http.path = "/v1/x"
        assert auth_pb2_grpc.AuthorizationStub(ch).Check(check, timeout=5).status.code == 0
    assert "cannot listen on off" not in proc.log()
