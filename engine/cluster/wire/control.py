"""Control messages: joining a worker, moving a slice, loading and releasing a stage,
cancels, liveness and status. Each request's reply is in :data:`REPLY_TO`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ...core.archs import WIDE_WINDOW
from .base import DTYPES, HIDDEN_DTYPES, INT32_MAX, MAX_CANCEL, WireError, WireMessage, check_hex64

# The longest context a stage takes: no position of it reaches a widened slice's window
MAX_STAGE_CTX = WIDE_WINDOW


@dataclass(frozen=True)
class Hello(WireMessage):
    """Head -> worker: join. An idle worker's session goes to the holder of ``key``; a worker
    whose stage is loaded refuses every other key with code ``busy`` until its owner releases
    it or disconnects. The owner's hello (same key) on any connection rejoins."""

    TYPE = "hello"
    head_id: str
    potluck_version: str
    key: str  # 64 hex digits: the key that signs this head's later requests to this worker

    def check(self) -> None:
        check_hex64(self.key, "hello key")


@dataclass(frozen=True)
class Welcome(WireMessage):
    """Worker -> head: who it is and what it offers."""

    TYPE = "welcome"
    node_id: str
    potluck_version: str
    cores: int
    free_mb: int
    speed: float
    state: str
    max_message: int  # bytes: the head sizes file chunks below it


@dataclass(frozen=True)
class Offer(WireMessage):
    """Head -> worker: "do you have this file?" (by sha256). It is layers ``[layer_lo,
    layer_hi)`` of the model ``source_sha256``: a worker holding that model (``--models``)
    cuts the slice itself."""

    TYPE = "offer"
    sha256: str
    size: int
    source_sha256: str
    layer_lo: int
    layer_hi: int

    def check(self) -> None:
        check_hex64(self.sha256, "sha256")
        if self.source_sha256:  # empty: the head does not say (a file that is not a slice)
            check_hex64(self.source_sha256, "sha256")
        if self.size <= 0:
            raise WireError("offer size must be positive")
        if not 0 <= self.layer_lo < self.layer_hi <= INT32_MAX:
            raise WireError("offer layers must be 0 <= lo < hi")


@dataclass(frozen=True)
class OfferReply(WireMessage):
    """Worker -> head: the file is here (``have``), or send it from byte ``received`` (what an
    interrupted transfer of it delivered already)."""

    TYPE = "offer_reply"
    sha256: str
    have: bool
    received: int

    def check(self) -> None:
        check_hex64(self.sha256, "sha256")
        if self.received < 0:
            raise WireError("offer_reply received must be >= 0")


@dataclass(frozen=True)
class Chunk(WireMessage):
    """Head -> worker: bytes [offset, offset+len(data)) of a file of ``total`` bytes."""

    TYPE = "chunk"
    ARRAYS = ("data",)
    sha256: str
    offset: int
    total: int
    data: np.ndarray = field(repr=False)  # [n] u8

    def check(self) -> None:
        check_hex64(self.sha256, "sha256")
        if self.data.dtype != DTYPES["u8"] or self.data.ndim != 1:
            raise WireError("chunk data must be a 1-d u8 array")
        if self.offset < 0 or self.total <= 0 or self.offset + self.data.size > self.total:
            raise WireError("chunk outside the file")


@dataclass(frozen=True)
class ChunkAck(WireMessage):
    TYPE = "chunk_ack"
    sha256: str
    received: int
    done: bool


@dataclass(frozen=True)
class Load(WireMessage):
    """Head -> worker: load the cached slice ``sha256`` as one stage of the pipeline.

    Data-path traffic is taken only when signed with ``upstream_key`` (the head signs the
    first stage's, the previous stage its forwards); ``next_addr`` is the next stage's
    ``tcp://host:port`` and ``downstream_key`` signs what goes there. Both are "" for the last
    stage, which returns its hidden states to the head on the head's own connection (the
    head computes the last layer and the output layer).
    """

    TYPE = "load"
    sha256: str
    layer_lo: int
    layer_hi: int
    first: bool
    last: bool
    n_ctx: int
    n_batch: int
    n_seq_max: int
    kv_unified: bool
    hidden_dtype: str
    next_addr: str
    upstream_key: str  # 64 hex digits
    downstream_key: str  # 64 hex digits; "" for the last stage

    def check(self) -> None:
        check_hex64(self.sha256, "sha256")
        if not 0 <= self.layer_lo < self.layer_hi:
            raise WireError("bad layer range")
        if not (1 <= self.n_ctx <= MAX_STAGE_CTX and 1 <= self.n_batch <= 1 << 16):
            raise WireError("n_ctx / n_batch out of range")
        if not 1 <= self.n_seq_max <= 256:
            raise WireError("n_seq_max must be 1..256")
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise WireError(f"hidden dtype must be one of {HIDDEN_DTYPES}")
        if self.last != (self.next_addr == "") or self.last != (self.downstream_key == ""):
            raise WireError("exactly the last stage has no next address and no downstream key")
        check_hex64(self.upstream_key, "upstream key")
        if not self.last:
            check_hex64(self.downstream_key, "downstream key")


@dataclass(frozen=True)
class Loaded(WireMessage):
    TYPE = "loaded"
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx: int
    load_ms: float
    # how long a verify batch stays exact on this stage's weights and this worker's CPU, and
    # whether its single steps must run as 2 rows (core/batch_exact.py): the head keeps to
    # what every stage allows
    max_rows: int
    two_row_steps: bool
    exact_reason: str

    def check(self) -> None:
        if not 1 <= self.max_rows <= INT32_MAX:
            raise WireError("loaded max_rows must be a positive count of rows")


@dataclass(frozen=True)
class Release(WireMessage):
    """Head -> worker: stop serving, free the stage, go back to waiting for a head (owner only)."""

    TYPE = "release"


@dataclass(frozen=True)
class Cancel(WireMessage):
    """Head -> every stage, out of band: skip the data-path work of ``group`` and of the
    groups in ``more``, all at once: a stage that aborts the first must never start the next
    before it hears of it (the abort freed cells that batch's positions follow).

    Skipped decodes still travel down the pipeline (empty) so that order is kept.
    """

    TYPE = "cancel"
    ARRAYS = ("more",)
    group: int
    more: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="<i4"), repr=False)  # [k] i32

    def check(self) -> None:
        if self.more.dtype != DTYPES["i32"] or self.more.ndim != 1 or self.more.shape[0] > MAX_CANCEL:
            raise WireError(f"cancel: more must be at most {MAX_CANCEL} i32 job groups")

    @property
    def groups(self) -> tuple[int, ...]:
        return (self.group, *self.more.tolist())


def cancel_messages(groups: Sequence[int]) -> list[Cancel]:
    """``groups`` as few Cancel messages as the wire allows (each names up to 257 job groups)."""
    step = MAX_CANCEL + 1
    return [Cancel(groups[i], np.array(groups[i + 1 : i + step], dtype="<i4"))
            for i in range(0, len(groups), step)]


@dataclass(frozen=True)
class Ping(WireMessage):
    """Any token holder -> worker: answered with a :class:`Pong` of the same nonce. At join
    the head times bare pings (the round trip) and pings carrying ``pad`` (the bandwidth),
    and the planner counts each hop's time (:meth:`potluck.engine.cluster.link.NodeLink.measure`)."""

    TYPE = "ping"
    ARRAYS = ("pad",)
    nonce: int
    pad: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8), repr=False)  # [n] u8, ignored

    def check(self) -> None:
        if self.pad.dtype != DTYPES["u8"] or self.pad.ndim != 1 or self.pad.size > MAX_PING_PAD:
            raise WireError(f"ping padding must be a 1-d u8 array of at most {MAX_PING_PAD} bytes")


@dataclass(frozen=True)
class Pong(WireMessage):
    """Reply to :class:`Ping`; with ``nonce == PROBE_NONCE`` an unsolicited probe the worker
    sends its owner to learn whether it is still connected (the head ignores it)."""

    TYPE = "pong"
    nonce: int


PROBE_NONCE = -1
MAX_PING_PAD = 4 << 20


@dataclass(frozen=True)
class Status(WireMessage):
    """Ask a worker for its state (tests check fuzzing leaves it unchanged)."""

    TYPE = "status"


@dataclass(frozen=True)
class StatusReply(WireMessage):
    TYPE = "status_reply"
    ARRAYS = ("pos_max",)
    state: str
    sha256: str
    layer_lo: int
    layer_hi: int
    txn: int
    finished: int  # batches computed to the end
    aborted: int  # batches stopped mid-compute by a cancel
    skipped: int  # batches of a cancelled group never started
    running_group: int  # job group of the batch computing now, -1 none
    busy_ms: float  # time spent computing since the stage loaded (stage utilisation)
    pos_max: np.ndarray = field(repr=False)  # [n_seq_max] i32: last position per sequence, -1 empty


@dataclass(frozen=True)
class Error(WireMessage):
    """Any side -> peer: a request was refused. ``node`` names the sender for the user."""

    TYPE = "error"
    node: str
    code: str
    message: str
    txn: int


CONTROL: tuple[type[WireMessage], ...] = (
    Hello, Welcome, Offer, OfferReply, Chunk, ChunkAck, Load, Loaded, Release, Cancel,
    Ping, Pong, Status, StatusReply, Error,
)

# a control request -> its reply (or an Error): anything else that arrives while the head
# waits is late (a reply to a request that timed out, a result of a broken chain)
REPLY_TO: dict[type[WireMessage], type[WireMessage]] = {
    Hello: Welcome, Offer: OfferReply, Chunk: ChunkAck, Load: Loaded, Status: StatusReply, Ping: Pong,
}
