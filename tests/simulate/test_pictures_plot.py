"""What the pictures draw, read from the figures' own data (lines, labels, limits), not pixels:
the fleet picture's legend speaks its caption's words, the rate picture draws the refill rate
and keeps coinciding users apart, the worker picture says what its shed level below 0 means."""

from __future__ import annotations

from typing import Any

import pytest

from extauthz.commands.pictures import REFILL_PER_S, Scenario, Sent, draw, scenarios

from .test_pictures_data import fleet_run

plt = pytest.importorskip("matplotlib.pyplot")


def picture(name: str) -> Scenario:
    [sc] = [s for s in scenarios(1.0) if s.name == name]
    return sc


def labels(ax: Any) -> list[str]:
    return [str(t) for t in ax.get_legend_handles_labels()[1]]


def rate_run() -> Scenario:
    """alice empties her bucket; bob and carol stay full (their token lines coincide at 19)."""
    sc = picture("1-request-rate")
    for i in range(60):
        t = 0.1 * i
        sc.results.append(Sent("bob", "bob", "get", t, t + 0.01, 200, tokens_left=19))
        sc.results.append(Sent("carol", "carol", "get", t, t + 0.01, 200, tokens_left=19))
        sc.results.append(Sent("alice", "alice", "get", t, t + 0.01, 200 if i < 20 else 429,
                               tokens_left=max(0, 19 - i)))
    return sc


def test_fleet_legend_uses_the_captions_words() -> None:
    sc = fleet_run(0)
    sc.caption = picture("3-fleet-usage").caption
    fig = draw(sc, 1.0)
    try:
        names = [label.split(":")[0].split(" (")[0].removesuffix(" in flight")
                 for ax in fig.axes for label in labels(ax)]
    finally:
        plt.close(fig)
    assert names and all(name in sc.caption for name in names), names


def test_rate_picture_draws_the_refill_rate_and_keeps_each_users_line_visible() -> None:
    fig = draw(rate_run(), 2.0)
    try:
        tokens, rates = fig.axes[0], fig.axes[1]
        refill = [line for line in rates.get_lines() if str(line.get_label()).startswith("refill rate")]
        assert len(refill) == 1 and set(refill[0].get_ydata()) == {REFILL_PER_S / 2.0}
        looks = {str(line.get_label()).split(":")[0]: (line.get_linestyle(), line.get_marker(), line.get_linewidth())
                 for line in tokens.get_lines() if str(line.get_label()).endswith("tokens left")}
        assert sorted(looks) == ["alice", "bob", "carol"]
        assert len(set(looks.values())) == 3  # bob's line at 19 no longer hides carol's
        allowed = {str(line.get_label()).split(":")[0]: (line.get_marker(), line.get_linewidth())
                   for line in rates.get_lines() if str(line.get_label()).endswith(": allowed")}
        assert len(set(allowed.values())) == len(allowed) == 3
    finally:
        plt.close(fig)


def test_worker_shed_level_below_zero_is_explained() -> None:
    sc = picture("4-worker-utilization")
    sc.shedder = [(0.1 * i, -1 / 3 + 0.05 * i, 0.9, {}) for i in range(20)]
    fig = draw(sc, 1.0)
    try:
        mid = fig.axes[1]
        low, _ = mid.get_ylim()
        assert low < 0
        assert "below 0" in mid.get_ylabel()
        [band] = [label for label in labels(mid) if label.startswith("below 0")]
        assert "nothing shed" in band
    finally:
        plt.close(fig)
