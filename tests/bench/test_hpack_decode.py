"""bench/hpack_decode.py: the blocks are Envoy's Check request headers as the bench says (a
unique id per request), both decoders read them the same, and the script prints a row per
shape. No timing assertions."""

from __future__ import annotations

import hpack
import pytest

from bench.hpack_decode import DECODERS, blocks, envoy_headers, main, run
from extauthz.server import hpackd


@pytest.mark.parametrize("n", [10, 12, 14])
def test_envoy_headers(n: int) -> None:
    first, second = envoy_headers(n, 0), envoy_headers(n, 1)
    assert len(first) == n
    assert (b":path", b"/envoy.service.auth.v3.Authorization/Check") in first
    assert dict(first)[b"x-request-id"] != dict(second)[b"x-request-id"]
    assert [k for k, _ in first] == [k for k, _ in second]


def test_envoy_headers_refuses_other_counts() -> None:
    with pytest.raises(ValueError, match="10 to 14"):
        envoy_headers(9, 0)


def test_both_decoders_read_the_blocks_back() -> None:
    seq = blocks(60, 14)
    want = [envoy_headers(14, i) for i in range(60)]
    for make in DECODERS.values():
        assert run(make, [], seq, 1, False)[1] == want
    firsts = [hpack.Encoder().encode(envoy_headers(14, i)) for i in range(3)]
    assert run(hpackd.Decoder, [], firsts, 2, True)[1] == want[:3]  # each on a new decoder


def test_main_prints_a_row_per_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--blocks", "20", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    for shape in ("steady", "first", "indexed"):
        assert shape in out
