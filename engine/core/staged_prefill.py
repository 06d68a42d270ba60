"""Long prompts prefilled in an F16 twin of a BF16 context, then handed over: F16's prefill
speed and BF16's exact, faster decoding in one target (docs/facts.md §25).

A BF16 cache computes every position on flash attention's one_chunk path, so single steps
equal verify batches at any thread count, but long prompts prefill at half the speed of an
F16 cache, whose batches of 64 rows or more take the tiled path (docs/facts.md §3). So a stage
computes each large batch of sequence 0 that extends the sequence (a prompt chunk) in a twin
context with an F16 cache, and copies sequence 0's cells back into its own BF16 cache
(:mod:`.kv_state` converts them) before it does anything else.

Exactness: which jobs go to the twin depends only on the jobs themselves (rows, sequence,
positions), and every strategy chunks its prompt the same way (``TargetBase.decode``), so
plain decoding and every speculative strategy compute each prompt position alike; decoding
after the hand-over happens in the BF16 cache as before. A pipeline's stages see the same jobs
and decide alike. The twin shares the main context's abort flag, so a cancel reaches it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np

from .jobs import DecodeJob
from .kv_state import GGML_TYPE_BF16, GGML_TYPE_F16, KvStateError, convert_seq_state, warm_up
from .runtime import Context, Model

log = logging.getLogger(__name__)

# Below 64 query rows (GGML_FA_TILE_Q) an F16 batch takes the one_chunk path like BF16:
# nothing to gain.
MIN_ROWS = 64


@dataclass
class PrefillCounters:
    staged_jobs: int = 0  # batches computed in the F16 twin
    handovers: int = 0  # times sequence 0 went back to the BF16 cache
    refused: int = 0  # large batches kept in BF16: a state layout kv_state does not know


class StagedPrefill:
    """The F16 twin of one BF16 :class:`Context`, open only while a prompt is prefilled."""

    def __init__(self, model: Model, main: Context) -> None:
        self.model = model
        self.main = main
        self.twin: Context | None = None
        self.n_past = 0  # tokens of sequence 0 in the twin
        self.counters = PrefillCounters()
        p = main.params
        self._n_stream = 1 if p.kv_unified else max(1, p.n_seq_max)
        warm_up()  # with the model's load, not in the middle of a reply

    @staticmethod
    def applies_to(main: Context) -> bool:
        """A BF16 cache with flash attention whose sequence 0 can be replaced alone: one
        sequence, or one KV stream per sequence."""
        p = main.params
        return p.kv_type == GGML_TYPE_BF16 and p.flash_attn and (p.n_seq_max <= 1 or not p.kv_unified)

    @property
    def active(self) -> bool:
        return self.twin is not None

    def takes(self, job: DecodeJob) -> bool:
        """Whether ``job`` is a prompt chunk: at least :data:`MIN_ROWS` rows of sequence 0 at
        consecutive positions right after the sequence's end."""
        n = job.n_tokens
        if n < MIN_ROWS or job.seq_ids.any():
            return False
        start = int(job.positions[0])
        if int(job.positions[-1]) != start + n - 1 or not np.array_equal(
            job.positions, np.arange(start, start + n, dtype=job.positions.dtype)
        ):
            return False
        end = self.n_past if self.active else self.main.seq_pos_max(0) + 1
        return start == end

    def computed(self, job: DecodeJob) -> None:
        """``job`` ran in the twin: its rows are part of sequence 0 now."""
        self.n_past = int(job.positions[-1]) + 1
        self.counters.staged_jobs += 1

    def aborted(self) -> None:
        """llama.cpp removed an aborted batch's cells: the twin holds what it held before."""
        self.n_past = self.twin.seq_pos_max(0) + 1 if self.twin is not None else 0

    def hand_over(self) -> None:
        """Put sequence 0 back into the BF16 cache and close the twin (frees its memory)."""
        twin = self.twin
        if twin is None:
            return
        self.twin = None
        try:
            if twin.seq_pos_max(0) >= 0:
                state = convert_seq_state(twin.seq_state(0), GGML_TYPE_BF16, n_stream=self._n_stream)
                self.main.set_seq_state(0, state)
            else:
                self.main.seq_rm(0)
        finally:
            twin.close()
        self.counters.handovers += 1

    def discard(self) -> None:
        """The conversation was cleared: forget the twin's cells."""
        if self.twin is not None:
            self.twin.close()
            self.twin = None
        self.n_past = 0

    def close(self) -> None:
        self.discard()

    def _open(self) -> None:
        p = self.main.params
        _, batch_threads = self.main.threads()
        params = replace(
            p, kv_type=GGML_TYPE_F16, n_seq_max=1, kv_unified=True, n_threads=batch_threads,
            single_step_threads=0, follow_load=False,
        )
        twin = Context(self.model, params, abort_flag_of=self.main)
        try:
            if self.main.seq_pos_max(0) >= 0:
                state = convert_seq_state(self.main.seq_state(0), GGML_TYPE_F16, n_stream=1)
                twin.set_seq_state(0, state)
        except BaseException:
            twin.close()
            raise
        self.twin = twin
        self.n_past = twin.seq_pos_max(0) + 1

    def try_open(self) -> bool:
        """Open the twin; False (and the job stays in BF16) if the cells cannot be converted."""
        if self.twin is not None:
            return True
        try:
            self._open()
        except KvStateError as e:
            log.info("prompt prefilled in BF16: %s", e)
            self.counters.refused += 1
            return False
        return True
