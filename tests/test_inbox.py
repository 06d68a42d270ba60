"""The worker's inbox over real ZeroMQ sockets: peers past their budget are dropped unread,
the owner's and the upstream's connections never are, and a dropped message is whole."""

from __future__ import annotations

import time

import zmq

from potluck.engine.cluster import inbox


def _router_with_backlog(ctx: zmq.Context, per_peer: int, peers: int) -> tuple[zmq.Socket, list[zmq.Socket]]:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVHWM, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealers = []
    for p in range(peers):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.SNDHWM, 0)
        d.setsockopt(zmq.ROUTING_ID, b"peer-%d" % p)
        d.connect(f"tcp://127.0.0.1:{port}")
        dealers.append(d)
    for d in dealers:
        for i in range(per_peer):
            d.send_multipart([b"frame-a", b"%d" % i])  # two frames: a drop must take both
    deadline = time.monotonic() + 30
    while router.getsockopt(zmq.EVENTS) & zmq.POLLIN == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.5)  # let the I/O thread queue the rest
    return router, dealers


def test_skim_drops_peers_past_their_budget_and_never_the_trusted() -> None:
    ctx = zmq.Context()
    per_peer = inbox.PEER_MESSAGES * 4
    router, dealers = _router_with_backlog(ctx, per_peer, 3)
    budget = inbox.PeerBudget()
    budget.metering = True
    budget.trust(b"peer-0")  # the owner, say
    served: dict[bytes, list[int]] = {}
    deadline = time.monotonic() + 30
    while sum(map(len, served.values())) + budget.dropped < 3 * per_peer:
        assert time.monotonic() < deadline, (budget.dropped, {k: len(v) for k, v in served.items()})
        got = budget.skim(router, lambda: None)
        if got is None:
            continue
        ident, slot = got
        frames = router.recv_multipart()
        assert frames[0] == b"frame-a", "a dropped message left frames behind"
        budget.spend(slot, sum(map(len, frames)))
        served.setdefault(ident, []).append(int(frames[1]))
    try:
        assert served[b"peer-0"] == list(range(per_peer))  # the trusted peer: all, in order
        for p in (b"peer-1", b"peer-2"):  # the others: their budget's worth, the first ones
            assert served[p] == list(range(inbox.PEER_MESSAGES))
        assert budget.dropped == 2 * (per_peer - inbox.PEER_MESSAGES)
        assert budget.skim(router, lambda: None) is None
    finally:
        for s in (router, *dealers):
            s.close(linger=0)
        ctx.destroy(linger=0)


def test_a_new_window_lifts_the_budget_and_the_metering() -> None:
    ctx = zmq.Context()
    now = [0.0]
    router, dealers = _router_with_backlog(ctx, inbox.PEER_MESSAGES * 2, 1)
    budget = inbox.PeerBudget(clock=lambda: now[0])
    budget.new_pass()
    budget.metering = True
    try:
        for _ in range(inbox.PEER_MESSAGES):
            got = budget.skim(router, lambda: None)
            assert got is not None
            budget.spend(got[1], len(b"".join(router.recv_multipart())))
        for d in dealers:  # more after the window's budget is spent
            for _ in range(10):
                d.send_multipart([b"frame-a", b"late"])
        now[0] += inbox.WINDOW_S  # a second later: a new window, nobody metered until a backlog
        budget.new_pass()
        assert not budget.metering
        budget.metering = True  # a backlog again: the peer has a whole budget
        got = budget.skim(router, lambda: None)
        assert got is not None and budget.dropped == 0
        assert budget.spend(got[1], 1), "its first message of the window"
    finally:
        for s in (router, *dealers):
            s.close(linger=0)
        ctx.destroy(linger=0)


def test_untrusted_peers_time_never_cuts_the_owner_off() -> None:
    """A flood that took the window's serving time leaves untrusted peers nothing more, yet the
    owner's requests are still served; the owner's own requests past that time cut it off."""
    budget = inbox.PeerBudget(clock=lambda: 0.0)
    budget.metering = True
    ping = [b"", b'{"type":"ping"}']
    budget.served(inbox.WINDOW_SERVE_S * 2)  # untrusted peers' messages
    assert budget.spent and budget.trusted_request(b"owner", ping) and budget.cut_offs == 0
    budget.served(inbox.WINDOW_SERVE_S, trusted=True)  # the owner's own
    assert not budget.trusted_request(b"owner", ping) and budget.cut_offs == 1
