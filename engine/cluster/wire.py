"""The cluster wire protocol: typed, versioned messages <-> lists of byte frames. No sockets.

Frame layout (one ZeroMQ multipart message, jupyter_client style)::

    frame 0   b"potluck/1"                      magic + protocol version
    frame 1   header, UTF-8 JSON object:
                {"type": "forward",              message type (a key of MESSAGES)
                 "f": {"txn": 7, "group": 0, ...},   scalar fields, exactly the class's
                 "a": [["inputs", "i32", [5]], ...],  one [name, dtype, shape] per array
                 "s": "9f3c..."}                  optional: HMAC-SHA256 of the message (see below)
    frame 2.. one raw little-endian buffer per entry of "a", in order

Binary payloads (token ids, hidden states, file chunks) travel as extra frames,
never inside JSON. :func:`to_frames` and :func:`parse_frames` are exact inverses;
:func:`parse_frames` validates everything (types, sizes, shapes, cross-field consistency) before anything is
used and raises only :class:`WireError`. Authentication and encryption are not done here:
every socket runs ZeroMQ CURVE with keys bound to the cluster token (see transport.py).

Every token holder shares those CURVE keys, so a peer is never recognized by its ZeroMQ
routing id (a client picks its own; the first connection with a given id wins). Instead the
head proves itself with keys only it hands out, over its own encrypted connections: the key
in its :class:`Hello` signs its later requests to that worker, and each :class:`Load` names the
key that signs the stage's incoming pipeline traffic (``upstream_key``) and the one it signs
its own forwards with (``downstream_key``). A signature ("s") is HMAC-SHA256 over the
message's canonical frames (:func:`signature`), so it binds type, every field and every array.

Data-path transactions (:class:`Forward`, :class:`KvApply`, :class:`Reset`) carry ``txn``, a
counter every stage checks so that KV operations and batches apply in the same order on
every stage; batches carry their job ``group``, so several groups can be in flight
and :class:`Cancel` can stop one (skipped batches still travel, empty, to keep order).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from ..core.jobs import DecodeJob
from ..core.kv import KV_OPS, KvOp

PROTOCOL_VERSION = 10  # 2: forward/kv carry engine jobs and KV ops; 3: a stage belongs to its head;
# 4: status reports busy time; 5: the last worker returns hidden states (the head computes the output);
# 6: one cancel names several job groups; 7: run_id fields renamed group/groups; 8: an offer's reply
# says how much of a cut-off transfer the worker kept (the head resumes there); 9: an offer names
# the model and layers of its slice (a worker holding the model cuts it: --models); 10: the head's
# messages and the pipeline's traffic are signed with keys from the head (hello, load), not
# recognized by routing id
MAGIC = b"potluck/%d" % PROTOCOL_VERSION
MAX_HEADER_BYTES = 16 * 1024
MAX_STR = 4096
MAX_ARRAYS = 4
MAX_CANCEL = 256  # job groups one cancel may name (besides the first)
MAX_DIM = 1 << 31
INT32_MAX = (1 << 31) - 1
DEFAULT_MAX_BYTES = 256 * 1024 * 1024  # one message; the worker also sets ZMQ_MAXMSGSIZE

DTYPES: dict[str, np.dtype] = {
    "i32": np.dtype("<i4"),
    "f32": np.dtype("<f4"),
    "f16": np.dtype("<f2"),
    "u8": np.dtype("u1"),
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_SCALARS = {"int": int, "str": str, "bool": bool, "float": float}

HIDDEN_DTYPES = ("f32", "f16")


class WireError(ValueError):
    """A frame list that is not a valid potluck message (the only error :func:`parse_frames` raises)."""


def _i64(x: int) -> bool:
    return -(1 << 63) <= x < (1 << 63)


@dataclass(frozen=True)
class WireMessage:
    """Base of every message; subclasses set TYPE, ARRAYS and may override :meth:`check`."""

    TYPE: ClassVar[str] = ""
    ARRAYS: ClassVar[tuple[str, ...]] = ()

    def check(self) -> None:
        """Cross-field validation; raise :class:`WireError`."""


# --------------------------------------------------------------------------- control messages


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
        _check_key(self.key, "hello key")


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
        _check_sha(self.sha256)
        if self.source_sha256:  # empty: the head does not say (a file that is not a slice)
            _check_sha(self.source_sha256)
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
        _check_sha(self.sha256)
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
        _check_sha(self.sha256)
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
        _check_sha(self.sha256)
        if not 0 <= self.layer_lo < self.layer_hi:
            raise WireError("bad layer range")
        if not (1 <= self.n_ctx <= 1 << 24 and 1 <= self.n_batch <= 1 << 16):
            raise WireError("n_ctx / n_batch out of range")
        if not 1 <= self.n_seq_max <= 256:
            raise WireError("n_seq_max must be 1..256")
        if self.hidden_dtype not in HIDDEN_DTYPES:
            raise WireError(f"hidden dtype must be one of {HIDDEN_DTYPES}")
        if self.last != (self.next_addr == "") or self.last != (self.downstream_key == ""):
            raise WireError("exactly the last stage has no next address and no downstream key")
        _check_key(self.upstream_key, "upstream key")
        if not self.last:
            _check_key(self.downstream_key, "downstream key")


@dataclass(frozen=True)
class Loaded(WireMessage):
    TYPE = "loaded"
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx: int
    load_ms: float


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
    TYPE = "ping"
    nonce: int


@dataclass(frozen=True)
class Pong(WireMessage):
    """Reply to :class:`Ping`; with ``nonce == PROBE_NONCE`` an unsolicited probe the worker
    sends its owner to learn whether it is still connected (the head ignores it)."""

    TYPE = "pong"
    nonce: int


PROBE_NONCE = -1


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


# --------------------------------------------------------------------------- data path


@dataclass(frozen=True)
class Forward(WireMessage):
    """One batch down the pipeline: token ids (to the first stage) or hidden states (later).

    ``inputs``: [n] i32 token ids, or [n, n_embd] f32/f16 hidden states.
    ``positions``, ``seq_ids``: [n] i32. ``outputs``: [n] u8, rows whose logits the head
    computes (every stage still computes every row: later layers need them all). ``skip``: the
    group was cancelled upstream; nothing is computed, order is kept.
    """

    TYPE = "forward"
    ARRAYS = ("inputs", "positions", "seq_ids", "outputs")
    txn: int
    group: int
    skip: bool
    inputs: np.ndarray = field(repr=False)
    positions: np.ndarray = field(repr=False)
    seq_ids: np.ndarray = field(repr=False)
    outputs: np.ndarray = field(repr=False)

    @classmethod
    def from_job(cls, txn: int, job: DecodeJob, inputs: np.ndarray | None = None) -> Forward:
        """``job`` as transaction ``txn``; ``inputs`` replaces its inputs (a stage's output)."""
        return cls(
            txn=txn,
            group=job.group,
            skip=False,
            inputs=job.inputs if inputs is None else inputs,
            positions=job.positions.astype("<i4", copy=False),
            seq_ids=job.seq_ids.astype("<i4", copy=False),
            outputs=job.outputs.astype("u1", copy=False),
        )

    def skipped(self) -> Forward:
        """The empty message a cancelled group still sends downstream (keeps txn order)."""
        empty = np.zeros(0, dtype="<i4")
        return Forward(self.txn, self.group, True, empty, empty, empty, np.zeros(0, dtype="u1"))

    def job(self) -> DecodeJob:
        inputs = self.inputs if self.is_tokens else self.inputs.astype(np.float32, copy=False)
        return DecodeJob(self.group, inputs, self.positions, self.seq_ids, self.outputs.astype(bool))

    @property
    def is_tokens(self) -> bool:
        return self.inputs.dtype == DTYPES["i32"]

    def check(self) -> None:
        if self.txn < 1 or self.group < 0:
            raise WireError("txn must be >= 1 and group >= 0")
        n = self.positions.shape[0] if self.positions.ndim == 1 else -1
        for name in ("positions", "seq_ids"):
            a = getattr(self, name)
            if a.dtype != DTYPES["i32"] or a.ndim != 1 or a.shape[0] != n:
                raise WireError(f"{name} must be an i32 array [n]")
        if self.outputs.dtype != DTYPES["u8"] or self.outputs.shape != (n,):
            raise WireError("outputs must be a u8 array [n]")
        if self.skip:
            return
        if n < 1:
            raise WireError("a batch needs at least one token")
        x = self.inputs
        if x.dtype == DTYPES["i32"]:
            if x.shape != (n,):
                raise WireError("token ids must be [n]")
        elif x.dtype in (DTYPES["f32"], DTYPES["f16"]):
            if x.ndim != 2 or x.shape[0] != n or x.shape[1] < 1:
                raise WireError("hidden states must be [n, n_embd]")
        else:
            raise WireError("inputs must be i32 token ids or f32/f16 hidden states")
        if self.positions.min() < 0 or self.seq_ids.min() < 0:
            raise WireError("positions and sequence ids must be >= 0")
        if not self.outputs.any():
            raise WireError("a batch must request at least one output row")
        if ((self.outputs != 0) & (self.outputs != 1)).any():
            raise WireError("outputs must be 0 or 1 per row")


@dataclass(frozen=True)
class KvApply(WireMessage):
    """A :class:`~potluck.engine.core.kv.KvOp` applied on every stage in pipeline order."""

    TYPE = "kv"
    txn: int
    group: int
    op: str
    seq: int
    dst: int
    p0: int
    p1: int
    delta: int

    @classmethod
    def from_op(cls, txn: int, op: KvOp, group: int = 0) -> KvApply:
        return cls(txn, group, op.op, op.seq, op.dst, op.p0, op.p1, op.delta)

    def kv_op(self) -> KvOp:
        return KvOp(self.op, self.seq, self.dst, self.p0, self.p1, self.delta)

    def check(self) -> None:
        if self.txn < 1 or self.group < 0:
            raise WireError("txn must be >= 1 and group >= 0")
        if self.op not in KV_OPS:
            raise WireError(f"kv op must be one of {KV_OPS}")
        if self.seq < 0 or self.dst < -1 or self.p0 < -1 or self.p1 < -1:
            raise WireError("negative sequence id or position")
        # llama.cpp takes these as int32: refuse what would wrap around before anything else
        if max(self.seq, self.dst, self.p0, self.p1, abs(self.delta)) > INT32_MAX:
            raise WireError("kv sequence id, position or shift beyond int32")


@dataclass(frozen=True)
class Reset(WireMessage):
    """Clear every sequence of every stage (a new conversation)."""

    TYPE = "reset"
    txn: int

    def check(self) -> None:
        if self.txn < 1:
            raise WireError("txn must be >= 1")


@dataclass(frozen=True)
class Result(WireMessage):
    """Last worker -> head: the hidden states [n, n_embd] (f32, or f16 with ``hidden_dtype``
    f16) of every row of transaction ``txn``; the head runs its own last layer(s) and the
    output layer on them. Every row, not only output rows: the head's layer keeps a KV cache."""

    TYPE = "result"
    ARRAYS = ("hidden",)
    txn: int
    group: int
    skip: bool
    hidden: np.ndarray = field(repr=False)

    def check(self) -> None:
        if self.hidden.dtype not in (DTYPES["f32"], DTYPES["f16"]) or self.hidden.ndim != 2:
            raise WireError("hidden states must be f32 or f16 [n, n_embd]")


MESSAGES: dict[str, type[WireMessage]] = {
    cls.TYPE: cls
    for cls in (
        Hello, Welcome, Offer, OfferReply, Chunk, ChunkAck, Load, Loaded, Release, Cancel,
        Ping, Pong, Status, StatusReply, Error, Forward, KvApply, Reset, Result,
    )
}

# a control request -> its reply (or an Error): anything else that arrives while the head
# waits is late (a reply to a request that timed out, a result of a broken chain)
REPLY_TO: dict[type[WireMessage], type[WireMessage]] = {
    Hello: Welcome, Offer: OfferReply, Chunk: ChunkAck, Load: Loaded, Status: StatusReply,
}


def _check_sha(sha: str) -> None:
    if len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
        raise WireError("sha256 must be 64 lowercase hex digits")


def _check_key(key: str, what: str) -> None:
    if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
        raise WireError(f"{what} must be 64 lowercase hex digits")


def _scalar_fields(cls: type[WireMessage]) -> list[tuple[str, type]]:
    out = []
    for f in dataclasses.fields(cls):
        if f.name in cls.ARRAYS:
            continue
        out.append((f.name, _SCALARS[str(f.type)]))
    return out


_SCHEMAS = {name: _scalar_fields(cls) for name, cls in MESSAGES.items()}


# --------------------------------------------------------------------------- encode / decode


def to_frames(msg: WireMessage, key: bytes = b"") -> list[bytes | memoryview]:
    """Frames for ``msg``, signed with ``key`` if one is given. Arrays go out as zero-copy
    little-endian buffers."""
    header, buffers = _encode(msg)
    if key:
        header["s"] = _mac(key, header, buffers)
    return [MAGIC, json.dumps(header, separators=(",", ":")).encode(), *buffers]


def _encode(msg: WireMessage) -> tuple[dict, list[bytes | memoryview]]:
    """The unsigned header and the array buffers of ``msg`` (its canonical form)."""
    cls = type(msg)
    fields = {name: getattr(msg, name) for name, _ in _SCHEMAS[cls.TYPE]}
    specs: list[list[object]] = []
    buffers: list[bytes | memoryview] = []
    for name in cls.ARRAYS:
        arr = np.asarray(getattr(msg, name))
        dt = _DTYPE_NAMES.get(arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype)
        if dt is None:
            raise TypeError(f"{cls.__name__}.{name}: unsupported dtype {arr.dtype}")
        arr = np.ascontiguousarray(arr, dtype=DTYPES[dt])
        specs.append([name, dt, list(arr.shape)])
        buffers.append(arr.reshape(-1).view(np.uint8).data)
    return {"type": cls.TYPE, "f": fields, "a": specs}, buffers


def _mac(key: bytes, header: dict, buffers: list[bytes | memoryview]) -> str:
    """HMAC-SHA256 over the canonical header and each buffer, length-prefixed."""
    h = hmac.new(key, MAGIC, hashlib.sha256)
    canonical = json.dumps(header, separators=(",", ":")).encode()
    h.update(len(canonical).to_bytes(8, "little") + canonical)
    for buf in buffers:
        h.update(len(buf).to_bytes(8, "little"))
        h.update(buf)
    return h.hexdigest()


def signed_by(msg: WireMessage, signature: str, key: bytes) -> bool:
    """Whether ``signature`` (the "s" of the frames ``msg`` came in) is ``key``'s signature of
    ``msg``: recomputed over its canonical form and compared in constant time."""
    if not key or not signature:
        return False
    header, buffers = _encode(msg)
    return hmac.compare_digest(_mac(key, header, buffers), signature)


def _as_bytes(frame: object) -> bytes | memoryview:
    if isinstance(frame, (bytes, memoryview)):
        return frame
    buf = getattr(frame, "buffer", None)  # zmq.Frame
    if isinstance(buf, memoryview):
        return buf
    if isinstance(frame, bytearray):
        return bytes(frame)
    raise WireError("frames must be bytes")


def parse_frames(frames: list, *, max_bytes: int = DEFAULT_MAX_BYTES) -> WireMessage:
    """Parse and validate ``frames``; raises only :class:`WireError`."""
    return parse_signed(frames, max_bytes=max_bytes)[0]


def parse_signed(frames: list, *, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[WireMessage, str]:
    """:func:`parse_frames`, and the message's signature ("" if unsigned; check it with
    :func:`signed_by`); raises only :class:`WireError`."""
    try:
        return _parse(frames, max_bytes)
    except WireError:
        raise
    except Exception as e:  # defensive: whatever slipped through is still a wire error
        raise WireError(f"malformed message ({type(e).__name__})") from None


def _parse(frames: list, max_bytes: int) -> tuple[WireMessage, str]:
    if not isinstance(frames, (list, tuple)) or len(frames) < 2:
        raise WireError("a message has at least 2 frames")
    if len(frames) > 2 + MAX_ARRAYS:
        raise WireError("too many frames")
    raw = [_as_bytes(f) for f in frames]
    if bytes(raw[0]) != MAGIC:
        head = bytes(raw[0][:16])
        if head.startswith(b"potluck/"):
            raise WireError(f"protocol version mismatch: got {head!r}, speak {MAGIC!r}")
        raise WireError("not a potluck message")
    if len(raw[1]) > MAX_HEADER_BYTES:
        raise WireError("header too large")
    total = sum(len(b) for b in raw)
    if total > max_bytes:
        raise WireError(f"message of {total} bytes exceeds the {max_bytes}-byte limit")
    try:
        header = json.loads(bytes(raw[1]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise WireError("header is not UTF-8 JSON") from None
    if not isinstance(header, dict) or set(header) - {"s"} != {"type", "f", "a"}:
        raise WireError("header must be an object with type, f, a (and s)")
    mtype, fields, specs, sig = header["type"], header["f"], header["a"], header.get("s", "")
    if not isinstance(sig, str) or len(sig) > 64:
        raise WireError("signature must be at most 64 hex digits")
    if not isinstance(mtype, str) or mtype not in MESSAGES:
        raise WireError(f"unknown message type {str(mtype)[:32]!r}")
    cls = MESSAGES[mtype]
    if not isinstance(fields, dict):
        raise WireError("fields must be an object")
    schema = _SCHEMAS[mtype]
    if set(fields) != {name for name, _ in schema}:
        raise WireError(f"{mtype}: wrong field set")
    kwargs: dict[str, object] = {}
    for name, typ in schema:
        v = fields[name]
        if typ is float and type(v) is int:
            v = float(v)
        if type(v) is not typ:
            raise WireError(f"{mtype}.{name} must be {typ.__name__}")
        if typ is int and not _i64(v):  # type: ignore[arg-type]
            raise WireError(f"{mtype}.{name} out of range")
        if typ is float and not np.isfinite(v):  # type: ignore[arg-type]
            raise WireError(f"{mtype}.{name} must be finite")
        if typ is str and len(v) > MAX_STR:  # type: ignore[arg-type]
            raise WireError(f"{mtype}.{name} too long")
        kwargs[name] = v
    if not isinstance(specs, list) or len(specs) != len(cls.ARRAYS) or len(raw) != 2 + len(specs):
        raise WireError(f"{mtype}: expected {len(cls.ARRAYS)} array frame(s)")
    for spec, name, buf in zip(specs, cls.ARRAYS, raw[2:]):
        kwargs[name] = _array(spec, name, buf)
    msg = cls(**kwargs)
    msg.check()
    return msg, sig


def _array(spec: object, name: str, buf: bytes | memoryview) -> np.ndarray:
    if not (isinstance(spec, list) and len(spec) == 3 and spec[0] == name):
        raise WireError(f"bad array spec for {name}")
    _, dt, shape = spec
    if not isinstance(dt, str) or dt not in DTYPES:
        raise WireError(f"{name}: unknown dtype")
    if not isinstance(shape, list) or not 1 <= len(shape) <= 2:
        raise WireError(f"{name}: shape must have 1 or 2 dimensions")
    n = 1
    for d in shape:
        if type(d) is not int or not 0 <= d < MAX_DIM:
            raise WireError(f"{name}: bad dimension")
        n *= d
    dtype = DTYPES[dt]
    if n * dtype.itemsize != len(buf):
        raise WireError(f"{name}: {len(buf)} bytes do not match shape {shape} of {dt}")
    arr = np.frombuffer(buf, dtype=dtype).reshape(shape)
    if dtype.kind == "f" and not np.isfinite(arr).all():
        raise WireError(f"{name}: non-finite values")
    return arr


# --------------------------------------------------------------------------- helpers


def frames_nbytes(frames: list[bytes | memoryview]) -> int:
    return sum(len(f) for f in frames)
