"""The TPU adapter: replay an mpimesh op trace through JAX (`mm.tpu.replay`).

Importing mpimesh does not import JAX: it is imported when a replay is built
(`python3 install.py tpu` in a checkout). See `tpu/replay.py` for the two modes.

>>> MODES  # how a trace is replayed: per-device kernels, or the global program placed by XLA
('shard_map', 'gspmd')
"""
from .replay import MODES, Replay, ReplayError, replay

__all__ = ["MODES", "Replay", "ReplayError", "replay"]
