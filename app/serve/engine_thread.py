"""The one thread that runs the engine for every HTTP request, in arrival order.

A session is not thread-safe, and in cluster mode the pipeline's sockets belong to the thread
that made them, so a single thread opens the session and serves a bounded FIFO of jobs: first
come, first served, each request answered exactly as it would be alone. Past the bound a
request is refused at once (the HTTP layer answers 429). A job takes its place in the queue
when it arrives, but the engine takes it only once its prompt is tokenized, which the HTTP
side does on another thread: a huge prompt never holds the engine while it is tokenized, and
requests that arrive behind it run first. A job cancelled while it waits leaves the queue;
one cancelled while it runs is stopped through the session's cancel, which also aborts a
prompt being processed mid-batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ...engine import Finished, NodeStatus, PlanChanged, PotluckError, Prompt, ReplyStarted, Session, TokenText
from .protocol import ApiError, GenerationRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    """How a reply ended, with the figures the response and the log line report."""

    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int  # prompt tokens whose KV came from a cache (not processed again)
    strategy: str
    drafted: int
    accepted: int
    tokens_per_s: float
    ttft_s: float


class StopScanner:
    """Holds back text that may be the start of a stop string; cuts the text at the first one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to send now, whether a stop string was reached)."""
        buf = self.pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.pending = ""
            return buf[: min(hits)], True
        keep = max((k for s in self.stops for k in range(1, min(len(s) - 1, len(buf)) + 1)
                    if buf.endswith(s[:k])), default=0)
        self.pending = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Job:
    """One request on its way through the engine; its events arrive on ``events`` in the event loop."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop, owner: str = "") -> None:
        self.request = request
        self.owner = owner  # the API key's name: kept conversations are reused only for it
        self.prompt: Prompt | None = None  # set once tokenized (EngineThread.ready)
        self.loop = loop
        self.events: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.finished = threading.Event()
        self.run_id: int | None = None
        self.queued_at = time.monotonic()

    def put(self, kind: str, item: object) -> None:
        """From the engine thread: ("text", str), ("done", Outcome) or ("error", ApiError)."""
        if kind != "text":
            self.finished.set()
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, item))
        except RuntimeError:  # the event loop is gone (shutting down)
            pass


class QueueFull(Exception):
    def __init__(self, retry_after_s: int) -> None:
        super().__init__("busy")
        self.retry_after_s = retry_after_s


class EngineThread:
    """Opens the session with ``opener`` on its own thread, then serves jobs one at a time."""

    def __init__(self, opener: Callable[[], Session], max_queue: int) -> None:
        self.max_queue = max_queue
        self.session: Session | None = None
        self.state = "loading"  # loading | ready | failed | stopped
        self.error = ""  # why it failed, or the last engine failure (shown by /health)
        self.notice = ""  # the last cluster notice (a worker lost and replaced)
        self.nodes: dict[str, NodeStatus] = {}  # cluster mode: each stage's health at the last report
        self.counters = dict.fromkeys(
            ("requests", "completed", "cancelled_waiting", "cancelled_running", "cancelled_before_decoding",
             "refused_busy", "refused_prompt", "failed", "prompt_tokens", "reused_tokens", "completion_tokens"), 0)
        self._opener = opener
        self._queue: deque[Job] = deque()
        self._running: Job | None = None
        self._cond = threading.Condition()
        self._stop = False
        self._mean_s = 2.0  # running mean of a request's engine time (Retry-After)
        self.loaded = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="potluck-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- called from the event loop
    def submit(self, job: Job) -> None:
        with self._cond:
            in_line = len(self._queue) + (self._running is not None)  # an idle engine takes the first at once
            if in_line > self.max_queue:
                self.counters["refused_busy"] += 1
                raise QueueFull(max(1, round(self._mean_s * in_line)))
            self.counters["requests"] += 1
            self._queue.append(job)
            self._cond.notify()

    def ready(self, job: Job, prompt: Prompt) -> None:
        """``job``'s prompt is tokenized: the engine may take it."""
        with self._cond:
            job.prompt = prompt
            self._cond.notify()

    def withdraw(self, job: Job) -> None:
        """``job`` will never be ready (its prompt was refused): give its place back."""
        with self._cond:
            if job in self._queue:
                self._queue.remove(job)
                self.counters["refused_prompt"] += 1

    def cancel(self, job: Job) -> None:
        """Stop ``job`` at once: out of the queue if it waits, through the session if it runs."""
        with self._cond:
            if job.cancelled.is_set() or job.finished.is_set():
                return
            job.cancelled.set()
            if job in self._queue:
                self._queue.remove(job)
                self.counters["cancelled_waiting"] += 1
                return
            run_id = job.run_id if self._running is job else None
        if run_id is not None and self.session is not None:
            self.session.cancel(run_id)

    def waiting(self) -> tuple[bool, int]:
        with self._cond:
            return self._running is not None, len(self._queue)

    def drain(self) -> None:
        """Shutting down: refuse the waiting jobs and cancel the running one; returns at once."""
        with self._cond:
            self._stop = True
            for job in self._queue:
                job.put("error", ApiError(503, "the server is shutting down"))
            self._queue.clear()
            self._cond.notify()
            running = self._running
        if running is not None:
            self.cancel(running)

    def stop(self) -> None:
        self.drain()
        self._thread.join(timeout=30)

    # -- the engine thread
    def _serve(self) -> None:
        try:
            self.session = self._opener()
            self.state = "ready"
        except PotluckError as e:
            self.state, self.error = "failed", str(e)
        except Exception as e:  # never a traceback on the console for a load failure
            log.exception("loading the model failed")
            self.state, self.error = "failed", f"loading the model failed: {e}"
        finally:
            self.loaded.set()
        if self.session is None:
            return
        try:
            while True:
                with self._cond:
                    while not self._stop and (job := self._first_ready()) is None:
                        self._cond.wait()
                    if self._stop:
                        return
                    assert job is not None
                    self._queue.remove(job)
                    self._running = job
                started = time.monotonic()
                try:
                    self._run(job)
                finally:
                    with self._cond:
                        self._running = None
                    self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - started)
        finally:
            self.session.close()
            self.state = "stopped"

    def _first_ready(self) -> Job | None:
        return next((job for job in self._queue if job.prompt is not None), None)

    def _run(self, job: Job) -> None:
        session = self.session
        assert session is not None and job.prompt is not None
        req = job.request
        started = False
        try:
            # no max_tokens: to the end of the reply, or of the context (finish_reason "length")
            max_tokens = req.max_tokens if req.max_tokens is not None else session.target.n_ctx
            events = session.answer(job.prompt, req.sampling, max_tokens, owner=job.owner)
            scanner = StopScanner(req.stop)
            stopped = False
            finished: Finished | None = None
            for event in events:
                if isinstance(event, ReplyStarted):
                    started = True
                    with self._cond:
                        job.run_id = event.run_id
                    if job.cancelled.is_set():  # hung up before its run had an id
                        session.cancel(event.run_id)
                elif isinstance(event, TokenText) and not stopped:
                    text, stopped = scanner.feed(event.text)
                    if text:
                        job.put("text", text)
                    if stopped:
                        session.cancel(event.run_id)
                elif isinstance(event, NodeStatus):
                    self.nodes[event.node] = event
                elif isinstance(event, PlanChanged):
                    self.notice = event.reason
                    log.warning("%s", event.reason)
                elif isinstance(event, Finished):
                    finished = event
            assert finished is not None
            if not stopped:
                tail = scanner.flush()
                if tail:
                    job.put("text", tail)
            job.put("done", self._outcome(job, finished, stopped))
        except PotluckError as e:
            # before the reply started: the request's fault (a prompt longer than the context);
            # after: the engine's (a cluster that lost its workers for good)
            self.counters["failed"] += started
            if started:
                self.error = str(e)
            job.put("error", ApiError(503, str(e)) if started else ApiError(400, str(e), code="invalid_prompt"))
        except Exception as e:
            log.exception("request %s failed", req.id)
            self.counters["failed"] += 1
            self.error = f"internal error: {type(e).__name__}"
            job.put("error", ApiError(500, f"internal error ({type(e).__name__}); see the server's log"))

    def _outcome(self, job: Job, f: Finished, stopped: bool) -> Outcome:
        if stopped:
            reason = "stop"
        elif f.reason == "cancelled":
            reason = "cancelled"
            self.counters["cancelled_running"] += 1
            self.counters["cancelled_before_decoding"] += not f.tokens  # e.g. mid-prompt: no token decoded
        else:
            reason = "stop" if f.reason == "stop" else "length"  # length or context_full
        reused = f.prompt_tokens - f.prefill_tokens if f.prefill_tokens or f.tokens else 0
        c = self.counters
        c["completed"] += reason != "cancelled"
        c["prompt_tokens"] += f.prompt_tokens
        c["reused_tokens"] += reused
        c["completion_tokens"] += len(f.tokens)
        return Outcome(
            finish_reason=reason, prompt_tokens=f.prompt_tokens, completion_tokens=len(f.tokens),
            reused_tokens=reused, strategy=f.strategy, drafted=f.drafted, accepted=f.accepted,
            tokens_per_s=f.tokens_per_s, ttft_s=f.ttft_s,
        )
