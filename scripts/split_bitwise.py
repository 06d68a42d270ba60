"""A model split by layers into in-process stages against the whole model, logits compared
bit for bit: the prompt, then greedy single steps (as 2 rows where the model's weight types
need it, the spare row's cells dropped after each), each step fed the whole model's token.

It separates what a split computes from what the cluster adds around it (worker processes,
the wire, KV operations sent as transactions): if the stages here equal the whole model and
`scripts/scale_demo.py` does not, look at the cluster's path (docs/facts.md §33).

    python -m scripts.split_bitwise --shape gpt-oss-20b --layers 6 --cuts 2,4 [--steps 20]
    python -m scripts.split_bitwise --model FILE.gguf --cuts 10,22
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from potluck.engine.core.chat import ChatFormat, Message
from potluck.engine.core.gguf_tools import layer_layout
from potluck.engine.core.jobs import DecodeJob
from potluck.engine.core.prompt import PromptTokenizer
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.stage import Stage
from potluck.engine.lab.fixtures import SHAPES, build_shape

from .scale_demo import PROMPT  # the demonstration's prompt, so the two runs can be set side by side


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), help="a random-weight fixture shape")
    ap.add_argument("--layers", type=int, help="the shape built with this many layers")
    ap.add_argument("--model", type=Path, help="a GGUF instead of a shape")
    ap.add_argument("--cuts", required=True, help="the first layer of each stage after the first, e.g. 2,4")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    path = args.model or build_shape(args.shape or "gpt-oss-20b", layers=args.layers)
    params = ContextParams(n_ctx=512, n_batch=128, n_threads=args.threads)
    whole_model = Model(path)
    bounds = [0, *(int(c) for c in args.cuts.split(",")), whole_model.n_layer]
    tokens = PromptTokenizer(whole_model, ChatFormat(whole_model.chat_template)).conversation(
        [Message("user", PROMPT)], 512).tokens()
    with tempfile.TemporaryDirectory() as tmp:
        stages = []
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            part = layer_layout(path, range(lo, hi), stage=True).write_to(Path(tmp) / f"stage{i}.gguf")
            stages.append(Stage(Model(part), first=i == 0, last=hi == bounds[-1], params=params))
        whole = Stage(whole_model, first=True, last=True, params=params)
        two_rows = whole_model.batch_exact.two_row_steps

        def split(job: DecodeJob) -> np.ndarray:
            for stage in stages:
                out = stage.compute(job)
                if not stage.last:
                    job = DecodeJob(job.group, out, job.positions, job.seq_ids, job.outputs)
            return out

        n = len(tokens)
        job = DecodeJob.tokens(1, tokens, 0, outputs=[False] * (n - 2) + [True, True])
        a, b = whole.compute(job), split(job)
        print(f"{path.name}: stages {bounds}, prompt {n} tokens, 2-row steps {two_rows}")
        print(f"prompt: max |whole - split| {float(np.abs(a - b).max()):.3g}")
        token, differ = int(a[-1].argmax()), 0
        for step in range(args.steps):
            pos = n + step
            job = DecodeJob.tokens(2, [token, token] if two_rows else [token], pos, outputs="all")
            a, b = whole.compute(job), split(job)
            diff = float(np.abs(a[0] - b[0]).max())
            differ += diff > 0
            if two_rows:
                for stage in (whole, *stages):
                    stage.ctx.seq_rm(0, pos + 1, -1)
            print(f"step {step:3d}: max diff {diff:.3g}, greedy {int(a[0].argmax())} / {int(b[0].argmax())}")
            token = int(a[0].argmax())
        print(f"{differ} of {args.steps} steps differ bitwise")
        return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
