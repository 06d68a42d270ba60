"""Target rows by position, the runs in flight that fill them, and judging guesses there.

Three strategies verify guesses against the target's logits: ``speculative`` (one batch a
round: every row is there at once), ``pearl`` and ``pipeinfer`` (several batches in flight:
rows are filed as batches return and guesses are judged as far as the rows reach). What
they share is written here once:

- :class:`RowJudge` applies the reply's sampler at one position (greedy: the guess must
  equal the target's own choice; sampling: :func:`~.verify.judge`), with the penalties'
  window over the conversation and the guesses before it (drafts kept earlier in the same
  round count, as they would in plain decoding); the loop over positions is
  :func:`~.verify.verify_lazily`;
- :class:`InFlightBook` keeps the rows by the position they decide, the runs sent and not
  yet redeemed (oldest first: a target returns them in the order sent), and drops the runs
  built on a rejected guess: cancelled as one group list, their cells trimmed from the tail
  of the KV cache, so every kept token stays in the cell plain decoding uses.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..core.jobs import GroupCancelled, InFlight
from ..core.sampling import Candidates, Sampler
from ..core.target import Target
from .verify import Decision, Guess, Verdict, judge, verify_chain, verify_greedy, verify_lazily


class RowJudge:
    """The reply's sampler applied to target rows, guess by guess (one per reply)."""

    def __init__(self, sampler: Sampler, history: list[int]) -> None:
        self.sampler = sampler
        self.params = sampler.params
        self.history = history  # the conversation: the session appends what each round yields

    def recent(self, extra: Sequence[int]) -> list[int]:
        """What the penalties see after ``extra`` guessed tokens (empty when none is on)."""
        n = self.params.repeat_last_n
        if not self.params.penalized or n <= 0:
            return []
        return [*self.history[-n:], *extra][-n:]

    def own_token(self, row: np.ndarray, kept: Sequence[int]) -> int:
        """The target's own token from ``row`` (after the kept guesses)."""
        return self.sampler.sample(row, self.recent(kept), kept)

    def keep(self, row: np.ndarray, x: int, q: Candidates | None, kept: Sequence[int]) -> int | None:
        """Guess ``x`` (drawn from ``q``; None: deterministic) at ``row``: None keeps it, else
        the token the target emits instead. Under a grammar p is the constrained distribution,
        so a guess the grammar refuses has p(x) = 0 and is never kept."""
        if self.params.greedy:
            t = self.own_token(row, kept)
            return None if t == x else t
        return judge(self.sampler.distribution(row, self.recent(kept), kept), q, x, self.sampler.uniform)

    def decide(
        self, guess_at: Callable[[int], Guess | None], row_at: Callable[[int], np.ndarray | None]
    ) -> Decision:
        """Judge guesses as far as the rows reach (pearl, pipeinfer): see :func:`verify_lazily`."""
        return verify_lazily(guess_at, row_at, self.keep, self.own_token)

    def chain(self, drafts: list[int], q: list[Candidates] | None, after: list[np.ndarray]) -> Verdict:
        """A whole chain whose rows are all there (speculative's one batch): ``after[i]``
        holds the target's logits after ``drafts[:i]``."""
        if self.params.greedy:
            return verify_greedy(drafts, lambda i: self.own_token(after[i], drafts[:i]))
        return verify_chain(
            drafts,
            lambda i: self.sampler.distribution(after[i], self.recent(drafts[:i]), drafts[:i]),
            q[: len(drafts)] if q is not None else None,
            self.sampler.uniform,
        )


@dataclass
class Sent(InFlight):
    """A run of tokens sent to the target (pearl's verify batches, pipeinfer's runs)."""

    speculative: bool = True  # holds guesses (else only accepted tokens: never dropped)
    queued_at: float = 0.0  # perf_counter when it was sent


class InFlightBook:
    """Rows by position and the runs in flight that will add to them (one per reply)."""

    def __init__(self, target: Target, pos: int, logits: np.ndarray) -> None:
        self.target = target
        self.rows: dict[int, np.ndarray] = {pos: logits}  # position -> target logits deciding it
        self.runs: deque[Sent] = deque()  # in flight, in the order sent
        self.stale: list[Sent] = []  # dropped runs whose tickets are still to redeem
        self.wasted = 0  # dropped runs that computed to the end all the same

    def send(self, tokens: list[int], speculative: bool = True) -> Sent:
        """Queue ``tokens`` after sequence 0 as a group of its own (logits for every row)."""
        ticket = self.target.append(tokens, self.target.new_group())
        run = Sent(ticket, self.target.n_past - len(tokens), len(tokens), speculative, time.perf_counter())
        self.runs.append(run)
        return run

    def ready(self) -> bool:
        """The oldest run's logits are here (never waits)."""
        return bool(self.runs) and self.target.poll(self.runs[0].ticket)

    def redeem_oldest(self) -> Sent:
        """Wait for the oldest run and file its rows: row i decides position ``pos0 + 1 + i``."""
        run = self.runs.popleft()
        out = self.target.wait(run.ticket)
        for i in range(run.n):
            self.rows[run.pos0 + 1 + i] = out[i]
        return run

    def cancel_from(self, pos: int, cancel: bool = True) -> int:
        """Runs starting at or after ``pos`` were built on a rejected guess: drop them, and
        cancel them (in one call: a stage never starts one after aborting another) unless
        ``cancel`` is off (they compute to the end). Returns how many were dropped."""
        doomed = [r for r in self.runs if r.pos0 >= pos]
        for r in doomed:
            self.runs.remove(r)
        self.stale += doomed
        if doomed and cancel:
            self.target.cancel(*(r.ticket.group for r in doomed))
        return len(doomed)

    def trim(self, pos: int) -> None:
        """Sequence 0 and the rows keep positions below ``pos`` only (the KV cut travels in
        order with the jobs, after any dropped run)."""
        self.target.truncate(min(self.target.n_past, pos))
        for k in [k for k in self.rows if k > pos]:
            del self.rows[k]

    def forget_before(self, pos: int) -> None:
        """Rows of decided positions are not needed again."""
        for k in [k for k in self.rows if k < pos]:
            del self.rows[k]

    def redeem_stale(self, block: bool) -> None:
        """Redeem the dropped runs' tickets (those already back, or all when ``block``)."""
        for r in list(self.stale):
            if block or self.target.poll(r.ticket):
                self.stale.remove(r)
                try:
                    self.target.wait(r.ticket)
                    self.wasted += 1
                except GroupCancelled:
                    pass
