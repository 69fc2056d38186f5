"""Link reports and the plan's learner links, without a cluster.

* ``LinkProfile.table()`` named its bandwidth columns ``MBps@{bytes >> 10}KiB``: probe sizes under 1 KiB, or
  within one KiB of each other, got one column, and all figures but the last were silently lost.
* Probe sizes given twice measure one bandwidth point twice (and would name one column twice): refused.
* ``ShardPlan`` priced deliveries to a learner node its links do not reach as the slowest measured link of
  their kind (links measured from another node): refused, typed.
"""

from __future__ import annotations

import pytest
from conduit import ConfigurationError
from conduit.distributed.links import LinkProfile, check_probes
from conduit.distributed.plan import ShardPlan
from conduit.placement import LinkCost

A, B, HERE, FAR = "node-a", "node-b", "node-here", "node-far"


def test_every_probe_size_gets_its_own_readable_column():
    sizes = (100, 512, 1000, 1024, 1536, 2047, 2048, 1 << 18, (1 << 18) + 1, 1 << 22)
    points = tuple((float(b), 1e6 * (i + 1)) for i, b in enumerate(sizes))  # MB/s = i + 1: each figure is distinct
    prof = LinkProfile({(A, B): LinkCost(1e-4, points)}, learner_node=A, sizes=sizes, repeats=1)
    (row,) = prof.table()
    cols = {k: v for k, v in row.items() if k.startswith("MBps@")}
    assert list(cols) == ["MBps@100B", "MBps@512B", "MBps@1000B", "MBps@1KiB", "MBps@1536B", "MBps@2047B",
                          "MBps@2KiB", "MBps@256KiB", "MBps@262145B", "MBps@4096KiB"]
    assert list(cols.values()) == pytest.approx([float(i + 1) for i in range(len(sizes))])  # no figure lost


def test_a_declared_links_fractional_point_is_named_exactly():
    prof = LinkProfile({(A, A): LinkCost(0.0, ((0.5, 2e6), (1.0, 3e6)))}, learner_node=A)
    (row,) = prof.table()
    assert row["MBps@0.5B"] == pytest.approx(2.0) and row["MBps@1B"] == pytest.approx(3.0)


def test_probe_sizes_given_twice_are_refused():
    with pytest.raises(ConfigurationError, match="distinct"):
        check_probes((1024, 1 << 18, 1024), 1, 1.0)
    assert check_probes((1024, 1 << 18), 1, 1.0) == (1024, 1 << 18)


def _measured_from_here() -> LinkProfile:
    """What measure_links gives for servers on A and B measured from HERE: every pair of A, B and HERE."""
    nodes = (A, B, HERE)
    return LinkProfile({(s, d): LinkCost.constant(10.0 if s == d else 1.0) for s in nodes for d in nodes},
                       learner_node=HERE)


def test_a_plan_whose_links_do_not_reach_the_learners_node_is_refused():
    links = _measured_from_here()
    with pytest.raises(ConfigurationError, match="no link to the learner's node node-far.*node-a.*node-b"):
        ShardPlan([A, B], FAR, links=links)
    with pytest.raises(ConfigurationError, match="no link to the learner's node"):
        ShardPlan([A, B], FAR, links=LinkProfile({(A, FAR): LinkCost.constant(1.0)}, learner_node=HERE))
    ShardPlan([A, B], FAR)  # no links: ranked by locality, nothing priced


def test_a_plan_prices_deliveries_from_the_links_to_the_declared_learner_node():
    """The learner on B (a server's node, not the measuring one): delivery from A is priced from A -> B, from B
    from B -> B, not from the links to the measuring node."""
    links = _measured_from_here()
    links.links[(A, B)] = LinkCost.constant(0.5)
    plan = ShardPlan([A, B], B, links=links, reuse=4.0)
    n = float(1 << 22)
    assert plan.cost(B, 0, n) == pytest.approx(n / 1e9 + 4.0 * n / 0.5e9)
    assert plan.cost(B, 1, n) == pytest.approx(n / 10e9 + 4.0 * n / 10e9)
    assert plan.order(B, n) == [1, 0]
