"""server/hpackd.py, the HPACK decoder: RFC 7541's Appendix C examples (fields and the dynamic
table after each block), every error path, the bounds (an HPACK bomb, an oversized table
size update), and a differential fuzz test against the ``hpack`` library's
decoder (random blocks from its Encoder and built field by field, and random mutations of
them: the same fields and table, or both refuse)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hpack
import pytest
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.table import HeaderTable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extauthz.server import hpackd
from extauthz.server.hpackd import (
    HUFFMAN_CODES,
    STATIC_TABLE,
    Decoder,
    HeaderListTooLarge,
    HpackError,
    TableSizeError,
    decode_huffman,
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HUFFMAN = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)


def unhex(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", ""))


def fields(*pairs: tuple[str, str]) -> list[tuple[bytes, bytes]]:
    return [(n.encode(), v.encode()) for n, v in pairs]


def table_size(table: list[tuple[bytes, bytes]]) -> int:
    return sum(len(n) + len(v) + 32 for n, v in table)


# -- the tables: RFC 7541 Appendices A and B as the hpack library holds them


def test_static_table_is_the_rfcs() -> None:
    assert list(STATIC_TABLE[1:]) == list(HeaderTable.STATIC_TABLE)


def test_huffman_codes_are_the_rfcs() -> None:
    assert list(REQUEST_CODES) == HUFFMAN_CODES


@pytest.mark.parametrize(("encoded", "text"), [
    ("f1e3 c2e5 f23a 6ba0 ab90 f4ff", "www.example.com"),
    ("a8eb 1064 9cbf", "no-cache"),
    ("25a8 49e9 5ba9 7d7f", "custom-key"),
    ("25a8 49e9 5bb8 e8b4 bf", "custom-value"),
    ("6402", "302"),
    ("aec3 771a 4b", "private"),
    ("d07a be94 1054 d444 a820 0595 040b 8166 e082 a62d 1bff", "Mon, 21 Oct 2013 20:13:21 GMT"),
    ("9d29 ad17 1863 c78f 0b97 c8e9 ae82 ae43 d3", "https://www.example.com"),
    ("9bd9 ab", "gzip"),
    ("", ""),
])
def test_huffman_rfc_strings(encoded: str, text: str) -> None:
    assert decode_huffman(unhex(encoded)) == text.encode()


@given(st.binary(max_size=300))
@SETTINGS
def test_huffman_every_byte_round_trips(raw: bytes) -> None:
    assert decode_huffman(HUFFMAN.encode(raw)) == raw


# -- RFC 7541 Appendix C: each block's fields and the dynamic table after it (newest first)


@pytest.mark.parametrize(("encoded", "want", "table"), [
    ("400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572",  # C.2.1
     fields(("custom-key", "custom-header")), fields(("custom-key", "custom-header"))),
    ("040c 2f73 616d 706c 652f 7061 7468", fields((":path", "/sample/path")), []),  # C.2.2
    ("1008 7061 7373 776f 7264 0673 6563 7265 74", fields(("password", "secret")), []),  # C.2.3
    ("82", fields((":method", "GET")), []),  # C.2.4
])
def test_rfc_c2_one_field(encoded: str, want: list[tuple[bytes, bytes]],
                          table: list[tuple[bytes, bytes]]) -> None:
    decoder = Decoder()
    assert decoder.decode(unhex(encoded)) == want
    assert decoder.table == table
    assert decoder.table_bytes == table_size(table)


_REQ1 = fields((":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com"))
_REQ2 = [*_REQ1, (b"cache-control", b"no-cache")]
_REQ3 = fields((":method", "GET"), (":scheme", "https"), (":path", "/index.html"),
               (":authority", "www.example.com"), ("custom-key", "custom-value"))
_REQ_TABLES = [
    fields((":authority", "www.example.com")),
    fields(("cache-control", "no-cache"), (":authority", "www.example.com")),
    fields(("custom-key", "custom-value"), ("cache-control", "no-cache"), (":authority", "www.example.com")),
]
_RESP1 = fields((":status", "302"), ("cache-control", "private"), ("date", "Mon, 21 Oct 2013 20:13:21 GMT"),
                ("location", "https://www.example.com"))
_RESP2 = [(b":status", b"307"), *_RESP1[1:]]
_RESP3 = fields((":status", "200"), ("cache-control", "private"), ("date", "Mon, 21 Oct 2013 20:13:22 GMT"),
                ("location", "https://www.example.com"), ("content-encoding", "gzip"),
                ("set-cookie", "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"))
_RESP_TABLES = [
    fields(("location", "https://www.example.com"), ("date", "Mon, 21 Oct 2013 20:13:21 GMT"),
           ("cache-control", "private"), (":status", "302")),
    fields((":status", "307"), ("location", "https://www.example.com"),
           ("date", "Mon, 21 Oct 2013 20:13:21 GMT"), ("cache-control", "private")),
    fields(("set-cookie", "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"),
           ("content-encoding", "gzip"), ("date", "Mon, 21 Oct 2013 20:13:22 GMT")),
]
RFC_SEQUENCES = {
    "C.3": (4096, [
        "8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
        "8286 84be 5808 6e6f 2d63 6163 6865",
        "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65",
    ], [_REQ1, _REQ2, _REQ3], _REQ_TABLES, [57, 110, 164]),
    "C.4": (4096, [
        "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",
        "8286 84be 5886 a8eb 1064 9cbf",
        "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
    ], [_REQ1, _REQ2, _REQ3], _REQ_TABLES, [57, 110, 164]),
    "C.5": (256, [
        "4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a"
        " 3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
        "4803 3330 37c1 c0bf",
        "88c1 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3220 474d 54c0 5a04"
        " 677a 6970 7738 666f 6f3d 4153 444a 4b48 514b 425a 584f 5157 454f 5049 5541 5851 5745 4f49"
        " 553b 206d 6178 2d61 6765 3d33 3630 303b 2076 6572 7369 6f6e 3d31",
    ], [_RESP1, _RESP2, _RESP3], _RESP_TABLES, [222, 222, 215]),
    "C.6": (256, [
        "4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0 82a6 2d1b ff6e"
        " 919d 29ad 1718 63c7 8f0b 97c8 e9ae 82ae 43d3",
        "4883 640e ffc1 c0bf",
        "88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b d9ab 77ad 94e7"
        " 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f 9587 3160 65c0 03ed"
        " 4ee5 b106 3d50 07",
    ], [_RESP1, _RESP2, _RESP3], _RESP_TABLES, [222, 222, 215]),
}


@pytest.mark.parametrize("section", sorted(RFC_SEQUENCES))
def test_rfc_sequences(section: str) -> None:
    """C.3-C.6: three blocks on one decoder; C.5 and C.6 with a 256-byte table (evictions)."""
    size, blocks, wants, tables, sizes = RFC_SEQUENCES[section]
    decoder = Decoder(max_allowed_table_size=size)
    decoder.header_table_size = size
    for block, want, table, nbytes in zip(blocks, wants, tables, sizes, strict=True):
        assert decoder.decode(unhex(block)) == want
        assert decoder.table == table
        assert decoder.table_bytes == nbytes == table_size(table)


# -- errors: each a HpackError with its reason


def raises(block: bytes, match: str, decoder: Decoder | None = None, kind: type[HpackError] = HpackError) -> None:
    with pytest.raises(kind, match=match):
        (decoder or Decoder()).decode(block)


def test_index_zero() -> None:
    raises(b"\x80", "index 0")


def test_index_past_the_tables() -> None:
    raises(b"\xbe", "index 62 past the dynamic table")  # 62: the dynamic table is empty
    decoder = Decoder()
    decoder.decode(unhex("400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572"))
    assert decoder.decode(b"\xbe") == fields(("custom-key", "custom-header"))
    raises(b"\xbf", "index 63 past", decoder)


def test_literal_name_index_past_the_tables() -> None:
    raises(b"\x7e\x01a", "index 62 past")  # incremental indexing, name index 62
    raises(b"\x0f\x2f\x01a", "index 62 past")  # without indexing, name index 15 + 47
    raises(b"\x1f\x2f\x01a", "index 62 past")  # never indexed


def test_truncated_integer() -> None:
    raises(b"\xff", "truncated integer")
    raises(b"\xff\x80\x80", "truncated integer")


def test_integer_bounded_in_length() -> None:
    """Five continuation bytes at most (so at most 2**35 past the prefix): a sixth is an
    error even if its value is 0, and the largest value is then refused where it is used."""
    raises(b"\xff\x80\x80\x80\x80\x80\x00", "integer longer than 5 continuation bytes")
    raises(b"\xff\x80\x80\x80\x80\x00", "index 127 past")  # 5 bytes of zeros: accepted as 127
    raises(b"\xff\xff\xff\xff\xff\x7f", f"index {127 + 2**35 - 1} past")


def test_truncated_strings() -> None:
    raises(b"\x40", "truncated header block")  # no name length
    raises(b"\x40\x03ab", "string longer than the header block")
    raises(b"\x40\x01a", "truncated header block")  # no value
    raises(b"\x40\x01a\x05abc", "string longer than the header block")
    raises(b"\x04\x7f\xff\xff\xff\xff\x0f", "string longer than the header block")  # ~2**35


def test_huffman_eos_in_a_string() -> None:
    raises(b"\x04\x84\xff\xff\xff\xff", "Huffman string with EOS")  # 30 ones: EOS
    with pytest.raises(HpackError, match="EOS"):
        decode_huffman(b"\x1f\xff\xff\xff\xff")  # 'a' 00011 then EOS then padding


def test_huffman_padding_longer_than_7_bits() -> None:
    assert decode_huffman(b"\x1f") == b"a"  # 00011 + 111
    with pytest.raises(HpackError, match="more than 7 bits"):
        decode_huffman(b"\x1f\xff")  # 11 bits of padding
    with pytest.raises(HpackError, match="more than 7 bits"):
        decode_huffman(b"\xff")  # a byte of padding alone


def test_huffman_padding_not_ones() -> None:
    with pytest.raises(HpackError, match="not with ones"):
        decode_huffman(b"\x18")  # 'a' 00011 then 000
    raises(b"\x04\x81\x18", "not with ones")


def test_table_size_update_after_a_field() -> None:
    raises(b"\x82\x3f\xe1\x1f", "table size update after a field")


def test_oversized_table_size_update_refused() -> None:
    decoder = Decoder(max_allowed_table_size=4096)
    raises(b"\x3f\xe2\x1f", "table size update to 4097, above 4096", decoder, TableSizeError)  # 31 + 4066
    decoder = Decoder(max_allowed_table_size=100)
    decoder.header_table_size = 100
    raises(b"\x3f\x46", "table size update to 101", decoder, TableSizeError)


def test_table_size_updates_at_the_start() -> None:
    """Updates (two here, RFC 7541 4.2) at a block's start set the size and evict."""
    decoder = Decoder()
    decoder.decode(unhex("400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572"))
    assert decoder.table_bytes == 55
    assert decoder.decode(b"\x20\x3f\x11\x82") == fields((":method", "GET"))  # 0, then 48
    assert decoder.header_table_size == 48
    assert decoder.table == []
    decoder.decode(b"\x40\x01a\x01b")  # 34 bytes: fits
    assert decoder.table == [(b"a", b"b")]
    decoder.decode(b"\x40\x02aa\x02bb")  # 36: evicts the first
    assert decoder.table == [(b"aa", b"bb")]
    decoder.decode(b"\x40\x0a" + b"c" * 10 + b"\x01d")  # 43: evicts the other
    assert decoder.table == [(b"c" * 10, b"d")]
    decoder.decode(b"\x40\x08" + b"c" * 8 + b"\x08" + b"d" * 8)  # 48: the whole table
    assert decoder.table == [(b"c" * 8, b"d" * 8)] and decoder.table_bytes == 48
    decoder.decode(b"\x40\x08" + b"c" * 8 + b"\x09" + b"d" * 9)  # 49 > 48: empties the table
    assert decoder.table == [] and decoder.table_bytes == 0


def test_table_must_shrink_to_a_lowered_bound() -> None:
    """After our SETTINGS lower the bound, the next block must shrink the table (4.2)."""
    decoder = Decoder()
    decoder.max_allowed_table_size = 1024
    raises(b"\x82", "table size 4096 above 1024", decoder, TableSizeError)
    decoder = Decoder()
    decoder.max_allowed_table_size = 1024
    assert decoder.decode(b"\x3f\xe1\x07\x82") == fields((":method", "GET"))  # 1024
    assert decoder.header_table_size == 1024


def test_header_list_bound() -> None:
    """RFC 9113's accounting: name + value + 32 per field."""
    block = b"\x82\x86\x84"  # :method GET (42), :scheme http (43), :path / (38): 123 bytes
    assert Decoder(max_header_list_size=123).decode(block) == fields(
        (":method", "GET"), (":scheme", "http"), (":path", "/"))
    raises(block, "header list larger than 122 bytes", Decoder(max_header_list_size=122), HeaderListTooLarge)


def test_hpack_bomb_stopped() -> None:
    """A 4 KiB entry put in the table once and referenced 16,000 times (a 16 KiB block that
    would decode to 64 MB): refused at the bound, after a handful of references."""
    big = b"x" * 4000
    block = b"\x40\x01b" + _string(big, False) + b"\xbe" * 16000
    assert len(block) < 20100
    decoder = Decoder(max_header_list_size=16384)
    with pytest.raises(HeaderListTooLarge, match="larger than 16384"):
        decoder.decode(block)
    assert decoder.table == [(b"b", big)]  # the entry went in; the references were refused


def test_never_indexed_values_stay_out_of_the_shared_cache() -> None:
    """The Huffman cache is shared by the connections: a value sent never indexed (a secret)
    must not be in it, where another connection could time a hit; other values are."""
    hpackd.clear_huffman_cache()
    secret, plain = HUFFMAN.encode(b"Bearer s3cret-token"), HUFFMAN.encode(b"application/grpc")
    block = b"\x1f\x08" + _string_of(secret) + b"\x0f\x10" + _string_of(plain)  # authorization, content-type
    assert Decoder().decode(block) == fields(("authorization", "Bearer s3cret-token"),
                                             ("content-type", "application/grpc"))
    assert secret not in hpackd._huffman_cache
    assert hpackd._huffman_cache[plain] == b"application/grpc"


def _string_of(huffman: bytes) -> bytes:
    return bytes([0x80 | len(huffman)]) + huffman


def test_empty_block_and_bytes_like_input() -> None:
    assert Decoder().decode(b"") == []
    assert Decoder().decode(bytearray(b"\x82")) == fields((":method", "GET"))  # type: ignore[arg-type]
    assert Decoder().decode(memoryview(b"\x82")) == fields((":method", "GET"))  # type: ignore[arg-type]


# -- differential: the hpack library's decoder and this one, on the same blocks

TOKENS = st.sampled_from([b"content-type", b"x-request-id", b"grpc-timeout", b"te", b":path", b"authorization",
                          b"x-api-key", b"cookie", b"user-agent", b"x-b3-traceid", b"a", b""])
NAMES = st.one_of(TOKENS, st.binary(max_size=40))
VALUES = st.one_of(st.sampled_from([b"", b"trailers", b"application/grpc", b"200m", b"POST"]),
                   st.binary(max_size=80), st.binary(min_size=100, max_size=400))


@st.composite
def encoder_blocks(draw: Callable[..., Any]) -> list[bytes]:
    """A connection's blocks from hpack's Encoder: random fields (indexed, never indexed),
    Huffman or not, table size changes between blocks."""
    encoder = hpack.Encoder()
    blocks = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()) and draw(st.booleans()):
            encoder.header_table_size = draw(st.sampled_from([0, 64, 256, 1000, 4096]))
        headers = []
        for _ in range(draw(st.integers(0, 12))):
            cls = hpack.NeverIndexedHeaderTuple if draw(st.integers(0, 4)) == 0 else hpack.HeaderTuple
            headers.append(cls(draw(NAMES), draw(VALUES)))
        blocks.append(encoder.encode(headers, huffman=draw(st.booleans())))
    return blocks


def _integer(value: int, prefix: int, first: int) -> bytes:
    out = hpack.hpack.encode_integer(value, prefix)
    out[0] |= first
    return bytes(out)


def _string(raw: bytes, huffman: bool) -> bytes:
    if huffman:
        raw = HUFFMAN.encode(raw)
    return _integer(len(raw), 7, 0x80 if huffman else 0) + raw


@st.composite
def built_blocks(draw: Callable[..., Any]) -> list[bytes]:
    """Blocks built representation by representation (RFC 7541 6): indexed fields of any
    index (some past the table), the three literal forms with an indexed or a literal name,
    table size updates (some at the start, some not, some above the bound)."""
    blocks = []
    index = st.one_of(st.integers(0, 70), st.integers(0, 300))
    for _ in range(draw(st.integers(1, 5))):
        out = b""
        if draw(st.integers(0, 3)) == 0:
            out += _integer(draw(st.sampled_from([0, 100, 4096, 4097, 300])), 5, 0x20)
        for _ in range(draw(st.integers(0, 10))):
            kind = draw(st.integers(0, 4))
            if kind == 0:
                out += _integer(draw(index), 7, 0x80)
            elif kind == 4:
                out += _integer(draw(st.sampled_from([0, 50, 4096])), 5, 0x20)  # mid-block
            else:
                prefix, first = {1: (6, 0x40), 2: (4, 0x00), 3: (4, 0x10)}[kind]
                name_index = draw(index) if draw(st.booleans()) else 0
                out += _integer(name_index, prefix, first)
                if not name_index:
                    out += _string(draw(NAMES), draw(st.booleans()))
                out += _string(draw(VALUES), draw(st.booleans()))
        blocks.append(out)
    return blocks


def _mutate(block: bytes, data: st.DataObject) -> bytes:
    if not block:
        return bytes(data.draw(st.binary(max_size=4)))
    out = bytearray(block)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(out) - 1)) if out else 0
        how = data.draw(st.integers(0, 3))
        if how == 0 and out:
            out[at] ^= 1 << data.draw(st.integers(0, 7))
        elif how == 1 and out:
            out[at] = data.draw(st.integers(0, 255))
        elif how == 2:
            out[at:at] = data.draw(st.binary(min_size=1, max_size=3))
        else:
            del out[at:]
    return bytes(out)


def _compare(blocks: list[bytes], limit: int = 65536, allowed: int = 4096) -> int:
    """Both decoders over ``blocks`` in order: the same fields and table after each block, or
    both raise on the same block (and nothing after it is decoded). The number decoded."""
    theirs = hpack.Decoder(max_header_list_size=limit)
    theirs.max_allowed_table_size = allowed
    ours = Decoder(max_header_list_size=limit, max_allowed_table_size=allowed)
    for n, block in enumerate(blocks):
        try:
            want = [(bytes(k), bytes(v)) for k, v in theirs.decode(block, raw=True)]
        except hpack.HPACKError as exc:
            with pytest.raises(HpackError):
                ours.decode(block)
            if isinstance(exc, hpack.OversizedHeaderListError):
                with pytest.raises(HeaderListTooLarge):
                    Decoder(max_header_list_size=limit, max_allowed_table_size=allowed).decode(block)
            return n
        assert ours.decode(block) == want
        assert ours.table == list(theirs.header_table.dynamic_entries)
        assert ours.table_bytes == theirs.header_table._current_size
        assert ours.header_table_size == theirs.header_table_size
    return len(blocks)


@given(encoder_blocks())
@SETTINGS
def test_differential_encoder_blocks(blocks: list[bytes]) -> None:
    assert _compare(blocks) == len(blocks)  # the Encoder's blocks are all valid


@given(built_blocks(), st.sampled_from([300, 4096, 65536]))
@SETTINGS
def test_differential_built_blocks(blocks: list[bytes], limit: int) -> None:
    _compare(blocks, limit)


@given(st.one_of(encoder_blocks(), built_blocks()), st.data())
@SETTINGS
def test_differential_mutated_blocks(blocks: list[bytes], data: st.DataObject) -> None:
    at = data.draw(st.integers(0, len(blocks) - 1))
    blocks[at] = _mutate(blocks[at], data)
    _compare(blocks)


@given(st.binary(max_size=60))
@SETTINGS
def test_differential_huffman_strings(raw: bytes) -> None:
    """Any bytes as a Huffman string: the same text, or both refuse (EOS, bad padding)."""
    block = b"\x00\x00" + _integer(len(raw), 7, 0x80) + raw
    _compare([block])
