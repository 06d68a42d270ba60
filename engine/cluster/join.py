"""Joining many workers at once: :func:`join_links`.

Each address is a candidate and the join is its proof: only a worker holding the cluster
token completes the CURVE handshake, and its welcome names its node id. Under ``--nodes
auto`` the addresses come from unauthenticated zeroconf records, so anyone on the LAN can add
candidates (clones of a real worker's record, junk at dead addresses). They are all tried at
once under one deadline, so junk costs one deadline instead of one each (ten junk records
used to take 54.5 s); a candidate that never proves itself displaces and hides nothing.

When to stop waiting: when every candidate has settled (welcomed, refused, failed), or, once
one worker has joined and :data:`MIN_WAIT_S` has passed, when none of the ones left holds a
connection that may still become a worker's: a worker that is up accepts the TCP connection
at once, dead addresses (a stale record, an address of another network, junk) never do, and
a host that takes it but is no worker of this cluster has it dropped before CURVE completes
(a worker of another cluster refuses the handshake; a silent host is cut at the handshake
timeout, 2 s). A connected candidate still in its handshake is waited for until the
deadline. Candidates left early finish in their own thread, which closes them at their
deadline, or at once when the pipeline closes its ZeroMQ context (ContextTerminated).

A welcomed link is timed (round trip and bandwidth, :meth:`.NodeLink.measure`) before it
counts as joined: the planner counts each hop's time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq

from .link import NodeFailedError, NodeLink, SameNodeError

log = logging.getLogger(__name__)

MIN_WAIT_S = 1.0  # past a lost SYN's first retransmission (1 s): a live worker has connected by then
POLL_S = 0.02
MEASURE_MIN_S = 5.0  # a worker welcomed just before the deadline still has its link timed


@dataclass
class JoinResult:
    """The candidates that proved to be workers (in the order given, one link per node) and
    why the others did not (address -> reason)."""

    joined: list[NodeLink] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    first_error: NodeFailedError | None = None  # in the order given: what a fixed --nodes list reports
    duplicates: dict[str, str] = field(default_factory=dict)  # address -> node id joined at an earlier address


class _Attempts:
    """The join threads' shared record (guarded by ``lock``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.errors: dict[NodeLink, NodeFailedError | None] = {}  # settled links; None: welcomed
        self.abandoned: set[NodeLink] = set()


def join_links(
    links: Sequence[NodeLink], head_id: str, version: str, timeout_s: float, *, all_needed: bool
) -> JoinResult:
    """Say hello to every link at once; returns within ``timeout_s`` (plus a reply's grace).

    ``all_needed`` (a fixed ``--nodes`` list): wait for every link; a failure is reported in
    ``first_error``. Otherwise (candidates) stop early as the module says; links that proved
    the same node id as an earlier one are closed (one link per worker)."""
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    attempts = _Attempts()

    def attempt(link: NodeLink) -> None:
        err: NodeFailedError | None = None

        def ours(node_id: str) -> bool:  # welcomed through another of these links
            with attempts.lock:
                return any(e is None and lk.node_id == node_id for lk, e in attempts.errors.items())

        try:
            link.join(head_id, version, max(0.0, deadline - time.monotonic()), ours)
            link.measure(max(MEASURE_MIN_S, deadline - time.monotonic()))  # before it counts as joined
        except NodeFailedError as e:
            err = e
        except zmq.ZMQError as e:  # ContextTerminated: the pipeline closed while we were left waiting
            err = NodeFailedError(f"{link.describe()}: {e}")
        with attempts.lock:
            abandoned = link in attempts.abandoned
            if not abandoned:
                attempts.errors[link] = err
        if abandoned:  # the caller moved on: this link is ours to close (else the context's term waits)
            link.close(release=link.welcome is not None)

    for i, link in enumerate(links):
        threading.Thread(target=attempt, args=(link,), name=f"potluck-join-{i}", daemon=True).start()
    while True:
        with attempts.lock:
            pending = [lk for lk in links if lk not in attempts.errors]
            welcomed = any(err is None for err in attempts.errors.values())
            early = (
                not all_needed and welcomed and time.monotonic() - started >= MIN_WAIT_S
                and not any(lk.reachable for lk in pending)
            )
            if not pending or early:
                attempts.abandoned.update(pending)
                errors = dict(attempts.errors)
                break
        time.sleep(POLL_S)
    result = JoinResult()
    seen: set[str] = set()
    for link in links:
        if link not in errors:
            result.failed[link.address] = (
                "no worker of this cluster there (no connection, or dropped before the handshake completed)"
            )
            continue
        err = errors[link]
        if isinstance(err, SameNodeError):
            result.duplicates[link.address] = err.node_id
        if err is not None:
            result.failed[link.address] = str(err)
            result.first_error = result.first_error or err
        elif link.node_id in seen and not all_needed:
            result.failed[link.address] = f"another address of node {link.node_id}"
            result.duplicates[link.address] = link.node_id
            link.close(release=False)  # the worker's session is the first link's
        else:
            seen.add(link.node_id)
            result.joined.append(link)
    for link in links:
        if link in errors and errors[link] is not None:
            link.close(release=False)
    log.info("joined %d of %d candidate(s) in %.1f s", len(result.joined), len(links), time.monotonic() - started)
    return result
