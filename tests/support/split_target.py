"""A model split by layer ranges, run as a pipeline of stages inside this process (tests only).

Each stage (a GGUF slice from :func:`potluck.engine.core.gguf_tools.slice_layers`) has its own context, KV cache
and :class:`~potluck.engine.core.runner.StageRunner` thread, so consecutive jobs overlap across stages exactly
as they do across the machines of a cluster. The stages are the same :class:`~potluck.engine.core.stage.Stage`
a cluster worker runs; this target is how the tests check a split at the logits level without a
network.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import Future

import numpy as np

from potluck.engine.core.jobs import DecodeJob, Ticket
from potluck.engine.core.kv import KvOp
from potluck.engine.core.runner import StageRunner, WorkItem
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.stage import Stage
from potluck.engine.core.target import TargetBase


class SplitTarget(TargetBase):
    """A :class:`~potluck.engine.core.target.Target` whose stages pass hidden states from one thread to the next."""

    def __init__(self, models: Sequence[Model], params: ContextParams | None = None) -> None:
        super().__init__()
        params = params or ContextParams()
        last = len(models) - 1
        self.stages = [Stage(m, first=i == 0, last=i == last, params=params) for i, m in enumerate(models)]
        self.runners = [StageRunner(s, name=f"stage{i}") for i, s in enumerate(self.stages)]
        self.n_vocab = models[0].n_vocab
        self.n_ctx = min(s.n_ctx for s in self.stages)
        self.n_batch = params.n_batch
        self.n_seq_max = self.stages[0].n_seq_max
        self.n_stages = len(self.stages)
        self.recurrent = models[0].recurrent
        self._pending: dict[int, Future] = {}
        self._seq = itertools.count(1)

    def submit(self, job: DecodeJob) -> Ticket:
        self.stages[0].check(job)
        done: Future = Future()
        self._forward(0, job, done)
        seq_no = next(self._seq)
        self._pending[seq_no] = done
        return Ticket(job.group, seq_no)

    def _forward(self, i: int, job: DecodeJob, done: Future) -> None:
        """Queue ``job`` on stage ``i``; its output becomes stage ``i+1``'s input (in the
        runner thread of stage ``i``, so per-stage order is submission order)."""

        def next_stage(fut: Future) -> None:
            err = fut.exception()
            if err is not None:
                done.set_exception(err)  # a skipped or aborted run goes no further
            elif i == len(self.runners) - 1:
                done.set_result(fut.result())
            else:
                hidden = DecodeJob(job.group, fut.result(), job.positions, job.seq_ids, job.outputs)
                self._forward(i + 1, hidden, done)

        self.runners[i].submit(job).add_done_callback(next_stage)

    def _wait(self, ticket: Ticket) -> np.ndarray:
        return self._pending.pop(ticket.seq_no).result()

    def poll(self, ticket: Ticket) -> bool:
        return self._pending[ticket.seq_no].done()

    def cancel(self, group: int, *more: int) -> None:
        for runner in self.runners:
            runner.cancel(group, *more)

    def kv(self, op: KvOp) -> None:
        self.stages[0].ctx.check_kv(op)
        self._forward_kv(0, op)

    def _forward_kv(self, i: int, op: WorkItem) -> None:
        fut = self.runners[i].submit(op)
        if i + 1 < len(self.runners):
            fut.add_done_callback(lambda _f: self._forward_kv(i + 1, op))

    def reset(self) -> None:
        self._forward_kv(0, Stage.clear)
        self._n_past = 0
        self._spans.clear()

    def pos_max(self) -> list[list[int]]:
        """Last position per sequence on every stage, once all work queued so far ran."""
        return [r.submit(Stage.pos_max).result() for r in self.runners]

    def close(self) -> None:
        for runner, stage in zip(reversed(self.runners), reversed(self.stages)):
            runner.close()
            stage.close()

