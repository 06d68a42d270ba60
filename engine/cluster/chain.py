"""A chain of workers: how to plan it (:class:`PipelineSetup`, :func:`plan_over`,
:func:`replan`) and load it (:func:`load_chain`: slices sent, stages loaded, each told its
upstream and where to forward), the head's own fallback worker (:class:`HeadWorker`), and
the threads the head's own layers take beside local workers (:func:`tail_threads`).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core.batch_exact import BatchExactness, combine
from ..core.errors import PotluckError
from ..core.spec import CurveKeys
from . import wire
from .link import REQUEST_TIMEOUT_S, NodeFailedError, NodeLink
from .plan import SplitPlan, kv_cells, layer_costs, manual_plan, plan_split, with_step_cost
from .transfer import CHUNK_BYTES, Progress, SliceCache, TransferStats, send_slice
from .transport import endpoint, host_of, on_this_machine


@dataclass(frozen=True)
class PipelineSetup:
    """How to build a chain over some workers; the target keeps it to re-plan after a loss."""

    model_path: Path
    keys: CurveKeys
    head_id: str
    n_ctx: int
    n_batch: int
    n_seq_max: int
    kv_unified: bool
    hidden_dtype: str
    potluck_version: str
    slice_cache: SliceCache
    progress: Progress | None = None
    split: tuple[int, ...] | None = None  # the user's fixed layer boundaries, if any
    head_speed: float = 0.0  # the head's speed score at its layers' threads (for the plan's prediction)


def plan_over(setup: PipelineSetup, links: Sequence[NodeLink], split: Sequence[int] | None = None) -> SplitPlan:
    """The layer plan over joined ``links`` (fixed boundaries, or by free memory and speed)."""
    costs = layer_costs(setup.model_path)
    nodes = [lk.info() for lk in links]
    cells = kv_cells(setup.n_ctx, setup.n_seq_max, setup.kv_unified)  # as the worker checks its load
    if split:
        plan = manual_plan(costs, nodes, split, cells, setup.n_batch, setup.hidden_dtype, setup.n_ctx,
                           setup.head_speed)
    else:
        plan = plan_split(costs, nodes, cells, setup.n_batch, setup.hidden_dtype, setup.n_ctx, setup.head_speed,
                          setup.slice_cache.known_ranges(setup.model_path))
    return with_step_cost(plan, setup.model_path, costs)


def replan(setup: PipelineSetup, links: Sequence[NodeLink]) -> SplitPlan:
    """The plan after the workers changed: the user's fixed split while there is one worker
    per stage of it, else by free memory and speed."""
    if setup.split:
        try:
            return plan_over(setup, links, setup.split)
        except PotluckError:
            pass  # another number of workers than the split has stages
    return plan_over(setup, links)


def load_chain(
    setup: PipelineSetup, links: Sequence[NodeLink], plan: SplitPlan, stats: TransferStats
) -> list[wire.Loaded]:
    """Send each stage its slice (unless it holds it) and load it; ``links`` in plan order."""
    for lk, s in zip(links, plan.stages):
        lk.layers = (s.lo, s.hi)
    slices = setup.slice_cache.slices(setup.model_path, plan.bounds)
    for lk, sl in zip(links, slices):
        room = lk.welcome.max_message - (64 << 10)  # type: ignore[union-attr]
        send_slice(lk.request, sl, stats, setup.progress, chunk_bytes=max(1 << 16, min(CHUNK_BYTES, room)))
    # Fresh keys for each hop of this chain: the head signs the first stage's traffic with
    # the first, stage i signs what it forwards to stage i+1 with the next (wire.Load).
    hop_keys = [os.urandom(32) for _ in links]
    for lk in links:
        lk.data_key = b""
    links[0].data_key = hop_keys[0]
    for i, (lk, sl) in enumerate(zip(links, slices)):  # every stage loads at once
        last = i == len(links) - 1
        lk.send(
            wire.Load(
                sha256=sl.sha256,
                layer_lo=sl.lo,
                layer_hi=sl.hi,
                first=i == 0,
                last=last,
                n_ctx=setup.n_ctx,
                n_batch=setup.n_batch,
                n_seq_max=setup.n_seq_max,
                kv_unified=setup.kv_unified,
                hidden_dtype=setup.hidden_dtype,
                next_addr="" if last else forward_address(links[i + 1], lk),
                upstream_key=hop_keys[i].hex(),
                downstream_key="" if last else hop_keys[i + 1].hex(),
            )
        )
    loaded: list[wire.Loaded] = []
    for lk in links:
        reply = lk.reply(wire.Loaded, REQUEST_TIMEOUT_S * 4)
        if not isinstance(reply, wire.Loaded):
            raise NodeFailedError(f"{lk.describe()} answered load with {reply.TYPE}")
        loaded.append(reply)
    return loaded


def chain_exactness(loaded: Sequence[wire.Loaded], tail: BatchExactness) -> BatchExactness:
    """What keeps verify batches exact over the whole chain: each worker judged its own slice
    on its own CPU (whether llama.cpp repacks, and how, is the worker's), the head its tail."""
    return combine([tail, *(BatchExactness(ld.max_rows, ld.two_row_steps, ld.exact_reason) for ld in loaded)])


def forward_address(nxt: NodeLink, upstream: NodeLink) -> str:
    """The endpoint ``upstream``'s stage forwards to so that it reaches ``nxt``: the address
    the head joined it at, except for the head's own worker, which the head reaches on
    loopback and a stage on another machine reaches at the head's address on its network."""
    if nxt.seen_from is not None:
        return endpoint(nxt.seen_from(upstream.address))
    return endpoint(nxt.address)


class HeadWorker:
    """Layers no worker can take run on the head itself: a worker inside this process (its
    llama.cpp in a supervised child, like any worker's), joined like the others.

    It listens on every interface: a surviving stage on another machine forwards to it at the
    head's address on that machine's network (:meth:`address_seen_from`); the head itself
    joins it on loopback. ``bind="127.0.0.1"`` keeps it on loopback when every stage is here."""

    def __init__(self, keys: CurveKeys, cache_dir: Path, n_threads: int = 0, bind: str = "0.0.0.0") -> None:
        from .profile import measure_profile
        from .worker import Worker

        self.worker = Worker(keys, measure_profile(n_threads or 1), cache_dir, bind=bind, n_threads=n_threads)
        self.address = f"127.0.0.1:{self.worker.port}"
        self._thread = threading.Thread(target=self.worker.serve_forever, name="head-worker", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def address_seen_from(self, peer: str) -> str:
        """``host:port`` at which the worker at ``peer`` reaches this one: loopback from this
        machine, else this machine's address on the route to ``peer`` (no packet is sent)."""
        host = host_of(peer)
        if on_this_machine(peer):
            return self.address
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect((host, 9))  # UDP connect: picks the route and source address only
                mine = probe.getsockname()[0]
        except OSError as e:
            raise PotluckError(f"no route from this head to {peer} for its own worker: {e}") from None
        return f"[{mine}]:{self.worker.port}" if family == socket.AF_INET6 else f"{mine}:{self.worker.port}"

    def close(self) -> None:
        self.worker.stop()
        self._thread.join(10)



def tail_threads(addresses: Sequence[str]) -> int:
    """Threads for the head's own layers when none are asked for: all cores, but one when a
    worker shares this machine. Between batches llama.cpp's OpenMP threads spin, and a
    spinning thread takes the core a local worker computes on. Measured with 2 loopback
    workers on 2 cores: the head's CPU fell from 13.3 to 5.0 ms a token, its layers took
    3.7 ms instead of 2.9, synchronous decoding held its speed and pipeinfer went from 51 to
    63 tok/s on code edits, 28 to 38 on chat."""
    return 1 if any(on_this_machine(a) for a in addresses) else 0
