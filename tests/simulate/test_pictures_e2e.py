"""``extauthz demo --pictures``: four non-empty PNGs and their data through the real stack (short
time scale); the data shows what each caption claims (the checks of test_pictures_data.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from extauthz.commands.cli import main
from extauthz.commands.pictures import check_captions

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_demo_pictures_writes_four_pngs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    assert main(["demo", "--pictures", str(tmp_path), "--time-scale", "0.3"]) == 0
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["1-request-rate.png", "2-concurrency.png", "3-fleet-usage.png",
                    "4-worker-utilization.png"]
    for name in pngs:
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    md = (tmp_path / "pictures.md").read_text()
    out = capsys.readouterr().out
    # what does not depend on timing: bob never hits alice's limit, critical is never refused
    assert "| bob |" in out and "| critical POST |" in out
    for row in out.splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")]
        if cells[0] in ("bob", "carol", "critical", "critical POST", "erin"):
            assert cells[1] == cells[2] and int(cells[1]) > 0, row
        if cells[0] == "alice burst":
            assert int(cells[3]) > 0, row  # 429s
    assert md.count("![") == 4
    verdicts = check_captions(tmp_path)
    assert verdicts == {name: [] for name in verdicts}, verdicts
    assert md.count("Caption checked against the data: holds.") == 4  # the demo says so
    assert "Caption checks" in out and out.count(": holds") == 4
