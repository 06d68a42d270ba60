"""The head's own stage: the output layer, after the workers.

Why: a row of logits is n_vocab floats (SmolLM2: 196 kB a token), a hidden state n_embd
(2.3 kB). So the last worker returns hidden states and the head computes the logits. llama.cpp
loads no model of 0 layers, so the output norm and matrix stand behind layers of zeros, each
adding exactly 0 to the residual stream (:func:`.plan.head_zeroed_layers`; a mixture's cut to
one expert): a slice run in this process by the same :class:`~potluck.engine.core.stage.Stage`
and :class:`~potluck.engine.core.runner.StageRunner` as a local target. Those layers keep a
KV cache, so they take every row of a batch, not only the output rows.

Order: this is the chain's last stage, so it applies every transaction in ``txn`` order, as
a worker does. A batch waits here until its hidden states come back from the last worker
(or is dropped when they come back skipped); KV operations and resets are ready at once but
wait behind earlier batches. Ready items go to the runner only from the front of the queue.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.errors import PotluckError
from ..core.jobs import DecodeJob
from ..core.kv import KvOp
from ..core.runner import StageRunner, WorkItem
from ..core.runtime import ContextParams, Model
from ..core.stage import Stage
from .child import check_kv_positions


@dataclass
class _Waiting:
    txn: int
    ticket: int  # the head's ticket of a batch; 0 for a KV operation or a reset
    work: WorkItem | None  # None: a batch whose hidden states have not come back yet
    job: DecodeJob | None = None
    dropped: bool = False  # skipped or refused upstream: it never reaches this stage


def _refuse(why: str) -> Callable[[Stage], object]:
    def item(_stage: Stage) -> object:
        raise PotluckError(why)
    return item


class HeadTail:
    """The output layer on the head, fed in transaction order.

    Owned by the head's socket thread, except :meth:`cancel` (any thread). Finished work is
    signalled on :attr:`wake_fd`, which the head's poller watches, so a result wakes it at once.
    """

    def __init__(self, path: Path, layers: tuple[int, int], params: ContextParams) -> None:
        self.layers = layers
        self.model = Model(path, mapped=False)  # read in: mapped, it peaked at twice its size
        try:
            self.stage = Stage(self.model, first=False, last=True, params=params)
        except BaseException:
            self.model.close()
            raise
        self.runner = StageRunner(self.stage, name="head-tail")
        self.n_embd = self.model.n_embd
        self.n_ctx = self.stage.n_ctx
        self._queue: collections.deque[_Waiting] = collections.deque()
        self._batches: dict[int, _Waiting] = {}  # txn -> batch still waiting for hidden states
        self._running: collections.deque[tuple[int, Future]] = collections.deque()  # (ticket, future)
        self._closed = False
        self.ran_here = 0  # batches computed on the waiting caller's thread (arrived(now=True))
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @property
    def wake_fd(self) -> int:
        return self._wake_r

    def expect(self, txn: int, ticket: int, job: DecodeJob) -> None:
        """Batch ``txn`` went down the chain: its place here is taken now."""
        item = _Waiting(txn, ticket, None, job)
        self._queue.append(item)
        self._batches[txn] = item

    def apply(self, txn: int, work: KvOp | Callable[[Stage], object]) -> None:
        """A KV operation or a call on the stage (a reset), in its place after earlier batches."""
        if isinstance(work, KvOp):
            try:
                check_kv_positions(work, self.n_ctx)
            except PotluckError as e:
                work = _refuse(str(e))
        self._queue.append(_Waiting(txn, 0, work))
        self._pump()

    def arrived(self, txn: int, hidden: np.ndarray, *, now: bool = False) -> None:
        """The last worker's hidden states of batch ``txn`` (shape checked by the head).
        ``now``: the caller waits for this batch, so if the runner is idle it computes here,
        on the caller's thread (two thread wake-ups less a token: synchronous decoding)."""
        item = self._batches.pop(txn, None)
        if item is None or item.job is None:
            return  # not a batch of this chain: nothing to compute
        job = item.job
        full = DecodeJob(job.group, hidden.astype(np.float32, copy=False), job.positions, job.seq_ids, job.outputs)
        try:
            self.stage.check(full)
            item.work = full
        except PotluckError as e:
            item.work = _refuse(str(e))
        self._pump(now=now)

    def drop(self, txn: int) -> int | None:
        """Batch ``txn`` came back skipped (cancelled or refused upstream): nothing to compute.
        The job group it was sent under (None: not a batch waiting here)."""
        item = self._batches.pop(txn, None)
        if item is None or item.job is None:
            return None
        item.dropped = True
        self._pump()
        return item.job.group

    def cancel(self, group: int, *more: int) -> None:
        """Skip the groups' queued batches here and abort the running one (any thread)."""
        self.runner.cancel(group, *more)

    def finished(self) -> list[tuple[int, Future]]:
        """(ticket, future) of the work done since the last call, in order (ticket 0: KV or reset)."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        done = []
        while self._running and self._running[0][1].done():
            done.append(self._running.popleft())
        return done

    def restart(self) -> list[tuple[int, Future]]:
        """Before a replay: let the runner finish what it holds (returned, as :meth:`finished`),
        forget batches still waiting for hidden states (the replay sends them again), and clear
        the cache: the replay then rebuilds it exactly as the workers' (recovery.py)."""
        self.runner.submit(lambda _stage: None).result()
        done = [*self.finished(), *self._running]
        self._running.clear()
        self._queue.clear()
        self._batches.clear()
        self.runner.submit(Stage.forget_all).result()
        return done

    def close(self) -> None:
        """Stop the runner and free the context and weights (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        self.runner.close()
        self.stage.close()
        self.model.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _pump(self, now: bool = False) -> None:
        """Send ready items to the runner, from the front only: order is every stage's. With
        ``now``, the last ready item runs on this thread if nothing is queued before it."""
        while self._queue and (self._queue[0].work is not None or self._queue[0].dropped):
            item = self._queue.popleft()
            if item.dropped or item.work is None:
                continue
            last_ready = not self._queue or (self._queue[0].work is None and not self._queue[0].dropped)
            # Here only on one thread: a team of OpenMP threads on a second thread of the
            # head would slow every batch of both by ~40 % (runtime.Context.compute_threads).
            if now and last_ready and self.runner.follow.threads == 1 and self.runner.idle():
                fut = self.runner.run(item.work)
                self.ran_here += 1
            else:
                fut = self.runner.submit(item.work)
                fut.add_done_callback(self._wake)
            self._running.append((item.ticket, fut))

    def _wake(self, _fut: Future) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # full (the head will look anyway) or closing
            pass
