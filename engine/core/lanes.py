"""Several conversations decoded together: one shared target, a KV stream per conversation,
their rows in one batch (continuous batching, as llama.cpp's server does with ``-np``).

A server's clients each hold a conversation on a *lane*. Each lane's :class:`~.session.Session`
runs its strategy, unchanged, on a thread of its own against a :class:`LaneTarget`: a Target
whose sequences are the lane's share of the shared target's (lane ``i`` owns sequences
``i*w .. i*w+w-1``, each in its own KV stream). The :class:`LaneHub` owns the shared target and
runs on the thread that owns it (a cluster's sockets belong to that thread). What the lanes ask
for queues in the hub, in each lane's order:

- a KV operation or a call (keep or restore a conversation) goes to the target at once;
- a prompt chunk (``PREFILL_TWIN_MIN_ROWS`` rows or more) goes on its own, one lane's prompt at
  a time, so that each chunk is computed exactly as alone (the F16 twin holds one sequence),
  and one chunk at a time: the other lanes' batches go between its chunks (a long prompt
  delays their next token by a chunk, not by the whole prompt);
- every other job (a plain step, a verify batch, a short prompt) waits until no lane that is
  decoding is still busy (sampling, drafting), then the waiting lanes' jobs go as ONE batch,
  lane after lane (their sequence ids ascending: llama.cpp's ubatch split takes consecutive
  sequences with equal rows together), and each lane gets its own rows back.

A lone conversation on a target computed on this machine sends its jobs to the target itself,
from its own thread (*solo*): through the hub each token would wake two more threads, about
a tenth of a small model's decoding speed on two cores. It goes through the hub again as soon as
a second lane is active, after what it sent has been computed.

A pipeline of ``n_stages`` stages gets up to ``n_stages + 1`` such batches in flight, each
holding a share of the lanes, so that every stage computes a different conversation's
micro-batch while the others compute theirs (the pipeline's bubble, filled with other
conversations instead of PipeInfer's guesses).

Exactness (docs/facts.md §32): with a BF16 cache every row is computed on flash attention's
one_chunk path, which walks the cells of the row's own KV stream in order and skips masked
cells, so a row gives the same logits whatever other sequences' rows share its batch and
however many cells the batch's widest stream pads the view to; each conversation's cells sit
at 0..n-1 of its own stream, where they sit alone. So every conversation gets exactly the
answer it gets alone, whatever the others do.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from .batch_exact import BatchExactness
from .errors import PotluckError
from .events import ClusterView, Event, NodeStatus
from .jobs import CancelledGroups, DecodeJob, GroupCancelled, Ticket
from .kv import KvOp
from .session import Session
from .staged_prefill import MIN_ROWS as PREFILL_TWIN_MIN_ROWS
from .target import LocalTarget, Target, TargetBase

log = logging.getLogger(__name__)

T = TypeVar("T")

# How long the hub sleeps between looks at results while a lane is busy and a batch is in
# flight (a pipeline's other micro-batches); with nothing in flight it sleeps until woken.
POLL_S = 0.001

Work = DecodeJob | KvOp | Callable[[Target], object]


@dataclass
class _Item:
    """One thing a lane asked for, in its lane's queue until the hub sends it."""

    lane: int
    work: Work
    future: Future = field(default_factory=Future)
    posted: int = 0  # the hub's post count when it was queued: older jobs go first

    @property
    def prompt_chunk(self) -> bool:
        return isinstance(self.work, DecodeJob) and self.work.n_tokens >= PREFILL_TWIN_MIN_ROWS


@dataclass
class _Sent:
    """A job in flight on the target and whose rows it holds."""

    ticket: Ticket
    parts: list[tuple[_Item, int, int]]  # (item, first output row, end)
    prompt_chunk: bool


@dataclass
class BatchingCounters:
    """What the hub sent; tests read these to prove that conversations shared batches."""

    batches: int = 0  # batches of lanes' small jobs (steps, verify batches, short prompts)
    shared: int = 0  # of those, batches holding the rows of two conversations or more
    most_lanes: int = 0  # the most conversations one batch held
    lane_jobs: int = 0  # lanes' jobs those batches carried
    rows: int = 0  # rows of those batches
    shared_rows: int = 0  # rows of the shared ones
    most_shared_rows: int = 0  # the most rows a shared batch held
    shared_verify: int = 0  # shared batches in which two conversations or more sent several rows (verify batches)
    most_in_flight: int = 0  # the most such batches in flight at once (a pipeline's micro-batches)
    overlapped: int = 0  # batches sent while another was in flight (the stages computed both at once)
    prompt_chunks: int = 0  # prompt chunks sent on their own
    split_for_exactness: int = 0  # batches closed at the model's longest exact batch (exact.max_rows)
    kv_ops: int = 0
    calls: int = 0  # kept conversations saved, restored or dropped
    solo: int = 0  # jobs a lone lane sent to the target itself (no batch, no hub thread)


class LaneHub:
    """The shared target and the lanes' queues; :meth:`step` runs on the target's owner thread."""

    def __init__(self, target: Target, n_lanes: int, lane_width: int = 1) -> None:
        if n_lanes < 1 or lane_width < 1 or target.n_seq_max < n_lanes * lane_width:
            raise ValueError(f"{n_lanes} lanes of {lane_width} sequences need a target with that many "
                             f"sequences (it has {target.n_seq_max})")
        self.target = target
        self.n_lanes = n_lanes
        self.lane_width = lane_width
        self.counters = BatchingCounters()
        self._cond = threading.Condition()
        self._queues: list[deque[_Item]] = [deque() for _ in range(n_lanes)]
        self._active = [False] * n_lanes  # a conversation is decoding on the lane
        self._waiting: list[Future | None] = [None] * n_lanes  # what the lane's thread is blocked on
        self._sent: deque[_Sent] = deque()  # in flight, oldest first
        self._prefilling: int | None = None  # the lane whose prompt chunks are being sent
        self._groups = itertools.count(1)  # job groups, unique across the lanes
        self._posted = itertools.count()  # jobs queued, in order (a batch takes the oldest first)
        self._cancelled = CancelledGroups()
        self._notices: list[Event] = []  # what the target reported (a lost worker), for every lane
        self._closed = False
        # bumped under the lock whenever a lane's state or queue changes: the owner thread
        # sleeps only if nothing changed since it last looked (no wake-up is lost)
        self._changes = 0
        # solo: a lone lane's jobs on the target, sent from its thread (LocalTarget takes work
        # from any thread); and what the hub took from the queues but has not sent yet
        self._solo_ok = isinstance(target, LocalTarget)
        self._solo: dict[int, DecodeJob] = {}  # the target's ticket number -> the job
        self._in_hand = 0
        self.lanes = [LaneTarget(self, i) for i in range(n_lanes)]

    # -- any thread
    def new_group(self) -> int:
        with self._cond:
            return next(self._groups)

    def activate(self, lane: int, active: bool = True) -> None:
        """A conversation starts (or stops) decoding on ``lane``: batches wait for an active
        lane's job before they go."""
        with self._cond:
            self._active[lane] = active
            self._changed()

    def wake(self) -> None:
        """End a :meth:`step`'s idle wait now (a request arrived for the owner thread)."""
        with self._cond:
            self._changed()

    def cancel(self, groups: Sequence[int]) -> None:
        """Skip the groups' jobs still queued here and abort a prompt chunk of theirs in flight.
        A batch shared with other conversations is never aborted: its rows come back as usual."""
        with self._cond:
            self._cancelled.add(groups)
            for queue in self._queues:
                for item in [i for i in queue if isinstance(i.work, DecodeJob) and i.work.group in groups]:
                    queue.remove(item)
                    self._resolve(item, GroupCancelled(f"job group {item.work.group} was cancelled"))  # type: ignore[union-attr]
            in_flight = [s.ticket.group for s in self._sent if s.prompt_chunk and s.ticket.group in groups]
            in_flight += [j.group for j in self._solo.values() if j.group in groups]  # never shared
            self._changed()
        if in_flight:
            self.target.cancel(*in_flight)

    # -- lane threads
    def submit_solo(self, lane: int, job: DecodeJob) -> Ticket | None:
        """Send ``job`` to the target from the lane's thread if the lane is alone: no other lane
        active, nothing queued, taken or in flight through the hub (so it runs after all the
        lane asked for before). None: post it."""
        with self._cond:
            alone = (self._solo_ok and self._active[lane] and sum(self._active) == 1 and not self._sent
                     and not self._in_hand and not any(self._queues) and not self._closed)
            if not alone or job.group in self._cancelled:
                return None
            try:
                ticket = self.target.submit(job)
            except Exception:  # refused: the hub's way gives the lane the error, at its wait
                return None
            self._solo[ticket.seq_no] = job
            self.counters.solo += 1
            return ticket

    def wait_solo(self, ticket: Ticket) -> np.ndarray:
        try:
            return self.target.wait(ticket)
        finally:
            with self._cond:
                del self._solo[ticket.seq_no]
                self._changed()  # the hub may send what waited for it

    def post(self, lane: int, work: Work) -> Future:
        """Queue ``work`` behind the lane's earlier work; its future gives the result."""
        with self._cond:
            item = _Item(lane, work, posted=next(self._posted))
            if self._closed:
                raise PotluckError("the server is shutting down")
            if isinstance(work, DecodeJob) and work.group in self._cancelled:
                item.future.set_exception(GroupCancelled(f"job group {work.group} was cancelled"))
                return item.future
            self._queues[lane].append(item)
            self._changed()
        return item.future

    def wait_for(self, lane: int, future: Future) -> object:
        """Block the lane's thread on ``future``: meanwhile the lane counts as waiting, so the
        others' batch need not wait for it."""
        with self._cond:
            if not future.done():
                self._waiting[lane] = future
                self._changed()
        return future.result()

    def call(self, lane: int, fn: Callable[[Target], T]) -> T:
        """``fn(target)`` on the hub's thread, in the lane's order (kept conversations)."""
        return self.wait_for(lane, self.post(lane, fn))  # type: ignore[return-value]

    def notices_since(self, seen: int) -> list[Event]:
        with self._cond:
            return self._notices[seen:]

    # -- the owner thread
    def step(self, timeout_s: float) -> None:
        """Send what is due, file what came back; with nothing to do, wait up to ``timeout_s``
        (only while nothing is in flight: a result ends the wait)."""
        seen, due = self._due()
        for kind, items in due:
            self._send(kind, items)
        filed = self._file_ready()
        if due or filed:
            return
        with self._cond:
            if self._changes != seen:
                return  # a lane posted or waited meanwhile: look again
            if not self._sent:
                self._cond.wait(timeout_s)
                return
            if self._busy(set()):
                self._cond.wait(POLL_S)
                return
            oldest = self._sent[0]
        self._file(oldest)  # only a result can change anything now: wait for it

    def regroup(self) -> None:
        """Between replies, with no lane decoding: let the target take in machines that joined
        (a cluster's workers back from a loss), as a session does before each reply alone."""
        with self._cond:
            if any(self._active) or self._sent or any(self._queues) or self._solo_busy():
                return
        self.target.regroup()
        self._collect_notices()

    def close(self) -> None:
        """Refuse new work, fail what is queued, and close the target."""
        with self._cond:
            self._closed = True
            for queue in self._queues:
                while queue:
                    self._resolve(queue.popleft(), GroupCancelled("the server is shutting down"))
        while self._sent:
            self._file(self._sent[0])
        self.target.close()

    # -- internals (the lock held where said)
    def _busy(self, ready: set[int]) -> bool:
        """A lane is decoding, not waiting for a result and has no job ``ready``: its next job
        may still join the batch."""
        return any(a and w is None and lane not in ready
                   for lane, (a, w) in enumerate(zip(self._active, self._waiting)))

    def _solo_busy(self) -> bool:
        """A lone lane's job is still computing (one it will not wait for counts once done)."""
        return any(not self._arrived(Ticket(job.group, no)) for no, job in self._solo.items())

    def _depth(self) -> int:
        """Batches of lanes' steps in flight at once: one on one machine (the next one would
        only queue behind it, and more lanes join it if it waits); on a pipeline one a stage
        and one more, which waits at the first stage while the head samples (PipeInfer keeps
        n_stages + 1 runs in flight too)."""
        n = self.target.n_stages
        return 1 if n <= 1 else n + 1

    def _changed(self) -> None:
        """A lane's state or queue changed (the lock held): wake the owner thread."""
        self._changes += 1
        self._cond.notify_all()

    def _due(self) -> tuple[int, list[tuple[str, list[_Item]]]]:
        """The change count seen, and what to send now, in order (the lock taken here)."""
        due: list[tuple[str, list[_Item]]] = []
        ready: list[_Item] = []
        chunk_out = False  # a prompt chunk goes in this pass
        with self._cond:
            seen = self._changes
            for lane, queue in enumerate(self._queues):
                while queue:
                    item = queue[0]
                    if not isinstance(item.work, DecodeJob):
                        due.append(("other", [queue.popleft()]))
                        self._in_hand += 1
                        self._prefilling = None if self._prefilling == lane else self._prefilling
                        continue
                    if not item.prompt_chunk:
                        self._prefilling = None if self._prefilling == lane else self._prefilling
                        ready.append(item)
                        break
                    # one prompt at a time, one chunk of it at a time: the other lanes' steps
                    # go between its chunks instead of waiting for the whole prompt
                    if (self._prefilling not in (None, lane) or chunk_out or any(s.prompt_chunk for s in self._sent)
                            or self._solo_busy()):
                        break
                    self._prefilling = lane
                    chunk_out = True
                    due.append(("chunk", [queue.popleft()]))
                    self._in_hand += 1
            merged = sum(not s.prompt_chunk for s in self._sent)
            if ready and not self._busy({i.lane for i in ready}) and not self._solo_busy():
                # one machine: every lane in one batch; a pipeline: lanes spread over enough
                # micro-batches to keep every stage busy, as large as that allows
                per_batch = max(1, sum(self._active) // self._depth())
                while ready and merged < self._depth():
                    batch = self._fill(ready, per_batch)
                    for item in batch:
                        self._queues[item.lane].popleft()
                    due.append(("batch", batch))
                    self._in_hand += 1
                    merged += 1
        return seen, due

    def _fill(self, ready: list[_Item], per_batch: int) -> list[_Item]:
        """The next batch from the ready jobs, oldest first (a lane left out of a full batch
        goes in the next), in lane order within the batch: at most ``per_batch`` lanes, the
        target's ``n_batch`` rows, and the model's longest exact batch (``exact.max_rows``,
        core/batch_exact.py: past it a K-quant's tiled kernels sum each row differently, so a
        row would not get the logits it gets alone); always at least one job, which then
        goes as it would alone."""
        batch: list[_Item] = []
        rows = 0
        limit = min(self.target.n_batch, self.target.exact.max_rows)
        ready.sort(key=lambda item: item.posted)
        while ready and len(batch) < per_batch:
            n = ready[0].work.n_tokens  # type: ignore[union-attr]
            if batch and rows + n > limit:
                if rows + n <= self.target.n_batch:
                    self.counters.split_for_exactness += 1
                break
            batch.append(ready.pop(0))
            rows += n
        return sorted(batch, key=lambda item: item.lane)

    def _send(self, kind: str, items: list[_Item]) -> None:
        try:
            self._send_now(kind, items)
        finally:
            with self._cond:
                self._in_hand -= 1

    def _send_now(self, kind: str, items: list[_Item]) -> None:
        try:
            if kind == "other":
                item = items[0]
                if isinstance(item.work, KvOp):
                    self.counters.kv_ops += 1
                    self.target.kv(item.work)
                    self._resolve(item, None)
                else:
                    self.counters.calls += 1
                    self._resolve(item, item.work(self.target))  # type: ignore[operator]
                return
            job = items[0].work if kind == "chunk" else self._merge(items)
            assert isinstance(job, DecodeJob)
            ticket = self.target.submit(job)
        except Exception as e:  # delivered to the lanes that asked (a refused KV operation too)
            if kind == "other" and not isinstance(e, PotluckError):
                log.error("%s failed: %s", items[0].work, e)
            for item in items:
                self._resolve(item, e)
            return
        parts, row = [], 0
        for item in items:
            n = item.work.n_outputs  # type: ignore[union-attr]
            parts.append((item, row, row + n))
            row += n
        with self._cond:  # cancel() reads it from other threads
            self._sent.append(_Sent(ticket, parts, kind == "chunk"))
            in_flight = sum(not s.prompt_chunk for s in self._sent)
        if kind == "chunk":
            self.counters.prompt_chunks += 1
        else:
            self.counters.most_in_flight = max(self.counters.most_in_flight, in_flight)
            self.counters.overlapped += in_flight > 1

    def _merge(self, items: list[_Item]) -> DecodeJob:
        jobs = [i.work for i in items]
        assert all(isinstance(j, DecodeJob) for j in jobs)
        c = self.counters
        lanes = len({i.lane for i in items})
        rows = sum(j.n_tokens for j in jobs)  # type: ignore[union-attr]
        c.batches += 1
        c.lane_jobs += len(items)
        c.rows += rows
        c.most_lanes = max(c.most_lanes, lanes)
        if lanes > 1:
            c.shared += 1
            c.shared_rows += rows
            c.most_shared_rows = max(c.most_shared_rows, rows)
            c.shared_verify += sum(j.n_tokens > 1 for j in jobs) > 1  # type: ignore[union-attr]
        if len(jobs) == 1:
            return jobs[0]  # type: ignore[return-value]
        return DecodeJob(
            next(self._groups),
            np.concatenate([j.inputs for j in jobs]),  # type: ignore[union-attr]
            np.concatenate([j.positions for j in jobs]),  # type: ignore[union-attr]
            np.concatenate([j.seq_ids for j in jobs]),  # type: ignore[union-attr]
            np.concatenate([j.outputs for j in jobs]),  # type: ignore[union-attr]
        )

    def _file_ready(self) -> bool:
        filed = False
        while self._sent and self._arrived(self._sent[0].ticket):
            self._file(self._sent[0])
            filed = True
        if filed:
            self._collect_notices()
        return filed

    def _arrived(self, ticket: Ticket) -> bool:
        """Whether waiting for ``ticket`` returns at once (a broken pipeline's error does too,
        and a solo ticket its lane has just redeemed)."""
        try:
            return self.target.poll(ticket)
        except Exception:
            return True

    def _file(self, sent: _Sent) -> None:
        """Wait for ``sent`` and give each lane its rows (or the error)."""
        try:
            rows: np.ndarray | BaseException = self.target.wait(sent.ticket)
        except Exception as e:
            rows = e
        with self._cond:
            self._sent.remove(sent)
            for item, a, b in sent.parts:
                self._resolve(item, rows if isinstance(rows, BaseException) else rows[a:b])
        self._collect_notices()

    def _collect_notices(self) -> None:
        news = self.target.notices(0)
        if news:
            with self._cond:
                self._notices.extend(news)

    def _resolve(self, item: _Item, outcome: object) -> None:
        """Settle an item's future; its lane is busy again (under the lock, so that a lane is
        never left marked as waiting on a future already settled)."""
        with self._cond:
            if self._waiting[item.lane] is item.future:
                self._waiting[item.lane] = None
            if isinstance(outcome, BaseException):
                item.future.set_exception(outcome)
            else:
                item.future.set_result(outcome)


class LaneTarget(TargetBase):
    """One lane's view of the shared target: its sequences are numbered from 0, its work goes
    through the hub (from the lane's own thread)."""

    def __init__(self, hub: LaneHub, lane: int) -> None:
        super().__init__()
        shared = hub.target
        self.hub = hub
        self.lane = lane
        self.base = lane * hub.lane_width  # the shared target's number of this lane's sequence 0
        self.n_vocab = shared.n_vocab
        self.n_ctx = shared.n_ctx
        self.n_batch = shared.n_batch
        self.n_seq_max = hub.lane_width
        self.n_stages = shared.n_stages
        # a recurrent model has one lane (loader.lanes_for), which sends its jobs unmerged:
        # its truncate keeps to what the stages' rollback can restore, as the target's would
        self.recurrent = shared.recurrent
        self._futures: dict[int, Future | Ticket] = {}  # a job through the hub, or sent solo
        self._tickets = itertools.count(1)
        self._notices_seen = 0

    @property
    def exact(self) -> BatchExactness:  # type: ignore[override]
        """The shared target's (batch_exact.py): a pipeline's changes when a lost worker's
        layers move to another CPU."""
        return self.hub.target.exact

    def new_group(self) -> int:
        return self.hub.new_group()

    def submit(self, job: DecodeJob) -> Ticket:
        self._check_seqs(int(job.seq_ids.min()), int(job.seq_ids.max()))
        shared = dataclasses.replace(job, seq_ids=job.seq_ids + self.base) if self.base else job
        no = next(self._tickets)
        solo = self.hub.submit_solo(self.lane, shared)
        self._futures[no] = solo if solo is not None else self.hub.post(self.lane, shared)
        return Ticket(job.group, no)

    def _wait(self, ticket: Ticket) -> np.ndarray:
        sent = self._futures.pop(ticket.seq_no)
        if isinstance(sent, Ticket):
            return self.hub.wait_solo(sent)
        return self.hub.wait_for(self.lane, sent)  # type: ignore[return-value]

    def poll(self, ticket: Ticket) -> bool:
        sent = self._futures[ticket.seq_no]
        return self.hub.target.poll(sent) if isinstance(sent, Ticket) else sent.done()

    def cancel(self, group: int, *more: int) -> None:
        self.hub.cancel((group, *more))

    def kv(self, op: KvOp) -> None:
        self._check_seqs(op.seq, op.dst if op.op == "cp" else op.seq)
        if op.op == "keep":  # every other sequence of this lane goes (the other lanes' stay)
            for s in range(self.n_seq_max):
                if s != op.seq:
                    self.kv(KvOp.rm(s))
            return
        dst = op.dst + self.base if op.op == "cp" else op.dst
        self.hub.post(self.lane, dataclasses.replace(op, seq=op.seq + self.base, dst=dst))

    def _check_seqs(self, lo: int, hi: int) -> None:
        if lo < 0 or hi >= self.n_seq_max:
            raise PotluckError(f"sequence id outside 0..{self.n_seq_max - 1} (a lane's own sequences)")

    def reset(self) -> None:
        for s in range(self.n_seq_max):
            self.kv(KvOp.rm(s))
        self._n_past = 0

    def keep_kv(self, slot: int, seq: int = 0) -> bool:
        self._check_seqs(seq, seq)
        return self.hub.call(self.lane, lambda t: t.keep_kv(slot, self.base + seq))

    def restore_kv(self, slot: int, n_past: int, seq: int = 0) -> bool:
        self._check_seqs(seq, seq)
        restored = self.hub.call(self.lane, lambda t: t.restore_kv(slot, n_past, self.base + seq))
        if restored and seq == 0:
            self._n_past = n_past
            self._spans.clear()
        return restored

    def drop_kv(self, slot: int) -> None:
        self.hub.call(self.lane, lambda t: t.drop_kv(slot))

    def kept_kv_budget(self) -> int | None:
        return self.hub.target.kept_kv_budget()

    def on_compute_thread(self, fn: Callable[[], T]) -> T:
        return self.hub.target.on_compute_thread(fn)

    def node_status(self, run_id: int) -> list[NodeStatus]:
        return self.hub.target.node_status(run_id)

    def notices(self, run_id: int) -> list[Event]:
        news = self.hub.notices_since(self._notices_seen)
        self._notices_seen += len(news)
        return [dataclasses.replace(e, run_id=run_id) for e in news]  # type: ignore[type-var]

    def cluster_view(self) -> ClusterView | None:
        return self.hub.target.cluster_view()

    def close(self) -> None:
        """The hub closes the shared target."""


@dataclass
class Lanes:
    """Sessions that decode together: ``sessions[i]`` runs on ``hub.lanes[i]``."""

    hub: LaneHub
    sessions: list[Session]

    def close(self) -> None:
        """The sessions' strategies, then the shared target and the model."""
        for session in self.sessions:
            session.close()
        self.hub.close()
        if self.sessions:
            self.sessions[0].model.close()
