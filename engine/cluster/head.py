"""The head side: :class:`~.pipeline_target.PipelineTarget`, a :class:`~potluck.engine.core.target.Target` whose layers
run on LAN workers, and :func:`open_pipeline`, which joins, plans, distributes and loads.

Data path: head -> stage 1 -> ... -> stage N -> head's tail (:mod:`.tail`). The head sends
every transaction (``forward`` batches, ``kv`` operations, ``reset``) to stage 1 only; each
stage applies it and passes it on, so KV operations and batches happen in the same order
everywhere. The last worker returns the hidden states of every row (n_embd floats a token,
not n_vocab: 2.3 kB instead of 196 kB for SmolLM2), and the head's tail, which holds the
output layer (behind zeros: :mod:`.tail`), takes them in transaction order with the KV
operations and resets, and computes the logits of the rows a batch asks for. Any number of
batches may be in flight: results are filed by ticket as the tail finishes them and handed
to whoever waits for that ticket, never dropped. ``cancel(group)`` goes to every stage out
of band, the tail included: queued batches of the run are skipped, a running one is aborted.

The head maps only the tail's slice of the target (the loader opens the target itself
vocab-only for the tokenizer and chat template), so a model too big for the head still
works in cluster mode.

Failure and recovery: every link has a ZeroMQ monitor; a worker that dies (socket closed),
freezes (heartbeats stop, 2.5 s), becomes unreachable or stays busy past ``stall_timeout_s``
is named as lost. The head then re-plans over the workers that still answer (and, when
they cannot hold the model, over a :class:`HeadWorker` of its own), sends them their new
slices, lets its tail finish what it holds, clears it, and replays its transaction log
(:mod:`.recovery`) verbatim through the new chain and the tail, so the KV caches and every
later result equal an uninterrupted run's; batches in flight are re-sent by the replay and
their tickets stay valid. The strategy never notices; the
session hears of it through :meth:`PipelineTarget.notices` (``NodeStatus``
"lost"/"recovering", ``PlanChanged``). Between replies :meth:`PipelineTarget.regroup` takes
in workers that joined or came back, the same way, when they make the plan faster. When no
plan fits what is left, or a worker refuses work, the target becomes unusable with a
:class:`NodeFailedError` naming the node, and the session keeps the conversation.

The parts: :mod:`.link` (one connection to a worker), :mod:`.chain` (planning and loading a
chain, the head's own worker), :mod:`.pipeline_target` (the target), :mod:`.rebuild`
(recovery and regrouping) and :mod:`.recovery` (the transaction log). This module opens a
pipeline over them.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import zmq

from ..core.errors import PotluckError
from ..core.gguf_tools import forget_parsed_headers
from ..core.load_watch import default_threads
from ..core.runtime import ContextParams
from ..core.spec import CurveKeys
from .chain import PipelineSetup, chain_exactness, load_chain, plan_over, tail_threads
from .join import join_links
from .link import JOIN_TIMEOUT_S, NodeFailedError, NodeLink, max_result_bytes
from .pipeline_target import STALL_TIMEOUT_S, PipelineTarget
from .plan import SplitPlan, head_zeroed_layers, splittable_costs
from .profile import measure_speed
from .tail import HeadTail
from .transfer import Progress, SliceCache, TransferStats

log = logging.getLogger(__name__)


def open_pipeline(
    model_path: Path,
    addresses: Sequence[str],
    keys: CurveKeys,
    *,
    n_ctx: int = 4096,
    n_batch: int = 512,
    n_seq_max: int = 1,
    kv_unified: bool = True,
    split: Sequence[int] | None = None,
    hidden_dtype: str = "f32",
    potluck_version: str = "0",
    on_plan: Callable[[SplitPlan], None] | None = None,
    progress: Progress | None = None,
    slice_cache: SliceCache | None = None,
    join_timeout_s: float = JOIN_TIMEOUT_S,
    skip_failed_joins: bool = False,
    strict_nodes: bool = False,
    stall_timeout_s: float = STALL_TIMEOUT_S,
    recover: bool = True,
    head_fallback: bool = True,
    candidates: Callable[[], Sequence[str]] | None = None,
    n_threads: int = 0,
) -> PipelineTarget:
    """Join the workers at ``addresses``, plan the split, send slices, load the stages, and
    load the head's own output layer (``n_threads`` for it; 0: see :func:`tail_threads`).

    ``split``: fixed layer boundaries of the workers' stages (e.g. ``[0, 9, 18]``), one stage
    per address in order; the last stage ends at ``n_layer``, which may be left out
    (:func:`.plan.manual_plan`). None plans by free memory and speed.
    ``on_plan`` sees the plan before anything loads.
    ``skip_failed_joins`` (``--nodes auto``): the addresses are candidates (anyone can advertise
    a zeroconf record): those that do not prove to be workers are skipped with a warning
    instead of failing the pipeline, and one link is kept per node. Every address is joined at
    once under one deadline, ``join_timeout_s`` (:func:`.join.join_links`).
    A fixed list (not ``skip_failed_joins``): a node that does not join (down, busy, another
    token) is skipped with a one-line warning when the others can hold the model, as the same
    loss mid-reply is recovered; ``strict_nodes`` (``--strict-nodes``) or a fixed ``split``
    refuses instead. Dead addresses are given up on as with candidates (:func:`.join.join_links`).
    ``recover``: re-plan over the other workers when one is lost (else the target just fails);
    ``head_fallback``: when what is left cannot hold the model, the head loads layers itself.
    ``candidates``: the workers that may join between replies (default: ``addresses``, so a
    lost worker restarted at its address is taken back when that makes the plan faster).
    """
    if not addresses:
        raise PotluckError("no workers given: pass --nodes host:port,... or start `potluck worker`s")
    model_path = Path(model_path)
    costs = splittable_costs(model_path)
    zctx = zmq.Context()
    head_id = f"head-{os.urandom(8).hex()}"  # a name for the logs: ownership is proven by keys
    setup = PipelineSetup(
        model_path, keys, head_id, n_ctx, n_batch, n_seq_max, kv_unified, hidden_dtype, potluck_version,
        slice_cache or SliceCache(), progress, tuple(split) if split else None,
        measure_speed(n_threads or tail_threads(addresses) or default_threads()),
    )
    max_msg = max_result_bytes(n_batch, costs.n_embd)
    links = [NodeLink(zctx, keys, addr, max_msg) for addr in addresses]
    tail: HeadTail | None = None
    t0 = time.perf_counter()
    try:
        # a fixed list waits for every node only under --strict-nodes: a node down at start is
        # skipped as the same loss a second later would be recovered (unless --split names it)
        listed = not skip_failed_joins
        wait_all = listed and (strict_nodes or bool(split))
        joins = join_links(links, head_id, potluck_version, join_timeout_s, all_needed=wait_all)
        links = joins.joined  # join_links closed the others
        if joins.duplicates and listed:
            raise PotluckError("the same worker is listed twice in --nodes")
        if joins.first_error is not None and (wait_all or not links):
            raise joins.first_error
        skipped = dict(joins.failed) if listed else {}
        if skipped:
            for address, why in skipped.items():
                log.warning("skipped %s (%s); going on with %d of %d listed workers (--strict-nodes refuses "
                            "instead)", address, why, len(links), len(addresses))
        elif joins.failed:
            for address, why in joins.failed.items():
                log.info("skipped %s: %s", address, why)
            log.warning("skipped %d of %d advertised address(es) that did not prove to be workers of this "
                        "cluster (-v names them)", len(joins.failed), len(joins.failed) + len(links))
        if not links:
            raise PotluckError("none of the discovered workers could be joined (a different cluster token, "
                               "or not running); run with -v to see each address")
        ids = [lk.node_id for lk in links]
        if len(set(ids)) != len(ids):
            raise PotluckError("the same worker is listed twice in --nodes")
        t_joined = time.perf_counter()
        try:
            plan = plan_over(setup, links, split)
        except PotluckError as e:
            if not skipped:
                raise
            address, why = next(iter(skipped.items()))
            raise PotluckError(f"{address}, listed in --nodes, did not join ({why}), and the other workers "
                               f"cannot hold the model without it: {e}") from None
        if on_plan:
            on_plan(plan)
        by_id = {lk.node_id: lk for lk in links}
        used = [by_id[s.node.name] for s in plan.stages]
        for lk in links:
            if lk not in used:
                lk.close(release=True)
        links = used
        stats = TransferStats()
        t_planned = time.perf_counter()
        loaded = load_chain(setup, links, plan, stats)
        t_chained = time.perf_counter()
        tail_slice = setup.slice_cache.head_slice(model_path, head_zeroed_layers(costs))
        forget_parsed_headers()
        params = ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max,
                               n_threads=n_threads or tail_threads([lk.address for lk in links]),
                               kv_unified=kv_unified, follow_load=n_threads == 0)  # as a worker's stage (child.py)
        tail = HeadTail(tail_slice.path, plan.head, params)
        # where a load's time goes (a second load should be seconds: nothing sent, seals checked)
        log.info("chain ready in %.1f s: joins %.1f s, plan %.1f s, slices and stage loads %.1f s "
                 "(%.0f MB sent), own layers %.1f s", time.perf_counter() - t0, t_joined - t0,
                 t_planned - t_joined, t_chained - t_planned, stats.bytes_sent / 1e6, time.perf_counter() - t_chained)
        if loaded[-1].n_embd != tail.n_embd:
            raise NodeFailedError(
                f"{links[-1].describe()} loaded hidden states of width {loaded[-1].n_embd}; "
                f"the model has {tail.n_embd}"
            )
        return PipelineTarget(
            zctx,
            links,
            tail,
            n_vocab=costs.n_vocab,
            n_ctx=min(n_ctx, tail.n_ctx, *(ld.n_ctx for ld in loaded)),
            n_batch=n_batch,
            n_seq_max=n_seq_max,
            kv_unified=kv_unified,
            plan=plan,
            transfer=stats,
            stall_timeout_s=stall_timeout_s,
            setup=setup,
            recover=recover,
            head_fallback=head_fallback,
            candidates=candidates or (lambda: list(addresses)),
            exact=chain_exactness(loaded, tail.model.batch_exact),
        )
    except BaseException:
        for lk in links:
            lk.close(release=True)
        if tail is not None:
            tail.close()
        zctx.term()
        raise
