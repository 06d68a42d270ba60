"""Cluster mode in the chat app: which workers, the plan over them, and each stage's health.

:class:`ClusterChoice` is what the user picked (``--nodes`` or the cluster picker); the
loader thread turns it into the engine's :class:`~potluck.engine.loader.ClusterSpec`
(zeroconf for ``auto``) and reports the plan and the slice transfer as Textual messages.
:class:`ClusterState` is the panel's picture of the chain, folded from what the engine
says: the plan when it loads, :class:`NodeStatus` / :class:`PlanChanged` events during
replies, and the head's per-link byte counters sampled by the panels' timer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from textual.message import Message as TMessage

from ...engine import DISCOVER_TIMEOUT_S, JOIN_TIMEOUT_S, ClusterView, NodeStatus, PlanChanged

AUTO = "auto"


@dataclass(frozen=True)
class ClusterChoice:
    """The workers to run the target on: ``auto`` (zeroconf) or host:port addresses."""

    nodes: str | tuple[str, ...]
    token: str | None = None  # None: the token file, $POTLUCK_TOKEN or the saved token
    token_file: Path | None = None
    split: tuple[int, ...] | None = None
    hidden_dtype: str = "f32"
    discover_timeout_s: float = DISCOVER_TIMEOUT_S
    join_timeout_s: float = JOIN_TIMEOUT_S
    interfaces: tuple[str, ...] | None = None  # zeroconf interfaces (tests: loopback only)
    strict_nodes: bool = False  # --strict-nodes: a listed worker that does not join refuses the load

    def describe(self) -> str:
        return "workers found on the LAN" if self.nodes == AUTO else ", ".join(self.nodes)

    def resolve(self, on_plan: Callable[[object], None], progress: Callable[[str, int, int], None]):  # noqa: ANN201
        """The engine's ClusterSpec (network: runs in the loader thread)."""
        from ...discovery.auth import keys_from_token, resolve_token
        from ...engine import ClusterSpec
        from ..cli import potluck_version

        keys = keys_from_token(resolve_token(self.token, self.token_file))
        if self.nodes == AUTO:
            from ...discovery.lan import find_candidates

            nodes = find_candidates(self.discover_timeout_s, interfaces=self.interfaces)
        else:
            nodes = tuple(self.nodes)
        return ClusterSpec(
            nodes=nodes, keys=keys, split=self.split, hidden_dtype=self.hidden_dtype,
            potluck_version=potluck_version(), on_plan=on_plan, progress=progress,
            skip_failed_joins=self.nodes == AUTO,  # zeroconf records are candidates, proven by joining
            join_timeout_s=self.join_timeout_s, strict_nodes=self.strict_nodes,
        )


@dataclass(frozen=True)
class StageRow:
    node: str
    address: str
    layers: tuple[int, int]  # first layer, last layer + 1 (as the head keeps them)
    state: str = "ok"  # "ok", "failed", "lost", "recovering", "loading"
    detail: str = ""
    bytes_per_token: float | None = None

    @property
    def layer_text(self) -> str:
        """As the split plan writes them: first layer, then the one after the last."""
        lo, hi = self.layers
        return f"{lo}-{hi}" if hi > lo else "-"


@dataclass(frozen=True)
class ClusterState:
    """The panel's picture of the chain (UI thread only; replaced, never mutated)."""

    stages: tuple[StageRow, ...] = ()
    plan: tuple[str, ...] = ()  # the plan's lines, as `generate --nodes` prints them
    transfer: tuple[str, int, int] | None = None  # what, bytes done, bytes total
    note: str = ""  # the latest loss / re-plan, for the user
    sent_bytes: int = 0  # slice bytes sent while loading
    cached_bytes: int = 0  # slice bytes the workers already had (nothing sent)
    head_layers: tuple[int, int] | None = None  # the layers the head computes (none: it computes the output)
    experts: tuple[int, int, int] = (0, 0, 0)  # a mixture's experts per layer, used a token, shared

    @property
    def experts_text(self) -> str:
        n_expert, n_used, n_shared = self.experts
        shared = f"+{n_shared}" if n_shared else ""
        return f"{n_used}{shared}/{n_expert} experts" if n_expert else ""

    def planned(
        self, lines: Sequence[str], stages: Sequence[StageRow], head_layers: tuple[int, int] | None = None
    ) -> ClusterState:
        return replace(self, plan=tuple(lines), stages=tuple(stages), note="", head_layers=head_layers)

    def sending(self, what: str, done: int, total: int) -> ClusterState:
        if done < total:
            return replace(self, transfer=(what, done, total))
        if what.endswith("(cached)"):  # the transfer's word for a slice the worker had
            return replace(self, transfer=None, cached_bytes=self.cached_bytes + total)
        return replace(self, transfer=None, sent_bytes=self.sent_bytes + total)

    def loaded(
        self, stages: Sequence[StageRow], head_layers: tuple[int, int] | None = None,
        experts: tuple[int, int, int] = (0, 0, 0),
    ) -> ClusterState:
        return replace(self, stages=tuple(stages), transfer=None, head_layers=head_layers or self.head_layers,
                       experts=experts)

    def with_status(self, e: NodeStatus) -> ClusterState:
        rows = list(self.stages)
        for i, r in enumerate(rows):
            if e.node in (r.node, r.address) or (r.layers == e.layers and not r.node):
                rows[i] = replace(r, state=e.state, detail=e.detail or r.detail, layers=e.layers or r.layers)
                break
        else:
            rows.append(StageRow(e.node, e.detail, e.layers, e.state, e.detail))
        note = self.note
        if e.state != "ok":
            note = f"{e.node} {e.state}" + (f": {e.detail}" if e.detail and e.state != "ok" else "")
        return replace(self, stages=tuple(rows), note=note)

    def with_plan(self, e: PlanChanged) -> ClusterState:
        old = {r.node: r for r in self.stages}
        rows = tuple(
            replace(old[node], layers=(lo, hi), state="ok") if node in old else StageRow(node, "", (lo, hi))
            for node, lo, hi in e.stages
        )
        return replace(self, stages=rows, note=e.reason)

    def with_health(self, health: Sequence[tuple[str, str, str]]) -> ClusterState:
        """The head's word on its stages right now (``ClusterView.health``): a lost worker
        shows lost, the others recovering, while the reply waits for the new chain."""
        state = self
        for node, status, detail in health:
            row = next((r for r in state.stages if node in (r.node, r.address)), None)
            if row is not None and row.state != status:
                state = state.with_status(NodeStatus(0, node, row.layers, status, detail))
        return state

    @property
    def recovering(self) -> bool:
        return any(r.state == "recovering" for r in self.stages)

    def failed(self, error: str) -> ClusterState:
        """The reply failed (a stage lost or frozen): mark the stage the error names."""
        rows = tuple(
            replace(r, state="lost", detail=error)
            if (r.node and r.node in error) or (r.address and r.address in error) else r
            for r in self.stages
        )
        if rows == self.stages:  # the error names no stage: the chain as a whole is down
            rows = tuple(replace(r, state="failed") for r in self.stages)
        return replace(self, stages=rows, note=error)

    def with_bytes(self, per_token: dict[str, float]) -> ClusterState:
        rows = tuple(replace(r, bytes_per_token=per_token.get(r.address, r.bytes_per_token)) for r in self.stages)
        return self if rows == self.stages else replace(self, stages=rows)

    @property
    def healthy(self) -> bool:
        return all(r.state == "ok" for r in self.stages)

    @property
    def broken(self) -> bool:
        """A stage is gone for good: the user should re-plan (loading or recovering is not)."""
        return any(r.state in ("lost", "failed") for r in self.stages)


def stages_of(view: ClusterView | None) -> list[StageRow]:
    """The chain a loaded session runs on (its :meth:`Session.cluster_view`), or []."""
    return [StageRow(s.node, s.address, s.layers) for s in (view.stages if view else ())]


Counters = tuple[int, dict[str, int]]  # tokens through the chain, bytes per link address


def traffic(view: ClusterView | None) -> Counters:
    """The head's counters now (ints read between its updates: a torn read is impossible)."""
    if view is None:
        return 0, {}
    return view.tokens, {s.address: s.bytes_total for s in view.stages}


def bytes_per_token(now: Counters, since: Counters) -> dict[str, float]:
    """Per stage (by address): bytes exchanged per token since ``since`` (the session's
    load, so the slices sent while loading do not count)."""
    tokens = now[0] - since[0]
    if tokens <= 0:
        return {}
    return {a: (b - since[1].get(a, 0)) / tokens for a, b in now[1].items()}


def human_bytes(n: float | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "kB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


# ----------------------------------------------------------------- loader-thread messages
class ClusterPlanned(TMessage):
    def __init__(self, lines: list[str], stages: list[StageRow], head_layers: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.lines, self.stages, self.head_layers = lines, stages, head_layers


class SliceProgress(TMessage):
    def __init__(self, what: str, done: int, total: int) -> None:
        super().__init__()
        self.what, self.done, self.total = what, done, total


@dataclass
class LoadReporter:
    """The ClusterSpec callbacks: plan and slice progress as messages (few: one per percent)."""

    post: Callable[[TMessage], bool]
    _last: dict[str, int] = field(default_factory=dict)

    def on_plan(self, plan: object) -> None:
        stages = [
            StageRow(s.node.name, s.node.address, (s.lo, s.hi), state="loading")  # type: ignore[attr-defined]
            for s in plan.stages  # type: ignore[attr-defined]
        ]
        head = getattr(plan, "head", None)  # the head's own layers (it computes the output layer)
        self.post(ClusterPlanned(list(plan.describe()), stages, head))  # type: ignore[attr-defined]

    def progress(self, what: str, done: int, total: int) -> None:
        pct = int(100 * done / total) if total else 100
        if self._last.get(what) == pct and done < total:
            return
        self._last[what] = pct
        self.post(SliceProgress(what, done, total))
