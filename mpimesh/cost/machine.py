"""Machines for the cost model: the `Machine` record and published figures (`calibrate` in
`mpimesh.cost.calibrate` measures one).

A `Machine` gives, per rank (processor): peak matmul FLOP/s, the latency α (seconds per
collective call) and bandwidth β (bytes/s per link) of the α-β model, memory in bytes, and
optionally the memory bandwidth that elementwise ops (and skinny matmuls) are bound by, fixed
per-op costs (an eager framework's dispatch), and α, β per mesh dim (`links`).

>>> m = Machine(flops=1e12, latency=1e-5, bandwidth=1e9, memory=2**30, links=(("rows", 2e-5, 5e8),))
>>> m.link("rows"), m.link("cols")
((2e-05, 500000000.0), (1e-05, 1000000000.0))
>>> TPUV2.flops * 512 / 1e15  # the Mesh-TensorFlow paper's 512-core pod: 11.5 PFLOP/s
11.52
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

from ..errors import MpimeshError


_POSITIVE = ("flops", "bandwidth", "memory", "memory_bandwidth")


def number(what: str, value, positive: bool, infinite: bool = False) -> float:
    """`value` as a float: a real number (TypeError otherwise), > 0 where `positive` else >= 0,
    finite unless `infinite` (MpimeshError otherwise); `what` names it in the errors."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number, got {value!r} ({type(value).__name__})")
    v = float(value)
    if not (v > 0 if positive else v >= 0) or (v == math.inf and not infinite):
        raise MpimeshError(f"{what} must be {'> 0' if positive else '>= 0'}{'' if infinite else ' and finite'}, "
                           f"got {value!r}")
    return v


@dataclass(frozen=True)
class Machine:
    """Hardware, per rank, for `estimate`; the constructor takes the fields below, by the same names."""

    flops: float
    """Peak FLOP/s of a large matmul (in the dtype the step computes in)."""
    latency: float
    """α, seconds per collective call (the default for mesh dims not in `links`)."""
    bandwidth: float
    """β, bytes/s per link (the default for mesh dims not in `links`)."""
    memory: float
    """Bytes of memory."""
    memory_bandwidth: float = math.inf
    """Bytes/s of memory traffic: an elementwise op's time is its bytes in and out over it; a
    matmul's time is its FLOPs at `flops` or its bytes at this, whichever is longer (the roofline:
    skinny matmuls are bound by memory)."""
    op_overhead: float = 0.0
    """Seconds every op costs on top (an eager framework's dispatch; 0 on hardware whose steps are
    compiled)."""
    einsum_overhead: float = 0.0
    """Seconds every einsum costs on top, instead of `op_overhead` (so a small matmul runs below
    peak: Hockney's half-performance size is `einsum_overhead * flops`)."""
    links: tuple = field(default=())
    """`((mesh_dim, latency, bandwidth), ...)`: measured α and β of some mesh dims."""
    name: str = ""
    """A label: `"TPUv2 core"`."""

    def __post_init__(self):
        for k in ("flops", "latency", "bandwidth", "memory", "memory_bandwidth", "op_overhead", "einsum_overhead"):
            object.__setattr__(self, k, number(f"Machine: {k}", getattr(self, k), k in _POSITIVE,
                                               infinite=k == "memory_bandwidth"))
        if not isinstance(self.name, str):
            raise TypeError(f"Machine: name must be a str, got {self.name!r} ({type(self.name).__name__})")
        if not isinstance(self.links, (tuple, list)):
            raise TypeError(f"Machine: links must be a tuple of (mesh_dim, latency, bandwidth), got {self.links!r}")
        links = []
        for i, link in enumerate(self.links):
            if not isinstance(link, (tuple, list)) or len(link) != 3 or not isinstance(link[0], str) or not link[0]:
                raise TypeError(f"Machine: links[{i}] must be (mesh_dim, latency, bandwidth) with mesh_dim a "
                                f"name, got {link!r}")
            if any(d == link[0] for d, _, _ in links):
                raise MpimeshError(f"Machine: links name mesh dim {link[0]!r} twice")
            links.append((link[0], number(f"Machine: links[{i}] ({link[0]!r}) latency", link[1], False),
                          number(f"Machine: links[{i}] ({link[0]!r}) bandwidth", link[2], True)))
        object.__setattr__(self, "links", tuple(links))

    def link(self, mesh_dim: str) -> tuple[float, float]:
        """`(α, β)` of `mesh_dim`: its measured link, else the machine's defaults."""
        for d, a, b in self.links:
            if d == mesh_dim:
                return a, b
        return self.latency, self.bandwidth

    def group(self, mesh_dims: Iterable[str]) -> tuple[float, float]:
        """`(α, β)` of a collective over several mesh dims at once: the slowest dim's (the
        largest α, the smallest β)."""
        links = [self.link(d) for d in mesh_dims] or [(self.latency, self.bandwidth)]
        return max(a for a, _ in links), min(b for _, b in links)


# --------------------------------------------------------------------------- published machines
# Figures are per core (TPU: a chip has 2 cores, which share its links) or per GPU, from:
#  [MTF]  Shazeer et al., "Mesh-TensorFlow: Deep Learning for Supercomputers", NeurIPS 2018, sec. 9:
#         "a 512-core TPUv2 cluster ... 11.5 petaflops" (peak), i.e. 22.5 TFLOP/s per core.
#  [TPU]  Jouppi et al., "A Domain-Specific Supercomputer for Training Deep Neural Networks",
#         CACM 63(7), 2020, Table 3: TPUv2 chip 46 TFLOP/s bf16, 16 GiB HBM at 700 GB/s, 4 ICI
#         links of 496 Gbit/s; TPUv3 chip 123 TFLOP/s, 32 GiB HBM at 900 GB/s, 4 ICI links of
#         656 Gbit/s. (Google Cloud's TPU docs give 45 and 123 TFLOP/s, 8 and 16 GiB per core.)
#  [H100] NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOP/s dense bf16 (1979 with
#         sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 4 at 900 GB/s total (both directions) per GPU.
# Not published, assumed (each a guess, said here so the simulation can be read with it): α, the
# per-collective latency: 5 µs per ICI collective call, 10 µs per NCCL call over NVLink (NCCL's
# small-message allreduce latency on one node is of that order). β is one direction of one link:
# a ring over a mesh dim of a TPU torus runs over one link per direction, shared by the chip's 2 cores,
# and a bidirectional ring uses both directions, so one link's one-way rate per core; on NVLink the
# 900 GB/s is 450 GB/s per direction, all of which a ring allreduce through NVSwitch can use.

TPUV2 = Machine(flops=11.52e15 / 512, latency=5e-6, bandwidth=496e9 / 8 / 2, memory=8 * 2**30,
                memory_bandwidth=700e9 / 2, name="TPUv2 core")
"""One TPUv2 core: 22.5 TFLOP/s bf16 [MTF], 8 GiB HBM [TPU], 350 GB/s HBM (700 per chip)
[TPU], β = 31 GB/s (a 496 Gbit/s ICI link, 62 GB/s, shared by the chip's 2 cores) [TPU], α = 5 µs
(assumed)."""

TPUV3 = Machine(flops=123e12 / 2, latency=5e-6, bandwidth=656e9 / 8 / 2, memory=16 * 2**30,
                memory_bandwidth=900e9 / 2, name="TPUv3 core")
"""One TPUv3 core: 61.5 TFLOP/s bf16 (123 per chip of 2 cores) [TPU], 16 GiB HBM, 450 GB/s HBM
(900 per chip), β = 41 GB/s (a 656 Gbit/s ICI link, 82 GB/s, shared by 2 cores) [TPU], α = 5 µs
(assumed)."""

H100_NVLINK = Machine(flops=989e12, latency=10e-6, bandwidth=450e9, memory=80e9, memory_bandwidth=3.35e12,
                      name="H100 SXM in an 8-GPU NVLink node")
"""One H100 SXM of an 8-GPU NVLink/NVSwitch node: 989 TFLOP/s dense bf16, 80 GB HBM3 at
3.35 TB/s, β = 450 GB/s (NVLink 4: 900 GB/s per GPU, both directions) [H100], α = 10 µs
(assumed). A node only: across nodes the links are InfiniBand, far slower."""


def with_links(machine: Machine, links: Optional[dict] = None, **changes) -> Machine:
    """`machine` with some fields changed and `links` (`{mesh_dim: (α, β)}`) added or replaced.

    >>> with_links(TPUV2, {"rows": (1e-6, 1e9)}).link("rows")
    (1e-06, 1000000000.0)
    """
    merged = {d: (a, b) for d, a, b in machine.links}
    merged.update(links or {})
    return replace(machine, links=tuple((d, a, b) for d, (a, b) in merged.items()), **changes)
