"""A user's journey through placement and scheduling, as the READMEs and docs describe it.

An RL-systems engineer declares a machine (a topology data file), plans a buffer on it
(``conduit plan``, :class:`~conduit.placement.Planner`) and reads the explanation. Each test
here follows a documented step literally and checks what the docs promise of it.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from importlib import resources
from typing import Any

import pytest
from conduit.errors import PlacementError
from conduit.placement import Planner, Topology, Workload

_DECLARED = json.loads((resources.files("conduit.placement") / "topologies" / "h200x1.json").read_text())


def _declared(edit: Any) -> dict[str, Any]:
    """The shipped h200x1 data file, with ``edit`` applied to a copy."""
    d = copy.deepcopy(_DECLARED)
    edit(d)
    return d


def _conduit(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", "import sys; from conduit.cli import main; sys.exit(main())", *args],
                          capture_output=True, text=True, timeout=120, env=env, check=False)


# -- a declared topology with mistakes is refused, saying what to fix --------------------------------------------
def test_a_misspelt_bandwidth_key_is_refused_not_read_as_an_unlimited_link() -> None:
    # "gpbs" for "gbps": was accepted as a link with no bandwidth figure, i.e. unlimited bandwidth, so the
    # planner priced every host copy at its overhead alone
    d = _declared(lambda d: d["links"]["host_copy"].__setitem__("gpbs", d["links"]["host_copy"].pop("gbps")))
    with pytest.raises(PlacementError, match=r"links\.host_copy has unknown key\(s\) gpbs.*\"gbps\""):
        Topology.from_file_dict(d)


def test_a_misspelt_link_name_is_refused_when_the_file_is_loaded() -> None:
    # was accepted: the link was kept under the misspelt name and the file's figure for host_copy was lost
    d = _declared(lambda d: d["links"].__setitem__("host_cpy", d["links"].pop("host_copy")))
    with pytest.raises(PlacementError, match=r"links\.host_cpy names no data path.*host_copy"):
        Topology.from_file_dict(d)


@pytest.mark.parametrize(("figure", "value"), [("gbps", 0), ("gbps", -3), ("gbps", "fast"), ("gbps", True),
                                               ("overhead_us", -5), ("overhead_us", float("nan"))])
def test_a_bad_link_figure_is_refused_naming_the_link_and_the_figure(figure: str, value: object) -> None:
    # was: "A link needs ... re-run `conduit profile`" (no link named, and no profile to re-run for a declared
    # machine), a bare "Malformed topology data (ValueError(...))", or for True a bandwidth of 1 GB/s
    d = _declared(lambda d: d["links"]["host_copy"].__setitem__(figure, value))
    with pytest.raises(PlacementError, match=rf"Topology 'h200x1': links\.host_copy\.{figure} is .*finite number") \
            as err:
        Topology.from_file_dict(d)
    assert "conduit profile" not in str(err.value)


def test_a_bad_default_p2p_bandwidth_is_refused_naming_it() -> None:
    dgx = json.loads((resources.files("conduit.placement") / "topologies" / "dgx-a100-80g.json").read_text())
    dgx["p2p"]["gbps"] = 0
    with pytest.raises(PlacementError, match=r"p2p\.gbps is 0; it must be a finite number > 0"):
        Topology.from_file_dict(dgx)


def test_the_shipped_topologies_still_load_and_plan() -> None:
    for name in ("dgx-a100-80g", "mi250x-node", "h200x1"):
        data = json.loads((resources.files("conduit.placement") / "topologies" / f"{name}.json").read_text())
        topo = Topology.from_file_dict(data)
        plan = Planner(topo).plan(Workload.transitions(1000, capacity=10**5, batch=512))
        assert plan.chosen.feasible


# -- `conduit plan` prints a readable table -------------------------------------------------------------------------
def test_plan_table_columns_stay_aligned_for_a_placement_over_eight_gpus() -> None:
    out = _conduit("plan", "--topology", "dgx-a100-80g", "--obs-dim", "5000", "--capacity", "1e6", "--batch", "512")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("candidate"))
    end = lines[header].index("ingest ms") + len("ingest ms")  # the ingest column is right-aligned to here
    rows = [ln for ln in lines[header + 1:] if ln.strip()]
    assert any("cuda:7]" in r for r in rows)
    for r in rows:  # was: the 8-GPU row's spec overran its column and shifted every figure after it
        assert r[end - 1].isdigit() and r[end] == " " and r[end - 4] == ".", (r, lines[header])


# -- `conduit schedule calibrate` finishes with its defaults ---------------------------------------------------------
@pytest.mark.parametrize("updates", ["1", "2"])
def test_calibrate_without_warmup_finishes_at_any_number_of_updates(updates: str) -> None:
    # the warm-up was 28 iterations whatever --updates said: at 1 or 2 deliveries per iteration that is 28 or 56
    # deliveries, fewer than the probe and confirm phases take (81 + 6 x the largest g_del), so the documented
    # command always ended in "error: calibration did not finish; raise --warmup"
    out = _conduit("schedule", "calibrate", "--obs-dim", "8", "--batch", "16", "--rollout", "16", "--capacity", "512",
                   "--updates", updates, "--iterations", "0")
    assert out.returncode == 0, (out.stdout[-800:], out.stderr[-800:])
    assert "chosen: g_ing=" in out.stdout and "measured in the confirm phase" in out.stdout, out.stdout


def test_the_warmup_covers_the_most_deliveries_a_calibration_takes() -> None:
    from conduit.scheduling.auto import Automatic
    from conduit.scheduling.cli import calibration_deliveries

    # probe: 3 rounds of g = 1, 2, 4, 8 (a chunk of g deliveries each); confirm: 3 windows per configuration of
    # one untimed chunk (at most 8) and 6 timed deliveries
    assert calibration_deliveries(Automatic()) == 3 * (1 + 2 + 4 + 8) + 2 * 3 * (8 + 6)
    assert calibration_deliveries(Automatic(overlap=True, g_del_max=3)) == 3 * (1 + 2 + 3)


# -- the latency model's public functions refuse bad input with Conduit's typed error --------------------------------
def test_fit_latency_and_choose_granularity_refuse_bad_input_with_a_conduit_error() -> None:
    from conduit.errors import ConduitError
    from conduit.scheduling import fit_latency
    from conduit.scheduling.model import choose_granularity

    # was a bare ValueError, which a caller catching conduit.ConduitError (as the CLI does) did not catch
    with pytest.raises(ConduitError, match="no calls to fit"):
        fit_latency([])
    with pytest.raises(ConduitError, match="finite and >= 0"):
        fit_latency([(1024.0, float("nan"), False)])
    with pytest.raises(ConduitError, match="no granularities"):
        choose_granularity({})
    with pytest.raises(ConduitError, match="finite and >= 0"):
        choose_granularity({1.0: -1.0})
