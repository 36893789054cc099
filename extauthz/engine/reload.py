"""Hot reload of the policy files.

:class:`PolicyWatcher` polls a digest of the policy files' contents (through symlinks) about
once a second. That sees every way a file can change, including a Kubernetes ConfigMap
update, which swaps the ``..data`` symlink of the mounted directory in one rename (the
visible ``*.yaml`` entries are symlinks into ``..data/``; :func:`load_policy` skips hidden
entries). When the digest changes, the new policy is built completely with the one
validator, :func:`extauthz.policy.load_policy`, and only then swapped in as a whole.

A failed reload keeps the last good policy serving. It is logged once per distinct broken
content (every issue with file, field and line), counted, and shown in ``/status``
(``reload.last_error``) until a good reload clears it. A parser child that fails (it could
not start, crashed, was killed, took more than ``child_timeout``, or sent back what cannot be
unpickled) is a failed reload of that content too: recorded once and not tried again until
the files change (a child that fails after its parse cost 1-2 s of CPU on every poll when
it was retried). A valid policy whose swap fails (the
new snapshot cannot be built) is a failed reload too, and is retried on every poll until it
applies (the built policy is kept for the retries: the same content is not parsed again). A
load that fails while the files are still changing (the digest moved under it) is not
reported: the next poll retries.

The server's job (:meth:`PolicyWatcher.poll`) never parses on the event loop, nor in this
process when the files are large. Files of more than :data:`ISOLATE_BYTES` together are
parsed and validated in a child process (started for the reload, gone after it); the policy
comes back as pickled pieces of at most :data:`PIECE` rules or limiters, rebuilt on the loop
one piece per loop step, and the swap itself only builds the new snapshot (no walk over the
rules: what it needs was computed when the policy was compiled). Parsing in a worker thread
was not enough: it shares the GIL with the loop, and the garbage collector's full
collections over the parse's hundreds of thousands of YAML nodes ran in that thread holding
the GIL, 0.2-0.7 s each, so a 0.88 MB policy of 12,000 rules stalled checks 0.3-0.9 s
(bench/reload_lag.py; docs/operations.md, "Hot reload"). Smaller files are parsed in a
worker thread, as before: their parse holds the loop for a few milliseconds at most, less
than starting a child costs. A file larger than ``max_bytes`` (``--policy-max-bytes``) is
refused before it is parsed, like any other broken content. The poll is cheap (a few small
files read and hashed, well under a millisecond). A content digest rather than file events:
a ConfigMap update never writes the files it shows (it points ``..data`` elsewhere), so an
inotify watch on them stays silent, and mtimes compare badly across the swap;
``watchfiles`` could watch the directory but adds a native dependency for what a 1 s poll
does as well.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import io
import json
import logging
import os
import pickle
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.clock import SYSTEM_CLOCK, Clock
from ..core.errors import PolicyError, PolicyIssue
from ..policy import Policy, load_policy
from ..policy.loader import MAX_FILE_BYTES, policy_files

log = logging.getLogger("extauthz.reload")


@dataclass(frozen=True, slots=True)
class ReloadError:
    at: float
    digest: str
    issues: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        return {"at": self.at, "issues": list(self.issues)}


@dataclass(frozen=True, slots=True)
class ChildFailed:
    """A parser child's failure (:meth:`PolicyWatcher.poll`): ``error`` says how."""

    error: str


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
_ELSEWHERE = "elsewhere"

#: policy files larger than this together are parsed in a child process (:meth:`PolicyWatcher.
#: poll`); smaller ones in a worker thread, whose share of the GIL and of the collector's work
#: stays within a few milliseconds (200 rules, 15 KiB: the loop's largest gap 6.5 ms, the
#: GIL's switch interval; 850 rules, 64 KiB: 12-78 ms; bench/reload_lag.py)
ISOLATE_BYTES = 16 << 10
#: rules (or limiters) per pickled piece of a policy built in a child: one piece is rebuilt
#: per loop step (200 rules: about 1.3 ms; docs/operations.md)
PIECE = 200


def policy_bytes(paths: Sequence[Path]) -> int:
    """The size of the policy files ``paths`` name, together (0 for what cannot be read)."""
    total = 0
    try:
        files = policy_files(p for p in paths if p.exists())
    except OSError:
        return 0
    for f in files:
        try:
            total += f.stat().st_size
        except OSError:
            pass
    return total


class _Packer(pickle.Pickler):
    """Pickles a policy with its long tuples left out, named by their index in ``long``."""

    def __init__(self, file: io.BytesIO, long: Sequence[tuple[Any, ...]]) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._long = {id(t): i for i, t in enumerate(long)}

    def persistent_id(self, obj: Any) -> int | None:
        return self._long.get(id(obj)) if type(obj) is tuple else None


class _Unpacker(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, long: Sequence[tuple[Any, ...]]) -> None:
        super().__init__(file)
        self._long = long

    def persistent_load(self, pid: Any) -> Any:
        return self._long[pid]


def pack(policy: Policy) -> list[bytes]:
    """``policy`` as pickled pieces: its rules and limiters :data:`PIECE` at a time, then the
    rest (which names those tuples). :func:`unpack` rebuilds it a piece per loop step."""
    long = [policy.rules, policy.limiters]
    pieces = [pickle.dumps((i, t[at:at + PIECE]), pickle.HIGHEST_PROTOCOL)
              for i, t in enumerate(long) for at in range(0, len(t), PIECE)]
    head = io.BytesIO()
    _Packer(head, long).dump(policy)
    pieces.append(head.getvalue())
    return pieces


async def unpack(pieces: Sequence[bytes]) -> Policy:
    """The policy :func:`pack` cut into ``pieces``, one piece per loop step (no step rebuilds
    more than :data:`PIECE` rules or limiters)."""
    long: list[list[Any]] = [[], []]
    for piece in pieces[:-1]:
        i, items = pickle.loads(piece)
        long[i].extend(items)
        await asyncio.sleep(0)
    policy = _Unpacker(io.BytesIO(pieces[-1]), [tuple(t) for t in long]).load()
    if not isinstance(policy, Policy):
        raise TypeError(f"a policy child sent a {type(policy).__name__}")
    return policy


def load_packed(paths: Sequence[Path], max_bytes: int) -> tuple[list[bytes], list[PolicyIssue]]:
    """:func:`load_policy` as a child process runs it: the policy :func:`pack` ed, or its
    issues (a :class:`PolicyError` itself does not survive pickling)."""
    try:
        return pack(load_policy(paths, max_bytes=max_bytes)), []
    except PolicyError as exc:
        return [], list(exc.issues)


def child_main() -> None:
    """The child of :func:`load_elsewhere`: a JSON request on stdin, the pickled answer of
    :func:`load_packed` on stdout. Without the garbage collector: a parse makes no cycles
    worth collecting, the process ends with it, and the collector's passes over the YAML
    nodes were half the parse's time."""
    gc.disable()
    request = json.loads(sys.stdin.buffer.read())
    answer = load_packed([Path(p) for p in request["paths"]], int(request["max_bytes"]))
    sys.stdout.buffer.write(pickle.dumps(answer, pickle.HIGHEST_PROTOCOL))


#: how long a child may take to parse a policy (a 1 MiB one takes a few seconds); then it
#: is killed
CHILD_TIMEOUT = 120.0
_CHILD = "from extauthz.engine.reload import child_main; child_main()"


def child_env() -> dict[str, str]:
    """This process's environment with ``PYTHONPATH`` set to its ``sys.path`` (absolute): the
    child imports this :mod:`extauthz` however this process found it (a zipapp, a pex, a
    source tree run from its directory), whatever directory it runs in."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or os.curdir) for p in sys.path)
    return env


async def load_elsewhere(paths: Sequence[Path], max_bytes: int, *, python: str = sys.executable,
                         time_bound: float = CHILD_TIMEOUT) -> tuple[list[bytes], list[PolicyIssue]]:
    """:func:`load_packed` in a child process started for it (a new interpreter ``python``,
    as ``--workers`` starts its workers: nothing of this process's state, threads or event
    loop is copied, and nobody's main module is run again; gone when it has answered). A
    child that cannot start raises :class:`OSError`; one that fails raises
    :class:`RuntimeError`, and so does one that takes longer than ``time_bound`` (it is killed).
    Cancelled (the server stopping), the child is killed."""
    request = json.dumps({"paths": [str(p) for p in paths], "max_bytes": max_bytes}).encode()
    child = await asyncio.create_subprocess_exec(
        python, "-c", _CHILD, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=child_env())
    try:
        out, err = await asyncio.wait_for(child.communicate(request), time_bound)
    except TimeoutError:
        raise RuntimeError(f"the policy parser process took more than {time_bound:g} s; killed") from None
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
    if child.returncode != 0:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
        raise RuntimeError(f"the policy parser process failed (exit {child.returncode}): {tail[0]}")
    answer: tuple[list[bytes], list[PolicyIssue]] = pickle.loads(out)  # bytes and issues: cheap
    return answer


class PolicyWatcher:
    """Polls ``paths``; on a change builds the new policy and calls ``apply(policy)``.

    :meth:`poll` (the server's job) builds in a child process (large files) or a worker
    thread and applies on the loop; :meth:`poll_once` does both in the caller (tests, tools)."""

    def __init__(self, paths: Sequence[str | Path], apply: Callable[[Policy], None], *,
                 current: Policy, interval: float = 1.0, clock: Clock = SYSTEM_CLOCK,
                 max_bytes: int = MAX_FILE_BYTES, python: str = sys.executable,
                 child_timeout: float = CHILD_TIMEOUT) -> None:
        self.paths = tuple(Path(p) for p in paths)
        self.max_bytes = max_bytes
        #: the interpreter a parser child runs (:func:`load_elsewhere`), and its time bound
        self.python = python
        self.child_timeout = child_timeout
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
        """:meth:`poll_once` with the reading, parsing and validating off the event loop: in
        a child process when the files hold more than :data:`ISOLATE_BYTES`, else in a worker
        thread. The loop rebuilds a child's policy a piece at a time and swaps it in."""
        digest, built = await asyncio.to_thread(self._build, True)
        outcome: Policy | PolicyError | ChildFailed | str = built
        if isinstance(outcome, str) and outcome == _ELSEWHERE:
            outcome = await self._elsewhere()
            if isinstance(outcome, PolicyError | ChildFailed):
                changing = await asyncio.to_thread(content_digest, self.paths, self.max_bytes) != digest
                if changing:
                    outcome = _CHANGING
        return self._settle(digest, outcome)

    async def _elsewhere(self) -> Policy | PolicyError | ChildFailed:
        """The policy a child builds, its issues, or how the child failed (it could not
        start, crashed, was killed or timed out, or sent what cannot be rebuilt)."""
        try:
            pieces, issues = await load_elsewhere(self.paths, self.max_bytes, python=self.python,
                                                  time_bound=self.child_timeout)
            return PolicyError(issues) if issues else await unpack(pieces)
        except Exception as exc:  # not CancelledError: the server stopping
            return ChildFailed(f"{type(exc).__name__}: {exc}")

    def poll_once(self) -> bool:
        """Reload if the files changed. True when a new policy took effect."""
        return self._settle(*self._build())

    def _build(self, isolate: bool = False) -> tuple[str, Policy | PolicyError | str]:
        """Read and build (any thread; touches no state but reads ``_seen`` and ``_unapplied``).
        ``isolate``: a changed content of more than :data:`ISOLATE_BYTES` is not parsed here
        (:data:`_ELSEWHERE`: the caller has a child process parse it)."""
        digest = content_digest(self.paths, self.max_bytes)
        if digest == self._seen:
            return digest, _UNCHANGED
        if (unapplied := self._unapplied) is not None and unapplied[0] == digest:
            return unapplied
        if isolate and policy_bytes(self.paths) > ISOLATE_BYTES:
            return digest, _ELSEWHERE
        try:
            return digest, load_policy(self.paths, max_bytes=self.max_bytes)
        except PolicyError as exc:
            if content_digest(self.paths, self.max_bytes) != digest:
                return digest, _CHANGING  # still being written: look again next time
            return digest, exc

    def _settle(self, digest: str, outcome: Policy | PolicyError | ChildFailed | str) -> bool:
        """Record what :meth:`_build` found and swap a new policy in (the loop's part)."""
        if isinstance(outcome, str):
            return False
        if self._unapplied is not None and self._unapplied[0] != digest:
            self._unapplied = None  # the files moved on
        if isinstance(outcome, PolicyError):
            self._seen = digest
            self._failed(digest, [str(i) for i in outcome.issues])
            return False
        if isinstance(outcome, ChildFailed):
            # marked seen: the same content is not handed to another child until it changes
            self._seen = digest
            self._failed(digest, [f"parsing in a child process failed (not tried again until the files "
                                  f"change): {outcome.error}"])
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
