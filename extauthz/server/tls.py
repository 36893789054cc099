"""TLS and mTLS on the gRPC port, with certificates rotated on disk picked up live.

``--tls-cert``/``--tls-key`` (PEM, both or neither) turn TLS on; ``--tls-client-ca`` also
makes clients present a certificate signed by that CA (mTLS), checked in the handshake.

Rotation: gRPC's dynamic server credentials call :meth:`CertificateReloader.fetch` at every
new handshake. It compares the files' (inode, size, mtime) with the last look (a stat per
new connection; Envoy keeps its connections open) and, when they changed, loads and checks
them: the key must match the certificate, every file must parse and the certificate must not
have expired (its notAfter; notBefore is not checked, so a node's clock a little behind the
issuer's does not refuse a fresh certificate). A bad set (half-written, mismatched,
unreadable, expired) keeps the last good certificate, is logged once per change and
counted (``/status`` ``tls``, metric ``extauthz_tls_reload_failures``); the next change is
tried again. Kubernetes' atomic Secret update (a ``..data`` symlink swap) changes the inode.
Connections already open keep the certificate they were made with.
"""

from __future__ import annotations

import datetime
import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509

log = logging.getLogger("extauthz.server")

_Stamp = tuple[tuple[int, int, int], ...]


class TlsConfigError(OSError):
    """TLS options or files that cannot work; the server does not start with them."""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert: Path
    key: Path
    client_ca: Path | None = None

    @classmethod
    def from_options(cls, cert: str | None, key: str | None, client_ca: str | None) -> TlsFiles | None:
        """None for plaintext; raises :class:`TlsConfigError` for a half-given pair."""
        if not cert and not key:
            if client_ca:
                raise TlsConfigError("--tls-client-ca needs --tls-cert and --tls-key (mTLS is TLS plus "
                                     "client certificates)")
            return None
        if not cert or not key:
            raise TlsConfigError("--tls-cert and --tls-key go together: give both (TLS) or neither (plaintext)")
        return cls(Path(cert), Path(key), Path(client_ca) if client_ca else None)

    @property
    def paths(self) -> tuple[Path, ...]:
        return (self.cert, self.key) if self.client_ca is None else (self.cert, self.key, self.client_ca)


@dataclass(frozen=True, slots=True)
class _Loaded:
    cert: bytes
    key: bytes
    client_ca: bytes | None


def _read(files: TlsFiles) -> _Loaded:
    try:
        return _Loaded(files.cert.read_bytes(), files.key.read_bytes(),
                       files.client_ca.read_bytes() if files.client_ca else None)
    except OSError as exc:
        raise TlsConfigError(f"cannot read {exc.filename}: {exc.strerror}") from None


def _check_not_expired(path: Path, pem: bytes, now: datetime.datetime) -> None:
    """The served (first) certificate of ``pem`` must not be past its notAfter."""
    try:
        leaf = x509.load_pem_x509_certificates(pem)[0]
    except ValueError as exc:
        raise TlsConfigError(f"{path}: not a PEM certificate ({exc})") from None
    if leaf.not_valid_after_utc <= now:
        raise TlsConfigError(f"{path}: the certificate expired at {leaf.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}")


def load(files: TlsFiles, now: datetime.datetime | None = None) -> _Loaded:
    """Read and check the files (the key matches the certificate, which has not expired at
    ``now``, default the wall clock; the CA parses)."""
    first = _read(files)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(files.cert, files.key)
    except (ssl.SSLError, ValueError) as exc:
        raise TlsConfigError(f"{files.cert} / {files.key}: not a matching PEM certificate and key ({exc})") from None
    _check_not_expired(files.cert, first.cert, now or datetime.datetime.now(datetime.UTC))
    if first.client_ca is not None:
        try:
            ctx.load_verify_locations(cadata=first.client_ca.decode("ascii"))
        except (ssl.SSLError, ValueError, UnicodeDecodeError) as exc:
            raise TlsConfigError(f"{files.client_ca}: not a PEM CA certificate ({exc})") from None
    if _read(files) != first:  # written to while we looked: not a settled set yet
        raise TlsConfigError("the certificate files changed while being loaded")
    return first


def _configuration(loaded: _Loaded) -> Any:
    return grpc.ssl_server_certificate_configuration([(loaded.key, loaded.cert)],
                                                     root_certificates=loaded.client_ca)


def _ssl_context(files: TlsFiles, mtls: bool) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(files.cert, files.key)
    ctx.set_alpn_protocols(["h2"])
    if mtls and files.client_ca is not None:
        ctx.load_verify_locations(cafile=str(files.client_ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class CertificateReloader:
    """Owns the gRPC server credentials of a TLS port and follows the files on disk."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._stamp = self._stamps()
        self._loaded = load(files)  # a bad set at start fails the start
        #: certificate sets loaded after the first, and changed sets refused (last good kept).
        self.reloads = 0
        self.failures = 0
        self.last_error: str | None = None

    @property
    def mtls(self) -> bool:
        return self.files.client_ca is not None

    def _stamps(self) -> _Stamp:
        out = []
        for path in self.files.paths:
            try:
                st = os.stat(path)
            except OSError:
                out.append((0, 0, 0))
            else:
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            _configuration(self._loaded), self.fetch, require_client_authentication=self.mtls)

    def ssl_context(self) -> ssl.SSLContext:
        """The port's context for the asyncio gRPC server (``--grpc-server asyncio``): ALPN
        ``h2``, client certificates required under mTLS; each handshake first looks for
        rotated files (:meth:`fetch`, the same checks) and, when a new set was loaded, serves
        it through a new context."""
        current: dict[str, Any] = {"loaded": self._loaded, "ctx": _ssl_context(self.files, self.mtls)}

        def pick(sslobj: ssl.SSLObject, name: str | None, ctx: ssl.SSLContext) -> None:
            self.fetch()
            if self._loaded is not current["loaded"]:
                try:
                    current["ctx"] = _ssl_context(self.files, self.mtls)
                except (OSError, ssl.SSLError) as exc:  # changed again since: keep the last
                    log.error("TLS certificate rotation: cannot build the context: %s", exc)
                else:
                    current["loaded"] = self._loaded
            if current["ctx"] is not ctx:
                sslobj.context = current["ctx"]

        outer: ssl.SSLContext = current["ctx"]
        outer.sni_callback = pick
        return outer

    def fetch(self) -> Any:
        """gRPC's certificate_configuration_fetcher: a new configuration, or None (keep)."""
        stamp = self._stamps()
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        try:
            loaded = load(self.files)
        except TlsConfigError as exc:
            self.failures += 1
            self.last_error = str(exc)
            log.error("TLS certificate rotation refused, keeping the last good certificate: %s", exc,
                      extra={"fields": {"event": "tls_reload_failed"}})
            return None
        except Exception as exc:  # never let a surprise break every handshake
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.exception("TLS certificate rotation failed, keeping the last good certificate")
            return None
        self.last_error = None  # the files on disk are a good set again
        if loaded == self._loaded:
            return None
        self._loaded = loaded
        self.reloads += 1
        log.info("TLS certificate rotated on disk: serving the new one",
                 extra={"fields": {"event": "tls_reloaded"}})
        return _configuration(loaded)

    def status(self) -> dict[str, Any]:
        return {"enabled": True, "mtls": self.mtls, "cert": str(self.files.cert),
                "reloads": self.reloads, "reload_failures": self.failures, "last_error": self.last_error}
