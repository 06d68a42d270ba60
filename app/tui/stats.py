"""What the live panels show, added up from a reply's events (pure, no Textual).

The reply thread folds each event it receives into a :class:`ReplyProgress` snapshot
(stamped with the app's clock), so the panels never poll engine state. The panels sample
the latest snapshot on a timer instead of repainting per token; :class:`SpeedMeter` turns
successive samples into "tokens/s now" and keeps that series for the sparkline. After a
reply ends, the figures come from its :class:`~potluck.engine.core.events.Finished` totals, so
they stay exact and stable.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ...engine import DrafterStanding, Event, Finished, ReplyStarted, RoundStats, TokenText

DASH = "—"
PAUSED_AFTER = 8  # rounds without a draft after drafting: the floor stopped it (adaptive.DraftGate)
PLAIN_NAMES = ("plain", "autoregressive")


@dataclass(frozen=True)
class ReplyProgress:
    """One reply's figures so far. Immutable: the reply thread replaces the snapshot per
    event and the UI thread reads whichever one is current, so no lock is needed."""

    run_id: int | None = None
    running: bool = False
    strategy: str = ""
    started_at: float = 0.0
    first_token_at: float = 0.0
    new_tokens: int = 0
    prompt_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    draft_len: int = 0
    n_past: int = 0
    n_ctx: int = 0
    draft_ms: float = 0.0  # busy drafting, whole reply
    verify_ms: float = 0.0  # busy verifying, whole reply
    overlap_ms: float = 0.0  # both at once
    drafters: tuple[DrafterStanding, ...] = ()  # latest standings of voting drafters
    finished: Finished | None = None
    draft_rounds: int = 0  # rounds that drafted: what "accepted per round" counts over
    last_draft_round: int = 0  # the round that drafted last (1-based; 0: none yet)
    plain_ms: float = 0.0  # time of the timed rounds that drafted nothing: plain steps
    plain_steps: int = 0

    def after(self, event: Event, now: float) -> ReplyProgress:
        """The figures once ``event`` has arrived at time ``now``."""
        if isinstance(event, ReplyStarted):
            return ReplyProgress(
                run_id=event.run_id,
                running=True,
                strategy=event.strategy,
                started_at=now,
                prompt_tokens=event.prompt_tokens,
                n_past=event.prompt_tokens - event.prefill_tokens,  # what the cache already holds
                n_ctx=event.n_ctx,
            )
        if isinstance(event, RoundStats):
            return replace(
                self,
                first_token_at=self.first_token_at or now,
                new_tokens=self.new_tokens + event.emitted,
                drafted=self.drafted + event.drafted,
                accepted=self.accepted + event.accepted,
                rounds=self.rounds + 1,
                draft_len=event.draft_len,
                n_past=event.n_past,
                draft_ms=self.draft_ms + event.draft_ms,
                verify_ms=self.verify_ms + event.verify_ms,
                overlap_ms=self.overlap_ms + event.overlap_ms,
                drafters=event.drafters or self.drafters,
                draft_rounds=self.draft_rounds + (event.drafted > 0),
                last_draft_round=self.rounds + 1 if event.drafted else self.last_draft_round,
                plain_ms=self.plain_ms + (event.verify_ms if not event.drafted else 0.0),
                plain_steps=self.plain_steps + (not event.drafted and event.verify_ms > 0),
            )
        if isinstance(event, TokenText) and event.token_ids and not self.first_token_at:
            return replace(self, first_token_at=now)
        if isinstance(event, Finished):
            return replace(self, running=False, n_past=event.n_past, finished=event)
        return self

    @property
    def drafting_paused(self) -> bool:
        """It drafted, then stopped for a while: drafting did not pay on this text."""
        return self.draft_rounds > 0 and self.rounds - self.last_draft_round >= PAUSED_AFTER

    def stopped(self) -> ReplyProgress:
        """The reply ended without a :class:`Finished` (it failed)."""
        return replace(self, running=False) if self.running else self


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
    overlap_pct: float | None = None  # share of verification the draft ran alongside (pearl)
    drafters: tuple[DrafterStanding, ...] = ()
    gain: str = ""  # one line: what speculation bought this reply


def _overlap_pct(p: ReplyProgress) -> float | None:
    """Overlap as a share of the shorter busy time: 100 % means one fully hid the other."""
    shorter = min(p.draft_ms, p.verify_ms)
    return 100.0 * min(1.0, p.overlap_ms / shorter) if p.overlap_ms > 0 and shorter > 0 else None


def _acceptance(p: ReplyProgress) -> tuple[float | None, float | None]:
    """Acceptance, and accepted drafts per round that drafted (rounds the floor kept plain
    do not count: "accepted/round 0.01" beside "acceptance 1.00" said nothing)."""
    if not p.drafted:
        return None, None
    return p.accepted / p.drafted, (p.accepted / p.draft_rounds if p.draft_rounds else None)


def gain_line(p: ReplyProgress, rate: float | None, plain_rate: float | None) -> str:
    """What speculation bought: the reply's rate against plain decoding's on this machine."""
    if p.strategy in PLAIN_NAMES or (p.strategy and p.strategy.endswith(": plain")):
        return "plain decoding"
    if not p.strategy:
        return ""
    if p.drafting_paused:
        return "drafting paused: did not pay"
    if not p.drafted:
        return "nothing drafted yet" if p.running else "nothing drafted: plain"
    if rate is None or not plain_rate:
        return "vs plain: not measured yet"
    return f"{rate / plain_rate:.2f}× plain ({plain_rate:.0f} tok/s here)"


@dataclass
class SpeedMeter:
    """Samples of one reply's progress; reset when a new reply (run id) shows up."""

    samples: list[float] = field(default_factory=list)
    plain_tok_s: float | None = None  # plain decoding's rate on this machine, latest measured
    _run_id: int | None = None
    _last: tuple[float, int] | None = None

    def _plain_rate(self, p: ReplyProgress) -> float | None:
        """This reply's own plain steps when it had enough of them, else the last measured."""
        if p.plain_steps >= 4 and p.plain_ms > 0:
            self.plain_tok_s = 1000.0 * p.plain_steps / p.plain_ms
        return self.plain_tok_s

    def sample(self, p: ReplyProgress, now: float) -> Figures:
        if p.run_id != self._run_id:
            self._run_id = p.run_id
            self.samples, self._last = [], None
        rate_now: float | None = None
        if p.running and p.first_token_at:
            if self._last is not None and now > self._last[0]:
                rate_now = max(0.0, (p.new_tokens - self._last[1]) / (now - self._last[0]))
                self.samples.append(rate_now)
            self._last = (now, p.new_tokens)
        f = p.finished
        acc, mean = _acceptance(p)
        if f is not None:
            if not f.drafted and f.strategy in PLAIN_NAMES and f.tokens_per_s > 0:
                self.plain_tok_s = f.tokens_per_s  # a plain reply measures the reference
            return Figures(
                running=False,
                strategy=f.strategy,
                tokens_per_s_reply=f.tokens_per_s,
                speed_series=tuple(self.samples),
                ttft_s=f.ttft_s,
                acceptance_rate=acc,
                mean_accepted_len=mean,
                draft_len=p.draft_len if f.drafted and not p.drafting_paused else None,
                drafted=f.drafted,
                accepted=f.accepted,
                prompt_tokens=f.prompt_tokens,
                generated_tokens=len(f.tokens),
                n_past=p.n_past,
                n_ctx=p.n_ctx,
                overlap_pct=_overlap_pct(p),
                drafters=p.drafters,
                gain=gain_line(p, f.tokens_per_s, self._plain_rate(p)),
            )
        reply_rate = None
        if p.running and p.first_token_at and now > p.first_token_at and p.new_tokens > 1:
            reply_rate = (p.new_tokens - 1) / (now - p.first_token_at)
        return Figures(
            running=p.running,
            strategy=p.strategy,
            tokens_per_s_now=rate_now,
            tokens_per_s_reply=reply_rate,
            speed_series=tuple(self.samples),
            ttft_s=(p.first_token_at - p.started_at) if p.first_token_at else None,
            acceptance_rate=acc,
            mean_accepted_len=mean,
            draft_len=p.draft_len if (p.drafted or p.draft_len) and not p.drafting_paused else None,
            drafted=p.drafted,
            accepted=p.accepted,
            prompt_tokens=p.prompt_tokens,
            generated_tokens=p.new_tokens,
            n_past=p.n_past,
            n_ctx=p.n_ctx,
            overlap_pct=_overlap_pct(p),
            drafters=p.drafters,
            gain=gain_line(p, reply_rate, self._plain_rate(p)),
        )


def fmt(value: float | int | None, spec: str = ".2f", unit: str = "") -> str:
    """A panel value, or a dash when it does not apply (never a misleading 0)."""
    if value is None:
        return DASH
    return f"{value:{spec}}{unit}"
