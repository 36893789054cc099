"""The auto-batcher: script calls queued in one event-loop iteration go out together in
the next (one round trip for all of them), sent by batcher-owned tasks, so that a caller
cancelled by the engine's deadline never interrupts a read on a pooled connection.

Riders (lease releases) do not start a round trip of their own: they wait for the next
check and go out in its pipeline write (its script call, merged below), or after :data:`RIDE_FLUSH_DELAY` when no check
comes (so that an idle server still releases promptly).

Calls of one script that merges (:class:`.wire.Merge`: ``check.lua``) submitted with the
same ``merge`` group (and the same shared ARGV) go out in one batch as ONE script call, the
riders first; each caller gets its own slice of the reply. Under load a batch's checks and
releases then cost one EVALSHA and one Redis TIME together."""

from __future__ import annotations

import asyncio
import functools
import operator
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Final

from redis import exceptions as rx

from ...core.errors import StoreUnavailable
from .wire import CLIENT_ERRORS, UNKNOWN, Reply, Script, Unanswered, wrap

__all__ = ["RIDE_FLUSH_DELAY", "Batcher", "Call", "written"]

#: Seconds a release waits for a check to ride with before it is sent on its own. A few
#: milliseconds: far below any lease TTL, and under load a check comes much sooner.
RIDE_FLUSH_DELAY: Final = 0.003


@dataclass(slots=True)
class Call:
    script: Script
    keys: Sequence[str]
    args: Sequence[str | bytes]
    future: asyncio.Future[Reply]
    #: not sent when its caller has gone before it was (a check: nothing gets committed)
    droppable: bool = False
    #: calls of one script with the same group are sent as one call (see the module doc;
    #: on Redis Cluster the group is the hash tag: one call must stay in one slot)
    merge: str | None = None
    #: a merged call: the calls it carries, in KEYS order
    parts: list[Call] | None = None
    #: when it was written to Redis (``time.monotonic()``; 0: not yet): the engine measures
    #: its store deadline from here, not from when the check queued (:meth:`RedisStore.waiting`)
    written: float = 0.0
    #: the connection's future of its reply, set when the bytes are read (before the reply
    #: travels to the caller): None until written on a lean connection
    reply: asyncio.Future[Any] | None = None

    def answered(self) -> bool:
        """Whether Redis's reply has been read (the caller may not have it yet)."""
        return self.future.done() or (self.reply is not None and self.reply.done())


class Batcher:
    """Queues calls and sends them with ``transmit(batch) -> replies`` (error replies in
    place); owns every task it starts (cancelled by :meth:`close`)."""

    def __init__(self, transmit: Callable[[list[Call]], Awaitable[list[Reply]]], *,
                 batching: bool, split: Callable[[list[Call]], list[list[Call]]] | None = None) -> None:
        self.batching = batching
        self.closed = False
        self._transmit = transmit
        #: Redis Cluster: a batch split per master, each part sent and its replies delivered
        #: on its own (a slow master delays only its own calls)
        self._split = split
        self._pending: list[Call] = []
        self._sender: asyncio.Task[None] | None = None
        #: releases waiting for a check to ride with, and their flush timer
        self._riders: list[Call] = []
        self._flush: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    def submit(self, script: Script, keys: Sequence[str], args: Sequence[str | bytes], *,
               droppable: bool = False, ride: bool = False,
               merge: str | None = None) -> asyncio.Future[Reply]:
        """Queue one script call; its future resolves to the raw reply (or a StoreError).
        ``ride``: wait for the next check's round trip (at most :data:`RIDE_FLUSH_DELAY`);
        ``merge``: the group of calls this one may share one script call with."""
        return self.submit_call(script, keys, args, droppable=droppable, ride=ride, merge=merge).future

    def submit_call(self, script: Script, keys: Sequence[str], args: Sequence[str | bytes], *,
                    droppable: bool = False, ride: bool = False, merge: str | None = None) -> Call:
        """:meth:`submit`, returning the queued :class:`Call` (when it is written, whether its
        reply was read: :meth:`Call.answered`)."""
        if self.closed:
            raise StoreUnavailable("redis store is closed")
        loop = asyncio.get_running_loop()
        call = Call(script, keys, args, loop.create_future(), droppable, merge)
        if ride and self.batching:
            self._riders.append(call)
            if self._flush is None and self._sender is None:
                self._flush = loop.call_later(RIDE_FLUSH_DELAY, self._flush_riders)
            return call
        if not self.batching:
            self.spawn(self._send([call]))
        else:
            self._pending.append(call)
            if self._sender is None:
                # Runs in the next loop iteration: everything submitted in this one rides along.
                self._sender = self.spawn(self._send_pending())
        return call

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A batcher-owned task (cancelled by :meth:`close`) whose result its caller
        awaits (senders deliver theirs through the calls' futures)."""
        task: asyncio.Task[Any] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: its awaiters may all have been cancelled

    def _flush_riders(self) -> None:
        self._flush = None
        if self._riders and self._sender is None and not self.closed:
            self._sender = self.spawn(self._send_pending())

    async def _send_pending(self) -> None:
        batch, self._pending, self._sender = self._pending, [], None
        if self._riders:  # first: a released slot is free for the checks behind it
            batch[:0] = self._riders
            self._riders = []
            if self._flush is not None:
                self._flush.cancel()
                self._flush = None
        await self._send(batch)

    async def _send(self, batch: list[Call]) -> None:
        # A check whose caller gave up before it was even sent is not sent: nothing is
        # committed for it. (Other calls, releases in particular, go out regardless.)
        batch = _merged([call for call in batch if not (call.droppable and call.future.cancelled())])
        if not batch:
            return
        if self._split is None or len(parts := self._split(batch)) == 1:
            await self._send_part(batch)  # one master: no split list built per batch
        else:
            await asyncio.gather(*(self._send_part(part) for part in parts))

    async def _send_part(self, batch: list[Call]) -> None:
        """One round trip for ``batch`` (merged calls), each caller given its reply."""
        written(batch, None)  # the lean connections stamp the write itself (wire time)
        try:
            replies = await self._transmit(batch)
        except asyncio.CancelledError:
            for call in batch:
                for part in call.parts or (call,):
                    part.future.cancel()
            raise
        except Unanswered as exc:  # sent, unanswered: each caller its late reply
            replies = [exc.part(operator.itemgetter(k)) for k in range(len(batch))]
        except BaseException as exc:  # every caller gets the error (wrapped below)
            replies = [exc] * len(batch)
        for call, reply in zip(batch, replies, strict=True):
            if call.parts is None:
                _deliver(call, reply)
                continue
            start = 0
            assert call.script.merge is not None
            for part in call.parts:  # a merged call: each caller its slice of the reply
                end = start + call.script.merge.reply_length(len(part.keys))
                _deliver(part, reply.part(functools.partial(_sliced, start, end))
                         if isinstance(reply, Unanswered)
                         else reply if isinstance(reply, BaseException) else reply[start:end])
                start = end

    async def close(self) -> None:
        """Cancel every task and every queued call."""
        self.closed = True
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._tasks.difference_update(tasks)
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        for call in [*self._pending, *self._riders]:
            call.future.cancel()
        self._pending.clear()
        self._riders.clear()


def written(batch: Sequence[Call], replies: Sequence[asyncio.Future[Any]] | None) -> None:
    """Stamp the calls of ``batch`` (and the parts of merged ones) written now; with
    ``replies``, the connection's futures of their replies, in order."""
    now = time.monotonic()
    for k, call in enumerate(batch):
        reply = None if replies is None else replies[k]
        for part in call.parts or (call,):
            part.written = now
            part.reply = reply
        call.written, call.reply = now, reply


def _sliced(start: int, end: int, reply: Reply) -> Reply:
    """One part's slice of a merged call's reply (an error reply: the whole error)."""
    return reply if isinstance(reply, BaseException) or reply is UNKNOWN else reply[start:end]


def _deliver(call: Call, reply: Reply) -> None:
    if call.future.cancelled():
        return  # the caller has gone (the engine never cancels its store calls)
    if call.script.merge is not None and (message := call.script.merge.failure(reply)) is not None:
        reply = rx.ResponseError(message)  # this call failed alone inside a merged script call
    if isinstance(reply, BaseException):
        call.future.set_exception(wrap(reply) if isinstance(reply, CLIENT_ERRORS) else reply)
    else:
        call.future.set_result(reply)


def _merged(batch: list[Call]) -> list[Call]:
    """``batch`` with the calls of one merging script, one ``merge`` group and the same
    shared ARGV joined into one call, at the place of the group's first call."""
    out: list[Call | list[Call]] = []
    groups: dict[tuple[str, str, tuple[str | bytes, ...]], list[Call]] = {}
    for call in batch:
        spec = call.script.merge
        if call.merge is None or spec is None:
            out.append(call)
            continue
        key = (call.script.sha, call.merge, tuple(call.args[:spec.shared]))
        group = groups.get(key)
        if group is None:
            group = groups[key] = []
            out.append(group)
        group.append(call)
    return [item if isinstance(item, Call) else _joined(item) for item in out]


def _joined(parts: list[Call]) -> Call:
    first = parts[0]
    if len(parts) == 1:
        return first
    assert first.script.merge is not None
    shared = first.script.merge.shared
    return Call(first.script, [k for part in parts for k in part.keys],
                [*first.args[:shared], *(a for part in parts for a in part.args[shared:])],
                first.future.get_loop().create_future(), merge=first.merge, parts=parts)
