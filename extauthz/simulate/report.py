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


def write_report(out: Path, replay: Replay, summary: dict[str, Any], *, bad_lines: BadLines,
                 traffic: list[str]) -> Path:
    plt = require_matplotlib()
    out.mkdir(parents=True, exist_ok=True)
    width, n = _span(replay)
    xs = [i * width for i in range(n)]
    lanes = replay.lanes
    style = {"candidate": "-", "baseline": "--"}
    pictures: list[tuple[str, str]] = []

    def save(fig: Any, name: str, caption: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=100)
        plt.close(fig)
        pictures.append((name, caption))

    fig, ax = plt.subplots(figsize=(9, 4))
    for lane in lanes:
        assert lane.series is not None
        for name, counts in sorted(lane.series.refused_by_limiter.items()):
            ax.plot(xs, _binned(counts, width, n), style[lane.name], label=f"{name} ({lane.name})")
    ax.set(xlabel="seconds from the first request", ylabel="refused requests / s",
           title="Refusals (and shadow would-refusals) per limiter")
    if ax.lines:
        ax.legend(fontsize="small")
    save(fig, "refusals_by_limiter.png", "Refusals per limiter over time (dashed: baseline).")

    fig, ax = plt.subplots(figsize=(9, 4))
    for lane in lanes:
        assert lane.series is not None
        for tier, counts in sorted(lane.series.refused_by_tier.items()):
            ax.plot(xs, _binned(counts, width, n), style[lane.name], label=f"{tier} refused ({lane.name})")
    cand = replay.candidate.series
    assert cand is not None
    for tier, counts in sorted(cand.requests_by_tier.items()):
        ax.plot(xs, _binned(counts, width, n), ":", alpha=0.6, label=f"{tier} sent")
    ax.set(xlabel="seconds from the first request", ylabel="requests / s", title="Traffic and refusals per tier")
    ax.legend(fontsize="small")
    save(fig, "refusals_by_tier.png", "Requests sent (dotted) and refused per tier.")

    if any(lane.series is not None and lane.series.levels for lane in lanes):
        fig, ax = plt.subplots(figsize=(9, 4))
        t0 = replay.first or 0.0
        for lane in lanes:
            assert lane.series is not None
            for name, points in sorted(lane.series.levels.items()):
                ax.plot([t - t0 for t, _, _ in points], [lv for _, lv, _ in points], style[lane.name],
                        label=f"{name} level ({lane.name})")
                if lane is replay.candidate:
                    ax.plot([t - t0 for t, _, _ in points], [u for _, _, u in points], ":", alpha=0.6,
                            label=f"{name} utilization")
        for y in (0.0, 1 / 3, 2 / 3):
            ax.axhline(y, color="grey", linewidth=0.5)
        ax.set(xlabel="seconds from the first request", ylabel="shed level",
               title="Worker utilization shedder: level (test sheds above 0, get above 1/3, post above 2/3)")
        ax.legend(fontsize="small")
        save(fig, "shedder_level.png", "Worker shedder level and utilization over time.")

    top = summary["top_identities"]
    if top:
        fig, ax = plt.subplots(figsize=(9, max(2.5, 0.35 * len(top))))
        labels = [row["identity"][:12] for row in top][::-1]
        ax.barh(labels, [row["requests"] - row["refused"] for row in top][::-1], label="allowed")
        ax.barh(labels, [row["refused"] for row in top][::-1],
                left=[row["requests"] - row["refused"] for row in top][::-1], label="refused")
        ax.set(xlabel="requests", title="Most refused identities (hashed)")
        ax.legend(fontsize="small")
        save(fig, "top_identities.png", "The identities refused most (candidate policy).")

    md = [_markdown(replay, summary, bad_lines, traffic)]
    md.append("\n## Pictures\n")
    for name, caption in pictures:
        md.append(f"![{caption}]({name})\n\n{caption}\n")
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path


def _table(lane: Lane, summary: dict[str, Any]) -> list[str]:
    rows = ["| limiter | mode | refused (or would refuse) | identities |", "|---|---|---:|---:|"]
    for name, row in summary["by_limiter"].items():
        spec = lane.policy.limiter(name)
        rows.append(f"| {name} | {spec.mode if spec else '?'} | {row['refused']:,} | {row['identities']:,} |")
    rows += ["", "| tier | requests | refused |", "|---|---:|---:|"]
    for tier, row in summary["by_tier"].items():
        rows.append(f"| {tier} | {row['requests']:,} | {row['refused']:,} |")
    return rows


def _markdown(replay: Replay, summary: dict[str, Any], bad: BadLines, traffic: list[str]) -> str:
    md = ["# extauthz simulate report", "",
          f"Traffic: {', '.join(traffic)}; {summary['requests']:,} requests over "
          f"{(replay.last or 0) - (replay.first or 0):,.1f} s, replayed in {replay.elapsed:.2f} s "
          f"({replay.requests_per_second:,.0f} requests/s).", ""]
    if bad.total:
        md += [f"Skipped bad lines: {bad.total} ({dict(bad.by_reason)}).", ""]
    md += ["## Candidate policy",
           f"{summary['allowed']:,} allowed, {summary['refused']:,} refused.", ""]
    md += _table(replay.candidate, summary)
    if replay.baseline is not None:
        base = summary["baseline"]
        diff = summary["difference"]
        md += ["", "## Baseline policy", f"{base['allowed']:,} allowed, {base['refused']:,} refused.", ""]
        md += _table(replay.baseline, base)
        md += ["", "## Who the candidate would hurt",
               f"{diff['refused_by_candidate_only']:,} requests of "
               f"{diff['identities_refused_by_candidate_only']:,} identities are refused by the "
               f"candidate and allowed by the baseline; {diff['refused_by_baseline_only']:,} requests "
               f"of {diff['identities_refused_by_baseline_only']:,} identities the other way round.", "",
               "| identity (hashed) | requests refused by the candidate only |", "|---|---:|"]
        md += [f"| `{row['identity']}` | {row['requests']:,} |" for row in diff["top_identities_hurt"]]
    md += ["", "## Most refused identities", "", "| identity (hashed) | requests | refused |", "|---|---:|---:|"]
    md += [f"| `{row['identity']}` | {row['requests']:,} | {row['refused']:,} |" for row in summary["top_identities"]]
    return "\n".join(md)
