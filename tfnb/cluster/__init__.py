"""Cluster layer: spec parsing, local worker processes, connecting, health, security."""
from tfnb.cluster.connect import Cluster, connect, current, local
from tfnb.cluster.local import LocalCluster
from tfnb.cluster.security import ExposedServerWarning, LoopbackGuard, listening_scope
from tfnb.cluster.spec import ClusterSpec, parse_spec
from tfnb.cluster.status import ClusterStatus

__all__ = ["Cluster", "ClusterSpec", "ClusterStatus", "ExposedServerWarning", "LocalCluster",
           "LoopbackGuard", "connect", "current", "listening_scope", "local", "parse_spec"]
