"""What dropping a rejected tail costs on a hybrid recurrent model (engine/core/rollback.py).

    .venv/bin/python -m scripts.rollback_cost                                  # the suite's small shape
    .venv/bin/python -m scripts.rollback_cost --shape qwen35moe-35b-a3b --layers 4 --reps 5

On one stage holding the whole model, for a verify batch of k+1 rows (the pending token and k
drafts), interleaved A/B, median of ``--reps``:
- the batch with llama.cpp's snapshots on (n_rs_seq 8) and off: the snapshots' cost per batch;
- the checkpoint a stage takes after every batch (the recurrent state copied out), and its size:
  into a new buffer while the last 16 stay alive (as a stage kept them before it reused their
  buffers: the allocator cannot hand back the one just freed), and into a dropped one's buffer;
- a rejected tail dropped by the snapshots, and by a checkpoint put back plus the accepted rows
  computed again (the path of a rejection in an older batch, or after an abort);
- a plain single-token step, with and without the checkpoint, for scale.
Figures are milliseconds on this machine's threads (``-t``); note the load (/proc/loadavg) with them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

import numpy as np

from potluck.engine.core.rollback import KEPT_CHECKPOINTS, SNAPSHOT_TOKENS
from potluck.engine.core.runtime import Context, ContextParams, Model
from potluck.engine.lab.hybrid_shapes import HYBRID_SHAPES, build_hybrid_shape


class _Timer:
    """``with timer.into(list):`` appends the block's milliseconds."""

    def into(self, out: list[float]) -> _Timer:
        self._out = out
        return self

    def __enter__(self) -> None:
        self._t = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self._out.append((time.perf_counter() - self._t) * 1e3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen35moe-small", choices=list(HYBRID_SHAPES))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--drafts", type=int, nargs="+", default=[2, 4, 7])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    model = Model(build_hybrid_shape(args.shape, layers=args.layers))
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(100, 40000, 64)]

    def context(snapshots: int) -> Context:
        ctx = Context(model, ContextParams(n_ctx=1024, n_batch=64, n_threads=args.threads, n_rs_seq=snapshots,
                                           f16_prefill=False))
        ctx.run_tokens(prompt, 0)
        return ctx

    on, off = context(SNAPSHOT_TOKENS), context(0)
    n0 = len(prompt)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"{model.path.name}: {model.n_layer} layers, {args.threads} threads, load {' '.join(load)}")
    state = on.recurrent_state(0)
    print(f"recurrent state of one sequence: {len(state) / 1e6:.2f} MB (a checkpoint; snapshots keep "
          f"{SNAPSHOT_TOKENS} more per sequence)")
    timed = _Timer()
    step_on: list[float] = []
    step_off: list[float] = []
    save: list[float] = []
    save_reused: list[float] = []
    alive: deque[bytearray] = deque(maxlen=KEPT_CHECKPOINTS)
    for i in range(args.reps):
        tok = [int(rng.integers(100, 40000))]
        with timed.into(step_on):
            on.run_tokens(tok, n0 + i)
        with timed.into(step_off):
            off.run_tokens(tok, n0 + i)
        with timed.into(save):
            alive.append(on.recurrent_state(0))
        with timed.into(save_reused):
            on.recurrent_state(0, into=state)
    n0 += args.reps
    print(f"plain step: {statistics.median(step_off):.2f} ms (snapshots on: {statistics.median(step_on):.2f}), "
          f"checkpoint {statistics.median(save):.3f} ms (into a reused buffer: {statistics.median(save_reused):.3f})")
    print(f"{'k':>3} {'batch off':>10} {'batch on':>9} {'snapshots':>10} {'checkpoint':>11} "
          f"{'drop (snap)':>12} {'drop (restore+replay)':>22}")
    for k in args.drafts:
        rows = k + 1
        b_on: list[float] = []
        b_off: list[float] = []
        ckpt: list[float] = []
        snap: list[float] = []
        restore: list[float] = []
        half = max(1, rows // 2)  # the second half of the batch is rejected
        for _ in range(args.reps):
            batch = [int(t) for t in rng.integers(100, 40000, rows)]
            kept_off = off.recurrent_state(0)
            with timed.into(b_off):
                off.run_tokens(batch, n0, outputs="all")
            off.set_recurrent_state(0, kept_off)  # (no snapshots: back by the checkpoint, untimed)
            off.seq_rm(0, n0, -1)
            kept = on.recurrent_state(0)  # the checkpoint before the batch (its cost: ckpt)
            with timed.into(b_on):
                on.run_tokens(batch, n0, outputs="all")
            with timed.into(ckpt):
                on.recurrent_state(0)
            with timed.into(snap):
                on.seq_rm(0, n0 + half, -1)
            with timed.into(restore):
                on.set_recurrent_state(0, kept)
                on.seq_rm(0, n0, -1)
                on.run_tokens(batch[:half], n0, outputs="last")
            on.set_recurrent_state(0, kept)  # the next batch starts where this one did (untimed)
            on.seq_rm(0, n0, -1)
        med = statistics.median
        print(f"{k:>3} {med(b_off):>10.2f} {med(b_on):>9.2f} {med(b_on) - med(b_off):>10.2f} {med(ckpt):>11.3f} "
              f"{med(snap):>12.3f} {med(restore):>22.2f}")
    on.close()
    off.close()
    model.close()


if __name__ == "__main__":
    main()
