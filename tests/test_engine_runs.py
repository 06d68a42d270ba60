"""The engine core's runs, sequences and tickets on one machine: several jobs in flight in
different KV sequences, each exactly what it computes alone; the canonical sequence never
disturbed; cancellation that reaches a running batch; the cross-stream copy guard; seeded
sampling that repeats when drafting runs on another thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from potluck.engine.core.events import Finished
from potluck.engine.core.gguf_tools import merge_layer_ranges, slice_layers
from potluck.engine.core.jobs import DecodeJob, GroupCancelled
from potluck.engine.core.kv import KvOp
from potluck.engine.core.runtime import Context, ContextParams, Model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.session import Session
from potluck.engine.core.spec import EngineSpec
from potluck.engine.core.target import LocalTarget, Target, TargetBase
from potluck.engine.speculation.drafters import Draft, Drafter, DraftRequest
from potluck.engine.speculation.strategies.registry import get_strategy_class

from .support.split_target import SplitTarget

THREADS = 2  # more than one thread: BF16 KV keeps batches exact at any count (docs/facts.md §3)
PROMPT = "<|im_start|>user\nName three rivers of Europe.<|im_end|>\n<|im_start|>assistant\n"
CANONICAL = " The Danube, the Rhine and the Seine are three of the longest."
SIDE = " I would rather talk about mountains: the Alps, the Pyrenees, the Carpathians."
SEQS = ContextParams(n_ctx=512, n_threads=THREADS, n_seq_max=2, kv_unified=False)


def alone(make: Callable[[], TargetBase], prefix: list[int], tokens: list[int]) -> np.ndarray:
    """Logits of ``tokens`` appended to ``prefix`` on sequence 0 of a fresh target."""
    t = make()
    try:
        t.decode(prefix)
        return t.decode(tokens, all_logits=True).copy()
    finally:
        t.close()


def two_runs_in_flight(make: Callable[[], TargetBase], model: Model) -> None:
    prefix = model.tokenize(PROMPT)
    canonical, side = model.tokenize(CANONICAL), model.tokenize(SIDE)
    ref_canonical = alone(make, prefix, canonical)
    ref_side = alone(make, prefix, side)
    ref_next = alone(make, prefix + canonical, canonical[:3])

    t = make()
    try:
        t.decode(prefix)
        t.kv(KvOp.cp(0, 1))  # the side run starts from the conversation, in its own KV stream
        n = len(prefix)
        side_run, main_run = t.new_group(), t.new_group()
        side_ticket = t.submit(DecodeJob.tokens(side_run, side, n, seq_id=1, outputs="all"))
        main_ticket = t.submit(DecodeJob.tokens(main_run, canonical, n, seq_id=0, outputs="all"))
        # redeemed in the other order than submitted: results are routed, not dropped
        assert np.array_equal(t.wait(main_ticket), ref_canonical)
        assert np.array_equal(t.wait(side_ticket), ref_side)
        # the canonical sequence goes on exactly as if the side run had never been
        t.kv(KvOp.rm(1))
        after = DecodeJob.tokens(t.new_group(), canonical[:3], n + len(canonical), outputs="all")
        assert np.array_equal(t.wait(t.submit(after)), ref_next)
    finally:
        t.close()


def test_two_runs_in_flight_local(model: Model) -> None:
    two_runs_in_flight(lambda: LocalTarget(model, SEQS), model)


def test_two_runs_in_flight_split_in_process(model: Model, model_path: Path, tmp_path: Path) -> None:
    """The same on two stages chained in this process (one runner thread per stage)."""
    slices = [slice_layers(model_path, tmp_path / f"s{lo}.gguf", lo, hi) for lo, hi in [(0, 13), (13, 30)]]
    models = [Model(p) for p in slices]
    try:
        two_runs_in_flight(lambda: SplitTarget(models, SEQS), model)
    finally:
        for m in models:
            m.close()


def test_cancel_reaches_a_running_batch_and_skips_queued_ones(model: Model) -> None:
    t = LocalTarget(model, ContextParams(n_ctx=1024, n_threads=THREADS))
    try:
        long = model.tokenize("The quick brown fox jumps over the lazy dog. " * 60)[:500]
        run = t.new_group()
        first = t.submit(DecodeJob.tokens(run, long[:250], 0))
        second = t.submit(DecodeJob.tokens(run, long[250:], 250))
        while t.runner.running_group != run:
            time.sleep(0.001)
        t.cancel(run)
        for ticket in (first, second):
            with pytest.raises(GroupCancelled):
                t.wait(ticket)
        c = t.runner.counters
        assert (c.aborted, c.skipped) == (1, 1)  # stopped mid-compute, the queued one never ran
        assert t.pos_max()[0] == -1  # llama.cpp removed the aborted batch's cells
        # still exact afterwards
        prompt = model.tokenize(PROMPT)
        ref = alone(lambda: LocalTarget(model, ContextParams(n_ctx=1024, n_threads=THREADS)), prompt[:3], prompt[3:])
        t.decode(prompt[:3])
        assert np.array_equal(t.decode(prompt[3:], all_logits=True), ref)
    finally:
        t.close()


def test_runs_cancelled_together_never_start_after_the_abort(model: Model) -> None:
    """Three runs, each continuing the one before (pipeinfer's micro-batches): cancelled in
    one call while the first computes, the first aborts (its cells go) and the next two are
    skipped. Started, the second would ask llama.cpp for positions that no longer follow."""
    t = LocalTarget(model, ContextParams(n_ctx=1024, n_threads=THREADS))
    try:
        long = model.tokenize("The quick brown fox jumps over the lazy dog. " * 60)[:500]
        runs = [t.new_group() for _ in range(3)]
        tickets = [t.submit(DecodeJob.tokens(r, long[i * 160 : (i + 1) * 160], i * 160)) for i, r in enumerate(runs)]
        while t.runner.running_group != runs[0]:
            time.sleep(0.001)
        t.cancel(*runs)
        for ticket in tickets:
            with pytest.raises(GroupCancelled):
                t.wait(ticket)
        c = t.runner.counters
        assert (c.aborted, c.skipped) == (1, 2)
        assert t.pos_max()[0] == -1
    finally:
        t.close()


def test_ranged_copy_across_streams_is_refused_not_fatal(model: Model) -> None:
    """llama.cpp aborts the process on this (GGML_ASSERT); the runtime refuses it for every caller."""
    with Context(model, SEQS) as ctx:
        ctx.run_tokens(model.tokenize(PROMPT), 0)
        with pytest.raises(ValueError, match="whole sequences"):
            ctx.seq_cp(0, 1, 0, 5)
        with pytest.raises(ValueError, match="whole sequences"):
            ctx.apply_kv(KvOp.cp(0, 1, 2, -1))
        ctx.seq_cp(0, 1)  # whole: fine
        assert ctx.seq_pos_max(1) == ctx.seq_pos_max(0)
    t = LocalTarget(model, SEQS)
    try:
        with pytest.raises(ValueError):
            t.kv(KvOp.cp(0, 1, 0, 4))  # refused before it is queued
    finally:
        t.close()


def test_canonical_context_is_the_one_asked_for(model: Model) -> None:
    """Per-sequence streams divide llama.cpp's n_ctx: the engine sizes it so sequence 0 keeps all."""
    t = LocalTarget(model, ContextParams(n_ctx=768, n_threads=1, n_seq_max=4, kv_unified=False))
    try:
        assert t.n_ctx == 768 and t.n_seq_max == 4
    finally:
        t.close()


class OnAnotherThread:
    """Runs a drafter's every call on a thread of its own while the caller's thread goes on."""

    def __init__(self, inner: Drafter, pool: ThreadPoolExecutor) -> None:
        self.inner, self.pool = inner, pool
        self.name = inner.name
        self.threads: set[int] = set()

    @property
    def step_ms(self) -> float:
        return self.inner.step_ms

    def _on_pool(self, fn: Callable[[], object]) -> object:
        def run() -> object:
            self.threads.add(threading.get_ident())
            return fn()

        return self.pool.submit(run).result()

    def begin(self, context: Sequence[int], rng: np.random.Generator) -> None:
        self._on_pool(lambda: self.inner.begin(context, rng))

    def draft(self, req: DraftRequest) -> Draft:
        return self._on_pool(lambda: self.inner.draft(req))  # type: ignore[return-value]

    def accept(self, n_accepted: int) -> None:
        self._on_pool(lambda: self.inner.accept(n_accepted))

    def reset(self) -> None:
        self.inner.reset()

    def close(self) -> None:
        self.inner.close()


def sampled_reply(model: Model, draft_path: Path, pool: ThreadPoolExecutor | None) -> tuple[tuple[int, ...], Finished]:
    options = {"max_draft": 3, "adaptive": False}  # fixed length: the weak draft keeps being tried
    spec = EngineSpec(strategy="sd", draft=draft_path, n_ctx=1024, n_threads=1, strategy_options=options)
    strategy = get_strategy_class("sd").build(model, spec)
    if pool is not None:
        strategy.drafter = OnAnotherThread(strategy.drafter, pool)  # type: ignore[attr-defined]
    target: Target = LocalTarget(model, ContextParams(n_ctx=1024, n_threads=1))
    session = Session(model, target, strategy)
    try:
        *_, fin = session.generate("Tell me about cats.", SamplingParams(temperature=0.9, seed=11), 48)
        assert isinstance(fin, Finished)
        if pool is not None:
            assert strategy.drafter.threads and threading.get_ident() not in strategy.drafter.threads  # type: ignore[attr-defined]
        return fin.tokens, fin
    finally:
        session.close()


@pytest.mark.slow  # seeded replies repeat with a draft thread by default: test_pearl, test_minions
def test_seeded_sampling_repeats_with_drafting_on_another_thread(
    model: Model, model_path: Path, tmp_path: Path
) -> None:
    """Each drafter draws from a generator of its own, spawned from the session's seed, so the
    reply does not depend on which thread drafts (nor on the verifier's draws)."""
    draft_path = merge_layer_ranges(model_path, tmp_path / "weak.gguf", [(0, 19)])  # a draft that gets rejected
    same_thread, fin = sampled_reply(model, draft_path, None)
    assert fin.drafted > fin.accepted > 0
    with ThreadPoolExecutor(1) as pool:
        other_thread, _ = sampled_reply(model, draft_path, pool)
    with ThreadPoolExecutor(1) as pool:
        again, _ = sampled_reply(model, draft_path, pool)
    assert same_thread == other_thread == again


def test_drafting_never_draws_from_the_verifiers_generator(model: Model) -> None:
    """The contract behind the test above: a drafter's random draws come from its own generator."""
    from potluck.engine.core.sampling import Sampler
    from potluck.engine.speculation.drafters.draft_model import DraftModelDrafter

    params = SamplingParams(temperature=1.0, seed=3)
    seeds = np.random.SeedSequence(params.seed)
    sampler = Sampler(params, np.random.default_rng(seeds))
    before = sampler.rng.bit_generator.state
    drafter = DraftModelDrafter(model, n_ctx=256, n_threads=1, owns_model=False)
    try:
        context = model.tokenize(PROMPT)
        drafter.begin(context, np.random.default_rng(seeds.spawn(1)[0]))
        draft = drafter.draft(DraftRequest(context, 4, 0.0, params))
        assert len(draft.tokens) == 4 and draft.q is not None  # sampled drafts: 4 draws were made
    finally:
        drafter.close()
    assert sampler.rng.bit_generator.state == before
