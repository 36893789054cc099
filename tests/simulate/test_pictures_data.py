"""The claims of the four pictures' captions, checked from the data written beside them
(docs/pictures/*.csv, made by ``extauthz demo --pictures``) by the demo's own caption checks
(extauthz/commands/pictures.py ``CAPTION_CHECKS``); test_pictures_e2e.py runs them on freshly made data.
And the checks themselves: a fleet past its cap is reported, with the requests that passed
unchecked, which the data, the tables and the fleet picture mark."""

from __future__ import annotations

from pathlib import Path

import pytest

from extauthz.commands.pictures import (
    CAPTION_CHECKS,
    CSV_FIELDS,
    Flow,
    Scenario,
    Sent,
    check_fleet,
    fleet_series,
    read_rows,
)

from ..conftest import ROOT

PICTURES = ROOT / "docs" / "pictures"


@pytest.mark.parametrize("name", CAPTION_CHECKS)
def test_the_committed_pictures_show_what_their_captions_say(name: str) -> None:
    assert CAPTION_CHECKS[name](PICTURES) == []


def test_every_picture_has_its_data_beside_it() -> None:
    md = (PICTURES / "pictures.md").read_text()
    for png in sorted(PICTURES.glob("*.png")):
        assert (PICTURES / f"{png.stem}.csv").exists(), png
        assert f"]({png.stem}.csv)" in md


def fleet_run(unchecked: int) -> Scenario:
    """A fleet scenario's results: 12 non-critical requests the limiter admitted, held from
    t=1 to t=3, ``unchecked`` more that passed unchecked in the same time, some refused, and
    critical requests answered every 0.1 s."""
    sc = Scenario("3-fleet-usage", "caption", 4.0, [Flow("non-critical GET", "/fleet/v1/items", "k", "many"),
                                                    Flow("critical POST", "/fleet/critical", "p", "pay",
                                                         tier="critical", method="POST")])
    for i in range(12 + unchecked):
        sc.results.append(Sent("non-critical GET", "many", "get", 0.9, 3.1, 200, upstream=(1.0 + i / 1000, 3.0),
                               unchecked=i >= 12))
    sc.results.append(Sent("non-critical GET", "many", "get", 1.5, 1.51, 503))
    for i in range(30):
        t = 0.1 * i
        sc.results.append(Sent("critical POST", "pay", "critical", t, t + 0.1, 200, upstream=(t, t + 0.09)))
    return sc


def test_fleet_caption_check_reports_more_in_flight_than_the_cap_and_the_unchecked(tmp_path: Path) -> None:
    fleet_run(0).write_csv(tmp_path)
    assert check_fleet(tmp_path) == []  # 12 of 12: the caption holds
    sc = fleet_run(7)
    sc.write_csv(tmp_path)
    assert check_fleet(tmp_path) == [
        "19 non-critical requests in flight at once, not the 12 of 16 slots it may use (the limiter's "
        "own: 12) (7 passed unchecked: Envoy's ext_authz check outlasted its timeout and "
        "failure_mode_allow let them through, with no lease)"]


def test_requests_that_passed_unchecked_are_marked(tmp_path: Path) -> None:
    sc = fleet_run(7)
    sc.write_csv(tmp_path)
    rows = read_rows(tmp_path / "3-fleet-usage.csv")
    assert tuple(rows[0]) == CSV_FIELDS
    assert sum(r["unchecked"] == "1" for r in rows) == 7
    assert "| non-critical GET | 20 | 19 | 0 | 1 | 7 |" in sc.table()  # the table counts them
    grid = [0.5, 2.0, 3.5]
    series = fleet_series(sc.results, grid)  # drawn apart in the fleet picture, counted in its legend
    assert [(label.split(" (")[0], ys) for _, label, ys in series] == [
        ("non-critical traffic in flight", [0, 12, 0]), ("passed unchecked", [0, 7, 0]),
        ("critical traffic in flight", [1, 1, 0])]
    assert series[1][1].startswith("passed unchecked (7:")
    assert [label for _, label, _ in fleet_series(fleet_run(0).results, grid)] == [
        "non-critical traffic in flight", "critical traffic in flight (on top)"]  # none: no such series

