"""Trust between token holders (issue 20): no token holder can take another head's pipeline
traffic, point a stage at an endpoint it must not reach, or grow a worker's memory by
flooding it. Each test runs the real attack against real worker processes on loopback."""

from __future__ import annotations

import hashlib
import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from potluck.discovery.auth import keys_from_token
from potluck.discovery.lan import local_ipv4
from potluck.engine.cluster import wire
from potluck.engine.cluster.chain import HeadWorker
from potluck.engine.cluster.child import StageProcess, StageSpec
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.cluster.transport import check_next_stage, client_socket
from potluck.engine.core.errors import PotluckError
from potluck.engine.core.gguf_tools import slice_layers
from potluck.engine.core.jobs import DecodeJob, GroupCancelled
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.target import LocalTarget
from potluck.engine.lab.flood import FloodPlan, flood_process
from potluck.engine.lab.worker_kills import process_tree

from .cluster_support import TOKEN, WorkerProc, start_worker, start_workers, stop_worker

PROMPT = "<|im_start|>user\nName three rivers.<|im_end|>\n<|im_start|>assistant\n"
N_CTX = 512


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProc]]:
    """Two workers of this module's own: the attacks leave connections behind."""
    tmp = tmp_path_factory.mktemp("trust")
    workers = start_workers(tmp, ["t0", "t1"])
    yield workers
    for w in workers:
        stop_worker(w.proc)


def until_answers(sock: zmq.Socket) -> None:
    """Wait until ``sock``'s CURVE connection is up (a status request comes back)."""
    sock.send_multipart(wire.to_frames(wire.Status()))
    assert sock.poll(10000), "the worker never answered"
    sock.recv_multipart()



def _reply(sock: zmq.Socket) -> wire.WireMessage:
    """The next reply that is not an owner probe."""
    while True:
        assert sock.poll(10000), "the worker never answered"
        msg = wire.parse_frames(sock.recv_multipart())
        if not (isinstance(msg, wire.Pong) and msg.nonce == wire.PROBE_NONCE):
            return msg


def test_a_head_between_welcome_and_load_keeps_its_worker_until_it_goes(pair: list[WorkerProc]) -> None:
    """Issue 20, left over: another head's hello used to take a worker whose owner had been
    welcomed but had not loaded yet (planning, streaming its slice). Now the owner keeps it
    while it is connected and has spoken within the setup lease; once it is gone, the
    next head is welcomed."""
    keys = keys_from_token(TOKEN)
    ctx = zmq.Context()
    first, second = client_socket(ctx, keys), client_socket(ctx, keys)
    for sock in (first, second):
        sock.connect(f"tcp://{pair[1].address}")
    second_key = bytes.fromhex("bb" * 32)
    try:
        first.send_multipart(wire.to_frames(wire.Hello("head-a", "0", "aa" * 32)))
        assert isinstance(_reply(first), wire.Welcome)
        second.send_multipart(wire.to_frames(wire.Hello("head-b", "0", "bb" * 32)))
        refusal = _reply(second)
        assert isinstance(refusal, wire.Error) and refusal.code == "busy", refusal
        first.close(linger=0)  # the first head goes away without a word
        deadline = time.monotonic() + 15
        while True:  # the worker probes its owner at most once a second
            second.send_multipart(wire.to_frames(wire.Hello("head-b", "0", "bb" * 32)))
            reply = _reply(second)
            if isinstance(reply, wire.Welcome):
                break
            assert isinstance(reply, wire.Error) and reply.code == "busy", reply
            assert time.monotonic() < deadline, "the worker never let the next head in"
            time.sleep(0.3)
        second.send_multipart(wire.to_frames(wire.Release(), second_key))  # idle again for the next test
        second.send_multipart(wire.to_frames(wire.Status()))
        assert _reply(second).state == "idle"
    finally:
        first.close(linger=0)
        second.close(linger=0)
        ctx.destroy(linger=0)

def test_a_squatted_forwarder_identity_cannot_replace_a_heads_traffic(
    pair: list[WorkerProc], model: Model, model_path: Path, tmp_path: Path
) -> None:
    """The attack of issue 20: a second token holder connects to stage B under the routing id
    A's forwarder once used (``fwd-<A's public node id>``) before the victim builds A -> B, then
    sends B its own hidden states for the victim's first transaction. Before the fix, ZeroMQ
    kept the attacker's connection for that id, dropped A's, and the victim printed the
    attacker's junk without a warning. Now B takes only traffic signed with the key the
    victim's head gave it, whoever connects under whatever id."""
    a, b = pair
    keys = keys_from_token(TOKEN)
    ctx = zmq.Context()
    squatter = client_socket(ctx, keys, f"fwd-{a.node_id}".encode())
    squatter.connect(f"tcp://{b.address}")
    until_answers(squatter)
    target = open_pipeline(model_path, [a.address, b.address], keys, n_ctx=N_CTX, n_threads=1,
                           slice_cache=SliceCache(tmp_path), split=[0, 15, 30])
    local = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1))
    try:
        prompt = model.tokenize(PROMPT)
        job = DecodeJob.tokens(target.new_group(), prompt, 0)
        ticket = target.submit(job)
        n = len(prompt)
        junk = wire.Forward.from_job(1, DecodeJob(job.group, np.full((n, model.n_embd), 0.5, np.float32),
                                                  job.positions, job.seq_ids, job.outputs))
        squatter.send_multipart(wire.to_frames(junk))  # unsigned: all a token holder can send
        got = target.wait(ticket)
        assert np.array_equal(got, local.decode(prompt)), "the victim's logits are not its own"
        assert squatter.poll(10000), "the squatter was not told"
        refusal = wire.parse_frames(squatter.recv_multipart())
        assert isinstance(refusal, wire.Error) and "not signed by this stage's upstream" in refusal.message
        for i, tok in enumerate((7, 11)):  # the victim goes on, exact
            more = target.submit(DecodeJob.tokens(job.group, [tok], n + i))
            assert np.array_equal(local.decode([tok]), target.wait(more))
    finally:
        squatter.close(linger=0)
        ctx.destroy(linger=0)
        local.close()
        target.close()


def test_a_busy_worker_does_not_name_its_owner_and_the_heads_links_choose_no_routing_id(
    pair: list[WorkerProc], model_path: Path, tmp_path: Path
) -> None:
    """A head's connections carry no routing id of its choosing (the worker names them), so
    there is nothing to squat when it reconnects; a busy worker tells nobody who owns it."""
    keys = keys_from_token(TOKEN)
    target = open_pipeline(model_path, [pair[0].address], keys, n_ctx=N_CTX, n_threads=1,
                           slice_cache=SliceCache(tmp_path))
    ctx = zmq.Context()
    other = client_socket(ctx, keys)
    other.connect(f"tcp://{pair[0].address}")
    try:
        assert target.links[0].sock.getsockopt(zmq.ROUTING_ID) == b""
        other.send_multipart(wire.to_frames(wire.Hello("head-other", "0", "77" * 32)))
        assert other.poll(10000)
        refusal = wire.parse_frames(other.recv_multipart())
        assert isinstance(refusal, wire.Error) and refusal.code == "busy"
        assert "head-" not in refusal.message and "another head" in refusal.message
        # its requests signed with its own key stay refused: only the owner's key counts
        other.send_multipart(wire.to_frames(wire.Release(), bytes.fromhex("77" * 32)))
        assert other.poll(10000)
        refusal = wire.parse_frames(other.recv_multipart())
        assert isinstance(refusal, wire.Error) and refusal.code == "busy"
        assert target.decode([1, 2, 3]).shape == (1, target.n_vocab)  # the owner is still served
    finally:
        other.close(linger=0)
        ctx.destroy(linger=0)
        target.close()


def rss_kb(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory now, in kB (``VmHWM``: its peak so far)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


# Issue 39 item 6: token holders flooding as real attackers would. One never reads its replies
# and claims routing ids of its own; the other shares one routing id over all its connections
# (libzmq kept such a connection aside, unread: +340 MB in 20 s) and reads slowly.
FLOODERS = (
    FloodPlan(4, 10.0, ("ping", "pad", "status", "hello", "junk", "forward"), idents="own", reads="never"),
    FloodPlan(4, 10.0, ("ping", "status", "junk"), idents="shared", reads="slow"),
)


def tree_rss_kb(pid: int) -> int:
    """Resident memory of a worker and its stage process, in kB."""
    return sum(rss_kb(p) for p in process_tree(pid))


def test_floods_from_several_token_holders_are_dropped_and_the_owner_is_served(
    tmp_path: Path, model: Model, model_path: Path
) -> None:
    """Two token holders (processes of their own) flood a worker for 10 s: several message
    kinds, routing ids of their own or one shared id, never reading or reading slowly. The
    worker drains its socket, serves its owner first and drops what the flooders' budgets do
    not allow, unread (its log counts them); its memory stays within the issue's 200 MB and
    goes back afterwards. The owner's decoding stays exact meanwhile; its speed, and the
    figures, are scripts/flood_worker.py's business."""
    keys = keys_from_token(TOKEN)
    w = start_worker(tmp_path, "flooded")
    target = open_pipeline(model_path, [w.address], keys, n_ctx=N_CTX, n_threads=1,
                           slice_cache=SliceCache(tmp_path / "cache"))
    local = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1))
    flooders: list[subprocess.Popen] = []
    try:
        prompt = model.tokenize(PROMPT)
        assert np.array_equal(local.decode(prompt), target.decode(prompt))
        before_kb = tree_rss_kb(w.proc.pid)
        for plan in FLOODERS:
            args, env = flood_process(w.address, plan, keys)
            flooders.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, text=True))
        samples_kb: list[int] = []
        tok = 7
        while any(f.poll() is None for f in flooders):  # the owner decodes all through the flood
            logits = target.decode([tok])
            assert np.array_equal(logits, local.decode([tok]))
            tok = int(np.argmax(logits[0]))
            if target.n_past >= N_CTX - 8:
                for t in (local, target):
                    t.truncate(len(prompt))
            samples_kb.append(tree_rss_kb(w.proc.pid))
        sent = [int(f.communicate(timeout=30)[0].strip() or 0) for f in flooders]
        assert all(sent) and w.alive(), sent
        dropped = [line for line in w.log().splitlines() if "past their budget" in line]
        assert dropped, "no flood message was dropped: the path did not run"
        # Issue 39's goal: within +200 MB of idle (scripts/flood_worker.py measures the figures)
        peak_kb = max(samples_kb)
        assert peak_kb - before_kb < 200 * 1024, (before_kb, peak_kb, sent)
        deadline = time.monotonic() + 30
        while tree_rss_kb(w.proc.pid) - before_kb > 100 * 1024:  # and it is given back afterwards
            assert time.monotonic() < deadline, (before_kb, tree_rss_kb(w.proc.pid))
            time.sleep(0.5)
        for tok in (7, 11, 13):  # the owner goes on, exact
            assert np.array_equal(local.decode([tok]), target.decode([tok]))
    finally:
        for f in flooders:
            if f.poll() is None:
                f.kill()
        local.close()
        target.close()
        stop_worker(w.proc)


def test_a_stage_process_answers_status_and_cancel_beside_a_running_batch(model_path: Path, tmp_path: Path) -> None:
    """The stage process computes on the thread that reads its work, so status requests and
    cancels travel on a second pipe: both must reach it while a long batch runs."""
    path = slice_layers(model_path, tmp_path / "s.gguf", 0, 15)
    proc = StageProcess()
    try:
        proc.load(StageSpec(str(path), hashlib.sha256(path.read_bytes()).hexdigest(), True, 2048, 512, 1, True, 1), 300)
        fut = proc.submit("job", DecodeJob.tokens(7, np.arange(512) % 900 + 20, 0, outputs="all"))
        deadline = time.monotonic() + 60
        st = proc.status()
        while st.running != 7 and not fut.done() and time.monotonic() < deadline:
            st = proc.status()
        assert st.running == 7 and not fut.done()  # answered while the batch computes
        proc.cancel(7)
        while not fut.done() and time.monotonic() < deadline:
            if select.select([proc.fileno()], [], [], 0.1)[0]:
                proc.take_replies()
        with pytest.raises(GroupCancelled):
            fut.result()
        after = proc.status()
        assert after.aborted == 1 and after.finished == 0  # stopped mid-compute, not skipped
    finally:
        proc.close()


def test_a_stage_released_while_its_process_is_slow_to_exit_is_not_reported_lost(
    model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After a normal release a worker logged "the stage process stopped answering; the stage
    is lost": the child was still freeing its model when its pipe closed, so it had no exit
    code yet (and one slower than 2 s is killed). A stopped child stands in for a slow one."""
    path = slice_layers(model_path, tmp_path / "s.gguf", 0, 15)
    proc = StageProcess()
    proc.load(StageSpec(str(path), hashlib.sha256(path.read_bytes()).hexdigest(), True, 256, 32, 1, True, 1), 300)
    os.kill(proc.proc.pid, signal.SIGSTOP)  # it cannot exit within close()'s wait: close() kills it
    # ... once every thread has stopped: a thread that reached the end of its pipe first would
    # exit at once (the child ends when its pipes do), and the stop would come too late
    tasks = Path(f"/proc/{proc.proc.pid}/task")
    deadline = time.monotonic() + 30
    while any((t / "stat").read_text().rsplit(")", 1)[1].split()[0] != "T" for t in tasks.iterdir()):
        assert time.monotonic() < deadline, "the stage process did not stop"
        time.sleep(0.01)
    with caplog.at_level("ERROR", logger="potluck.engine.cluster.child"):
        proc.close()
    assert proc.proc.returncode == -signal.SIGKILL  # the slow exit path ran
    assert proc.crashed is None and not [r for r in caplog.records if "lost" in r.message]


@pytest.mark.parametrize(
    ("next_addr", "head_here", "why"),
    [
        ("inproc://zeromq.zap.01", True, "only tcp://host:port"),
        ("ipc:///tmp/anything", True, "only tcp://host:port"),
        ("tcp://10.0.0.7", True, "only tcp://host:port"),
        ("tcp://10.0.0.7:0", True, "only tcp://host:port"),
        ("tcp://10.0.0.7:80 ", True, "only tcp://host:port"),
        ("tcp://127.0.0.1:6000", False, "only from a head on this machine"),
        ("tcp://localhost:6000", False, "only from a head on this machine"),
        ("tcp://0.0.0.0:6000", False, "only from a head on this machine"),
        ("tcp://[::1]:6000", False, "only from a head on this machine"),
        ("tcp://[::]:6000", False, "only from a head on this machine"),
        ("tcp://127.0.0.1:5555", True, "this worker itself"),
        # issue 39: loopback by another name, each as libzmq's resolver reads it
        ("tcp://127.1:6000", False, r"resolves to 127\.0\.0\.1\): an address of this machine"),
        ("tcp://0:6000", False, r"resolves to 0\.0\.0\.0\): an address of this machine"),
        ("tcp://2130706433:6000", False, r"resolves to 127\.0\.0\.1\)"),
        ("tcp://0x7f000001:6000", False, r"resolves to 127\.0\.0\.1\)"),
        ("tcp://017700000001:6000", False, r"resolves to 127\.0\.0\.1\)"),
        ("tcp://0.1.2.3:6000", False, "only from a head on this machine"),
        ("tcp://[::ffff:127.0.0.1]:6000", False, "only from a head on this machine"),
        ("tcp://127.1:5555", True, "this worker itself"),
        ("tcp://0x7f000001:5555", True, "this worker itself"),
    ],
)
def test_next_stage_addresses_a_worker_refuses(next_addr: str, head_here: bool, why: str) -> None:
    with pytest.raises(PotluckError, match=why):
        check_next_stage(next_addr, 5555, head_here)


def test_next_stage_names_are_resolved_and_checked_as_connected() -> None:
    """Issue 39: names that resolve to this machine pass no more: `localhost.`, this
    machine's own host name, its interface addresses, and a name resolving to any of them.
    The worker connects to the address literal it checked, never to the name again."""
    host = socket.gethostname()
    refused = ["localhost.", host, f"{host}.", *local_ipv4()]
    for name in refused:
        with pytest.raises(PotluckError, match="refused"):
            check_next_stage(f"tcp://{name}:6000", 5555, False)
    # a name of the LAN, as the resolver answers it
    lan = {"worker-2.lan": ["10.0.0.7"], "sneaky.lan": ["10.0.0.8", "127.0.0.1"], "v6.lan": ["fd00::7"]}
    resolve = lambda name, port: lan[name]  # noqa: E731
    assert check_next_stage("tcp://worker-2.lan:6000", 5555, False, resolve) == "tcp://10.0.0.7:6000"
    assert check_next_stage("tcp://v6.lan:6000", 5555, False, resolve) == "tcp://[fd00::7]:6000"
    with pytest.raises(PotluckError, match=r"resolves to 127\.0\.0\.1"):  # any answer on this machine refuses
        check_next_stage("tcp://sneaky.lan:6000", 5555, False, resolve)
    with pytest.raises(PotluckError, match="does not resolve"):
        check_next_stage("tcp://no-such-host.invalid:6000", 5555, False)
    assert check_next_stage("tcp://[::ffff:10.0.0.7]:6000", 5555, False) == "tcp://10.0.0.7:6000"


def test_next_stage_addresses_a_worker_takes() -> None:
    assert check_next_stage("tcp://10.0.0.7:5555", 5555, False) == "tcp://10.0.0.7:5555"  # another machine
    assert check_next_stage("tcp://127.0.0.1:6000", 5555, True) == "tcp://127.0.0.1:6000"  # a head here
    assert check_next_stage("tcp://127.1:6000", 5555, True) == "tcp://127.0.0.1:6000"  # its loopback workers


def test_a_load_naming_a_forbidden_next_stage_is_refused_by_a_real_worker(pair: list[WorkerProc]) -> None:
    """A token holder that owns a worker (its hello's key signs its load) still cannot point
    its stage at the worker's own ZAP endpoint, an ipc socket or the worker itself."""
    keys = keys_from_token(TOKEN)
    key = "5a" * 32
    ctx = zmq.Context()
    head = client_socket(ctx, keys)
    head.connect(f"tcp://{pair[1].address}")

    def ask(msg: wire.WireMessage) -> wire.WireMessage:
        head.send_multipart(wire.to_frames(msg, bytes.fromhex(key)))
        while True:
            assert head.poll(10000), "no reply"
            reply = wire.parse_frames(head.recv_multipart())
            if not (isinstance(reply, wire.Pong) and reply.nonce == wire.PROBE_NONCE):
                return reply

    try:
        assert isinstance(ask(wire.Hello("head-x", "0", key)), wire.Welcome)
        port = pair[1].address.rsplit(":", 1)[1]
        itself = (f"tcp://{host}:{port}" for host in ("127.0.0.1", "127.1", "0x7f000001", "0", socket.gethostname()))
        for bad in ("inproc://zeromq.zap.01", "ipc:///tmp/potluck-x", *itself):
            load = wire.Load("ab" * 32, 0, 2, True, False, 64, 8, 1, True, "f32", bad, "cd" * 32, "ef" * 32)
            reply = ask(load)
            assert isinstance(reply, wire.Error) and "next-stage address" in reply.message, (bad, reply)
        head.send_multipart(wire.to_frames(wire.Release(), bytes.fromhex(key)))
    finally:
        head.close(linger=100)
        ctx.destroy(linger=0)


def test_the_heads_own_worker_is_reached_at_the_heads_address_on_a_stages_network(tmp_path: Path) -> None:
    """Recovery's fallback worker listens on every interface: the head joins it on loopback, a
    stage on this machine forwards to it on loopback, and a stage elsewhere at this machine's
    address on the route to that stage (before, 127.0.0.1 for everyone, which a stage on
    another machine would take as its own loopback)."""
    hw = HeadWorker(keys_from_token(TOKEN), tmp_path / "hw")
    try:
        assert hw.worker.bind == "0.0.0.0" and hw.address.startswith("127.0.0.1:")
        assert hw.address_seen_from("127.0.0.1:7000") == hw.address
        try:
            remote = hw.address_seen_from("192.0.2.10:7000")  # TEST-NET-1: routed, never reached
        except PotluckError:
            pytest.skip("no route off this machine to compare with")
        host, port = remote.rsplit(":", 1)
        assert int(port) == hw.worker.port and not host.startswith("127.")
        assert hw.address_seen_from(f"{host}:7000") == hw.address  # this machine's own address
    finally:
        hw.close()


def test_connections_past_the_bound_are_refused_at_the_handshake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every connection costs a worker about 40 kB of libzmq buffers and a queue of replies, so
    a token holder opening thousands grew it without bound. Past its bound (1,500, lowered
    here) a worker refuses handshakes with ZAP status 300 (temporary): counted, and a head
    says it may be that (libzmq shows the client no reason); once the flood closes,
    connections are taken again."""
    from potluck.engine.cluster import worker as worker_module
    from potluck.engine.cluster.link import NodeLink, NodeLostError
    from potluck.engine.cluster.profile import NodeProfile
    from potluck.engine.cluster.transport import established_by_peer

    monkeypatch.setattr(worker_module, "MAX_CONNECTIONS", 20)
    keys = keys_from_token(TOKEN)
    w = worker_module.Worker(keys, NodeProfile("gated", 2, 1000, 1.0), tmp_path / "cache", bind="127.0.0.1")
    serving = threading.Thread(target=w.serve_forever, daemon=True)
    serving.start()
    ctx = zmq.Context()  # the flooder's
    head_ctx = zmq.Context()  # a head's, apart as another process's would be: after 40 refused
    # handshakes the flooder's own I/O thread was seen to leave a new connection unserved
    flood = []
    try:
        for _ in range(40):
            s = client_socket(ctx, keys)
            s.connect(f"tcp://127.0.0.1:{w.port}")
            flood.append(s)
        deadline = time.monotonic() + 30
        while w.gate.refused == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert w.gate.refused > 0  # the path ran: handshakes refused past the bound
        link = NodeLink(head_ctx, keys, f"127.0.0.1:{w.port}")
        with pytest.raises(NodeLostError, match="or it takes no more connections now"):
            link.join("head-late", "0", timeout_s=3)
        link.close(release=False)
        for s in flood:
            s.close(linger=0)
        flood.clear()
        # the flood gone from the kernel's table (what the gate counts; with 20 of it left the next
        # connection would be the 21st), a connection is taken again
        deadline = time.monotonic() + 60
        while sum((established_by_peer(w.port) or {}).values()) > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        # A head tries again, as it does when a join goes unanswered: under load about one first
        # connection in ten right after the flood was closed by the worker before its handshake
        # ended, with the gate reading the table at every handshake as well (docs/facts.md §35)
        pongs = []
        for _ in range(3):
            late = client_socket(head_ctx, keys)
            late.setsockopt(zmq.SNDTIMEO, 10000)  # a refused handshake fails the test, never hangs it
            late.connect(f"tcp://127.0.0.1:{w.port}")
            try:
                late.send_multipart(wire.to_frames(wire.Ping(5)))
                if late.poll(10000):
                    pongs.append(wire.parse_frames(late.recv_multipart()))
            except zmq.Again:
                pass
            late.close(linger=0)
            if pongs:
                break
        assert pongs == [wire.Pong(5)], (
            f"no pong once the flood closed: the gate refused {w.gate.refused} handshake(s) and read the "
            f"kernel's table {w.gate.scans} time(s); the table shows {established_by_peer(w.port)}")
    finally:
        ctx.destroy(linger=0)  # every socket of the test's, whatever failed
        head_ctx.destroy(linger=0)
        w.stop()
        serving.join(10)


def test_the_gate_reads_the_kernel_table_once_an_interval_and_counts_what_it_admits() -> None:
    """The table lists every TCP socket of the machine (60 ms to read with 6,000), and the gate
    runs at every handshake, before any key is checked: it reads it again once ``rescan_s`` has
    passed, and in between counts each handshake it admits, so a burst is held to the bounds
    without a reading each."""
    from potluck.engine.cluster.transport import ConnectionGate

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    accepted = [server.accept()[0] for _ in clients]
    now = [0.0]
    try:
        gate = ConnectionGate(port, total=5, per_peer=1, rescan_s=1.0, clock=lambda: now[0])
        burst = [gate.admit("127.0.0.1") for _ in range(6)]  # 3 open: 3 more fit under "past 5"
        assert burst[:3] == ["", "", ""] and all("connections open (at most 5)" in why for why in burst[3:]), burst
        assert gate.scans == 1 and gate.refused == 3
        now[0] = 1.0  # the interval passed: read again, and the 3 connections really open fit
        assert gate.admit("127.0.0.1") == "" and gate.scans == 2

        apart = ConnectionGate(port, total=100, per_peer=1, rescan_s=1.0, clock=lambda: now[0])
        # one address other than loopback: its handshakes count, IPv4-mapped or not
        assert [apart.admit(a) for a in ("10.1.2.3", "::ffff:10.1.2.3")] == ["", ""]
        assert "2 connections from 10.1.2.3 (at most 1" in apart.admit("10.1.2.3")
        assert apart.scans == 1
    finally:
        for s in clients + accepted + [server]:
            s.close()


def test_a_hello_dropped_unread_is_said_again() -> None:
    """A worker under a flood drops a stranger's message unread once the second's budget is
    spent (inbox.py), a joining head's hello too: the head says it again, and the first answer
    is taken."""
    from potluck.engine.cluster.link import NodeLink
    from potluck.engine.cluster.transport import server_socket

    keys = keys_from_token(TOKEN)
    ctx = zmq.Context()
    server = server_socket(ctx, keys, max_msg_bytes=wire.DEFAULT_MAX_BYTES)
    port = server.bind_to_random_port("tcp://127.0.0.1")
    hellos: list[wire.WireMessage] = []

    def worker_that_drops_the_first_hello() -> None:
        while len(hellos) < 2 and server.poll(20_000):
            ident, *frames = server.recv_multipart()
            hellos.append(wire.parse_frames(frames))
            if len(hellos) == 2:
                welcome = wire.Welcome("flooded", "0", 2, 1000, 1.0, "idle", wire.DEFAULT_MAX_BYTES)
                server.send_multipart([ident, *wire.to_frames(welcome)])

    thread = threading.Thread(target=worker_that_drops_the_first_hello)
    thread.start()
    link = NodeLink(ctx, keys, f"127.0.0.1:{port}")
    try:
        welcome = link.join("head-patient", "0", timeout_s=20)
    finally:
        thread.join()
        link.close(release=False)
        ctx.destroy(linger=0)
    assert welcome.node_id == "flooded" and link.hellos_repeated == 1
    assert [type(h) for h in hellos] == [wire.Hello, wire.Hello]
