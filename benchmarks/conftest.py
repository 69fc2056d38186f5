"""Benchmarks: `.venv/bin/python -m pytest benchmarks` (not part of the test suite).

The ``ratios`` fixture collects each benchmark's median (or mean, where a table asks) into a named table; at the end of
a run with statistics, every table is written to ``benchmarks/results/<table>.md`` with
each cell as a ratio to the table's baseline column, all from the same run.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
RESULTS = Path(__file__).parent / "results"


class Ratios:
    """Tables of medians: ``table -> row -> column -> seconds``."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[str, dict[str, float]]] = defaultdict(lambda: defaultdict(dict))
        self.baselines: dict[str, str] = {}
        self.notes: dict[str, str] = {}
        self.stats: dict[str, str] = {}

    def add(self, table: str, row: str, column: str, benchmark: Any, *, baseline: str, note: str = "",
            stat: str = "median") -> None:
        """Record ``benchmark``'s ``stat`` (``median``, or ``mean`` where the calls of one column fall into groups
        of different cost, whose median would be either group's) as ``table[row][column]``."""
        stats = getattr(benchmark, "stats", None)
        if stats is None or not getattr(stats, "stats", None) or not stats.stats.data:
            return  # --benchmark-disable: no statistics to report
        self.tables[table][row][column] = getattr(stats.stats, stat)
        self.baselines[table] = baseline
        self.stats[table] = stat
        if note:
            self.notes[table] = note

    def write(self) -> list[Path]:
        RESULTS.mkdir(exist_ok=True)
        written = []
        for table, rows in self.tables.items():
            base = self.baselines[table]
            stat = self.stats.get(table, "median")
            cols = sorted({c for r in rows.values() for c in r}, key=lambda c: (c != base, c))
            lines = [f"# {table}", "", self.notes.get(table, ""), "",
                     f"{stat.capitalize()} per call; ratio = {stat} / {stat} of `{base}` in the same row, same run.",
                     "",
                     "| row | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
            for row, cells in rows.items():
                b = cells.get(base)
                out = []
                for c in cols:
                    v = cells.get(c)
                    if v is None:
                        out.append("-")
                    elif b:
                        out.append(f"{v * 1e3:.4f} ms ({v / b:.2f}x)")
                    else:
                        out.append(f"{v * 1e3:.4f} ms")
                lines.append(f"| {row} | " + " | ".join(out) + " |")
            path = RESULTS / f"{table}.md"
            path.write_text("\n".join(lines) + "\n")
            written.append(path)
        return written


_RATIOS = Ratios()


@pytest.fixture(scope="session")
def ratios() -> Ratios:
    return _RATIOS


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for path in _RATIOS.write():
        print(f"\nwrote {path}")
