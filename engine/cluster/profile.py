"""What a machine offers to the cluster: cores, free memory and a measured speed.

The planner divides layers by the speed, and turns a stage's weight bytes into seconds with
it: GB/s of weights through llama.cpp's own decode kernel, measured, never assumed
(docs/facts.md §6, §33).
"""

from __future__ import annotations

import functools
import os
import uuid
from dataclasses import dataclass

from ..core.matvec_probe import q4_0_matvec_gbps
from ..core.memory import free_memory_mb


@dataclass(frozen=True)
class NodeProfile:
    node_id: str
    cores: int
    free_mb: int  # MemAvailable, or less under a cgroup limit (core/memory.py)
    speed: float  # GB/s of Q4_0 weights through llama.cpp's matrix-vector product (measure_speed)


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def measure_speed(threads: int, trials: int = 120) -> float:
    """GB/s of Q4_0 weights through llama.cpp's matrix-vector product on the threads llama.cpp
    will use (:func:`~potluck.engine.core.matvec_probe.q4_0_matvec_gbps`): a decode step's own
    kernel, so hosts whose float and integer units compare differently are still ranked by
    how fast they decode. The best of ``trials`` (~2 ms each at 1 thread, ~0.4 s in all with
    the matrix's set-up): other processes competing for the cores, or cold pages, only slow a
    trial. At 1 thread over ten processes it came out 9.2-10.1 here, once 7.3 (docs/facts.md
    §33). Measured once per process and thread count: a head re-plans after a lost worker
    without measuring again."""
    return _speed(max(1, threads), trials)


@functools.cache
def _speed(threads: int, trials: int) -> float:
    return round(q4_0_matvec_gbps(threads, trials), 2)


def node_id() -> str:
    """A short random id for this worker run (zeroconf instance names must differ)."""
    return uuid.uuid4().hex[:12]


def measure_profile(threads: int, nid: str | None = None) -> NodeProfile:
    return NodeProfile(
        node_id=nid or node_id(),
        cores=usable_cores(),
        free_mb=free_memory_mb(),
        speed=measure_speed(threads),
    )
