"""One layer range of a model with its own KV cache: the unit every target computes with.

A whole model is one stage (first and last). A model split by layers (docs/facts.md §5) is a
chain of stages: a stage that is not last captures ``l_out-{n_layer-1}``, the residual stream
after its last layer, and the next stage takes it as embedding input. The same class serves
:class:`~potluck.engine.core.target.LocalTarget`, the in-process
the tests' in-process ``SplitTarget`` and a cluster worker, so what the tests prove at
the logits level is what a worker runs.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .batch import Batch
from .errors import PotluckError
from .jobs import DecodeJob
from .kv import KvOp
from .memory import free_memory_bytes
from .prompt_cache import FREE_MEMORY_SHARE, PromptCache
from .rollback import SNAPSHOT_TOKENS, RecurrentRollback
from .runtime import Context, ContextParams, Model
from .staged_prefill import StagedPrefill

MAX_KEPT = PromptCache.MAX_CONVERSATIONS  # kept conversations per stage (a head asks for no more)


class Stage:
    """``first``: takes token ids; ``last``: returns logits (else hidden states)."""

    def __init__(self, model: Model, *, first: bool, last: bool, params: ContextParams) -> None:
        self.model = model
        self.first = first
        self.last = last
        capture = None if last else model.n_layer - 1
        # a recurrent state drops a tail only as far as it was kept (core/rollback.py)
        snapshots = SNAPSHOT_TOKENS if model.recurrent else 0
        self.ctx = Context(model, replace(params, capture_layer=capture, n_rs_seq=snapshots))
        self.n_ctx = self.ctx.n_ctx
        self.n_batch = params.n_batch
        self.n_seq_max = max(1, params.n_seq_max)
        self.kept: dict[int, bytearray] = {}  # slot -> a sequence's state (KvOp save/load/drop)
        self._batch = Batch(
            params.n_batch, n_embd=0 if first else model.n_embd, n_seq_max=self.n_seq_max,
            n_pos=model.positions_per_token,
        )
        self.rollback: RecurrentRollback | None = None
        if model.recurrent:
            self.rollback = RecurrentRollback(self.ctx, self._replay)
        # tensors named in params.observe, rows of sequence 0 by position [n_ctx, width]
        # (positions >= the sequence's length hold stale rows): TriForce's keys and queries
        self.observed: dict[str, np.ndarray] = {}
        # prompt chunks in an F16 twin of a BF16 cache (docs/facts.md §25)
        self.prefill: StagedPrefill | None = None
        if params.f16_prefill and StagedPrefill.applies_to(self.ctx):
            self.prefill = StagedPrefill(self.ctx)

    def check(self, job: DecodeJob) -> None:
        """Refuse a job this stage cannot run, before anything reaches llama.cpp."""
        n = job.n_tokens
        if not 1 <= n <= self.n_batch:
            raise PotluckError(f"a batch of {n} tokens does not fit n_batch {self.n_batch}")
        if job.positions.shape != (n,) or job.seq_ids.shape != (n,) or job.outputs.shape != (n,):
            raise PotluckError("positions, sequence ids and outputs need one entry per row")
        if int(job.positions.min()) < 0 or int(job.positions.max()) >= self.n_ctx:
            raise PotluckError(f"position outside the context (0..{self.n_ctx - 1})")
        if int(job.seq_ids.min()) < 0 or int(job.seq_ids.max()) >= self.n_seq_max:
            raise PotluckError(f"sequence id outside 0..{self.n_seq_max - 1}")
        if not job.outputs.any():
            raise PotluckError("a batch must request at least one output row")
        if self.first:
            if not job.is_tokens or job.inputs.shape != (n,):
                raise PotluckError("the first stage takes token ids [n]")
            if int(job.inputs.min()) < 0 or int(job.inputs.max()) >= self.model.n_vocab:
                raise PotluckError("token id outside the vocabulary")
        elif job.inputs.ndim != 2 or job.inputs.shape != (n, self.model.n_embd):
            raise PotluckError(f"this stage takes hidden states [n, {self.model.n_embd}]")

    def compute(self, job: DecodeJob) -> np.ndarray:
        """Hidden states [n, n_embd] f32 (not last) or logits [n_outputs, vocab] f32 (last),
        owned by the caller. ``InterruptedError`` if aborted (llama.cpp dropped the cells)."""
        ctx = self._context_for(job)
        self._fill(job, twin=ctx is not self.ctx)
        canonical = self.rollback is not None and bool((job.seq_ids == 0).all())
        try:
            ctx.run_batch(self._batch)  # aborted: llama.cpp drops the batch's cells, in either context
        except InterruptedError:
            if canonical:  # a half-written recurrent state: put back the one before it
                self.rollback.aborted(job)  # type: ignore[union-attr]
            raise
        if canonical:
            self.rollback.computed(job)  # type: ignore[union-attr]
        if ctx is not self.ctx:
            self.prefill.counters.staged_jobs += 1  # type: ignore[union-attr]
        if ctx.observed:
            self._record_observed(job, ctx.observed)
        if not self.last:
            assert ctx.captured is not None
            return ctx.captured  # a fresh array per run
        return ctx.logits(job.n_outputs).copy()

    def _fill(self, job: DecodeJob, twin: bool = False) -> None:
        positions = job.positions.tolist()
        # the F16 twin holds the job's one sequence as its sequence 0
        seq_ids = 0 if twin else [[s] for s in job.seq_ids.tolist()]
        # A capturing stage must mark every row as output, or its last layer keeps only those.
        flags: list[bool] | str = job.outputs.tolist() if self.last else "all"
        if self.first:
            self._batch.set_tokens(job.inputs.tolist(), positions, seq_ids, flags)
        else:
            self._batch.set_embeddings(job.inputs, positions, seq_ids, flags)

    def _replay(self, job: DecodeJob) -> None:
        """Compute kept rows of sequence 0 again after a rollback put an older state back."""
        self._fill(job)
        self.ctx.run_batch(self._batch)

    def _context_for(self, job: DecodeJob) -> Context:
        """The F16 twin for a prompt chunk, else this stage's own context (after the twin, if
        it holds a sequence of the job, has handed it back)."""
        if self.prefill is None:
            return self.ctx
        if self.prefill.takes(job):
            twin = self.prefill.open(int(job.seq_ids[0]))
            if twin is not None:
                return twin
        if self.prefill.active and (not self._streams or self.prefill.seq in job.seq_ids):
            self.prefill.hand_over()
        return self.ctx

    @property
    def _streams(self) -> bool:
        """One KV stream per sequence: work on one sequence never moves another's cells."""
        return self.n_seq_max > 1 and not self.ctx.params.kv_unified

    def settle(self) -> None:
        """The twin's sequence back in this stage's own context before anything else touches it."""
        if self.prefill is not None:
            self.prefill.hand_over()

    def _settle_for(self, op: KvOp) -> None:
        """Hand the twin's sequence back if ``op`` touches it (any operation does, with one
        KV stream for every sequence)."""
        p = self.prefill
        if p is None or not p.active:
            return
        if not self._streams or op.op == "keep" or p.seq in (op.seq, op.dst if op.op == "cp" else -1):
            p.hand_over()

    def _record_observed(self, job: DecodeJob, observed: dict[str, np.ndarray]) -> None:
        canonical = job.seq_ids == 0
        if not canonical.any():
            return
        pos = job.positions[canonical]
        for name, rows in observed.items():
            store = self.observed.get(name)
            if store is None:
                store = self.observed[name] = np.zeros((self.n_ctx, rows.shape[1]), np.float32)
            store[pos] = rows[canonical]

    def apply_kv(self, op: KvOp) -> None:
        self._settle_for(op)
        if op.is_slot_op:
            self._slot_op(op)
            return
        if self.rollback is not None:
            self._recurrent_kv(op)
            return
        try:
            self.ctx.apply_kv(op)
        except ValueError as e:
            raise PotluckError(str(e)) from None

    def _recurrent_kv(self, op: KvOp) -> None:
        """Sequence 0 of a recurrent model: its tail goes through the rollback; a whole
        sequence may go. Copies, shifts and partial ranges of other sequences would need
        states nobody kept, and are refused."""
        assert self.rollback is not None
        if op.op == "rm" and op.seq == 0 and op.p1 < 0:
            if op.p0 <= 0:
                self.ctx.seq_rm(0)
                self.rollback.forget()
            else:
                self.rollback.trim(op.p0)
            return
        if op.op == "rm" and op.p0 <= 0 and op.p1 < 0:
            self.ctx.seq_rm(op.seq)
            return
        raise PotluckError(
            f"kv {op.op} on sequence {op.seq} is not possible on {self.model.arch}'s recurrent state: "
            "only sequence 0's tail can be dropped"
        )

    def _slot_op(self, op: KvOp) -> None:
        """Kept conversations: a sequence's cells by slot (``save`` replaces a slot's). A
        ``load`` puts them back where they were computed (cells 0..n-1 of the sequence's own
        stream, whichever sequence it now is), so decoding goes on exactly."""
        slot = op.dst
        if op.op == "drop":
            self.kept.pop(slot, None)
        elif op.op == "load":
            state = self.kept.get(slot)
            if state is None:
                raise PotluckError(f"no kept conversation in slot {slot}")
            self.ctx.set_seq_state(op.seq, state)
            if self.rollback is not None and op.seq == 0:
                self.rollback.restart_at(self.ctx.seq_pos_max(0) + 1)
        else:
            if slot not in self.kept and len(self.kept) >= MAX_KEPT:
                raise PotluckError(f"already {MAX_KEPT} kept conversations: drop one first")
            if self.rollback is not None:
                self.rollback.settle()  # llama.cpp would save the state before a pending rollback
            state = self.ctx.seq_state(op.seq)
            if len(state) > FREE_MEMORY_SHARE * free_memory_bytes():
                raise PotluckError(f"a kept conversation of {len(state) / 1e6:.0f} MB does not fit in free memory")
            self.kept[slot] = state

    def kept_nbytes(self) -> int:
        return sum(map(len, self.kept.values()))

    def clear(self) -> None:
        """A new conversation: every sequence goes; kept conversations stay."""
        if self.prefill is not None:
            self.prefill.discard()
        self.ctx.clear()
        if self.rollback is not None:
            self.rollback.forget()

    def forget_all(self) -> None:
        """Every sequence and every kept conversation (a cluster rebuilt its chain)."""
        self.clear()
        self.kept.clear()

    def pos_max(self) -> list[int]:
        """Last position held per sequence (-1: empty); the twin's sequence's in the F16 twin
        while a prompt is being prefilled there."""
        held = [self.ctx.seq_pos_max(s) for s in range(self.n_seq_max)]
        if self.prefill is not None and self.prefill.active:
            held[self.prefill.seq] = self.prefill.end(self.prefill.seq) - 1
        return held

    def close(self) -> None:
        if self.prefill is not None:
            self.prefill.discard()
        self._batch.close()
        self.ctx.close()
