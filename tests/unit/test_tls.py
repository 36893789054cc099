"""TLS options: both or neither, a clear error otherwise; bad files fail the start; a rotation
is loaded only when it is a matching, readable set."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import pytest

from extauthz.server.tls import CertificateReloader, TlsConfigError, TlsFiles

from ..conftest import ROOT
from ..infra.certs import CA


@pytest.mark.parametrize(("cert", "key", "ca", "message"), [
    ("c.pem", None, None, "--tls-cert and --tls-key go together"),
    (None, "k.pem", None, "--tls-cert and --tls-key go together"),
    (None, None, "ca.pem", "--tls-client-ca needs --tls-cert and --tls-key"),
])
def test_half_given_options_are_refused(cert: str | None, key: str | None, ca: str | None, message: str) -> None:
    with pytest.raises(TlsConfigError, match=message):
        TlsFiles.from_options(cert, key, ca)


def test_no_options_is_plaintext() -> None:
    assert TlsFiles.from_options(None, None, None) is None
    assert TlsFiles.from_options("", "", "") is None


def test_serve_refuses_a_half_pair_with_a_clear_message(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "extauthz", "serve", "--policies", str(ROOT / "policies"),
                           "--listen", "127.0.0.1:0", "--admin-listen", "off", "--tls-cert", str(tmp_path / "c")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2
    assert "extauthz serve: --tls-cert and --tls-key go together" in proc.stderr


def test_bad_files_fail_the_start_and_bad_rotations_keep_the_last_good(tmp_path: Path) -> None:
    ca = CA()
    good, other = ca.issue("extauthz", dns=("extauthz",)), ca.issue("extauthz", dns=("extauthz",))
    cert, key = good.write(tmp_path, "tls")
    files = TlsFiles(cert, key, ca.write(tmp_path / "ca.crt"))
    with pytest.raises(TlsConfigError, match="cannot read"):
        CertificateReloader(TlsFiles(tmp_path / "missing.crt", key))
    key.write_bytes(other.key_pem)
    with pytest.raises(TlsConfigError, match="not a matching PEM certificate and key"):
        CertificateReloader(files)
    key.write_bytes(good.key_pem)
    reloader = CertificateReloader(files)
    assert reloader.mtls and reloader.fetch() is None  # nothing changed
    (tmp_path / "ca.crt").write_text("not a certificate")
    assert reloader.fetch() is None
    assert reloader.failures == 1 and "not a PEM CA certificate" in (reloader.last_error or "")
    assert reloader.fetch() is None and reloader.failures == 1  # counted once per change
    ca.write(tmp_path / "ca.crt")
    other.write(tmp_path, "tls")
    assert reloader.fetch() is not None  # a good set: a new configuration for new handshakes
    assert (reloader.reloads, reloader.last_error) == (1, None)
    assert reloader.status()["reload_failures"] == 1


def test_a_bad_rotation_undone_clears_the_error(tmp_path: Path) -> None:
    """A bad set written over the good one and then the good one put back: the error no
    longer describes the files, so /status must not keep reporting it."""
    ca = CA()
    good = ca.issue("extauthz", dns=("extauthz",))
    cert, key = good.write(tmp_path, "tls")
    reloader = CertificateReloader(TlsFiles(cert, key))
    cert.write_text("half-written")
    assert reloader.fetch() is None and reloader.failures == 1 and reloader.last_error
    good.write(tmp_path, "tls")
    assert reloader.fetch() is None  # the same certificate as served: nothing new to hand out
    assert (reloader.reloads, reloader.failures, reloader.last_error) == (0, 1, None)


def test_an_expired_certificate_fails_the_start_and_its_rotation_is_refused(tmp_path: Path) -> None:
    ca = CA()
    expired = ca.issue("extauthz", dns=("extauthz",), valid_for=-datetime.timedelta(hours=1))
    cert, key = expired.write(tmp_path, "tls")
    with pytest.raises(TlsConfigError, match=r"tls\.crt: the certificate expired at "):
        CertificateReloader(TlsFiles(cert, key))
    good = ca.issue("extauthz", dns=("extauthz",))
    good.write(tmp_path, "tls")
    reloader = CertificateReloader(TlsFiles(cert, key))
    expired.write(tmp_path, "tls")                      # a rotation to an expired certificate
    assert reloader.fetch() is None                    # keeps serving the good one
    assert reloader.failures == 1 and "expired" in (reloader.last_error or "")
    ca.issue("extauthz", dns=("extauthz",)).write(tmp_path, "tls")
    assert reloader.fetch() is not None and reloader.last_error is None
