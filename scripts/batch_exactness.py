"""Verify batches against single steps, by weight type: the measurement behind
engine/core/batch_exact.py (docs/facts.md, "verify batches vs single steps, by weight type").

    .venv/bin/python -m scripts.batch_exactness                # every type, both settings
    .venv/bin/python -m scripts.batch_exactness --types Q4_K_M,F32 --threads 1,2
    .venv/bin/python -m scripts.batch_exactness --cost MODEL.gguf ...   # what 2-row steps cost
    .venv/bin/python -m scripts.batch_exactness --speed MODEL.gguf --strategy anpd   # the cap's cost

Builds small models in ``--cache`` (default: potluck's fixtures folder): a dense qwen3 and a
qwen3moe of random weights (``potluck bench --build-fixtures --shape``), requantized by
llama.cpp to each type (llama.cpp keeps a mixture's router, ``ffn_gate_inp``, in F32 whatever
the type, as in every published mixture). For each file, extra buffer types (repacking) on
and off, and each thread count: after a prompt, 48 single steps (as 1 row, and as 2 rows: the
token again at the next position, both rows' logits, the spare cell trimmed), then for each k
one k-row batch of the same tokens at the same cells; a k "differs" where any of its rows'
logits is not bit-identical to its single step. Prints, per line, the largest k up to which
every batch is exact, the k that differ, and what batch_exact.py predicts (its cap, and
whether it runs single steps as 2 rows) and the verdict: ``ok`` (exact, as long as
measured), ``safe`` (exact, shorter than it could be) or ``UNSAFE`` (a batch the engine allows
differs: the table in batch_exact.py is wrong for this llama.cpp or CPU). The figures are
exact comparisons, not timings: the load does not change them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from potluck.engine.core.batch_exact import BatchExactness, model_exactness, weight_types
from potluck.engine.core.paths import fixtures_dir
from potluck.engine.core.runtime import Context, ContextParams, Model, quantize_model
from potluck.engine.lab.batch_rows import steps_and_batches
from potluck.engine.lab.fixtures import build_shape
from potluck.engine.lab.perf import PROMPT

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "IQ4_NL", "MXFP4_MOE",
         "Q2_K", "Q3_K_S", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q6_K")
KS = (*range(2, 17), 24, 32, 48)
SHAPES = {"dense": "qwen3-small", "moe": "qwen3moe-small"}


def build(cache: Path, kind: str, file_type: str) -> Path:
    dst = cache / f"{kind}-{file_type}.gguf"
    if not dst.exists():
        cache.mkdir(parents=True, exist_ok=True)
        quantize_model(build_shape(SHAPES[kind]), dst, file_type, pure=file_type != "Q4_K_M", n_threads=2)
    return dst


def differing(model: Model, n_threads: int, two_rows: bool) -> list[int]:
    """The k whose k-row batch differs from k single steps somewhere in its logits."""
    tokens = [int(t) for t in np.random.default_rng(0).integers(100, 40000, size=max(KS))]
    steps, batches = steps_and_batches(model, model.tokenize(PROMPT), tokens, KS, n_threads=n_threads,
                                       two_rows=two_rows)
    return [k for k in KS if not np.array_equal(batches[k], steps[:k])]


def exact_up_to(bad: list[int]) -> int:
    return (min(bad) - 1) if bad else max(KS)


def verdict(predicted: BatchExactness, measured: int) -> str:
    """ok: exact and as long as measured; safe: exact, shorter than it could be; UNSAFE: a
    verify batch the engine allows differs from single steps."""
    if not predicted.speculates:
        return "ok" if measured < 2 else "safe"
    if predicted.max_rows > measured:
        return "UNSAFE"
    return "ok" if predicted.max_rows == measured else "safe"


def print_line(name: str, ebt: bool, n_threads: int, one: int, two: int, predicted: BatchExactness,
               measured: int, types: str) -> None:
    pred = f"{predicted.max_rows}{' 2-row' if predicted.two_row_steps else ''}"
    print(f"{name:22s} {'on' if ebt else 'off':5s} {n_threads:3d} {one:21d} {two:21d}"
          f"  {pred:9s} {verdict(predicted, measured):6s}  {types}", flush=True)


def step_cost(path: Path, n_threads: int, steps: int = 32, reps: int = 5) -> tuple[float, float]:
    """Median ms of a single step as 1 row and as 2 rows (interleaved runs of ``steps`` steps
    after the prompt, the same tokens), on this machine now."""
    times: dict[bool, list[float]] = {False: [], True: []}
    with Model(path) as model, Context(model, ContextParams(n_ctx=512, n_threads=n_threads)) as ctx:
        prompt = model.tokenize(PROMPT)
        n0 = len(prompt)
        ctx.run_tokens(prompt, 0)
        tokens = [int(t) for t in np.random.default_rng(0).integers(100, 40000, size=steps)]
        for _ in range(reps):
            for two_rows in (False, True):
                t0 = time.perf_counter()
                for i, t in enumerate(tokens):
                    if two_rows:
                        ctx.run_tokens([t, t], n0 + i, outputs="all")
                    else:
                        ctx.run_tokens([t], n0 + i)
                    ctx.seq_rm(0, n0 + i + 1, -1)
                times[two_rows].append((time.perf_counter() - t0) * 1e3 / steps)
                ctx.seq_rm(0, n0, -1)
    return statistics.median(times[False]), statistics.median(times[True])


SPEED_PROMPTS = (
    "Rewrite this Python code with snake_case names and return the whole code:\n\n"
    "def computeTotal(itemList, taxRate):\n    runningSum = 0\n    for singleItem in itemList:\n"
    "        runningSum += singleItem.unitPrice * singleItem.itemCount\n"
    "    return runningSum * (1 + taxRate)\n",
    "Write a long, detailed story about a robot who learns to cook.",
)


def speed(path: Path, strategy: str, n_threads: int, tokens: int, reps: int, fixed: bool) -> None:
    """Tokens/s of ``strategy`` with the engine's cap and with it lifted (every batch up to 48
    rows, as before batch_exact.py), plain decoding beside them, interleaved; whether each
    reply equals plain decoding's. ``fixed``: the strategy's longest drafts every round
    (adaptive=false), so the cap's effect is not hidden by the floor's gate."""
    from potluck.engine.core import runtime
    from potluck.engine.core.batch_exact import FREE
    from potluck.engine.core.events import Finished
    from potluck.engine.core.sampling import SamplingParams
    from potluck.engine.core.spec import EngineSpec
    from potluck.engine.loader import open_session

    capped = runtime.Model.batch_exact

    def reply(name: str, prompt: str) -> Finished:
        options: dict[str, object] = {"adaptive": False} if fixed and name != "plain" else {}
        session = open_session(EngineSpec(model=path, strategy=name, n_ctx=1024, n_threads=n_threads,
                                          strategy_options=options))
        try:
            return next(ev for ev in session.generate(prompt, SamplingParams(), tokens) if isinstance(ev, Finished))
        finally:
            session.close()

    rates: dict[str, list[float]] = {"plain": [], "capped": [], "uncapped": []}
    for _ in range(reps):
        for prompt in SPEED_PROMPTS:
            ref = reply("plain", prompt)
            rates["plain"].append(ref.tokens_per_s)
            for mode in ("capped", "uncapped"):
                runtime.Model.batch_exact = capped if mode == "capped" else property(lambda self: FREE)
                try:
                    got = reply(strategy, prompt)
                finally:
                    runtime.Model.batch_exact = capped
                rates[mode].append(got.tokens_per_s)
                same = "equals plain" if list(got.tokens) == list(ref.tokens) else "DIFFERS from plain"
                print(f"{mode:8s} {got.tokens_per_s:6.1f} tok/s, accepted {got.accepted}/{got.drafted} in "
                      f"{got.rounds} rounds, {same}", flush=True)
    load = Path("/proc/loadavg").read_text().split()[0]
    mode = " adaptive=false" if fixed else ""
    print(f"{path.name} {strategy}{mode}, {n_threads} threads, {tokens} tokens, median tok/s: " + ", ".join(
        f"{k} {statistics.median(v):.1f}" for k, v in rates.items()) + f"; load {load}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=fixtures_dir() / "batch-exactness")
    ap.add_argument("--types", default=",".join(TYPES), help="llama.cpp file types, comma-separated")
    ap.add_argument("--kinds", default="dense,moe")
    ap.add_argument("--threads", default="2", help="thread counts, comma-separated")
    ap.add_argument("--extra-bufts", default="on,off", help="extra buffer types (repacking): on, off or on,off")
    ap.add_argument("--cost", type=Path, nargs="*", help="instead: time single steps as 1 and 2 rows on these files")
    ap.add_argument("--speed", type=Path, help="instead: tokens/s of --strategy on this file, capped and not")
    ap.add_argument("--strategy", default="anpd")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--fixed", action="store_true", help="--speed: adaptive=false, the longest drafts")
    args = ap.parse_args(argv)
    if args.speed:
        speed(args.speed, args.strategy, int(args.threads.split(",")[0]), args.tokens, args.reps, args.fixed)
        return 0
    if args.cost:
        for path in args.cost:
            for n_threads in (int(t) for t in args.threads.split(",")):
                one, two = step_cost(path, n_threads)
                load = Path("/proc/loadavg").read_text().split()[0]
                print(f"{path.name}: {n_threads} threads, a step as 1 row {one:.2f} ms, as 2 rows {two:.2f} ms "
                      f"({two / one:.2f}x), load {load}", flush=True)
        return 0
    print(f"{'file':22s} {'bufts':5s} {'thr':3s} {'1-row steps: exact to':>21s} {'2-row steps: exact to':>21s}"
          f"  {'predicted':9s} {'':6s}  types")
    for kind in args.kinds.split(","):
        for ftype in args.types.split(","):
            path = build(args.cache, kind, ftype)
            types = ",".join(sorted(weight_types(path)))
            for ebt in (x == "on" for x in args.extra_bufts.split(",")):
                predicted = model_exactness(path, use_extra_bufts=ebt)
                with Model(path, use_extra_bufts=ebt) as model:
                    for n_threads in (int(t) for t in args.threads.split(",")):
                        one = exact_up_to(differing(model, n_threads, two_rows=False))
                        two = exact_up_to(differing(model, n_threads, two_rows=True))
                        measured = two if predicted.two_row_steps else one
                        print_line(path.name, ebt, n_threads, one, two, predicted, measured, types)
    return 0


if __name__ == "__main__":
    sys.exit(main())
