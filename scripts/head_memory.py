"""Where a cluster head's memory goes, step by step, in one process (docs/facts.md §33).

The head opens the target vocabulary-only, reads in its own slice (the output layer behind
layers of zeros: ``gguf_tools.layer_layout(..., head=True)``) and runs it as the chain's last
stage. This does the same without workers: it feeds the slice random hidden states (a prompt,
then single steps) and prints the resident set after each part, and the time of a step.

    python -m scripts.head_memory ~/.cache/potluck/fixtures/gpt-oss-20b-harmony-q4_0-seed0.gguf
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from potluck.engine.cluster.plan import head_zeroed_layers, layer_costs
from potluck.engine.core.gguf_tools import layer_layout
from potluck.engine.core.jobs import DecodeJob
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.stage import Stage


def resident_mib() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) // 1024, int(fields["VmHWM"].split()[0]) // 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=128, help="n_batch, as the head's (scale_demo's default)")
    ap.add_argument("--prompt", type=int, default=53, help="rows of the prompt")
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()

    def report(what: str) -> None:
        rss, peak = resident_mib()
        print(f"{what:<34} VmRSS {rss:6,} MiB   VmHWM {peak:6,} MiB")

    report("start")
    vocab = Model(args.model, vocab_only=True)  # as the head: the tokenizer and chat template
    report("target, vocabulary only")
    with tempfile.TemporaryDirectory(prefix="potluck-head-") as tmp:
        zeroed = head_zeroed_layers(layer_costs(args.model))
        path = layer_layout(args.model, range(*zeroed), head=True).write_to(Path(tmp) / "head.gguf")
        lo, hi = zeroed
        held = f"layer {lo}" if hi - lo == 1 else f"layers {lo}-{hi - 1}"
        print(f"head slice: the output layer behind {held} as zeros, {path.stat().st_size / 1e6:,.0f} MB")
        model = Model(path, mapped=False)  # read in, as the head's tail
        report("slice read in")
        stage = Stage(model, first=False, last=True,
                      params=ContextParams(n_ctx=args.ctx, n_batch=args.batch, n_threads=1))
        report(f"context (n_batch {args.batch})")
        rng = np.random.default_rng(0)
        n, width = args.prompt, model.n_embd
        outputs = np.zeros(n, bool)
        outputs[-1] = True
        stage.compute(DecodeJob(0, rng.standard_normal((n, width), dtype=np.float32),
                                np.arange(n, dtype=np.int32), np.zeros(n, np.int32), outputs))
        report(f"a prompt of {n} rows")
        t0 = time.perf_counter()
        for i in range(args.steps):
            stage.compute(DecodeJob(0, rng.standard_normal((1, width), dtype=np.float32),
                                    np.array([n + i], np.int32), np.zeros(1, np.int32), np.ones(1, bool)))
        step_ms = (time.perf_counter() - t0) / args.steps * 1e3
        report(f"{args.steps} single steps")
        print(f"a single step: {step_ms:.1f} ms (one thread)")
        stage.close()
        model.close()
    vocab.close()


if __name__ == "__main__":
    main()
