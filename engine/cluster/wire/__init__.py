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

from .base import (
    DEFAULT_MAX_BYTES,
    DTYPES,
    HIDDEN_DTYPES,
    INT32_MAX,
    MAGIC,
    MAX_ARRAYS,
    MAX_CANCEL,
    MAX_DIM,
    MAX_HEADER_BYTES,
    MAX_STR,
    PROTOCOL_VERSION,
    WireError,
    WireMessage,
)
from .codec import MESSAGES, frames_nbytes, parse_frames, parse_signed, signed_by, to_frames
from .control import (
    MAX_PING_PAD,
    MAX_STAGE_CTX,
    PROBE_NONCE,
    REPLY_TO,
    Cancel,
    Chunk,
    ChunkAck,
    Error,
    Hello,
    Load,
    Loaded,
    Offer,
    OfferReply,
    Ping,
    Pong,
    Release,
    Status,
    StatusReply,
    Welcome,
    cancel_messages,
)
from .data import Forward, KvApply, Reset, Result

__all__ = [
    "DEFAULT_MAX_BYTES", "DTYPES", "HIDDEN_DTYPES", "INT32_MAX", "MAGIC", "MAX_ARRAYS", "MAX_CANCEL",
    "MAX_DIM", "MAX_HEADER_BYTES", "MAX_PING_PAD", "MAX_STAGE_CTX", "MAX_STR", "MESSAGES", "PROBE_NONCE",
    "PROTOCOL_VERSION", "REPLY_TO", "Cancel", "Chunk", "ChunkAck", "Error", "Forward", "Hello", "KvApply", "Load",
    "Loaded", "Offer", "OfferReply", "Ping", "Pong", "Release", "Reset", "Result", "Status",
    "StatusReply", "Welcome", "WireError", "WireMessage", "cancel_messages", "frames_nbytes",
    "parse_frames", "parse_signed", "signed_by", "to_frames",
]
