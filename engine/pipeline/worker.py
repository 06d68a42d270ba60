"""The worker side: one ROUTER socket serving a head's control requests and pipeline traffic.

Life of a worker: wait for a head (``hello``), receive or find its slice by sha256
(``offer``/``chunk``), ``load`` it as one :class:`~potluck.engine.stage.Stage`, then take
data-path transactions in ``txn`` order: ``forward`` (a batch: compute, pass hidden states to
the next stage or logits to the head), ``kv`` and ``reset`` (apply, pass on). ``release`` or a
new head's ``hello`` frees the stage and the worker waits again.

Two threads: this one owns every socket and answers control messages at once; the stage's
:class:`~potluck.engine.runner.StageRunner` computes. So a ``cancel`` reaches a running
batch (aborted mid-compute through llama.cpp's abort flag) and queued batches of the run are
skipped; a skipped or refused batch still goes downstream, empty, so every stage sees every
transaction in order. Finished work comes back to this thread through a queue and a pipe
the poller watches.

Nothing a peer sends can crash a worker: every message is validated by
:func:`.wire.parse_frames` and against the loaded stage before use, refused with a log line
and an ``error`` reply, and the loop goes on.
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import shutil
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zmq

from ..errors import PotluckError
from ..jobs import DecodeJob, RunCancelled
from ..runner import StageRunner, WorkItem
from ..runtime import ContextParams, Model
from ..stage import Stage
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


class LoadedStage:
    """A cached slice loaded as one stage, with the thread that computes it."""

    def __init__(self, path: Path, load: wire.Load, n_threads: int) -> None:
        self.load = load
        self.model = Model(path)
        try:
            params = ContextParams(
                n_ctx=load.n_ctx,
                n_batch=load.n_batch,
                n_seq_max=load.n_seq_max,
                n_threads=n_threads,
                kv_unified=load.kv_unified,
            )
            self.stage = Stage(self.model, first=load.first, last=load.last, params=params)
        except BaseException:
            self.model.close()
            raise
        self.runner = StageRunner(self.stage, name=f"layers-{load.layer_lo}-{load.layer_hi}")

    def close(self) -> None:
        self.runner.close()
        self.stage.close()
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
        self.stage: LoadedStage | None = None
        self.head: bytes = b""
        self.txn = 0
        self.forward: zmq.Socket | None = None
        # finished runner work, in txn order, back to this thread: (stage, message, future)
        self._done: queue.SimpleQueue[tuple[LoadedStage, wire.WireMessage, Future]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
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
        poller.register(self._wake_r, zmq.POLLIN)
        log.info("worker %s waiting for a head", self.node)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(200))
                if self.monitor in events:
                    self._log_handshake_failures()
                if self._wake_r in events:
                    self._send_finished()
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
            self._send_finished()  # keep results flowing while a burst of requests arrives

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
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.monitor.close(linger=0)
        self.sock.close(linger=0)
        self.auth.stop()
        self.zctx.term()

    # -- dispatch
    def handle(self, ident: bytes, frames: list) -> None:
        try:
            msg = wire.parse_frames(frames, max_bytes=self.max_msg_bytes)
        except wire.WireError as e:
            self._refuse(ident, "malformed", str(e))
            return
        try:
            if isinstance(msg, (wire.Forward, wire.KvApply, wire.Reset)):
                self._data(ident, msg)
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

    def _send(self, ident: bytes, msg: wire.WireMessage) -> None:
        try:
            self.sock.send_multipart([ident, *wire.to_frames(msg)], copy=False)
        except zmq.ZMQError as e:  # peer gone (ROUTER_MANDATORY) or not reading
            log.info("could not reply to %r: %s", ident[:24], e)

    def _control(self, ident: bytes, msg: wire.WireMessage) -> None:
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
            if self.stage is not None:
                self.stage.runner.cancel(msg.run_id)  # reaches a running batch, not only queued ones
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
        stage = LoadedStage(path, msg, self.n_threads)
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
        load_ms = (time.perf_counter() - t0) * 1000
        log.info("loaded layers %d-%d (%s) in %.0f ms", msg.layer_lo, msg.layer_hi, msg.sha256[:12], load_ms)
        m = stage.model
        return wire.Loaded(m.n_layer, m.n_embd, m.n_vocab, stage.stage.n_ctx, load_ms)

    def _release(self) -> None:
        if self.stage is not None:
            self.stage.close()  # stops its runner: nothing more reaches the queue
            self.stage = None
            log.info("stage released; waiting for a head")
        self._drain_finished()
        if self.forward is not None:
            self.forward.close(linger=0)
            self.forward = None
        self.head = b""
        self.txn = 0

    def _status(self) -> wire.StatusReply:
        ld = self.stage
        if ld is None:
            return wire.StatusReply("idle", "0" * 64, 0, 0, self.txn, 0, 0, 0, -1, np.zeros(0, dtype="<i4"))
        c, running = ld.runner.counters, ld.runner.running_run
        return wire.StatusReply(
            "loaded", ld.load.sha256, ld.load.layer_lo, ld.load.layer_hi, self.txn,
            c.finished, c.aborted, c.skipped, -1 if running is None else running,
            np.array(ld.runner.positions, dtype="<i4"),
        )

    # -- data path: this thread checks order and validity, the runner computes
    def _data(self, ident: bytes, msg: wire.Forward | wire.KvApply | wire.Reset) -> None:
        ld = self.stage
        if ld is None:
            raise PotluckError("no stage is loaded")
        if ident != ld.load.upstream.encode():
            raise PotluckError("pipeline traffic from a peer that is not this stage's upstream")
        if msg.txn != self.txn + 1:
            raise PotluckError(f"transaction {msg.txn} out of order (expected {self.txn + 1})")
        self.txn = msg.txn  # in order: consumed whatever happens next, so later stages see it too
        try:
            item = self._work_item(ld, msg)
        except PotluckError as e:
            self.rejected += 1
            log.warning("transaction %d refused: %s", msg.txn, e)
            self._send(self.head, wire.Error(self.node, "failed", str(e), msg.txn))
            # It still travels on, as an empty batch, so later stages see every txn in order.
            run_id = msg.run_id if isinstance(msg, wire.Forward) else 0
            msg = wire.Forward(msg.txn, run_id, True, *_empty_arrays())
            item = _placeholder(run_id)
        fut = ld.runner.submit(item)
        fut.add_done_callback(lambda f, m=msg: self._finished(ld, m, f))

    @staticmethod
    def _work_item(ld: LoadedStage, msg: wire.Forward | wire.KvApply | wire.Reset) -> WorkItem:
        if isinstance(msg, wire.Reset):
            return Stage.clear
        if isinstance(msg, wire.KvApply):
            op = msg.kv_op()
            try:
                ld.stage.ctx.check_kv(op)
            except ValueError as e:
                raise PotluckError(str(e)) from None
            return op
        if msg.skip:  # cancelled or refused upstream: skipped here too, in its place
            return _placeholder(msg.run_id)
        job = msg.job()
        ld.stage.check(job)
        return job

    def _finished(self, ld: LoadedStage, msg: wire.WireMessage, fut: Future) -> None:
        """Runner thread: hand the outcome to the socket thread."""
        self._done.put((ld, msg, fut))
        try:
            os.write(self._wake_w, b"\0")
        except OSError:  # closing
            pass

    def _drain_finished(self) -> None:
        while True:
            try:
                self._done.get_nowait()
            except queue.Empty:
                break

    def _send_finished(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        while True:
            try:
                ld, msg, fut = self._done.get_nowait()
            except queue.Empty:
                return
            if ld is not self.stage:
                continue  # released meanwhile
            try:
                self._pass_on(ld, msg, fut)
            except PotluckError as e:
                log.warning("%s", e)
                self._send(self.head, wire.Error(self.node, "failed", str(e), getattr(msg, "txn", 0)))

    def _pass_on(self, ld: LoadedStage, msg: wire.WireMessage, fut: Future) -> None:
        """Send a finished transaction on: logits to the head, everything else downstream."""
        err = fut.exception()
        if isinstance(msg, wire.Forward):
            if err is not None and not isinstance(err, RunCancelled):
                log.error("batch of transaction %d failed: %s", msg.txn, err)
                self._send(self.head, wire.Error(self.node, "failed", f"{err}", msg.txn))
            out = None if err is not None else fut.result()
            if ld.load.last:
                logits = out if out is not None else np.zeros((0, 1), dtype=np.float32)
                self._send(self.head, wire.Result(msg.txn, msg.run_id, out is None, logits))
                return
            if out is None:
                self._forward(wire.to_frames(msg.skipped() if not msg.skip else msg))
                return
            hidden = out.astype(np.float16) if ld.load.hidden_dtype == "f16" else out
            self._forward(wire.to_frames(wire.Forward.from_job(msg.txn, msg.job(), hidden)))
            return
        if err is not None:  # a KV operation the stage refused: the head must know
            self._send(self.head, wire.Error(self.node, "failed", f"{err}", getattr(msg, "txn", 0)))
        if self.forward is not None:
            self._forward(wire.to_frames(msg))

    def _forward(self, frames: list) -> None:
        assert self.forward is not None
        try:
            self.forward.send_multipart(frames, copy=False)
        except zmq.Again:
            raise PotluckError(f"next stage {self.stage.load.next_addr if self.stage else ''} is unreachable") from None


def _empty_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    empty = np.zeros(0, dtype="<i4")
    return empty, empty, empty, np.zeros(0, dtype="u1")


def _placeholder(run_id: int) -> DecodeJob:
    """A batch with no rows: the runner skips it in its place in the queue (keeps txn order)."""
    return DecodeJob(run_id, *_empty_arrays()[:3], np.zeros(0, dtype=bool))
