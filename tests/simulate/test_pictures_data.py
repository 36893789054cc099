"""The claims of the four pictures' captions, checked from the data written beside them
(docs/pictures/*.csv, made by ``extauthz demo --pictures``). test_pictures_e2e.py runs the same
checks on freshly made data."""

from __future__ import annotations

import csv
import itertools
import statistics
from pathlib import Path

import pytest

from extauthz.pictures import in_flight

from ..conftest import ROOT

PICTURES = ROOT / "docs" / "pictures"
Rows = list[dict[str, str]]


def read(path: Path) -> Rows:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def statuses(rows: Rows, **match: str) -> list[int]:
    return [int(r["status"]) for r in rows if all(r[k] == v for k, v in match.items())]


def max_in_flight(rows: Rows, **match: str) -> int:
    spans = [(float(r["upstream_start"]), float(r["upstream_end"])) for r in rows
             if r["upstream_start"] and all(r[k] == v for k, v in match.items())]
    assert spans, match
    return max(in_flight(spans)[1])


def check_request_rate(d: Path) -> None:
    rows = read(d / "1-request-rate.csv")
    assert 429 in statuses(rows, user="alice")  # the bursting user is refused
    for user in ("bob", "carol"):  # the others never
        assert set(statuses(rows, user=user)) == {200}, user
    tokens = {u: [float(r["tokens_left"]) for r in rows if r["user"] == u and r["tokens_left"]]
              for u in ("alice", "bob", "carol")}
    assert all(0 <= t <= 20 for ts in tokens.values() for t in ts)  # within the bucket (burst 20)
    assert min(tokens["alice"]) == 0 and min(tokens["bob"]) > 0 and min(tokens["carol"]) > 0


def check_concurrency(d: Path) -> None:
    rows = read(d / "2-concurrency.csv")
    assert max_in_flight(rows, user="dave") == 4  # up to the limit, never above it
    assert max_in_flight(rows, user="erin") <= 2
    assert 429 in statuses(rows, user="dave")
    assert set(statuses(rows, user="erin")) == {200}


def check_fleet(d: Path) -> None:
    rows = read(d / "3-fleet-usage.csv")
    assert max_in_flight(rows, tier="get") == 12  # non-critical fills its 12 of 16 slots, no more
    assert 503 in statuses(rows, tier="get")
    assert set(statuses(rows, tier="critical")) == {200}  # critical is never refused
    # ... nor stalled by the generator: answers keep coming, never a gap of two request times
    critical = sorted((float(r["sent"]), float(r["answered"])) for r in rows if r["tier"] == "critical")
    took = statistics.median(b - a for a, b in critical)
    answers = sorted(b for _, b in critical)
    assert max(b - a for a, b in itertools.pairwise(answers)) < 2 * took


def check_workers(d: Path) -> None:
    rows = read(d / "4-worker-utilization.csv")
    assert set(statuses(rows, tier="critical")) == {200}  # critical never shed
    refused = {tier: [float(r["sent"]) for r in rows if r["tier"] == tier and r["status"] == "503"]
               for tier in ("test", "get", "post")}
    # shed in order: test first, then get, then post, each tier at least as much as the next
    assert min(refused["test"]) < min(refused["get"]) < min(refused["post"])
    assert len(refused["test"]) >= len(refused["get"]) >= len(refused["post"]) > 0
    shedder = read(d / "4-worker-utilization-shedder.csv")
    for s in shedder:
        p = [float(s[f"p_{tier}"]) for tier in ("test", "get", "post", "critical")]
        assert p[0] >= p[1] >= p[2] >= p[3] == 0.0, s
        assert 0.0 <= float(s["utilization"]) <= 1.0 and float(s["level"]) <= 1.0
    levels = [float(s["level"]) for s in shedder]
    assert levels[0] < 0 and max(levels) > 2 / 3 and levels[-1] < 0  # rests, sheds post too, recovers


CHECKS = [check_request_rate, check_concurrency, check_fleet, check_workers]


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
def test_the_committed_pictures_show_what_their_captions_say(check: object) -> None:
    assert callable(check)
    check(PICTURES)


def test_every_picture_has_its_data_beside_it() -> None:
    md = (PICTURES / "pictures.md").read_text()
    for png in sorted(PICTURES.glob("*.png")):
        assert (PICTURES / f"{png.stem}.csv").exists(), png
        assert f"]({png.stem}.csv)" in md
