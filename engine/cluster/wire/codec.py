"""Messages <-> frames: encoding, HMAC signatures and the validating parser."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json

import numpy as np

from .base import (
    DEFAULT_MAX_BYTES,
    DTYPES,
    MAGIC,
    MAX_ARRAYS,
    MAX_DIM,
    MAX_HEADER_BYTES,
    MAX_STR,
    WireError,
    WireMessage,
)
from .control import CONTROL
from .data import DATA

MESSAGES: dict[str, type[WireMessage]] = {cls.TYPE: cls for cls in (*CONTROL, *DATA)}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_SCALARS = {"int": int, "str": str, "bool": bool, "float": float}


def _i64(x: int) -> bool:
    return -(1 << 63) <= x < (1 << 63)


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
