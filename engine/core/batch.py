"""A llama.cpp batch: token ids or hidden states with explicit positions, sequence ids and
output flags. With :mod:`.runtime`, the only module that imports ``llama_cpp``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp as ll
import numpy as np

from .native import NativeObject


class Batch(NativeObject):
    """A ``llama_batch`` of token ids (``n_embd == 0``) or of embeddings (hidden states).

    ``n_pos``: positions per embedding row. Models with multi-section RoPE (M-RoPE, Qwen3.5)
    read 4 per row of an embedding batch, section-major (``pos[j * n + i]``), where a token
    batch gives one that llama.cpp repeats; a stage's hidden states are text, so each row's
    position is written to every section, exactly what llama.cpp does for token ids."""

    def __init__(self, capacity: int, *, n_embd: int = 0, n_seq_max: int = 1, n_pos: int = 1) -> None:
        self.capacity = capacity
        self.n_embd = n_embd
        self.n_seq_max = n_seq_max
        self.n_pos = n_pos if n_embd else 1
        # llama_batch_init sizes ``pos`` by its token count: n_pos times the rows for M-RoPE
        self._b = ll.llama_batch_init(capacity * self.n_pos, n_embd, n_seq_max)
        self.n_tokens = 0

    def close(self) -> None:
        if getattr(self, "_b", None) is not None:
            ll.llama_batch_free(self._b)
            self._b = None


    @property
    def raw(self) -> ll.llama_batch:
        return self._b

    def set_tokens(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        seq_ids: Sequence[Sequence[int]] | int = 0,
        outputs: Sequence[bool] | str = "last",
    ) -> None:
        n = len(tokens)
        if n > self.capacity or self.n_embd:
            raise ValueError(f"batch holds {self.capacity} token ids, got {n}")
        b = self._b
        for i in range(n):
            b.token[i] = tokens[i]
        self._fill_common(n, positions, seq_ids, outputs)

    def set_embeddings(
        self,
        embd: np.ndarray,  # [n_tokens, n_embd] float32
        positions: Sequence[int],
        seq_ids: Sequence[Sequence[int]] | int = 0,
        outputs: Sequence[bool] | str = "last",
    ) -> None:
        embd = np.ascontiguousarray(embd, dtype=np.float32)
        n = embd.shape[0]
        if not self.n_embd or embd.shape[1] != self.n_embd or n > self.capacity:
            raise ValueError(f"embeddings of shape {embd.shape} do not fit this batch")
        ctypes.memmove(self._b.embd, embd.ctypes.data, embd.nbytes)
        self._fill_common(n, positions, seq_ids, outputs)

    def _fill_common(
        self,
        n: int,
        positions: Sequence[int],
        seq_ids: Sequence[Sequence[int]] | int,
        outputs: Sequence[bool] | str,
    ) -> None:
        b = self._b
        for i in range(n):
            for j in range(self.n_pos):
                b.pos[j * n + i] = positions[i]
            ids = (seq_ids,) if isinstance(seq_ids, int) else seq_ids[i]
            b.n_seq_id[i] = len(ids)
            for j, s in enumerate(ids):
                b.seq_id[i][j] = s
            if outputs == "all":
                b.logits[i] = True
            elif outputs == "last":
                b.logits[i] = i == n - 1
            elif outputs == "none":
                b.logits[i] = False
            else:
                b.logits[i] = bool(outputs[i])  # type: ignore[index]
        b.n_tokens = n
        self.n_tokens = n
