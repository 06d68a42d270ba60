"""A model split by layer ranges: stages that pass hidden states from one to the next.

Each stage is a GGUF slice (:func:`.gguf_tools.slice_layers`) in its own context with its
own KV cache of its layers. A stage that is not last captures ``l_out-{n_layer-1}`` (the
residual stream after its last layer) and the next stage takes it as embedding input
(DESIGN.md fact 3). :class:`SplitTarget` chains stages in one process; the cluster head
uses the same :class:`Stage` on remote workers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from .errors import ContextFullError
from .runtime import Batch, Context, ContextParams, Model


class Stage:
    """One layer range with its KV cache. ``first``: takes token ids; ``last``: yields logits."""

    def __init__(self, model: Model, *, first: bool, last: bool, params: ContextParams) -> None:
        self.model = model
        self.first = first
        self.last = last
        capture = None if last else model.n_layer - 1
        self.ctx = Context(model, replace(params, capture_layer=capture))
        self._embd_batch = None if first else Batch(params.n_batch, n_embd=model.n_embd)

    def forward(
        self,
        inputs: Sequence[int] | np.ndarray,
        pos0: int,
        *,
        outputs: str = "last",
        seq_id: int = 0,
    ) -> np.ndarray:
        """Run one batch: hidden states [n, n_embd] (not last) or logits [rows, vocab] (last)."""
        n = len(inputs)
        # A capturing stage must mark every row as output, or its last layer keeps only those rows.
        flags = outputs if self.last else "all"
        if self.first:
            self.ctx.decode(list(inputs), pos0, seq_id=seq_id, outputs=flags)  # type: ignore[arg-type]
        else:
            assert self._embd_batch is not None
            self._embd_batch.set_embeddings(np.asarray(inputs), range(pos0, pos0 + n), seq_id, flags)
            self.ctx.decode_batch(self._embd_batch)
        if not self.last:
            assert self.ctx.captured is not None
            return self.ctx.captured
        if outputs == "all":
            return self.ctx.logits(n)
        return self.ctx.logits_row(-1)[None, :]

    def truncate(self, n_past: int, seq_id: int = 0) -> None:
        self.ctx.seq_rm(seq_id, n_past, -1)

    def close(self) -> None:
        self.ctx.close()
        if self._embd_batch is not None:
            self._embd_batch.close()


class SplitTarget:
    """A :class:`~.target.Target` made of stages run one after another in this process."""

    def __init__(self, models: Sequence[Model], params: ContextParams | None = None) -> None:
        params = params or ContextParams()
        last = len(models) - 1
        self.stages = [Stage(m, first=i == 0, last=i == last, params=params) for i, m in enumerate(models)]
        self.n_vocab = models[0].n_vocab
        self.n_ctx = self.stages[0].ctx.n_ctx
        self.n_batch = params.n_batch
        self._n_past = 0

    @property
    def n_past(self) -> int:
        return self._n_past

    def decode(self, tokens: Sequence[int], *, all_logits: bool = False) -> np.ndarray:
        if self._n_past + len(tokens) > self.n_ctx:
            raise ContextFullError(
                f"the conversation needs {self._n_past + len(tokens)} tokens but the context holds "
                f"{self.n_ctx}; start a new conversation or raise --ctx"
            )
        rows: list[np.ndarray] = []
        out: np.ndarray = np.empty(0)
        for start in range(0, len(tokens), self.n_batch):
            chunk = list(tokens[start : start + self.n_batch])
            x: Sequence[int] | np.ndarray = chunk
            for stage in self.stages:
                x = stage.forward(x, self._n_past, outputs="all" if all_logits else "last")
            self._n_past += len(chunk)
            out = np.asarray(x)
            if all_logits:
                rows.append(out.copy())
        return np.concatenate(rows) if all_logits else out

    def truncate(self, n_past: int) -> None:
        if n_past < self._n_past:
            for stage in self.stages:  # KV operations apply on every stage, in pipeline order
                stage.truncate(n_past)
            self._n_past = n_past

    def close(self) -> None:
        for stage in reversed(self.stages):
            stage.close()
