"""The model a strategy verifies against: a KV cache of one canonical sequence plus logits.

Strategies only see the :class:`Target` protocol, so the same strategy runs on a local
llama.cpp context, on layer stages chained in one process (:mod:`.split`) or on a pipeline
of LAN workers. Sequence 0 is the canonical conversation; ``n_past`` tokens of it are in
the KV cache, at positions ``0..n_past-1`` and, because rejected tails are always trimmed
from the end, in the same KV cells that plain decoding would use (DESIGN.md fact 4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from .errors import ContextFullError
from .runtime import Context, ContextParams, Model

# A k-token batch computes each row exactly like k single-token steps only up to 48 tokens
# (flash attention, measured): verification batches must stay at or below this size.
MAX_EXACT_BATCH = 48


class Target(Protocol):
    n_vocab: int
    n_ctx: int
    n_batch: int

    @property
    def n_past(self) -> int: ...

    def decode(self, tokens: Sequence[int], *, all_logits: bool = False) -> np.ndarray:
        """Append ``tokens`` to sequence 0; logits [n_rows, vocab] for every row or the last one.

        The returned array may be a view that the next call overwrites: copy what you keep.
        """
        ...

    def truncate(self, n_past: int) -> None:
        """Forget every token at position >= ``n_past`` (rejected drafts, edited history)."""
        ...

    def close(self) -> None: ...


class LocalTarget:
    """A whole model in one llama.cpp context on this machine."""

    def __init__(self, model: Model, params: ContextParams | None = None) -> None:
        self.model = model
        self.ctx = Context(model, params or ContextParams())
        self.n_vocab = model.n_vocab
        self.n_ctx = self.ctx.n_ctx
        self.n_batch = self.ctx.params.n_batch
        self._n_past = 0

    @property
    def n_past(self) -> int:
        return self._n_past

    def decode(self, tokens: Sequence[int], *, all_logits: bool = False) -> np.ndarray:
        n = len(tokens)
        if n == 0:
            raise ValueError("decode needs at least one token")
        if self._n_past + n > self.n_ctx:
            raise ContextFullError(
                f"the conversation needs {self._n_past + n} tokens but the context holds "
                f"{self.n_ctx}; start a new conversation or raise --ctx"
            )
        rows: list[np.ndarray] = []
        for start in range(0, n, self.n_batch):
            chunk = tokens[start : start + self.n_batch]
            try:
                self.ctx.decode(chunk, self._n_past, outputs="all" if all_logits else "last")
            except BaseException:  # aborted or failed mid-batch: drop the partial batch's cells
                self.ctx.seq_rm(0, self._n_past, -1)
                raise
            self._n_past += len(chunk)
            if all_logits:
                out = self.ctx.logits(len(chunk))
                rows.append(out if n <= self.n_batch else out.copy())
        if all_logits:
            return rows[0] if len(rows) == 1 else np.concatenate(rows)
        return self.ctx.logits_row(-1)[None, :]

    def truncate(self, n_past: int) -> None:
        if n_past < self._n_past:
            self.ctx.seq_rm(0, n_past, -1)
            self._n_past = n_past

    def set_abort(self, fn: Callable[[], bool] | None) -> None:
        """Poll ``fn`` during decodes; True aborts the running batch (``InterruptedError``)."""
        self.ctx.set_abort(fn)

    def close(self) -> None:
        self.ctx.close()
