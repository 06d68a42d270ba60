"""Mixtures of experts split over loopback workers: every strategy's greedy replies equal plain
decoding on one machine (the conftest's shared worker pool, the memoized plain references).

gpt-oss-small has every rule of its kind at once: sliding-window layers every other layer (a
stage must hold one), attention sinks, biases, MXFP4 experts. Drafting strategies draft with
the target's own first layers (a draft of the same vocabulary that is often wrong: rejections
trim every stage's KV tail, acceptances keep it). The other mixtures run every strategy under
the slow marker."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from potluck.discovery.auth import keys_from_token
from potluck.engine.cluster.head import open_pipeline
from potluck.engine.cluster.pipeline_target import PipelineTarget
from potluck.engine.cluster.transfer import SliceCache
from potluck.engine.core.events import Finished
from potluck.engine.core.gguf_tools import describe as describe_gguf
from potluck.engine.core.gguf_tools import write_layers
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.session import Session
from potluck.engine.core.spec import EngineSpec
from potluck.engine.core.target import LocalTarget
from potluck.engine.lab.fixtures import build_shape
from potluck.engine.speculation.strategies.registry import STRATEGIES

from .cluster_support import JOIN_S, TOKEN, WorkerProc
from .support.references import plain_conversation

N_CTX = 512
TURNS = ["Hi! Name two fruits.", "Which one is sweeter?"]
MAX_NEW = 16
SYSTEM = "Be brief."
# triforce reads the target's attention keys: one machine only (refused with --nodes, as for any model)
CLUSTER_STRATEGIES = [name for name in STRATEGIES if name != "triforce"]


@pytest.fixture(scope="module")
def slice_cache(tmp_path_factory: pytest.TempPathFactory) -> SliceCache:
    return SliceCache(tmp_path_factory.mktemp("moe-slices"))


@pytest.fixture(scope="module", params=[
    "gpt-oss-small", pytest.param("qwen3moe-small", marks=pytest.mark.slow),
    pytest.param("deepseek2-small", marks=pytest.mark.slow), pytest.param("glm4moe-small", marks=pytest.mark.slow),
    pytest.param("gemma4-small", marks=pytest.mark.slow),
])
def moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Model, Path, Path]]:
    """(the model, its file, a draft: its layers but the last one)."""
    path = build_shape(request.param)
    with Model(path) as m:
        draft = write_layers(path, tmp_path_factory.mktemp("draft") / "d.gguf", list(range(m.n_layer - 1)))
        yield m, path, draft


def converse(model: Model, target: PipelineTarget, name: str, draft: Path | None) -> list[Finished]:
    # pearl runs its draft model beside the target: a thread each
    spec = EngineSpec(strategy=name, draft=draft, n_ctx=N_CTX, n_threads=2 if name == "pearl" else 1,
                      strategy_options={"adaptive": False} if name != "plain" else {})
    strategy = STRATEGIES[name].build(model, spec)
    session = Session(model, target, strategy, system=SYSTEM)
    try:
        out = []
        for turn in TURNS:
            *_, fin = session.generate(turn, SamplingParams(), MAX_NEW)
            assert isinstance(fin, Finished)
            out.append(fin)
        return out
    finally:
        strategy.close()


def test_every_strategy_on_a_split_mixture_of_experts_is_exact(
    moe: tuple[Model, Path, Path], loopback_pool: list[WorkerProc], slice_cache: SliceCache
) -> None:
    model, path, draft = moe
    reference = [tuple(t) for t in plain_conversation(model, TURNS, MAX_NEW, n_ctx=N_CTX, system=SYSTEM)]
    # two workers and the head, a stage each (the planner puts tiny layers on one worker)
    end = model.n_layer
    split = [0, end // 2, end]
    target = open_pipeline(path, [w.address for w in loopback_pool[:2]], keys_from_token(TOKEN), n_ctx=N_CTX,
                           slice_cache=slice_cache, split=split, join_timeout_s=JOIN_S)
    try:
        assert [lk.layers for lk in target.links] == [(0, end // 2), (end // 2, end)]
        about = describe_gguf(path)
        experts = (about["n_expert"], about["n_expert_used"], about["n_expert_shared"])
        assert target.cluster_view().experts == experts and experts[0] > experts[1] > 0
        for name in CLUSTER_STRATEGIES:
            cls = STRATEGIES[name]
            takes_draft = cls.needs_draft or cls.accepts_draft
            fins = converse(model, target, name, draft if takes_draft else None)
            assert [f.tokens for f in fins] == reference, name
            drafted, accepted = sum(f.drafted for f in fins), sum(f.accepted for f in fins)
            if takes_draft and name != "pipeinfer":  # pipeinfer's guesses depend on timing
                assert drafted > accepted > 0, (name, drafted, accepted)
            target.reset()
    finally:
        target.close()


def test_a_pipeline_runs_single_steps_as_its_stages_judged_bit_for_bit(
    loopback_pool: list[WorkerProc], slice_cache: SliceCache
) -> None:
    """gpt-oss's router is F32: ggml sums 1 row (vec_dot) differently from 2 (tinyBLAS), so
    single steps run as 2 rows. Each worker judges its own slice on its own CPU and says so
    when it loads; a pipeline keeps to that however it was opened (here without the loader,
    which once set it from the head's file: the gpt-oss-20b demonstration left one process's
    tokens at token 2 that way). Every step's logits equal one process's, bit for bit."""
    path = build_shape("gpt-oss-small")
    with Model(path) as model:
        prompt = model.tokenize("The capital of France is a city where", add_special=True)
        local = LocalTarget(model, ContextParams(n_ctx=N_CTX, n_threads=1))
        try:
            expected, tokens = [local.decode(prompt)], []
            for _ in range(12):
                tokens.append(int(expected[-1].argmax()))
                expected.append(local.decode([tokens[-1]]))
        finally:
            local.close()
        assert model.batch_exact.two_row_steps and local.padded_steps == 12
    end = model.n_layer
    target = open_pipeline(path, [w.address for w in loopback_pool[:2]], keys_from_token(TOKEN), n_ctx=N_CTX,
                           slice_cache=slice_cache, split=[0, end // 2, end], join_timeout_s=JOIN_S)
    try:
        assert target.exact.two_row_steps and target.exact.max_rows == model.batch_exact.max_rows
        got = [target.decode(prompt), *(target.decode([t]) for t in tokens)]
        assert target.padded_steps == 12
        for step, (a, b) in enumerate(zip(expected, got)):
            assert np.array_equal(a, b), (step, float(np.abs(a - b).max()))
    finally:
        target.close()


def test_the_chat_apps_cluster_panel_shows_the_plans_experts() -> None:
    from rich.console import Console

    from potluck.app.tui.cluster import ClusterState, StageRow
    from potluck.app.tui.widgets import cluster_table

    def shown(state: ClusterState) -> str:
        console = Console(width=60, record=True)
        console.print(cluster_table(state, "ctrl+g"))
        return console.export_text()

    rows = (StageRow("node-a", "127.0.0.1:1", (0, 12)), StageRow("node-b", "127.0.0.1:2", (12, 22)))
    assert "2 stage(s) · 4/32 experts" in shown(ClusterState(stages=rows, experts=(32, 4, 0)))
    assert "experts" not in shown(ClusterState(stages=rows))  # a dense model
