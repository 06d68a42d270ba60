"""A hybrid recurrent model (qwen35moe) over loopback worker processes: speculation with
rejected drafts rolled back on every worker, and a worker lost mid-reply, replaced by a replay
of the head's log, give plain decoding's tokens on one machine."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from potluck.discovery.auth import keys_from_token
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.pipeline_target import PipelineTarget
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.core.events import Finished, TokenText
from potluck.engine.core.gguf_tools import slice_layers
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.session import Session
from potluck.engine.core.spec import EngineSpec
from potluck.engine.core.target import LocalTarget, Target
from potluck.engine.lab.hybrid_shapes import build_hybrid_shape
from potluck.engine.speculation.strategies.registry import get_strategy_class

from .cluster_support import JOIN_S, TOKEN, WorkerProc, start_workers, stop_worker

# worker processes take minutes here; speculation over stages is also checked in-process
# (tests/test_hybrid.py, 3 stages)
pytestmark = pytest.mark.slow

N_CTX = 512
TURNS = ["Repeat after me: the cat sat on the mat, the cat sat on the mat.", "Now say it again."]
MAX_NEW = 24
# two workers with attention layers (3; 7 and 11), and the head the output layer behind zeros of
# layer 11 and of a recurrent layer (archs.Arch.filler)
SPLIT = [0, 5, 12]


@pytest.fixture(scope="module")
def path() -> Path:
    return build_hybrid_shape("qwen35moe-small")


@pytest.fixture(scope="module")
def model(path: Path) -> Iterator[Model]:
    with Model(path) as m:
        yield m


@pytest.fixture(scope="module")
def draft(path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return slice_layers(path, tmp_path_factory.mktemp("draft") / "draft.gguf", 0, 8)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> SliceCache:
    return SliceCache(tmp_path_factory.mktemp("hybrid-slices"))


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProc]]:
    """Two workers for the module (the loss test, last, kills one)."""
    tmp = tmp_path_factory.mktemp("hybrid-workers")
    procs = start_workers(tmp, ["h0", "h1"])
    try:
        yield procs
    finally:
        for w in procs:
            if w.alive():
                stop_worker(w.proc)


def converse(model: Model, target: Target, strategy: str, draft: Path | None,
             on_token: Callable[[int], None] | None = None) -> tuple[list[tuple[int, ...]], int, int]:
    spec = EngineSpec(strategy=strategy, draft=draft, n_ctx=N_CTX, n_threads=1, strategy_options={"adaptive": False})
    session = Session(model, target, get_strategy_class(strategy).build(model, spec))
    replies, drafted, accepted = [], 0, 0
    try:
        for turn in TURNS:
            n = 0
            for ev in session.generate(turn, SamplingParams(), MAX_NEW):
                if isinstance(ev, TokenText):
                    n += len(ev.token_ids)
                    if on_token is not None:
                        on_token(n)
                elif isinstance(ev, Finished):
                    replies.append(ev.tokens)
                    drafted, accepted = drafted + ev.drafted, accepted + ev.accepted
            on_token = None  # the loss happens in the first reply only
    finally:
        session.strategy.close()
    return replies, drafted, accepted


@pytest.fixture(scope="module")
def reference(model: Model) -> list[tuple[int, ...]]:
    target = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1))
    try:
        return converse(model, target, "plain", None)[0]
    finally:
        target.close()


def pipeline(path: Path, workers: list[WorkerProc], cache: SliceCache) -> PipelineTarget:
    return open_pipeline(path, [w.address for w in workers], keys_from_token(TOKEN), n_ctx=N_CTX, split=SPLIT,
                         slice_cache=cache, join_timeout_s=JOIN_S)


@pytest.mark.parametrize("strategy", ["sd", "pipeinfer"])
def test_speculation_over_workers_is_exact(
    model: Model, path: Path, draft: Path, workers: list[WorkerProc], cache: SliceCache, reference, strategy: str
) -> None:
    target = pipeline(path, workers, cache)
    try:
        assert target.recurrent and target.head_layers == (12, 12)  # the output layer alone
        replies, drafted, accepted = converse(model, target, strategy, draft)
        assert replies == reference
        assert drafted > accepted  # rejected drafts were rolled back on every stage
        assert target.tail.stage.rollback is not None
        c = target.tail.stage.rollback.counters
        assert c.snapshot_rollbacks + c.restores > 0, c
    finally:
        target.close()


def test_a_lost_worker_is_replaced_and_the_reply_stays_exact(
    model: Model, path: Path, workers: list[WorkerProc], cache: SliceCache, reference
) -> None:
    """The replay of the head's log (batches, rejected tails and all) rebuilds every
    recurrent state on the new chain exactly."""
    target = pipeline(path, workers, cache)
    lost = workers[0]

    def strike(n_tokens: int) -> None:
        if n_tokens >= 6 and lost.alive():
            os.kill(lost.proc.pid, signal.SIGKILL)

    try:
        replies, drafted, accepted = converse(model, target, "anpd", None, strike)
        assert not lost.alive() and target.recoveries == 1 and target.failure is None
        assert replies == reference
        assert drafted > accepted and target.stats.replayed_batches > 0
    finally:
        target.close()
