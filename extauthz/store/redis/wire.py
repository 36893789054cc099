"""What goes over the wire: the Lua scripts (called by SHA), EVALSHA packed by hand,
``check.lua``'s reply decoded, client errors wrapped once, and the one NOSCRIPT path
(load the missing script, resend only the calls that got NOSCRIPT)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import importlib.resources
import operator
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

from redis import exceptions as rx

from ...core.errors import StoreError, StoreTimeout, StoreUnavailable
from ..algorithms import RULES
from ..base import OP_KINDS, CheckResult, Op, OpResult, StoreStats

__all__ = [
    "CLIENT_ERRORS", "MERGES", "NOSCRIPT_ATTEMPTS", "SCRIPT_NAMES", "UNKNOWN", "Merge", "Reply", "Script",
    "StoreStats", "Unanswered", "check_args", "check_result", "check_results", "later", "load_script", "num",
    "op_args", "pack_command", "pack_evalsha", "release_args", "released", "send_reloading", "unknown_reply", "wrap",
]

SCRIPT_NAMES: Final = ("check", "inflight", "shed_state", "compensate", "swap_value", "peek")

#: EVALSHA attempts while Redis answers NOSCRIPT (each after a SCRIPT LOAD): a flush that
#: lands between the load and the resend, or one per cluster node, is survived.
NOSCRIPT_ATTEMPTS: Final = 4

#: Errors from the client that mean "Redis could not answer" (wrapped into StoreError).
CLIENT_ERRORS: Final = (rx.RedisError, rx.RedisClusterException, OSError)

Reply = Any


@dataclass(frozen=True, slots=True)
class Merge:
    """How several calls of one script become one call (the batcher does it, per group):
    the first ``shared`` ARGV are the same in every call and sent once, then every call's
    other ARGV in order; KEYS concatenated; the reply is the calls' replies concatenated,
    ``head + per_key * len(keys)`` values each."""

    shared: int
    head: int
    per_key: int

    def reply_length(self, keys: int) -> int:
        return self.head + self.per_key * keys

    @staticmethod
    def failure(reply: Sequence[Any]) -> str | None:
        """The error of one call's answer when the script failed it alone (its first value
        is -1, its next ones the message: check.lua), else None."""
        if not isinstance(reply, list | tuple) or not reply or reply[0] != -1:
            return None
        message = reply[2] if len(reply) > 2 else b"script error"
        return message.decode(errors="replace") if isinstance(message, bytes) else str(message)


#: the scripts whose calls merge (see their headers): check.lua's calls share "now" and answer
#: {admitted, then ok and value per key} per request (a release is a check.lua entry too).
MERGES: Final = {"check": Merge(shared=1, head=1, per_key=2)}


@dataclass(frozen=True, slots=True)
class Script:
    """One Lua script: its source and SHA1 (what EVALSHA names it by), and how its calls
    merge (None: they do not)."""

    name: str
    source: bytes
    sha: str
    merge: Merge | None = None

    @classmethod
    def of(cls, name: str, source: bytes, merge: Merge | None = None) -> Script:
        return cls(name, source, hashlib.sha1(source, usedforsecurity=False).hexdigest(), merge)


def load_script(name: str) -> Script:
    """Read ``<name>.lua`` from the ``extauthz.lua`` package data."""
    source = importlib.resources.files("extauthz.lua").joinpath(f"{name}.lua").read_bytes()
    return Script.of(name, source, MERGES.get(name))


class _Unknown:
    """The reply of a command whose connection was lost before it answered: it may have run."""

    def __repr__(self) -> str:
        return "UNKNOWN"


#: a late reply that never came (the connection was lost first): the command may have run
UNKNOWN: Final = _Unknown()


class Unanswered(rx.RedisError):
    """Commands were written and their replies did not come: within the socket timeout
    (``timed_out``; a stalled Redis runs them when it resumes) or before the connection was
    lost. Their outcome is unknown now; ``late`` resolves to the replies when they come after
    all (a retired connection keeps reading them: :mod:`.conn`), :data:`UNKNOWN` for each one
    whose connection was lost first."""

    def __init__(self, message: str, late: asyncio.Future[Any], *, timed_out: bool) -> None:
        super().__init__(message)
        self.late = late
        self.timed_out = timed_out

    def part(self, pick: Callable[[Any], Any]) -> Unanswered:
        """The same failure for a part of the replies: ``late`` mapped through ``pick``."""
        return Unanswered(str(self), later(self.late, pick), timed_out=self.timed_out)


def later(late: asyncio.Future[Any], then: Callable[[Any], Any]) -> asyncio.Future[Any]:
    """A future of ``then(late's result)``; failing (retrieved) when ``late`` or ``then`` fails."""
    out: asyncio.Future[Any] = late.get_loop().create_future()

    def done(_: asyncio.Future[Any]) -> None:
        try:
            if late.cancelled():
                raise rx.ConnectionError("redis: late reply dropped")
            error = late.exception()
            if error is not None:
                raise error
            out.set_result(then(late.result()))
        except Exception as exc:
            out.set_exception(exc)
            out.exception()  # retrieved: nobody may wait for it

    late.add_done_callback(done)
    return out


def wrap(exc: BaseException) -> StoreError:
    """A client exception as the store's own error (timeouts kept apart; an unanswered
    call's ``late`` replies carried over)."""
    if isinstance(exc, StoreError):
        return exc
    if isinstance(exc, Unanswered):
        error: StoreError = (StoreTimeout(f"redis: {exc}") if exc.timed_out
                             else StoreUnavailable(f"redis: {exc}"))
        error.late = exc.late
        return error
    if isinstance(exc, rx.TimeoutError):
        return StoreTimeout(f"redis: {exc}")
    return StoreUnavailable(f"redis: {type(exc).__name__}: {exc}")


def num(x: float) -> str:
    return repr(float(x))


#: the 5 ARGV of a release op in check.lua (ZREM the entry's lease id from the key)
_RELEASE_ARGS: Final = (b"r", b"0", b"", b"", b"")


def check_args(now: str, ops: Sequence[Op], lease_id: str) -> tuple[list[str], list[str | bytes]]:
    """KEYS and ARGV of one request's check.lua call: now, then the request's lease id, its
    number of ops and 5 ARGV per op (see its header)."""
    return _entry(now, [op.key for op in ops], lease_id, [op_args(op) for op in ops])


def release_args(now: str, keys: Sequence[str], lease_id: str) -> tuple[list[str], list[str | bytes]]:
    """KEYS and ARGV of a check.lua call that releases ``lease_id`` from each of ``keys``."""
    return _entry(now, list(keys), lease_id, [_RELEASE_ARGS] * len(keys))


def released(reply: Sequence[Any]) -> int:
    """How many keys held the lease, from a release entry's reply (its ops' ok flags)."""
    return sum(int(reply[i]) for i in range(1, len(reply), 2))


def _entry(now: str, keys: list[str], lease_id: str,
           per_op: Sequence[Sequence[bytes]]) -> tuple[list[str], list[str | bytes]]:
    args: list[str | bytes] = [now, lease_id, str(len(keys))]
    for op in per_op:
        args.extend(op)
    return keys, args


def op_args(op: Op) -> tuple[bytes, ...]:
    """The 5 ARGV check.lua reads per op (see its header): packed by the op kind's ``CODE``
    and ``ARGS`` (:mod:`extauthz.store.base`)."""
    return _PACKERS[type(op)](op)


#: how a field of each type crosses to Redis: floats as ``repr(float)`` (exact; check.lua
#: reads them back with tonumber), ints as integers, strings as they are
_FORMATS: Final[dict[str, Callable[[Any], bytes]]] = {
    "float": lambda x: num(x).encode(),
    "int": lambda x: str(int(x)).encode(),
    "str": lambda x: str(x).encode(),
}


def _packer(kind: type[Op]) -> Callable[[Op], tuple[bytes, ...]]:
    """The ARGV packer of one op kind, from its ``CODE`` and ``ARGS``: the fields' values are
    read in ``ARGS`` order, and what they pack to is cached (an op's numbers repeat from
    check to check; its key is not part of them)."""
    types = {f.name: str(f.type) for f in dataclasses.fields(kind)}
    slots = [name.split() for name in kind.ARGS]
    names = [name for slot in slots for name in slot]
    formats = [_FORMATS[types[name]] for name in names]
    code = kind.CODE.encode()
    read = operator.attrgetter(*names) if len(names) > 1 else (lambda op: (getattr(op, names[0]),))

    @functools.lru_cache(maxsize=4096)
    def pack(enforce: bool, values: tuple[Any, ...]) -> tuple[bytes, ...]:
        packed = iter([fmt(v) for fmt, v in zip(formats, values, strict=True)])
        return (code, b"1" if enforce else b"0",
                *(b" ".join(next(packed) for _ in slot) for slot in slots))

    return lambda op: pack(op.enforce, read(op))


#: op kind -> its ARGV packer
_PACKERS: Final = {kind: _packer(kind) for kind in OP_KINDS}


def _bulk(arg: str | bytes) -> bytes:
    data = arg if isinstance(arg, bytes) else arg.encode()
    return b"$%d\r\n%b\r\n" % (len(data), data)


def pack_command(*args: str | bytes) -> bytes:
    """Any command in RESP (off the hot path: SCRIPT LOAD over the lean connection)."""
    return b"*%d\r\n" % len(args) + b"".join(_bulk(a) for a in args)


def pack_evalsha(sha: bytes, keys: Sequence[str], args: Sequence[str | bytes]) -> bytes:
    """EVALSHA in RESP, packed here: redis-py's generic packer costs more than the rest of
    a check (it was ~90 us of ~100 us per check in a profile)."""
    parts = [b"*%d\r\n$7\r\nEVALSHA\r\n" % (3 + len(keys) + len(args)), _bulk(sha),
             _bulk(str(len(keys)))]
    parts.extend(_bulk(k) for k in keys)
    parts.extend(_bulk(a) for a in args)
    return b"".join(parts)


def unknown_reply(ops: Sequence[Op]) -> list[Any]:
    """check.lua's reply taken for a call that may have run (:data:`UNKNOWN`): admitted, and
    each op committed where its rule says so (``Rule.assume_committed``: every lease op
    held, as releasing a lease id that is not there is harmless) and not elsewhere (no
    bucket op taken: refunding tokens that were not taken would not be; a grant or give-back
    neither, of tokens or of quota units; a fleet grant's slots neither: taken, they expire
    with its TTL)."""
    reply: list[Any] = [1]
    for op in ops:
        reply.extend((1 if RULES[type(op)].assume_committed else 0, b"0"))
    return reply


def check_result(ops: Sequence[Op], reply: Reply) -> CheckResult:
    """One request's check.lua answer as the store's result (an error reply raised, wrapped;
    an entry that failed alone inside a merged call raised too; :data:`UNKNOWN` taken as
    :func:`unknown_reply`)."""
    if reply is UNKNOWN:
        reply = unknown_reply(ops)
    if isinstance(reply, BaseException):
        raise wrap(reply)
    if (message := Merge.failure(reply)) is not None:
        raise StoreUnavailable(f"redis: {message}")
    admitted = int(reply[0]) == 1
    return CheckResult(admitted, tuple(check_results(ops, reply, admitted)))


def check_results(ops: Sequence[Op], reply: Sequence[Any], admitted: bool) -> list[OpResult]:
    """check.lua's reply (each op's allowed flag and its state before the commit) -> the
    results, derived by each op's rule (``algorithms.RULES``) as on the memory store."""
    results = []
    for i, op in enumerate(ops):
        allowed = int(reply[1 + 2 * i]) == 1
        results.append(RULES[type(op)].result(op, allowed, float(reply[2 + 2 * i]), admitted and allowed))
    return results


async def send_reloading(
    scripts: Sequence[Script],
    send: Callable[[list[int]], Awaitable[Sequence[Reply]]],
    load: Callable[[Script], Awaitable[None]],
    stats: StoreStats,
) -> list[Reply]:
    """The one NOSCRIPT path. ``send(indexes)`` sends the calls at those indexes in one
    round trip and returns their replies in order, error replies in place (never raising
    for one call's error); every call that got NOSCRIPT has its script loaded (``load``)
    and is resent, up to :data:`NOSCRIPT_ATTEMPTS` times."""
    replies: list[Reply] = [None] * len(scripts)
    todo = list(range(len(scripts)))
    for attempt in range(NOSCRIPT_ATTEMPTS):
        stats.commands += len(todo)
        stats.round_trips += 1
        try:
            answers = await send(todo)
        except Unanswered as exc:  # the late replies, in place among those already known
            raise exc.part(functools.partial(_filled, list(replies), list(todo))) from None
        missing: list[int] = []
        for i, answer in zip(todo, answers, strict=True):
            replies[i] = answer
            if isinstance(answer, rx.NoScriptError):
                missing.append(i)
        if not missing or attempt + 1 == NOSCRIPT_ATTEMPTS:
            break
        for script in {scripts[i] for i in missing}:
            await load(script)
        todo = missing
    return replies


def _filled(known: list[Reply], indexes: list[int], answers: Sequence[Reply]) -> list[Reply]:
    out = list(known)
    for i, answer in zip(indexes, answers, strict=True):
        out[i] = answer
    return out
