"""A worker's stage in a supervised child process, so llama.cpp can abort without killing the worker.

llama.cpp ends the whole process on a failed ``GGML_ASSERT`` (a slice it cannot load,
docs/facts.md §5) and its GGUF loader has a history of memory-corruption bugs. The worker
therefore never maps a model itself: :class:`StageProcess` spawns a child that loads the
cached slice (proven intact by the worker: slice_store.py) as one
:class:`~potluck.engine.core.stage.Stage` and runs its
:class:`~potluck.engine.core.runner.StageRunner`. The worker's socket thread talks to it over a
pipe; a reader thread turns replies into the futures the worker already waits on. When the
child dies (SIGABRT, SIGSEGV, killed), every pending future fails with
:class:`StageCrashed` naming the signal, and the worker frees the stage and serves the next head.

Every job is checked by the stage inside the child, in its place in the queue, so a refused
batch keeps the transaction order like any other.
"""

from __future__ import annotations

import itertools
import logging
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin before 3.11
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from ..core.errors import PotluckError
from ..core.jobs import DecodeJob, GroupCancelled
from ..core.kv import KvOp

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 5.0


class StageCrashed(PotluckError):
    """The stage's child process died (llama.cpp aborted or crashed, or it was killed)."""


@dataclass(frozen=True)
class StageSpec:
    """What the child needs to load a slice (plain values: it crosses a process boundary)."""

    path: str
    sha256: str
    first: bool  # takes token ids; never last: the head computes the output layer (head.py)
    n_ctx: int
    n_batch: int
    n_seq_max: int
    kv_unified: bool
    n_threads: int  # 0: every core, as many as other processes leave free (load_watch.py)


@dataclass(frozen=True)
class StageInfo:
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx: int


@dataclass(frozen=True)
class StageStatus:
    finished: int
    aborted: int
    skipped: int
    running: int  # -1: none
    positions: tuple[int, ...]
    busy_s: float  # time spent computing since the stage loaded


def describe_exit(code: int | None) -> str:
    """How a child ended, in words ("killed by SIGABRT (llama.cpp aborted)")."""
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = {"SIGABRT": " (llama.cpp aborted)", "SIGSEGV": " (a memory fault in native code)"}
        return f"was killed by {name}{hint.get(name, '')}"
    return f"exited with status {code}"


class StageProcess:
    """One child process serving one stage; :meth:`load` once, then submit work in order."""

    def __init__(self) -> None:
        # A fresh interpreter that imports this module and core only. multiprocessing's spawn
        # would also import the worker's __main__ again (the whole command line, every
        # strategy): 1 to 3 s of CPU per stage process, and a worker starts one per load.
        # Never fork: the worker holds sockets and threads.
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        fd = theirs.fileno()
        code = f"from potluck.engine.cluster.child import serve_stage; serve_stage({fd})"
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(fd,), stdin=subprocess.DEVNULL)
        theirs.close()
        self._lock = threading.Lock()
        self._pending: dict[int, Future] = {}
        self._seq = itertools.count(1)
        self._send_lock = threading.Lock()
        self.crashed: str | None = None
        self.on_crash: Callable[[str], None] | None = None
        self._reader: threading.Thread | None = None
        self._closing = False  # close() asked the child to end: its exit is no loss

    # -- lifetime
    def load(self, spec: StageSpec, timeout_s: float) -> StageInfo:
        """Load the slice in the child; raises PotluckError (refused) or StageCrashed."""
        self._send(("load", spec))
        if not self._conn.poll(timeout_s):
            self.kill()
            self.close()
            raise StageCrashed(f"loading the slice took more than {timeout_s:g} s; the stage process was stopped")
        try:
            reply = self._conn.recv()
        except (EOFError, OSError):
            why = f"the stage process {self._exit_reason()}"
            self.close()
            raise StageCrashed(why) from None
        if reply[0] == "failed":
            self.close()
            raise PotluckError(reply[1])
        self._reader = threading.Thread(target=self._read_loop, name="potluck-stage-reader", daemon=True)
        self._reader.start()
        return reply[1]

    def close(self) -> None:
        """End the child (a release): it frees its model and exits; one that takes more than
        2 s is killed. Either way the stage was released, not lost."""
        self._closing = True
        try:
            self._send(("close",))
        except PotluckError:
            pass
        self._join(2.0)
        if self.proc.poll() is None:
            self.kill()
        self._conn.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(2.0)
        self._fail_pending(StageCrashed("the stage was released"))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self._join(2.0)

    # -- work
    def submit(self, kind: str, payload: object = None) -> Future:
        """``kind``: "job" (DecodeJob), "kv" (KvOp), "reset" or "skip" (job group of a placeholder)."""
        fut: Future = Future()
        if self.crashed is not None:
            fut.set_exception(StageCrashed(self.crashed))
            return fut
        n = next(self._seq)
        with self._lock:
            self._pending[n] = fut
        try:
            self._send((kind, n, payload))
        except PotluckError as e:
            with self._lock:
                self._pending.pop(n, None)
            if not fut.done():
                fut.set_exception(StageCrashed(self.crashed or str(e)))
        return fut

    def cancel(self, group: int, *more: int) -> None:
        try:
            self._send(("cancel", (group, *more)))
        except PotluckError:
            pass

    def status(self) -> StageStatus:
        fut = self.submit("status")
        try:
            return fut.result(STATUS_TIMEOUT_S)
        except (TimeoutError, FutureTimeout):
            raise PotluckError("the stage process did not answer a status request") from None

    # -- internals
    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (OSError, ValueError, EOFError) as e:
            raise PotluckError(f"the stage process is gone ({e})") from None

    def _join(self, timeout_s: float) -> int | None:
        """The child's exit status (negative: the signal that ended it), or None if it still runs."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def _exit_reason(self) -> str:
        return describe_exit(self._join(2.0))

    def _read_loop(self) -> None:
        while True:
            try:
                reply = self._conn.recv()
            except (EOFError, OSError):
                break
            kind, n, ok, payload = reply
            with self._lock:
                fut = self._pending.pop(n, None)
            if fut is None or fut.done():
                continue
            if ok:
                fut.set_result(payload)
            else:
                fut.set_exception(_error(payload))
        if self._closing:  # released: the child may still be freeing its model (no exit code yet)
            self._fail_pending(StageCrashed("the stage was released"))
            return
        reason = f"the stage process {self._exit_reason()}"
        if self.proc.returncode == 0:  # ended on its own without a crash
            self._fail_pending(StageCrashed("the stage was released"))
            return
        self.crashed = reason
        log.error("%s; the stage is lost, the worker goes on", reason)
        self._fail_pending(StageCrashed(reason))
        if self.on_crash is not None:
            self.on_crash(reason)

    def _fail_pending(self, err: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)


def _error(payload: tuple[str, str]) -> BaseException:
    kind, message = payload
    if kind == "cancelled":
        return GroupCancelled(message)
    return PotluckError(message)


def _encode_error(e: BaseException) -> tuple[str, str]:
    if isinstance(e, (GroupCancelled, InterruptedError)):
        return ("cancelled", str(e))
    if isinstance(e, PotluckError):
        return ("refused", str(e))
    return ("failed", f"{type(e).__name__}: {e}")


# --------------------------------------------------------------------------- the child


def serve_stage(fd: int) -> None:  # pragma: no cover - runs in the child process
    """Load the stage, then serve work items on the connection at ``fd`` until ``close`` or
    the worker goes away (the end of the connection)."""
    logging.basicConfig(level=logging.WARNING, format="potluck stage: %(message)s")
    conn = Connection(fd)
    from ..core import runner, runtime, stage  # noqa: F401 - llama.cpp loads while the worker waits for a load
    from ..core.observe import native_observer

    native_observer()  # compiled meanwhile too (about a second): a stage's capture runs through it
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        return
    if msg[0] != "load":
        return
    spec: StageSpec = msg[1]
    try:
        stage, runner = _open(spec)
    except Exception as e:
        conn.send(("failed", str(e) if isinstance(e, PotluckError) else f"{type(e).__name__}: {e}"))
        return
    m = stage.model
    conn.send(("ready", StageInfo(m.n_layer, m.n_embd, m.n_vocab, stage.n_ctx)))
    send_lock = threading.Lock()

    def reply(n: int, ok: bool, payload: object) -> None:
        try:
            with send_lock:
                conn.send(("done", n, ok, payload))
        except (OSError, ValueError):
            pass

    def resolve(n: int, fut: Future) -> None:
        err = fut.exception()
        if err is None:
            reply(n, True, fut.result())
        else:
            reply(n, False, _encode_error(err))

    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "close":
                break
            if kind == "cancel":
                runner.cancel(*msg[1])
                continue
            n, payload = msg[1], msg[2]
            if kind == "status":
                c, running = runner.counters, runner.running_group
                reply(n, True, StageStatus(c.finished, c.aborted, c.skipped, -1 if running is None else running,
                                           tuple(runner.positions), c.busy_s))
                continue
            item = _work_item(stage, kind, payload)
            runner.submit(item).add_done_callback(lambda f, n=n: resolve(n, f))
    finally:
        runner.close()
        stage.close()
        stage.model.close()


def _open(spec: StageSpec):  # pragma: no cover - child
    from ..core.runner import StageRunner
    from ..core.runtime import ContextParams, Model
    from ..core.stage import Stage

    model = Model(Path(spec.path))  # proven intact by the worker just before (slice_store.has)
    try:
        params = ContextParams(n_ctx=spec.n_ctx, n_batch=spec.n_batch, n_seq_max=spec.n_seq_max,
                               n_threads=spec.n_threads, kv_unified=spec.kv_unified,
                               follow_load=spec.n_threads == 0)
        stage = Stage(model, first=spec.first, last=False, params=params)
    except BaseException:
        model.close()
        raise
    return stage, StageRunner(stage, name="stage")


def _work_item(stage, kind: str, payload: object):  # pragma: no cover - child
    """The runner item for one request; a refused one raises in its place in the order."""

    def refuse(why: str):
        def item(_stage: object) -> None:
            raise PotluckError(why)
        return item

    if kind == "reset":
        return type(stage).clear
    if kind == "kv":
        assert isinstance(payload, KvOp)
        try:
            stage.ctx.check_kv(payload)
            check_kv_positions(payload, stage.n_ctx)
        except (ValueError, PotluckError) as e:
            return refuse(str(e))
        return payload
    if kind == "skip":
        empty = np.zeros(0, dtype=np.int32)
        return DecodeJob(int(payload), empty, empty, empty, np.zeros(0, dtype=bool))
    if kind == "job":
        assert isinstance(payload, DecodeJob)
        try:
            stage.check(payload)
        except PotluckError as e:
            return refuse(str(e))
        return payload
    return refuse(f"unknown work item {kind!r}")


def check_kv_positions(op: KvOp, n_ctx: int) -> None:
    """Positions and shifts inside the context, before llama.cpp's int32 arguments see them."""
    for name, p in (("p0", op.p0), ("p1", op.p1)):
        if not -1 <= p <= n_ctx:
            raise PotluckError(f"kv {op.op}: {name} {p} outside -1..{n_ctx}")
    if not -n_ctx <= op.delta <= n_ctx:
        raise PotluckError(f"kv {op.op}: shift {op.delta} larger than the context ({n_ctx})")
