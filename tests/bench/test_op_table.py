"""bench/op_table.py: every figure's workload runs its checks (the embedded store answers each
mix, the wire packs and decodes it). No timing assertions."""

from __future__ import annotations

import pytest

from bench.op_table import FIGURES, workload


@pytest.mark.parametrize("figure", FIGURES)
def test_every_figure_runs(figure: str) -> None:
    workload(figure, 50, 7)()

