"""Failure without recovery: a worker killed or frozen mid-reply is named within 5 s, nothing
hangs, and the conversation so far is kept."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from potluck.discovery.auth import keys_from_token
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.link import NodeFailedError
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.core.events import TokenText
from potluck.engine.core.plain import Plain
from potluck.engine.core.runtime import Model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.session import Session

from .cluster_support import TOKEN, WorkerProc, start_workers, stop_workers


@pytest.fixture()
def two_workers(tmp_path: Path) -> Iterator[list[WorkerProc]]:
    procs = start_workers(tmp_path, ["w0", "w1"])
    yield procs
    for w in procs:
        if w.alive():
            os.kill(w.proc.pid, signal.SIGCONT)
    stop_workers([w.proc for w in procs])


@pytest.fixture(scope="module")
def slice_cache(tmp_path_factory: pytest.TempPathFactory) -> SliceCache:
    return SliceCache(tmp_path_factory.mktemp("slices"))


@pytest.mark.parametrize("how", ["kill", "freeze"])
def test_worker_lost_mid_reply_is_named_quickly(
    how: str, two_workers: list[WorkerProc], model: Model, model_path: Path, slice_cache: SliceCache
) -> None:
    target = open_pipeline(
        model_path, [w.address for w in two_workers], keys_from_token(TOKEN), n_ctx=512,
        split=[0, 15, 30], slice_cache=slice_cache, recover=False,  # recovery: test_cluster_recovery.py
    )
    session = Session(model, target, Plain())
    victim = two_workers[1]
    emitted: list[int] = []
    try:
        stream = session.generate("Count from one to fifty in words.", SamplingParams(), 200)
        with pytest.raises(NodeFailedError) as err:
            for event in stream:
                if isinstance(event, TokenText):
                    emitted.extend(event.token_ids)
                    if len(emitted) == 5:
                        os.kill(victim.proc.pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
                        t_lost = time.monotonic()
        assert time.monotonic() - t_lost < 5.0
        message = str(err.value)
        assert victim.node_id in message and victim.address in message and "15-30" in message
        # The conversation is intact: the question and the partial reply are kept.
        assert [m.role for m in session.messages] == ["user", "assistant"]
        assert session.messages[-1].content
        assert target.failure is not None and target.n_past <= session.conversation_tokens
        with pytest.raises(NodeFailedError):
            target.decode([1])
    finally:
        t0 = time.monotonic()
        target.close()
        assert time.monotonic() - t0 < 3.0
    assert two_workers[0].alive()
