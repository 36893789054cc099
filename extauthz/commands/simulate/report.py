"""``simulate --report DIR``: report.md and PNG plots (matplotlib, the ``tune`` extra)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from .replay import Lane, Replay
from .traffic import BadLines


def require_matplotlib(flag: str = "--report", extras: str = "tune") -> Any:
    """Import matplotlib with a file-only backend, or raise ImportError saying which flag
    needs it and what to install (``demo --pictures`` also needs Envoy: ``demo,tune``)."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(f"{flag} needs matplotlib: pip install 'extauthz[{extras}]' "
                          f"(or leave out {flag})") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _binned(counts: Counter[int], width: int, n_bins: int) -> list[float]:
    out = [0.0] * n_bins
    for second, n in counts.items():
        i = second // width
        if 0 <= i < n_bins:
            out[i] += n
    return [v / width for v in out]  # per second


def _span(replay: Replay) -> tuple[int, int]:
    """(bin width in seconds, number of bins) for about 300 bins at most."""
    span = max(1.0, (replay.last or 0.0) - (replay.first or 0.0) + 1.0)
    width = max(1, math.ceil(span / 300))
    return width, math.ceil(span / width)


#: one colour per tier, the same in every picture (critical stands out)
TIER_COLORS = {"critical": "#d62728", "post": "#ff7f0e", "get": "#1f77b4", "test": "#7f7f7f"}
LANE_STYLE = {"candidate": "-", "baseline": "--"}


def peak_load(replay: Replay) -> dict[str, Any] | None:
    """The peak load (requests/s, per bin of the report's width) offered, allowed by each
    policy, and the most the candidate removes in one bin: from the baseline's allowed load,
    or without a baseline from the offered load. None without series."""
    cand = replay.candidate.series
    if cand is None:
        return None
    width, n = _span(replay)
    sent = _binned(sum((c for c in cand.requests_by_tier.values()), Counter()), width, n)
    allowed = _binned(cand.allowed, width, n)
    base = replay.baseline.series if replay.baseline is not None else None
    reference = _binned(base.allowed, width, n) if base is not None else sent
    removed = [r - a for r, a in zip(reference, allowed, strict=True)]
    i = max(range(n), key=removed.__getitem__) if n else 0
    return {"bin_seconds": width, "offered_peak": max(sent, default=0.0),
            "candidate_allowed_peak": max(allowed, default=0.0),
            **({"baseline_allowed_peak": max(reference, default=0.0)} if base is not None else {}),
            "removed_peak": max(0.0, removed[i]) if n else 0.0, "removed_at": i * width,
            "compared_with": "baseline" if base is not None else "offered"}


def legend_outside(ax: Any) -> None:
    """The legend outside the plotting area, on the right, so it never covers data."""
    if ax.lines or ax.patches:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def write_report(out: Path, replay: Replay, summary: dict[str, Any], *, bad_lines: BadLines,
                 traffic: list[str]) -> Path:
    plt = require_matplotlib()
    out.mkdir(parents=True, exist_ok=True)
    width, n = _span(replay)
    xs = [i * width for i in range(n)]
    lanes = replay.lanes
    pictures: list[tuple[str, str]] = []

    def save(fig: Any, name: str, caption: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=100, bbox_inches="tight")
        plt.close(fig)
        pictures.append((name, caption))

    fig, ax = plt.subplots(figsize=(11, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = sorted({name for lane in lanes if lane.series for name in lane.series.refused_by_limiter})
    for lane in lanes:
        assert lane.series is not None
        for name, counts in sorted(lane.series.refused_by_limiter.items()):
            ax.plot(xs, _binned(counts, width, n), LANE_STYLE[lane.name],
                    color=colors[names.index(name) % len(colors)], label=f"{name} ({lane.name})")
    ax.set(xlabel="seconds from the first request", ylabel="refused requests / s",
           title="Refusals (and shadow would-refusals) per limiter")
    legend_outside(ax)
    save(fig, "refusals_by_limiter.png", "Refusals per limiter over time (solid: candidate, dashed: baseline).")

    fig, ax = plt.subplots(figsize=(11, 4))
    cand = replay.candidate.series
    assert cand is not None
    for tier, counts in sorted(cand.requests_by_tier.items()):
        ax.plot(xs, _binned(counts, width, n), ":", linewidth=1.0, color=TIER_COLORS.get(tier, "black"),
                label=f"{tier} sent")
    for lane in lanes:
        assert lane.series is not None
        for tier, counts in sorted(lane.series.refused_by_tier.items()):
            ax.plot(xs, _binned(counts, width, n), LANE_STYLE[lane.name], linewidth=1.8,
                    color=TIER_COLORS.get(tier, "black"), label=f"{tier} refused ({lane.name})")
    ax.set(xlabel="seconds from the first request", ylabel="requests / s", title="Traffic and refusals per tier")
    legend_outside(ax)
    save(fig, "refusals_by_tier.png", "Requests sent (dotted) and refused per tier (solid: candidate, "
         "dashed: baseline); each tier has its own colour.")

    if any(lane.series is not None and lane.series.levels for lane in lanes):
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
        t0 = replay.first or 0.0
        for lane in lanes:
            assert lane.series is not None
            for j, (name, points) in enumerate(sorted(lane.series.levels.items())):
                ts = [t - t0 for t, _, _ in points]
                color = colors[j % len(colors)]
                if lane is replay.candidate:  # the utilization is the same input for both lanes
                    top.plot(ts, [u for _, _, u in points], "-", color=color, label=f"{name} utilization")
                    spec = lane.policy.limiter(name)
                    for y, what in ((getattr(spec, "good_below", None), "good below"),
                                    (getattr(spec, "bad_above", None), "bad above")):
                        if isinstance(y, float):
                            top.axhline(y, color=color, linestyle=":", linewidth=0.8,
                                        label=f"{name} {what} {y:g}")
                bottom.plot(ts, [lv for _, lv, _ in points], LANE_STYLE[lane.name], color=color,
                            label=f"{name} shed level ({lane.name})")
        for y, tier in ((0.0, "test"), (1 / 3, "get"), (2 / 3, "post")):
            bottom.axhspan(y, y + 1 / 3, color=TIER_COLORS[tier], alpha=0.08)
            bottom.text(0.0, y + 1 / 6, f" above {y:.2f}: {tier} shed too", fontsize="small",
                        va="center", color=TIER_COLORS[tier], transform=bottom.get_yaxis_transform())
        bottom.axhline(0.0, color="grey", linewidth=0.5)
        top.set(ylabel="utilization (0..1)", ylim=(-0.02, 1.02),
                title="Worker utilization shedder: its input (top) and its shed level (bottom)")
        bottom.set(xlabel="seconds from the first request", ylabel="shed level",
                   ylim=(min(-0.05, bottom.get_ylim()[0]), 1.02))
        legend_outside(top)
        legend_outside(bottom)
        save(fig, "shedder_level.png", "Worker shedder: utilization on its own axis (top); the shed "
             "level (bottom) sheds test above 0, get above 1/3, post above 2/3, critical never.")

    customers = summary.get("customers") or []
    if customers:
        fig, ax = plt.subplots(figsize=(11, max(2.5, 0.4 * len(customers))))
        labels = [_who(row, 20) for row in customers][::-1]
        ys = list(range(len(customers)))
        ax.barh([y + 0.2 for y in ys], [row["candidate"]["refused"] for row in customers][::-1], height=0.4,
                color="#d62728", label="refused (candidate)")
        if replay.baseline is not None:
            ax.barh([y - 0.2 for y in ys], [row["baseline"]["refused"] for row in customers][::-1],
                    height=0.4, color="#7f7f7f", label="refused (baseline)")
        ax.set_yticks(ys, labels)
        ax.set(xlabel="requests refused", title="Customers whose outcome changes most")
        legend_outside(ax)
        save(fig, "top_identities.png", "The customers whose refusals change most from the baseline "
             "to the candidate (without a baseline: the most refused).")

    md = [_markdown(replay, summary, bad_lines, traffic, peak_load(replay))]
    md.append("\n## Pictures\n")
    for name, caption in pictures:
        md.append(f"![{caption}]({name})\n\n{caption}\n")
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path


def _who(row: dict[str, Any], width: int = 0) -> str:
    """A customer's name from --identities, else its hash."""
    label = str(row.get("label") or row["identity"])
    return label[:width] if width else label


def _table(lane: Lane, summary: dict[str, Any]) -> list[str]:
    rows = ["| limiter | mode | refused (or would refuse) | identities |", "|---|---|---:|---:|"]
    for name, row in summary["by_limiter"].items():
        spec = lane.policy.limiter(name)
        rows.append(f"| {name} | {spec.mode if spec else '?'} | {row['refused']:,} | {row['identities']:,} |")
    rows += ["", "| tier | requests | refused |", "|---|---:|---:|"]
    for tier, row in summary["by_tier"].items():
        rows.append(f"| {tier} | {row['requests']:,} | {row['refused']:,} |")
    return rows


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in d.items()) or "-"


def _customers(summary: dict[str, Any], baseline: bool) -> list[str]:
    rows = summary.get("customers") or []
    if not rows:
        return ["No customer is refused by either policy."]
    return _customer_table(rows, baseline) + _would_admit(rows)


def _would_admit(rows: list[dict[str, Any]]) -> list[str]:
    """The smallest numbers that would have admitted each refused customer (``would_admit``)."""
    from .advice import describe_advice

    lines = [f"* `{_who(r)}`: {name} would admit all {r['requests']:,} of its requests with "
             f"{describe_advice(numbers)}" for r in rows for name, numbers in (r.get("would_admit") or {}).items()]
    return (["", "What would have admitted them (each customer's own requests, replayed through the "
             "limiter's rule; one number changed at a time):", "", *lines]) if lines else []


def _customer_table(rows: list[dict[str, Any]], baseline: bool) -> list[str]:
    if baseline:
        md = ["| customer | share of traffic | requests | refused: baseline | refused: candidate | change "
              "| candidate by limiter | candidate by tier | baseline by limiter | baseline by tier |",
              "|---|---:|---:|---:|---:|---:|---|---|---|---|"]
        for r in rows:
            c, b = r["candidate"], r["baseline"]
            md.append(f"| `{_who(r)}` | {r['share_of_traffic']:.1%} | {r['requests']:,} | {b['refused']:,} "
                      f"| {c['refused']:,} | {r['change']:+,} | {_counts(c['by_limiter'])} "
                      f"| {_counts(c['by_tier'])} | {_counts(b['by_limiter'])} | {_counts(b['by_tier'])} |")
        return md
    md = ["| customer | share of traffic | requests | refused | by limiter | by tier |",
          "|---|---:|---:|---:|---|---|"]
    for r in rows:
        c = r["candidate"]
        md.append(f"| `{_who(r)}` | {r['share_of_traffic']:.1%} | {r['requests']:,} | {c['refused']:,} "
                  f"| {_counts(c['by_limiter'])} | {_counts(c['by_tier'])} |")
    return md


def _markdown(replay: Replay, summary: dict[str, Any], bad: BadLines, traffic: list[str],
              peak: dict[str, Any] | None = None) -> str:
    base = summary.get("baseline")
    md = ["# extauthz simulate report", ""]
    critical = summary["critical_refused"]
    if critical:
        md += [f"> **Critical traffic refused: the candidate refuses {critical:,} critical requests**"
               + (f" (the baseline: {base['critical_refused']:,})." if base else "."), ""]
    else:
        md += ["The candidate refuses no critical request.", ""]
    md += [f"Traffic: {', '.join(traffic)}; {summary['requests']:,} requests over "
           f"{(replay.last or 0) - (replay.first or 0):,.1f} s, replayed in {replay.elapsed:.2f} s "
           f"({replay.requests_per_second:,.0f} requests/s).", ""]
    if bad.total:
        md += [f"Skipped bad lines: {bad.total} ({dict(bad.by_reason)}).", ""]
    md += ["## Summary", "", "| figure (`--fail-on` name) | candidate |" + (" baseline |" if base else ""),
           "|---|---:|" + ("---:|" if base else "")]
    for figure, fmt in (("refused", "{:,}"), ("refused_share", "{:.2%}"), ("critical_refused", "{:,}"),
                        ("customers_refused", "{:,}"), ("max_customer_refused_share", "{:.1%}")):
        md.append(f"| {figure} | {fmt.format(summary[figure])} |"
                  + (f" {fmt.format(base[figure])} |" if base else ""))
    if peak is not None:
        what = "the baseline allows" if peak["compared_with"] == "baseline" else "is offered"
        md += ["", f"Peak load (per {peak['bin_seconds']} s): offered {peak['offered_peak']:,.1f} requests/s, "
               f"allowed by the candidate {peak['candidate_allowed_peak']:,.1f}/s"
               + (f", by the baseline {peak['baseline_allowed_peak']:,.1f}/s" if "baseline_allowed_peak" in peak
                  else "")
               + f". The candidate removes at most **{peak['removed_peak']:,.1f} requests/s** of what "
               f"{what} (at {peak['removed_at']:,} s)."]
    md += ["", "## Who the candidate would hurt (customers whose outcome changes most)" if base
           else "## Customers refused most", ""]
    md += _customers(summary, base is not None)
    md += ["", "## Candidate policy", f"{summary['allowed']:,} allowed, {summary['refused']:,} refused.", ""]
    md += _table(replay.candidate, summary)
    if replay.baseline is not None and base is not None:
        diff = summary["difference"]
        md += ["", "## Baseline policy", f"{base['allowed']:,} allowed, {base['refused']:,} refused.", ""]
        md += _table(replay.baseline, base)
        md += ["", "## Request by request",
               f"{diff['refused_by_candidate_only']:,} requests of "
               f"{diff['identities_refused_by_candidate_only']:,} identities are refused by the "
               f"candidate and allowed by the baseline; {diff['refused_by_baseline_only']:,} requests "
               f"of {diff['identities_refused_by_baseline_only']:,} identities the other way round.", "",
               "Each policy replays with its own limiter state, built from its own decisions, so the "
               "two can differ on a request even where their limits agree: a request one policy "
               "refuses takes no token and holds no lease there, so that customer's next requests "
               "can pass under it while the other policy, which let the earlier ones through, "
               "refuses them. That is why a stricter candidate can still show requests \"refused by "
               "the baseline only\". Worker shedders also draw at random (seeded: `--seed`): their "
               "refusals agree in rate per tier, not request by request. Compare customers and "
               "totals (above), not single requests.", "",
               "| customer | requests refused by the candidate only |", "|---|---:|"]
        labels = {r["identity"]: r.get("label") for r in summary.get("customers", [])}
        md += [f"| `{labels.get(row['identity']) or row['identity']}` | {row['requests']:,} |"
               for row in diff["top_identities_hurt"]]
    return "\n".join(md)
