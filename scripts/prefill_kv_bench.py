"""KV cache type and single-step path: exactness and speed (issue 22, docs/facts.md §3).

    .venv/bin/python -m scripts.prefill_kv_bench [--depth 2300] [--steps 24] [--threads 2]

After prefilling ``--depth`` tokens (seeded random ids, n_batch 512 chunks, as every
strategy prefills), ``--steps`` tokens are decoded one position at a time in each mode and
each position's logits are compared with the same tokens decoded as ONE batch (the rows a
verify batch computes: flash attention's one_chunk path). Modes:

- ``bf16``: BF16 cache, every step on all threads (today's default);
- ``f16-split``: F16 cache, 1-token steps on all threads (llama.cpp's default: split-KV path
  past 512 cells);
- ``f16-1thread``: F16 cache, 1-token steps on one thread (``--kv f16`` today);
- ``f16-pad2``: F16 cache, each step padded to 2 rows (the token again at the next position,
  no logits, its cell trimmed after): two query rows never take split-KV, all threads;
- ``f32-split``, ``f32-pad2``: the same with an F32 cache (tiled prefill too, twice the bytes);
- ``bf16-staged``: the default since docs/facts.md §25: a target's stage prefills in an F16
  twin and hands the cells to its BF16 cache (core/staged_prefill.py) before the prompt's
  ``decode`` returns: the prefill figure includes the hand-over, ``handover_ms`` is its part.

Reported per mode: prefill tok/s, decode ms per token at that depth, and the max |logit
difference| against the batch rows (0.0: exact). Timings are one run each: on a shared
machine say so when quoting them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

MODES = ("bf16", "bf16-staged", "f16-split", "f16-1thread", "f16-pad2", "f32-split", "f32-pad2")


@dataclass(frozen=True)
class ModeResult:
    mode: str
    depth: int
    prefill_tok_s: float
    decode_ms_per_token: float
    max_abs_diff: float  # single steps vs the same tokens as one batch
    handover_ms: float = 0.0  # bf16-staged: the twin's cells back into the BF16 cache


def _prefill(ctx, tokens: Sequence[int], n_batch: int) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(tokens), n_batch):
        ctx.run_tokens(tokens[i : i + n_batch], i)
    return len(tokens) / (time.perf_counter() - t0)


def run_mode(model_path: Path | None, mode: str, depth: int, steps: int, n_threads: int, seed: int = 0) -> ModeResult:
    from potluck.engine.core.kv_state import GGML_TYPE_BF16, GGML_TYPE_F16
    from potluck.engine.core.runtime import Context, ContextParams, Model
    from potluck.engine.loader import resolve_model

    kv = {"bf16": GGML_TYPE_BF16, "f16": GGML_TYPE_F16, "f32": 0}[mode.split("-")[0]]  # 0: GGML_TYPE_F32
    single = 1 if mode == "f16-1thread" else 0
    n_ctx = -(-(depth + steps + 2) // 256) * 256
    with Model(resolve_model(model_path)) as model:
        rng = np.random.default_rng(seed)
        prompt = rng.integers(100, model.n_vocab - 100, size=depth).tolist()
        tail = rng.integers(100, model.n_vocab - 100, size=steps).tolist()
        if mode == "bf16-staged":
            return _staged(model, prompt, tail, n_ctx, n_threads)
        params = ContextParams(n_ctx=n_ctx, n_batch=512, n_threads=n_threads, kv_type=kv,
                               single_step_threads=single)
        with Context(model, params) as ctx:
            prefill = _prefill(ctx, prompt, 512)
            # reference: the tail as one batch (<= 48 rows: one_chunk, like verify batches)
            ctx.run_tokens(tail, depth, outputs="all")
            want = ctx.logits(steps).copy()
            ctx.seq_rm(0, depth, -1)
            got = np.empty_like(want)
            t0 = time.perf_counter()
            for i, tok in enumerate(tail):
                pos = depth + i
                if mode.endswith("-pad2"):
                    ctx.run_tokens([tok, tok], pos, outputs=[True, False])
                    got[i] = ctx.logits_row(0)
                    ctx.seq_rm(0, pos + 1, -1)
                else:
                    ctx.run_tokens([tok], pos)
                    got[i] = ctx.logits_row(-1)
            decode_ms = (time.perf_counter() - t0) * 1e3 / steps
    return ModeResult(mode, depth, prefill, decode_ms, float(np.abs(got - want).max()))


def _staged(model, prompt: list[int], tail: list[int], n_ctx: int, n_threads: int) -> ModeResult:
    """The production path: a :class:`LocalTarget`, whose stage stages the prompt and hands it
    back before ``decode`` returns (so the prefill figure includes the hand-over, as the time
    to the first token does; ``handover_ms`` says how much of it that was)."""
    from potluck.engine.core.runtime import ContextParams
    from potluck.engine.core.target import LocalTarget

    depth, steps = len(prompt), len(tail)
    target = LocalTarget(model, ContextParams(n_ctx=n_ctx, n_batch=512, n_threads=n_threads))
    try:
        t0 = time.perf_counter()
        target.decode(prompt)
        prefill = depth / (time.perf_counter() - t0)
        counters = target.stage.prefill.counters if target.stage.prefill is not None else None
        assert counters is not None and counters.handovers == 1, "the prompt did not take the twin"
        handover_ms = counters.handover_s * 1e3
        want = target.decode(tail, all_logits=True).copy()
        target.truncate(depth)
        t0 = time.perf_counter()
        got = np.stack([target.decode([tok])[-1].copy() for tok in tail])
        decode_ms = (time.perf_counter() - t0) * 1e3 / steps
    finally:
        target.close()
    return ModeResult("bf16-staged", depth, prefill, decode_ms, float(np.abs(got - want).max()), handover_ms)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", type=Path)
    ap.add_argument("--depth", type=int, default=2300)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if not 1 <= args.steps <= 48:
        ap.error("--steps must be 1..48 (the reference batch must stay on the one_chunk path)")
    results = [run_mode(args.model, m, args.depth, args.steps, args.threads) for m in args.modes.split(",")]
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
        return 0
    print(f"depth {args.depth}, {args.steps} steps, {args.threads} threads")
    print(f"{'mode':<14}{'prefill tok/s':>15}{'decode ms/t':>13}{'tok/s':>8}{'max |diff|':>12}{'hand-over ms':>14}")
    for r in results:
        print(f"{r.mode:<14}{r.prefill_tok_s:>15.1f}{r.decode_ms_per_token:>13.2f}"
              f"{1e3 / r.decode_ms_per_token:>8.1f}{r.max_abs_diff:>12.4g}{r.handover_ms:>14.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
