"""What every decoding strategy shares: the per-reply state and the strategy interface.

A strategy is a generator: each round it yields a :class:`Round` (the tokens it now knows
are the target's output and the round's counters). The session appends them to the reply,
cuts at an end-of-generation token or the length limit, and sets :attr:`Generation.done`;
the strategy checks it after every ``yield``.

KV invariant every strategy keeps: after each round, the target's sequence 0 holds a
prefix of ``history`` (all conversation tokens, including the ones just yielded) and at
most the last token is pending. Speculative tokens that were rejected are trimmed from the
tail before yielding, so every kept token sits in the KV cell plain decoding would use.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import numpy as np

from .errors import PotluckError
from .events import DrafterStanding
from .sampling import Sampler, SamplingParams
from .target import Target

if TYPE_CHECKING:
    from .runtime import Model
    from .spec import EngineSpec


@dataclass(frozen=True)
class Round:
    tokens: list[int]  # accepted drafts followed by the one token the target itself chose
    drafted: int = 0
    accepted: int = 0
    draft_len: int = 0  # speculation length chosen for this round
    draft_ms: float = 0.0  # busy drafting during the round
    verify_ms: float = 0.0  # busy verifying during the round
    overlap_ms: float = 0.0  # both at once (strategies that draft while the target verifies)
    drafters: tuple[DrafterStanding, ...] = ()  # each voting drafter's standing (minions)
    # the drafter reading the conversation before this round (a draft model's prefill, after
    # the first token): prompt processing, as llama.cpp's speculative example counts it
    prompt_ms: float = 0.0
    # the target's logits [vocab] each of ``tokens`` was decided at (views, not copies): the
    # logprobs a client asks for are the target's, whichever strategy ran
    rows: Sequence[np.ndarray] = ()


@dataclass
class Generation:
    """One reply being generated: what a strategy reads and the session updates."""

    run_id: int  # the reply's id (events carry it)
    target: Target
    sampler: Sampler
    seeds: np.random.SeedSequence  # the reply's seed; drafters get generators spawned from it
    history: list[int]  # the whole conversation's tokens, growing as rounds are accepted
    first_logits: np.ndarray  # [vocab] target logits after the prompt
    max_new: int
    is_eog: Callable[[int], bool]
    cancel: threading.Event = field(default_factory=threading.Event)
    done: bool = False
    n_new: int = 0

    def drafter_rng(self) -> np.random.Generator:
        """A generator of a drafter's own: seeded runs repeat whatever thread drafts."""
        return np.random.default_rng(self.seeds.spawn(1)[0])

    @property
    def remaining(self) -> int:
        """Tokens the reply may still take (drafters never propose more than this)."""
        room = self.target.n_ctx - self.target.n_past - 1
        return max(0, min(self.max_new - self.n_new, room))


class Strategy(ABC):
    """A decoding method. Subclasses register themselves in :mod:`.registry`."""

    name: ClassVar[str]
    needs_draft: ClassVar[bool] = False
    # runs verify batches: refused, in one line, where no batch length is exact on the model's
    # weights (core/batch_exact.py)
    needs_exact_batches: ClassVar[bool] = True
    accepts_draft: ClassVar[bool] = False  # takes an optional --draft (needs_draft implies it)
    description: ClassVar[str] = ""
    n_sequences: ClassVar[int] = 1  # KV sequences the target must offer (side runs, partitions)
    # Its rounds wait for one target result at a time and its sequences are its own, so its
    # batches may share the target with other conversations' (a server's lanes, core/lanes.py).
    shares_batches: ClassVar[bool] = False
    # strategy options (EngineSpec.strategy_options, `bench --option`): name -> what it sets
    options: ClassVar[dict[str, str]] = {}

    @classmethod
    def build(cls, target_model: Model, spec: EngineSpec) -> Strategy:
        """Create the strategy for ``target_model`` (strategies with a draft load it here)."""
        return cls()

    @classmethod
    def observed_tensors(cls, model: Model) -> tuple[str, ...]:
        """Graph tensors the target's context copies out of every run for this strategy
        (``ContextParams.observe``; TriForce reads attention keys and queries)."""
        return ()

    @classmethod
    def check_options(cls, given: dict[str, object]) -> None:
        unknown = sorted(set(given) - set(cls.options))
        if unknown:
            known = ", ".join(sorted(cls.options)) or "none"
            raise PotluckError(f"strategy {cls.name!r} has no option {unknown[0]!r} (its options: {known})")

    def pick_for_reply(self, n_tokens: int, sampling: SamplingParams) -> str:
        """Settle how the next reply runs, for a conversation of ``n_tokens`` tokens sampled
        with ``sampling``, and return the name its events carry (``auto`` picks a strategy here
        and names it)."""
        return self.name

    def prepare(self, g: Generation) -> None:
        """Get ready for a reply after the target's prefill; optional. What runs here delays
        the first token (it counts as prompt processing), so the speculative strategies
        and PEARL leave their drafter's reading of the prompt for after it; PipeInfer on
        several machines prefills its drafter here."""

    @abstractmethod
    def run(self, g: Generation) -> Iterator[Round]:
        """Yield rounds until ``g.done`` is set (or the context is full)."""

    def reset(self) -> None:
        """Forget per-conversation state (a new conversation, or history edited)."""

    def close(self) -> None:
        """Release models or contexts this strategy owns."""
