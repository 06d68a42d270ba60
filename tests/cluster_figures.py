"""Closing-note figures for cluster mode (a script, not a test: timings never go in tests).

    .venv/bin/python -m tests.cluster_figures

Starts 3 loopback workers (1 thread each), then reports: tokens/s on one machine (1 and
2 threads) vs 2- and 3-stage pipelines, per-hop latency, bytes on the wire per token,
slice transfer throughput, and whether fp16 hidden states keep greedy output exact.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from potluck.assets import default_model_path
from potluck.discovery.auth import keys_from_token
from potluck.engine.cluster import wire
from potluck.engine.cluster.head import PipelineTarget, open_pipeline
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.core.events import Finished
from potluck.engine.core.gguf_tools import slice_layers
from potluck.engine.core.jobs import DecodeJob
from potluck.engine.core.plain import Plain
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.session import Session
from potluck.engine.core.target import LocalTarget, Target

from .cluster_support import TOKEN, start_workers, stop_worker
from .support.prompts import PROMPTS
from .support.split_target import SplitTarget

N_CTX = 1024
NEW = 64


def _first_link_bytes(target) -> tuple[int, int]:
    """(bytes sent to, bytes received from) the chain's workers so far."""
    return sum(lk.bytes_out for lk in target.links), sum(lk.bytes_in for lk in target.links)


def chat_speed(model: Model, target: Target, repeats: int = 3) -> tuple[float, list[tuple[int, ...]]]:
    """Best decode tok/s over ``repeats`` short chat replies (greedy), and the tokens."""
    best, outs = 0.0, []
    for i in range(repeats):
        if hasattr(target, "reset"):
            target.reset()
        else:
            target.truncate(0)
        s = Session(model, target, Plain())
        fin = [e for e in s.generate(PROMPTS[i % 2], SamplingParams(), NEW) if isinstance(e, Finished)][0]
        best = max(best, fin.tokens_per_s)
        outs.append(fin.tokens)
    return best, outs


def ping_rtt_ms(target: PipelineTarget, n: int = 200) -> float:
    link = target.links[0]
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        link.send(wire.Ping(i))
        assert link.sock.poll(2000)
        link.recv()
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1000)


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="potluck-figures-"))
    mp = default_model_path()
    assert mp is not None
    keys = keys_from_token(TOKEN)
    model = Model(mp)
    workers = start_workers(tmp, ["w0", "w1", "w2"])
    try:
        for threads in (1, 2):
            lt = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=threads))
            tps, ref = chat_speed(model, lt)
            lt.close()
            print(f"single machine, {threads} thread(s): {tps:.1f} tok/s")
        local1 = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1))
        t0 = time.perf_counter()
        for _ in range(NEW):
            local1.decode([1])
        local_ms = (time.perf_counter() - t0) / NEW * 1000
        local1.close()
        print(f"single machine, 1 thread: {local_ms:.2f} ms per single-token decode")
        split_ms: dict[int, float] = {}
        for split in ([0, 15, 30], [0, 10, 20, 30]):
            slices = [Model(slice_layers(mp, tmp / f"inproc-{lo}-{hi}.gguf", lo, hi))
                      for lo, hi in zip(split, split[1:])]
            st = SplitTarget(slices, ContextParams(n_ctx=N_CTX, n_threads=1))
            st.decode([1, 2, 3])
            t0 = time.perf_counter()
            for _ in range(NEW):
                st.decode([1])
            split_ms[len(slices)] = (time.perf_counter() - t0) / NEW * 1000
            st.close()
            for sm in slices:
                sm.close()
            print(f"in-process split into {len(slices)} stages, 1 thread: {split_ms[len(slices)]:.2f} ms per token")

        cache = SliceCache(tmp / "slices")
        for n_stages, split in ((2, [0, 15, 30]), (3, [0, 10, 20, 30])):
            target = open_pipeline(mp, [w.address for w in workers[:n_stages]], keys, n_ctx=N_CTX,
                                   split=split, slice_cache=cache)
            tr = target.transfer
            if tr.bytes_sent:
                print(f"{n_stages} stages: sent {tr.bytes_sent / 1e6:.1f} MB of slices in {tr.seconds:.2f} s "
                      f"= {tr.mb_per_s:.0f} MB/s (sha256 checked by the worker)")
            else:
                print(f"{n_stages} stages: slices cached on the workers, 0 bytes sent")
            tps, outs = chat_speed(model, target)
            print(f"{n_stages} stages (1 thread each): {tps:.1f} tok/s; output identical to one machine: {outs == ref}")
            target.reset()
            target.decode([1, 2, 3])
            out0, in0 = _first_link_bytes(target)
            t0 = time.perf_counter()
            for _ in range(NEW):
                target.decode([1])
            ms = (time.perf_counter() - t0) / NEW * 1000
            out1, in1 = _first_link_bytes(target)
            hops = n_stages + 1
            base = split_ms[n_stages]
            print(f"  {ms:.2f} ms per token vs {base:.2f} ms for the same split in one process: "
                  f"+{ms - base:.2f} ms over {hops} hops = {(ms - base) / hops:.2f} ms per hop")
            print(f"  ping round trip head<->stage 1: {ping_rtt_ms(target):.3f} ms")
            hidden = wire.Forward.from_job(
                1, DecodeJob(0, np.zeros((1, model.n_embd), np.float32), np.zeros(1, np.int32),
                             np.zeros(1, np.int32), np.ones(1, bool)),
            )
            hop_bytes = wire.frames_nbytes(wire.to_frames(hidden))
            print(f"  bytes per token: head->stage 1 {(out1 - out0) / NEW:.0f}, stage->stage {hop_bytes} "
                  f"(f32 hidden {model.n_embd * 4}), last stage->head {(in1 - in0) / NEW:.0f} (f32 logits)")
            target.close()

        target = open_pipeline(mp, [w.address for w in workers[:2]], keys, n_ctx=N_CTX, split=[0, 15, 30],
                               hidden_dtype="f16", slice_cache=cache)
        _, outs16 = chat_speed(model, target)
        same = sum(a == b for a, b in zip(outs16, ref))
        lt = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1))
        target.reset()
        toks = model.tokenize("<|im_start|>user\nExplain what a hash table is.<|im_end|>\n<|im_start|>assistant\n")
        diff = float(np.abs(lt.decode(toks, all_logits=True) - target.decode(toks, all_logits=True)).max())
        agree = []
        tok = int(np.argmax(lt.decode([1])[0]))
        target.decode([1])
        for _ in range(NEW):
            a = lt.decode([tok])[0].copy()
            b = target.decode([tok])[0]
            agree.append(int(np.argmax(a)) == int(np.argmax(b)))
            diff = max(diff, float(np.abs(a - b).max()))
            tok = int(np.argmax(a))
        print(f"fp16 hidden states: {same}/{len(ref)} replies identical; max |logit diff| {diff:.4f}; "
              f"teacher-forced argmax agreement {np.mean(agree):.3f}")
        lt.close()
        target.close()
    finally:
        for w in workers:
            stop_worker(w.proc)
        model.close()
        zmq.Context.instance().term()


if __name__ == "__main__":
    main()
