"""The engine's threads: the one that owns the target, and one per lane that runs a conversation.

A session is not thread-safe, and in cluster mode the pipeline's sockets belong to the thread
that made them, so one thread opens the lanes (engine/core/lanes.py: up to ``parallel``
conversations decoded together, each on its own session) and owns their shared target: it
hands each waiting request to a free lane in arrival order (first come, first served), and
in between it runs the lanes' hub, which sends the lanes' steps to the target as one batch.
Each lane's thread runs its request's reply, and every answer is what the request would get
alone. Past the bound a request is refused at once (the HTTP layer answers 429). A job takes
its place in the queue when it arrives, but a lane takes it only once its prompt is tokenized,
which the HTTP side does on another thread: a huge prompt never holds the engine while it is
tokenized, and requests that arrive behind it run first. A job cancelled while it waits
leaves the queue; one cancelled while it runs is stopped through its session's cancel, which
also aborts a prompt being processed mid-batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ...engine import (
    CallPart,
    CallScanner,
    ClusterView,
    Finished,
    GrammarSpec,
    HarmonyScanner,
    Lanes,
    Model,
    NodeStatus,
    PlanChanged,
    PotluckError,
    Prompt,
    PromptCache,
    ReplyStarted,
    Session,
    TextStream,
    ThinkSplitter,
    TokenText,
    ToolCall,
    harmony_bytes,
    opens_thinking,
)
from .protocol import ApiError, GenerationRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Delta:
    """New text of one choice, with its tokens' log-probabilities when the request asked
    (OpenAI's entries: token, logprob, bytes, top_logprobs)."""

    choice: int
    text: str
    logprobs: tuple[dict[str, Any], ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()  # the choice's calls, once it ended (not streamed as parts)
    call_parts: tuple[CallPart, ...] = ()  # pieces of forced calls, streamed as they are written
    reasoning: str = ""  # thinking, told apart from the answer (``reasoning_content``)


@dataclass(frozen=True)
class Outcome:
    """How a reply ended, with the figures the response and the log line report."""

    finish_reason: str  # "stop" | "length" | "cancelled": the first choice's (the log line's)
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int  # prompt tokens whose KV came from a cache (not processed again)
    strategy: str
    drafted: int
    accepted: int
    tokens_per_s: float
    ttft_s: float
    finish_reasons: tuple[str, ...] = ()  # each choice's


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
        self.grammar: GrammarSpec | None = request.grammar  # or a tool call's, set when tokenized
        self.tool_format = ""  # the template's call format, when the request has tools
        self.split_thinking = False  # the template thinks and [server] reasoning is on
        self.template = ""  # the chat template's source, once tokenized: how its replies think
        self.harmony = False  # a chat reply in gpt-oss's channels (read by HarmonyScanner)
        self.loop = loop
        self.events: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.timed_out = False  # cancelled by request_timeout_s, not by its client (the log line)
        self.finished = threading.Event()
        self.run_id: int | None = None
        self.queued_at = time.monotonic()

    def put(self, kind: str, item: object) -> None:
        """From the engine thread: ("text", Delta), ("done", Outcome) or ("error", ApiError)."""
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


def shared_chars(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share: a binary search of slice compares,
    so a long conversation costs the owner thread a few C-speed passes, not a Python loop."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class EngineThread:
    """Opens the lanes with ``opener`` on its own thread, then serves jobs, one a lane at a time."""

    IDLE_WAIT_S = 1.0  # the owner thread's longest sleep with nothing to do (a submit wakes it)

    def __init__(self, opener: Callable[[], Lanes], max_queue: int) -> None:
        self.max_queue = max_queue
        self.lanes: Lanes | None = None
        self.state = "loading"  # loading | ready | failed | stopped
        self.error = ""  # why it failed, or the last engine failure (shown by /health)
        self.notice = ""  # the last cluster notice (a worker lost and replaced)
        self.nodes: dict[str, NodeStatus] = {}  # cluster mode: each stage's health at the last report
        self.counters = dict.fromkeys(
            ("requests", "completed", "cancelled_waiting", "cancelled_running", "cancelled_before_decoding",
             "refused_busy", "refused_prompt", "failed", "prompt_tokens", "reused_tokens", "completion_tokens",
             "drafted", "accepted", "stopped_by_string"), 0)
        self.counters.update(prompt_seconds=0.0, predicted_seconds=0.0)  # prompt processing, generation
        self.on_outcome: Callable[[Outcome], None] | None = None  # /metrics' time to first token
        self._opener = opener
        self._queue: deque[Job] = deque()
        self._running: dict[int, Job] = {}  # lane -> the job it runs
        self._last_used: list[float] = []  # per lane: when its last job was handed to it
        self._cond = threading.Condition()
        self._stop = False
        self._mean_s = 2.0  # running mean of a request's engine time (Retry-After)
        self.loaded = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="potluck-engine", daemon=True)
        self._lane_threads: list[threading.Thread] = []

    @property
    def n_lanes(self) -> int:
        return len(self.lanes.sessions) if self.lanes is not None else 1

    @property
    def session(self) -> Session | None:
        """A lane's session (None while loading), for what every lane shares: the model's
        prompts (thread-safe: the HTTP side tokenizes with them), the prompt cache, the cluster."""
        return self.lanes.sessions[0] if self.lanes is not None else None

    @property
    def prompt_cache(self) -> PromptCache | None:
        return self.session.prompt_cache if self.session is not None else None

    def cluster_view(self) -> ClusterView | None:
        return self.session.cluster_view() if self.session is not None else None

    def batching(self) -> dict[str, int] | None:
        """What the lanes' hub sent (None while loading): proof that conversations shared batches."""
        return asdict(self.lanes.hub.counters) if self.lanes is not None else None

    def start(self) -> None:
        self._thread.start()

    # -- called from the event loop
    def submit(self, job: Job) -> None:
        with self._cond:
            in_line = len(self._queue) + len(self._running)  # an idle lane takes the first at once
            if in_line >= self.n_lanes + self.max_queue:
                self.counters["refused_busy"] += 1
                raise QueueFull(max(1, round(self._mean_s * (in_line + 1 - self.n_lanes) / self.n_lanes)))
            self.counters["requests"] += 1
            self._queue.append(job)
            self._cond.notify_all()
        self._wake()

    def ready(self, job: Job, prompt: Prompt) -> None:
        """``job``'s prompt is tokenized: the engine may take it."""
        with self._cond:
            job.prompt = prompt
            self._cond.notify_all()
        self._wake()  # the owner thread may sleep in the hub

    def withdraw(self, job: Job) -> None:
        """``job`` will never be ready (its prompt was refused): give its place back."""
        with self._cond:
            if job in self._queue:
                self._queue.remove(job)
                self.counters["refused_prompt"] += 1

    def cancel(self, job: Job) -> None:
        """Stop ``job`` at once: out of the queue if it waits, through its session if it runs."""
        with self._cond:
            if job.cancelled.is_set() or job.finished.is_set():
                return
            job.cancelled.set()
            if job in self._queue:
                self._queue.remove(job)
                self.counters["cancelled_waiting"] += 1
                return
            lane = next((i for i, j in self._running.items() if j is job), None)
            run_id = job.run_id if lane is not None else None
        if run_id is not None and lane is not None and self.lanes is not None:
            self.lanes.sessions[lane].cancel(run_id)

    def waiting(self) -> tuple[int, int]:
        """(requests running, requests waiting). A request whose answer is out no longer runs,
        though its lane may still be tidying up (a client reads /metrics right after it)."""
        with self._cond:
            return sum(not j.finished.is_set() for j in self._running.values()), len(self._queue)

    def drain(self) -> None:
        """Shutting down: refuse the waiting jobs and cancel the running ones; returns at once."""
        with self._cond:
            self._stop = True
            for job in self._queue:
                job.put("error", ApiError(503, "the server is shutting down"))
            self._queue.clear()
            self._cond.notify_all()
            running = list(self._running.values())
        for job in running:
            self.cancel(job)
        self._wake()

    def stop(self) -> None:
        self.drain()
        self._thread.join(timeout=30)

    def _wake(self) -> None:
        if self.lanes is not None:
            self.lanes.hub.wake()

    # -- the owner thread
    def _serve(self) -> None:
        try:
            self.lanes = self._opener()
            self._last_used = [0.0] * self.n_lanes
            self.state = "ready"
        except PotluckError as e:
            self.state, self.error = "failed", str(e)
        except Exception as e:  # never a traceback on the console for a load failure
            log.exception("loading the model failed")
            self.state, self.error = "failed", f"loading the model failed: {e}"
        finally:
            self.loaded.set()
        lanes = self.lanes
        if lanes is None:
            return
        self._lane_threads = [threading.Thread(target=self._lane, args=(i,), name=f"potluck-lane-{i}", daemon=True)
                              for i in range(self.n_lanes)]
        for t in self._lane_threads:
            t.start()
        try:
            while True:
                with self._cond:
                    if self._stop and not self._running:
                        return
                    idle = not self._running and self._first_ready() is not None
                if idle:  # between replies: a cluster may take in workers that joined
                    lanes.hub.regroup()
                with self._cond:
                    self._admit()
                try:
                    lanes.hub.step(self.IDLE_WAIT_S)
                except Exception as e:  # the lanes got their errors; the server lives on
                    log.exception("the engine's hub failed")
                    self.error = f"internal error: {type(e).__name__}"
                    time.sleep(0.1)
        finally:
            with self._cond:
                self._stop = True
                self._cond.notify_all()
            for t in self._lane_threads:
                t.join(timeout=30)
            lanes.close()
            self.state = "stopped"

    def _admit(self) -> None:
        """Hand waiting jobs to free lanes, oldest first (the lock held)."""
        assert self.lanes is not None
        while not self._stop and len(self._running) < self.n_lanes and (job := self._first_ready()) is not None:
            self._queue.remove(job)
            lane = self._pick_lane(job)
            self._running[lane] = job
            self._last_used[lane] = time.monotonic()
            self.lanes.hub.activate(lane)
            self._cond.notify_all()

    def _pick_lane(self, job: Job) -> int:
        """The free lane whose conversation the request continues furthest (only its own API
        key's conversation counts); else the one used least recently (its conversation goes to
        the prompt cache)."""
        assert self.lanes is not None and job.prompt is not None
        free = [i for i in range(self.n_lanes) if i not in self._running]
        text, sessions = job.prompt.text, self.lanes.sessions
        return max(free, key=lambda i: (shared_chars(sessions[i].held_text(job.owner), text), -self._last_used[i]))

    def _first_ready(self) -> Job | None:
        return next((job for job in self._queue if job.prompt is not None), None)

    # -- a lane's thread
    def _lane(self, lane: int) -> None:
        assert self.lanes is not None
        hub = self.lanes.hub
        while True:
            with self._cond:
                while lane not in self._running and not self._stop:
                    self._cond.wait()
                job = self._running.get(lane)
                if job is None:
                    return
            started = time.monotonic()
            try:
                self._run(self.lanes.sessions[lane], job)
            finally:
                with self._cond:
                    del self._running[lane]
                    self._mean_s = 0.8 * self._mean_s + 0.2 * (time.monotonic() - started)
                    self._cond.notify_all()
                hub.activate(lane, False)

    def _run(self, session: Session, job: Job) -> None:
        assert job.prompt is not None
        req = job.request
        started = False
        try:
            # no max_tokens: to the end of the reply, or of the context (finish_reason "length")
            max_tokens = req.max_tokens if req.max_tokens is not None else session.target.n_ctx
            events = session.answer(job.prompt, req.sampling, max_tokens, owner=job.owner, grammar=job.grammar,
                                    logprobs=req.logprobs, n=req.n)
            readers = [ChoiceReader(job, session.model, c) for c in range(req.n)]
            finished: list[Finished] = []
            for event in events:
                if isinstance(event, ReplyStarted):
                    started = True
                    with self._cond:
                        job.run_id = event.run_id
                    if job.cancelled.is_set():  # hung up before its run had an id
                        session.cancel(event.run_id)
                elif isinstance(event, TokenText) and not readers[event.choice].stopped:
                    reader = readers[event.choice]
                    delta = reader.feed(event)
                    if delta is not None:
                        job.put("text", delta)
                    if reader.stopped:  # this choice ends here; with several, the next one begins
                        session.end_choice()
                        with self._cond:
                            self.counters["stopped_by_string"] += 1
                elif isinstance(event, NodeStatus):
                    self.nodes[event.node] = event
                elif isinstance(event, PlanChanged):
                    self.notice = event.reason
                    log.warning("%s", event.reason)
                elif isinstance(event, Finished):
                    finished.append(event)
                    delta = readers[event.choice].end()
                    if delta is not None:
                        job.put("text", delta)
            assert finished
            job.put("done", self._outcome(job, finished, readers))
        except PotluckError as e:
            # before the reply started: the request's fault (a prompt longer than the context);
            # after: the engine's (a cluster that lost its workers for good)
            with self._cond:
                self.counters["failed"] += started
            if started:
                self.error = str(e)
            job.put("error", ApiError(503, str(e)) if started else ApiError(400, str(e), code="invalid_prompt"))
        except Exception as e:
            log.exception("request %s failed", req.id)
            with self._cond:
                self.counters["failed"] += 1
            self.error = f"internal error: {type(e).__name__}"
            job.put("error", ApiError(500, f"internal error ({type(e).__name__}); see the server's log"))

    def _outcome(self, job: Job, ends: list[Finished], readers: list[ChoiceReader]) -> Outcome:
        reasons = []
        for f in ends:
            if readers[f.choice].called:
                reasons.append("tool_calls")
            elif readers[f.choice].stopped:
                reasons.append("stop")
            elif f.reason == "cancelled":
                reasons.append("cancelled")
            else:
                reasons.append("stop" if f.reason == "stop" else "length")  # length or context_full
        f = ends[0]
        reused = f.prompt_tokens - f.prefill_tokens if f.prefill_tokens or f.tokens else 0
        generated = sum(len(e.tokens) for e in ends)
        seconds = sum(len(e.tokens) / e.tokens_per_s for e in ends if e.tokens_per_s > 0)
        with self._cond:  # lanes finish on threads of their own
            c = self.counters
            c["cancelled_running"] += reasons[0] == "cancelled"
            c["cancelled_before_decoding"] += reasons[0] == "cancelled" and not f.tokens  # e.g. mid-prompt
            c["completed"] += reasons[0] != "cancelled"
            c["prompt_tokens"] += f.prompt_tokens
            c["reused_tokens"] += reused
            c["completion_tokens"] += generated
            c["drafted"] += sum(e.drafted for e in ends)
            c["accepted"] += sum(e.accepted for e in ends)
            c["prompt_seconds"] += f.ttft_s if f.prefill_tokens else 0.0
            c["predicted_seconds"] += seconds
        outcome = Outcome(
            finish_reason=reasons[0], prompt_tokens=f.prompt_tokens, completion_tokens=generated,
            reused_tokens=reused, strategy=f.strategy, drafted=sum(e.drafted for e in ends),
            accepted=sum(e.accepted for e in ends), tokens_per_s=generated / seconds if seconds else 0.0,
            ttft_s=f.ttft_s, finish_reasons=tuple(reasons),
        )
        if self.on_outcome is not None:
            self.on_outcome(outcome)
        return outcome


class ChoiceReader:
    """One choice's reply read for the client as it streams: cut at a stop string, its thinking
    told apart, its tool calls found (a harmony reply's channels read from its tokens)."""

    def __init__(self, job: Job, model: Model, choice: int) -> None:
        req = job.request
        self.model = model
        self.choice = choice
        self.stop = StopScanner(req.stop)
        self.stopped = False  # a stop string ended it
        self.called = False  # it ended in tool calls
        # forced calls (a grammar makes them well-formed) stream as they are written
        stream_calls = req.stream and req.tool_choice == "required"
        self.harmony = HarmonyScanner(req.tools, stream_calls, job.split_thinking) if job.harmony else None
        self.raw = TextStream()  # a harmony reply's text, its control tokens marked
        self.calls = CallScanner(job.tool_format, req.tools, stream_calls) if req.tools and not job.harmony else None
        opened = job.split_thinking and job.prompt is not None and opens_thinking(job.prompt.text)
        splits = job.split_thinking and not job.harmony
        self.thoughts = ThinkSplitter.for_template(job.template, opened) if splits else None

    def feed(self, event: TokenText) -> Delta | None:
        """The delta the client gets for ``event`` (None: nothing to send yet)."""
        logprobs = logprob_entries(self.model, event)
        if self.harmony is not None:
            read = self.harmony.feed(self.raw.feed(
                harmony_bytes(self.model, (t for t in event.token_ids if not self.model.is_eog(t)))))
            text, self.stopped = self.stop.feed(read.content)
            return self._delta(text, read.reasoning, tuple(read.parts), logprobs)
        text, self.stopped = self.stop.feed(event.text)
        thought, text = _split(self.thoughts, text)
        parts: tuple[CallPart, ...] = ()
        if self.calls is not None:
            text = self.calls.feed(text)
            parts = tuple(self.calls.parts())
        return self._delta(text, thought, parts, logprobs)

    def end(self) -> Delta | None:
        """The last delta, once the choice's reply ended: what was held back, and its calls."""
        found: tuple[ToolCall, ...] = ()
        if self.harmony is not None:
            read = self.harmony.feed(self.raw.flush())
            rest = self.harmony.finish()
            text, thought, parts = read.content + rest.content, read.reasoning + rest.reasoning, read.parts + rest.parts
            found = tuple(self.harmony.calls)
            streamed = self.harmony.stream_calls
            if not self.stopped:
                text, self.stopped = self.stop.feed(text)
                text += "" if self.stopped else self.stop.flush()
            else:
                text = ""
        else:
            parts = []
            text = "" if self.stopped else self.stop.flush()
            thought, text = _split(self.thoughts, text, end=True)
            streamed = False
            if self.calls is not None:
                text = self.calls.feed(text)
                rest_text, found = self.calls.finish()
                text += rest_text
                streamed = self.calls.stream_calls
        self.called = bool(found)
        if streamed:
            found = ()  # they went out as parts
        return self._delta(text, thought, tuple(parts), (), found)

    def _delta(self, text: str, thought: str, parts: tuple[CallPart, ...], logprobs: tuple[dict[str, Any], ...],
               calls: tuple[ToolCall, ...] = ()) -> Delta | None:
        if not (text or thought or logprobs or parts or calls):
            return None
        return Delta(self.choice, text, logprobs, tool_calls=calls, reasoning=thought, call_parts=parts)


def _split(splitter: ThinkSplitter | None, text: str, end: bool = False) -> tuple[str, str]:
    """(thinking, answer) of a reply's new text (all answer where thinking is not split)."""
    if splitter is None:
        return "", text
    thought, answer = splitter.feed(text)
    if end:
        more, rest = splitter.finish()
        thought, answer = thought + more, answer + rest
    return thought, answer


def logprob_entries(model: Model, event: TokenText) -> tuple[dict[str, Any], ...]:
    """``event``'s log-probabilities as OpenAI's chat entries (the completions shape is made
    from these)."""

    def token(t: int) -> tuple[str, list[int]]:
        raw = model.token_bytes(t)
        return raw.decode("utf-8", errors="replace"), list(raw)

    out = []
    for lp in event.logprobs:
        text, raw = token(lp.token)
        top = []
        for t, value in lp.top:
            t_text, t_raw = token(t)
            top.append({"token": t_text, "logprob": value, "bytes": t_raw})
        out.append({"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top})
    return tuple(out)
