"""Runs one :class:`~potluck.engine.core.stage.Stage`'s work on a thread of its own.

Jobs and KV operations run strictly in submission order (the order that keeps every stage's
KV cache identical to plain decoding's). The submitting thread is free meanwhile: a strategy
drafts while the target verifies, a worker reads its socket while a batch computes.

Cancelling a job group skips its queued jobs and aborts its running one mid-compute through the
context's abort flag (llama.cpp then removes the batch's cells itself). Counters say which
happened, so tests prove the path ran instead of guessing from timings.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from .errors import PotluckError
from .jobs import CancelledGroups, DecodeJob, GroupCancelled
from .kv import KvOp
from .load_watch import INTERVAL_S, ThreadFollower
from .stage import Stage

log = logging.getLogger(__name__)

# What the queue holds: a batch, a KV operation, or a call on the stage in its place in the
# order (clearing the cache for a new conversation, reading positions once earlier work ran).
WorkItem = DecodeJob | KvOp | Callable[[Stage], object]


@dataclass
class RunnerCounters:
    finished: int = 0  # jobs computed to the end
    aborted: int = 0  # jobs stopped mid-compute by a cancel
    skipped: int = 0  # jobs of a cancelled group never started
    kv_ops: int = 0
    busy_s: float = 0.0  # time spent computing jobs (aborted ones included): stage utilisation


class StageRunner:
    """FIFO of jobs and KV operations for one stage, with cancellation by job group."""

    def __init__(
        self, stage: Stage, name: str = "stage", load_interval_s: float = INTERVAL_S, *, threaded: bool = True
    ) -> None:
        self.stage = stage
        self.counters = RunnerCounters()
        # Threads: those asked for (the context's at open, then set_threads) and, for a context
        # that follows the load, no more than the cores other processes leave free.
        self.follow = ThreadFollower(stage.ctx, stage.ctx.params.follow_load, load_interval_s, f"potluck-{name}")
        self._queue: collections.deque[tuple[WorkItem, Future]] = collections.deque()
        self._cond = threading.Condition()
        self._cancelled = CancelledGroups()
        self._running: int | None = None  # job group of the job computing now
        # last position per sequence after the latest item, read by other threads (a status
        # request must not read llama.cpp's KV metadata while a batch is writing it)
        self.positions: list[int] = stage.pos_max()
        self._closing = False
        self._last: Future | None = None  # the future of the latest submitted item
        # threaded=False: no queue thread; the owner calls run() in order itself (the stage
        # process, whose reading thread computes: one thread hand-off less a batch)
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._loop, name=f"potluck-{name}", daemon=True)
            self._thread.start()

    # -- any thread
    def submit(self, item: WorkItem) -> Future:
        """Queue a job (its future gives the stage's output array), a KV operation or a call."""
        fut: Future = Future()
        with self._cond:
            if self._closing:
                raise RuntimeError("runner is closed")
            self._queue.append((item, fut))
            self._last = fut
            self._cond.notify()
        return fut

    def idle(self) -> bool:
        """Whether everything submitted has finished (its future is done: the positions a
        finished item publishes are read before that, so nothing touches the stage now)."""
        with self._cond:
            return self._last is None or self._last.done()

    def run(self, item: WorkItem) -> Future:
        """Run ``item`` now, on the calling thread, as the queue would: a runner made with
        ``threaded=False`` (its owner reads its work in order), or an :meth:`idle` one.
        :meth:`cancel` still reaches it from any thread. The future is done on return."""
        fut: Future = Future()
        if not self.idle():
            raise RuntimeError("run() would overtake queued work")
        if self._closing:
            fut.set_exception(GroupCancelled("the stage is closing"))
            return fut
        self._execute(item, fut)
        return fut

    def renew(self) -> None:
        """A new owner: it numbers its job groups afresh (the last one's cancels say nothing of
        them) and counts from zero."""
        with self._cond:
            self._cancelled.clear()
            self.counters = RunnerCounters()

    def set_threads(self, n_threads: int) -> Future:
        """Threads from the next queued item on (still within the cores left free when the
        context follows the load)."""
        return self.submit(lambda _stage: self.follow.use(n_threads))

    def cancel(self, group: int, *more: int) -> None:
        """Skip the groups' queued jobs and abort the running one. Several groups are cancelled
        in one step: after an abort frees a group's cells, the next job must not start unless
        it is known to be cancelled too (its positions would no longer follow the cache's)."""
        groups = (group, *more)
        with self._cond:
            self._cancelled.add(groups)
            if self._running in groups:
                self.stage.ctx.request_abort()

    @property
    def running_group(self) -> int | None:
        return self._running

    def close(self) -> None:
        """Stop after the running item; queued work is dropped. The stage stays open."""
        with self._cond:
            self._closing = True
            if self._running is not None:
                self.stage.ctx.request_abort()
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for _, fut in self._queue:
            fut.cancel()
        self._queue.clear()

    # -- runner thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                item, fut = self._queue.popleft()
            self._execute(item, fut)

    def _execute(self, item: WorkItem, fut: Future) -> None:
        with self._cond:
            # a job with no rows is a placeholder that only keeps its place in the order
            skip = isinstance(item, DecodeJob) and (item.group in self._cancelled or item.n_tokens == 0)
            if isinstance(item, DecodeJob) and not skip:
                self._running = item.group
                self.stage.ctx.clear_abort()
        if isinstance(item, DecodeJob):
            self._run_job(item, fut, skip)
        else:
            self._run_other(item, fut)

    def _run_job(self, job: DecodeJob, fut: Future, skip: bool) -> None:
        if skip:
            self.counters.skipped += 1
            fut.set_exception(GroupCancelled(f"job group {job.group} was cancelled"))
            return
        self.follow.refresh()
        outcome: np.ndarray | BaseException
        t0 = time.perf_counter()
        try:
            outcome = self.stage.compute(job)
            self.counters.finished += 1
        except InterruptedError:
            self.counters.aborted += 1
            outcome = GroupCancelled(f"job group {job.group} was cancelled mid-compute")
        except BaseException as e:  # delivered to whoever waits for it
            outcome = e
        self.counters.busy_s += time.perf_counter() - t0
        with self._cond:
            self._running = None
        self._resolve(fut, outcome)

    def _run_other(self, item: KvOp | Callable[[Stage], object], fut: Future) -> None:
        outcome: object
        try:
            if isinstance(item, KvOp):
                self.stage.apply_kv(item)
                self.counters.kv_ops += 1
                outcome = None
            else:
                outcome = item(self.stage)
        except PotluckError as e:  # a refusal: whoever waits says it, or takes it (a kept slot gone: a miss)
            outcome = e
        except BaseException as e:
            log.error("%s failed: %s", item, e)
            outcome = e
        self._resolve(fut, outcome)

    def _resolve(self, fut: Future, outcome: object) -> None:
        """Publish the positions first: whoever the result wakes may ask for them."""
        self.positions = self.stage.pos_max()
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)
