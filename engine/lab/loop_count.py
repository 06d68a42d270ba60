"""Whether replies loop: a reply *loops* when some 8-token sequence occurs 3 times or more in
it (overlapping occurrences count). scripts/loop_count.py counts it over fixed prompts,
greedy against the chat app's sampling defaults (which the caller passes: the lab never
imports the app); tests check the rule."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core.events import Finished
from ..core.sampling import SamplingParams
from ..core.spec import EngineSpec
from ..loader import open_session

NGRAM, TIMES = 8, 3


def loops(tokens: Sequence[int], n: int = NGRAM, times: int = TIMES) -> bool:
    """True when some ``n``-token sequence occurs ``times`` times or more in ``tokens``."""
    counts = Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
    return any(c >= times for c in counts.values())


@dataclass(frozen=True)
class LoopReport:
    replies: int  # per mode: prompts x seeds
    greedy_loops: int
    sampled_loops: int
    greedy_looped: tuple[str, ...]  # prompts whose greedy reply loops
    sampled_looped: tuple[tuple[str, int], ...]  # (prompt, seed) whose sampled reply loops


def count_loops(model: Path | None, prompts: Sequence[str], seeds: Sequence[int], max_tokens: int,
                strategy: str, sampled: Callable[[int], SamplingParams], n_threads: int = 0) -> LoopReport:
    """Each prompt answered greedily by plain decoding (deterministic: a loop counts once per
    seed) and once per seed with ``strategy`` and ``sampled(seed)``, each in a fresh session."""

    def reply(strategy: str, prompt: str, params: SamplingParams) -> list[int]:
        # a fresh conversation per reply: no earlier reply shapes this one
        session = open_session(EngineSpec(model=model, strategy=strategy, n_threads=n_threads))
        try:
            fin = [e for e in session.generate(prompt, params, max_tokens) if isinstance(e, Finished)][-1]
        finally:
            session.close()
        return list(fin.tokens)

    greedy = [p for p in prompts if loops(reply("plain", p, SamplingParams()))]
    looped = [(p, seed) for p in prompts for seed in seeds if loops(reply(strategy, p, sampled(seed)))]
    return LoopReport(len(prompts) * len(seeds), len(greedy) * len(seeds), len(looped), tuple(greedy), tuple(looped))
