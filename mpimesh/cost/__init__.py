"""Cost model and automatic layouts: price a step's op trace on a machine, search layout rules.

`Machine` describes a rank's hardware (published `TPUV2`, `TPUV3`, `H100_NVLINK`, or measured by
`calibrate`); `record(fn, args, mesh, rules)` runs a step dry; `estimate` prices it in seconds and
bytes per rank; `pipeline_estimate` prices a pipeline over a mesh dim; `auto_layout` (also
`mm.auto_layout`) returns the fastest rules that fit as a `LayoutPlan`. More: docs/cost_model.md.

>>> import mpimesh as mm
>>> def step(x):
...     return mm.reduce_sum(mm.square(x))
>>> rec = record(step, [ArgSpec("batch:4096;d:256", "float32")], "rows:4", "batch:rows")
>>> e = estimate(rec, "d:rows", "rows:4", TPUV2)
>>> e["collectives"], e["bytes_per_rank"] == 4096 * 64 * 4 * 2 + 4
({'allreduce/rows': {'calls': 1, 'elements': 1, 'bytes': 4}}, True)
"""
from .calibrate import calibrate
from .machine import H100_NVLINK, TPUV2, TPUV3, Machine, with_links
from .model import (ArgSpec, OpCost, Recording, collective_seconds, estimate, from_program, from_trace,
                    op_seconds, record)
from .pipeline import pipeline_estimate
from .search import LayoutPlan, auto_layout

__all__ = ["Machine", "TPUV2", "TPUV3", "H100_NVLINK", "calibrate", "with_links", "ArgSpec", "Recording",
           "OpCost", "record", "from_trace", "from_program", "estimate", "collective_seconds", "op_seconds", "LayoutPlan",
           "auto_layout", "pipeline_estimate"]
