"""`potluck perf`: decode and prompt-processing speed of a model here, and its batch-cost curve."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from ...engine import Model, PotluckError, resolve_model, validate
from ...engine.lab.perf import history_consistency, measure
from ..cli import COMMANDS
from .common import positive_int


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "perf", help=COMMANDS["perf"],
        description="Measure this machine: plain decoding and prompt speed, and what a batch of k tokens "
        "costs against one (what speculation's break-even rests on). Takes minutes; each step says so.",
    )
    p.add_argument("-m", "--model", type=Path, help="GGUF model (default: the bundled one)")
    p.add_argument("-t", "--threads", type=int, default=0, help="CPU threads (default: all cores)")
    p.add_argument("--runs", type=positive_int, default=5, help="repetitions; medians are reported")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--batches", default="1,2,4,8,16", metavar="K,K,...",
        help="verify-batch sizes of the cost curve (default 1,2,4,8,16; at most 48)",
    )
    add_history_flag(p)


def run(args: argparse.Namespace) -> int:
    args.threads = validate.threads(args.threads, "--threads")
    ks = _batches(args.batches)

    def progress(line: str) -> None:  # minutes of work: each step says where it is (stderr)
        print(f"perf: {line}", file=sys.stderr, flush=True)

    with Model(resolve_model(args.model)) as model:
        report = measure(model, n_threads=args.threads, runs=args.runs, ks=ks, progress=progress)
        history = (
            history_consistency(model, n_threads=args.threads, progress=progress) if args.history_check else None
        )
    if args.json:
        extra = {"history_check": asdict(history)} if history else {}
        print(json.dumps({**asdict(report), "batch_cost": report.batch_cost, **extra}))
        return 0
    print(f"model {report.model}, {report.threads} threads, median of {report.runs} runs")
    print(f"decode   {report.decode_tokens_per_s:8.1f} tokens/s (single-token steps)")
    print(f"prompt   {report.prefill_tokens_per_s:8.1f} tokens/s ({report.prefill_tokens}-token prompt)")
    print("batch cost (time of a k-token decode / 1-token decode):")
    for k, cost in report.batch_cost.items():
        print(f"  k={k:<3d} {report.batch_ms[k]:7.2f} ms  x{cost:.2f}")
    if history:
        print(
            f"history check: {history.differing} of {history.replies} last replies differ between "
            f"turn-by-turn decoding and a fresh session prefilling the history at once "
            f"(first divergence at token {history.first_divergence}; histories of {history.prefill_tokens} tokens)"
        )
    return 0


def add_history_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--history-check",
        action="store_true",
        help="also compare turn-by-turn conversations with the same history prefilled at once",
    )


def _batches(text: str) -> tuple[int, ...]:
    try:
        return tuple(sorted({1, *(int(k) for k in text.split(",") if k.strip())}))
    except ValueError:
        raise PotluckError(f"--batches takes sizes like 1,2,4,8, not {text!r}") from None
