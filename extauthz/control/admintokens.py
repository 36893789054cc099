"""The admin port's client side: the headers the commands send and the token file they read
(:func:`client_token`), by the rules the server applies (:func:`parse_tokens`; the server's
side, :mod:`extauthz.server.adminauth`, imports them from here). Only the standard library:
an operator command reaches the admin port without loading the server's HTTP stack."""

from __future__ import annotations

import re
from pathlib import Path

#: a mutating request without a token must carry this header (any non-empty value); the CLI
#: sends ``extauthz/VERSION``.
CLIENT_HEADER = "X-Extauthz-Client"
#: why a change is made (percent-encoded UTF-8); required when a token is set.
REASON_HEADER = "X-Extauthz-Reason"
#: who the client says it is (the CLI's OS user; percent-encoded UTF-8).
USER_HEADER = "X-Extauthz-User"
#: the shortest token accepted (a token from ``openssl rand -hex 32`` has 64).
MIN_TOKEN = 16
#: longest reason and user kept (characters).
TEXT_MAX = 200
_NAMED = re.compile(r"^([A-Za-z0-9_.@-]{1,64}):(\S+)$")


class AdminConfigError(ValueError):
    """The admin port's token or host options are unusable; the server does not start."""


def parse_tokens(text: str, where: str) -> dict[str, str]:
    """``{token: name}`` from a token file's text (name ``""`` for a bare token). Raises
    AdminConfigError naming ``where`` when no token is there or one is too short."""
    tokens: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = _NAMED.match(line)
        name, token = (match.group(1), match.group(2)) if match else ("", line)
        if len(token) < MIN_TOKEN or any(c.isspace() for c in token):
            raise AdminConfigError(f"{where}:{n}: a token has at least {MIN_TOKEN} characters "
                                   "and no spaces (e.g. `openssl rand -hex 32`)")
        tokens[token] = name
    if not tokens:
        raise AdminConfigError(f"{where}: no token in the file (a bare token, or NAME:TOKEN lines)")
    return tokens


def client_token(path: str) -> str:
    """The token the CLI sends from ``path`` (the first one, without its ``NAME:``)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise AdminConfigError(f"cannot read the admin token file {path}: {exc.strerror or exc}") from None
    return next(iter(parse_tokens(text, path)))
