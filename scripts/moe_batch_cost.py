"""The verify batch's cost curve of mixture-of-experts shapes against a dense one, and how many
experts a batch of k reply tokens reads (docs/facts.md §32).

    .venv/bin/python -m scripts.moe_batch_cost --shapes gpt-oss-20b:8,qwen3-30b-a3b:8,8b:8 -t 2

Each shape is built at ``NAME:LAYERS`` depth (``potluck bench --build-fixtures --shape NAME
--layers N``; no ``:LAYERS``: full depth). After a prompt, the model decodes a greedy reply; a
verify batch of k rows then holds the reply's last k tokens (different tokens route to
different experts, as drafts do), decoded at the same cells and trimmed again. Sizes are timed
in a shuffled order each repetition, and both the fastest and the median time are reported
(the adaptive draft length uses the fastest: another program only ever slows a batch). For
each k it also counts the distinct experts the batch's rows are routed to in a middle layer
(llama.cpp's own ranking, ``ffn_moe_argsort``), the part of a mixture's batch cost a dense
model does not have. Prints a table and, last, one JSON line; note the load (``/proc/loadavg``)
printed with it: on a shared 2-core machine the times are noisy, the expert counts are not.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import numpy as np

from potluck.engine.core.runtime import Context, ContextParams, Model
from potluck.engine.core.target import LocalTarget
from potluck.engine.lab.fixtures import SHAPES, build_shape
from potluck.engine.lab.perf import PROMPT

REPLY_TOKENS = 48


def parse_shapes(text: str) -> list[tuple[str, int | None]]:
    out = []
    for item in text.split(","):
        name, _, layers = item.partition(":")
        if name not in SHAPES:
            raise SystemExit(f"unknown shape {name!r}; pick from {', '.join(SHAPES)}")
        out.append((name, int(layers) if layers else None))
    return out


def reply_tokens(model: Model, target: LocalTarget) -> tuple[list[int], int]:
    """A greedy reply after the prompt, and where it ends (the batch's first cell)."""
    tok = int(target.decode(model.tokenize(PROMPT))[-1].argmax())
    reply = []
    for _ in range(REPLY_TOKENS):
        tok = int(target.decode([tok])[-1].argmax())
        reply.append(tok)
    return reply, target.n_past


def timings(model: Model, ks: list[int], reps: int, threads: int) -> dict[int, list[float]]:
    target = LocalTarget(model, ContextParams(n_ctx=1024, n_threads=threads))
    try:
        reply, n0 = reply_tokens(model, target)
        out: dict[int, list[float]] = {k: [] for k in ks}
        rng = random.Random(0)
        for _ in range(reps):
            for k in rng.sample(ks, len(ks)):
                t0 = time.perf_counter()
                target.decode(reply[-k:], all_logits=True)
                out[k].append((time.perf_counter() - t0) * 1e3)
                target.truncate(n0)
        return out
    finally:
        target.close()


def experts_read(model: Model, ks: list[int], threads: int) -> dict[int, float]:
    """Distinct experts the rows of a k-token batch are routed to, in a middle layer."""
    n_used = int(model.meta(f"{model.arch}.expert_used_count") or 0)
    if not n_used:
        return {}
    name = f"ffn_moe_argsort-{model.n_layer // 2}"
    target = LocalTarget(model, ContextParams(n_ctx=1024, n_threads=threads))
    try:
        reply, n0 = reply_tokens(model, target)
    finally:
        target.close()
    ctx = Context(model, ContextParams(n_ctx=1024, n_threads=threads, observe=(name,)))
    try:
        last = reply[-max(ks):]
        ctx.run_tokens(model.tokenize(PROMPT) + reply[: -max(ks)], 0)
        start = n0 - max(ks)
        out = {}
        for k in ks:
            ctx.run_tokens(last[:k], start)
            ranked = ctx.observed[name].view(np.int32)  # [k, n_expert], best first
            out[k] = float(len({int(e) for row in ranked for e in row[:n_used]}))
            ctx.seq_rm(0, start)
        return out
    finally:
        ctx.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="gpt-oss-20b:8,qwen3-30b-a3b:8,8b:8")
    p.add_argument("--batches", default="1,2,3,4,6,8,12,16")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("-t", "--threads", type=int, default=2)
    args = p.parse_args()
    ks = sorted({int(k) for k in args.batches.split(",")} | {1})
    results = []
    for name, layers in parse_shapes(args.shapes):
        path = build_shape(name, layers=layers)
        load = os.getloadavg()
        with Model(path) as model:
            times = timings(model, ks, args.reps, args.threads)
            experts = experts_read(model, ks, args.threads)
        fastest = {k: min(v) for k, v in times.items()}
        median = {k: statistics.median(v) for k, v in times.items()}
        row = {"shape": name, "layers": model.n_layer, "gb": round(path.stat().st_size / 1e9, 2),
               "threads": args.threads, "loadavg": [round(x, 2) for x in load], "fastest_ms": fastest,
               "median_ms": median, "experts_read": experts}
        results.append(row)
        print(f"{name} ({model.n_layer} layers, {row['gb']} GB, {args.threads} threads, load {load[0]:.1f}):")
        for k in ks:
            ex = f"  {experts[k]:5.1f} experts" if k in experts else ""
            print(f"  k={k:<3d} fastest {fastest[k]:8.1f} ms  x{fastest[k] / fastest[1]:5.2f}   "
                  f"median {median[k]:8.1f} ms  x{median[k] / median[1]:5.2f}{ex}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
