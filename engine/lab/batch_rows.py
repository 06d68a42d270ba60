"""Single steps against a k-row batch, row for row: the measurement behind each weight type's
exact batch length (core/batch_exact.py), shared by scripts/batch_exactness.py (the table)
and the tests that pin its edges."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..core.runtime import Context, ContextParams, Model


def steps_and_batches(model: Model, prompt: Sequence[int], tokens: Sequence[int], ks: Sequence[int], *,
                      n_threads: int, two_rows: bool, n_ctx: int = 512) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    """After ``prompt``: each of ``tokens`` decoded as a single step (as 2 rows, the second
    dropped, where ``two_rows``), [len(tokens), vocab]; and for each k in ``ks`` the first k
    of them decoded as one batch, [k, vocab]. Two contexts, so neither sees the other's cells."""
    params = ContextParams(n_ctx=n_ctx, n_threads=n_threads, f16_prefill=False)
    n0 = len(prompt)
    with Context(model, params) as steps, Context(model, params) as batch:
        steps.run_tokens(list(prompt), 0)
        batch.run_tokens(list(prompt), 0)
        rows = []
        for i, t in enumerate(tokens):
            if two_rows:
                steps.run_tokens([t, t], n0 + i, outputs="all")
                rows.append(steps.logits_row(0).copy())
                steps.seq_rm(0, n0 + i + 1, -1)
            else:
                steps.run_tokens([t], n0 + i)
                rows.append(steps.logits_row(-1).copy())
        batches = {}
        for k in ks:
            batch.seq_rm(0, n0, -1)
            batch.run_tokens(list(tokens[:k]), n0, outputs="all")
            batches[k] = batch.logits(k).copy()
        return np.stack(rows), batches
