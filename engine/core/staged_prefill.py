"""Long prompts prefilled in an F16 twin of a BF16 context, then handed over: F16's prefill
speed and BF16's exact, faster decoding in one target (docs/facts.md §25).

A BF16 cache computes every position on flash attention's one_chunk path, so single steps
equal verify batches at any thread count, but long prompts prefill at half the speed of an
F16 cache, whose batches of 64 rows or more take the tiled path (docs/facts.md §3). So a stage
computes each large batch of one sequence that extends the sequence (a prompt chunk) in a twin
context with an F16 cache, and copies that sequence's cells back into its own BF16 cache
(:mod:`.kv_state` converts them) before anything else touches the sequence.

The twin holds one sequence at a time (sequence 0 for one conversation; any conversation's
when several are decoded together, core/lanes.py). Work on the other sequences of a context
with one KV stream per sequence goes on in the BF16 cache meanwhile and leaves the twin open:
handing the sequence over between two chunks of its prompt would round its F16 cells to BF16
and back, and the next chunk would see other numbers than it sees alone.

Exactness: which jobs go to the twin depends only on the jobs themselves (rows, sequence,
positions), and every strategy chunks its prompt the same way (``TargetBase.decode``), so
plain decoding and every speculative strategy compute each prompt position alike; decoding
after the hand-over happens in the BF16 cache as before. A pipeline's stages see the same jobs
and decide alike. The twin shares the main context's abort flag, so a cancel reaches it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import numpy as np

from .jobs import DecodeJob
from .kv_state import GGML_TYPE_BF16, GGML_TYPE_F16, KvStateError, convert_seq_state, warm_up
from .runtime import Context

log = logging.getLogger(__name__)

# Below 64 query rows (GGML_FA_TILE_Q) an F16 batch takes the one_chunk path like BF16:
# nothing to gain.
MIN_ROWS = 64


@dataclass
class PrefillCounters:
    staged_jobs: int = 0  # batches computed in the F16 twin
    handovers: int = 0  # times sequence 0 went back to the BF16 cache
    handover_s: float = 0.0  # time those took (state out, converted, in; the twin closed)
    refused: int = 0  # large batches kept in BF16: a state layout kv_state does not know


class StagedPrefill:
    """The F16 twin of one BF16 :class:`Context`, open only while a prompt is prefilled."""

    def __init__(self, main: Context) -> None:
        self.main = main
        self.twin: Context | None = None
        self.seq = 0  # the sequence the open twin holds (as its own sequence 0)
        self.counters = PrefillCounters()
        p = main.params
        self._n_stream = 1 if p.kv_unified else max(1, p.n_seq_max)
        self._values = main.model.kv_values
        self._cell_ext = main.model.kv_cell_ext
        warm_up()  # with the model's load, not in the middle of a reply

    @staticmethod
    def applies_to(main: Context) -> bool:
        """A BF16 cache with flash attention whose sequences can be replaced one by one (one
        sequence, or one KV stream per sequence), in a model whose KV state kv_state reads."""
        p = main.params
        return (
            p.kv_type == GGML_TYPE_BF16 and p.flash_attn and (p.n_seq_max <= 1 or not p.kv_unified)
            and main.model.plain_kv_cells
        )

    @property
    def active(self) -> bool:
        return self.twin is not None

    def end(self, seq: int = 0) -> int:
        """Where sequence ``seq`` ends: in the twin while it holds the sequence, else in the main cache."""
        if self.twin is not None and seq == self.seq:
            return self.twin.seq_pos_max(0) + 1
        return self.main.seq_pos_max(seq) + 1

    def holds(self, seq: int) -> bool:
        """Whether the open twin holds sequence ``seq`` (-1: any sequence at all)."""
        return self.twin is not None and seq in (self.seq, -1)

    def takes(self, job: DecodeJob) -> bool:
        """Whether ``job`` is a prompt chunk: at least :data:`MIN_ROWS` rows of one sequence at
        consecutive positions right after the sequence's end."""
        n = job.n_tokens
        seq = int(job.seq_ids[0]) if n else 0
        if n < MIN_ROWS or (job.seq_ids != seq).any():
            return False
        start = self.end(seq)
        return bool(np.array_equal(job.positions, np.arange(start, start + n, dtype=job.positions.dtype)))

    def open(self, seq: int = 0) -> Context | None:
        """The twin holding sequence ``seq`` (opened with its cells on first use; a twin that
        holds another sequence hands it over first), or None when kv_state cannot read this
        model's state: the batch then stays in BF16."""
        if self.twin is not None:
            if self.seq == seq:
                return self.twin
            self.hand_over()
        p = self.main.params
        _, batch_threads = self.main.threads()
        params = replace(
            p, kv_type=GGML_TYPE_F16, n_seq_max=1, kv_unified=True, n_threads=batch_threads,
            single_step_threads=0, follow_load=False,
        )
        twin = Context(self.main.model, params, abort_flag_of=self.main)
        try:
            if self.main.seq_pos_max(seq) >= 0:
                twin.set_seq_state(0, convert_seq_state(
                    self.main.seq_state(seq), GGML_TYPE_F16, n_stream=1, values=self._values, cell_ext=self._cell_ext))
        except KvStateError as e:
            twin.close()
            log.info("prompt prefilled in BF16: %s", e)
            self.counters.refused += 1
            return None
        except BaseException:
            twin.close()
            raise
        self.twin, self.seq = twin, seq
        return twin

    def hand_over(self) -> None:
        """Put the twin's sequence back into the BF16 cache and close the twin (frees its memory)."""
        twin = self.twin
        if twin is None:
            return
        t0 = time.perf_counter()
        self.twin = None
        try:
            if twin.seq_pos_max(0) >= 0:
                state = convert_seq_state(
                    twin.seq_state(0), GGML_TYPE_BF16, n_stream=self._n_stream, values=self._values,
                    cell_ext=self._cell_ext)
                self.main.set_seq_state(self.seq, state)
            else:
                self.main.seq_rm(self.seq)
        finally:
            twin.close()
        self.counters.handovers += 1
        self.counters.handover_s += time.perf_counter() - t0

    def discard(self) -> None:
        """The conversation was cleared, or the stage closes: forget the twin's cells."""
        if self.twin is not None:
            self.twin.close()
            self.twin = None
