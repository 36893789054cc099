"""Hot reload of the policy files.

:class:`PolicyWatcher` polls a digest of the policy files' contents (through symlinks) about
once a second. That sees every way a file can change, including a Kubernetes ConfigMap
update, which swaps the ``..data`` symlink of the mounted directory in one rename (the
visible ``*.yaml`` entries are symlinks into ``..data/``; :func:`load_policy` skips hidden
entries). When the digest changes, the new policy is built completely with the one
validator, :func:`extauthz.policy.load_policy`, and only then swapped in as a whole.

A failed reload keeps the last good policy serving. It is logged once per distinct broken
content (every issue with file, field and line), counted, and shown in ``/status``
(``reload.last_error``) until a good reload clears it. A valid policy whose swap fails (the
new snapshot cannot be built) is a failed reload too, and is retried on every poll until it
applies (the built policy is kept for the retries: the same content is not parsed again). A
load that fails while the files are still changing (the digest moved under it) is not
reported: the next poll retries.

The server's job (:meth:`PolicyWatcher.poll`) reads, hashes, parses and validates in a worker
thread and only swaps the built policy in on the event loop, so checks keep being answered
while a large policy is parsed (a 0.9 MB policy took seconds on the loop). A file larger
than ``max_bytes`` (``--policy-max-bytes``) is refused before it is parsed, like any other
broken content. The poll is cheap (a few small files read and hashed, well under a millisecond). A
content digest rather than file events: a ConfigMap update never writes the files it
shows (it points ``..data`` elsewhere), so an inotify watch on them stays silent, and mtimes
compare badly across the swap; ``watchfiles`` could watch the directory but adds a native
dependency for what a 1 s poll does as well.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .clock import SYSTEM_CLOCK, Clock
from .errors import PolicyError
from .policy import Policy, load_policy
from .policy.loader import MAX_FILE_BYTES, policy_files

log = logging.getLogger("extauthz.reload")


@dataclass(frozen=True, slots=True)
class ReloadError:
    at: float
    digest: str
    issues: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        return {"at": self.at, "issues": list(self.issues)}


def content_digest(paths: Sequence[Path], max_bytes: int = MAX_FILE_BYTES) -> str:
    """A digest of what :func:`load_policy` would read from ``paths`` (names and bytes; of a
    file larger than ``max_bytes``, which is refused anyway, its size and first bytes)."""
    h = hashlib.sha256()
    existing = []
    for p in paths:
        if p.exists():
            existing.append(p)
        else:
            h.update(b"missing\0" + str(p).encode() + b"\0")
    try:
        files = policy_files(existing)
    except OSError as exc:  # a directory vanishing mid-swap
        h.update(f"error\0{exc}\0".encode())
        return h.hexdigest()
    for f in files:
        h.update(str(f).encode() + b"\0")
        try:
            with f.open("rb") as stream:
                h.update(stream.read(max_bytes + 1))
                h.update(f"\0size\0{os.fstat(stream.fileno()).st_size}".encode())
        except OSError as exc:
            h.update(f"unreadable\0{exc.strerror}".encode())
        h.update(b"\0")
    return h.hexdigest()


#: what a build found: nothing new, still being written (look again), or the digest's outcome
_UNCHANGED = "unchanged"
_CHANGING = "changing"


class PolicyWatcher:
    """Polls ``paths``; on a change builds the new policy and calls ``apply(policy)``.

    :meth:`poll` (the server's job) builds in a worker thread and applies on the loop;
    :meth:`poll_once` does both in the caller (tests, tools)."""

    def __init__(self, paths: Sequence[str | Path], apply: Callable[[Policy], None], *,
                 current: Policy, interval: float = 1.0, clock: Clock = SYSTEM_CLOCK,
                 max_bytes: int = MAX_FILE_BYTES) -> None:
        self.paths = tuple(Path(p) for p in paths)
        self.max_bytes = max_bytes
        self.apply = apply
        self.interval = interval
        self._clock = clock
        self.version = current.version
        self.sources = current.sources
        self.loaded_at = clock.wall()
        self.reloads = 0
        self.failures = 0
        self.last_error: ReloadError | None = None
        self._seen = content_digest(self.paths, max_bytes)
        #: a built policy whose swap failed, by digest: its retries swap it in again without
        #: parsing the same content anew on every poll (written on the loop, read by the thread)
        self._unapplied: tuple[str, Policy] | None = None

    @property
    def failing(self) -> bool:
        return self.last_error is not None

    async def poll(self) -> bool:
        """:meth:`poll_once` with the reading, parsing and validating in a worker thread:
        the event loop only swaps the result in."""
        digest, outcome = await asyncio.to_thread(self._build)
        return self._settle(digest, outcome)

    def poll_once(self) -> bool:
        """Reload if the files changed. True when a new policy took effect."""
        return self._settle(*self._build())

    def _build(self) -> tuple[str, Policy | PolicyError | str]:
        """Read and build (any thread; touches no state but reads ``_seen`` and ``_unapplied``)."""
        digest = content_digest(self.paths, self.max_bytes)
        if digest == self._seen:
            return digest, _UNCHANGED
        if (unapplied := self._unapplied) is not None and unapplied[0] == digest:
            return unapplied
        try:
            return digest, load_policy(self.paths, max_bytes=self.max_bytes)
        except PolicyError as exc:
            if content_digest(self.paths, self.max_bytes) != digest:
                return digest, _CHANGING  # still being written: look again next time
            return digest, exc

    def _settle(self, digest: str, outcome: Policy | PolicyError | str) -> bool:
        """Record what :meth:`_build` found and swap a new policy in (the loop's part)."""
        if isinstance(outcome, str):
            return False
        if self._unapplied is not None and self._unapplied[0] != digest:
            self._unapplied = None  # the files moved on
        if isinstance(outcome, PolicyError):
            self._seen = digest
            self._failed(digest, [str(i) for i in outcome.issues])
            return False
        policy = outcome
        if policy.version == self.version:
            self._seen = digest
            self.last_error = None  # back to the content being served
            return False
        previous = self.version
        try:
            self.apply(policy)
        except Exception as exc:
            # Building the new snapshot failed (a bug: nothing a policy or an override holds
            # should make it fail). Counted and shown like a refused policy, once per content,
            # and retried on the next poll (the digest is not marked seen).
            if self.last_error is None or self.last_error.digest != digest:
                self._failed(digest, [f"applying the policy failed: {type(exc).__name__}: {exc}"])
            self._unapplied = (digest, policy)
            return False
        self._unapplied = None
        self._seen = digest
        self.version, self.sources = policy.version, policy.sources
        self.loaded_at = self._clock.wall()
        self.reloads += 1
        self.last_error = None
        log.info("policy reloaded: version %s (was %s)", policy.version, previous, extra={"fields": {
            "event": "policy_reloaded", "version": policy.version, "previous": previous,
            "sources": list(policy.sources), "limiters": [s.name for s in policy.limiters]}})
        return True

    def _failed(self, digest: str, issues: list[str]) -> None:
        self.failures += 1
        self.last_error = ReloadError(self._clock.wall(), digest, tuple(issues))
        log.error("policy reload failed; still serving version %s:\n  %s", self.version,
                  "\n  ".join(issues), extra={"fields": {
                      "event": "policy_reload_failed", "serving": self.version, "issues": issues}})

    def status(self) -> dict[str, object]:
        return {
            "version": self.version,
            "sources": list(self.sources),
            "loaded_at": self.loaded_at,
            "reloads": self.reloads,
            "failures": self.failures,
            "last_error": None if self.last_error is None else self.last_error.to_dict(),
            "watching": [str(p) for p in self.paths],
            "interval": self.interval,
        }
