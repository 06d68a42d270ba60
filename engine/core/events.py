"""What a generation streams to its consumer (CLI, TUI, benchmarks). Data only.

A reply yields one :class:`ReplyStarted`, then any number of :class:`TokenText`,
:class:`RoundStats` and :class:`NodeStatus`, then one :class:`Finished`. Every event carries
the ``run_id`` of its reply, so a consumer that has more than one reply in flight (or a
late event of a cancelled one) can tell them apart. Counters are per round because the
panels and the adaptive selectors read them; consumers add them up themselves instead of
polling engine state.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReplyStarted:
    """The prompt is known (prefill is about to run)."""

    run_id: int
    strategy: str
    prompt_tokens: int  # tokens of the whole rendered conversation
    prefill_tokens: int  # tokens that must be processed now (the rest is cached)
    n_ctx: int  # tokens the conversation may hold
    thinking_opened: bool = False  # the rendered prompt opened a <think> block: the reply starts inside it


@dataclass(frozen=True)
class TokenLogprob:
    """A reply token's log-probability under the target (the softmax of its raw logits, before
    penalties, filters, temperature or grammar: what llama-server reports), and the likeliest
    tokens at its position with theirs, likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenText:
    """Newly accepted tokens and the valid UTF-8 text they complete."""

    run_id: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token id, when the reply asked for them
    choice: int = 0  # which of a request's n replies (Session.answer's n)


@dataclass(frozen=True)
class DrafterStanding:
    """One of several voting drafters after a round (minions): what its panel row shows."""

    name: str
    weight: float  # its vote
    acceptance: float  # tokens the target kept / tokens judged, this conversation
    voted: bool  # its chain was the one verified this round


@dataclass(frozen=True)
class RoundStats:
    """One draft/verify round (plain decoding: one token, nothing drafted)."""

    run_id: int
    drafted: int
    accepted: int
    emitted: int
    draft_len: int  # speculation length chosen for the round
    draft_ms: float  # busy drafting during the round
    verify_ms: float  # busy verifying during the round
    n_past: int  # tokens in the KV cache after the round
    overlap_ms: float = 0.0  # drafting and verifying at once (pearl, minions drafting ahead)
    drafters: tuple[DrafterStanding, ...] = ()  # voting drafters' standings (minions)


@dataclass(frozen=True)
class NodeStatus:
    """A pipeline stage's health as seen by the head (cluster mode)."""

    run_id: int
    node: str
    layers: tuple[int, int]
    state: str  # "ok", "failed", "lost" (gone mid-reply) or "recovering"
    detail: str = ""


@dataclass(frozen=True)
class PlanChanged:
    """The cluster's layer plan changed mid-conversation (a node was lost, or re-planned)."""

    run_id: int
    stages: tuple[tuple[str, int, int], ...]  # (node, first layer, last layer) per stage, in order
    reason: str  # one line for the user: what happened and what the head did about it


@dataclass(frozen=True)
class Finished:
    """The end of a reply, with its totals."""

    run_id: int
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
    strategy: str = "plain"
    n_past: int = 0  # tokens in the KV cache after the reply
    extra: dict[str, float] = field(default_factory=dict)
    choice: int = 0  # which of a request's n replies (Session.answer's n)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted_len(self) -> float | None:
        return self.accepted / self.rounds if self.rounds and self.drafted else None


Event = ReplyStarted | TokenText | RoundStats | NodeStatus | PlanChanged | Finished


@dataclass(frozen=True)
class StageView:
    """One worker's stage as the head sees it now (cluster panels, ``/health``)."""

    node: str  # node id, or the address before the worker named itself
    address: str
    layers: tuple[int, int]  # [lo, hi) of the model's layers
    bytes_total: int  # bytes sent to and received from it so far (slices included)


@dataclass(frozen=True)
class ClusterView:
    """The chain a cluster session runs on: read between the head's updates, never torn."""

    stages: tuple[StageView, ...]
    head_layers: tuple[int, int]  # the layers the head computes itself: none, (n_layer, n_layer)
    tokens: int  # tokens sent down the chain so far
    # (node, state, detail) of the stages that are not "ok" now: a loss being recovered shows
    # here at once, while the reply thread waits for the new chain (10-18 s)
    health: tuple[tuple[str, str, str], ...] = ()
    # the plan's mixture of experts: routed experts per layer, used a token, shared (0s: dense)
    experts: tuple[int, int, int] = (0, 0, 0)
