"""PipeInfer (Butler et al. 2024, "Asynchronous Pipelined Speculation") on the cluster pipeline.

On a pipeline each stage computes in turn, so one token at a time keeps one stage busy and
the others idle. PipeInfer keeps several runs in flight at once:
- *asynchronous speculation*: the target's own token goes down the pipeline alone, as a
  non-speculative run that is never cancelled, while the head drafts;
- *continuous speculation*: whenever the head would otherwise wait for logits it sends
  another micro-batch of 1-4 drafted tokens, built on the newest speculation, until a
  confidence cutoff stops it: a micro-batch is drafted only if the drafter's chance that
  all its tokens are accepted reaches ``p_accept + iterations * recovery - declines *
  decay`` (iterations: speculative micro-batches in flight, each built on the ones before;
  declines: times speculation stopped while no result was waiting, since a speculative run
  was last accepted whole), the paper's recovery and decay factors;
- *early cancellation*: after each sampling, runs built on a rejected guess are cancelled
  by run id; stages skip their queued work or abort it mid-compute, and a cancelled run
  still passes an empty message so the order of transactions holds (engine/pipeline).

KV caches: every fed token sits in sequence 0 at its own position, in the order the head
fed it, and rejected guesses leave from the tail (a KV ``rm`` that travels down the
pipeline in order with the batches). That is the per-sequence "partition" of the paper
reduced to its tail: a speculative run's cells only become canonical by being accepted,
and an accepted token never moves, so no cache copy is ever needed and each kept token
sits in the cell plain decoding uses (exact, docs/facts.md §3). Partitions would cost a
whole-sequence data copy per run both ways (``seq_cp`` across KV streams takes whole
sequences only) and would divide the context among the partitions.

Each micro-batch holds at most 4 tokens, and never more than ``target.exact.max_rows`` (the
longest exact batch on the model's weights, core/batch_exact.py): greedy output is
token for token plain decoding's; sampled output keeps the target's distribution (each
position is judged with :func:`~..verify.judge`, as in pearl).

The floor every speculative strategy has (:class:`~..adaptive.DraftGate`) judges the
rounds here too: on machines where a speculative run takes cores the stages on the
critical path need (loopback workers sharing a CPU), guesses that are mostly rejected cost
more than the idle stages they fill, and the gate falls back to the synchronous pipeline
until a probe pays again.

On a target of one stage there is nothing to overlap: the strategy runs as ordinary
speculation (:class:`~.speculative.Speculative`) with the same drafter.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...core.errors import PotluckError
from ...core.jobs import GroupCancelled
from ...core.rollback import KEEP_BATCHES
from ...core.strategy import Generation, Round, Strategy
from ...core.target import Target
from ..adaptive import UNTIL_REPLY_END, DraftGate, LengthConfig
from ..drafters import ContextView, Drafter, DraftRequest
from ..inflight import InFlightBook, RowJudge
from ..verify import Guess
from .speculative import Speculative

if TYPE_CHECKING:
    from ...core.runtime import Model
    from ...core.spec import EngineSpec

MAX_MICRO = 4  # the paper's micro-batches hold 1-4 tokens


@dataclass(frozen=True)
class Cutoff:
    """The confidence cutoff of continuous speculation (PipeInfer §IV-B2), with the
    factors of the paper's own runs (``-pa 0.001 -pr 0.4 -pd 0.01``), except that the
    recovery factor shrinks on deep pipelines: at 0.4 a fourth micro-batch in flight is
    never confident enough, which cannot fill more than about four stages (measured with
    ``potluck simulate``). ``recovery=None``: min(0.4, 1 / (stages + 1))."""

    p_accept: float = 0.001
    recovery: float | None = None
    decay: float = 0.01

    def value(self, iterations: int, declines: int, n_stages: int) -> float:
        recovery = self.recovery if self.recovery is not None else min(0.4, 1.0 / (n_stages + 1))
        return max(0.0, self.p_accept + iterations * recovery - declines * self.decay)


@dataclass
class Speculation:
    """Continuous speculation's decisions (§IV-B), one object per reply: whether another run
    may be sent, how many guesses it may hold, the confidence it needs, and the declines
    behind the cutoff's decay. The simulator's head loop (engine/lab/sim_head.py) decides
    with this same object, so the model follows the strategy by construction."""

    cutoff: Cutoff
    max_micro: int  # most guesses in one micro-batch
    cap: int  # runs in flight at once
    continuous: bool  # several speculative runs in flight (else at most one)
    n_stages: int
    declines: int = 0  # speculation stopped with no result waiting, since a run was accepted whole

    def may_send(self, n_runs: int, n_speculative: int) -> bool:
        """Whether another run may go down the pipeline now."""
        return n_runs < self.cap and (self.continuous or n_speculative == 0)

    def room(self, remaining: int, n_guesses: int) -> int:
        """Guesses the next micro-batch may hold: never past the reply's end (``remaining``
        tokens it may still take, ``n_guesses`` already in flight)."""
        return min(self.max_micro, remaining - 1 - n_guesses)

    def bar(self, n_speculative: int) -> float:
        """The chance that all of a micro-batch's guesses hold which it needs (above 1:
        send none); ``n_speculative``: speculative runs in flight, each built on the ones
        before."""
        return self.cutoff.value(n_speculative, self.declines, self.n_stages)

    def declined(self, result_waiting: bool) -> None:
        """The drafter had nothing confident enough: idle with nothing sent, lower the bar."""
        if not result_waiting:
            self.declines += 1

    def decided(self, n_accepted: int, own: bool) -> None:
        """A round decided tokens: a speculative run accepted whole resets the decay."""
        if n_accepted and not own:
            self.declines = 0


@dataclass
class PipeInferCounters:
    """What the last reply did (tests and the bench read these)."""

    runs: int = 0  # runs sent
    speculative_runs: int = 0
    cancelled: int = 0  # runs cancelled because they were built on a rejected guess
    wasted: int = 0  # runs computed on a rejected guess (cancellation off, or too late)
    max_in_flight: int = 0
    kept_at_end: int = 0  # runs still in flight with kept tokens when the reply ended


class PipeInfer(Strategy):
    name = "pipeinfer"
    accepts_draft = True  # a draft model with --draft, else the N-gram tables
    description = "asynchronous pipelined speculation for the cluster (PipeInfer)"
    options = {
        "max_micro": "the most drafted tokens in one micro-batch (1-4)",
        "max_runs": "the most runs in flight at once (0: the number of stages plus one)",
        "cancel": "cancel runs built on a rejected guess (false: compute them to the end)",
        "continuous": "keep speculating while runs are in flight (false: one speculative run at a time)",
        "p_accept": "the confidence a micro-batch needs to be sent (the cutoff's base)",
        "recovery": "added to the cutoff for each speculative micro-batch in flight "
        "(default: min(0.4, 1 / (stages + 1)))",
        "decay": "taken off the cutoff each time the head idles with speculation declined",
        "adaptive": "stop speculating while it loses to the synchronous pipeline (false: always speculate)",
    }

    def __init__(
        self,
        drafter: Drafter,
        local: Speculative,
        *,
        max_micro: int = MAX_MICRO,
        max_runs: int = 0,
        cancel: bool = True,
        continuous: bool = True,
        cutoff: Cutoff = Cutoff(),
        adaptive: bool = True,
        gate_backoff: int = DraftGate().backoff,
    ) -> None:
        self.drafter = drafter
        self.local = local  # one stage: ordinary speculation with the same drafter
        self.max_micro = max_micro
        self.max_runs = max_runs
        self.cancel = cancel
        self.continuous = continuous
        self.cutoff = cutoff
        self.adaptive = adaptive
        self.gate_backoff = gate_backoff
        self.gate = DraftGate(backoff=gate_backoff)
        self.counters = PipeInferCounters()

    @classmethod
    def build(cls, target_model: Model, spec: EngineSpec) -> Strategy:
        from .kit import bool_option, float_option, int_option, load_draft_model, saved_costs

        cls.check_options(spec.strategy_options)
        max_micro = int_option(spec, "max_micro", MAX_MICRO, 1, MAX_MICRO)
        max_runs = int_option(spec, "max_runs", 0, 0, 64)
        cancel = bool_option(spec, "cancel", True)
        continuous = bool_option(spec, "continuous", True)
        adaptive = bool_option(spec, "adaptive", True)
        cutoff = Cutoff(
            p_accept=float_option(spec, "p_accept", Cutoff.p_accept, 0.0, 1.0),
            recovery=None if "recovery" not in spec.strategy_options
            else float_option(spec, "recovery", 0.4, 0.0, 1.0),
            decay=float_option(spec, "decay", Cutoff.decay, 0.0, 1.0),
        )
        drafter: Drafter
        if spec.draft is None:
            from ..drafters.ngram import NgramDrafter

            drafter, length = NgramDrafter(), LengthConfig(s_init=7, s_max=7)  # anpd's defaults
            backoff = DraftGate().backoff
        else:
            from ..drafters.draft_model import DraftModelDrafter

            draft_model = load_draft_model(target_model, spec)
            try:
                drafter = DraftModelDrafter(draft_model, n_ctx=spec.n_ctx, n_threads=spec.n_threads,
                                            follow_load=spec.n_threads == 0)
            except BaseException:
                draft_model.close()
                raise
            length = LengthConfig(s_init=4, s_max=12)  # sd's defaults
            backoff = UNTIL_REPLY_END  # a draft model pays a catch-up prefill to resume
        local = Speculative(drafter, length, adaptive=adaptive, costs=saved_costs(target_model, spec),
                            gate_backoff=backoff)
        return cls(drafter, local, max_micro=max_micro, max_runs=max_runs, cancel=cancel,
                   continuous=continuous, cutoff=cutoff, adaptive=adaptive, gate_backoff=backoff)

    def prepare(self, g: Generation) -> None:
        if g.target.n_stages < 2:
            self.local.prepare(g)  # one machine: ordinary speculation, its draft on the target's thread
            return
        self.drafter.begin(g.history, g.drafter_rng())

    def run(self, g: Generation) -> Iterator[Round]:
        if g.target.n_stages < 2:
            return self.local.run(g)
        return self._pipelined(g)

    def in_flight_cap(self, target: Target) -> int:
        """Runs in flight at once: one per stage keeps every stage busy, one more covers
        the trip back to the head. A recurrent model's stages can take back only their last
        few batches (core/rollback.py): no more runs than that."""
        cap = self.max_runs or target.n_stages + 1
        return min(cap, KEEP_BATCHES - 1) if target.recurrent else cap

    def _pipelined(self, g: Generation) -> Iterator[Round]:
        target, sampler = g.target, g.sampler
        params = sampler.params
        history = g.history  # grows by what each round yields (the session appends)
        counters = self.counters = PipeInferCounters()
        gate = self.gate
        gate.new_reply()
        speculated = False  # a speculative run was in flight during this round
        first = True
        cap = self.in_flight_cap(target)
        book = InFlightBook(target, len(history), g.first_logits)  # runs: a pipeline returns them in order
        judge = RowJudge(sampler, history)
        guesses: list[Guess] = []  # (token, q row) drafted for positions len(history).., all sent
        spec = Speculation(self.cutoff, self.max_micro, cap, self.continuous, target.n_stages)
        last = time.perf_counter()
        draft_ms = wait_ms = 0.0

        def send(tokens: list[int], speculative: bool) -> None:
            book.send(tokens, speculative)
            counters.runs += 1
            counters.speculative_runs += speculative
            counters.max_in_flight = max(counters.max_in_flight, len(book.runs))

        def drop_after(p: int) -> None:
            """Runs holding positions >= ``p`` were built on a rejected guess: cancel them
            (or let them run, without cancellation) and trim the cache back to ``p``."""
            dropped = book.cancel_from(p, cancel=self.cancel)
            if self.cancel:
                counters.cancelled += dropped
            book.trim(p)

        try:
            while True:
                p = len(history)  # the position decided next
                # 1. file every result that is here (never waiting)
                while book.ready():
                    book.redeem_oldest()
                if book.stale:
                    book.redeem_stale(block=False)

                # 2. decide what the rows allow: accepted guesses, then the target's own token
                decision = judge.decide(
                    lambda i, guesses=guesses: guesses[i] if i < len(guesses) else None,
                    lambda i, p=p: book.rows.get(p + i),
                )
                emitted = decision.tokens
                if emitted:
                    if decision.own:
                        # every run in flight holds guesses at or after the own token's position
                        drop_after(p + len(emitted) - 1)
                        guesses = []
                    else:
                        del guesses[: len(emitted)]
                    spec.decided(decision.n_accepted, decision.own)
                    now = time.perf_counter()
                    # the floor: a round with guesses in flight against synchronous rounds
                    if not first:  # the first token came from prompt processing: no round to time
                        gate.record(max(decision.judged, 1) if speculated else 0, len(emitted), (now - last) * 1e3)
                    first = False
                    speculated = any(r.speculative for r in book.runs)
                    yield Round(
                        tokens=emitted,
                        drafted=decision.judged,
                        accepted=decision.n_accepted,
                        draft_len=self.max_micro,
                        draft_ms=draft_ms,
                        verify_ms=wait_ms,
                        overlap_ms=max(0.0, (now - last) * 1e3 - wait_ms - draft_ms),
                        rows=decision.rows,
                    )
                    last, draft_ms, wait_ms = now, 0.0, 0.0
                    if g.done or g.remaining <= 0:
                        return
                    book.forget_before(len(history))
                    p = len(history)

                # 3. the target's own token goes down alone: a run that is never cancelled
                if target.n_past < p:
                    send(history[target.n_past : p], speculative=False)

                # 4. continuous speculation while runs may be added
                t0 = time.perf_counter()
                while spec.may_send(len(book.runs), n_speculative := sum(r.speculative for r in book.runs)):
                    if book.ready():
                        break  # logits are waiting: sampling them comes first (the paper's probe)
                    room = min(spec.room(g.remaining, len(guesses)), target.exact.max_rows)
                    if self.adaptive:  # the gate's risk budget caps the guesses in flight
                        # a wasted guess costs about one stage's share of a plain step
                        row_ms = gate.plain_ms / target.n_stages if gate.plain_ms else None
                        room = min(room, gate.draft_cap(MAX_MICRO * cap, row_ms) - len(guesses))
                    if room <= 0:
                        break
                    want = spec.bar(n_speculative)
                    if want > 1.0:
                        break
                    context = ContextView(history, p, tuple(x for x, _ in guesses))
                    draft = self.drafter.draft(DraftRequest(context, room, want, params))
                    if not draft.tokens:
                        spec.declined(book.ready())
                        break
                    tokens = draft.tokens[:room]
                    qs = draft.q[: len(tokens)] if draft.q is not None else [None] * len(tokens)
                    guesses += zip(tokens, qs)
                    send(tokens, speculative=True)
                    speculated = True
                draft_ms += (time.perf_counter() - t0) * 1e3

                # 5. nothing more to send: wait for the oldest run
                if book.runs and not book.ready():
                    t0 = time.perf_counter()
                    book.redeem_oldest()
                    wait_ms += (time.perf_counter() - t0) * 1e3
                elif not book.runs and p not in book.rows:
                    raise PotluckError("pipeinfer: no run in flight and no logits to decide from")
        finally:
            # the reply ended: no guess may stay in flight or in the cache past the conversation
            # a run holding a kept token must finish (an accepted guess may still be on its way
            # down the pipeline); runs wholly past the reply's end are cancelled
            past_end = [r.ticket.group for r in book.runs if r.pos0 >= len(history)]
            counters.kept_at_end += len(book.runs) - len(past_end)
            if past_end and self.cancel:
                target.cancel(*past_end)
            for r in book.runs:
                try:
                    target.wait(r.ticket)
                except GroupCancelled:
                    pass
            book.runs.clear()
            book.redeem_stale(block=True)
            counters.wasted += book.wasted
            target.truncate(min(target.n_past, len(history)))

    def reset(self) -> None:
        self.local.reset()  # the drafter too
        self.gate = DraftGate(backoff=self.gate_backoff)

    def close(self) -> None:
        self.local.close()  # the drafter too
