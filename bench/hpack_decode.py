"""HPACK decoding of Envoy's ext_authz Check request headers: the ``hpack`` library's
``Decoder`` against server/hpackd.py's (issue 31: the library was ~40 % of the event-loop gRPC
server's receive path).

The header blocks are what Envoy sends on one connection to the authorization cluster: the
same headers on every ``Check`` (``--headers`` of them, 10 to 14: the pseudo-headers,
``content-type``, ``te``, ``grpc-timeout``, Envoy's own ``x-envoy-*``, ...), with an
``x-request-id`` unique per request (and with 14 headers a ``traceparent`` unique per request
too), encoded by ``hpack``'s ``Encoder`` as Envoy's encoder does it: every field indexed
incrementally, strings Huffman-coded, one dynamic table of 4,096 bytes for the connection. So
after the first block each block is a few one-byte indexed fields and one or two Huffman
literals, and the unique ids slowly evict each other from the table.

Three shapes, per block, each decoder on its own fresh context:

  steady      ``--blocks`` blocks of one connection in order (the common case)
  first       the first block of a connection (every field a literal, each on a new decoder),
              ``--blocks`` connections: hpackd's Huffman cache holds the values that do not
              change between connections (all but the ids)
  indexed     a block of indexed fields only (what a client with constant headers sends:
              h2load in bench/grpc_floor.py)

Figures: microseconds per block, the minimum over ``--rounds`` interleaved rounds (the
machine is shared: the minimum is the least disturbed), and the ratio to ``hpack``. The
decoders' outputs are compared first (the same fields), so a figure is never of a wrong
answer.

    python -m bench.hpack_decode [--blocks 2000] [--rounds 7] [--headers 12]
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Callable

import hpack

from extauthz.server import hpackd

CHECK_PATH = b"/envoy.service.auth.v3.Authorization/Check"


def envoy_headers(n: int, i: int) -> list[tuple[bytes, bytes]]:
    """The ``i``-th Check request's headers as Envoy's gRPC client sends them (``n``: 10-14)."""
    if not 10 <= n <= 14:
        raise ValueError("--headers is 10 to 14")
    rid = uuid.UUID(int=(0x9D3C2F8E << 96) + i * 2654435761, version=4)
    headers = [
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", CHECK_PATH),
        (b":authority", b"ext_authz"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
        (b"grpc-timeout", b"250m"), (b"x-envoy-internal", b"true"),
        (b"x-request-id", str(rid).encode()),
        (b"x-envoy-expected-rq-timeout-ms", b"250"),
    ]
    extra = [(b"x-forwarded-for", b"10.42.0.17"), (b"user-agent", b"envoy/1.40.0"),
             (b"x-envoy-downstream-service-cluster", b"ingress")]
    headers += extra[:min(n - 10, 3)]
    if n == 14:
        headers.append((b"traceparent", f"00-{rid.hex}-{i:016x}-01".encode()))
    return headers


def blocks(n_blocks: int, n_headers: int) -> list[bytes]:
    encoder = hpack.Encoder()
    return [encoder.encode(envoy_headers(n_headers, i), huffman=True) for i in range(n_blocks)]


class _Hpack:
    """The ``hpack`` library's decoder with the call h2 makes (``raw=True``)."""

    def __init__(self) -> None:
        self.decoder = hpack.Decoder()

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        return [(bytes(n), bytes(v)) for n, v in self.decoder.decode(block, raw=True)]


DECODERS: dict[str, Callable[[], _Hpack | hpackd.Decoder]] = {"hpack": _Hpack, "hpackd": hpackd.Decoder}


def run(make: Callable[[], _Hpack | hpackd.Decoder], prime: list[bytes], seq: list[bytes],
        repeat: int, fresh: bool) -> tuple[float, list[list[tuple[bytes, bytes]]]]:
    """Microseconds per block of ``seq`` (``repeat`` times over) on a decoder that decoded
    ``prime`` first (``fresh``: a new decoder for each block, its making timed too), and the
    last pass's fields. hpackd's Huffman cache starts empty: no block is a repeat of one it
    saw in an earlier run."""
    hpackd.clear_huffman_cache()
    decoder = make()
    for block in prime:
        decoder.decode(block)
    out: list[list[tuple[bytes, bytes]]] = []
    t0 = time.perf_counter()
    for _ in range(repeat):
        out = [(make() if fresh else decoder).decode(block) for block in seq]
    return (time.perf_counter() - t0) / (repeat * len(seq)) * 1e6, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--headers", type=int, default=12)
    args = ap.parse_args(argv)
    if args.blocks < 2 or args.rounds < 1:
        ap.error("--blocks is at least 2, --rounds at least 1")
    try:
        steady = blocks(args.blocks, args.headers)
    except ValueError as exc:
        ap.error(str(exc))
    # the same headers again: now every field is in the table (one byte each)
    again = hpack.Encoder()
    first = again.encode(envoy_headers(args.headers, 0))
    shapes = {  # prime, timed blocks, repeats, a fresh decoder for each repeat
        "steady": ([], steady, 1, False),
        "first": ([], [hpack.Encoder().encode(envoy_headers(args.headers, i)) for i in range(args.blocks)],
                  1, True),
        "indexed": ([first], [again.encode(envoy_headers(args.headers, 0))], args.blocks, False),
    }
    for prime, seq, _, fresh in shapes.values():
        answers = [run(make, prime, seq, 1, fresh)[1] for make in DECODERS.values()]
        if answers[0] != answers[1]:
            print("the decoders disagree", file=sys.stderr)
            return 1
    best = {(s, d): float("inf") for s in shapes for d in DECODERS}
    for _ in range(args.rounds):
        for shape, (prime, seq, repeat, fresh) in shapes.items():
            for name, make in DECODERS.items():
                best[shape, name] = min(best[shape, name], run(make, prime, seq, repeat, fresh)[0])
    print(f"HPACK decoding, Envoy Check request headers ({args.headers} fields, "
          f"x-request-id unique), us per block, min of {args.rounds} rounds")
    print(f"{'shape':<10} {'bytes/block':>11} {'hpack':>8} {'hpackd':>8} {'ratio':>7}")
    for shape, (_, seq, _, _) in shapes.items():
        size = sum(map(len, seq)) / len(seq)
        a, b = best[shape, "hpack"], best[shape, "hpackd"]
        print(f"{shape:<10} {size:>11.1f} {a:>8.2f} {b:>8.2f} {b / a:>7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
