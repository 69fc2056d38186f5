"""The scale simulator (a SIMULATION, not a measurement): Conduit's experience path on declared clusters.

A discrete-event simulation of one training iteration on clusters of declared node
topologies (``conduit/placement/topologies/``) joined by a declared network, driving the
same placement planner and cost model as :mod:`conduit.placement` (core's model prices each
node; :mod:`.planning` adds the cluster: network cards, serving other nodes, multi-node
pricing). ``conduit simulate`` runs the paper's two scaling experiments and writes a table
and a plot.
"""

from conduit.simulation.cluster import NETWORKS, SCENARIOS, Network, Scenario
from conduit.simulation.engine import Simulation, Task
from conduit.simulation.model import (
    ReplayWorkload,
    ScalePoint,
    equivalent_specs,
    run_scenario,
    simulate_iteration,
    simulate_scale,
)
from conduit.simulation.planning import ClusterCostModel, ClusterPlanner, ServeSteps, uniform_view

__all__ = [
    "Simulation",
    "Task",
    "Network",
    "NETWORKS",
    "Scenario",
    "SCENARIOS",
    "ReplayWorkload",
    "ScalePoint",
    "simulate_iteration",
    "simulate_scale",
    "run_scenario",
    "equivalent_specs",
    "ClusterPlanner",
    "ClusterCostModel",
    "ServeSteps",
    "uniform_view",
]
