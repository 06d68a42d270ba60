"""The head computes the model's last layer and the output layer (engine/cluster/tail.py):
the last worker returns hidden states, a few kB a token instead of 196 kB of logits, and
every logit still equals one machine's exactly, on 2 and 3 real worker processes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from potluck.discovery.auth import keys_from_token
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.pipeline_target import PipelineTarget
from potluck.engine.cluster.tail import HeadTail
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.core.jobs import DecodeJob, GroupCancelled
from potluck.engine.core.kv import KvOp
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.stage import Stage
from potluck.engine.core.target import LocalTarget

from .cluster_support import TOKEN, WorkerProc

N_CTX = 512
PROMPT = "<|im_start|>user\nName three rivers of Europe.<|im_end|>\n<|im_start|>assistant\n"
STEPS = 10
MAX_BYTES_PER_TOKEN = 8 * 1024  # the goal; logits were 196,709 bytes a token


@pytest.fixture(scope="module")
def slice_cache(tmp_path_factory: pytest.TempPathFactory) -> SliceCache:
    return SliceCache(tmp_path_factory.mktemp("tail-slices"))


def greedy_logits(target: LocalTarget | PipelineTarget, prompt: list[int]) -> list[np.ndarray]:
    """The prompt's logits (every row), then STEPS greedy steps' logits."""
    out = [target.decode(prompt, all_logits=True).copy()]
    for _ in range(STEPS):
        out.append(target.decode([int(np.argmax(out[-1][-1]))]).copy())
    return out


# three loopback workers by default: test_cluster_recovery (every reply there crosses 3 stages)
@pytest.mark.parametrize("n_workers", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_last_worker_returns_hidden_states_and_logits_stay_exact(
    n_workers: int, model: Model, model_path: Path, loopback_pool: list[WorkerProc], slice_cache: SliceCache
) -> None:
    prompt = model.tokenize(PROMPT)
    local = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1))
    try:
        want = greedy_logits(local, prompt)
    finally:
        local.close()
    split = [0, 15, 30] if n_workers == 2 else None  # the user's split, or the planner's
    target = open_pipeline(model_path, [w.address for w in loopback_pool[:n_workers]], keys_from_token(TOKEN),
                           n_ctx=N_CTX, n_threads=1, slice_cache=slice_cache, split=split)
    try:
        # workers share every layer; the head holds the output layer (behind layer 29 as zeros)
        assert target.head_layers == (30, 30) and target.links[-1].layers is not None
        assert target.links[-1].layers[1] == 30 and target.tail.model.n_layer == 1
        assert len(target.links) == n_workers and target.n_stages == n_workers + 1
        last = target.links[-1]
        bytes_in, tokens = last.bytes_in, target.stats.tokens
        got = greedy_logits(target, prompt)
        per_token = (last.bytes_in - bytes_in) / (target.stats.tokens - tokens)
        assert target.stats.tokens - tokens == len(prompt) + STEPS
        for ref, out in zip(want, got):
            assert np.array_equal(ref, out)  # max |diff| 0.0, every row of the prompt too
        # hidden states of every row came back (n_embd f32 each), never a row of logits
        assert model.n_embd * 4 < per_token <= MAX_BYTES_PER_TOKEN, per_token
        counters = target.tail.runner.counters
        assert counters.finished == 1 + STEPS and counters.aborted == counters.skipped == 0
        # waited for one at a time: the head's layers ran on the waiting thread, no hand-off
        assert target.tail.ran_here == 1 + STEPS
    finally:
        target.close()


def test_kv_operations_and_cancels_reach_the_heads_layer_in_order(
    model: Model, model_path: Path, loopback_pool: list[WorkerProc], slice_cache: SliceCache
) -> None:
    """A removed tail, a batch of a cancelled run and a reset go through the head's own layer
    in their place: the next logits still equal one machine's."""
    prompt = model.tokenize(PROMPT)
    target = open_pipeline(model_path, [w.address for w in loopback_pool[:2]], keys_from_token(TOKEN),
                           n_ctx=N_CTX, n_threads=1, slice_cache=slice_cache, split=[0, 15])
    local = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1))
    try:
        for t in (local, target):
            t.decode(prompt)
            t.decode([11, 12, 13])
            t.truncate(len(prompt))  # a KV rm, behind the batch before it
        run = target.new_group()
        target.cancel(run)
        ticket = target.submit(DecodeJob.tokens(run, [5, 6], len(prompt)))
        with pytest.raises(GroupCancelled):
            target.wait(ticket)
        assert np.array_equal(local.decode([42]), target.decode([42]))
        for t in (local, target):
            t.reset()
        assert np.array_equal(local.decode(prompt, all_logits=True), target.decode(prompt, all_logits=True))
        assert target.tail.runner.counters.kv_ops >= 1
    finally:
        local.close()
        target.close()


def test_tail_takes_transactions_in_order_whatever_order_hidden_states_arrive(
    model: Model, model_path: Path, tmp_path: Path
) -> None:
    """The head's stage on its own (no workers): a batch whose hidden states come first waits
    for the earlier one, a KV operation waits behind the batch before it, a dropped batch
    frees its place; the logits equal one machine's."""
    cache = SliceCache(tmp_path)
    (front_slice,), tail_slice = cache.slices(model_path, [0, 30]), cache.head_slice(model_path, (29, 30))
    params = ContextParams(n_ctx=N_CTX, n_threads=1)
    prompt = model.tokenize(PROMPT)
    local = LocalTarget(model, params)
    with Model(front_slice.path) as front_model:
        front = Stage(front_model, first=True, last=False, params=params)
        tail = HeadTail(tail_slice.path, (30, 30), params)
        try:
            want = [local.decode(prompt).copy(), local.decode([7, 8], all_logits=True).copy()]
            local.truncate(len(prompt))
            want.append(local.decode([9]).copy())
            jobs = [DecodeJob.tokens(1, prompt, 0), DecodeJob.tokens(1, [7, 8], len(prompt), outputs="all"),
                    DecodeJob.tokens(1, [5], len(prompt) + 2), DecodeJob.tokens(1, [9], len(prompt))]
            for txn, job in enumerate(jobs[:3], start=1):
                tail.expect(txn, txn, job)
            tail.apply(4, KvOp.rm(0, len(prompt)))  # behind batch 3, which never computes
            tail.expect(5, 5, jobs[3])
            hidden = [front.compute(jobs[0]), front.compute(jobs[1])]
            tail.arrived(2, hidden[1])  # before batch 1: it must wait
            assert not wait_done(tail, 0.5) and tail.runner.counters.finished == 0
            tail.arrived(1, hidden[0])
            tail.drop(3)  # skipped upstream: the KV operation behind it goes ahead
            front.apply_kv(KvOp.rm(0, len(prompt)))
            tail.arrived(5, front.compute(jobs[3]))
            done = wait_done(tail, 30.0, count=4)
            assert [ticket for ticket, _ in done] == [1, 2, 0, 5]
            got = [fut.result() for ticket, fut in done if ticket]
            for ref, out in zip(want, got):
                assert np.array_equal(ref, out)
            assert tail.runner.counters.kv_ops == 1
        finally:
            tail.close()
            front.close()
            local.close()


def wait_done(tail: HeadTail, timeout_s: float, count: int = 1) -> list:
    """What the tail finished within ``timeout_s`` (stops at ``count`` items)."""
    import select
    import time

    done: list = []
    deadline = time.monotonic() + timeout_s
    while len(done) < count and time.monotonic() < deadline:
        select.select([tail.wake_fd], [], [], 0.05)
        done += tail.finished()
    return done


def test_the_heads_layers_take_one_thread_beside_a_loopback_worker(
    model_path: Path, loopback_pool: list[WorkerProc], slice_cache: SliceCache
) -> None:
    """llama.cpp's OpenMP threads spin between batches: beside a worker on this machine the
    head's layers keep to one thread; with only remote workers they take every core."""
    from potluck.engine.cluster.chain import tail_threads

    target = open_pipeline(model_path, [w.address for w in loopback_pool[:2]], keys_from_token(TOKEN),
                           n_ctx=N_CTX, slice_cache=slice_cache, split=[0, 15])  # no n_threads given
    try:
        assert target.tail.stage.ctx.params.n_threads == 1
    finally:
        target.close()
    assert tail_threads(["127.0.0.1:5555", "192.0.2.7:5555"]) == 1
    assert tail_threads(["localhost:1"]) == tail_threads(["[::1]:1"]) == tail_threads(["tcp://127.0.0.2:1"]) == 1
    # 192.0.2.0/24 is reserved for documentation: never this machine's. 0: all cores
    assert tail_threads(["192.0.2.7:5555", "[2001:db8::7]:5555", "pc-kitchen.local:5555"]) == 0


def test_a_worker_at_this_machines_lan_address_shares_its_cores() -> None:
    """Zeroconf lists a worker on the same PC at its LAN address, not at 127.0.0.1."""
    from potluck.discovery.lan import local_ipv4  # what a worker advertises
    from potluck.engine.cluster.chain import tail_threads

    lan = [a for a in local_ipv4() if not a.startswith("127.")]
    if not lan:
        pytest.skip("this machine has no IPv4 address besides loopback")
    assert tail_threads([f"{lan[0]}:5555"]) == 1
