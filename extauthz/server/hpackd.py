"""A fast, bounded HPACK decoder (RFC 7541) for the gRPC port's request headers (issue 31).

The ``hpack`` library's ``Decoder.decode`` was ~40 % of the event-loop gRPC server's receive
path: a ``HeaderTuple`` and a ``logging.debug`` call per field, a memoryview slice and copy per
literal, Huffman decoded a nibble at a time with a flag test per nibble. This decoder reads a
header block in one method with the common cases inline (an indexed field below 127, a length
below 127), and decodes Huffman strings a byte at a time through a state table built once at
import (:data:`_NEXT`, :data:`_EMIT`: 257 states x 256 bytes), with a bounded cache of short
Huffman strings shared by the connections (:data:`_huffman_cache`, emptied when full: a plain
dict costs less per miss than ``functools.lru_cache``, and Envoy's unique ids miss on every
request; the hits are the constant values Envoy sends again after its encoder evicted them,
and on each new connection; never-indexed values, a client's secrets, are not cached).

Everything a peer controls is bounded: an integer takes at most 5 continuation bytes (as
``hpack``: values stay below 2**36) and each value is checked where it is used (an index
against the tables, a length against the bytes left, a table size against
:attr:`Decoder.max_allowed_table_size`); the decoded header list is bounded by
:attr:`Decoder.max_header_list_size` with RFC 9113's accounting (name + value + 32 per field),
so a large entry referenced many times (an HPACK bomb) stops at the bound. Huffman strings
follow RFC 7541 5.2: EOS in a string, padding longer than 7 bits, or padding not all ones is an
error. Every error is a :class:`HpackError` (``ValueError``) with a short reason: the caller
answers COMPRESSION_ERROR (RFC 9113 4.3); the decoding context is then unusable.

The gRPC port's connection (:mod:`extauthz.server.h2conn`) decodes every request header block
with it (:func:`~extauthz.server.h2conn.hpack_decoder`); an oversized list is
ENHANCE_YOUR_CALM there, any other error COMPRESSION_ERROR.
"""

from __future__ import annotations

from collections import deque

__all__ = ["Decoder", "HeaderListTooLarge", "HpackError", "TableSizeError", "clear_huffman_cache",
           "decode_huffman"]

#: RFC 9113 6.5.2 / RFC 7541 4.1: what a field costs in a header list and in the dynamic table
FIELD_OVERHEAD = 32
#: continuation bytes an integer may take (5 x 7 bits past the prefix: as the hpack library)
MAX_INT_CONTINUATIONS = 5
#: Huffman-encoded strings up to this many bytes go through the cache
CACHED_HUFFMAN_BYTES = 64
CACHED_HUFFMAN_STRINGS = 1024


class HpackError(ValueError):
    """A header block that cannot be decoded (a COMPRESSION_ERROR for the connection)."""


class HeaderListTooLarge(HpackError):
    """The decoded header list exceeds :attr:`Decoder.max_header_list_size`."""


class TableSizeError(HpackError):
    """A dynamic table size above :attr:`Decoder.max_allowed_table_size`."""


# RFC 7541 Appendix A; index 0 is unused (an indexed field of index 0 is an error)
STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = (
    (b"", b""),  # 0: not an index
    (b':authority', b''),  # 1
    (b':method', b'GET'),  # 2
    (b':method', b'POST'),  # 3
    (b':path', b'/'),  # 4
    (b':path', b'/index.html'),  # 5
    (b':scheme', b'http'),  # 6
    (b':scheme', b'https'),  # 7
    (b':status', b'200'),  # 8
    (b':status', b'204'),  # 9
    (b':status', b'206'),  # 10
    (b':status', b'304'),  # 11
    (b':status', b'400'),  # 12
    (b':status', b'404'),  # 13
    (b':status', b'500'),  # 14
    (b'accept-charset', b''),  # 15
    (b'accept-encoding', b'gzip, deflate'),  # 16
    (b'accept-language', b''),  # 17
    (b'accept-ranges', b''),  # 18
    (b'accept', b''),  # 19
    (b'access-control-allow-origin', b''),  # 20
    (b'age', b''),  # 21
    (b'allow', b''),  # 22
    (b'authorization', b''),  # 23
    (b'cache-control', b''),  # 24
    (b'content-disposition', b''),  # 25
    (b'content-encoding', b''),  # 26
    (b'content-language', b''),  # 27
    (b'content-length', b''),  # 28
    (b'content-location', b''),  # 29
    (b'content-range', b''),  # 30
    (b'content-type', b''),  # 31
    (b'cookie', b''),  # 32
    (b'date', b''),  # 33
    (b'etag', b''),  # 34
    (b'expect', b''),  # 35
    (b'expires', b''),  # 36
    (b'from', b''),  # 37
    (b'host', b''),  # 38
    (b'if-match', b''),  # 39
    (b'if-modified-since', b''),  # 40
    (b'if-none-match', b''),  # 41
    (b'if-range', b''),  # 42
    (b'if-unmodified-since', b''),  # 43
    (b'last-modified', b''),  # 44
    (b'link', b''),  # 45
    (b'location', b''),  # 46
    (b'max-forwards', b''),  # 47
    (b'proxy-authenticate', b''),  # 48
    (b'proxy-authorization', b''),  # 49
    (b'range', b''),  # 50
    (b'referer', b''),  # 51
    (b'refresh', b''),  # 52
    (b'retry-after', b''),  # 53
    (b'server', b''),  # 54
    (b'set-cookie', b''),  # 55
    (b'strict-transport-security', b''),  # 56
    (b'transfer-encoding', b''),  # 57
    (b'user-agent', b''),  # 58
    (b'vary', b''),  # 59
    (b'via', b''),  # 60
    (b'www-authenticate', b''),  # 61
)
_STATIC_LAST = len(STATIC_TABLE) - 1  # 61 (literal in :meth:`Decoder.decode`)
_STATIC_SIZES = tuple(len(n) + len(v) + FIELD_OVERHEAD for n, v in STATIC_TABLE)
assert _STATIC_LAST == 61

# RFC 7541 Appendix B: the code length of each symbol (256 is EOS). The code is canonical:
# codes are assigned in order of (length, symbol), which :func:`_huffman_codes` rebuilds.
_HUFFMAN_LENGTHS = bytes((
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28,
    28, 28, 28, 28, 28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5,
    5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, 15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6,
    6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, 20, 22, 20, 20, 22, 22, 22, 23, 22,
    23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24, 22,
    21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20,
    22, 22, 22, 23, 22, 22, 23, 26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, 19,
    21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, 20, 24, 20, 21, 22, 21, 21, 23, 22,
    22, 25, 25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26, 30,
))


def _huffman_codes() -> list[int]:
    codes = [0] * 257
    code = 0
    prev = 0
    for i, sym in enumerate(sorted(range(257), key=lambda s: (_HUFFMAN_LENGTHS[s], s))):
        length = _HUFFMAN_LENGTHS[sym]
        if i:
            code = (code + 1) << (length - prev)
        prev = length
        codes[sym] = code
    return codes


HUFFMAN_CODES = _huffman_codes()
_EOS = 256
_FAIL = 256  # the state after EOS was decoded: a sink, never accepting


def _huffman_tables() -> tuple[list[int], list[bytes], frozenset[int]]:
    """The byte-at-a-time decoding tables: for state ``s`` (an inner node of the code tree,
    0 the root) and input byte ``b``, at ``s << 8 | b``: the next state, pre-shifted by 8, and
    the bytes the byte completes. Built from a nibble-at-a-time tree walk, composed twice."""
    # the code tree: children[node] = [zero, one]; a leaf is ~symbol (negative)
    children: list[list[int]] = [[0, 0]]
    for sym in range(257):
        code, length = HUFFMAN_CODES[sym], _HUFFMAN_LENGTHS[sym]
        node = 0
        for bit in range(length - 1, 0, -1):
            b = (code >> bit) & 1
            if not children[node][b]:
                children.append([0, 0])
                children[node][b] = len(children) - 1
            node = children[node][b]
        children[node][code & 1] = ~sym
    assert len(children) == 256  # a complete code of 257 symbols has 256 inner nodes
    nib_next = [0] * (257 * 16)
    nib_emit: list[bytes] = [b""] * (257 * 16)
    for state in range(256):
        for nibble in range(16):
            node, out = state, bytearray()
            for bit in range(3, -1, -1):
                if node == _FAIL:
                    break
                child = children[node][(nibble >> bit) & 1]
                if child < 0:
                    if ~child == _EOS:
                        node = _FAIL
                        continue
                    out.append(~child)
                    node = 0
                else:
                    node = child
            nib_next[state * 16 + nibble] = node
            nib_emit[state * 16 + nibble] = bytes(out)
    for nibble in range(16):
        nib_next[_FAIL * 16 + nibble] = _FAIL
    interned: dict[bytes, bytes] = {}
    nxt = [0] * (257 * 256)
    emit: list[bytes] = [b""] * (257 * 256)
    for state in range(257):
        for byte in range(256):
            i = state * 16 + (byte >> 4)
            mid = nib_next[i]
            j = mid * 16 + (byte & 15)
            both = nib_emit[i] + nib_emit[j]
            nxt[state << 8 | byte] = nib_next[j] << 8
            emit[state << 8 | byte] = interned.setdefault(both, both)
    # accepting states: the root and the inner nodes reached by up to 7 one bits (padding)
    accept = {0}
    node = 0
    for _ in range(7):
        node = children[node][1]
        accept.add(node << 8)
    return nxt, emit, frozenset(accept)


_NEXT, _EMIT, _ACCEPT = _huffman_tables()


def decode_huffman(data: bytes) -> bytes:
    """``data`` Huffman-decoded (RFC 7541 5.2), or :class:`HpackError`."""
    nxt, emit = _NEXT, _EMIT
    state = 0
    out: list[bytes] = []
    append = out.append
    for byte in data:
        i = state | byte
        append(emit[i])
        state = nxt[i]
    if state not in _ACCEPT:
        raise HpackError("Huffman string with EOS" if state == _FAIL << 8
                         else "Huffman string padded with more than 7 bits or not with ones")
    return b"".join(out)


#: short Huffman strings decoded, shared by every connection; emptied when full
_huffman_cache: dict[bytes, bytes] = {}


def clear_huffman_cache() -> None:
    """Empty the cache of decoded Huffman strings (benchmarks start from it empty)."""
    _huffman_cache.clear()


def _string(block: bytes, pos: int, end: int, cached: bool = True) -> tuple[bytes, int]:
    """The string literal at ``pos`` (RFC 7541 5.2) and the position after it; a Huffman
    string through the shared cache unless not ``cached``."""
    if pos >= end:
        raise HpackError("truncated header block")
    first = block[pos]
    length = first & 0x7F
    pos += 1
    if length == 0x7F:
        length, pos = _integer(block, pos, end, 0x7F)
    stop = pos + length
    if stop > end:
        raise HpackError("string longer than the header block")
    raw = block[pos:stop]
    if first & 0x80:
        if not cached:
            return decode_huffman(raw), stop
        cache = _huffman_cache
        text = cache.get(raw)
        if text is None:
            text = decode_huffman(raw)
            if length <= CACHED_HUFFMAN_BYTES:
                if len(cache) >= CACHED_HUFFMAN_STRINGS:
                    cache.clear()
                cache[raw] = text
        raw = text
    return raw, stop


def _integer(block: bytes, pos: int, end: int, value: int) -> tuple[int, int]:
    """The continuation of an integer whose prefix was full (``value``: the prefix maximum),
    from ``pos``; at most :data:`MAX_INT_CONTINUATIONS` bytes (RFC 7541 5.1)."""
    shift = 0
    for _ in range(MAX_INT_CONTINUATIONS):
        if pos >= end:
            raise HpackError("truncated integer")
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise HpackError("integer longer than 5 continuation bytes")


class Decoder:
    """One HTTP/2 connection's HPACK decoding context (RFC 7541): the dynamic table and its
    bounds. :meth:`decode` takes one whole header block (HEADERS and its CONTINUATIONs)."""

    def __init__(self, max_header_list_size: int = 65536, max_allowed_table_size: int = 4096) -> None:
        #: the largest decoded header list accepted (RFC 9113: name + value + 32 per field)
        self.max_header_list_size = max_header_list_size
        #: our SETTINGS_HEADER_TABLE_SIZE: a table size update above it is an error, and so is
        #: a block that leaves the table larger (the peer must shrink it after our SETTINGS)
        self.max_allowed_table_size = max_allowed_table_size
        self._max_size = 4096  # the dynamic table's maximum now (RFC 7541 4.2)
        self._size = 0  # the dynamic table's size now (RFC 7541 4.1)
        #: the dynamic table, newest first (index 62 is ``_table[0]``)
        self._table: deque[tuple[bytes, bytes]] = deque()

    @property
    def header_table_size(self) -> int:
        """The dynamic table's maximum size now (set by the peer's size updates)."""
        return self._max_size

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        self._max_size = value
        self._evict(0)

    @property
    def table(self) -> list[tuple[bytes, bytes]]:
        """The dynamic table's entries, newest first (a copy)."""
        return list(self._table)

    @property
    def table_bytes(self) -> int:
        """The dynamic table's size (RFC 7541 4.1: name + value + 32 per entry)."""
        return self._size

    def _evict(self, room: int) -> None:
        table = self._table
        size = self._size
        limit = self._max_size - room
        while size > limit and table:
            name, value = table.pop()
            size -= len(name) + len(value) + FIELD_OVERHEAD
        self._size = size

    def _add(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value) + FIELD_OVERHEAD
        if size > self._max_size:  # RFC 7541 4.4: the table is emptied, the entry not added
            self._table.clear()
            self._size = 0
            return
        self._evict(size)
        self._table.appendleft((name, value))
        self._size += size

    def _field(self, index: int) -> tuple[bytes, bytes]:
        if index <= _STATIC_LAST:
            if index == 0:
                raise HpackError("index 0")
            return STATIC_TABLE[index]
        i = index - _STATIC_LAST - 1
        table = self._table
        if i >= len(table):
            raise HpackError(f"index {index} past the dynamic table")
        return table[i]

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """The header list of one header block, in order, names and values as bytes."""
        if type(block) is not bytes:
            block = bytes(block)
        headers: list[tuple[bytes, bytes]] = []
        append = headers.append
        static = STATIC_TABLE
        static_sizes = _STATIC_SIZES
        table = self._table
        limit = self.max_header_list_size
        listed = 0
        pos = 0
        end = len(block)
        while pos < end:
            first = block[pos]
            pos += 1
            if first & 0x80:  # 6.1 indexed field
                index = first & 0x7F
                if index == 0x7F:
                    index, pos = _integer(block, pos, end, 0x7F)
                if index <= 61:
                    if not index:
                        raise HpackError("index 0")
                    field = static[index]
                    listed += static_sizes[index]
                else:
                    try:
                        field = table[index - 62]
                    except IndexError:
                        raise HpackError(f"index {index} past the dynamic table") from None
                    listed += len(field[0]) + len(field[1]) + 32
                if listed > limit:
                    raise HeaderListTooLarge(f"header list larger than {limit} bytes")
                append(field)
                continue
            if first & 0x40:  # 6.2.1 literal with incremental indexing
                index = first & 0x3F
                if index == 0x3F:
                    index, pos = _integer(block, pos, end, 0x3F)
            elif first & 0x20:  # 6.3 dynamic table size update
                if headers:
                    raise HpackError("table size update after a field")
                size = first & 0x1F
                if size == 0x1F:
                    size, pos = _integer(block, pos, end, 0x1F)
                if size > self.max_allowed_table_size:
                    raise TableSizeError(f"table size update to {size}, above {self.max_allowed_table_size}")
                self.header_table_size = size
                continue
            else:  # 6.2.2 without indexing, 6.2.3 never indexed
                index = first & 0x0F
                if index == 0x0F:
                    index, pos = _integer(block, pos, end, 0x0F)
            if index:
                name = self._field(index)[0]
            else:
                name, pos = _string(block, pos, end)
            # a never-indexed value (RFC 7541 6.2.3: a client's secret) stays out of the cache
            # shared by the connections: another connection could time its hits
            value, pos = _string(block, pos, end, first & 0xF0 != 0x10)
            field = (name, value)
            if first & 0x40:
                self._add(name, value)
            listed += len(name) + len(value) + 32
            if listed > limit:
                raise HeaderListTooLarge(f"header list larger than {limit} bytes")
            append(field)
        if self._max_size > self.max_allowed_table_size:
            raise TableSizeError(f"table size {self._max_size} above {self.max_allowed_table_size}")
        return headers
