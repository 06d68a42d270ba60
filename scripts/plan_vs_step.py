"""The planner's time model against a measured decoding step, one process per GGUF (docs/facts.md §33).

The planner times a stage by the weight bytes a token reads (a mixture's routed experts only) at
the node's measured speed, times ``TWO_ROW_STEP_COST`` where single steps run as 2 rows. This
prints that prediction beside plain greedy decoding's measured rate for each file, run whole on
this machine. Given two depths of one shape (``--layers 4,12``), it also prints what each added
layer cost against what the model says, which leaves the fixed costs (the output layer, Python)
out: that is the figure to compare across architectures.

    python -m scripts.plan_vs_step --shape qwen35moe-35b-a3b --shape qwen3-30b-a3b --layers 4,12
    python -m scripts.plan_vs_step FILE.gguf ...
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from potluck.engine import EngineSpec, SamplingParams, TokenText, open_session
from potluck.engine.cluster.plan import layer_costs, step_cost, whole_model_s
from potluck.engine.cluster.profile import measure_speed
from potluck.engine.core.errors import PotluckError
from potluck.engine.lab.shapes import build_named_shape

PROMPT = "Tell me a story about a cat who learns to sail."


def measured_step_s(path: Path, threads: int, tokens: int, reps: int) -> float:
    """Best of ``reps`` greedy replies: seconds a decoded token, the first (prefill) left out."""
    session = open_session(EngineSpec(model=path, strategy="plain", n_threads=threads, n_ctx=512))
    best = float("inf")
    try:
        for _ in range(reps):
            n, start = 0, 0.0
            for event in session.generate(PROMPT, SamplingParams(), tokens):
                if isinstance(event, TokenText):
                    n += 1
                    if n == 1:
                        start = time.perf_counter()
            if n > 1:
                best = min(best, (time.perf_counter() - start) / (n - 1))
    finally:
        session.close()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--shape", action="append", default=[], help="a shape of `potluck bench --shape` (repeatable)")
    ap.add_argument("--layers", default="4,12", help="depths to build each --shape at (comma-separated)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    files = list(args.files)
    for shape in args.shape:
        files += [build_named_shape(shape, layers=int(n)) for n in args.layers.split(",")]
    speed = measure_speed(args.threads)
    print(f"speed {speed:.2f} GB/s at {args.threads} threads (profile.measure_speed)")
    rows = []
    for path in files:
        costs = layer_costs(path)
        rows_a_step = step_cost(path, costs)
        predicted_s = whole_model_s(costs, speed) * rows_a_step
        got_s = measured_step_s(path, args.threads, args.tokens, args.reps)
        recurrent = sum(1 for b in costs.state_bytes or () if b)
        rows.append((path, costs, predicted_s, got_s))
        print(f"{path.name}: {costs.arch}, {costs.n_layer} layers ({recurrent} recurrent), "
              f"{'2-row' if rows_a_step > 1 else '1-row'} steps; predicted {1 / predicted_s:.1f} tok/s, "
              f"measured {1 / got_s:.1f} ({predicted_s / got_s:.2f}x of the prediction)")
    for (_, ca, pa, ga), (_, cb, pb, gb) in zip(rows, rows[1:]):
        if ca.arch == cb.arch and ca.n_embd == cb.n_embd and cb.n_layer > ca.n_layer:
            added = cb.n_layer - ca.n_layer
            print(f"{ca.arch} {ca.n_layer} -> {cb.n_layer} layers: a layer {(gb - ga) / added * 1e3:.2f} ms measured, "
                  f"{(pb - pa) / added * 1e3:.2f} ms predicted ({(gb - ga) / (pb - pa):.2f}x)")


if __name__ == "__main__":
    try:
        main()
    except PotluckError as e:  # an unknown shape, an unreadable file: one line
        raise SystemExit(f"plan_vs_step: {e}") from None
