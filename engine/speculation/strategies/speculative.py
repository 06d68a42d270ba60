"""Speculative decoding on one machine: draft, verify in one target batch, keep the prefix.

Strategies share this loop and differ only in where drafts come from:
- ``sd``: a small draft model with the target's vocabulary (Leviathan et al. 2023);
- ``anpd``: multi-level N-gram tables over the conversation itself (Ou et al. 2024);
- ``minions``: several drafters voting (:mod:`.minions`);
- ``triforce``: the target over a retrieval cache, picked each round by :meth:`Speculative.plan`
  (:mod:`.triforce`).

Each round (compare llama.cpp's examples/speculative-simple):
1. choose the speculation length ``s`` (Minions' adaptive selector, :mod:`..adaptive`);
2. draft up to ``s`` tokens after the conversation;
3. decode the pending token and the drafts in ONE target batch of at most
   ``target.exact.max_rows`` tokens (the model's weight types set it, core/batch_exact.py),
   which computes every row exactly like single steps;
4. accept a prefix of the drafts plus one token of the target's own (:mod:`..verify`);
5. trim the rejected drafts from the KV tail, so every kept token sits in the cell plain
   decoding would have put it in: greedy output is token-for-token plain decoding's;
6. report the round's counters and feed its cost back to the length selector.

The token the target chose last is *pending*: it is part of the conversation but enters
the KV cache as the first row of the next round's batch (so ``s = 0`` is plain decoding).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from ...core.errors import PotluckError
from ...core.strategy import Generation, Round, Strategy
from ...core.target import MAX_EXACT_BATCH
from ..adaptive import UNTIL_REPLY_END, DraftBreakEven, DraftGate, LengthConfig, SpeculationLength
from ..costs import SavedLine
from ..drafters import Draft, Drafter, DraftRequest
from ..inflight import RowJudge
from .kit import LENGTH_OPTIONS, bool_option, int_option, load_draft_model, saved_costs

if TYPE_CHECKING:
    from ...core.runtime import Model
    from ...core.spec import EngineSpec


# A cost line that forbids drafting is re-checked by a short draft every PROBE_EVERY rounds.
PROBE_EVERY = 64
PROBE_LEN = 3


class Speculative(Strategy):
    """Draft/verify rounds over any :class:`Drafter` (subclasses pick the drafter)."""

    name = "speculative"
    description = "draft, verify in one batch, keep the accepted prefix"

    def __init__(
        self,
        drafter: Drafter,
        length: LengthConfig,
        *,
        adaptive: bool = True,
        costs: SavedLine | None = None,
        gate_backoff: int = DraftGate().backoff,
    ) -> None:
        self.drafter = drafter
        self.length_config = length
        self.adaptive = adaptive
        self.length = SpeculationLength(length)
        # the verify-cost line is the machine's and the model's: kept across conversations
        self.break_even = DraftBreakEven()
        self.costs = costs
        if costs is not None:
            self.break_even.load(costs.restore())
        self.gate_backoff = gate_backoff
        self.gate = DraftGate(backoff=gate_backoff)
        self._blocked = 0  # rounds in a row the break-even threshold allowed no draft

    def run(self, g: Generation) -> Iterator[Round]:
        try:
            yield from self._rounds(g)
        finally:
            if self.costs is not None:
                self.costs.keep(self.break_even.samples())

    def _rounds(self, g: Generation) -> Iterator[Round]:
        target, sampler = g.target, g.sampler
        pending: list[int] = []  # last emitted token: in g.history, not yet in the KV cache
        head_logits = g.first_logits  # target logits after g.history while nothing is pending
        judge = RowJudge(sampler, g.history)
        self.gate.new_reply()
        prompt_ms = 0.0  # the drafter's reading of the conversation, reported with the next round

        while True:
            # 1. how far to speculate, how likely a draft token must be, and who drafts; the
            # first round only samples the prompt's own logits (see prepare)
            k, min_accept_p, drafter = self.plan(g, pending) if pending else (0, 0.0, self.drafter)

            # 2. draft (under a grammar: a draft model drafts within it on a copy of its state;
            # other drafts stop after the first token it refuses, which verification rejects)
            t0 = time.perf_counter()
            draft, drafts = self.draft(drafter, g, k, min_accept_p)
            t1 = time.perf_counter()

            # 3. one target decode: row i holds the logits after the conversation + drafts[:i]
            batch = pending + drafts
            rows = target.decode(batch, all_logits=True) if batch else None
            after = _rows_after_drafts(rows, bool(pending), head_logits, len(drafts))

            # 4. accept a prefix of the drafts and one token of the target's own
            verdict = judge.chain(drafts, draft.q, after)
            # 5. rejected drafts leave the KV cache from the tail
            target.truncate(len(g.history) + verdict.n_accepted)
            t2 = time.perf_counter()
            if drafts:
                self.learn(drafter, len(drafts), verdict.n_accepted)

            # 6. report, and let the measured cost steer the next speculation length
            tokens = verdict.tokens(drafts)
            draft_ms, verify_ms = (t1 - t0) * 1e3, (t2 - t1) * 1e3
            if batch:  # the first round decodes nothing: it says nothing of costs
                self.length.record(len(tokens), draft_ms, verify_ms)
                self.break_even.record(len(batch), verify_ms)
                self.gate.record(len(drafts), len(tokens), draft_ms + verify_ms)
            yield Round(
                tokens=tokens,
                drafted=len(drafts),
                accepted=verdict.n_accepted,
                draft_len=k,
                draft_ms=draft_ms,
                verify_ms=verify_ms,
                prompt_ms=prompt_ms,
                rows=after[: len(tokens)],
            )
            if g.done or g.remaining <= 0:
                return
            prompt_ms = 0.0
            if not pending:  # the first token is out (the session has it in g.history)
                t = time.perf_counter()
                self.start_drafting(g)
                prompt_ms = (time.perf_counter() - t) * 1e3
            pending = [tokens[-1]]

    @staticmethod
    def draft(drafter: Drafter, g: Generation, k: int, min_accept_p: float) -> tuple[Draft, list[int]]:
        """The drafter's guesses (at most ``k``), cut after the first one the reply's grammar
        refuses: that one is judged (and rejected), guesses past it could never be kept."""
        if k <= 0:
            return Draft([]), []
        grammar = g.sampler.grammar
        own = grammar.fork() if grammar is not None else None
        try:
            draft = drafter.draft(DraftRequest(g.history, k, min_accept_p, g.sampler.params, own))
        finally:
            if own is not None:
                own.close()
        drafts = draft.tokens[:k]
        if grammar is not None and drafts:
            drafts = drafts[: grammar.allowed_run(drafts) + 1]
        return draft, drafts

    def plan(self, g: Generation, pending: list[int]) -> tuple[int, float, Drafter]:
        """This round's draft length, the chance each draft token must have to pay for its
        share of the batch, and the drafter (TriForce picks one of its levels here).

        Never past the reply's end or the exact batch size; the gate keeps the whole reply
        from falling below plain decoding."""
        if self.adaptive:
            # risk of each row: its share of the verify batch on the measured curve + its draft
            wanted = self.length.length()
            verify_row = self.break_even.row_ms(wanted)
            row_ms = verify_row + self.drafter.step_ms if verify_row is not None else None
            s = min(wanted, self.gate.draft_cap(self.length_config.s_max, row_ms))
        else:
            s = self.length_config.s_max
        k = max(0, min(s, g.remaining - 1, g.target.exact.max_rows - len(pending)))
        min_accept_p = self.break_even.threshold(self.drafter.step_ms, max(1, k)) if self.adaptive else 0.0
        if min_accept_p >= 1.0:
            # not even a sure draft pays here now: plain step, no draft sync; but now and
            # then a short probe re-measures what a batch costs (the line may be stale)
            self._blocked += 1
            if self._blocked < PROBE_EVERY:
                k = 0
            else:
                self._blocked, min_accept_p, k = 0, 0.0, min(k, PROBE_LEN)
        return k, min_accept_p, self.drafter

    def sure_draft_pays(self) -> bool:
        """Whether a draft the target always accepts would beat plain steps here: the rows it
        adds on the measured batch-cost curve plus its drafting time cost less than the plain
        steps it saves (a draft model on a mixture whose verify batches read many experts may
        not). True while nothing is measured, and without the adaptive controls."""
        if not self.adaptive:
            return True
        return self.break_even.threshold(self.drafter.step_ms, self.length.length()) < 1.0

    def learn(self, drafter: Drafter, drafted: int, accepted: int) -> None:
        """The round's drafter hears how many of its ``drafted`` tokens the target kept."""
        drafter.accept(accepted)

    def prepare(self, g: Generation) -> None:
        """A draft model computes on the target's thread: drafting and verifying take turns,
        and one OpenMP team serves both. The drafter reads the prompt only once the first
        token is out (:meth:`start_drafting`): that token is sampled from the prompt's own
        logits, so nothing of speculation delays it. A draft model's prefill of the prompt
        came before it, and a weak draft model added 50-60 % to the time to first token."""
        bind = getattr(self.drafter, "compute_on", None)
        if bind is not None:
            bind(g.target.on_compute_thread)

    def start_drafting(self, g: Generation) -> None:
        """Let the drafter read the conversation so far (a draft model prefills it), after
        the first round; its time is reported as prompt processing (``Round.prompt_ms``)."""
        self.drafter.begin(g.history, g.drafter_rng())

    def reset(self) -> None:
        self.drafter.reset()
        self.length = SpeculationLength(self.length_config)
        self.gate = DraftGate(backoff=self.gate_backoff)

    def close(self) -> None:
        self.drafter.close()


def _rows_after_drafts(
    rows: np.ndarray | None, pending: bool, head_logits: np.ndarray, k: int
) -> list[np.ndarray]:
    """Target logits after the conversation plus 0..k drafts (views, no copies)."""
    if pending:
        assert rows is not None
        return [rows[i] for i in range(k + 1)]
    return [head_logits] + ([rows[i] for i in range(k)] if rows is not None else [])


class DraftModelSpeculative(Speculative):
    name = "sd"
    needs_draft = True
    shares_batches = True
    description = "speculative decoding with a small draft model (--draft)"
    options = {**LENGTH_OPTIONS, "min_draft_p": "stop drafting once the draft's confidence falls below"}

    @classmethod
    def build(cls, target_model: Model, spec: EngineSpec) -> Strategy:
        from ..drafters.draft_model import DraftModelDrafter

        cls.check_options(spec.strategy_options)
        s_max = int_option(spec, "max_draft", 12, 1, MAX_EXACT_BATCH - 1)
        s_init = int_option(spec, "initial_draft", min(4, s_max), 0, s_max)
        adaptive = bool_option(spec, "adaptive", True)
        p_min = spec.strategy_options.get("min_draft_p", 0.0)
        if not isinstance(p_min, (int, float)) or isinstance(p_min, bool) or not 0.0 <= p_min < 1.0:
            raise PotluckError(f"strategy option min_draft_p must be a number in [0, 1), got {p_min!r}")
        draft_model = load_draft_model(target_model, spec)
        try:
            drafter = DraftModelDrafter(
                draft_model, n_ctx=spec.n_ctx, n_threads=spec.n_threads, p_min=float(p_min),
                follow_load=spec.n_threads == 0,
            )
        except BaseException:
            draft_model.close()
            raise
        length = LengthConfig(s_init=s_init, s_max=s_max)
        # a draft model pays a catch-up prefill to resume: once drafting loses, not this reply
        return cls(drafter, length, adaptive=adaptive, costs=saved_costs(target_model, spec),
                   gate_backoff=UNTIL_REPLY_END)


class NgramSpeculative(Speculative):
    name = "anpd"
    shares_batches = True
    description = "adaptive multi-level N-gram drafts from the conversation (no draft model)"
    options = {**LENGTH_OPTIONS, "ngram_max": "the longest N-gram the tables hold (ANPD's N)"}

    @classmethod
    def build(cls, target_model: Model, spec: EngineSpec) -> Strategy:
        from ..drafters.ngram import NgramDrafter

        cls.check_options(spec.strategy_options)
        n_max = int_option(spec, "ngram_max", 5, 2, 16)  # ANPD's defaults: N = 5, K = 7
        s_max = int_option(spec, "max_draft", 7, 1, MAX_EXACT_BATCH - 1)
        s_init = int_option(spec, "initial_draft", s_max, 0, s_max)
        adaptive = bool_option(spec, "adaptive", True)
        length = LengthConfig(s_init=s_init, s_max=s_max)
        return cls(NgramDrafter(n_max), length, adaptive=adaptive, costs=saved_costs(target_model, spec))
