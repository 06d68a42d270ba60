"""What a machine offers to the cluster: cores, free memory and a measured speed score.

The planner divides layers by the speed score, so it only has to be proportional to how
fast this machine runs llama.cpp layers; it is measured, never assumed (docs/facts.md §6).
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass

import numpy as np

from ..core.memory import free_memory_mb


@dataclass(frozen=True)
class NodeProfile:
    node_id: str
    cores: int
    free_mb: int  # MemAvailable, or less under a cgroup limit (core/memory.py)
    speed: float  # arbitrary units, proportional to the expected layer throughput


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def measure_speed(threads: int, trials: int = 40) -> float:
    """Single-core multiply-add throughput (GFLOP/s) times the threads llama.cpp will use.

    A decode step streams weights through multiply-adds; numpy's elementwise kernels are
    single-threaded, so this measures one core. The best of several short trials is kept,
    so that other processes competing for the cores (or a cold cache) do not skew it: 40 of
    them (~0.07 s), since the best of 15 still came out 3.9-7.2 on one quiet core where 40
    gave 5.5-7.5 (docs/facts.md §33).
    """
    rng = np.random.default_rng(0)
    a = rng.standard_normal(1 << 18, dtype=np.float32)  # 1 MiB: the size of a weight tile
    b = rng.standard_normal(1 << 18, dtype=np.float32)
    out = np.empty_like(a)
    best = float("inf")
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(8):
            np.multiply(a, b, out=out)
            np.add(out, a, out=out)
        best = min(best, time.perf_counter() - t0)
    gflops = 2 * 8 * a.size / best / 1e9
    return round(gflops * max(1, threads), 2)


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
