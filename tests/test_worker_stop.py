"""SIGTERM ends a worker and its stage process at any moment (issue 39 item 9).

Both workers of a chain killed together during a reply once left one of them and its llama.cpp
child blocked writing to each other (~219 KB queued each way) until ``kill -9``. Here a burst
of single-token batches (a replay sends the whole conversation at once) fills the stage
process's pipe before both workers get SIGTERM; other trials stop them in the middle of a
slice transfer. A few of each here; ``python -m scripts.worker_kill_trials`` runs 20 of each
and reports the times (the goal: 2 s; a wedged worker never ends).
"""

from __future__ import annotations

import random
import threading
from pathlib import Path

from potluck.discovery.auth import keys_from_token
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.core.runtime import Model
from potluck.engine.lab.worker_kills import queue_burst, sigterm_and_time

from .cluster_support import TOKEN, start_workers, stop_workers

KILLS = 2  # of each kind, in the suite (scripts/worker_kill_trials.py: 20 of each)
BURST = 1500  # single-token batches queued at once before the stop
LIMIT_S = 15.0  # far past the 2 s goal on a busy CI machine; a wedged worker never ends
PROMPT = "<|im_start|>user\nCount to twenty.<|im_end|>\n<|im_start|>assistant\n"


def test_sigterm_during_replies_ends_each_worker_and_its_stage(tmp_path: Path, model: Model, model_path: Path) -> None:
    rng = random.Random(39)
    keys = keys_from_token(TOKEN)
    cache = SliceCache(tmp_path / "slices")
    times: list[float | None] = []
    logs = []
    for _ in range(KILLS):
        workers = start_workers(tmp_path, ["a", "b"])  # the same caches: slices are sent once
        try:
            target = open_pipeline(model_path, [w.address for w in workers], keys, n_ctx=2048, n_threads=1,
                                   slice_cache=cache, recover=False)
            try:
                prompt = model.tokenize(PROMPT)
                target.decode(prompt)
                assert queue_burst(target, 200, len(prompt), BURST) == BURST  # ~1 MB: far more than a pipe holds
                threading.Event().wait(rng.uniform(0.0, 0.05))
                times += sigterm_and_time([w.proc for w in workers], LIMIT_S)
            finally:
                target.close()
            logs += [w.log() for w in workers]
        finally:
            stop_workers([w.proc for w in workers])
    assert all(t is not None for t in times), times
    stopping = [line for log in logs for line in log.splitlines() if "stopping with" in line]
    # each stopped through its own close, with its stage loaded (seen once 3 of 4 under load:
    # the logs say which worker had no stage, and why)
    assert len(stopping) == 2 * KILLS, "\n\n".join(logs)
    # the path under test ran: a stage had work waiting for room in its pipe when stopped
    assert any(" 0 byte(s) of them waiting" not in line for line in stopping), stopping


def test_sigterm_during_slice_transfers_ends_each_worker(tmp_path: Path, model_path: Path) -> None:
    rng = random.Random(20)
    times: list[float | None] = []
    for trial in range(KILLS):
        workers = start_workers(tmp_path, [f"t{trial}a", f"t{trial}b"])  # fresh caches: the slices are sent
        try:
            times += _kill_during_transfer(workers, model_path, SliceCache(tmp_path / f"head{trial}"),
                                           rng.uniform(0.1, 0.9))
        finally:
            stop_workers([w.proc for w in workers])
    assert all(t is not None for t in times), times


def _kill_during_transfer(workers: list, model_path: Path, cache: SliceCache, at: float) -> list[float | None]:
    """Open a chain over ``workers`` and SIGTERM them once a slice is ``at`` sent."""
    sending = threading.Event()
    failed: list[BaseException] = []

    def progress(what: str, done: int, total: int) -> None:
        if total and done >= at * total:
            sending.set()

    def head() -> None:
        try:
            open_pipeline(model_path, [w.address for w in workers], keys_from_token(TOKEN), n_ctx=256,
                          progress=progress, slice_cache=cache, recover=False).close()
        except Exception as e:  # the workers are stopped under it
            failed.append(e)

    thread = threading.Thread(target=head, daemon=True)
    thread.start()
    assert sending.wait(120), "no slice was being sent"
    times = sigterm_and_time([w.proc for w in workers], LIMIT_S)
    thread.join(120)
    assert not thread.is_alive() and failed, "the head did not notice its workers stopped"
    return times
