"""Corked writes: what one event-loop turn writes to a connection goes out as one
``transport.write`` (one ``send`` system call), at the start of the next turn.

Used by the HTTP authorization port (answers to pipelined requests decided in one turn; the
Redis connections were measured corked and are not: docs/design.md). Order is kept (one buffer per
connection, written whole); back-pressure is the transport's own (``pause_writing`` follows
the flushed write), and a turn adds at most what it produced to the buffer.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["Cork"]


class Cork:
    """The writes to ``transport`` in this loop turn, held until :meth:`flush` (scheduled
    with ``loop.call_soon`` by the turn's first write; call it at once before a close)."""

    __slots__ = ("_handle", "_loop", "_parts", "_transport")

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._parts: list[bytes] = []
        self._handle: asyncio.Handle | None = None

    def write(self, data: bytes, *, last: bool = False) -> None:
        """Hold ``data`` for this turn's write; ``last``: the writer knows nothing more
        follows in this turn, so it is written now with what is held (no flush scheduled:
        a lone answer costs what an uncorked write does)."""
        if last:
            if self._parts:
                self._parts.append(data)
                self.flush()
            elif not self._transport.is_closing():
                self._transport.write(data)
            return
        if not self._parts:
            self._handle = self._loop.call_soon(self.flush)
        self._parts.append(data)

    def flush(self) -> None:
        """Write what is held now (a closing transport drops it, as its ``write`` would)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        parts = self._parts
        if not parts:
            return
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def drop(self) -> None:
        """Forget what is held (the connection is gone or aborted)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._parts.clear()
