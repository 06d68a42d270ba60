"""Dropping the tail of sequence 0 on a stage whose layers keep a recurrent state.

A KV cache forgets the last k positions by freeing their cells. A recurrent layer (Gated
DeltaNet, Mamba) keeps one state per sequence, folded over every token so far: the state
before those k tokens is gone unless it was kept. Two levers, both measured on qwen35moe
(docs/facts.md §30):

- llama.cpp's own snapshots (``n_rs_seq``): every batch writes the state after each of its
  last ``n_rs_seq`` tokens, and ``llama_memory_seq_rm`` can then drop up to that many tokens
  *of the last batch* (it checks the count, not which batch wrote the snapshot: dropping into
  an earlier batch returns true and reads a stale state, so that is refused here). One such
  rollback is pending until the next decode reads it; a state saved meanwhile is the
  pre-rollback one, so nothing is saved then;
- checkpoints: after every batch of sequence 0 the recurrent state (llama.cpp's partial-only
  sequence state, no attention cells) is copied out, with the batch's inputs. Any position at
  or after the oldest checkpoint can then be restored: put the checkpoint back, drop the
  attention cells after it, and compute the kept rows again from their inputs (token ids on a
  first stage, hidden states on a later one, so no stage waits for another).

A speculative round rejects drafts of the batch it just verified: the snapshots undo that for
free. Rejections that reach into an earlier batch (PEARL and PipeInfer keep several in flight),
a batch aborted mid-compute (whose state is half written) and anything older go through the
checkpoints. Replayed rows compute exactly like the first time where a k-row batch computes
each row like k single steps (quantized weights; see docs/facts.md §30 for F32 routers).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import PotluckError
from .jobs import DecodeJob

if TYPE_CHECKING:  # the planner reads this module's constants without loading llama.cpp
    from .runtime import Context

# Tokens of the last batch llama.cpp keeps snapshots for (its n_rs_seq): a verify batch of up to
# this many drafts plus the pending token rolls back for free. Each costs a state copy per
# batch row written, and memory: (1 + n) states per sequence.
SNAPSHOT_TOKENS = 8
# Checkpoints (one per batch of sequence 0) a stage keeps: how many batches back a rollback can
# reach. The head asks for no more than KEEP_BATCHES of its own batches back (core/target.py).
KEPT_CHECKPOINTS = 16
KEEP_BATCHES = KEPT_CHECKPOINTS // 2
MAX_RESTORE_ATTEMPTS = 3
# copies of a sequence's recurrent state a stage holds: llama.cpp's current one and snapshots,
# and the checkpoints (the planner counts them: cluster/plan.py)
ROLLBACK_STATES = 1 + SNAPSHOT_TOKENS + KEPT_CHECKPOINTS


@dataclass
class RollbackCounters:
    """What the rollbacks of a stage did (tests assert that a path ran; benches time it)."""

    snapshot_rollbacks: int = 0  # tails dropped by llama.cpp's snapshots
    restores: int = 0  # tails dropped by putting a checkpoint back
    replayed_rows: int = 0  # rows computed again after a restore
    aborted_batches: int = 0  # batches aborted mid-compute, their state put back
    checkpoints: int = 0
    fresh_buffers: int = 0  # checkpoints written into a new buffer (not a dropped one's)
    checkpoint_ms: float = 0.0  # copying states out (every batch)
    restore_ms: float = 0.0  # putting states back and replaying rows


@dataclass
class _Rows:
    """Rows of sequence 0 as a batch computed them, the first ``n`` still in the cache."""

    job: DecodeJob
    n: int

    @property
    def pos0(self) -> int:
        return int(self.job.positions[0])

    @property
    def end(self) -> int:
        return self.pos0 + self.n


@dataclass
class RecurrentRollback:
    """Sequence 0 of one :class:`~.runtime.Context` with recurrent layers, kept restorable.

    ``replay(job)`` computes a job's rows in the context without returning anything (the
    stage's batch filling, so a later stage replays hidden states like it computed them)."""

    ctx: Context
    replay: Callable[[DecodeJob], None]
    kept_checkpoints: int = KEPT_CHECKPOINTS
    counters: RollbackCounters = field(default_factory=RollbackCounters)

    def __post_init__(self) -> None:
        self._rows: deque[_Rows] = deque()  # batches since the oldest checkpoint, in order
        self._checkpoints: dict[int, bytearray] = {}  # position -> state after positions < it
        self._spare: list[bytearray] = []  # dropped checkpoints' buffers, written over by the next ones
        self._pending = False  # a snapshot rollback the next decode has still to read
        # where llama.cpp's last batch of sequence 0 began: its snapshots reach no further back
        # (a replay computes a part of a kept batch; a restore leaves no valid snapshot at all)
        self._snapshots_from = 0
        self.forget()

    # -- what the stage tells it
    def computed(self, job: DecodeJob) -> None:
        """``job`` (rows of sequence 0 only) ran: keep its rows and the state after them."""
        if self._rows and self._rows[-1].end != int(job.positions[0]):
            raise PotluckError(
                f"sequence 0 continues at position {int(job.positions[0])}, not where it ends ({self._rows[-1].end})"
            )
        self._pending = False  # the decode read it
        self._snapshots_from = int(job.positions[0])
        self._rows.append(_Rows(job, job.n_tokens))
        t = time.perf_counter()
        while len(self._checkpoints) >= self.kept_checkpoints:  # the oldest's buffer takes the new one
            self._spare.append(self._checkpoints.pop(min(self._checkpoints)))
        self._keep(self.end)
        self.counters.checkpoints += 1
        self.counters.checkpoint_ms += (time.perf_counter() - t) * 1e3
        floor = min(self._checkpoints)
        while self._rows and self._rows[0].end <= floor:
            self._rows.popleft()

    def aborted(self, job: DecodeJob) -> None:
        """``job`` stopped mid-compute: some layers' states were written, the rest not. Put
        sequence 0 back as it was before it (llama.cpp dropped its attention cells or not)."""
        self.counters.aborted_batches += 1
        self._restore(int(job.positions[0]))

    @property
    def end(self) -> int:
        return self._rows[-1].end if self._rows else min(self._checkpoints)

    @property
    def floor(self) -> int:
        """The earliest position sequence 0 can be cut back to."""
        return min(self._checkpoints)

    def trim(self, p0: int) -> None:
        """Sequence 0 keeps positions below ``p0`` only."""
        if p0 >= self.end:
            return
        if p0 < self.floor:
            raise PotluckError(
                f"cannot drop sequence 0 back to position {p0}: its recurrent state is kept from position "
                f"{self.floor} on"
            )
        last = self._rows[-1] if self._rows else None
        n_back = self.end - p0
        if (
            last is not None and self._snapshots_from < p0 and n_back <= self.ctx.n_rs_seq and not self._pending
            and self.ctx.seq_rm(0, p0, -1)
        ):
            last.n = p0 - last.pos0
            self._pending = True
            self._drop_checkpoints_after(p0)
            self.counters.snapshot_rollbacks += 1
            return
        self._restore(p0)

    def settle(self) -> None:
        """Make the state llama.cpp would save the logical one (before a kept conversation is
        copied out): a pending snapshot rollback is redone from a checkpoint."""
        if self._pending:
            self._restore(self.end)

    def forget(self) -> None:
        """Sequence 0 is empty (a new conversation) or was replaced whole (a kept one)."""
        self._rows.clear()
        self._pending = False
        self.restart_at(0)

    def restart_at(self, pos: int) -> None:
        """Sequence 0 now holds ``pos`` tokens computed elsewhere (a restored conversation):
        its state there is the one checkpoint."""
        self._rows.clear()
        self._pending = False
        self._snapshots_from = pos  # none
        self._drop_checkpoints_after(-1)
        self._keep(pos)

    # -- internals
    def _keep(self, pos: int) -> None:
        """Checkpoint the state after positions < ``pos``, in a dropped one's buffer if any."""
        old = self._checkpoints.pop(pos, None)
        spare = old if old is not None else (self._spare.pop() if self._spare else None)
        state = self.ctx.recurrent_state(0, into=spare)
        self.counters.fresh_buffers += state is not spare
        self._checkpoints[pos] = state

    def _drop_checkpoints_after(self, p0: int) -> None:
        for pos in [p for p in self._checkpoints if p > p0]:
            self._spare.append(self._checkpoints.pop(pos))
        # no more buffers than a full set of checkpoints (the planner counts that many)
        del self._spare[max(0, self.kept_checkpoints - len(self._checkpoints)):]

    def _restore(self, p0: int) -> None:
        """Sequence 0 as it was after position ``p0 - 1``: the newest checkpoint at or before
        it, the attention cells after that dropped, the kept rows up to ``p0`` computed again.

        A cancel meant for a batch can leave the context's abort flag set after that batch
        finished (or set it again while this runs): the kept rows are never a cancelled run's,
        so the flag is cleared and an interrupted restore starts over from its checkpoint."""
        t = time.perf_counter()
        for attempt in range(MAX_RESTORE_ATTEMPTS):
            self.ctx.clear_abort()
            try:
                self._restore_once(p0)
                break
            except InterruptedError:
                if attempt == MAX_RESTORE_ATTEMPTS - 1:
                    why = "sequence 0's recurrent state could not be put back: every replay was aborted"
                    raise PotluckError(why) from None
        self.counters.restores += 1
        self.counters.restore_ms += (time.perf_counter() - t) * 1e3

    def _restore_once(self, p0: int) -> None:
        base = max(p for p in self._checkpoints if p <= p0)
        self.ctx.set_recurrent_state(0, self._checkpoints[base])
        if not self.ctx.seq_rm(0, base, -1):
            raise PotluckError(f"llama.cpp refused to drop sequence 0's cells from position {base}")
        self._pending = False
        self._snapshots_from = p0  # none valid until a replay
        kept: deque[_Rows] = deque()
        replayed = 0
        for rows in self._rows:
            if rows.pos0 >= p0:
                break
            n = min(rows.n, p0 - rows.pos0)
            lo = max(0, base - rows.pos0)
            if lo < n:
                self.replay(rows.job.rows(lo, n))
                self._snapshots_from = rows.pos0 + lo
                replayed += n - lo
            kept.append(_Rows(rows.job, n))
        # only now, all rows replayed: an interrupted attempt left the window as it was
        self._rows = kept
        self._drop_checkpoints_after(base)
        if p0 > base:
            self._keep(p0)
        self.counters.replayed_rows += replayed
