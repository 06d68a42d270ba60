"""The wire protocol: exact round trips, and parse_frames raises nothing but WireError on junk."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from potluck.engine.cluster import wire
from potluck.engine.core.jobs import DecodeJob

SHA = "ab" * 32


def samples() -> list[wire.WireMessage]:
    hidden = np.arange(12, dtype=np.float32).reshape(3, 4)
    return [
        wire.Hello("head-1", "0.1.0"),
        wire.Welcome("n1", "0.1.0", 8, 16000, 3.5, "idle", 1 << 28),
        wire.Offer(SHA, 10),
        wire.OfferReply(SHA, True),
        wire.Chunk(SHA, 0, 10, np.arange(4, dtype=np.uint8)),
        wire.ChunkAck(SHA, 4, False),
        wire.Load(SHA, 0, 12, True, False, 512, 64, 1, True, "f32", "tcp://h:1", "head-1", "head-1"),
        wire.Loaded(12, 576, 49152, 512, 12.5),
        wire.Release(),
        wire.Cancel(3),
        wire.Cancel(3, np.array([4, 5], dtype=np.int32)),
        wire.Ping(1),
        wire.Pong(1),
        wire.Status(),
        wire.StatusReply("loaded", SHA, 0, 12, 5, 9, 1, 2, 4, 12.5, np.array([7, -1], dtype=np.int32)),
        wire.Error("n1", "refused", "why", 3),
        wire.Forward.from_job(1, DecodeJob.tokens(0, [1, 2, 3], 0)),
        wire.Forward.from_job(
            2, DecodeJob(4, hidden, np.arange(5, 8, dtype=np.int32), np.zeros(3, np.int32), np.ones(3, bool))
        ),
        wire.Forward.from_job(
            3, DecodeJob(0, hidden.astype(np.float16), np.arange(3, dtype=np.int32), np.array([0, 1, 1], np.int32),
                         np.array([0, 0, 1], bool)),
        ),
        wire.KvApply(4, 0, "rm", 0, -1, 10, -1, 0),
        wire.Reset(5),
        wire.Result(6, 0, False, np.ones((2, 5), dtype=np.float32)),
    ]


def same(a: wire.WireMessage, b: wire.WireMessage) -> bool:
    if type(a) is not type(b):
        return False
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, np.ndarray):
            if x.dtype != y.dtype or not np.array_equal(x, y):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("msg", samples(), ids=lambda m: m.TYPE)
def test_to_frames_and_parse_frames_are_inverses(msg: wire.WireMessage) -> None:
    frames = wire.to_frames(msg)
    assert frames[0] == wire.MAGIC
    back = wire.parse_frames([bytes(f) for f in frames])
    assert same(msg, back)
    assert [bytes(f) for f in wire.to_frames(back)] == [bytes(f) for f in frames]


def test_every_message_type_is_sampled() -> None:
    assert {m.TYPE for m in samples()} == set(wire.MESSAGES)


def test_version_mismatch_is_named() -> None:
    frames = [bytes(f) for f in wire.to_frames(wire.Ping(1))]
    with pytest.raises(wire.WireError, match="version mismatch"):
        wire.parse_frames([b"potluck/1", *frames[1:]])


@pytest.mark.parametrize(
    "header,buffers,why",
    [
        ({"type": "forward", "f": {"txn": 1, "group": 0, "skip": False},
          "a": [["inputs", "i32", [2]], ["positions", "i32", [3]], ["seq_ids", "i32", [3]],
                ["outputs", "u8", [3]]]},
         [b"\0" * 8, b"\0" * 12, b"\0" * 12, b"\1\0\0"], "token ids"),
        ({"type": "ping", "f": {"nonce": True}, "a": []}, [], "must be int"),
        ({"type": "ping", "f": {"nonce": 1, "x": 2}, "a": []}, [], "field set"),
        ({"type": "chunk", "f": {"sha256": SHA, "offset": 8, "total": 9}, "a": [["data", "u8", [4]]]},
         [b"abcd"], "outside"),
        ({"type": "result", "f": {"txn": 1, "group": 0, "skip": False}, "a": [["hidden", "f32", [1, 2]]]},
         [np.array([1.0, np.nan], dtype=np.float32).tobytes()], "non-finite"),
        ({"type": "kv", "f": {"txn": 1, "group": 0, "op": "drop", "seq": 0, "dst": -1, "p0": 0,
                              "p1": -1, "delta": 0}, "a": []}, [], "kv op"),
        ({"type": "load", "f": {"sha256": SHA, "layer_lo": 0, "layer_hi": 4, "first": True, "last": True,
                                "n_ctx": 64, "n_batch": 8, "n_seq_max": 999, "kv_unified": True,
                                "hidden_dtype": "f32", "next_addr": "", "upstream": "h", "reply_to": "h"},
          "a": []}, [], "n_seq_max"),
        ({"type": "cancel", "f": {"group": 1}, "a": [["more", "i32", [300]]]}, [b"\0" * 1200], "at most"),
        ({"type": "cancel", "f": {"group": 1}, "a": [["more", "f32", [2]]]}, [b"\0" * 8], "i32"),
    ],
)
def test_inconsistent_messages_are_refused(header: dict, buffers: list[bytes], why: str) -> None:
    with pytest.raises(wire.WireError, match=why):
        wire.parse_frames([wire.MAGIC, json.dumps(header).encode(), *buffers])


def mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    """One random corruption of a valid message: bytes, frames, header JSON or sizes."""
    frames = list(frames)
    kind = rng.randrange(8)
    i = rng.randrange(len(frames))
    if kind == 0 and frames[i]:
        b = bytearray(frames[i])
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        frames[i] = bytes(b)
    elif kind == 1:
        frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    elif kind == 2:
        frames.insert(i, rng.randbytes(rng.randrange(64)))
    elif kind == 3 and len(frames) > 1:
        del frames[i]
    elif kind == 4:
        header = json.loads(frames[1])
        key = rng.choice(list(header["f"]) or ["x"])
        header["f"][key] = rng.choice([None, -1, 2**70, "x" * 5000, [], {}, 1.5, True, "", 0])
        frames[1] = json.dumps(header).encode()
    elif kind == 5:
        header = json.loads(frames[1])
        if header["a"]:
            spec = rng.choice(header["a"])
            spec[rng.randrange(3)] = rng.choice([[2**40], [-1], "f64", [1, 2, 3], None, "outputs", [0]])
        else:
            header["a"] = [["x", "u8", [1]]]
        frames[1] = json.dumps(header).encode()
    elif kind == 6:
        frames[1] = rng.choice([b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"type":"ping"}', b"1e999"])
    else:
        frames = [rng.randbytes(rng.randrange(1, 40)) for _ in range(rng.randint(0, 8))]
    return frames


def test_fuzzed_frames_raise_only_wire_error() -> None:
    rng = random.Random(1234)
    valid = [[bytes(f) for f in wire.to_frames(m)] for m in samples()]
    outcomes = {"refused": 0, "accepted": 0}
    for _ in range(5000):
        frames = mutate(rng, rng.choice(valid))
        try:
            wire.parse_frames(frames, max_bytes=1 << 20)
            outcomes["accepted"] += 1  # e.g. a flipped byte inside a payload: still well-formed
        except wire.WireError:
            outcomes["refused"] += 1
    assert outcomes["refused"] > 3000


def test_oversized_message_is_refused_before_parsing() -> None:
    frames = [bytes(f) for f in wire.to_frames(wire.Chunk(SHA, 0, 1 << 21, np.zeros(1 << 21, np.uint8)))]
    with pytest.raises(wire.WireError, match="exceeds"):
        wire.parse_frames(frames, max_bytes=1 << 20)
    with pytest.raises(wire.WireError, match="header too large"):
        wire.parse_frames([wire.MAGIC, b" " * (wire.MAX_HEADER_BYTES + 1)])


@pytest.mark.parametrize("outputs", [[0] * 7 + [3], [255] * 8, [2, 1], [0, 0]])
def test_outputs_must_be_zero_or_one_with_one_set(outputs: list[int]) -> None:
    """outputs=[0]*7+[3] once leaked worker memory; [255]*8 crashed it (a row counted per non-zero byte)."""
    n = len(outputs)
    msg = wire.Forward(1, 0, False, np.ones(n, np.int32), np.arange(n, dtype=np.int32), np.zeros(n, np.int32),
                       np.array(outputs, dtype=np.uint8))
    with pytest.raises(wire.WireError, match="outputs|at least one output"):
        wire.parse_frames([bytes(f) for f in wire.to_frames(msg)])


@pytest.mark.parametrize(
    "fields", [dict(p0=2**31), dict(p1=2**40), dict(delta=-(2**31)), dict(seq=2**31), dict(dst=2**33)]
)
def test_kv_values_beyond_int32_are_refused(fields: dict[str, int]) -> None:
    """llama.cpp takes KV positions as int32: a wrapped value must never reach it."""
    base = dict(txn=1, group=0, op="add", seq=0, dst=-1, p0=0, p1=-1, delta=0) | fields
    with pytest.raises(wire.WireError, match="int32"):
        wire.parse_frames([bytes(f) for f in wire.to_frames(wire.KvApply(**base))])


def test_many_cancelled_runs_go_in_as_few_messages_as_fit() -> None:
    from potluck.engine.cluster.head import cancel_messages

    msgs = cancel_messages(list(range(1, 601)))
    assert [len(m.groups) for m in msgs] == [257, 257, 86]
    assert [r for m in msgs for r in m.groups] == list(range(1, 601))
    for m in msgs:
        assert wire.parse_frames(wire.to_frames(m)).groups == m.groups
