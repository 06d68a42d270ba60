"""Recovery of a :class:`~.pipeline_target.PipelineTarget`: a lost worker's chain is rebuilt
over the workers that still answer (or the head's own worker) and the transaction log
(:mod:`.recovery`) is replayed through it; between replies, workers that joined or came back
are taken in the same way when they make the plan faster.

:class:`ChainRebuild` is the part of the target that does this; it works on the target's
links, tail, log and ticket books, and the strategy never notices.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import zmq

from ..core.errors import PotluckError
from ..core.events import Event, NodeStatus, PlanChanged
from ..core.gguf_tools import forget_parsed_headers
from ..core.jobs import CancelledGroups
from . import wire
from .chain import HeadWorker, PipelineSetup, chain_exactness, load_chain, replan
from .join import join_links
from .link import REJOIN_TIMEOUT_S, NodeFailedError, NodeLink, NodeLostError, max_result_bytes
from .plan import SplitPlan
from .recovery import LoggedBatch, LoggedKv, TransactionLog
from .tail import HeadTail
from .transfer import TransferStats

log = logging.getLogger(__name__)

# Between replies the head asks listed workers it does not use whether they are back: a
# short join, and an address that does not answer is asked again only this much later.
REGROUP_JOIN_TIMEOUT_S = 1.0
# The head's own worker (HeadWorker) is in this process: it can only be slow to accept, on a
# machine busy with everything else, never absent.
HEAD_WORKER_JOIN_TIMEOUT_S = 30.0
REGROUP_RETRY_S = 30.0
REGROUP_GAIN = 0.9  # a new plan is taken only if its slowest stage is this much faster
# Recoveries in a row without one result coming back: past this the cluster is flapping.
MAX_RECOVERIES_IN_A_ROW = 3
# A rebuild that keeps losing nodes (a head worker that cannot start, workers dying one by
# one) ends in one clear error instead of retrying forever.
MAX_REBUILDS = 4
RECOVERY_DEADLINE_S = 90.0
# Replayed batches whose results were already delivered run under this job group, which no
# caller ever gets from new_group(): a cancel sent meanwhile can never skip one of them.
REPLAY_GROUP = 0


class ChainRebuild:
    """Rebuild and replay for :class:`~.pipeline_target.PipelineTarget` (its base class)."""

    _zctx: zmq.Context
    links: list[NodeLink]
    tail: HeadTail
    n_batch: int
    n_ctx: int
    plan: SplitPlan | None
    transfer: TransferStats
    setup: PipelineSetup | None
    recover: bool
    head_fallback: bool
    head_worker: HeadWorker | None
    candidates: Callable[[], Sequence[str]] | None
    log: TransactionLog
    recoveries: int
    recovery_s: list[float]
    _retry_at: dict[str, float]
    _rows: dict[int, int]
    _cancelled: CancelledGroups
    _recoveries_in_a_row: int
    _notices: list[Callable[[int], Event]]
    _health: tuple[tuple[str, str, str], ...]  # stages not "ok" during a recovery (cluster_view)
    _broken: str | None
    _kept_logs: dict[int, tuple[TransactionLog, int]]

    def regroup(self) -> None:
        """Between replies: take in workers that joined (or came back) since the plan was
        made, if the plan gets faster with them. Nothing is in flight then; the new chain
        gets the log replayed, exactly as after a loss."""
        setup = self.setup
        if setup is None or not self.recover or self._broken is not None or self._rows or self.candidates is None:
            return
        known = {lk.address for lk in self.links} | {self.head_worker.address if self.head_worker else ""}
        ids = {lk.node_id for lk in self.links}
        now = time.monotonic()
        tried = [
            NodeLink(self._zctx, setup.keys, address,
                            max_result_bytes(self.n_batch, self.tail.n_embd))
            for address in self.candidates()
            if address not in known and self._retry_at.get(address, 0.0) <= now
        ]
        joins = join_links(tried, setup.head_id, setup.potluck_version, REGROUP_JOIN_TIMEOUT_S, all_needed=False)
        for address, why in joins.failed.items():
            log.info("%s stays out of the plan: %s", address, why)
            self._retry_at[address] = now + REGROUP_RETRY_S
        new: list[NodeLink] = []
        for link in joins.joined:
            if link.node_id in ids:
                link.close(release=False)
                continue
            new.append(link)
        if not new:
            return
        try:
            better = replan(setup, [*self.links, *new])
        except PotluckError:
            better = None
        new_ids = {lk.node_id for lk in new}
        if better is None or self.plan is None or not any(s.node.name in new_ids for s in better.stages) or (
            max(s.cost for s in better.stages) >= REGROUP_GAIN * max(s.cost for s in self.plan.stages)
        ):
            for lk in new:
                lk.close(release=True)
                self._retry_at[lk.address] = now + REGROUP_RETRY_S
            return
        names = ", ".join(lk.describe() for lk in new)
        t0 = time.monotonic()
        self.links.extend(new)
        try:
            self._rebuild()
            self._replay()
        except NodeLostError as e:
            self._recover(e)  # one of them went away meanwhile: carry on without it
            return
        except PotluckError as e:
            self._give_up(NodeFailedError(f"taking in {names} failed"), str(e))
        stages = tuple((lk.node_id, *(lk.layers or (0, 0))) for lk in self.links)
        reason = (
            f"{names} joined; the plan now uses {len(self.links)} worker(s) (rebuilt in "
            f"{time.monotonic() - t0:.1f} s, replaying {self.log.n_rows} cached tokens)"
        )
        reason += self._f16_caveat()
        log.warning("%s", reason)
        self._notices.append(lambda run_id: PlanChanged(run_id, stages, reason))

    # -- internals: recovery
    def _recover(self, err: NodeLostError) -> None:
        """Replace the chain after ``err``: re-plan over the workers that still answer, load
        them, replay the log. Raises :class:`NodeFailedError` (target unusable) if it cannot."""
        if not self.recover or self.setup is None:
            self._fail(str(err))
            raise NodeFailedError(str(err)) from None
        self._recoveries_in_a_row += 1
        if self._recoveries_in_a_row > MAX_RECOVERIES_IN_A_ROW:
            self._give_up(err, f"{MAX_RECOVERIES_IN_A_ROW} recoveries in a row returned nothing")
        self._flush_cancels()
        first = err
        log.warning("%s; re-planning over the other workers", first)
        old_stages = [(lk.node_id, *(lk.layers or (0, 0))) for lk in self.links]
        t0 = time.monotonic()
        for attempt in range(1, MAX_REBUILDS + 1):
            lost = [lk for lk in self.links if lk.address == err.address] or [
                lk for lk in self.links if lk.drain_events()
            ]
            for lk in lost:
                self._notice_node(lk, "lost", str(err))
                lk.close(release=False)
            self.links = [lk for lk in self.links if lk not in lost]
            for lk in self.links:
                self._notice_node(lk, "recovering", "rebuilding its KV cache from the head's log")
            try:
                self._rebuild()
                self._replay()
                break
            except NodeLostError as again:
                if attempt == MAX_REBUILDS or time.monotonic() - t0 > RECOVERY_DEADLINE_S:
                    # the first loss leads: it is what the user must fix; the last says why it stuck
                    self._give_up(first, f"the chain broke again {attempt} time(s) while being rebuilt "
                                         f"(last: {again})")
                err = again
                log.warning("%s during recovery", again)
            except PotluckError as e:
                self._give_up(first, str(e))
        self.recoveries += 1
        self.recovery_s.append(time.monotonic() - t0)
        self._health = ()
        new_stages = tuple((lk.node_id, *(lk.layers or (0, 0))) for lk in self.links)
        reason = (
            f"{first}; continued on {len(self.links)} worker(s) after "
            f"{time.monotonic() - t0:.1f} s, replaying {self.log.n_rows} cached tokens"
        )
        reason += self._f16_caveat()
        log.warning("recovered: %s (was %s)", reason, old_stages)
        self._notices.append(lambda run_id: PlanChanged(run_id, new_stages, reason))

    def _f16_caveat(self) -> str:
        """f16 hidden states round at every stage boundary: new boundaries, new roundings."""
        if self.setup is not None and self.setup.hidden_dtype != "f32":
            return f" ({self.setup.hidden_dtype} hidden states: the rest may differ from an uninterrupted run)"
        return ""

    def _give_up(self, err: NodeFailedError, why: str) -> None:
        message = f"{err}; recovery failed: {why}"
        for lk in self.links:
            lk.close(release=True)
        self.links = []
        self._watch_links()
        self._fail(message)
        raise NodeFailedError(message) from None

    def _notice_node(self, link: NodeLink, state: str, detail: str) -> None:
        node, layers = link.node_id or link.address, link.layers or (0, 0)
        self._notices.append(lambda run_id: NodeStatus(run_id, node, layers, state, detail))
        # readable now by cluster_view() from another thread: a new tuple, never mutated
        self._health = (*(h for h in self._health if h[0] != node), (node, state, detail))

    def _rebuild(self) -> None:
        """Bring the surviving workers back to idle, plan over them and load the new chain."""
        setup = self.setup
        assert setup is not None
        for lk in self.links:
            lk.rejoin(setup.head_id, setup.potluck_version)
        deadline = time.monotonic() + REJOIN_TIMEOUT_S
        for lk in self.links:
            lk.await_welcome(deadline)
        try:
            if not self.links:
                raise PotluckError("no worker is left to take over its layers")
            plan = replan(setup, self.links)
        except PotluckError as e:
            here = self.head_worker.address if self.head_worker else ""
            if not self.head_fallback or any(lk.address == here for lk in self.links):
                raise
            log.warning("%s; the head loads the layers itself", e)
            self.links.append(self._join_head_worker())
            plan = replan(setup, self.links)
        by_id = {lk.node_id: lk for lk in self.links}
        used = [by_id[s.node.name] for s in plan.stages]
        for lk in self.links:
            if lk not in used:
                lk.close(release=True)
        self.links = used
        self._watch_links()
        loaded = load_chain(setup, used, plan, self.transfer)
        forget_parsed_headers()
        if loaded[-1].n_embd != self.tail.n_embd or min(ld.n_ctx for ld in loaded) < self.n_ctx:
            raise PotluckError("the new chain's width or context differs from the old one's")
        self.plan = plan
        # other workers, perhaps other CPUs: strategies read it each round, steps each submit
        self.exact = chain_exactness(loaded, self.tail.model.batch_exact)

    def _join_head_worker(self) -> NodeLink:
        setup = self.setup
        assert setup is not None
        if self.head_worker is None:
            self.head_worker = HeadWorker(setup.keys, setup.slice_cache.folder / "head-worker")
        link = NodeLink(self._zctx, setup.keys, self.head_worker.address,
                        max_result_bytes(self.n_batch, self.tail.n_embd))
        link.seen_from = self.head_worker.address_seen_from
        try:
            link.join(setup.head_id, setup.potluck_version, HEAD_WORKER_JOIN_TIMEOUT_S)
        except NodeFailedError as e:
            link.close(release=False)
            log.warning("the head's own worker did not join (%s); its thread %s, %d refusal(s) so far", e,
                        "runs" if self.head_worker.running else "has stopped", self.head_worker.worker.rejected)
            self.head_worker.close()  # it does not answer: the next attempt starts a fresh one
            self.head_worker = None
            raise
        return link

    def _replay(self) -> None:
        """Send the log, in order, to the new chain's first stage and the cleared tail: each
        stage applies exactly what the old chain applied. Batches whose result is still
        awaited keep their ticket; what the tail finished before it was cleared is filed."""
        self._file_tail(self.tail.restart())
        self._kept_logs.clear()  # kept conversations' cells went with the old chain
        self._txn = 0
        self._txn_ticket.clear()
        self._txn_rows.clear()
        for entry in self.log:
            if isinstance(entry, LoggedKv):
                op, group = entry.op, entry.group
                self._send_op(lambda txn, op=op, group=group: wire.KvApply.from_op(txn, op, group), op)
                continue
            assert isinstance(entry, LoggedBatch)
            job = entry.job
            if self._awaited(entry.ticket):
                if job.group in self._cancelled:  # the old chain would have skipped it
                    self._skipped.add(entry.ticket)
                    self.log.forget(entry.ticket)
                    continue
            else:
                job = dataclasses.replace(job, group=REPLAY_GROUP)
            self._send_batch(entry.ticket, job)
            self.stats.replayed_batches += 1
            self.stats.replayed_tokens += job.n_tokens
        # The new stages skip later batches of cancelled groups as the old ones did; replayed
        # batches run under REPLAY_GROUP, so these cancels cannot touch them.
        for msg in wire.cancel_messages(tuple(self._cancelled)):
            for link in self.links:
                link.send_nowait(msg)

