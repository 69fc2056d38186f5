"""``conduit simulate --baseline link-blind``: the table says over how many sampled placements its non-adaptive
figure was averaged (``--samples`` changes it: at 64 MI250X GCDs, 91.3 ms with one, 82.8 ms with eight)."""

from __future__ import annotations

from pathlib import Path

from conduit.cli import main


def _table(tmp_path: Path, samples: str) -> str:
    out = tmp_path / samples
    assert main(["simulate", "--scenario", "mi250x", "--gpus", "64", "--baseline", "link-blind", "--samples", samples,
                 "--out", str(out)]) == 0
    return (out / "scale-mi250x.md").read_text()


def test_link_blind_table_names_the_samples_it_averaged(tmp_path: Path) -> None:
    """The Markdown table read "non-adaptive = link-blind" whatever --samples was: two tables of different
    figures with the same heading. It now says "mean of N sampled placements"."""
    one, three = _table(tmp_path, "1"), _table(tmp_path, "3")
    assert "mean of 1 sampled placement per scale" in one.splitlines()[0], one.splitlines()[0]
    assert "mean of 3 sampled placements per scale" in three.splitlines()[0], three.splitlines()[0]


def test_other_baselines_do_not_mention_samples(tmp_path: Path) -> None:
    out = tmp_path / "o"
    assert main(["simulate", "--scenario", "mi250x", "--gpus", "64", "--out", str(out)]) == 0
    assert "sampled" not in (out / "scale-mi250x.md").read_text().splitlines()[0]
