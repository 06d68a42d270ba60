"""What a generation streams to its consumer (CLI, TUI, benchmarks). Data only.

A generation yields any number of :class:`TokenText` and :class:`RoundStats`, then one
:class:`Finished`. Counters are per round because the panels and the adaptive
selectors read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenText:
    """Newly accepted tokens and the valid UTF-8 text they complete."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class RoundStats:
    """One draft/verify round (plain decoding: one token, nothing drafted)."""

    drafted: int
    accepted: int
    emitted: int
    draft_len: int
    draft_ms: float
    verify_ms: float


@dataclass(frozen=True)
class NodeStatus:
    """A pipeline stage's health as seen by the head (cluster mode)."""

    node: str
    layers: tuple[int, int]
    state: str
    detail: str = ""


@dataclass(frozen=True)
class Finished:
    """The end of a reply, with its totals."""

    reason: str  # "stop" (end-of-generation token), "length", "cancelled", "context_full"
    text: str
    tokens: tuple[int, ...]
    prompt_tokens: int  # tokens of the whole rendered conversation
    prefill_tokens: int  # tokens actually processed for this turn (the rest was cached)
    ttft_s: float
    prefill_s: float
    decode_s: float
    tokens_per_s: float
    prefill_tokens_per_s: float
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    strategy: str = "autoregressive"
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_len(self) -> float | None:
        return self.accepted / self.rounds if self.rounds and self.drafted else None


Event = TokenText | RoundStats | NodeStatus | Finished
