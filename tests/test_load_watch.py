"""A stage whose thread count the user did not choose computes on the cores other processes
leave free (engine/core/load_watch.py): the arithmetic on a /proc laid out in a temporary
folder, and a real stage beside a real busy process, exact at every switch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from potluck.engine.core.load_watch import LoadWatch, read_times, threads_for
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.target import LocalTarget

PROMPT = "<|im_start|>user\nName three rivers of Europe.<|im_end|>\n<|im_start|>assistant\n"


def _write_proc(root: Path, cpu_busy: list[int], cpu_idle: list[int], own_ticks: int) -> None:
    """/proc/stat (user=busy ticks, idle) and /proc/self/stat (utime=own ticks)."""
    lines = [f"cpu  {sum(cpu_busy)} 0 0 {sum(cpu_idle)} 0 0 0 0 0 0"]
    lines += [f"cpu{i} {b} 0 0 {d} 0 0 0 0 0 0" for i, (b, d) in enumerate(zip(cpu_busy, cpu_idle))]
    (root / "self").mkdir(parents=True, exist_ok=True)
    (root / "stat").write_text("\n".join(lines) + "\nintr 1 2 3\n")
    # the command name may hold spaces and parentheses: fields are counted after the last ")"
    (root / "self" / "stat").write_text(f"4242 (potluck (ui) x) S 1 1 1 0 -1 0 0 0 0 0 {own_ticks} 0 0 0 20 0\n")


def test_outside_load_is_the_machines_busy_time_less_our_own(tmp_path: Path) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    now = [100.0]
    _write_proc(tmp_path, [0, 0], [0, 0], 0)
    watch = LoadWatch(interval_s=1.0, proc=tmp_path, clock=lambda: now[0])
    watch.cpus = [0, 1]
    assert read_times([0, 1], tmp_path) is not None
    assert watch.free_cores() is None  # no interval passed yet
    # 1 s: we used 1.2 cores (our threads and the UI thread), the machine 2.0: 0.8 outside
    now[0] += 1.0
    _write_proc(tmp_path, [tick, tick], [0, 0], int(1.2 * tick))
    free = watch.free_cores()
    assert free == pytest.approx(1.2, abs=0.02)
    assert threads_for(2, free) == 1
    # next second: only our own work (UI included) keeps the machine busy: every core is free
    now[0] += 1.0
    _write_proc(tmp_path, [tick + tick // 2, tick + tick // 2], [tick // 2, tick // 2], int(2.2 * tick))
    free = watch.free_cores()
    assert free == pytest.approx(2.0, abs=0.02)
    assert threads_for(2, free) == 2
    # a core we may not use is busy: it does not count
    now[0] += 1.0
    _write_proc(tmp_path, [tick + tick // 2, tick + tick // 2, 50 * tick], [tick, tick, 0], int(2.2 * tick))
    assert watch.free_cores() == pytest.approx(2.0, abs=0.02)


def test_threads_for_takes_a_core_when_three_quarters_of_it_are_free() -> None:
    assert [threads_for(2, f) for f in (0.0, 0.4, 1.0, 1.5, 1.74, 1.75, 2.0)] == [1, 1, 1, 1, 1, 2, 2]
    assert threads_for(4, 16.0) == 4  # never more than asked for
    assert threads_for(2, float("inf")) == 2  # no figure yet (pearl sets threads in its first second)
    assert threads_for(8, 5.8) == 6


@pytest.fixture()
def two_cores_one_busy() -> Iterator[None]:
    """This process on cores {0, 1} and another process spinning on core 1, for the block."""
    if not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 usable cores")
    old = os.sched_getaffinity(0)
    cores = sorted(old)[:2]
    os.sched_setaffinity(0, cores)
    spinner = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.sched_setaffinity(0, cores[1:])
    )
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()
        os.sched_setaffinity(0, old)


def test_threads_set_before_the_first_load_figure_take_effect(model: Model) -> None:
    """pearl splits the cores (target 1 thread, draft the other) as soon as a reply starts,
    before a follow-load runner has its first figure: the change must happen, not fail in
    the runner (it raised on "no figure yet" and the target kept both cores beside the draft)."""
    target = LocalTarget(model, ContextParams(n_ctx=512, n_threads=2, follow_load=True))
    try:
        assert target.runner.follow.free_cores == float("inf")  # no figure yet
        target.runner.set_threads(1).result()
        assert target.runner.follow.threads == 1 and target.stage.ctx.threads() == (1, 1)
        target.runner.set_threads(2).result()
        assert target.runner.follow.threads == 2 and target.runner.follow.changes == 2
    finally:
        target.close()


def test_a_stage_beside_a_busy_process_drops_a_thread_and_stays_exact(
    model: Model, two_cores_one_busy: None
) -> None:
    """Two threads asked for, one core spun by another process: the runner sees one core
    free and goes on with one thread; every logit equals a fixed-thread context's."""
    follow = LocalTarget(model, ContextParams(n_ctx=512, n_threads=2, follow_load=True))
    fixed = LocalTarget(model, ContextParams(n_ctx=512, n_threads=2))
    follow.runner.follow.watch.interval_s = 0.2  # type: ignore[union-attr]  # look often: a short test
    try:
        prompt = model.tokenize(PROMPT)
        logits = follow.decode(prompt)
        assert np.array_equal(logits, fixed.decode(prompt))
        tok, steps = int(np.argmax(logits[-1])), 0
        deadline = time.monotonic() + 120  # a bound for a stalled machine, not a timing goal
        while (follow.runner.follow.changes == 0 or steps < 64) and time.monotonic() < deadline:
            if follow.n_past >= 500:
                follow.truncate(len(prompt))
                fixed.truncate(len(prompt))
            got = follow.decode([tok])
            assert np.array_equal(got, fixed.decode([tok])), steps
            tok, steps = int(np.argmax(got[-1])), steps + 1
        assert follow.runner.follow.changes >= 1
        assert follow.runner.follow.threads == 1 and follow.runner.follow.wanted == 2
        assert fixed.runner.follow.changes == 0  # a chosen thread count is kept
    finally:
        follow.close()
        fixed.close()


def test_a_draft_model_beside_a_busy_process_drops_a_thread_and_drafts_the_same(
    model: Model, two_cores_one_busy: None
) -> None:
    """sd's draft model (here the bundled model itself) follows the load like the target: with
    one core spun it goes on with one thread, and every greedy draft is a fixed-thread one's."""
    from potluck.engine.core.sampling import SamplingParams
    from potluck.engine.speculation.drafters import DraftRequest
    from potluck.engine.speculation.drafters.draft_model import DraftModelDrafter

    follow = DraftModelDrafter(model, n_ctx=512, n_threads=2, owns_model=False, follow_load=True)
    fixed = DraftModelDrafter(model, n_ctx=512, n_threads=2, owns_model=False)
    follow.follow.watch.interval_s = 0.2  # type: ignore[union-attr]  # look often: a short test
    context, rounds = model.tokenize(PROMPT), 0
    try:
        deadline = time.monotonic() + 120  # a bound for a stalled machine, not a timing goal
        while (follow.follow.changes == 0 or rounds < 16) and time.monotonic() < deadline:
            if len(context) > 400:
                context = context[:20]
            req = DraftRequest(context=context, max_tokens=4, min_accept_p=0.0, sampling=SamplingParams())
            got = follow.draft(req).tokens
            assert got == fixed.draft(req).tokens and got, rounds
            context, rounds = context + got, rounds + 1
        assert follow.follow.changes >= 1
        assert follow.follow.threads == 1 and follow.follow.wanted == 2
        assert fixed.follow.changes == 0  # a chosen thread count is kept
    finally:
        follow.close()
        fixed.close()
