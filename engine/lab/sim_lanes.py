"""Several conversations decoded together over the simulated pipeline: the hub of
engine/core/lanes.py, modelled (see :mod:`.simulate` for the stages, links and cores).

Each of ``conversations`` lanes prefills its own prompt (the hub sends one lane's prompt
chunks at a time), then decodes plain decoding's steps, one row a lane a step. The hub's
rules, as the module does them:

- at most ``depth`` batches of lanes' steps in flight: 1 on one stage (the next would only
  queue behind it), ``n_stages + 1`` on a pipeline (one a stage, one waiting at the first);
- a batch takes ``max(1, active // depth)`` lanes, the lanes in order: one machine puts every
  lane in one batch, a pipeline spreads them over enough micro-batches to keep every stage
  busy, each as large as that allows;
- a batch goes once every lane that is not in flight is ready; the head then samples each
  returned lane's row (``sample_ms`` a row: the lanes' threads take turns on one interpreter).

A batch of ``b`` rows costs ``stage_ms * cost(b)`` on each stage, as any run does. The figures
are aggregate: every conversation's tokens over the time from the end of the prompts to the
last token, and the gain over one conversation on the same pipeline.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Sequence
from dataclasses import asdict, replace

from ..core.errors import PotluckError
from .sim_config import SimConfig
from .sim_engine import BUSY, WAIT, Action, Engine
from .sim_head import Timeline

MAX_CONVERSATIONS = 256  # llama.cpp's most sequences in one context


def hub_depth(n_stages: int) -> int:
    """Batches of lanes' steps in flight at once (core/lanes.py ``LaneHub._depth``)."""
    return 1 if n_stages <= 1 else n_stages + 1


def lanes_loop(eng: Engine, conversations: int, timeline: Timeline) -> Generator[Action, None, None]:
    """The hub's loop over ``conversations`` lanes of plain decoding."""
    cfg, c = eng.cfg, eng.counters
    for _ in range(conversations):  # one lane's prompt at a time, its last row gives its first token
        chunks = [min(cfg.n_batch, cfg.prompt_tokens - s) for s in range(0, cfg.prompt_tokens, cfg.n_batch)]
        last = [eng.submit(n, prefill=True) for n in chunks][-1]
        yield (WAIT, last)
        yield (BUSY, cfg.sample_ms)
    timeline.prefill_end = timeline.first_after = eng.now
    timeline.busy_at_prefill = eng.busy_until_now()
    timeline.contended_at_prefill = eng.cores.contended_until_now()
    depth = hub_depth(cfg.n_stages)
    left = [cfg.tokens] * conversations  # tokens each lane still decides
    ready: deque[int] = deque(range(conversations))
    in_flight: deque[tuple[int, list[int]]] = deque()
    while in_flight or ready:
        per_batch = max(1, sum(n > 0 for n in left) // depth)
        while ready and len(in_flight) < depth:
            lanes = [ready.popleft() for _ in range(min(per_batch, len(ready)))]
            in_flight.append((eng.submit(len(lanes)), lanes))
            c.runs += 1
            c.max_in_flight = max(c.max_in_flight, len(in_flight))
        run, lanes = in_flight[0]
        if not eng.ready(run):
            yield (WAIT, run)
        in_flight.popleft()
        yield (BUSY, cfg.sample_ms * len(lanes))
        for lane in lanes:
            left[lane] -= 1
            if left[lane] > 0:
                ready.append(lane)
    timeline.end = eng.now


def simulate_lanes(cfg: SimConfig, conversations: Sequence[int] = (1, 2, 4)) -> dict:
    """Aggregate tokens/s of plain decoding with each number of conversations decoded
    together over ``cfg``'s pipeline, and the gain over one conversation. No randomness: one
    run each (``cfg.seeds`` is not used)."""
    cfg.check()
    counts = sorted(set(conversations))
    if not counts or counts[0] < 1 or counts[-1] > MAX_CONVERSATIONS:
        raise PotluckError(f"simulate: --conversations takes counts from 1 to {MAX_CONVERSATIONS}, "
                           f"got {list(conversations)}")
    results: dict[int, dict] = {}
    for n in counts:
        eng = Engine(replace(cfg, strategies=("iterative",)))
        timeline = Timeline()
        eng.run(lanes_loop(eng, n, timeline))
        wall = timeline.end - timeline.prefill_end
        busy = [(b - b0) / wall for b, b0 in zip(eng.busy_until_now(), timeline.busy_at_prefill)]
        results[n] = {
            "tok_s": n * cfg.tokens / wall * 1e3,
            "per_conversation_tok_s": cfg.tokens / wall * 1e3,
            "stage_busy": busy,
            "busy_mean": sum(busy) / len(busy),
            "contended": (eng.cores.contended_until_now() - timeline.contended_at_prefill) / wall,
            "batches": eng.counters.runs,
            "rows_per_batch": n * cfg.tokens / max(1, eng.counters.runs),
            "max_in_flight": eng.counters.max_in_flight,
        }
    base = results.get(1)
    for r in results.values():
        r["gain_vs_one"] = r["tok_s"] / base["tok_s"] if base else None
    return {"config": asdict(cfg), "conversations": counts, "results": results}
