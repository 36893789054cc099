"""Where a running server says which admin port it got (two servers on one host).

``extauthz serve`` writes its admin URL to ``RUNTIME_DIR/admin-PORT.url``, PORT being its
gRPC ``--listen`` port, and removes it on a clean stop. RUNTIME_DIR is
``$XDG_RUNTIME_DIR/extauthz`` or ``/tmp/extauthz-UID`` (created 0700; a directory that another
user owns, or a symlink, is refused). ``extauthz switch|report --listen HOST:PORT`` read it,
so an operator names a server by the port they started it with, whatever admin port it got.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path


class PortFileError(OSError):
    pass


def runtime_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base:
        return Path(base) / "extauthz"
    return Path(tempfile.gettempdir()) / f"extauthz-{os.getuid()}"


def listen_port(listen: str) -> int:
    _, sep, port = listen.strip().rpartition(":")
    text = port if sep else listen.strip()
    if not text.isdigit():
        raise ValueError(f"expected HOST:PORT or PORT, got {listen!r}")
    return int(text)


def admin_url_path(listen: str) -> Path:
    """The file a server listening on ``listen`` (``HOST:PORT`` or ``PORT``) writes."""
    return runtime_dir() / f"admin-{listen_port(listen)}.url"


def _own_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PortFileError(f"{path} is not a private directory of this user; not writing there")
    return path


def write_admin_url(path: Path, url: str) -> None:
    _own_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(url + "\n")
    tmp.replace(path)  # atomic: a reader sees the old or the new URL


def remove_admin_url(path: Path, url: str) -> None:
    """Remove the file if it still names ``url`` (a newer server may own it now)."""
    with contextlib.suppress(OSError):
        if path.read_text().strip() == url:
            path.unlink()


def read_admin_url(listen: str) -> str:
    path = admin_url_path(listen)
    try:
        url = path.read_text().strip()
    except FileNotFoundError:
        raise PortFileError(f"no server on {listen} wrote {path} (is it running on this host, "
                            "as this user, with its admin port on?)") from None
    if not url.startswith("http://"):
        raise PortFileError(f"{path} does not hold an admin URL")
    return url
