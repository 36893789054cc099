"""bench/memory_soak.py: the figures it prints come from the samples (start after the warm-up,
end, max, ratios), and RSS is read from /proc for every process given. No timing assertions."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.load import read_wrk
from bench.memory_soak import rss_bytes, summarize


def test_summary_starts_after_the_warmup() -> None:
    mib = 2**20
    samples = [(0.0, 50 * mib), (5.0, 200 * mib), (10.0, 100 * mib), (15.0, 130 * mib), (20.0, 110 * mib)]
    m = summarize(samples, warmup=10.0)
    assert (m["start_mib"], m["end_mib"], m["max_mib"]) == (100, 110, 130)
    assert m["end_ratio"] == pytest.approx(1.1) and m["max_ratio"] == pytest.approx(1.3)
    assert m["samples"] == 3 and m["measured_s"] == 10.0


def test_a_run_without_a_sample_after_the_warmup_is_refused() -> None:
    with pytest.raises(ValueError, match=r"no sample after the 30\.0 s warm-up"):
        summarize([(0.0, 1), (10.0, 2)], warmup=30.0)


def test_rss_sums_every_process_and_skips_the_gone() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        mine, theirs = rss_bytes([os.getpid()]), rss_bytes([child.pid])
        assert mine > 0 and theirs > 0
        assert rss_bytes([os.getpid(), child.pid]) >= mine  # the child's own pages add
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
    assert rss_bytes([child.pid]) == 0


@pytest.mark.parametrize("length,seconds", [("10.01s", 10.01), ("11.00m", 660.0), ("850.00ms", 0.85)])
def test_wrk_runs_of_any_length_are_read(length: str, seconds: float) -> None:
    # wrk prints a run's length in its largest whole unit: a 10-minute soak says "11.00m"
    out = (f"  608011 requests in {length}, 161.82MB read\n  Non-2xx or 3xx responses: 5770\n"
           "  Socket errors: connect 0, read 1, write 0, timeout 2\n")
    figures = read_wrk(out)
    assert figures["seconds"] == pytest.approx(seconds)
    assert figures["rps"] == pytest.approx(608011 / seconds)
    assert (figures["non_2xx"], figures["errors"]) == (5770, 3)
