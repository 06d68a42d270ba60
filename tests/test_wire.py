"""The wire protocol: exact round trips, and parse_frames raises nothing but WireError on junk."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from potluck.engine.cluster import wire
from potluck.engine.core.jobs import DecodeJob
from potluck.engine.core.kv import KvOp
from potluck.engine.lab.wire_fuzz import SHA, mutate, samples


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
        ({"type": "kv", "f": {"txn": 1, "group": 0, "op": "flush", "seq": 0, "dst": -1, "p0": 0,
                              "p1": -1, "delta": 0}, "a": []}, [], "kv op"),
        ({"type": "load", "f": {"sha256": SHA, "layer_lo": 0, "layer_hi": 4, "first": True, "last": True,
                                "n_ctx": 64, "n_batch": 8, "n_seq_max": 999, "kv_unified": True,
                                "hidden_dtype": "f32", "next_addr": "", "upstream_key": "cd" * 32,
                                "downstream_key": ""},
          "a": []}, [], "n_seq_max"),
        ({"type": "cancel", "f": {"group": 1}, "a": [["more", "i32", [300]]]}, [b"\0" * 1200], "at most"),
        ({"type": "cancel", "f": {"group": 1}, "a": [["more", "f32", [2]]]}, [b"\0" * 8], "i32"),
        ({"type": "ping", "f": {"nonce": 1}, "a": [["pad", "u8", [2, 2]]]}, [b"\0" * 4], "ping padding"),
        ({"type": "ping", "f": {"nonce": 1}, "a": [["pad", "u8", [wire.MAX_PING_PAD + 1]]]},
         [b"\0" * (wire.MAX_PING_PAD + 1)], "ping padding"),
    ],
)
def test_inconsistent_messages_are_refused(header: dict, buffers: list[bytes], why: str) -> None:
    with pytest.raises(wire.WireError, match=why):
        wire.parse_frames([wire.MAGIC, json.dumps(header).encode(), *buffers])


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


@pytest.mark.parametrize(
    "fields", [dict(seq=-1), dict(dst=-1), dict(p0=0), dict(p1=5), dict(delta=2)]
)
@pytest.mark.parametrize("op", ["save", "load", "drop"])
def test_kept_conversation_ops_take_a_sequence_and_a_slot_only(op: str, fields: dict[str, int]) -> None:
    base = dict(txn=1, group=0, op=op, seq=3, dst=7, p0=-1, p1=-1, delta=0)
    assert wire.parse_frames([bytes(f) for f in wire.to_frames(wire.KvApply(**base))]).kv_op() == KvOp(op, 3, 7)
    with pytest.raises(wire.WireError, match=f"kv {op} takes a sequence and a slot|negative sequence"):
        wire.parse_frames([bytes(f) for f in wire.to_frames(wire.KvApply(**(base | fields)))])


def test_many_cancelled_runs_go_in_as_few_messages_as_fit() -> None:

    msgs = wire.cancel_messages(list(range(1, 601)))
    assert [len(m.groups) for m in msgs] == [257, 257, 86]
    assert [r for m in msgs for r in m.groups] == list(range(1, 601))
    for m in msgs:
        assert wire.parse_frames(wire.to_frames(m)).groups == m.groups


def test_a_signature_binds_every_field_and_array_and_only_its_key() -> None:
    """Signed frames name their key's HMAC of the canonical message: the right key checks, a
    wrong key, a changed field or a changed array byte does not, and unsigned frames never do."""
    key, other = b"k" * 32, b"o" * 32
    msg = wire.Forward.from_job(3, DecodeJob.tokens(1, [5, 6, 7], 0))
    parsed, sig = wire.parse_signed(wire.to_frames(msg, key))
    assert sig and wire.signed_by(parsed, sig, key) and not wire.signed_by(parsed, sig, other)
    assert wire.parse_signed(wire.to_frames(msg))[1] == "" and not wire.signed_by(parsed, "", key)
    frames = [bytes(f) for f in wire.to_frames(msg, key)]
    header = json.loads(frames[1])
    header["f"]["txn"] = 4  # same signature, another transaction
    moved, sig2 = wire.parse_signed([frames[0], json.dumps(header).encode(), *frames[2:]])
    assert sig2 == sig and not wire.signed_by(moved, sig2, key)
    inputs = bytearray(frames[2])
    inputs[0] ^= 1  # one bit of a token id
    flipped, sig3 = wire.parse_signed([frames[0], frames[1], bytes(inputs), *frames[3:]])
    assert not wire.signed_by(flipped, sig3, key)
    with pytest.raises(wire.WireError, match="signature"):
        header["s"] = 7
        wire.parse_frames([frames[0], json.dumps(header).encode(), *frames[2:]])
