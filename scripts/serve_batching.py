"""Would `potluck serve` gain from decoding several clients' sequences in one batch?

Each of B conversations gets its own KV stream (``kv_unified=False``) and a distinct prompt.
Then the same greedy steps are decoded two ways, interleaved per repetition:

- one batch per step holding one row per conversation (what a batching server would do);
- one single-row batch per conversation per step (what the server's one engine thread does).

It reports ms per step, aggregate tokens/s and the gain of batching, and checks that every
conversation's greedy tokens are the same both ways (batched rows must not change results).

    python -m scripts.serve_batching [--clients 1,2,4] [--steps 64] [--threads 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from potluck.assets import default_model_path
from potluck.engine.core.batch import Batch
from potluck.engine.core.runtime import Context, ContextParams, Model

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table handles collisions, with an example in Python.",
    "List five ways to save energy at home and say why each one works.",
    "Summarize the causes of the French Revolution in a paragraph.",
    "Describe the water cycle to a ten year old.",
    "What are the trade-offs between SQL and NoSQL databases?",
    "Give me a recipe for a vegetarian chili and the time each step takes.",
    "Translate 'the early bird catches the worm' into French and explain it.",
]


def _prefill(ctx: Context, model: Model, n: int) -> tuple[list[int], list[int]]:
    """Prompt i in sequence i; returns each sequence's next position and first greedy token."""
    pos, nxt = [], []
    for s in range(n):
        toks = model.tokenize(f"<|im_start|>user\n{PROMPTS[s % len(PROMPTS)]}<|im_end|>\n<|im_start|>assistant\n")
        ctx.run_tokens(toks, 0, seq_id=s)
        pos.append(len(toks))
        nxt.append(int(np.argmax(ctx.logits_row(-1))))
    return pos, nxt


def run(model: Model, n: int, steps: int, threads: int, batched: bool) -> tuple[float, list[list[int]]]:
    ctx = Context(model, ContextParams(n_ctx=1024, n_batch=64, n_seq_max=n, n_threads=threads, kv_unified=False))
    batch = Batch(64, n_seq_max=1)
    try:
        pos, nxt = _prefill(ctx, model, n)
        out: list[list[int]] = [[t] for t in nxt]
        t0 = time.perf_counter()
        for _ in range(steps):
            if batched:
                batch.set_tokens(nxt, pos, [[s] for s in range(n)], "all")
                ctx.run_batch(batch)
                rows = ctx.logits(n)
                nxt = [int(np.argmax(rows[s])) for s in range(n)]
            else:
                for s in range(n):
                    ctx.run_tokens([nxt[s]], pos[s], seq_id=s)
                    nxt[s] = int(np.argmax(ctx.logits_row(-1)))
            for s in range(n):
                pos[s] += 1
                out[s].append(nxt[s])
        return time.perf_counter() - t0, out
    finally:
        batch.close()
        ctx.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,2,4")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    with Model(default_model_path()) as model:
        run(model, 1, 8, args.threads, True)  # warm caches and threads
        for n in (int(c) for c in args.clients.split(",")):
            times: dict[bool, list[float]] = {True: [], False: []}
            tokens: dict[bool, list[list[int]]] = {}
            for _ in range(args.reps):
                for batched in (False, True):
                    dt, toks = run(model, n, args.steps, args.threads, batched)
                    times[batched].append(dt)
                    tokens[batched] = toks
            one, many = statistics.median(times[False]), statistics.median(times[True])
            rows.append({
                "clients": n,
                "separate_ms_per_step": 1000 * one / args.steps,
                "batched_ms_per_step": 1000 * many / args.steps,
                "separate_tok_s": n * args.steps / one,
                "batched_tok_s": n * args.steps / many,
                "gain": one / many,
                "same_tokens": tokens[True] == tokens[False],
            })
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{'clients':>7} {'separate ms/step':>17} {'batched ms/step':>16} {'separate tok/s':>15} "
          f"{'batched tok/s':>14} {'gain':>5}  same tokens")
    for r in rows:
        print(f"{r['clients']:>7} {r['separate_ms_per_step']:>17.1f} {r['batched_ms_per_step']:>16.1f} "
              f"{r['separate_tok_s']:>15.1f} {r['batched_tok_s']:>14.1f} {r['gain']:>5.2f}  {r['same_tokens']}")


if __name__ == "__main__":
    main()
