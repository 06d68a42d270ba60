"""Timings the engine takes at run time to choose a plan (not benchmarks: those live in lab/)."""

from __future__ import annotations

import statistics
import time

from .runtime import Context, ContextParams, Model


def decode_ms_per_token(model: Model, n_threads: int, steps: int = 16) -> float:
    """Median single-token decode time after a short prompt (cost ratio of two models)."""
    with Context(model, ContextParams(n_ctx=256, n_threads=n_threads)) as ctx:
        ctx.run_tokens(list(range(100, 132)), 0)
        times = []
        for i in range(steps):
            t = time.perf_counter()
            ctx.run_tokens([100 + i], 32 + i)
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3
