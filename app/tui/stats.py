"""What the live panels show, computed from the engine's counters (pure, no Textual).

The panels sample :class:`~potluck.engine.session.LiveStats` on a timer instead of
repainting per token; :class:`SpeedMeter` turns successive samples into "tokens/s now"
and keeps that series for the sparkline. After a reply ends, the figures come from its
:class:`~potluck.engine.events.Finished` totals, so they stay exact and stable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ...engine.events import Finished

DASH = "—"


class Counters(Protocol):
    running: bool
    strategy: str
    started_at: float
    first_token_at: float
    new_tokens: int
    prompt_tokens: int
    drafted: int
    accepted: int
    rounds: int
    draft_len: int
    n_past: int
    n_ctx: int


@dataclass(frozen=True)
class Figures:
    running: bool = False
    strategy: str = ""
    tokens_per_s_now: float | None = None
    tokens_per_s_reply: float | None = None
    speed_series: tuple[float, ...] = ()
    ttft_s: float | None = None
    acceptance_rate: float | None = None  # None: nothing drafted (plain decoding)
    mean_accepted_len: float | None = None
    draft_len: int | None = None
    drafted: int = 0
    accepted: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    n_past: int = 0
    n_ctx: int = 0


def _acceptance(drafted: int, accepted: int, rounds: int) -> tuple[float | None, float | None]:
    if not drafted:
        return None, None
    return accepted / drafted, (accepted / rounds if rounds else None)


@dataclass
class SpeedMeter:
    """Samples of one reply's progress; reset when a new reply starts."""

    samples: list[float] = field(default_factory=list)
    _reply_started_at: float | None = None
    _last: tuple[float, int] | None = None
    _finished: Finished | None = None

    def finish(self, finished: Finished) -> None:
        self._finished = finished

    def sample(self, stats: Counters, now: float) -> Figures:
        if stats.running and stats.started_at != self._reply_started_at:
            self._reply_started_at = stats.started_at
            self.samples, self._last, self._finished = [], None, None
        rate_now: float | None = None
        if stats.running and stats.first_token_at:
            if self._last is not None and now > self._last[0]:
                rate_now = max(0.0, (stats.new_tokens - self._last[1]) / (now - self._last[0]))
                self.samples.append(rate_now)
            self._last = (now, stats.new_tokens)
        f = self._finished
        if f is not None and not stats.running:
            acc, mean = f.acceptance_rate, f.mean_accepted_len
            return Figures(
                running=False,
                strategy=f.strategy,
                tokens_per_s_reply=f.tokens_per_s,
                speed_series=tuple(self.samples),
                ttft_s=f.ttft_s,
                acceptance_rate=acc,
                mean_accepted_len=mean,
                draft_len=stats.draft_len if f.drafted else None,
                drafted=f.drafted,
                accepted=f.accepted,
                prompt_tokens=f.prompt_tokens,
                generated_tokens=len(f.tokens),
                n_past=stats.n_past,
                n_ctx=stats.n_ctx,
            )
        acc, mean = _acceptance(stats.drafted, stats.accepted, stats.rounds)
        reply_rate = None
        if stats.first_token_at and now > stats.first_token_at and stats.new_tokens > 1:
            reply_rate = (stats.new_tokens - 1) / (now - stats.first_token_at)
        return Figures(
            running=stats.running,
            strategy=stats.strategy,
            tokens_per_s_now=rate_now,
            tokens_per_s_reply=reply_rate if stats.running else None,
            speed_series=tuple(self.samples),
            ttft_s=(stats.first_token_at - stats.started_at) if stats.first_token_at else None,
            acceptance_rate=acc,
            mean_accepted_len=mean,
            draft_len=stats.draft_len if (stats.drafted or stats.draft_len) else None,
            drafted=stats.drafted,
            accepted=stats.accepted,
            prompt_tokens=stats.prompt_tokens,
            generated_tokens=stats.new_tokens,
            n_past=stats.n_past,
            n_ctx=stats.n_ctx,
        )


def fmt(value: float | int | None, spec: str = ".2f", unit: str = "") -> str:
    """A panel value, or a dash when it does not apply (never a misleading 0)."""
    if value is None:
        return DASH
    return f"{value:{spec}}{unit}"
