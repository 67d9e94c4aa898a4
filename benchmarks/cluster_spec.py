"""A described cluster for benchmarks/scaling.py's predictions, and where this machine is oversubscribed.

    spec = parse_cluster("cores=16, link=12.5GB/s, latency=5us")
    on_cluster(machine, spec, "rows:8;cols:16")  # the calibrated machine with the links of that mesh

A spec is comma-separated KEY=VALUE fields: `cores=N` or `gpus=N` (ranks per node, one per core or
GPU), `link` (a node's bandwidth to the network, one direction: B/s, KB/s, MB/s, GB/s, TB/s,
Kbit/s ... Tbit/s) and `latency` (what a message between nodes adds: s, ms, us, ns), all required;
`node_link` and `node_latency`, both or neither: α and β within a node (default: the calibrated
machine's own link). Every rank computes at the calibrated machine's rates. Ranks are numbered
row-major in mesh coordinates and fill nodes in order, so a mesh dim lies within a node when it and
the dims after it hold at most N ranks. A dim that crosses nodes has α = the node's α + `latency`
and β = the smaller of the node's β and `link` over the rings that leave a node at once (one per
coordinate of the dims after it): a ring runs at its slowest hop.
"""
from __future__ import annotations

import math
import os
import re
from typing import NamedTuple, Optional

from mpimesh.cost import Machine, with_links
from mpimesh.shape import Shape

BANDWIDTH = {"B/s": 1.0, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "TB/s": 1e12,
             "Kbit/s": 1e3 / 8, "Mbit/s": 1e6 / 8, "Gbit/s": 1e9 / 8, "Tbit/s": 1e12 / 8}
TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
DEFAULT = "cores=16, link=12.5GB/s, latency=5us"


class ClusterError(ValueError):
    """A spec that cannot be read; the message names the field."""


class Cluster(NamedTuple):
    """Nodes of `per_node` ranks (`unit`: "cores" or "gpus"), linked at `bandwidth` bytes/s with
    `latency` seconds per message; `node` = (α, β) within a node, None: the calibrated machine's."""
    per_node: int
    unit: str
    bandwidth: float
    latency: float
    node: Optional[tuple] = None

    def describe(self) -> str:
        """'nodes of 16 cores, 12.5 GB/s and 5 µs between nodes'."""
        inner = "" if self.node is None else \
            f"; within a node {fmt_bandwidth(self.node[1])}, {fmt_time(self.node[0])}"
        return (f"nodes of {self.per_node} {self.unit if self.per_node > 1 else self.unit[:-1]}, "
                f"{fmt_bandwidth(self.bandwidth)} and {fmt_time(self.latency)} between nodes{inner}")


def _quantity(field: str, text: str, units: dict) -> float:
    """'12.5GB/s' -> 1.25e10 in `units`; ClusterError naming `field` otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(\S*)\s*", text)
    if not m or m.group(2) not in units:
        raise ClusterError(f"--cluster: {field}={text.strip()!r} is not a number with a unit "
                           f"({', '.join(units)})")
    value = float(m.group(1)) * units[m.group(2)]
    if value <= 0 and field.endswith("link"):
        raise ClusterError(f"--cluster: {field}={text.strip()!r} must be > 0")
    return value


def parse_cluster(text: str) -> Cluster:
    """The `Cluster` a spec describes (see the module docstring).

    >>> parse_cluster("gpus=8, link=400Gbit/s, latency=2us")
    Cluster(per_node=8, unit='gpus', bandwidth=50000000000.0, latency=2e-06, node=None)
    """
    fields: dict = {}
    for part in (p for p in text.split(",") if p.strip()):
        key, eq, value = (s.strip() for s in part.partition("="))
        if not eq or not value:
            raise ClusterError(f"--cluster: {part.strip()!r} is not KEY=VALUE")
        if key not in ("cores", "gpus", "link", "latency", "node_link", "node_latency"):
            raise ClusterError(f"--cluster: unknown field {key!r} (fields: cores or gpus, link, latency, "
                               f"node_link, node_latency)")
        if key in fields:
            raise ClusterError(f"--cluster: field {key!r} given twice")
        fields[key] = value
    units = [k for k in ("cores", "gpus") if k in fields]
    missing = ([] if units else ["cores (or gpus)"]) + [k for k in ("link", "latency") if k not in fields]
    if missing or len(units) > 1 or ("node_link" in fields) != ("node_latency" in fields):
        raise ClusterError(f"--cluster {text!r}: " + (f"missing field{'s' * (len(missing) > 1)} {', '.join(missing)}"
                           if missing else "give cores or gpus, not both" if len(units) > 1 else
                           "give node_link and node_latency together"))
    unit = units[0]
    if not fields[unit].isdigit() or int(fields[unit]) < 1:
        raise ClusterError(f"--cluster: {unit}={fields[unit]!r} must be a positive integer (ranks per node)")
    node = None
    if "node_link" in fields:
        node = (_quantity("node_latency", fields["node_latency"], TIME),
                _quantity("node_link", fields["node_link"], BANDWIDTH))
    return Cluster(int(fields[unit]), unit, _quantity("link", fields["link"], BANDWIDTH),
                   _quantity("latency", fields["latency"], TIME), node)


def mesh_links(cluster: Cluster, mesh_shape) -> dict:
    """`{mesh dim: (crosses nodes, rings sharing a node's link)}` for `mesh_shape` on `cluster`.

    >>> mesh_links(parse_cluster(DEFAULT), "rows:8;cols:16")
    {'cols': (False, 1), 'rows': (True, 16)}
    """
    out, inner = {}, 1
    for d in reversed(list(Shape(mesh_shape))):
        out[d.name] = (inner * d.size > cluster.per_node, inner)
        inner *= d.size
    return out


def on_cluster(machine: Machine, cluster: Cluster, mesh_shape) -> Machine:
    """`machine` (per-rank compute and its own link) with every mesh dim of `mesh_shape` given the
    cluster's α and β (see the module docstring).

    >>> m = Machine(flops=1e9, latency=2e-5, bandwidth=5e9, memory=1e9)
    >>> on_cluster(m, parse_cluster("cores=4, link=1GB/s, latency=5us"), "rows:4;cols:2").links
    (('cols', 2e-05, 5000000000.0), ('rows', 2.5e-05, 500000000.0))
    """
    links = {}
    for d, (crosses, rings) in mesh_links(cluster, mesh_shape).items():
        alpha, beta = cluster.node if cluster.node is not None else machine.link(d)
        links[d] = (alpha + cluster.latency, min(beta, cluster.bandwidth / rings)) if crosses else (alpha, beta)
    return with_links(machine, links, name=f"{machine.name or 'machine'} on {cluster.describe()}")


def nodes(cluster: Cluster, ranks: int) -> int:
    """The nodes `ranks` ranks fill."""
    return math.ceil(ranks / cluster.per_node)


def usable_cores() -> int:
    """The CPUs this process may run on (`os.sched_getaffinity`; `os.cpu_count()` where that is missing)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def oversubscribed(ranks: int, cores: int) -> bool:
    """Whether `ranks` processes share fewer than `ranks` cores.

    >>> oversubscribed(2, 2), oversubscribed(4, 2)
    (False, True)
    """
    return ranks > cores


def fmt_bandwidth(b: float) -> str:
    """12.5e9 -> '12.5 GB/s'."""
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if b >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.3g} B/s"


def fmt_time(t: float) -> str:
    """5e-6 -> '5 µs'."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if t >= scale:
            return f"{t / scale:.3g} {unit}"
    return f"{t / 1e-9:.3g} ns"
