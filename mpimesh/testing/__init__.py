"""Test fixtures shared by mpimesh's tests and benchmarks: `Cluster`, hosts in network namespaces
on one machine with MPI over TCP between them (`mpimesh.testing.cluster`).

>>> from mpimesh.testing import Cluster, unavailable
>>> Cluster.addresses(2)
['10.77.0.1', '10.77.0.2']
"""
from .cluster import Cluster, cleanup_leftovers, namespaces, tool, unavailable

__all__ = ["Cluster", "cleanup_leftovers", "namespaces", "tool", "unavailable"]
