"""Tools that attack the cluster protocol on loopback, shared by the tests and by
scripts/fuzz_cluster.py: one well-formed message of every wire type, a random corruption of a
message's frames, and a token holder posing as a worker that answers batches with lies.

Nothing in the product uses them; they live in the lab so that the tests and the scripts
import one copy (scripts never import tests/).
"""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable

import numpy as np
import zmq

from ..cluster import wire
from ..cluster.transport import server_socket, start_authenticator
from ..core.jobs import DecodeJob
from ..core.spec import CurveKeys

SHA = "ab" * 32


def samples() -> list[wire.WireMessage]:
    """One well-formed message of every wire type (the round-trip tests check it is every one)."""
    hidden = np.arange(12, dtype=np.float32).reshape(3, 4)
    return [
        wire.Hello("head-1", "0.1.0", "cd" * 32),
        wire.Welcome("n1", "0.1.0", 8, 16000, 3.5, "idle", 1 << 28),
        wire.Offer(SHA, 10, "", 0, 1),
        wire.OfferReply(SHA, True, 0),
        wire.Chunk(SHA, 0, 10, np.arange(4, dtype=np.uint8)),
        wire.ChunkAck(SHA, 4, False),
        wire.Load(SHA, 0, 12, True, False, 512, 64, 1, True, "f32", "tcp://h:1", "cd" * 32, "ef" * 32),
        wire.Loaded(12, 576, 49152, 512, 12.5, 48, False, ""),
        wire.Release(),
        wire.Cancel(3),
        wire.Cancel(3, np.array([4, 5], dtype=np.int32)),
        wire.Ping(1),
        wire.Ping(2, np.arange(5, dtype=np.uint8)),  # a join's padded ping (the link's bandwidth)
        wire.Pong(1),
        wire.Status(),
        wire.StatusReply("loaded", SHA, 0, 12, 5, 9, 1, 2, 4, 12.5, np.array([7, -1], dtype=np.int32)),
        wire.Error("n1", "refused", "why", 3),
        wire.Forward.from_job(1, DecodeJob.tokens(0, [1, 2, 3], 0)),
        wire.Forward.from_job(
            2, DecodeJob(4, hidden, np.arange(5, 8, dtype=np.int32), np.zeros(3, np.int32), np.ones(3, bool))
        ),
        wire.Forward.from_job(
            3, DecodeJob(0, hidden.astype(np.float16), np.arange(3, dtype=np.int32), np.array([0, 1, 1], np.int32),
                         np.array([0, 0, 1], bool)),
        ),
        wire.KvApply(4, 0, "rm", 0, -1, 10, -1, 0),
        wire.Reset(5),
        wire.Result(6, 0, False, np.ones((2, 5), dtype=np.float32)),
    ]



def mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    """One random corruption of a valid message: bytes, frames, header JSON or sizes."""
    frames = list(frames)
    kind = rng.randrange(8)
    i = rng.randrange(len(frames))
    if kind == 0 and frames[i]:
        b = bytearray(frames[i])
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        frames[i] = bytes(b)
    elif kind == 1:
        frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    elif kind == 2:
        frames.insert(i, rng.randbytes(rng.randrange(64)))
    elif kind == 3 and len(frames) > 1:
        del frames[i]
    elif kind == 4:
        header = json.loads(frames[1])
        key = rng.choice(list(header["f"]) or ["x"])
        header["f"][key] = rng.choice([None, -1, 2**70, "x" * 5000, [], {}, 1.5, True, "", 0])
        frames[1] = json.dumps(header).encode()
    elif kind == 5:
        header = json.loads(frames[1])
        if header["a"]:
            spec = rng.choice(header["a"])
            spec[rng.randrange(3)] = rng.choice([[2**40], [-1], "f64", [1, 2, 3], None, "outputs", [0]])
        else:
            header["a"] = [["x", "u8", [1]]]
        frames[1] = json.dumps(header).encode()
    elif kind == 6:
        frames[1] = rng.choice([b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"type":"ping"}', b"1e999"])
    else:
        frames = [rng.randbytes(rng.randrange(1, 40)) for _ in range(rng.randint(0, 8))]
    return frames


class FakeWorker:
    """A token holder posing as a worker: an honest setup (hello, offer, load, ping, status),
    then ``result(forward)`` gives the frames it sends back for each batch (lies, or nothing).
    ``stale``: a result of an old chain and the welcome of a timed-out hello go out just
    before an offer's reply (what a rebuilding head must not take as that reply).
    ``refusal``: the answer to every message instead (a worker that refuses whatever it is asked)."""

    def __init__(
        self, keys: CurveKeys, n_vocab: int, result: Callable[[wire.Forward], list], n_embd: int = 576,
        stale: bool = False, port: int = 0, node_id: str = "fake", free_mb: int = 4000,
        refusal: wire.Error | None = None,
    ) -> None:
        self.node_id = node_id
        self.free_mb = free_mb
        self.ctx = zmq.Context()
        self.auth = start_authenticator(self.ctx, keys)
        self.sock = server_socket(self.ctx, keys, max_msg_bytes=64 << 20)
        self.sock.setsockopt(zmq.SNDTIMEO, 2000)
        if port:
            self.sock.bind(f"tcp://127.0.0.1:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.n_vocab = n_vocab
        self.n_embd = n_embd
        self.result = result
        self.stale = stale  # late messages go out just before the offer's reply
        self.refusal = refusal
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while not self.stop:
            if not self.sock.poll(20):
                continue
            ident, *frames = self.sock.recv_multipart()
            try:
                msg = wire.parse_frames(frames)
            except wire.WireError:
                continue
            replies: list = []
            if self.refusal is not None:
                replies = [wire.to_frames(self.refusal)]
            elif isinstance(msg, wire.Hello):
                replies = [wire.to_frames(wire.Welcome(self.node_id, "0", 2, self.free_mb, 1.0, "idle", 64 << 20))]
            elif isinstance(msg, wire.Offer):
                replies = [wire.to_frames(wire.OfferReply(msg.sha256, True, 0))]
                if self.stale:  # a result of the old chain, the welcome of a hello that timed out
                    replies[:0] = [wire.to_frames(wire.Result(7, 3, False, np.zeros((1, self.n_embd), np.float32))),
                                   wire.to_frames(wire.Welcome(self.node_id, "0", 2, 4000, 1.0, "idle", 64 << 20))]
            elif isinstance(msg, wire.Load):
                n_layer = msg.layer_hi - msg.layer_lo
                loaded = wire.Loaded(n_layer, self.n_embd, self.n_vocab, msg.n_ctx, 1.0, 48, False, "")
                replies = [wire.to_frames(loaded)]
            elif isinstance(msg, wire.Forward):
                replies = self.result(msg)
            elif isinstance(msg, wire.Ping):
                replies = [wire.to_frames(wire.Pong(msg.nonce))]
            elif isinstance(msg, wire.Status):
                replies = [wire.to_frames(wire.StatusReply("loaded", "0" * 64, 0, 1, 0, 0, 0, 0, -1, 0.0,
                                                           np.zeros(1, np.int32)))]
            for frames_out in replies:
                try:
                    self.sock.send_multipart([ident, *frames_out])
                except zmq.ZMQError:
                    pass

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.sock.close(linger=0)
        self.auth.stop()
        self.ctx.destroy(linger=0)
