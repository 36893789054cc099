"""A frame trickled into the gRPC port's connection (server/h2conn.py ``H2Conn.receive``) in
reads of ``--piece`` bytes: microseconds of ``receive`` per read and per frame, against the
same frames read whole (issue 31's review: a partial frame was copied whole at every read, so
a 16 KiB frame read a byte at a time cost a 16 KiB copy per byte, quadratic in the frame).

The frames are of an unknown type (ignored, within no budget: the connection alone is timed)
of ``--size`` bytes, the largest SETTINGS_MAX_FRAME_SIZE the port accepts by default. Figures
are the minimum over ``--rounds`` rounds (the machine is shared). What the figure leaves out:
the event loop's own cost per read (the syscall, ``data_received``), which the trickle pays
too; the request_timeout bounds a frame begun to 10 s (docs/security.md).

    python -m bench.h2_trickle [--size 16384] [--piece 1] [--frames 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

from extauthz.server.h2conn import PREFACE, H2Conn


class _Owner:
    """Takes what the connection tells and drops it (only ``receive`` is timed)."""

    def inspect(self, kind: int, sid: int, flags: int, arg: int) -> None: ...
    def spoke(self) -> None: ...


def _conn() -> H2Conn:
    conn = H2Conn(_Owner(), max_concurrent_streams=100, max_frame_size=16384,  # type: ignore[arg-type]
                  max_header_list_size=16384, header_table_size=4096, stream_window=1 << 20,
                  connection_window=16 << 20, max_block=16384)
    conn.receive(PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    return conn


def _frame(size: int) -> bytes:
    return size.to_bytes(3, "big") + b"\x20\x00\x00\x00\x00\x00" + b"x" * size


def run(size: int, piece: int, frames: int, rounds: int) -> tuple[float, float]:
    """Seconds per frame: trickled in ``piece``-byte reads, and read whole."""
    data = _frame(size) * frames
    pieces = [data[i:i + piece] for i in range(0, len(data), piece)]
    trickled = whole = float("inf")
    for _ in range(rounds):
        conn = _conn()
        start = time.perf_counter()
        for p in pieces:
            conn.receive(p)
        trickled = min(trickled, (time.perf_counter() - start) / frames)
        assert conn.unparsed == 0
        conn = _conn()
        start = time.perf_counter()
        conn.receive(data)
        whole = min(whole, (time.perf_counter() - start) / frames)
    return trickled, whole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=16384)
    ap.add_argument("--piece", type=int, default=1)
    ap.add_argument("--frames", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    trickled, whole = run(a.size, a.piece, a.frames, a.rounds)
    reads = -(-(a.size + 9) // a.piece)
    print(f"frame of {a.size} bytes in reads of {a.piece}: {trickled * 1e3:.2f} ms a frame "
          f"({trickled / reads * 1e6:.2f} us a read of {reads}); read whole: {whole * 1e6:.1f} us a frame")


if __name__ == "__main__":
    main()
