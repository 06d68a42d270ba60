"""A discrete-event model of potluck's LAN pipeline, to compare ways of decoding on it.

Why a model: a real cluster of 32 nodes is not at hand, and on two loopback workers the
effects PipeInfer (Butler et al. 2024, §IV-V) relies on are small and noisy. The model
keeps only what decides the speed of one conversation on a pipeline:

- **Stages.** N stages in a chain, each computing one job at a time in FIFO order. A
  micro-batch of b tokens costs ``stage_ms[i] * cost(b)`` on stage i, where ``cost`` is a
  batch-cost curve relative to one token (docs/facts.md §6; interpolated linearly,
  extrapolated with its last slope).
- **Links.** head -> stage 1 -> ... -> stage N -> head. A message takes the link for
  ``bytes / bandwidth`` (one message at a time per link) and arrives ``latency_ms`` later.
  Every link carries the hidden state (``n_embd * 4`` bytes a token); the return link
  carries ``return_bytes`` a token (the hidden state when the head computes the output
  layer, ``vocab * 4`` when the last stage returns logits). The head's output layer costs
  ``head_ms * cost(b)`` per run, on its own runner (not the head loop).
- **Per-message work.** A stage's job also costs ``run_ms`` whatever its rows (the decode
  call's own work: building the batch and the graph, copying the hidden state out). Each
  message also burns ``msg_ms`` of CPU at its receiver, a stage or the head (a socket
  thread, the pipe to the worker's llama.cpp process, the encryption threads), empty and
  cancelled ones included. That CPU runs beside the message, not in its way: the delay a
  hop adds is ``latency_ms``. Only on shared cores does it slow anything, by taking cores
  from the computing stages: what makes many small runs dearer than few big ones there.
- **Head loop.** One thing at a time: drafting costs ``draft_ms`` a drafted token (0 for
  N-gram lookups), sampling/verifying ``sample_ms`` a run's result.
- **Acceptance.** Each drafted token is right with probability ``alpha``, independently;
  a chain of guesses holds up to its first wrong one. With probability ``p_none`` the
  drafter has no guess at all (N-gram tables often have none).
- **Cancellation.** The cancel message reaches every stage ``latency_ms`` after the head
  sends it. A stage that has not started the run skips it (``skip_ms``) and still passes
  an empty message on, so the order of messages holds; a stage computing it stops
  ``abort_ms`` after the cancel arrives (llama.cpp polls its abort flag coarsely,
  docs/facts.md §7).
- **Prompt.** ``prompt_tokens`` are prefilled in chunks of ``n_batch`` through the same
  pipeline. TTFT is the paper's (§V-A2): from the token sampled at the end of prefill to
  the next one decided; ``ttft_e2e_ms`` adds the prefill.

Every strategy is one :class:`Policy` of the same head loop (:func:`_head_loop`), which is
the loop of ``engine/speculation/strategies/pipeinfer.py`` step for step; the other strategies are
that loop with parts switched off:

- ``iterative``: one token at a time (today's synchronous cluster decoding);
- ``speculative``: draft k, send the last token and the k guesses as one batch, wait
  (SpecInfer over the pipeline, the paper's baseline);
- ``pipelined``: the same batches kept in flight back to back, each built on the guesses
  of the earlier ones; no cancellation: after a rejection, later runs are computed and
  thrown away;
- ``pipeinfer``: the target's own token goes down alone as a non-speculative run, while
  micro-batches of 1-4 guesses keep the pipeline full under the confidence cutoff
  (a micro-batch's confidence is ``alpha ** len``, the chance all its tokens hold); runs
  built on a rejected guess are cancelled. Ablations: ``pipeinfer-nocancel``,
  ``pipeinfer-nocontinuous`` (one speculative run at a time, of ``max_draft`` tokens).

The confidence cutoff's counters are read three ways (``cutoff_rule``), because the paper's
words, its authors' code and potluck's module differ:

- ``paper`` (§IV-B2): ``iterations`` counts micro-batches sent since a run was accepted
  whole; ``declines`` counts times speculation was declined with no result waiting;
  both reset when a run is accepted whole;
- ``reference`` (the authors' ``examples/speculative/speculative.cpp``): ``iterations``
  counts the micro-batches of the current burst (from 0 each time the head comes back
  from sampling); ``declines`` resets whenever a token is accepted;
- ``code`` (``engine/speculation/strategies/pipeinfer.py`` as of 2026-11-23): ``iterations`` is the
  number of speculative runs in flight; ``declines`` resets when a round accepts guesses
  and ends on no token of the target's own; a cutoff above 1 stops speculation without
  counting a decline. The cutoff itself is the strategy's :class:`Cutoff` (one formula).

The readings matter: under ``paper``, a burst whose first guess fails leaves the cutoff
above 1 until about 40 idle declines (decay 0.01) bring it down, so PipeInfer spends most
of its time one token at a time (``--trends --cutoff-rule paper``); under ``code`` with
the paper's recovery factor 0.4 at most 3 speculative runs fly at once, too few to fill
more than about 4 stages, which is why the strategy's default shrinks it on deep pipelines.

On one stage ``pipeinfer`` runs as ``speculative``, as the strategy module does.

**Shared cores** (``cores``, 0 by default). By default every stage and the head has its
own machine. Validating the model against loopback runs breaks that: on one machine the
worker processes and the head share its cores, and speculative micro-batches that keep
stages busy take cores from the critical path. With ``cores = N`` every computing
activity (a stage's job, the head's output layer for a run, its drafting and sampling)
shares N cores by processor sharing: while k compute at once each progresses at
``min(1, N / k)``. The engine keeps each activity's work left; when the rate changes it
brings them up to date and moves their finish events (the version that invalidates a
finish an abort moved). Iterative decoding never computes two things at once, so it is the
same with or without shared cores, unless the messages' CPU (``msg_ms``) runs beside a
stage on a single core; :func:`fit_latency` then bisects instead of solving.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from ..core.errors import PotluckError
from ..speculation.strategies.pipeinfer import MAX_MICRO, Cutoff

# docs/facts.md §6, `potluck perf` with logits for every row (SmolLM2-135M, 2 threads)
DEFAULT_BATCH_COST: tuple[tuple[int, float], ...] = ((1, 1.0), (2, 1.76), (4, 3.06), (8, 5.55), (16, 11.07))
STRATEGIES = ("iterative", "speculative", "pipelined", "pipeinfer", "pipeinfer-nocancel", "pipeinfer-nocontinuous")
TREND_NODES = (1, 2, 4, 8, 16, 32)
CUTOFF_RULES = ("paper", "reference", "code")
MAX_MS = 1e6  # any time setting (ms): beyond it sums of times lose their precision


@dataclass(frozen=True)
class SimConfig:
    """Everything the model needs; times in ms, one conversation of ``tokens`` tokens."""

    stage_ms: tuple[float, ...] = (6.0, 6.0)  # per stage, one token (default: 12 ms/token split in two)
    head_ms: float = 0.0  # the head's output layer, one token
    run_ms: float = 0.0  # a stage's fixed cost per job, whatever its rows
    msg_ms: float = 0.0  # CPU one message burns at its receiver, beside it (with cores > 0)
    sample_ms: float = 0.1  # sampling / verifying one run's result
    draft_ms: float = 0.0  # one drafted token (0: N-gram lookups)
    latency_ms: float = 0.1  # one message on one link (loopback ~0.1, gigabit ~1)
    bandwidth_mbps: float = 10_000.0  # megabits/s of each link
    n_embd: int = 576  # hidden state: n_embd * 4 bytes a token on every link
    return_bytes: int = 0  # a token on the return link (0: the hidden state; 49152 * 4 for logits)
    batch_cost: tuple[tuple[int, float], ...] = DEFAULT_BATCH_COST
    alpha: float = 0.7  # chance a drafted token is accepted
    p_none: float = 0.0  # chance the drafter has no guess
    tokens: int = 200  # tokens decided after the prompt's own
    seeds: int = 3
    prompt_tokens: int = 64
    prefill_ms: float = 0.0  # whole model, a prompt token (0: the batch-cost curve; perf's prefill speed)
    n_batch: int = 512
    k: int = 4  # draft length of speculative and pipelined
    max_runs: int = 0  # runs in flight (0: stages + 1)
    max_draft: int = 8  # pipeinfer-nocontinuous: one bigger speculative run
    p_accept: float = 0.001  # PipeInfer's cutoff factors (the paper's -pa -pr -pd)
    recovery: float | None = None  # None: the strategy's own default, min(0.4, 1 / (stages + 1))
    decay: float = 0.01
    cutoff_rule: str = "code"  # or "paper", "reference" (module docstring)
    skip_ms: float = 0.01
    abort_ms: float = 0.5
    cores: int = 0  # cores all computing shares (0: each stage and the head on its own machine)
    strategies: tuple[str, ...] = STRATEGIES

    @property
    def n_stages(self) -> int:
        return len(self.stage_ms)

    def check(self) -> SimConfig:
        """Refuse what the model cannot mean, with one line naming the setting."""
        if not self.stage_ms:
            raise PotluckError("simulate: at least one stage is needed (--stages 1 or more)")
        if not all(0 < ms <= MAX_MS for ms in self.stage_ms):
            raise PotluckError(f"simulate: each stage's ms must be above 0 and at most {MAX_MS:g}, "
                               f"got {list(self.stage_ms)}")
        for name, value in (("--head-ms", self.head_ms), ("--run-ms", self.run_ms), ("--msg-ms", self.msg_ms),
                            ("--sample-ms", self.sample_ms), ("--draft-ms", self.draft_ms),
                            ("--latency-ms", self.latency_ms), ("--skip-ms", self.skip_ms),
                            ("--abort-ms", self.abort_ms), ("--recovery", self.recovery or 0.0),
                            ("--prefill-ms", self.prefill_ms),
                            ("--decay", self.decay), ("--p-accept", self.p_accept)):
            if not 0 <= value <= MAX_MS:
                raise PotluckError(f"simulate: {name} must be between 0 and {MAX_MS:g}, got {value}")
        if not 1e-3 <= self.bandwidth_mbps <= 1e9:
            raise PotluckError(f"simulate: --bandwidth-mbps must be between 0.001 and 1e9, got {self.bandwidth_mbps}")
        for name, value in (("--alpha", self.alpha), ("--p-none", self.p_none)):
            if not 0.0 <= value <= 1.0:
                raise PotluckError(f"simulate: {name} must be between 0 and 1, got {value}")
        # upper bounds keep one run within seconds to minutes, not hours
        for name, ivalue, low, high in (("--tokens", self.tokens, 1, 100_000), ("--seeds", self.seeds, 1, 100),
                                        ("--stages", self.n_stages, 1, 256),
                                        ("--prompt-tokens", self.prompt_tokens, 1, 1_000_000),
                                        ("--n-batch", self.n_batch, 1, 1_000_000), ("--k", self.k, 1, 64),
                                        ("--max-runs", self.max_runs, 0, 1024), ("--max-draft", self.max_draft, 1, 64),
                                        ("--n-embd", self.n_embd, 1, 1_000_000), ("--cores", self.cores, 0, 1024),
                                        ("--return-bytes", self.return_bytes, 0, 100_000_000)):
            if not low <= ivalue <= high:
                raise PotluckError(f"simulate: {name} must be between {low} and {high}, got {ivalue}")
        if self.prompt_tokens > 10_000 * self.n_batch:
            raise PotluckError(f"simulate: {self.prompt_tokens} prompt tokens in chunks of {self.n_batch} is too many "
                               "chunks; raise --n-batch")
        if self.cutoff_rule not in CUTOFF_RULES:
            raise PotluckError(f"simulate: --cutoff-rule is one of {', '.join(CUTOFF_RULES)}, got {self.cutoff_rule!r}")
        unknown = [s for s in self.strategies if s not in STRATEGIES]
        if unknown or not self.strategies:
            raise PotluckError(f"simulate: unknown strategy {', '.join(unknown) or '(none)'}; "
                               f"choose from {', '.join(STRATEGIES)}")
        check_batch_cost(self.batch_cost)
        return self


def check_batch_cost(points: Sequence[tuple[int, float]]) -> None:
    ks = [k for k, _ in points]
    if not points or ks[0] != 1 or any(b <= a for a, b in zip(ks, ks[1:])):
        raise PotluckError("simulate: the batch cost needs k=1 first and growing k (e.g. 1:1,2:1.76,4:3.06)")
    if any(not 0 < c <= 1e6 for _, c in points) or ks[-1] > 1_000_000:
        raise PotluckError("simulate: batch costs must be positive numbers (at most 1e6, for k up to 1e6)")


def batch_cost_fn(points: Sequence[tuple[int, float]]) -> Callable[[int], float]:
    """cost(b) relative to one token: linear between the measured points, the last slope
    beyond them (prefill chunks are far past the measured 16)."""
    ks = np.array([k for k, _ in points], dtype=float)
    cs = np.array([c for _, c in points], dtype=float)
    slope = (cs[-1] - cs[-2]) / (ks[-1] - ks[-2]) if len(ks) > 1 else cs[0]
    cache: dict[int, float] = {}

    def cost(b: int) -> float:
        if b not in cache:
            cache[b] = float(np.interp(b, ks, cs)) if b <= ks[-1] else float(cs[-1] + (b - ks[-1]) * slope)
        return cache[b]

    return cost


@dataclass(frozen=True)
class PerfTiming:
    """What the model takes from `potluck perf --json` (engine/lab/perf.py's PerfReport)."""

    model_ms: float  # one token through the whole model
    prefill_ms: float  # one prompt token through the whole model (0: not in the report)
    batch_cost: tuple[tuple[int, float], ...]

    @classmethod
    def from_report(cls, report: Mapping[str, Any], source: str = "the perf report") -> PerfTiming:
        try:
            speed = float(report["decode_tokens_per_s"])
            prefill = float(report.get("prefill_tokens_per_s") or 0.0)
            cost = tuple(sorted((int(k), float(c)) for k, c in report["batch_cost"].items()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise PotluckError(f"simulate: {source} is not `potluck perf --json` output (decode_tokens_per_s, "
                               "batch_cost); write it with `potluck perf --json > FILE.json`") from None
        if not (speed > 0 and math.isfinite(speed)):
            raise PotluckError(f"simulate: {source}: decode_tokens_per_s must be positive, got {speed}")
        check_batch_cost(cost)
        prefill_ms = 1000.0 / prefill if prefill > 0 and math.isfinite(prefill) else 0.0
        return cls(1000.0 / speed, prefill_ms, cost)

    def config(self, stages: int, base: SimConfig = SimConfig()) -> SimConfig:
        """``base`` with this model split evenly over ``stages`` stages."""
        if not 1 <= stages <= 256:
            raise PotluckError(f"simulate: --stages must be between 1 and 256, got {stages}")
        return replace(base, stage_ms=(self.model_ms / stages,) * stages, prefill_ms=self.prefill_ms,
                       batch_cost=self.batch_cost)


@dataclass(frozen=True)
class Policy:
    """One way of decoding, as switches of the one head loop."""

    name: str
    micro: int  # most guesses per run (0: never drafts)
    max_runs: int  # runs in flight at once
    lone_own: bool  # the target's own token goes alone, as a run never cancelled
    cancel: bool  # cancel runs built on a rejected guess (else compute and drop them)
    continuous: bool  # several speculative runs in flight (else at most one)
    cutoff: Cutoff | None  # None: always draft `micro`
    cutoff_rule: str = "paper"
    poll_before_draft: bool = True  # stop speculating once a result waits (the paper's probe)


def policy(name: str, cfg: SimConfig) -> Policy:
    cap = cfg.max_runs or cfg.n_stages + 1  # one run per stage, one more for the trip back
    # the paper's readings use its factor; potluck's strategy (None) sizes it to the pipeline
    recovery = cfg.recovery if cfg.recovery is not None or cfg.cutoff_rule == "code" else 0.4
    cutoff = Cutoff(cfg.p_accept, recovery, cfg.decay)
    pipeinfer = Policy("pipeinfer", MAX_MICRO, cap, True, True, True, cutoff, cfg.cutoff_rule)
    if cfg.n_stages < 2 and name.startswith("pipeinfer"):
        name = "speculative"  # on one stage the strategy runs as ordinary speculation
    return {
        "iterative": Policy(name, 0, 1, True, False, False, None),
        "speculative": Policy(name, cfg.k, 1, False, False, False, None),
        "pipelined": Policy(name, cfg.k, cap, False, False, True, None),
        "pipeinfer": pipeinfer,
        "pipeinfer-nocancel": replace(pipeinfer, name=name, cancel=False),
        "pipeinfer-nocontinuous": replace(pipeinfer, name=name, continuous=False, micro=cfg.max_draft),
    }[name]


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


@dataclass
class _Run:
    id: int
    pos0: int  # position of its first token: its rows decide positions pos0+1 ..
    n: int
    speculative: bool


@dataclass
class Timeline:
    """When the head decided tokens: the figures come from these."""

    prefill_end: float = 0.0
    first_after: float = 0.0
    end: float = 0.0
    busy_at_prefill: list[float] = field(default_factory=list)
    contended_at_prefill: float = 0.0


def _head_loop(
    eng: Engine, pol: Policy, rng: np.random.Generator, timeline: Timeline
) -> Generator[Action, None, None]:
    """The head loop of engine/speculation/strategies/pipeinfer.py, over the model: (1) file results
    that are here, (2) judge guesses against them, (3) send the target's own token,
    (4) speculate while the cutoff allows, (5) otherwise wait for the oldest run."""
    cfg, c = eng.cfg, eng.counters
    # the prompt, in chunks through the pipeline; its last row gives the first token
    chunks = [min(cfg.n_batch, cfg.prompt_tokens - s) for s in range(0, cfg.prompt_tokens, cfg.n_batch)]
    last = [eng.submit(n, prefill=True) for n in chunks][-1]
    yield (WAIT, last)
    yield (BUSY, cfg.sample_ms)
    h = n_past = cfg.prompt_tokens + 1  # the first token is decided and is fed with the next run
    n_past -= 1
    timeline.prefill_end = eng.now
    timeline.busy_at_prefill = eng.busy_until_now()
    timeline.contended_at_prefill = eng.cores.contended_until_now()
    goal = h + cfg.tokens
    rows: set[int] = set()  # positions the target has given a row (logits) for
    runs: deque[_Run] = deque()  # in flight, in the order sent
    guesses: list[tuple[bool, bool]] = []  # (right, last of its run) for positions h..
    iterations = declines = 0
    alpha = cfg.alpha

    def send(n: int, speculative: bool) -> None:
        nonlocal n_past
        runs.append(_Run(eng.submit(n), n_past, n, speculative))
        n_past += n
        c.runs += 1
        c.speculative_runs += speculative
        c.max_in_flight = max(c.max_in_flight, len(runs))

    def drop_after(q: int) -> None:
        """Runs holding positions >= q were built on a rejected guess."""
        for r in [r for r in runs if r.pos0 + r.n > q and r.speculative]:
            runs.remove(r)
            if pol.cancel:
                eng.cancel(r.id)
                c.cancelled += 1
            else:
                c.wasted += 1

    while True:
        p = h
        # 1. file every result that is here
        filed = 0
        while runs and eng.ready(runs[0].id):
            r = runs.popleft()
            rows.update(range(r.pos0 + 1, r.pos0 + r.n + 1))
            filed += 1
        if filed:
            yield (BUSY, cfg.sample_ms * filed)
        # 2. accepted guesses, then the target's own token
        emitted = accepted = 0
        own = whole = False
        while p + emitted in rows:
            j = emitted
            emitted += 1
            if j >= len(guesses):
                own = True
                break
            right, last_of_run = guesses[j]
            if not right:
                own = True
                break
            accepted += 1
            whole |= last_of_run
        if emitted:
            if own:
                drop_after(p + emitted - 1)
                n_past = min(n_past, p + emitted - 1)
                guesses = []
            else:
                del guesses[:emitted]
            c.accepted += accepted
            h = p + emitted
            if pol.cutoff_rule == "reference":
                declines = 0  # any token accepted
            elif pol.cutoff_rule == "code":
                declines = 0 if accepted and not own else declines
            elif whole:
                iterations = declines = 0
            if not timeline.first_after:
                timeline.first_after = eng.now
            if h >= goal:
                timeline.end = eng.now
                return
            rows = {k for k in rows if k >= h}
        # 3. the target's own token alone, a run never cancelled
        if pol.lone_own and n_past < h:
            send(h - n_past, speculative=False)
        # 4. speculation while runs may be added
        if pol.cutoff_rule == "reference":
            iterations = 0  # each burst starts from the base cutoff
        while len(runs) < pol.max_runs and (pol.continuous or not any(r.speculative for r in runs)):
            room = min(pol.micro, goal - h - 1 - len(guesses))
            if room <= 0 or (pol.poll_before_draft and runs and eng.ready(runs[0].id)):
                break
            n = room
            if pol.cutoff is not None:
                if pol.cutoff_rule == "code":
                    iterations = sum(r.speculative for r in runs)
                want = pol.cutoff.value(iterations, declines, cfg.n_stages)
                n = 0 if want > 1.0 else _longest_confident(alpha, want, room)
            if n and cfg.p_none and rng.random() < cfg.p_none:
                n = 0
            if n == 0:
                if pol.cutoff is not None:
                    c.declines += 1
                    if (want <= 1.0 or pol.cutoff_rule != "code") and not (runs and eng.ready(runs[0].id)):
                        declines += 1  # idle with nothing sent: lower the bar (decay)
                break
            yield (BUSY, cfg.draft_ms * n)
            c.drafted += n
            right = rng.random(n) < alpha
            guesses += [(bool(x), i == n - 1) for i, x in enumerate(right)]
            send(max(0, h - n_past) + n, speculative=True)  # an own token not fed yet rides along
            iterations += 1
        if n_past < h:
            send(h - n_past, speculative=False)  # nothing drafted: the own token alone
        # 5. nothing more to send: wait for the oldest run
        if runs and not eng.ready(runs[0].id):
            yield (WAIT, runs[0].id)
        elif not runs and p not in rows and h not in rows:
            raise RuntimeError("simulate: no run in flight and nothing to decide (a model bug)")


def _longest_confident(alpha: float, want: float, room: int) -> int:
    """Most tokens (up to ``room``) whose chance of all being accepted reaches ``want``."""
    n = 0
    while n < room and alpha ** (n + 1) >= want:
        n += 1
    return n


def _simulate_one(cfg: SimConfig, name: str, seed: int) -> dict[str, float | list[float]]:
    eng = Engine(cfg)
    timeline = Timeline()
    eng.run(_head_loop(eng, policy(name, cfg), np.random.default_rng(seed), timeline))
    wall = timeline.end - timeline.prefill_end
    busy = [(b - b0) / wall for b, b0 in zip(eng.busy_until_now(), timeline.busy_at_prefill)]
    c = eng.counters
    return {
        "tok_s": cfg.tokens / wall * 1e3,
        "ttft_ms": timeline.first_after - timeline.prefill_end,
        "ttft_e2e_ms": timeline.first_after,
        "prefill_ms": timeline.prefill_end,
        "stage_busy": busy,
        # share of the time more activities computed than there were cores
        "contended": (eng.cores.contended_until_now() - timeline.contended_at_prefill) / wall,
        "runs": c.runs,
        "speculative_runs": c.speculative_runs,
        "cancelled": c.cancelled,
        "wasted": c.wasted,
        "skipped": c.skipped,
        "aborted": c.aborted,
        "drafted": c.drafted,
        "accepted": c.accepted,
        "declines": c.declines,
        "max_in_flight": c.max_in_flight,
        "max_computing": c.max_computing,
        "tokens_per_run": cfg.tokens / max(1, c.runs),
    }


def simulate(cfg: SimConfig) -> dict:
    """Every strategy of ``cfg`` over ``cfg.seeds`` seeds (the same seeds for each):
    means of the figures and counters, keyed by strategy, plus the config used."""
    cfg.check()
    results: dict[str, dict] = {}
    for name in cfg.strategies:
        per_seed = [_simulate_one(cfg, name, seed) for seed in range(cfg.seeds)]
        mean: dict[str, float | list[float]] = {}
        for key, first in per_seed[0].items():
            if isinstance(first, list):
                mean[key] = [float(np.mean([s[key][i] for s in per_seed])) for i in range(len(first))]
            else:
                mean[key] = float(np.mean([s[key] for s in per_seed]))
        mean["busy_mean"] = float(np.mean(mean["stage_busy"]))
        mean["acceptance"] = mean["accepted"] / mean["drafted"] if mean["drafted"] else 0.0
        results[name] = mean
    base = results.get("iterative")
    for r in results.values():
        r["speed_vs_iterative"] = r["tok_s"] / base["tok_s"] if base else None
    return {"config": asdict(cfg), "results": results}


def fit_latency(cfg: SimConfig, iterative_tok_s: float) -> SimConfig:
    """``cfg`` with the link latency that makes ``iterative`` decode at a measured speed.

    Real links cost more than the wire: each hop also pays for framing, a socket and a
    thread handoff. One measured figure (the synchronous pipeline's tokens/s) fixes that
    per-hop cost; the other strategies are then predictions. Iterative decoding's token
    time is closed form (every stage, every link and the head in turn) unless the
    messages' CPU shares too few cores with the computing: then the closed form's latency is
    refined by bisection on the simulated speed."""
    cfg.check()
    if not (iterative_tok_s > 0 and math.isfinite(iterative_tok_s)):
        raise PotluckError(f"simulate: the measured speed must be positive, got {iterative_tok_s}")
    n = cfg.n_stages
    wire_ms = (n * cfg.n_embd * 4 + (cfg.return_bytes or cfg.n_embd * 4)) * 8 / (cfg.bandwidth_mbps * 1e3)
    fixed_ms = sum(cfg.stage_ms) + n * cfg.run_ms + cfg.head_ms + cfg.sample_ms + wire_ms
    target_ms = 1000.0 / iterative_tok_s
    latency_ms = (target_ms - fixed_ms) / (n + 1)
    too_fast = PotluckError(
        f"simulate: {iterative_tok_s:g} tok/s is faster than the stages alone allow "
        f"({1000.0 / fixed_ms:.1f} tok/s): the stage times are too high for that measurement"
    )
    if latency_ms < 0:
        raise too_fast
    if not (cfg.msg_ms and cfg.cores):
        return replace(cfg, latency_ms=latency_ms).check()

    def token_ms(lat: float) -> float:
        c = replace(cfg, latency_ms=lat, strategies=("iterative",), seeds=1)
        return 1000.0 / simulate(c)["results"]["iterative"]["tok_s"]

    lo, hi = 0.0, latency_ms  # the messages' CPU only ever slows a token: the answer is below
    if token_ms(lo) > target_ms:
        raise too_fast
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if token_ms(mid) < target_ms else (lo, mid)
    return replace(cfg, latency_ms=(lo + hi) / 2).check()


@dataclass(frozen=True)
class TrendSetting:
    """The paper's setting for its trends (§V): a big target split evenly over N nodes
    (its per-token time fixed), a small draft, a gigabit LAN, a memory-bound batch curve
    (big models on many cores barely pay for more rows, docs/facts.md §6)."""

    model_ms: float = 200.0  # whole target, one token
    draft_ms: float = 6.0  # one drafted token (~1B draft for a 70B target)
    latency_ms: float = 1.0  # gigabit
    bandwidth_mbps: float = 880.0  # ~110 MB/s
    n_embd: int = 8192  # a 70B Llama
    batch_cost: tuple[tuple[int, float], ...] = ((1, 1.0), (2, 1.05), (4, 1.15), (8, 1.4), (16, 2.0))
    high_alpha: float = 0.8
    low_alpha: float = 0.5
    slow_factor: float = 3.0  # one node that much slower
    nodes: tuple[int, ...] = TREND_NODES
    strategies: tuple[str, ...] = ("iterative", "speculative", "pipelined", "pipeinfer")


def trend_config(base: SimConfig, setting: TrendSetting, nodes: int, alpha: float, slow: bool) -> SimConfig:
    stage = setting.model_ms / nodes
    stage_ms = [stage] * nodes
    if slow:
        stage_ms[nodes // 2] *= setting.slow_factor
    return replace(
        base, stage_ms=tuple(stage_ms), draft_ms=setting.draft_ms, latency_ms=setting.latency_ms,
        bandwidth_mbps=setting.bandwidth_mbps, n_embd=setting.n_embd, return_bytes=0,
        batch_cost=setting.batch_cost, alpha=alpha, strategies=setting.strategies,
        max_runs=0,
    )


def trends(base: SimConfig, setting: TrendSetting = TrendSetting()) -> dict:
    """The paper's trend figures: (a) tok/s against nodes at high and low acceptance,
    (b) with one node ``slow_factor`` slower, (c) TTFT against nodes (high acceptance).
    Each figure maps strategy -> one value per node count."""
    figures: dict[str, dict[str, list[float]]] = {}
    for key, alpha, slow in (("high", setting.high_alpha, False), ("low", setting.low_alpha, False),
                             ("slow", setting.high_alpha, True)):
        runs = [simulate(trend_config(base, setting, n, alpha, slow))["results"] for n in setting.nodes]
        figures[f"tok_s_{key}"] = {s: [r[s]["tok_s"] for r in runs] for s in setting.strategies}
        if key == "high":
            figures["ttft_ms"] = {s: [r[s]["ttft_ms"] for r in runs] for s in setting.strategies}
            figures["busy_high"] = {s: [r[s]["busy_mean"] for r in runs] for s in setting.strategies}
    return {"setting": asdict(setting), "nodes": list(setting.nodes), "figures": figures}
