"""The chat app's cluster handling: the plan and slice transfer while a chain loads, each
stage's health during replies, the re-plan key and the cluster picker (F9).

A mixin of :class:`~.app.PotluckApp`: the handlers fold what the loader and reply threads
post into :class:`~.cluster.ClusterState` and redraw the panel from it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ...engine import EngineSpec, PlanChanged
from .cluster import ClusterChoice, ClusterPlanned, ClusterState, SliceProgress, traffic
from .replies import ChatSession, ClusterEvent
from .screens import ClusterScreen, LocalChoice
from .widgets import StatsPanel

log = logging.getLogger(__name__)


class ClusterHandlers:
    """Cluster mode's messages and keys (the app's state lives on the app itself)."""

    cluster: ClusterChoice | None
    cluster_state: ClusterState | None
    discovery_interfaces: tuple[str, ...] | None
    session: ChatSession | None
    spec: EngineSpec
    _traffic_at_load: tuple[int, dict[str, int]]
    start_loading: Callable[[EngineSpec], None]
    update_status: Callable[[], None]

    def show_cluster(self) -> None:
        panels = self._main.query(StatsPanel)
        if panels:
            panels.first().show_cluster(self.cluster_state, self.settings.keys.replan)

    def on_cluster_planned(self, event: ClusterPlanned) -> None:
        for line in event.lines:
            log.info("%s", line)
        if self.cluster_state is not None:
            self.cluster_state = self.cluster_state.planned(event.lines, event.stages, event.head_layers)
        self.notify("\n".join(event.lines), title="Cluster plan", timeout=10)
        self.show_cluster()
        self.update_status()

    def on_slice_progress(self, event: SliceProgress) -> None:
        if self.cluster_state is not None:
            self.cluster_state = self.cluster_state.sending(event.what, event.done, event.total)
        self.show_cluster()
        self.update_status()

    def on_cluster_event(self, event: ClusterEvent) -> None:
        if self.cluster_state is None:
            return
        e, notes = event.event, event.reply.cluster_notes
        if isinstance(e, PlanChanged):
            self.cluster_state = self.cluster_state.with_plan(e)
            # The new chain was loaded with fresh slices: count bytes per token from here.
            self._traffic_at_load = traffic(self.session.cluster_view() if self.session else None)
            notes[:] = [e.reason]  # it names the node and what the head did: the one line to keep
        else:
            self.cluster_state = self.cluster_state.with_status(e)
            if e.state in ("lost", "failed") and not notes:
                notes.append(f"{e.node} {e.state}" + (f": {e.detail}" if e.detail else ""))
        if notes and event.reply.view.is_attached:  # the conversation says it, under the reply
            event.reply.view.set_note(notes[-1])
        self.show_cluster()
        self.update_status()  # "recovering…" ends with the new plan

    def action_replan(self) -> None:
        """Reopen the session over the chosen workers (``auto``: those found now); the next
        reply replays the conversation into the new chain through the normal prefill."""
        if self.cluster is None:
            self.notify("not in cluster mode: F9 picks workers", severity="warning")
            return
        if self.reply is not None:
            self.notify("a reply is still being generated; Esc stops it", severity="warning")
            return
        self.notify(f"re-planning over {self.cluster.describe()}…")
        self.start_loading(self.spec)

    def action_cluster(self) -> None:
        if self.reply is not None:
            self.notify("wait for the reply (or Esc) before changing workers", severity="warning")
            return
        self.run_worker(self._open_cluster_picker(), group="picker", exclusive=True)

    async def _open_cluster_picker(self) -> None:
        stages = self.cluster_state.stages if self.cluster_state else ()
        choice = await self.push_screen_wait(
            ClusterScreen(
                self.discovery_interfaces, {r.address for r in stages}, self.cluster,
                self.settings.cluster.join_timeout_s,
            )
        )
        if choice is None:
            return
        if isinstance(choice, LocalChoice):
            if self.cluster is None:
                return
            self.cluster = None
        else:
            self.cluster = choice
        self.start_loading(self.spec)
