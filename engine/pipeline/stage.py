"""The worker side: one ROUTER socket serving a head's control requests and pipeline traffic.

Life of a worker: wait for a head (``hello``), receive or find its slice by sha256
(``offer``/``chunk``), ``load`` it as one stage, then apply data-path transactions in
``txn`` order: ``decode`` (compute, forward hidden states to the next stage or return
logits to the head), ``kv`` and ``reset`` (apply, forward). ``release`` or a new head's
``hello`` frees the stage and the worker waits again. Nothing a peer sends can crash it:
every message is validated by :func:`.wire.decode` and against the loaded stage before
use, refused with a log line and an ``error`` reply, and the loop goes on.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq

from ..errors import PotluckError
from ..runtime import Batch, Context, ContextParams, Model
from . import wire
from .profile import NodeProfile
from .transport import (
    AUTH_FAILED_EVENTS,
    CurveKeys,
    client_socket,
    read_event,
    server_socket,
    start_authenticator,
)

log = logging.getLogger(__name__)

FORWARD_TIMEOUT_MS = 5000
CANCELLED_KEPT = 1024


class StageCompute:
    """A loaded layer range with its KV cache: runs batches of tokens or hidden states.

    Mirrors :class:`potluck.engine.split.Stage` (capture of ``l_out-{n_layer-1}``, every row
    an output on capturing stages) but takes explicit positions, sequence ids and output
    rows, because the pipeline's transactions carry them (PipeInfer's partitions).
    """

    def __init__(self, path: Path, load: wire.Load, n_threads: int) -> None:
        self.load = load
        self.model = Model(path)
        try:
            capture = None if load.last else self.model.n_layer - 1
            params = ContextParams(
                n_ctx=load.n_ctx,
                n_batch=load.n_batch,
                n_seq_max=load.n_seq_max,
                n_threads=n_threads,
                kv_unified=load.kv_unified,
                capture_layer=capture,
            )
            self.ctx = Context(self.model, params)
            n_seq = load.n_seq_max
            self.batch = (
                Batch(load.n_batch, n_seq_max=n_seq)
                if load.first
                else Batch(load.n_batch, n_embd=self.model.n_embd, n_seq_max=n_seq)
            )
        except BaseException:
            self.model.close()
            raise

    def validate(self, msg: wire.Decode) -> None:
        """Refuse a batch this stage cannot run (sizes, ranges), before touching llama.cpp."""
        n = msg.n_tokens
        if n > self.load.n_batch:
            raise PotluckError(f"batch of {n} tokens exceeds n_batch {self.load.n_batch}")
        if int(msg.positions.max()) >= self.ctx.n_ctx:
            raise PotluckError(f"position beyond the context ({self.ctx.n_ctx})")
        if int(msg.seq_ids.max()) >= self.load.n_seq_max:
            raise PotluckError(f"sequence id beyond n_seq_max {self.load.n_seq_max}")
        if self.load.first:
            if not msg.is_tokens:
                raise PotluckError("the first stage takes token ids")
            if int(msg.inputs.min()) < 0 or int(msg.inputs.max()) >= self.model.n_vocab:
                raise PotluckError("token id outside the vocabulary")
        elif msg.is_tokens or msg.inputs.shape[1] != self.model.n_embd:
            raise PotluckError(f"this stage takes hidden states [n, {self.model.n_embd}]")

    def run(self, msg: wire.Decode) -> np.ndarray:
        """Hidden states [n, n_embd] f32 (not last) or logits [rows, vocab] f32 (last)."""
        positions = msg.positions.tolist()
        seq_ids = [[s] for s in msg.seq_ids.tolist()]
        flags: list[bool] | str = [bool(o) for o in msg.outputs] if self.load.last else "all"
        if self.load.first:
            self.batch.set_tokens(msg.inputs.tolist(), positions, seq_ids, flags)
        else:
            self.batch.set_embeddings(msg.inputs.astype(np.float32), positions, seq_ids, flags)
        self.ctx.decode_batch(self.batch)
        if not self.load.last:
            assert self.ctx.captured is not None
            return self.ctx.captured
        return self.ctx.logits(int(msg.outputs.sum())).copy()

    def kv(self, op: wire.KvOp) -> None:
        n_seq = self.load.n_seq_max
        if op.seq >= n_seq or op.dst >= n_seq:
            raise PotluckError(f"sequence id beyond n_seq_max {n_seq}")
        if op.op == "rm":
            self.ctx.seq_rm(op.seq, op.p0, op.p1)
        elif op.op == "cp":
            if op.dst < 0:
                raise PotluckError("kv cp needs a destination sequence")
            if not self.load.kv_unified and (op.p0, op.p1) != (-1, -1):
                # llama.cpp aborts the process on a ranged copy across streams (DESIGN.md fact 4)
                raise PotluckError("kv cp across streams copies whole sequences only (p0 = p1 = -1)")
            self.ctx.seq_cp(op.seq, op.dst, op.p0, op.p1)
        elif op.op == "keep":
            self.ctx.seq_keep(op.seq)
        elif op.op == "add":
            self.ctx.seq_add(op.seq, op.p0, op.p1, op.delta)

    def pos_max(self) -> np.ndarray:
        return np.array([self.ctx.seq_pos_max(s) for s in range(self.load.n_seq_max)], dtype="<i4")

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
        self.model.close()


@dataclass
class _Upload:
    total: int
    received: int
    part: Path
    hasher: hashlib._Hash


class Worker:
    """Serves one head at a time on ``tcp://bind:port`` until :meth:`stop`."""

    def __init__(
        self,
        keys: CurveKeys,
        profile: NodeProfile,
        cache_dir: Path,
        *,
        bind: str = "0.0.0.0",
        port: int = 0,
        n_threads: int = 0,
        max_msg_bytes: int = wire.DEFAULT_MAX_BYTES,
        potluck_version: str = "0",
    ) -> None:
        self.keys = keys
        self.profile = profile
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        self.n_threads = n_threads
        self.max_msg_bytes = max_msg_bytes
        self.version = potluck_version
        self.zctx = zmq.Context()
        self.auth = start_authenticator(self.zctx, keys)
        self.sock = server_socket(self.zctx, keys, max_msg_bytes=max_msg_bytes)
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        )
        if port:
            self.sock.bind(f"tcp://{bind}:{port}")
            self.port = port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{bind}")
        self.bind = bind
        self._stop = threading.Event()
        self.stage: StageCompute | None = None
        self.head: bytes = b""
        self.txn = 0
        self.forward: zmq.Socket | None = None
        self.cancelled: collections.deque[int] = collections.deque(maxlen=CANCELLED_KEPT)
        self.uploads: dict[str, _Upload] = {}
        self.rejected = 0  # messages refused (tests and logs)
        self.bytes_received = 0

    # -- lifetime
    @property
    def node(self) -> str:
        return f"{self.profile.node_id}@{self.bind}:{self.port}"

    def stop(self) -> None:
        self._stop.set()

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        log.info("worker %s waiting for a head", self.node)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(200))
                if self.monitor in events:
                    self._log_handshake_failures()
                if self.sock in events:
                    self._serve_pending()
        finally:
            self.close()

    def _serve_pending(self) -> None:
        for _ in range(64):  # bounded, so the stop flag and the monitor are checked
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self.bytes_received += sum(len(f.buffer) for f in frames)
            self.handle(frames[0].bytes, frames[1:])

    def _log_handshake_failures(self) -> None:
        while self.monitor.poll(0):
            try:
                event, _ = read_event(self.monitor)
            except zmq.ZMQError:
                return
            if event in AUTH_FAILED_EVENTS:
                self.rejected += 1
                log.warning("refused a connection that failed the CURVE handshake (no or wrong token)")

    def close(self) -> None:
        self._release()
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.auth.stop()
        self.zctx.term()

    # -- dispatch
    def handle(self, ident: bytes, frames: list) -> None:
        try:
            msg = wire.decode(frames, max_bytes=self.max_msg_bytes)
        except wire.WireError as e:
            self._refuse(ident, "malformed", str(e))
            return
        try:
            if isinstance(msg, (wire.Decode, wire.KvOp, wire.Reset)):
                self._data(ident, msg, frames)
            else:
                self._control(ident, msg)
        except PotluckError as e:
            self._refuse(ident, "refused", str(e), getattr(msg, "txn", 0))
        except Exception as e:  # a bug must not take the worker down
            log.exception("error while serving %s", type(msg).__name__)
            self._refuse(ident, "internal", f"{type(e).__name__}: {e}", getattr(msg, "txn", 0))

    def _refuse(self, ident: bytes, code: str, why: str, txn: int = 0) -> None:
        self.rejected += 1
        log.warning("refused a message from %r: %s", ident[:24], why)
        self._send(ident, wire.Error(node=self.node, code=code, message=why, txn=txn))

    def _send(self, ident: bytes, msg: wire.Message) -> None:
        try:
            self.sock.send_multipart([ident, *wire.encode(msg)], copy=False)
        except zmq.ZMQError as e:  # peer gone (ROUTER_MANDATORY) or not reading
            log.info("could not reply to %r: %s", ident[:24], e)

    def _control(self, ident: bytes, msg: wire.Message) -> None:
        if isinstance(msg, wire.Hello):
            if self.stage is not None:
                log.info("a new head %s takes over; releasing the stage", msg.head_id)
            self._release()
            log.info("head %s joined", msg.head_id)
            p = self.profile
            state = "idle"
            welcome = wire.Welcome(
                p.node_id, self.version, p.cores, p.free_mb, p.speed, state, self.max_msg_bytes
            )
            self._send(ident, welcome)
        elif isinstance(msg, wire.Offer):
            self._send(ident, wire.OfferReply(msg.sha256, self._offer(msg)))
        elif isinstance(msg, wire.Chunk):
            self._send(ident, self._chunk(msg))
        elif isinstance(msg, wire.Load):
            self._send(ident, self._load(msg))
        elif isinstance(msg, wire.Release):
            self._release()
        elif isinstance(msg, wire.Cancel):
            self.cancelled.append(msg.run_id)
        elif isinstance(msg, wire.Ping):
            self._send(ident, wire.Pong(msg.nonce))
        elif isinstance(msg, wire.Status):
            self._send(ident, self._status())
        else:
            raise PotluckError(f"a worker does not accept {msg.TYPE!r} messages")

    # -- slice cache
    def cached_path(self, sha: str) -> Path:
        return self.cache_dir / f"{sha}.gguf"

    def _offer(self, msg: wire.Offer) -> bool:
        if self.cached_path(msg.sha256).exists():
            return True
        free = shutil.disk_usage(self.cache_dir).free
        if msg.size > free:
            raise PotluckError(f"slice of {msg.size} bytes does not fit in {free} free bytes")
        old = self.uploads.pop(msg.sha256, None)
        if old is not None:
            old.part.unlink(missing_ok=True)
        part = self.cache_dir / f"{msg.sha256}.part"
        part.write_bytes(b"")
        self.uploads[msg.sha256] = _Upload(msg.size, 0, part, hashlib.sha256())
        return False

    def _chunk(self, msg: wire.Chunk) -> wire.ChunkAck:
        up = self.uploads.get(msg.sha256)
        if up is None:
            raise PotluckError("chunk for a file that was not offered")
        if msg.total != up.total or msg.offset != up.received:
            raise PotluckError(f"chunk at {msg.offset} but {up.received} bytes received so far")
        with open(up.part, "ab") as f:
            f.write(msg.data.tobytes())
        up.hasher.update(msg.data)
        up.received += msg.data.size
        done = up.received == up.total
        if done:
            del self.uploads[msg.sha256]
            if up.hasher.hexdigest() != msg.sha256:
                up.part.unlink(missing_ok=True)
                raise PotluckError("received slice does not match its sha256; discarded")
            up.part.replace(self.cached_path(msg.sha256))
            log.info("received slice %s (%d bytes)", msg.sha256[:12], up.total)
        return wire.ChunkAck(msg.sha256, up.received, done)

    # -- stage
    def _load(self, msg: wire.Load) -> wire.Loaded:
        path = self.cached_path(msg.sha256)
        if not path.exists():
            raise PotluckError(f"slice {msg.sha256[:12]} is not in this worker's cache")
        self._release()
        t0 = time.perf_counter()
        stage = StageCompute(path, msg, self.n_threads)
        if stage.model.n_layer != msg.layer_hi - msg.layer_lo:
            stage.close()
            raise PotluckError("slice layer count does not match the requested range")
        if not msg.last:
            fwd = client_socket(self.zctx, self.keys, f"fwd-{self.profile.node_id}".encode())
            fwd.setsockopt(zmq.SNDTIMEO, FORWARD_TIMEOUT_MS)
            try:
                fwd.connect(msg.next_addr)
            except zmq.ZMQError as e:
                fwd.close(linger=0)
                stage.close()
                raise PotluckError(f"bad next-stage address {msg.next_addr!r}: {e}") from None
            self.forward = fwd
        self.stage = stage
        self.head = msg.reply_to.encode()
        self.txn = 0
        self.cancelled.clear()
        load_ms = (time.perf_counter() - t0) * 1000
        log.info("loaded layers %d-%d (%s) in %.0f ms", msg.layer_lo, msg.layer_hi, msg.sha256[:12], load_ms)
        m = stage.model
        return wire.Loaded(m.n_layer, m.n_embd, m.n_vocab, stage.ctx.n_ctx, load_ms)

    def _release(self) -> None:
        if self.forward is not None:
            self.forward.close(linger=0)
            self.forward = None
        if self.stage is not None:
            self.stage.close()
            self.stage = None
            log.info("stage released; waiting for a head")
        self.head = b""
        self.txn = 0

    def _status(self) -> wire.StatusReply:
        st = self.stage
        if st is None:
            return wire.StatusReply("idle", "0" * 64, 0, 0, self.txn, np.zeros(0, dtype="<i4"))
        ld = st.load
        return wire.StatusReply("loaded", ld.sha256, ld.layer_lo, ld.layer_hi, self.txn, st.pos_max())

    # -- data path
    def _data(self, ident: bytes, msg: wire.Decode | wire.KvOp | wire.Reset, frames: list) -> None:
        st = self.stage
        if st is None:
            raise PotluckError("no stage is loaded")
        if ident != st.load.upstream.encode():
            raise PotluckError("pipeline traffic from a peer that is not this stage's upstream")
        try:
            if msg.txn != self.txn + 1:
                raise PotluckError(f"transaction {msg.txn} out of order (expected {self.txn + 1})")
            if isinstance(msg, wire.Decode):
                self._decode(st, msg)
            else:
                if isinstance(msg, wire.KvOp):
                    st.kv(msg)
                else:
                    st.ctx.clear()
                self.txn = msg.txn
                if self.forward is not None:
                    self._forward(list(frames))
        except Exception as e:  # the head is told (not the upstream forwarder, which never reads)
            self.rejected += 1
            if isinstance(e, PotluckError):
                log.warning("transaction %d failed: %s", msg.txn, e)
            else:
                log.exception("transaction %d failed", msg.txn)
            self._send(self.head, wire.Error(self.node, "failed", f"{e}", msg.txn))

    def _decode(self, st: StageCompute, msg: wire.Decode) -> None:
        skip = msg.skip or msg.run_id in self.cancelled
        if not skip:
            st.validate(msg)
        self.txn = msg.txn  # validated: the transaction is consumed whatever happens next
        if skip:
            out = np.zeros((0, 1), dtype=np.float32)
        else:
            try:
                out = st.run(msg)
            except InterruptedError:
                skip, out = True, np.zeros((0, 1), dtype=np.float32)
        if st.load.last:
            self._send(self.head, wire.Result(msg.txn, msg.run_id, skip, out))
            return
        hidden = out.astype(np.float16) if st.load.hidden_dtype == "f16" and not skip else out
        if skip:
            hidden = np.zeros((0, 1), dtype=np.float32)
        fwd = wire.Decode(
            txn=msg.txn,
            run_id=msg.run_id,
            skip=skip,
            inputs=hidden,
            positions=msg.positions,
            seq_ids=msg.seq_ids,
            outputs=msg.outputs,
        )
        self._forward(wire.encode(fwd))

    def _forward(self, frames: list) -> None:
        assert self.forward is not None
        try:
            self.forward.send_multipart(frames, copy=False)
        except zmq.Again:
            raise PotluckError(f"next stage {self.stage.load.next_addr if self.stage else ''} is unreachable") from None
