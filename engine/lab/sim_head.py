"""The simulator's head loop: pipeinfer's decisions over the model, and the other ways of
decoding as that loop with parts switched off (:class:`Policy`; see :mod:`.simulate`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Generator
from dataclasses import dataclass, field, replace

import numpy as np

from ..speculation.strategies.pipeinfer import MAX_MICRO, Cutoff, Speculation
from .sim_config import SimConfig
from .sim_engine import BUSY, WAIT, Action, Engine


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
class Reading(Speculation):
    """The cutoff's counters as the strategy keeps them (``code``): pipeinfer's own
    :class:`Speculation`, plus the hooks where the paper's readings differ (no-ops here)."""

    def burst(self) -> None:
        """The head is back from sampling and may speculate again."""

    def sent(self) -> None:
        """A speculative micro-batch was sent."""

    def settled(self, n_accepted: int, own: bool, whole: bool) -> None:
        """A round decided tokens (``whole``: a speculative run was accepted to its end)."""
        self.decided(n_accepted, own)

    def declined_above_one(self, result_waiting: bool) -> None:
        """The bar was above 1: the strategy stops without counting a decline."""


@dataclass
class PaperReading(Reading):
    """§IV-B2 as written: ``iterations`` counts micro-batches sent since a run was accepted
    whole; both counters reset then."""

    iterations: int = 0

    def bar(self, n_speculative: int) -> float:
        return self.cutoff.value(self.iterations, self.declines, self.n_stages)

    def sent(self) -> None:
        self.iterations += 1

    def settled(self, n_accepted: int, own: bool, whole: bool) -> None:
        if whole:
            self.iterations = self.declines = 0

    def declined_above_one(self, result_waiting: bool) -> None:
        self.declined(result_waiting)


@dataclass
class ReferenceReading(PaperReading):
    """The authors' code: ``iterations`` counts the current burst's micro-batches;
    ``declines`` resets whenever a token is decided."""

    def burst(self) -> None:
        self.iterations = 0

    def settled(self, n_accepted: int, own: bool, whole: bool) -> None:
        self.declines = 0


READINGS: dict[str, type[Reading]] = {"code": Reading, "paper": PaperReading, "reference": ReferenceReading}


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


def head_loop(
    eng: Engine, pol: Policy, rng: np.random.Generator, timeline: Timeline
) -> Generator[Action, None, None]:
    """The head loop of engine/speculation/strategies/pipeinfer.py, over the model: (1) file results
    that are here, (2) judge guesses against them, (3) send the target's own token,
    (4) speculate while the cutoff allows, (5) otherwise wait for the oldest run. What to
    send and when to stop are decided by the strategy's own :class:`Speculation` (through
    a :class:`Reading` of the cutoff's counters)."""
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
    rule = READINGS[pol.cutoff_rule](pol.cutoff or Cutoff(), pol.micro, pol.max_runs, pol.continuous, cfg.n_stages)
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
            rule.settled(accepted, own, whole)
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
        rule.burst()
        while rule.may_send(len(runs), n_speculative := sum(r.speculative for r in runs)):
            room = rule.room(goal - h, len(guesses))
            if room <= 0 or (pol.poll_before_draft and runs and eng.ready(runs[0].id)):
                break
            n = room
            if pol.cutoff is not None:
                want = rule.bar(n_speculative)
                n = 0 if want > 1.0 else _longest_confident(alpha, want, room)
            if n and cfg.p_none and rng.random() < cfg.p_none:
                n = 0
            if n == 0:
                if pol.cutoff is not None:
                    c.declines += 1
                    waiting = bool(runs) and eng.ready(runs[0].id)
                    if want <= 1.0:
                        rule.declined(waiting)
                    else:
                        rule.declined_above_one(waiting)
                break
            yield (BUSY, cfg.draft_ms * n)
            c.drafted += n
            right = rng.random(n) < alpha
            guesses += [(bool(x), i == n - 1) for i, x in enumerate(right)]
            send(max(0, h - n_past) + n, speculative=True)  # an own token not fed yet rides along
            rule.sent()
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
