"""Adaptive speculation length: a pure controller fed with per-round measurements.

Minions (Wang et al. 2024, section 3.3) picks the speculation length ``s`` that minimises
``t_LLM(s) / vl(s)``, the verification time per verified token, with a heuristic search: an
online monitor records that ratio every round; once ``decision_threshold`` rounds have been
recorded since the last change, fit a line through the monitored data; slope > 0 means the
last move overshot, so ``s -= s_punish``; slope < 0 means there is room, so ``s += s_reward``.

Two adaptations to a single machine, both measured at run time rather than assumed:
- drafting and verification run one after the other here (Minions pipelines them), so the
  cost of a round is ``draft_ms + verify_ms``, not the verification alone;
- the line is fitted through (``s``, cost per emitted token) points of the current and the
  previous setting, so its slope is the measured effect of the last move whichever way it
  went (a fit against time would reward a move down by moving back up);
- ``s = 0`` is plain decoding. It is a legal setting, so when drafting does not pay the
  controller walks down to it and stays; it probes ``s = 1`` again after a back-off that
  doubles each time plain decoding wins (acceptance may recover later in a reply).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthConfig:
    s_init: int = 4
    s_max: int = 8
    decision_threshold: int = 8  # rounds recorded before each decision (Minions)
    s_reward: int = 1
    s_punish: int = 1
    max_backoff: int = 256  # most rounds spent at s = 0 before probing drafting again


class SpeculationLength:
    """Chooses how many tokens to draft next round from measured round costs."""

    def __init__(self, config: LengthConfig = LengthConfig()) -> None:
        self.config = config
        self.s = max(0, min(config.s_init, config.s_max))
        self._wait = config.decision_threshold  # rounds at s = 0 before probing s = 1
        self._win_ms = 0.0  # monitored data since the last change of s
        self._win_tokens = 0
        self._win_rounds = 0
        # per length: decayed (ms, emitted tokens) sums, so old windows fade as contexts change
        self._seen: dict[int, tuple[float, float]] = {}
        self._prev_s: int | None = None
        self.decisions: list[int] = []  # every length chosen (reports and tests)

    def length(self) -> int:
        return self.s

    def record(self, emitted: int, draft_ms: float, verify_ms: float) -> None:
        """One round's measurement: the tokens it produced and what it cost."""
        if emitted <= 0:
            return
        self._win_ms += draft_ms + verify_ms
        self._win_tokens += emitted
        self._win_rounds += 1
        need = self._wait if self.s == 0 else self.config.decision_threshold
        if self._win_rounds >= need:
            self._decide()

    def cost_per_token(self, s: int) -> float | None:
        """Measured ms per emitted token at length ``s`` (None if never tried)."""
        seen = self._seen.get(s)
        return seen[0] / seen[1] if seen and seen[1] > 0 else None

    def slope(self) -> float | None:
        """Slope of the line fitted through (s, cost per token) of the last two settings."""
        if self._prev_s is None or self._prev_s == self.s:
            return None
        xs = [self._prev_s, self.s]
        ys = [self.cost_per_token(x) for x in xs]
        if ys[0] is None or ys[1] is None:
            return None
        return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])

    def _decide(self) -> None:
        cfg = self.config
        old = self.s
        ms, tok = self._seen.get(old, (0.0, 0.0))
        self._seen[old] = (0.5 * ms + self._win_ms, 0.5 * tok + self._win_tokens)
        self._win_ms, self._win_tokens, self._win_rounds = 0.0, 0, 0
        slope = self.slope()
        if old == 0:
            new = 1  # plain decoding had its turn: probe drafting again
        elif slope is not None and slope > 0:
            new = max(0, old - cfg.s_punish)  # the last move overshot
        else:
            new = min(cfg.s_max, old + cfg.s_reward)  # room to speculate more (or explore)
            if slope is not None:
                self._wait = cfg.decision_threshold  # drafting pays: forget the back-off
        if new == 0:
            self._wait = min(self._wait * 2, cfg.max_backoff)
        if new != old:
            self._prev_s = old
        self.s = new
        self.decisions.append(new)


class DraftBreakEven:
    """How likely a drafted token must be accepted to be worth drafting and verifying.

    Drafting ``k`` tokens makes the verify batch ``k`` rows longer, which costs ``c(1 + k) -
    c(1)`` ms on the batch-cost curve ``c``, plus ``d`` ms a token to draft; a drafted token
    saves a whole plain step (``c(1)`` ms) only if accepted. It pays when P(accept) > (the
    row's share of that + d) / c(1). The curve is measured, never assumed: each batch size's
    fastest recent verify time, linear between measured sizes, a least-squares line through
    them past the largest (docs/facts.md §6, §32). It is not a line: Q4_0 batches of 4 rows
    cost less than 2 (§20), and a mixture of experts reads up to k x top-k experts for k rows,
    so its first extra rows cost more than later ones (§32). On a compute-bound box the
    threshold is high; on memory-bound machines the curve is flat and it falls towards 0.
    """

    def __init__(self, window: int = 96, prior: float = 0.6) -> None:
        # Recent timings per batch size: a long run of plain steps (size 1) must not evict
        # the multi-token measurements, or the curve is lost and drafting (and a draft
        # model's costly catch-up) would restart from the prior again and again.
        self._per_size = max(4, window // 8)
        self._verify: dict[int, deque[float]] = {}
        self.prior = prior
        # the fastest time per size and the fitted line, refitted only after a new timing: a
        # speculative round asks for them several times, and np.polyfit took about a
        # millisecond a round (a tenth of a 135M step)
        self._points: list[tuple[int, float]] = []
        self._fit: tuple[float, float] | None = None
        self._stale = True

    def samples(self) -> dict[int, list[float]]:
        """The timings the curve comes from (kept across conversations: engine/speculation/costs.py)."""
        return {size: list(times) for size, times in self._verify.items()}

    def load(self, samples: dict[int, list[float]]) -> None:
        """Start from timings measured earlier on this machine and model."""
        for size, times in samples.items():
            if size > 0:
                q = self._verify.setdefault(size, deque(maxlen=self._per_size))
                q.extend(float(t) for t in times if t > 0)
        self._stale = True

    def record(self, batch: int, verify_ms: float) -> None:
        if batch > 0:
            self._verify.setdefault(batch, deque(maxlen=self._per_size)).append(verify_ms)
            self._stale = True

    def _refresh(self) -> None:
        """Each size's fastest recent timing: another program taking a core only ever slows a
        batch (by 10-100x when llama.cpp's threads wait for a descheduled one, docs/facts.md
        §6), and a curve through such timings, kept on disk, would stop drafting for good."""
        if self._stale:
            self._points = sorted((size, min(times)) for size, times in self._verify.items() if times)
            self._fit, self._stale = self._fitted(), False

    def line(self) -> tuple[float, float] | None:
        """(a, m): the least-squares line through the curve's points, verify ms of a 1-token
        batch and of each extra token, if measurable (the curve past its largest size)."""
        self._refresh()
        return self._fit

    def _fitted(self) -> tuple[float, float] | None:
        """Least squares through (size - 1, fastest ms), in closed form (a few points)."""
        pts = [(size - 1.0, ms) for size, ms in self._points]
        if len(pts) < 2:
            return None
        n = len(pts)
        mx = sum(x for x, _ in pts) / n
        my = sum(y for _, y in pts) / n
        sxx = sum((x - mx) ** 2 for x, _ in pts)
        if sxx <= 0.0:
            return None
        m = sum((x - mx) * (y - my) for x, y in pts) / sxx
        a1 = my - m * mx
        if a1 <= 0:
            return None
        return a1, max(0.0, m)

    def cost_ms(self, size: int) -> float | None:
        """Verify ms of a batch of ``size`` rows on the measured curve (None: fewer than two
        sizes measured)."""
        fit = self.line()
        if fit is None:
            return None
        pts = self._points
        below = [(k, ms) for k, ms in pts if k <= size]
        above = [(k, ms) for k, ms in pts if k >= size]
        if below and above:
            (k0, c0), (k1, c1) = below[-1], above[0]
            return c0 if k1 == k0 else c0 + (c1 - c0) * (size - k0) / (k1 - k0)
        a, m = fit
        if above:  # below the smallest measured size: the line's value there
            return max(1e-6, min(above[0][1], a + m * (size - 1)))
        k_last, c_last = pts[-1]  # past the largest: on from it at the line's slope
        return c_last + m * (size - k_last)

    def row_ms(self, k: int) -> float | None:
        """What each of ``k`` drafted rows adds to a verify batch, on average, in ms."""
        c1, ck = self.cost_ms(1), self.cost_ms(1 + max(1, k))
        if c1 is None or ck is None:
            return None
        return max(0.0, (ck - c1) / max(1, k))

    def threshold(self, draft_step_ms: float = 0.0, k: int = 1) -> float:
        """The acceptance chance a drafted token needs when ``k`` are drafted this round;
        ``draft_step_ms``: what drafting one more token costs (a draft model's step)."""
        row, c1 = self.row_ms(k), self.cost_ms(1)
        if row is None or c1 is None or c1 <= 0:
            return self.prior
        return min(1.0, (row + draft_step_ms) / c1)


UNTIL_REPLY_END = 1 << 30  # a back-off no reply reaches: closed, the gate waits for the next reply


class DraftGate:
    """A whole-reply floor: drafting stays on only while rounds that draft beat plain steps.

    The per-token threshold (:class:`DraftBreakEven`) rests on the drafters' own estimates of
    their acceptance, which can be wrong for a reply they were not tuned on. The gate checks
    the outcome instead: each round that drafted books what it saved against plain decoding,
    ``emitted * plain_ms - round_ms``, where ``plain_ms`` is the measured cost of the plain
    rounds around it (same depth, same overheads). Risk is budgeted like a bankroll:
    - a round may draft only as many tokens as the booked savings plus ``budget_steps``
      plain steps could pay for if every one of them were rejected (``row_ms`` each), and at
      least ``probe_len``; savings count up to ``max_bank_steps`` plain steps;
    - once the booked loss passes ``budget_steps`` plain steps the gate closes for
      ``backoff`` plain rounds, doubling after each loss (up to ``max_backoff``), and resets
      the back-off once the bank is full (drafting clearly pays here).
    Every reply starts open (it may copy its input). A reply of n tokens thus loses at most
    about ``(budget_steps + probe_len * row/plain) * log2(n / backoff)`` plain steps.
    A draft model must first catch up on every token it missed before it can draft again (a
    prefill as long as the back-off), so for it a closed gate stays closed until the reply
    ends (``backoff=UNTIL_REPLY_END``); its next reply starts in sync (prefilled with the
    prompt) and probes again.
    """

    def __init__(
        self,
        *,
        budget_steps: float = 0.5,
        max_bank_steps: float = 8.0,
        backoff: int = 32,
        max_backoff: int = 512,
        probe_len: int = 1,
    ) -> None:
        self.budget_steps = budget_steps
        self.max_bank_steps = max_bank_steps
        self.initial_backoff = backoff
        self.max_backoff = max(max_backoff, backoff)  # a longer first back-off is its own cap
        self.probe_len = probe_len
        self.backoff = backoff
        self.plain_ms: float | None = None  # decayed cost of one plain round, measured
        self._closed_for = 0  # plain rounds left before the next probe
        self._saved_ms = 0.0  # booked since the gate last opened
        self.closures = 0  # times the gate closed (reports and tests)

    def is_open(self) -> bool:
        return self._closed_for == 0

    def draft_cap(self, s_max: int, row_ms: float | None = None) -> int:
        """Most tokens the next round may draft; ``row_ms``: what one more verified row costs
        (None: unknown, taken as a whole plain step, the compute-bound worst case)."""
        if not self.is_open() or self.plain_ms is None:
            return 0  # closed, or no plain round measured yet to compare drafting with
        row = self.plain_ms if row_ms is None else row_ms
        if row <= 0.0:
            return s_max  # extra rows are free (memory-bound): nothing to risk
        affordable = int((self._saved_ms + self.budget_steps * self.plain_ms) / row)
        return max(0, min(s_max, max(self.probe_len, affordable)))

    def record(self, drafted: int, emitted: int, round_ms: float) -> None:
        """One round: how many tokens it drafted and emitted, and its wall time."""
        if emitted <= 0 or round_ms <= 0:
            return
        if drafted == 0:
            per = round_ms / emitted
            self.plain_ms = per if self.plain_ms is None else 0.8 * self.plain_ms + 0.2 * per
            if self._closed_for > 0:
                self._closed_for -= 1
            return
        if self.plain_ms is None:
            return  # nothing to compare with yet
        bank = self.max_bank_steps * self.plain_ms
        self._saved_ms = min(bank, self._saved_ms + emitted * self.plain_ms - round_ms)
        if self._saved_ms >= bank:
            self.backoff = self.initial_backoff  # drafting pays here: forget the losses
        elif self._saved_ms < -self.budget_steps * self.plain_ms:
            self._closed_for = self.backoff
            self.backoff = min(2 * self.backoff, self.max_backoff)
            self._saved_ms = 0.0
            self.closures += 1

    def new_reply(self) -> None:
        """A reply starts: probe at once (it may copy its input), keeping the back-off learnt."""
        self._closed_for = 0
        self._saved_ms = 0.0
