"""A worker's stage in a supervised child process, so llama.cpp can abort without killing the worker.

llama.cpp ends the whole process on a failed ``GGML_ASSERT`` (a slice it cannot load,
docs/facts.md §5) and its GGUF loader has a history of memory-corruption bugs. The worker
therefore never maps a model itself: :class:`StageProcess` spawns a child that loads the
cached slice (proven intact by the worker: slice_store.py) as one
:class:`~potluck.engine.core.stage.Stage` and runs its
:class:`~potluck.engine.core.runner.StageRunner`. The worker's socket thread talks to it over
two pipes and reads the replies itself, turning them into the futures it waits on. When the
child dies (SIGABRT, SIGSEGV, killed), every pending future fails with
:class:`StageCrashed` naming the signal, and the worker frees the stage and serves the next head.

Each batch crosses as few threads as possible (docs/facts.md §23): a thread wake-up costs
50-200 µs on a virtual machine, which is most of a hop's own cost on a small model.

The worker never waits on the child: work is written without blocking (what the pipe does not
take yet waits in :attr:`StageProcess` 's own buffer, written when the pipe has room), the
work queued beyond the child is bounded (:meth:`StageProcess.over_limit`), and :meth:`close`
never writes to a full pipe. Once both sent on a full pipe at once (the worker its work, the
child its results, ~219 KB each way): neither read again, and the worker ignored SIGTERM
(issue 39 item 9). A child exits at once when told to close or when its control pipe ends,
which is also how it learns that its worker died (the kernel closes a dead process's ends).

Every job is checked by the stage inside the child, in its place in the queue, so a refused
batch keeps the transaction order like any other.
"""

from __future__ import annotations

import itertools
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np

from ..core.errors import PotluckError
from ..core.jobs import DecodeJob, GroupCancelled
from ..core.kv import KvOp
from ..core.printable import PrintableFormatter

log = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 5.0
CLOSE_WAIT_S = 1.0  # a stage process that has not exited this long after close() is killed
PENDING_FLOOR_BYTES = 64 << 20  # work a stage may hold queued, at the least (see StageProcess.limit)
PENDING_ITEMS = 1 << 16


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
    # core/batch_exact.py's judgment of this slice as loaded here (this CPU, repacked or not),
    # as plain fields: the worker process never imports llama.cpp
    max_rows: int
    two_row_steps: bool
    exact_reason: str


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
    """One child process serving one stage; :meth:`load` once, then submit work in order.

    Owned by one thread (the worker's socket thread), which also reads the replies: it polls
    :meth:`fileno` and calls :meth:`take_replies`, so a finished batch reaches the thread that
    sends it on without a hand-off. Two pipes: work (jobs, KV operations, resets) is computed
    in order by the child thread that reads it; control (cancel, status) is read by another
    child thread, so it reaches a running batch.
    """

    def __init__(self) -> None:
        # A fresh interpreter that imports this module and core only. multiprocessing's spawn
        # would also import the worker's __main__ again (the whole command line, every
        # strategy): 1 to 3 s of CPU per stage process, and a worker starts one per load.
        # Never fork: the worker holds sockets and threads.
        ours, theirs = socket.socketpair()
        ours_ctl, theirs_ctl = socket.socketpair()
        self._conn = Connection(ours.detach())
        self._control = Connection(ours_ctl.detach())
        fds = (theirs.fileno(), theirs_ctl.fileno())
        code = f"from potluck.engine.cluster.child import serve_stage; serve_stage{fds}"
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=fds, stdin=subprocess.DEVNULL)
        theirs.close()
        theirs_ctl.close()
        self._fd = self._conn.fileno()  # kept: the poller unregisters it after close
        os.set_blocking(self._conn.fileno(), False)  # the worker's writes never wait (see _flush)
        os.set_blocking(self._control.fileno(), False)
        self._out = bytearray()  # work written to no pipe yet (the pipe was full)
        self._out_control = bytearray()  # the same for the control pipe
        self._pending: dict[int, Future] = {}
        self._pending_bytes: dict[int, int] = {}
        self.queued_bytes = 0  # work sent and not yet answered, or not yet sent
        self.limit_bytes = PENDING_FLOOR_BYTES
        self._seq = itertools.count(1)
        self.crashed: str | None = None
        self.on_crash: Callable[[str], None] | None = None
        self._loaded = False
        self._ended = False  # the child's end was seen (pending work failed)
        self._closing = False  # close() asked the child to end: its exit is no loss

    # -- lifetime
    def load(self, spec: StageSpec, timeout_s: float) -> StageInfo:
        """Load the slice in the child; raises PotluckError (refused) or StageCrashed."""
        self._write(self._conn, ("load", spec))
        deadline = time.monotonic() + timeout_s
        while self._out and time.monotonic() < deadline:  # a load message is small: it fits at once
            self._flush(0.1)
        if self._out or not self._conn.poll(max(0.0, deadline - time.monotonic())):
            self.kill()
            self.close()
            raise StageCrashed(f"loading the slice took more than {timeout_s:g} s; the stage process was stopped")
        try:
            reply = self._recv()
        except (EOFError, OSError):
            why = f"the stage process {self._exit_reason()}"
            self.close()
            raise StageCrashed(why) from None
        if reply[0] == "failed":
            self.close()
            raise PotluckError(reply[1])
        self._loaded = True
        return reply[1]

    def fileno(self) -> int:
        """Readable when replies (or the child's end) are waiting: then call :meth:`take_replies`;
        writable, while :meth:`wants_write`, when the pipe has room again: then :meth:`flush`."""
        return self._fd

    @property
    def queued_items(self) -> int:
        """Work items sent (or waiting to be) and not yet answered."""
        return len(self._pending)

    @property
    def unsent_bytes(self) -> int:
        """Bytes of work waiting for room in the pipe."""
        return len(self._out)

    def wants_write(self) -> bool:
        """Whether work waits for room in the pipe (the worker polls for it: :meth:`flush`)."""
        return bool(self._out) and not self._closing

    def flush(self) -> None:
        """Write what the pipe takes now of the work waiting for room."""
        self._flush(0.0)

    def over_limit(self, size: int = 0) -> bool:
        """Whether queuing ``size`` more bytes of work would pass what this stage may hold
        queued (:attr:`limit_bytes`, or :data:`PENDING_ITEMS` items): the worker refuses it."""
        return self.queued_bytes + size > self.limit_bytes or len(self._pending) >= PENDING_ITEMS

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """End the child (a release, or the worker stopping): :meth:`begin_close`, then wait up
        to ``wait_s`` for it to exit and kill it if it has not. Either way the stage was
        released, not lost."""
        self.begin_close()
        self.end_close(time.monotonic() + wait_s)

    def begin_close(self) -> None:
        """Tell the child to end without waiting on anything: a close request if its control
        pipe has room, and the end of both pipes (its control thread exits on either, and a
        child blocked writing a result gets EPIPE)."""
        if self._closing:
            return
        self._closing = True
        self._out_control += _frame(("close",))
        _write_some(self._control, self._out_control)  # a few bytes; whatever fits, never waiting
        self._conn.close()
        self._control.close()
        self._out.clear()
        self._fail_pending(StageCrashed("the stage was released"))

    def end_close(self, deadline: float) -> None:
        """Wait for the child until ``deadline`` (monotonic), then kill it."""
        self._join(max(0.0, deadline - time.monotonic()))
        if self.proc.poll() is None:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self._join(2.0)

    # -- work
    def submit(self, kind: str, payload: object = None) -> Future:
        """``kind``: "job" (DecodeJob), "kv" (KvOp), "reset", "renew" (a new head takes the
        loaded stage over) or "skip" (job group of a placeholder). Never waits: what the pipe
        cannot take yet is written by :meth:`flush`. The future is resolved by :meth:`take_replies`."""
        return self._request(self._conn, kind, payload)

    def take_replies(self) -> None:
        """Resolve the futures of the replies that arrived (their callbacks run here). If the
        child has ended, every pending future fails and :attr:`on_crash` is told why."""
        if self._ended or not self._loaded or self._closing:
            return
        try:
            self._flush(0.0)
            while self._conn.poll(0):
                _, n, ok, payload = self._recv()
                self.queued_bytes -= self._pending_bytes.pop(n, 0)
                fut = self._pending.pop(n, None)
                if fut is None or fut.done():
                    continue
                if ok:
                    fut.set_result(payload)
                else:
                    fut.set_exception(_error(payload))
        except (EOFError, OSError):
            self._child_ended()

    def settle(self, timeout_s: float) -> bool:
        """Take replies until nothing is pending, waiting at most ``timeout_s``: whether it
        became idle (a stage kept for the next head must hold no work of the last)."""
        deadline = time.monotonic() + timeout_s
        self.take_replies()
        while self._pending and not (self._ended or self._closing):
            left = deadline - time.monotonic()
            if left <= 0 or not self._conn.poll(left):
                break
            self.take_replies()
        return not self._pending

    def cancel(self, group: int, *more: int) -> None:
        """Best effort, never waiting: the child's control thread reads its pipe at once (a
        cancel lost to a full pipe only lets a batch compute that would have been aborted;
        the worker skips the group's later batches itself)."""
        if self._closing:
            return
        self._out_control += _frame(("cancel", (group, *more)))
        _write_some(self._control, self._out_control)

    def status(self) -> StageStatus:
        """The child's counters (answered beside a running batch); replies that arrive
        meanwhile are taken as :meth:`take_replies` would."""
        fut: Future = Future()
        if self.crashed is not None or self._closing:
            raise PotluckError("the stage process is gone")
        n = next(self._seq)
        self._pending[n] = fut
        self._out_control += _frame(("status", n, None))
        deadline = time.monotonic() + STATUS_TIMEOUT_S
        while not fut.done():
            left = deadline - time.monotonic()
            if left <= 0 or self._ended:
                break
            try:
                _write_some(self._control, self._out_control)
                if self._conn.poll(min(left, 0.05)):
                    self.take_replies()
                else:
                    self._flush(0.0)
            except (EOFError, OSError):
                self._child_ended()
        if not fut.done():
            self._pending.pop(n, None)
            raise PotluckError("the stage process did not answer a status request")
        return fut.result()

    # -- internals
    def _request(self, conn: Connection, kind: str, payload: object = None) -> Future:
        fut: Future = Future()
        if self.crashed is not None or self._closing:
            fut.set_exception(StageCrashed(self.crashed or "the stage was released"))
            return fut
        n = next(self._seq)
        data = _frame((kind, n, payload))
        self._pending[n] = fut
        self._pending_bytes[n] = len(data)
        self.queued_bytes += len(data)
        self._out += data
        self._flush(0.0)
        return fut

    def _write(self, conn: Connection, msg: tuple) -> None:
        """Queue ``msg`` on the work pipe (the load, before any work)."""
        assert conn is self._conn
        self._out += _frame(msg)
        self._flush(0.0)

    def _flush(self, wait_s: float) -> None:
        """Write what the pipes take of what waits for them, waiting at most ``wait_s`` for
        room in the work pipe."""
        if self._closing:
            return
        if self._out_control:
            _write_some(self._control, self._out_control)
        if self._out and wait_s > 0:
            select.select([], [self._conn.fileno()], [], wait_s)
        _write_some(self._conn, self._out)

    def _recv(self) -> object:
        """One message from the work pipe, whose descriptor is non-blocking: the bytes of a
        message the child started writing are waited for (it writes them whole)."""
        os.set_blocking(self._conn.fileno(), True)
        try:
            return self._conn.recv()
        finally:
            os.set_blocking(self._conn.fileno(), False)

    def _join(self, timeout_s: float) -> int | None:
        """The child's exit status (negative: the signal that ended it), or None if it still runs."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def _exit_reason(self) -> str:
        return describe_exit(self._join(2.0))

    def _child_ended(self) -> None:
        """The work pipe closed: a release, or the child died (a crash, told to on_crash)."""
        self._ended = True
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
        pending, self._pending = self._pending, {}
        self._pending_bytes.clear()
        self.queued_bytes = len(self._out)
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)


def _write_some(conn: Connection, out: bytearray) -> None:
    """Write what ``conn``'s non-blocking descriptor takes of ``out`` now (and drop it from
    ``out``); a pipe whose reader is gone drops everything (its end is seen when reading)."""
    try:
        while out:
            n = os.write(conn.fileno(), out)
            del out[:n]
    except BlockingIOError:
        return
    except (OSError, ValueError):  # EPIPE, a closed handle
        out.clear()


def _frame(msg: tuple) -> bytes:
    """``msg`` as :class:`multiprocessing.connection.Connection` frames it (a 4-byte length,
    then the pickle), so the child reads it with ``recv``."""
    data = bytes(ForkingPickler.dumps(msg))
    if len(data) > 0x7FFFFFFF:
        raise PotluckError("a work item of more than 2 GB")
    return struct.pack("!i", len(data)) + data


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


def serve_stage(fd: int, control_fd: int) -> None:  # pragma: no cover - runs in the child process
    """Load the stage, then compute work items from ``fd`` in order on this thread until
    ``close`` or the worker goes away (the end of the connection); a second thread reads
    ``control_fd`` (cancel, status), so those reach a running batch."""
    handler = logging.StreamHandler()
    handler.setFormatter(PrintableFormatter("potluck stage: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[handler])
    conn, control = Connection(fd), Connection(control_fd)
    from ..core import runner, runtime, stage  # noqa: F401 - llama.cpp loads while the worker waits for a load
    from ..core.observe import native_observer

    # loaded meanwhile too (numba's start and its cache, ~0.5 s of CPU): a capture runs through it
    native_observer()
    try:
        msg = conn.recv()
    except (EOFError, OSError):
        os._exit(0)  # closed before any load (a spare): nothing to free, no interpreter teardown (~1 s)
    if msg[0] != "load":
        os._exit(0)
    spec: StageSpec = msg[1]
    try:
        stage, runner = _open(spec)
    except Exception as e:
        conn.send(("failed", str(e) if isinstance(e, PotluckError) else f"{type(e).__name__}: {e}"))
        return
    m, exact = stage.model, stage.model.batch_exact
    conn.send(("ready", StageInfo(m.n_layer, m.n_embd, m.n_vocab, stage.n_ctx,
                                  exact.max_rows, exact.two_row_steps, exact.reason)))
    send_lock = threading.Lock()

    def reply(n: int, ok: bool, payload: object) -> None:
        try:
            with send_lock:
                conn.send(("done", n, ok, payload))
        except (OSError, ValueError):
            pass

    threading.Thread(target=_serve_control, args=(control, runner, reply), name="potluck-stage-control",
                     daemon=True).start()
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "close":
                break
            n, payload = msg[1], msg[2]
            if kind == "renew":  # a new head takes the loaded stage over: nothing of the last one stays
                runner.renew()
                fut = runner.run(type(stage).forget_all)
            else:
                fut = runner.run(_work_item(stage, kind, payload))
            err = fut.exception()
            reply(n, err is None, fut.result() if err is None else _encode_error(err))
    finally:
        runner.close()
        stage.close()
        stage.model.close()


def _serve_control(control: Connection, runner, reply: Callable[[int, bool, object], None]) -> None:  # pragma: no cover
    """Cancels and status requests, beside the batch the main thread computes. A close request,
    or the end of the pipe (the worker closed it, or died), ends the process at once: nothing
    here outlives the worker's interest (its main thread may be mid-batch, or writing a result
    nobody reads)."""
    while True:
        try:
            msg = control.recv()
        except (EOFError, OSError):
            msg = ("close",)
        kind = msg[0]
        if kind == "cancel":
            runner.cancel(*msg[1])
        elif kind == "status":
            c, running = runner.counters, runner.running_group
            reply(msg[1], True, StageStatus(c.finished, c.aborted, c.skipped, -1 if running is None else running,
                                            tuple(runner.positions), c.busy_s))
        elif kind == "close":
            runner.close()  # abort the running batch (llama.cpp's abort flag), then go
            os._exit(0)


def _open(spec: StageSpec):  # pragma: no cover - child
    from ..core.memory import advise_random_reads
    from ..core.runner import StageRunner
    from ..core.runtime import ContextParams, Model
    from ..core.stage import Stage

    # proven intact by the worker just before (slice_store.has). A first stage maps its slice
    # (it reads an embedding row a token, and mapped rows are what the plan counts); a later
    # one reads its weights in, so it never holds them twice (Model's ``mapped``).
    model = Model(Path(spec.path), mapped=spec.first)
    advise_random_reads(Path(spec.path))  # read by rows from now on, not by windows of MBs
    try:
        params = ContextParams(n_ctx=spec.n_ctx, n_batch=spec.n_batch, n_seq_max=spec.n_seq_max,
                               n_threads=spec.n_threads, kv_unified=spec.kv_unified,
                               follow_load=spec.n_threads == 0)
        stage = Stage(model, first=spec.first, last=False, params=params)
    except BaseException:
        model.close()
        raise
    return stage, StageRunner(stage, name="stage", threaded=False)


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
