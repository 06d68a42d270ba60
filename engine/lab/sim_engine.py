"""The simulator's event engine: stages in a chain, links, the head's output layer and
processor sharing over the cores (see :mod:`.simulate` for the model). The head loop
(:mod:`.sim_head`) drives it through :meth:`Engine.submit`, :meth:`Engine.cancel` and
:meth:`Engine.ready`."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

from .sim_config import SimConfig, batch_cost_fn


@dataclass
class Counters:
    runs: int = 0  # runs sent after the prompt
    speculative_runs: int = 0
    cancelled: int = 0  # runs cancelled on a rejected guess
    wasted: int = 0  # runs computed on a rejected guess (no cancellation)
    skipped: int = 0  # stage jobs skipped (cancelled before they started, or empty)
    aborted: int = 0  # stage jobs stopped mid-compute
    drafted: int = 0
    accepted: int = 0
    declines: int = 0  # times the cutoff stopped speculation
    max_in_flight: int = 0
    max_computing: int = 0  # most activities computing at once (stages, head output layer, head loop)


@dataclass
class _Msg:
    run: int
    n: int  # tokens
    rows: int  # rows the head gets back (a prompt chunk returns none but its last)
    prefill: bool = False
    empty: bool = False


@dataclass
class _Task:
    """One computing activity: ``work`` ms left at full speed as of ``since``."""

    work: float
    since: float
    done: Callable[..., None]
    args: tuple
    version: int = 0  # invalidates a finish event that an abort or a rate change moved


class _Cores:
    """Processor sharing over ``cores`` cores (0: as many as there are activities):
    while k activities compute, each progresses at min(1, cores / k)."""

    def __init__(self, eng: Engine, cores: int) -> None:
        self.eng = eng
        self.cores = cores
        self.active: list[_Task] = []
        self.rate = 1.0
        self.contended_ms = 0.0  # time with more activities than cores
        self._since = 0.0  # when contended_ms was last brought up to date

    def start(self, work: float, done: Callable[..., None], *args: object) -> _Task:
        task = _Task(work, self.eng.now, done, args)
        self._changed(len(self.active) + 1)
        self.active.append(task)
        self._schedule(task)
        c = self.eng.counters
        c.max_computing = max(c.max_computing, len(self.active))
        return task

    def set_work(self, task: _Task, work: float) -> None:
        """The task now has ``work`` ms left (a stage that polls its abort flag)."""
        task.work, task.since = work, self.eng.now
        self._schedule(task)

    def contended_until_now(self) -> float:
        now = self.eng.now
        return self.contended_ms + (now - self._since if self.rate < 1.0 else 0.0)

    def _schedule(self, task: _Task) -> None:
        task.version += 1
        self.eng._at(self.eng.now + task.work / self.rate, self._finish, task, task.version)

    def _finish(self, task: _Task, version: int) -> None:
        if version != task.version:
            return
        self.active.remove(task)
        self._changed(len(self.active))
        task.done(*task.args)

    def _changed(self, k: int) -> None:
        """``k`` activities compute from now on: where that changes the rate, bring the
        work of those in :attr:`active` up to date and move their finish events."""
        now = self.eng.now
        rate = min(1.0, self.cores / k) if self.cores and k else 1.0
        if rate == self.rate:
            return
        if self.rate < 1.0:
            self.contended_ms += now - self._since
        self._since = now
        for task in self.active:
            task.work = max(0.0, task.work - (now - task.since) * self.rate)
            task.since = now
        self.rate = rate
        for task in self.active:
            self._schedule(task)


@dataclass
class _Stage:
    ms: float
    queue: deque[_Msg] = field(default_factory=deque)
    current: _Msg | None = None
    task: _Task | None = None  # the current job's compute
    started: float = 0.0
    busy_ms: float = 0.0
    cancelled: set[int] = field(default_factory=set)  # runs whose cancel reached this stage


BUSY, WAIT = 0, 1
Action = tuple[int, float]  # (BUSY, ms) or (WAIT, run id)


class Engine:
    """The event engine: stages, links and the head's output layer, all computing on
    :class:`_Cores`. The head loop drives it through :meth:`submit`, :meth:`cancel` and
    :meth:`ready`; its own drafting and sampling compute on the same cores."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.cost = batch_cost_fn(cfg.batch_cost)
        self.stages = [_Stage(ms) for ms in cfg.stage_ms]
        self.total_ms = sum(cfg.stage_ms) or 1.0
        self.link_free = [0.0] * (len(self.stages) + 1)  # head->s1, ..., sN->head
        self.head_queue: deque[tuple[int, float]] = deque()  # the head's output-layer runner: (run, ms)
        self.head_busy = False
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = 0
        self._arrived: set[int] = set()
        self._next_run = 0
        self._waiting: int | None = None
        self._loop: Generator[Action, None, None] | None = None
        self.done = False
        self.counters = Counters()
        self.cores = _Cores(self, cfg.cores)

    # --- the head's side ---
    def submit(self, n: int, prefill: bool = False) -> int:
        """Send a run of ``n`` tokens; a prompt chunk returns only its last row."""
        run = self._next_run
        self._next_run += 1
        self._send(0, _Msg(run, n, 1 if prefill else n, prefill))
        return run

    def cancel(self, run: int) -> None:
        for i in range(len(self.stages)):
            self._at(self.now + self.cfg.latency_ms, self._cancel_reaches, i, run)

    def ready(self, run: int) -> bool:
        return run in self._arrived

    def run(self, loop: Generator[Action, None, None], max_events: int = 20_000_000) -> None:
        self._loop = loop
        self._resume()
        events = self._events
        while not self.done:
            if not events:
                raise RuntimeError("simulate: the head waits for a run that never comes (a model bug)")
            max_events -= 1
            if max_events < 0:
                raise RuntimeError("simulate: too many events")
            self.now, _, fn, args = heapq.heappop(events)
            fn(*args)

    def busy_until_now(self) -> list[float]:
        """Compute time per stage so far, counting the job in progress up to now."""
        return [s.busy_ms + (self.now - s.started if s.current is not None else 0.0) for s in self.stages]

    # --- events ---
    def _at(self, t: float, fn: Callable[..., None], *args: object) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, fn, args))

    def _resume(self) -> None:
        assert self._loop is not None
        while True:
            try:
                kind, value = next(self._loop)
            except StopIteration:
                self.done = True
                return
            if kind == BUSY:
                if value > 0:
                    self.cores.start(value, self._resume)
                    return
            elif int(value) not in self._arrived:
                self._waiting = int(value)
                return

    def _send(self, link: int, msg: _Msg) -> None:
        """Put ``msg`` on a link: it holds the link for its bytes, then travels."""
        cfg = self.cfg
        if msg.empty:
            size = 0
        elif link == len(self.stages):
            size = msg.rows * (cfg.return_bytes or cfg.n_embd * 4)
        else:
            size = msg.n * cfg.n_embd * 4
        start = max(self.now, self.link_free[link])
        self.link_free[link] = start + size * 8 / (cfg.bandwidth_mbps * 1e3)
        arrive = self.link_free[link] + cfg.latency_ms
        self._at(arrive, self._received, link, msg)

    def _received(self, link: int, msg: _Msg) -> None:
        if self.cfg.msg_ms and self.cfg.cores:  # the receiver's CPU, beside the message
            self.cores.start(self.cfg.msg_ms, _nothing)
        if link == len(self.stages):
            self._reach_head(msg)
        else:
            self._reach_stage(link, msg)

    def _reach_stage(self, i: int, msg: _Msg) -> None:
        stage = self.stages[i]
        stage.queue.append(msg)
        if stage.current is None:
            self._start(i)

    def _start(self, i: int) -> None:
        stage = self.stages[i]
        msg = stage.current = stage.queue.popleft()
        if msg.empty or msg.run in stage.cancelled:
            msg.empty = True
            self.counters.skipped += 1
            ms = self.cfg.skip_ms
        elif msg.prefill and self.cfg.prefill_ms:
            ms = self.cfg.run_ms + self.cfg.prefill_ms * msg.n * stage.ms / self.total_ms
        else:
            ms = self.cfg.run_ms + stage.ms * self.cost(msg.n)
        stage.started = self.now
        stage.task = self.cores.start(ms, self._finish, i)

    def _finish(self, i: int) -> None:
        stage = self.stages[i]
        msg = stage.current
        assert msg is not None
        stage.busy_ms += self.now - stage.started
        stage.current = stage.task = None
        self._send(i + 1, msg)
        if stage.queue:
            self._start(i)

    def _cancel_reaches(self, i: int, run: int) -> None:
        stage = self.stages[i]
        stage.cancelled.add(run)
        msg = stage.current
        if msg is not None and msg.run == run and not msg.empty:
            msg.empty = True  # stops at the next poll of the abort flag
            self.counters.aborted += 1
            assert stage.task is not None
            self.cores.set_work(stage.task, self.cfg.abort_ms)

    def _reach_head(self, msg: _Msg) -> None:
        if msg.empty or not self.cfg.head_ms:
            self._at(self.now, self._result, msg.run)  # nothing to compute (an empty one is only dropped)
            return
        self.head_queue.append((msg.run, self.cfg.head_ms * self.cost(msg.rows)))
        if not self.head_busy:
            self._head_next()

    def _head_next(self) -> None:
        """The head's output layer computes the rows of one run at a time, in order."""
        run, ms = self.head_queue.popleft()
        self.head_busy = True
        self.cores.start(ms, self._head_done, run)

    def _head_done(self, run: int) -> None:
        self.head_busy = False
        self._result(run)
        if self.head_queue and not self.head_busy:
            self._head_next()

    def _result(self, run: int) -> None:
        self._arrived.add(run)
        if self._waiting == run:
            self._waiting = None
            self._resume()


def _nothing() -> None:
    pass
