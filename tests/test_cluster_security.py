"""Security: only token holders join or send work; a worker fed >= 1000 malformed, oversized
or random messages stays up, unchanged, and then serves a valid head exactly."""

from __future__ import annotations

import json
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from potluck.discovery.auth import keys_from_token
from potluck.engine.cluster import wire
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.cluster.transport import client_socket
from potluck.engine.core.errors import PotluckError
from potluck.engine.core.jobs import DecodeJob
from potluck.engine.core.kv import KV_OPS
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.target import LocalTarget

from .cluster_support import TOKEN, WorkerProc, start_worker, stop_worker
from .test_wire import mutate, samples

MAX_MSG_MB = 6
# Requests any token holder may make that change a worker's state on purpose.
LEGIT_REQUESTS = {"hello", "release", "cancel", "load", "offer", "chunk"}


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProc]:
    w = start_worker(tmp_path_factory.mktemp("sec"), "w", extra_args=["--max-message-mb", str(MAX_MSG_MB)])
    yield w
    stop_worker(w.proc)


def test_head_without_the_token_cannot_join(worker: WorkerProc, model_path: Path, tmp_path: Path) -> None:
    wrong = keys_from_token("potluck-another-cluster-Q7vX2mLp9RkT4wZc")
    t0 = time.monotonic()
    with pytest.raises(PotluckError, match="refused our CURVE handshake: started with a different cluster token"):
        open_pipeline(model_path, [worker.address], wrong, slice_cache=SliceCache(tmp_path), join_timeout_s=2)
    assert time.monotonic() - t0 < 10
    # A client with the right server key but its own key pair is refused by the ZAP check.
    ctx = zmq.Context()
    try:
        right = keys_from_token(TOKEN)
        pub, sec = zmq.curve_keypair()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = right.server_public, pub, sec
        sock.connect(f"tcp://{worker.address}")
        sock.send_multipart(wire.to_frames(wire.Status()))
        assert not sock.poll(1500), "a client key not derived from the token got an answer"
        # Plain (unencrypted) ZeroMQ gets nothing either.
        plain = ctx.socket(zmq.DEALER)
        plain.setsockopt(zmq.LINGER, 0)
        plain.connect(f"tcp://{worker.address}")
        plain.send_multipart(wire.to_frames(wire.Status()))
        assert not plain.poll(1000)
        sock.close()
        plain.close()
    finally:
        ctx.destroy(linger=0)
    deadline = time.monotonic() + 5
    while "refused" not in worker.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "refused" in worker.log()
    assert worker.alive()


def fuzz_cases(rng: random.Random) -> Iterator[list[bytes]]:
    """Malformed frames, shape/size lies and well-formed but invalid transactions."""
    valid = [[bytes(f) for f in wire.to_frames(m)] for m in samples()]
    produced = 0
    while produced < 900:
        frames = mutate(rng, rng.choice(valid))
        try:
            if wire.parse_frames(frames).TYPE in LEGIT_REQUESTS:
                continue  # a mutation that left a well-formed request: not a malformed case
        except wire.WireError:
            pass
        if frames:
            produced += 1
            yield frames
    # Well-formed messages that a serving stage must refuse (wrong txn, bad shapes, ids).
    for _ in range(100):
        n = rng.randint(1, 8)
        pos = np.arange(n, dtype=np.int32) + rng.choice([0, 10**6])
        inputs = rng.choice([
            np.full(n, rng.choice([-5, 10**7, 3]), dtype=np.int32),
            np.zeros((n, 7), dtype=np.float32),
        ])
        seq = np.full(n, rng.choice([0, 300]), dtype=np.int32)
        msg = wire.Forward.from_job(rng.choice([1, 2, 10**6]), DecodeJob(0, inputs, pos, seq, np.ones(n, bool)))
        yield [bytes(f) for f in wire.to_frames(msg)]
        kv = wire.KvApply(rng.choice([1, 2, 50]), 0, rng.choice(KV_OPS), rng.choice([0, 5, 255]), 3, 0, -1, 1)
        yield [bytes(f) for f in wire.to_frames(kv)]
    for name in ("load", "chunk"):
        header = {"type": name, "f": {}, "a": []}
        yield [wire.MAGIC, json.dumps(header).encode()]
    yield [bytes(f) for f in wire.to_frames(wire.Chunk("cd" * 32, 0, 100, np.zeros(10, np.uint8)))]
    load = wire.Load("ef" * 32, 0, 2, True, True, 64, 8, 1, True, "f32", "", "cd" * 32, "")
    yield [bytes(f) for f in wire.to_frames(load)]


def status(sock: zmq.Socket) -> tuple:
    sock.send_multipart(wire.to_frames(wire.Status()))
    assert sock.poll(5000)
    reply = wire.parse_frames(sock.recv_multipart())
    assert isinstance(reply, wire.StatusReply)
    return reply.state, reply.sha256, reply.layer_lo, reply.layer_hi, reply.txn, tuple(reply.pos_max), reply.finished


def test_fuzzed_worker_stays_up_unchanged_and_serves_a_valid_head(
    worker: WorkerProc, model: Model, model_path: Path, tmp_path: Path
) -> None:
    keys = keys_from_token(TOKEN)
    target = open_pipeline(model_path, [worker.address], keys, n_ctx=512, slice_cache=SliceCache(tmp_path))
    local = LocalTarget(model, ContextParams(n_ctx=512, n_threads=1))
    ctx = zmq.Context()
    fuzzer = client_socket(ctx, keys, b"fuzzer")
    try:
        prompt = model.tokenize("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")
        assert np.array_equal(local.decode(prompt), target.decode(prompt))
        fuzzer.connect(f"tcp://{worker.address}")
        before = status(fuzzer)
        assert before[0] == "loaded" and before[4] == 1 and before[5][0] == len(prompt) - 1

        rng = random.Random(5)
        sent = refused = 0
        for frames in fuzz_cases(rng):
            fuzzer.send_multipart(frames)
            sent += 1
            assert fuzzer.poll(5000), f"no answer to fuzz case {sent}"
            reply = wire.parse_frames(fuzzer.recv_multipart())
            refused += isinstance(reply, wire.Error)
        assert sent >= 1000 and refused >= sent - 60  # the rest: harmless valid queries (ping, status)

        # Raw TCP garbage and a message over the size limit (libzmq drops those connections).
        host, port = worker.address.split(":")
        for i in range(40):  # odd: random bytes; even: a ZMTP greeting start, then junk
            junk = rng.randbytes(rng.randint(1, 4096)) if i % 2 else b"\xff" + b"\0" * 8 + b"\x7f" + b"junk" * 50
            with socket.create_connection((host, int(port))) as s:
                s.sendall(junk)
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        for opt, val in (("curve_serverkey", keys.server_public), ("curve_publickey", keys.client_public),
                         ("curve_secretkey", keys.client_secret)):
            setattr(big, opt, val)
        big.connect(f"tcp://{worker.address}")
        big.send_multipart([wire.MAGIC, b"{}", b"\0" * ((MAX_MSG_MB + 1) << 20)])
        assert not big.poll(1000)
        big.close()

        assert worker.alive()
        assert status(fuzzer) == before
        # The valid head goes on exactly where it was.
        tok = int(np.argmax(local.decode([1])[0]))
        assert tok == int(np.argmax(target.decode([1])[0]))
        for _ in range(4):
            ref = local.decode([tok])[0].copy()
            assert np.array_equal(ref, target.decode([tok])[0])
            tok = int(np.argmax(ref))
    finally:
        fuzzer.close(linger=0)
        ctx.destroy(linger=0)
        local.close()
        target.close()


def test_worker_survives_a_head_that_vanishes(
    worker: WorkerProc, model: Model, model_path: Path, tmp_path: Path
) -> None:
    """A head that dies without releasing its stage: the worker waits, the next head is served."""
    keys = keys_from_token(TOKEN)
    cache = SliceCache(tmp_path)
    prompt = model.tokenize("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    gone = open_pipeline(model_path, [worker.address], keys, n_ctx=512, slice_cache=cache)
    gone.decode(prompt)
    for link in gone.links:  # as if the head process had crashed: no release message
        link.close(release=False)
    gone._zctx.term()
    local = LocalTarget(model, ContextParams(n_ctx=512, n_threads=1))
    target = open_pipeline(model_path, [worker.address], keys, n_ctx=512, slice_cache=cache)
    try:
        assert target.transfer.bytes_sent == 0
        assert np.array_equal(local.decode(prompt, all_logits=True), target.decode(prompt, all_logits=True))
    finally:
        local.close()
        target.close()
    assert worker.alive()
