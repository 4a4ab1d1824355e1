"""Placement: which device runs which stage of a model, chosen by a cost model.

Examples
--------
>>> from tfnb.models import tiny
>>> from tfnb.placement import Topology, plan
>>> topo = Topology(["a", "b"], memory="250kB", flops=[1e9, 4e9])
>>> p = plan(tiny("llama"), topo, mode="optimal", context_len=16)
>>> sorted(set(p.assignment.values()))
['a', 'b']
"""
from tfnb.names import OBJECTIVES, PLAN_MODES, PLANNERS
from tfnb.placement.apply import place
from tfnb.placement.cost import DEFAULT_CONTEXT_LEN, Prediction, Topology, parse_bytes, predict
from tfnb.placement.measure import clear_cache, measure_topology
from tfnb.placement.plan import Plan, PlanDiff, Segment
from tfnb.placement.planners import (
    as_topology,
    describe_cluster,
    greedy_assignment,
    memory_assignment,
    optimal_assignment,
    plan,
    replica_groups,
)

__all__ = ["DEFAULT_CONTEXT_LEN", "OBJECTIVES", "PLANNERS", "PLAN_MODES", "Plan", "PlanDiff",
           "Prediction", "Segment", "Topology", "as_topology", "clear_cache", "describe_cluster",
           "greedy_assignment", "measure_topology", "memory_assignment", "optimal_assignment",
           "parse_bytes", "place", "plan", "predict", "replica_groups"]
