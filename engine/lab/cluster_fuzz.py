"""Fuzz campaigns against the cluster on loopback, both ways, shared by
scripts/fuzz_cluster.py (up to 100k cases) and the tests (a few hundred).

:func:`fuzz_as_head`: cases sent as the authenticated upstream head of a real worker (the
identity every check sits behind): mutated frames of every message type, and well-formed
transactions in order that are invalid in one way (token ids, positions, sequences, sizes,
outputs bytes, KV ranges), so the worker's own checks run. Afterwards the worker must be
alive, its state (KV positions, computed batches) unchanged, and its next batches exact.

:func:`fuzz_as_worker`: a token holder posing as a worker answers the head's batches with
mutated or lying results (wrong widths, rows, txns, sizes, types, refusals). The head must
raise only PotluckError (never crash, never accept a wrong shape), and afterwards a real
pipeline from the same process must be exact.

Real workers are started by the caller (``start_worker``: the lab never imports the app)
with the token behind ``keys``, and a small cache quota.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

import numpy as np
import zmq

from ..cluster import wire
from ..cluster.head import open_pipeline
from ..cluster.transfer import SliceCache
from ..cluster.transport import client_socket
from ..core.errors import PotluckError
from ..core.jobs import DecodeJob
from ..core.kv import KV_OPS
from ..core.runtime import ContextParams, Model
from ..core.spec import CurveKeys
from ..core.target import LocalTarget
from .wire_fuzz import FakeWorker, mutate, samples


class FuzzWorker(Protocol):
    """A running worker the campaign attacks (``app.loopback.LoopbackWorker`` is one)."""

    address: str

    def alive(self) -> bool: ...


# starts a worker with TOKEN, its home under the given folder; stops it on exit
StartWorker = Callable[[Path], AbstractContextManager[FuzzWorker]]

N_CTX = 128
FAR = 8 * N_CTX  # past any context llama.cpp rounds N_CTX up to
N_BATCH = 32
PROMPT = "<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n"
# Well-formed requests that change a worker's state on purpose when its owner sends them.
OWNER_REQUESTS = {"hello", "release", "offer", "load"}


def replies(sock: zmq.Socket, timeout_ms: int) -> list[wire.WireMessage]:
    out = []
    while sock.poll(timeout_ms):
        out.append(wire.parse_frames(sock.recv_multipart()))
        timeout_ms = 0
    return out


def until(sock: zmq.Socket, done, timeout_s: float = 30.0) -> list[wire.WireMessage]:
    """Read replies until ``done(msg)`` holds for one; owner probes are skipped."""
    got = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            msg = wire.parse_frames(sock.recv_multipart())
            if isinstance(msg, wire.Pong) and msg.nonce == wire.PROBE_NONCE:
                continue
            got.append(msg)
            if done(msg):
                return got
    raise AssertionError(f"no expected reply within {timeout_s} s (got {[m.TYPE for m in got]})")


def status(sock: zmq.Socket) -> wire.StatusReply:
    sock.send_multipart(wire.to_frames(wire.Status()))
    return until(sock, lambda m: isinstance(m, wire.StatusReply))[-1]


# --------------------------------------------------------------------------- as the upstream head


def invalid_transaction(rng: random.Random, txn: int, n_vocab: int) -> wire.WireMessage:
    """A well-formed transaction numbered ``txn`` that the stage must refuse (one flaw)."""
    n = rng.randint(1, 8)
    pos = np.arange(n, dtype=np.int32) + FAR - 4
    seq = np.zeros(n, np.int32)
    tokens = np.ones(n, np.int32)
    outputs = np.ones(n, bool)
    flaw = rng.randrange(9)
    if flaw == 0:
        tokens = np.full(n, rng.choice([n_vocab, n_vocab + 1, 2**31 - 1]), np.int32)
        pos = np.arange(n, dtype=np.int32)
    elif flaw == 1:
        pos = np.full(n, rng.choice([FAR, FAR + 1, 2**31 - 1]), np.int32)
    elif flaw == 2:
        seq = np.full(n, rng.choice([1, 5, 255, 2**31 - 1]), np.int32)
        pos = np.arange(n, dtype=np.int32)
    elif flaw == 3:
        n = N_BATCH + rng.randint(1, 40)
        return wire.Forward.from_job(txn, DecodeJob.tokens(1, [1] * n, 0, outputs="all"))
    elif flaw == 4:
        hidden = np.zeros((n, rng.choice([1, 7, 576])), np.float32)
        return wire.Forward.from_job(txn, DecodeJob(1, hidden, np.arange(n, dtype=np.int32), seq, outputs))
    elif flaw == 5:
        op = rng.choice(KV_OPS)
        return wire.KvApply(txn, 0, op, rng.choice([1, 7, 2**31 - 1]), rng.choice([-1, 0, 3]), 0, -1, 0)
    elif flaw == 6:
        big = rng.choice([FAR + 1, 2**20, 2**31 - 1])
        return wire.KvApply(txn, 0, rng.choice(["rm", "add", "cp"]), 0, 0 if rng.random() < 0.5 else -1,
                            big, -1, rng.choice([0, big, -big]))
    elif flaw == 7:
        return wire.KvApply(txn, 0, "add", 0, -1, 0, -1, rng.choice([FAR + 1, -FAR - 1, 2**31 - 1]))
    else:  # a kept conversation that was never saved
        return wire.KvApply(txn, 0, "load", 0, rng.choice([1, 99, 2**31 - 1]), -1, -1, 0)
    return wire.Forward.from_job(txn, DecodeJob(1, tokens, pos, seq, outputs))


def fuzz_as_head(n_cases: int, seed: int, model: Model, model_path: Path, tmp: Path, keys: CurveKeys,
                 start_worker: StartWorker) -> dict:
    """``n_cases`` hostile messages as the authenticated upstream head of a fresh worker."""
    with start_worker(tmp / "head-fuzz") as worker:
        return _fuzz_as_head(n_cases, random.Random(seed), model, model_path, tmp, keys, worker)


def _fuzz_as_head(n_cases: int, rng: random.Random, model: Model, model_path: Path, tmp: Path, keys: CurveKeys,
                  worker: FuzzWorker) -> dict:
    address = worker.address
    target = open_pipeline(model_path, [address], keys, n_ctx=N_CTX, n_batch=N_BATCH,
                           slice_cache=SliceCache(tmp / "slices"))
    local = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1))
    ctx = zmq.Context()
    watcher = client_socket(ctx, keys, b"fuzz-watcher")
    watcher.connect(f"tcp://{address}")
    report = {"cases": 0, "refused": 0, "consumed_refused": 0, "harmless": 0, "skipped_owner_requests": 0}
    try:
        prompt = model.tokenize(PROMPT)
        assert np.array_equal(local.decode(prompt), target.decode(prompt)), "not exact before fuzzing"
        link = target.links[0]
        head = link.sock

        def signed(msg: wire.WireMessage) -> list:
            """As the owner sends it (protocol 8): pipeline traffic with the stage's upstream
            key, the rest with the hello's key; a well-formed case reaches the stage's checks."""
            data = isinstance(msg, (wire.Forward, wire.KvApply, wire.Reset))
            return wire.to_frames(msg, link.data_key if data else link.key)

        before = status(watcher)
        next_txn = before.txn + 1
        valid = [[bytes(f) for f in wire.to_frames(m)] for m in samples()]
        while report["cases"] < n_cases:
            family = rng.randrange(4)
            if family == 0:  # in order and invalid: reaches the stage's own checks
                msg = invalid_transaction(rng, next_txn, model.n_vocab)
                frames = [bytes(f) for f in wire.to_frames(msg)]
            elif family == 1 and rng.random() < 0.5:  # outputs bytes other than 0/1
                n = rng.randint(1, 8)
                outs = np.array([rng.choice([0, 1, 2, 3, 127, 255]) for _ in range(n)], np.uint8)
                outs[rng.randrange(n)] = rng.choice([2, 3, 255])
                fwd = wire.Forward(next_txn, 1, False, np.ones(n, np.int32), np.arange(n, dtype=np.int32),
                                   np.zeros(n, np.int32), outs)
                frames = [bytes(f) for f in wire.to_frames(fwd)]
            else:
                frames = mutate(rng, rng.choice(valid))
                if not frames:
                    continue  # nothing to send
            try:
                parsed: wire.WireMessage | None = wire.parse_frames(frames)
            except wire.WireError:
                parsed = None
            if parsed is not None and parsed.TYPE in OWNER_REQUESTS and not (
                isinstance(parsed, wire.Load) and parsed.sha256 != before.sha256  # not cached: refused
            ):
                report["skipped_owner_requests"] += 1
                continue  # well-formed: the owner may do that on purpose
            if isinstance(parsed, wire.Reset) or (
                isinstance(parsed, (wire.Forward, wire.KvApply)) and parsed.txn == next_txn
                and family != 0 and not isinstance(parsed, wire.Forward)
            ):
                report["skipped_owner_requests"] += 1
                continue  # a valid KV operation or reset in order would change the cache on purpose
            if isinstance(parsed, wire.Forward) and parsed.txn == next_txn and not parsed.skip and family != 0:
                try:
                    target_check(parsed, model.n_vocab)
                    report["skipped_owner_requests"] += 1
                    continue  # a valid batch: computing it is what the owner asked for
                except ValueError:
                    pass
            report["cases"] += 1
            head.send_multipart(signed(parsed) if parsed is not None else frames)
            consumed = isinstance(parsed, (wire.Forward, wire.KvApply)) and parsed.txn == next_txn
            if os.environ.get("FUZZ_DEBUG"):
                print(report["cases"], consumed, repr(parsed)[:200], file=sys.stderr)
            if consumed:
                got = until(head, lambda m, t=next_txn: isinstance(m, wire.Error) and m.txn == t
                            or isinstance(m, wire.Result) and m.txn == t)
                if isinstance(parsed, wire.Forward) and not any(isinstance(m, wire.Result) for m in got):
                    until(head, lambda m, t=next_txn: isinstance(m, wire.Result) and m.txn == t)
                if isinstance(got[-1], wire.Result) and not got[-1].skip:
                    raise AssertionError(f"case {report['cases']}: an invalid batch was computed")
                next_txn += 1
                report["consumed_refused"] += 1
                continue
            head.send_multipart(signed(wire.Ping(report["cases"])))
            got = until(head, lambda m, i=report["cases"]: isinstance(m, wire.Pong) and m.nonce == i)
            if any(isinstance(m, wire.Error) for m in got):
                report["refused"] += 1
            else:
                report["harmless"] += 1
            if not worker.alive():
                raise AssertionError(f"the worker died at case {report['cases']}")
        after = status(watcher)
        same = (before.state, before.sha256, before.finished, tuple(before.pos_max)) == (
            after.state, after.sha256, after.finished, tuple(after.pos_max))
        report["state_unchanged"] = bool(same and after.txn == next_txn - 1)
        exact = True
        pos = len(prompt)
        tok = 1
        for _ in range(6):  # greedy steps straight through the worker and the head's tail: logits identical
            ref = local.decode([tok])[0]
            job = DecodeJob.tokens(1, [tok], pos)
            head.send_multipart(signed(wire.Forward.from_job(next_txn, job)))
            res = until(head, lambda m, t=next_txn: isinstance(m, (wire.Result, wire.Error)) and m.txn == t)[-1]
            exact = exact and isinstance(res, wire.Result) and res.hidden.shape == (1, model.n_embd)
            if exact:
                tail_job = DecodeJob(1, res.hidden, job.positions, job.seq_ids, job.outputs)
                exact = np.array_equal(target.tail.runner.submit(tail_job).result()[0], ref)
            next_txn, pos, tok = next_txn + 1, pos + 1, int(np.argmax(ref))
        report["exact_after"] = bool(exact)
        report["worker_alive"] = worker.alive()
        report["ok"] = report["state_unchanged"] and report["exact_after"] and report["worker_alive"]
        return report
    finally:
        watcher.close(linger=0)
        ctx.term()
        local.close()
        target.close()


def target_check(msg: wire.Forward, n_vocab: int) -> None:
    """ValueError unless a worker would compute this batch (what the fuzzer must not send)."""
    n = msg.positions.shape[0]
    if not (1 <= n <= N_BATCH and msg.is_tokens and msg.inputs.shape == (n,)):
        raise ValueError
    if msg.positions.max() >= FAR or msg.seq_ids.max() >= 1 or msg.inputs.max() >= n_vocab:
        raise ValueError
    if msg.inputs.min() < 0 or not msg.outputs.any():
        raise ValueError


# --------------------------------------------------------------------------- as a malicious worker


def lies(rng: random.Random, msg: wire.Forward, n_embd: int) -> list:
    """Frames a malicious last stage sends for batch ``msg``, then (usually) an honest result:
    hidden states of every row (the head computes the output layer)."""
    rows = int(msg.positions.size)
    honest = wire.to_frames(wire.Result(msg.txn, msg.group, False, np.zeros((rows, n_embd), np.float32)))
    kind = rng.randrange(9)
    txn = rng.choice([msg.txn, msg.txn, msg.txn + 1, 0, 2**40])
    if kind == 0:
        width = rng.choice([n_embd + 1, n_embd + 1000, n_embd - 1, 1])
        dtype = rng.choice([np.float32, np.float16])
        lie = wire.to_frames(wire.Result(txn, msg.group, False, np.zeros((rows, width), dtype)))
    elif kind == 1:
        lie = wire.to_frames(wire.Result(txn, msg.group, False, np.zeros((rng.choice([0, rows + 1, 64]), n_embd),
                                                                            np.float32)))
    elif kind == 2:
        lie = wire.to_frames(wire.Result(txn, msg.group, rng.random() < 0.5, np.zeros((0, 1), np.float32)))
    elif kind == 3:
        lie = wire.to_frames(wire.Error("liar", rng.choice(["failed", "busy", "crashed", "x"]), "no", txn))
    elif kind == 4:
        lie = mutate(rng, [bytes(f) for f in honest])
    elif kind == 5:
        lie = mutate(rng, [bytes(f) for f in wire.to_frames(rng.choice(samples()))])
    elif kind == 6:
        lie = wire.to_frames(rng.choice(samples()))
    elif kind == 7:  # a result bigger than any legal one (the head caps its message size)
        lie = [wire.MAGIC, json.dumps({"type": "result", "f": {"txn": txn, "group": 0, "skip": False},
                                       "a": [["hidden", "f32", [2 * N_BATCH + 8, n_embd]]]}).encode(),
               b"\0" * ((2 * N_BATCH + 8) * n_embd * 4)]
    else:
        lie = [rng.randbytes(rng.randrange(1, 64)) for _ in range(rng.randint(1, 5))]
    return [lie, honest]  # an unanswered batch is the stall path, tested elsewhere (and slow here)


def fuzz_as_worker(n_cases: int, seed: int, model: Model, model_path: Path, tmp: Path, keys: CurveKeys,
                   start_worker: StartWorker) -> dict:
    """``n_cases`` batches answered with lies by a token holder posing as a worker; then a
    real pipeline from the same process must be exact. A target that refused a lie without
    failing (a refusal of one batch) answers the next case: refusing must leave it usable."""
    rng = random.Random(seed)
    n_vocab = model.n_vocab
    cache = SliceCache(tmp / "slices")
    liar = FakeWorker(keys, n_vocab, lambda m: lies(rng, m, model.n_embd), n_embd=model.n_embd, node_id="liar")
    report = {"cases": 0, "refused": 0, "accepted_honest": 0, "reopened": 0, "wrong_shape_accepted": 0,
              "other_exceptions": 0}
    target = None
    try:
        while report["cases"] < n_cases:
            if target is None or target.failure is not None:
                if target is not None:
                    target.close()
                target = open_pipeline(model_path, [f"127.0.0.1:{liar.port}"], keys, n_ctx=N_CTX, n_batch=N_BATCH,
                                       slice_cache=cache, stall_timeout_s=0.5, join_timeout_s=5,
                                       recover=False)  # the head's own checks, not its recovery
                report["reopened"] += 1
            report["cases"] += 1
            try:
                target.reset()
                out = target.decode([1, 2, 3][: rng.randint(1, 3)])
                if out.shape != (1, n_vocab):
                    report["wrong_shape_accepted"] += 1
                report["accepted_honest"] += 1
            except PotluckError:
                report["refused"] += 1  # a lie refused: the next case reuses the target unless it failed
            except Exception as e:  # anything but a PotluckError is a bug in the head
                report["other_exceptions"] += 1
                report.setdefault("first_exception", f"{type(e).__name__}: {e}")
                target.close()
                target = None
    finally:
        if target is not None:
            target.close()
        liar.close()
    # the same process then runs a real pipeline exactly
    with start_worker(tmp / "after-liar") as worker:
        real = open_pipeline(model_path, [worker.address], keys, n_ctx=N_CTX, n_batch=N_BATCH, slice_cache=cache)
        local = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1))
        try:
            prompt = model.tokenize(PROMPT)
            report["exact_after"] = bool(np.array_equal(local.decode(prompt, all_logits=True),
                                                        real.decode(prompt, all_logits=True)))
        finally:
            local.close()
            real.close()
    report["ok"] = report["exact_after"] and not report["other_exceptions"] and not report["wrong_shape_accepted"]
    return report
