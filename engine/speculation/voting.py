"""Minions' majority-voted speculator (Wang et al. 2024, section 3.2) as pure functions.

Each drafter proposes a chain; the chains merge into a token tree
(:meth:`~potluck.engine.speculation.verify.TokenTree.from_chains`). A node's weight is the sum of the
weights of the drafters whose chain passes through it; from the root the heaviest child is
followed to a leaf, and that path is the majority-approved draft (ties: the drafter listed
first). The drafter whose chain ends at that leaf is the *voted* drafter.

Weights follow measured acceptance (the weighted majority algorithm, Littlestone and Warmuth
1994): after ``window`` judged rounds a drafter's average acceptance rate (ACR, the paper's
equation 1) is compared with ``reward_threshold`` and ``punish_threshold`` and its weight is
multiplied by ``reward`` or ``punish``. One change from the paper: every drafter is scored
against the tokens the target really produced, not only the voted one, so a drafter that was
outvoted but right gains weight (the target's own token after a rejection judges them all).
Weights stay within ``[w_min, w_max]`` so a drafter punished for a while can still win back
its place when the conversation changes. The paper names the thresholds and factors but
gives no values; :class:`WeightConfig`'s are ours (a drafter kept at 60 % gains half again
its weight per window, one under 30 % loses half).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .verify import TokenTree


@dataclass(frozen=True)
class WeightConfig:
    window: int = 4  # judged rounds per drafter before its weight is updated
    reward_threshold: float = 0.6
    punish_threshold: float = 0.3
    reward: float = 1.5
    punish: float = 0.5
    w_min: float = 1.0 / 64
    w_max: float = 64.0


def score_chain(chain: Sequence[int], truth: Sequence[int]) -> tuple[int, int]:
    """(kept, judged) tokens of ``chain`` against what the target produced after the same
    context. A chain is judged up to its first wrong token and everything after that counts
    as lost (the paper's acceptance rate: verified length / speculation length); a chain
    longer than what is known so far is judged only on the known part.
    """
    kept = 0
    for a, b in zip(chain, truth):
        if a != b:
            return kept, len(chain)
        kept += 1
    return kept, kept


class DrafterWeights:
    """Per-drafter vote weights driven by measured acceptance (pure: no timing, no model)."""

    def __init__(
        self, n: int, config: WeightConfig = WeightConfig(), initial: Sequence[float] | None = None
    ) -> None:
        self.config = config
        self.weights = [1.0] * n if initial is None else [float(w) for w in initial]
        self.kept = [0] * n  # whole conversation, for reports
        self.judged = [0] * n
        self._rates: list[list[float]] = [[] for _ in range(n)]  # this window's per-round rates
        self.changes = 0  # weight updates made (tests and reports)

    def record(self, i: int, kept: int, judged: int) -> None:
        """Drafter ``i``'s chain of one round: ``kept`` of ``judged`` tokens accepted."""
        if judged <= 0:
            return
        self.kept[i] += kept
        self.judged[i] += judged
        rates = self._rates[i]
        rates.append(kept / judged)
        if len(rates) >= self.config.window:
            acr = sum(rates) / len(rates)
            rates.clear()
            cfg = self.config
            if acr >= cfg.reward_threshold:
                self.weights[i] = min(cfg.w_max, self.weights[i] * cfg.reward)
                self.changes += 1
            elif acr <= cfg.punish_threshold:
                self.weights[i] = max(cfg.w_min, self.weights[i] * cfg.punish)
                self.changes += 1

    def acceptance(self, i: int) -> float:
        return self.kept[i] / self.judged[i] if self.judged[i] else 0.0

    def leader(self) -> int:
        """The heaviest drafter (ties: the first)."""
        return max(range(len(self.weights)), key=lambda i: (self.weights[i], -i))


def heaviest_path(
    chains: Sequence[Sequence[int]], weights: Sequence[float], root: int = -1
) -> tuple[list[int], int]:
    """The majority-approved chain and the index of the voted drafter (-1: no chain).

    ``chains[i]`` is drafter ``i``'s proposal (possibly empty: it does not vote).
    """
    tree = TokenTree.from_chains(root, chains)
    weight = [0.0] * len(tree.tokens)
    ends: list[int] = []  # node where each chain ends (0: empty chain)
    for chain, w in zip(chains, weights):
        node = 0
        for tok in chain:
            node = next(c for c in tree.children(node) if tree.tokens[c] == tok)
            weight[node] += w
        ends.append(node)
    node, path = 0, []
    while True:
        kids = tree.children(node)  # in insertion order: ties go to the first drafter's token
        if not kids:
            break
        node = max(kids, key=lambda c: (weight[c], -c))
        path.append(tree.tokens[node])
    if node == 0:
        return [], -1
    voters = [i for i, end in enumerate(ends) if end == node]
    return path, max(voters, key=lambda i: (weights[i], -i))
