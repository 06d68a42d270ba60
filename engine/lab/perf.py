"""Raw speed of one model on this machine: decode and prompt tokens/s, batch-cost curve.

The batch-cost curve (time of a k-token decode relative to a 1-token decode) decides
whether speculation can pay: on few cores small models are compute-bound and k tokens
cost almost k times one token (docs/facts.md §6). A batch holds the reply's own last k tokens:
a mixture of experts reads the experts of every token in it (up to k x top-k of them).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..core.errors import PotluckError
from ..core.load_watch import default_threads
from ..core.runtime import ContextParams, Model
from ..core.target import MAX_EXACT_BATCH, LocalTarget

PROMPT = (
    "<|im_start|>user\nExplain, step by step, how a bicycle stays upright while it moves, "
    "and what the rider does to turn.<|im_end|>\n<|im_start|>assistant\n"
)


@dataclass(frozen=True)
class PerfReport:
    model: str
    threads: int
    decode_tokens_per_s: float  # median over runs, single-token steps
    prefill_tokens_per_s: float  # median over runs, one prompt of prefill_tokens
    prefill_tokens: int
    batch_ms: dict[int, float]  # k -> median ms of a k-token decode
    runs: int

    @property
    def batch_cost(self) -> dict[int, float]:
        one = self.batch_ms[min(self.batch_ms)]
        return {k: ms / one for k, ms in self.batch_ms.items()}


def measure(
    model: Model,
    *,
    n_threads: int = 0,
    runs: int = 5,
    decode_tokens: int = 128,
    prefill_tokens: int = 256,
    ks: Sequence[int] = (1, 2, 4, 8, 16),
    progress: Callable[[str], None] = lambda line: None,
) -> PerfReport:
    """``progress`` hears one line per step (a run takes tens of seconds on a small machine)."""
    if not ks or min(ks) < 1 or max(ks) > MAX_EXACT_BATCH:
        raise PotluckError(f"batch sizes run from 1 to {MAX_EXACT_BATCH} (a verify batch's most), not {list(ks)}")
    target = LocalTarget(model, ContextParams(n_ctx=2048, n_threads=n_threads))
    try:
        base = model.tokenize(PROMPT)
        filler = model.tokenize(" The quick brown fox jumps over the lazy dog.")
        long_prompt = (base + filler * prefill_tokens)[:prefill_tokens]
        decode_rates, prefill_rates = [], []
        batch_ms: dict[int, list[float]] = {k: [] for k in ks}
        for run in range(runs):
            progress(f"run {run + 1} of {runs}: a {len(long_prompt)}-token prompt, {decode_tokens} decode steps, "
                     f"batches of {', '.join(map(str, ks))}")
            target.truncate(0)
            t0 = time.perf_counter()
            target.decode(long_prompt)
            prefill_rates.append(len(long_prompt) / (time.perf_counter() - t0))

            target.truncate(0)
            logits = target.decode(base)[-1]
            tok = int(logits.argmax())
            reply = []
            t0 = time.perf_counter()
            for _ in range(decode_tokens):
                tok = int(target.decode([tok])[-1].argmax())
                reply.append(tok)
            decode_rates.append(decode_tokens / (time.perf_counter() - t0))

            n0 = target.n_past
            for k in ks:
                # the reply's own tokens, as a verify batch holds them: a mixture routes different
                # tokens to different experts (k copies of one token would share theirs)
                batch = (reply * (k // len(reply) + 1))[-k:]
                t0 = time.perf_counter()
                target.decode(batch, all_logits=True)
                batch_ms[k].append((time.perf_counter() - t0) * 1e3)
                target.truncate(n0)
        return PerfReport(
            model=model.name,
            threads=n_threads or default_threads(),  # what the context took for 0
            decode_tokens_per_s=statistics.median(decode_rates),
            prefill_tokens_per_s=statistics.median(prefill_rates),
            prefill_tokens=len(long_prompt),
            batch_ms={k: statistics.median(v) for k, v in batch_ms.items()},
            runs=runs,
        )
    finally:
        target.close()


CONVERSATIONS = [
    ["Hi! Who are you?", "What can you help me with?", "Give me a tip for learning Python."],
    ["Name a fruit.", "What color is it?", "Write a haiku about it."],
    ["What is 12 times 7?", "Now divide that by 4.", "Explain how you did it."],
    ["Tell me about the moon.", "How far away is it?", "Could people live there?"],
    ["Suggest a name for a cat.", "Why that name?", "Suggest one for a dog too."],
]


@dataclass(frozen=True)
class HistoryCheck:
    replies: int  # last-turn replies compared
    differing: int  # replies whose greedy tokens differ between the two ways
    first_divergence: list[int]  # token index where each differing reply first diverges
    prefill_tokens: list[int]  # history length the fresh session prefilled in one go


def history_consistency(
    model: Model, *, max_tokens: int = 64, n_threads: int = 0, progress: Callable[[str], None] = lambda line: None
) -> HistoryCheck:
    """Turn-by-turn conversation vs. the same history prefilled at once in a fresh session.

    llama.cpp computes large batches slightly differently from small ones (docs/facts.md §3),
    so the last reply can differ even though both are "plain greedy decoding".
    """
    from ..core.plain import Plain
    from ..core.session import Session

    params = ContextParams(n_ctx=4096, n_threads=n_threads)
    differing, divergence, prefilled = 0, [], []
    for i, turns in enumerate(CONVERSATIONS):
        progress(f"history check: conversation {i + 1} of {len(CONVERSATIONS)}")
        live = Session(model, LocalTarget(model, params), Plain())
        for text in turns:
            *_, last = live.generate(text, max_tokens=max_tokens)
        history = live.messages[:-1]  # everything but the last reply
        fresh = Session(model, LocalTarget(model, params), Plain())
        fresh.load_messages(history[:-1])
        *_, again = fresh.generate(history[-1].content, max_tokens=max_tokens)
        prefilled.append(again.prefill_tokens)
        if last.tokens != again.tokens:
            differing += 1
            pairs = zip(last.tokens + (-1,), again.tokens + (-1,))
            divergence.append(next(i for i, (a, b) in enumerate(pairs) if a != b))
        live.target.close()
        fresh.target.close()
    return HistoryCheck(len(CONVERSATIONS), differing, divergence, prefilled)
