"""TriForce (Sun et al. 2024): hierarchical speculation for long contexts.

Every decoding step of a long conversation reads the whole KV cache. TriForce drafts with
the target itself over a small *retrieval cache* (the chunks of the context that matter for
the current query) and verifies with the full cache, and lets a cheaper draft speculate for
that retrieval-cache target in turn:

    N-gram tables  --gamma1-->  target over the retrieval cache (sequence 1)
                   --gamma2-->  target over the full cache (sequence 0, canonical)

The first level is a drafter (:class:`~..drafters.retrieval.RetrievalDrafter`: the
retrieval cache, its rebuilds, the N-gram guesses it checks on the way); the second is
:class:`~.speculative.Speculative`'s round loop unchanged: sequence 0 verifies the pending
token and the gamma2 drafts in one batch of at most ``target.exact.max_rows`` rows (same
verifier, rejected tail trimmed), so greedy output is token for token plain decoding's and
sampled output keeps the target's distribution (retrieval drafts are deterministic: q =
delta). What TriForce adds to the loop is its choice of drafter each round (:meth:`plan`).

Below ``min_context`` tokens (or when the retrieval cache would not be much smaller than the
full one) a reply runs as ``anpd``: reading the cache is then cheap and the retrieval level
only costs. In a long reply, rounds where one retrieval draft cannot pay for its verify row
(measured: :class:`..adaptive.DraftBreakEven`) draft with the N-grams alone, and a
:class:`..adaptive.DraftGate` keeps the reply from falling below plain decoding.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ...core.errors import PotluckError
from ...core.strategy import Generation, Round, Strategy
from ...core.target import MAX_EXACT_BATCH
from ..adaptive import LengthConfig
from ..drafters import Drafter
from ..drafters.ngram import NgramDrafter
from ..drafters.retrieval import LevelCounters, RetrievalConfig, RetrievalDrafter, score_layers
from .kit import LENGTH_OPTIONS, bool_option, int_option, saved_costs
from .speculative import NgramSpeculative, Speculative

if TYPE_CHECKING:
    from ...core.runtime import Model
    from ...core.spec import EngineSpec


class TriForce(Speculative):
    name = "triforce"
    description = "long contexts: the target drafts over a retrieval KV cache, N-grams draft for it"
    n_sequences = 2
    options = {
        **LENGTH_OPTIONS,
        "ngram_max": "the longest N-gram the tables hold",
        "budget": "tokens of context chunks the retrieval cache keeps",
        "chunk": "positions per scored chunk",
        "sinks": "first positions the retrieval cache always keeps",
        "recent": "last positions the retrieval cache always keeps",
        "stride": "rebuild the retrieval cache after this many new tokens",
        "min_context": "shorter conversations decode as anpd",
        "gamma1": "most N-gram tokens per retrieval-cache step",
    }

    def __init__(
        self,
        model: Model,
        config: RetrievalConfig,
        length: LengthConfig,
        short: NgramSpeculative,
        *,
        n_max: int = 5,
        adaptive: bool = True,
    ) -> None:
        self.ngram = NgramDrafter(n_max)
        self.retrieval = RetrievalDrafter(model, config, self.ngram, adaptive=adaptive)
        # the full cache's verify-cost line is learnt per reply here (no saved line)
        super().__init__(self.retrieval, length, adaptive=adaptive)
        self.config = config
        self.short = short  # the whole reply when the context is short
        self.n_max = n_max
        self._long = False

    @property
    def counters(self) -> LevelCounters:
        """What each level drafted and kept since the last reset (the bench reads these)."""
        return self.retrieval.counters

    # -- construction
    @classmethod
    def observed_tensors(cls, model: Model) -> tuple[str, ...]:
        if model.recurrent:
            return ()  # refused by build
        return tuple(f"{kind}-{layer}" for layer in score_layers(model.n_layer) for kind in ("Qcur", "Kcur"))

    @classmethod
    def build(cls, target_model: Model, spec: EngineSpec) -> Strategy:
        cls.check_options(spec.strategy_options)
        if spec.cluster is not None:
            raise PotluckError(
                "strategy 'triforce' runs on one machine (it reads the target's attention keys); "
                "use anpd or sd with --nodes"
            )
        if target_model.recurrent:
            raise PotluckError(
                f"strategy 'triforce' drafts over a retrieval cache of attention cells, and {target_model.arch}'s "
                "recurrent layers keep one state per sequence that no subset of positions can rebuild; use anpd or sd"
            )
        d = RetrievalConfig()
        n_max = int_option(spec, "ngram_max", 5, 2, 16)
        chunk = int_option(spec, "chunk", d.chunk, 1, 256)
        config = RetrievalConfig(
            budget=int_option(spec, "budget", d.budget, chunk, 1 << 20),
            chunk=chunk,
            sinks=int_option(spec, "sinks", d.sinks, 0, 1 << 20),
            recent=int_option(spec, "recent", d.recent, 1, 1 << 20),
            stride=int_option(spec, "stride", d.stride, 1, 1 << 20),
            min_context=int_option(spec, "min_context", d.min_context, 0, 1 << 24),
            gamma1=int_option(spec, "gamma1", d.gamma1, 0, MAX_EXACT_BATCH - 1),
        )
        s_max = int_option(spec, "max_draft", 8, 1, MAX_EXACT_BATCH - 1)
        s_init = int_option(spec, "initial_draft", min(4, s_max), 0, s_max)
        adaptive = bool_option(spec, "adaptive", True)
        length = LengthConfig(s_init=s_init, s_max=s_max)
        costs = saved_costs(target_model, spec)
        short_length = LengthConfig(s_init=min(7, s_max), s_max=min(7, s_max))
        short = NgramSpeculative(NgramDrafter(n_max), short_length, adaptive=adaptive, costs=costs)
        return cls(target_model, config, length, short, n_max=n_max, adaptive=adaptive)

    # -- a reply
    def prepare(self, g: Generation) -> None:
        n_past = g.target.n_past
        self._long = n_past >= self.config.min_context and n_past >= 2 * self.config.kept
        if not self._long:
            self.counters.short_replies += 1
            self.short.prepare(g)
            return
        self.counters.long_replies += 1

    def start_drafting(self, g: Generation) -> None:
        """After the first token (:meth:`Speculative.prepare`): the retrieval drafter takes
        the target, its N-grams read the conversation."""
        self.retrieval.start(g.target, g.history, g.drafter_rng())

    def run(self, g: Generation) -> Iterator[Round]:
        if not self._long:
            yield from self.short.run(g)
            return
        yield from super().run(g)

    def plan(self, g: Generation, pending: list[int]) -> tuple[int, float, Drafter]:
        """How many drafts this round may verify, how likely each must be, and from which
        level: a retrieval-cache draft costs a target step (the drafter's ``step_ms``), an
        N-gram draft nothing. Where verifying a row costs nearly a whole step (compute-bound
        batches, docs/facts.md §6) no retrieval draft can pay: the N-grams then draft alone
        (anpd). Never asked for the first round: that one only samples the prompt's token
        (:meth:`Speculative.prepare`)."""
        drafter: Drafter = self.retrieval
        if self.adaptive:
            step_ms, wanted = self.retrieval.step_ms, self.length.length()
            min_accept_p = self.break_even.threshold(step_ms, wanted)
            if min_accept_p >= 1.0:
                drafter, min_accept_p = self.ngram, self.break_even.threshold(0.0, wanted)
            verify_row = self.break_even.row_ms(wanted)  # each row's share on the measured curve
            row_ms = verify_row + (0.0 if drafter is self.ngram else step_ms) if verify_row is not None else None
            s = min(wanted, self.gate.draft_cap(self.length_config.s_max, row_ms))
        else:
            s, min_accept_p = self.length_config.s_max, 0.0
        k = max(0, min(s, g.remaining - 1, g.target.exact.max_rows - len(pending)))
        return (0 if min_accept_p >= 1.0 else k), min_accept_p, drafter

    def learn(self, drafter: Drafter, drafted: int, accepted: int) -> None:
        if drafter is self.ngram:  # level 1 skipped: the full cache judged N-gram drafts
            self.counters.direct_drafted += drafted
            self.counters.direct_accepted += accepted
        super().learn(drafter, drafted, accepted)

    # -- lifetime
    def reset(self) -> None:
        self.short.reset()
        super().reset()  # the retrieval drafter and its N-grams, the length and the gate

    def close(self) -> None:
        self.short.close()
        super().close()
