"""A worker's stage: what it checks before loading a slice, and the loaded stage itself.

The worker's socket thread (worker.py) decides whose ``load`` to take; this module decides
whether this machine can take it (memory, architecture) and loads it in a supervised child
process (child.py), so a slice that crashes llama.cpp costs that child only.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import PotluckError
from ..core.memory import process_rss_bytes
from . import wire
from .child import StageInfo, StageProcess, StageSpec
from .plan import kv_cells, layer_costs, stage_mem_mb
from .profile import free_memory_mb
from .slice_seal import Seal

LOAD_TIMEOUT_S = 300.0


class LoadedStage:
    """A cached slice loaded as one stage in a child process (see child.py)."""

    def __init__(self, proc: StageProcess, load: wire.Load, info: StageInfo, seal: Seal | None = None) -> None:
        self.proc = proc
        self.load = load
        self.info = info
        self.seal = seal  # the slice file as loaded: a kept stage is taken over only while it is unchanged

    def close(self) -> None:
        self.proc.close()


@dataclass
class KeptStage:
    """A stage its head released, still loaded until ``until`` (monotonic s) for a head that
    loads the same slice with the same settings; ``mb``: what ending it gives back
    (:func:`held_mb`, read when it was released: an idle stage does not grow)."""

    stage: LoadedStage
    until: float
    mb: float


def held_mb(stage: LoadedStage, planned_mb: float) -> float:
    """What ending ``stage`` gives back: its process's resident memory, or the planner's figure
    where that is more. A stage holds more than planned (its mapped slice, llama.cpp's buffers,
    the interpreter): offering only the plan's figure left a 4.9 GB worker that had run an
    8-layer stage of 4,086 MB planned short of that same stage for the next head."""
    return max(planned_mb, process_rss_bytes(stage.proc.proc.pid) / (1 << 20))


def stage_memory_mb(path: Path, load: wire.Load) -> tuple[float, str | None]:
    """(MB a stage of this slice needs under ``load``'s limits, why this worker does not load
    it or None), from the header: the planner's own figure (:func:`.plan.stage_bytes`) over
    the slice's layers, and its architecture's rules (core/archs.py)."""
    costs = layer_costs(path)  # one read of the header per file version
    cells = kv_cells(load.n_ctx, load.n_seq_max, load.kv_unified)
    return stage_mem_mb(costs, 0, costs.n_layer, cells, load.n_batch, load.n_ctx), costs.unsplittable


def check_load(path: Path, msg: wire.Load) -> None:
    """Refuse what this machine cannot or should not load, before a process maps it."""
    try:
        need_mb, why = stage_memory_mb(path, msg)
    except Exception as e:  # a header that does not parse: not a slice we load
        raise PotluckError(f"slice {msg.sha256[:12]} is not a readable GGUF ({type(e).__name__})") from None
    if why is not None:
        raise PotluckError(f"this worker does not load the slice: {why}")
    free = free_memory_mb()
    if need_mb > free:
        raise PotluckError(
            f"this stage needs about {need_mb:,.0f} MB (n_ctx {msg.n_ctx}, n_batch {msg.n_batch}, "
            f"{msg.n_seq_max} sequence(s)) but this worker has {free:,} MB free; lower --ctx"
        )


def load_stage(proc: StageProcess, path: Path, msg: wire.Load, n_threads: int) -> LoadedStage:
    """Load the slice at ``path`` in ``proc`` as ``msg`` asks; raises :class:`PotluckError`
    (a corrupt slice is deleted, so the head sends it again) or :class:`.child.StageCrashed`."""
    spec = StageSpec(str(path), msg.sha256, msg.first, msg.n_ctx, msg.n_batch,
                     msg.n_seq_max, msg.kv_unified, n_threads)
    try:
        info = proc.load(spec, LOAD_TIMEOUT_S)
    except PotluckError as e:
        if "does not match its sha256" in str(e):
            path.unlink(missing_ok=True)  # corrupted on disk: the head sends it again
        raise
    stage = LoadedStage(proc, msg, info, Seal.of(path, msg.sha256))
    if info.n_layer != msg.layer_hi - msg.layer_lo:
        stage.close()
        raise PotluckError("slice layer count does not match the requested range")
    return stage


class Handback:
    """Finished stage work and stage crashes, collected while the worker's socket thread reads
    its stage process's replies (:meth:`.child.StageProcess.take_replies` runs the futures'
    callbacks there) and sent on right after, in order."""

    def __init__(self) -> None:
        self._done: collections.deque[tuple[LoadedStage, wire.WireMessage, Future]] = collections.deque()
        self._crashed: collections.deque[tuple[StageProcess, str]] = collections.deque()

    def finished(self, stage: LoadedStage, msg: wire.WireMessage, fut: Future) -> None:
        """``msg``'s work on ``stage`` ended (in txn order)."""
        self._done.append((stage, msg, fut))

    def crashed(self, proc: StageProcess, why: str) -> None:
        """The stage process died."""
        self._crashed.append((proc, why))

    def take(self) -> tuple[list[tuple[LoadedStage, wire.WireMessage, Future]], list[tuple[StageProcess, str]]]:
        """Everything handed back so far (finished work, then crashes)."""
        done, crashed = list(self._done), list(self._crashed)
        self._done.clear()
        self._crashed.clear()
        return done, crashed

    def forget_finished(self) -> None:
        """The stage was released; its finished work goes nowhere."""
        self._done.clear()
