"""A hybrid recurrent model (qwen35moe: Qwen3.5's Gated DeltaNet and full-attention layers,
each with routed experts) speculates exactly, on one machine and split (its splits are
checked at the logits level with every architecture's in tests/test_archs_exact.py).

A recurrent layer's state cannot drop its last k positions the way a KV cache frees cells:
every strategy's rejected drafts go back through the stage's rollback (llama.cpp's snapshots
for the tail of the last batch, checkpoints and replayed rows for anything older,
engine/core/rollback.py). Each test asserts that the rollback ran (rejections, counters) and
that the tokens are plain decoding's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from potluck.engine.cluster.plan import NodeInfo
from potluck.engine.core import archs
from potluck.engine.core.batch_exact import weight_types
from potluck.engine.core.errors import PotluckError
from potluck.engine.core.events import Finished
from potluck.engine.core.gguf_tools import open_reader, slice_layers
from potluck.engine.core.jobs import DecodeJob
from potluck.engine.core.kv import KvOp
from potluck.engine.core.rollback import KEPT_CHECKPOINTS
from potluck.engine.core.runtime import ContextParams, Model, quantize_model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.session import Session
from potluck.engine.core.spec import EngineSpec
from potluck.engine.core.stage import Stage
from potluck.engine.core.target import LocalTarget, TargetBase
from potluck.engine.lab.hybrid_shapes import build_hybrid_shape
from potluck.engine.loader import describe_model, open_session
from potluck.engine.speculation.strategies.registry import get_strategy_class

from .support.references import plain_reply
from .support.split_target import SplitTarget

SHAPE = "qwen35moe-small"
N_CTX = 512
MAX_TOKENS = 48
THREADS = 1
# a prompt that repeats itself, so that N-gram drafts are made (and mostly rejected)
PROMPTS = [
    "Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat.",
    "List three prime numbers and say why each is prime.",
]
THREE = ((0, 4), (4, 9), (9, 12))  # (tests/test_archs_exact.py checks the splits at the logits)


@pytest.fixture(scope="module")
def target_path() -> Path:
    return build_hybrid_shape(SHAPE)


@pytest.fixture(scope="module")
def model(target_path: Path):
    with Model(target_path) as m:
        yield m


@pytest.fixture(scope="module")
def draft_path(target_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft of the same architecture: the target's first 8 layers and its output head,
    agreeing with it now and then (its drafts are accepted and rejected)."""
    return slice_layers(target_path, tmp_path_factory.mktemp("draft") / "draft.gguf", 0, 8)


@pytest.fixture(scope="module")
def slices(target_path: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("slices")
    made = {cuts: [Model(slice_layers(target_path, out / f"{lo}-{hi}.gguf", lo, hi)) for lo, hi in cuts]
            for cuts in (THREE,)}
    yield made
    for models in made.values():
        for m in models:
            m.close()


@pytest.fixture(scope="module")
def reference(model: Model) -> dict[str, list[int]]:
    return {p: plain_reply(model, p, MAX_TOKENS, n_ctx=N_CTX) for p in PROMPTS}


def params() -> ContextParams:
    return ContextParams(n_ctx=N_CTX, n_threads=THREADS)


def stages_of(target: TargetBase) -> list[Stage]:
    return target.stages if isinstance(target, SplitTarget) else [target.stage]  # type: ignore[attr-defined]


def generate(session: Session, prompt: str) -> Finished:
    for ev in session.generate(prompt, SamplingParams(temperature=0.0), MAX_TOKENS):
        if isinstance(ev, Finished):
            return ev
    raise AssertionError("no Finished event")


def test_fixture_is_a_hybrid_with_varied_routing(model: Model) -> None:
    """Finite logits, varied greedy tokens, and more than one set of experts chosen."""
    assert model.arch == "qwen35moe" and model.recurrent and model.positions_per_token == 4
    ctx_params = ContextParams(n_ctx=N_CTX, n_threads=THREADS, observe=("ffn_moe_probs-11",))
    target = LocalTarget(model, ctx_params)
    try:
        tokens = model.tokenize(PROMPTS[1])
        logits = target.decode(tokens, all_logits=True)
        assert np.isfinite(logits).all()
        probs = target.observed("ffn_moe_probs-11")[: len(tokens)]  # [n_tokens, n_expert]
        chosen = {tuple(sorted(np.argsort(row)[-2:])) for row in probs}
        assert len(chosen) > 3, chosen
    finally:
        target.close()


def test_a_slice_of_one_kind_of_layer_carries_the_other_kind_as_zeros(target_path: Path, tmp_path: Path) -> None:
    """llama.cpp's hybrid memory aborts the process on a slice without both kinds of layer: such
    a slice carries the nearest layer of the other kind in front, its matrices zeros of the
    smallest type (tests/test_archs_exact.py's 3-stage split runs one of each kind exactly)."""
    recurrent = archs.recurrent_layers(archs.read_header(open_reader(target_path)))
    assert recurrent[4:7] == (True, True, True) and recurrent[7] is False
    s = slice_layers(target_path, tmp_path / "s.gguf", 4, 7)
    h = archs.read_header(open_reader(s))
    assert h.n_layer == 4 and h.get("attention.recurrent_layers") == [False, True, True, True]
    by_name = {t.name: t for t in open_reader(s).tensors}
    source = {t.name: t for t in open_reader(target_path).tensors}
    assert by_name["blk.0.attn_q.weight"].tensor_type.name == "Q1_0"  # layer 3 (nearest attention), zeros
    assert by_name["blk.1.ssm_out.weight"].tensor_type == source["blk.4.ssm_out.weight"].tensor_type
    assert not np.asarray(by_name["blk.0.ffn_down_exps.weight"].data).any()
    assert "Q1_0" not in weight_types(s)  # zeros: no kernel choice changes a batch's rows
    with Model(s) as m:  # loads (llama.cpp aborted the process here)
        assert m.n_layer == 4


def test_the_planner_counts_a_filler_in_memory_as_zeros_and_in_time_as_its_layer(target_path: Path) -> None:
    """The zeroed layer of a one-kind stage takes its zeros' bytes in the stage's memory, and
    computes about as long as the layer it stands for (docs/facts.md §33): the planner counts
    both, so a filler is planned where it costs least."""
    from dataclasses import replace

    from potluck.engine.cluster.plan import _cost, head_zeroed_layers, layer_costs, stage_bytes

    costs = layer_costs(target_path)
    plain = replace(costs, filler=None)
    assert costs.zeroed_layer(4, 7) == 3 and costs.zeroed_layer(0, 4) is None
    assert head_zeroed_layers(costs) == (11, 12) and costs.zeroed_layer(11, 12) == 10  # the head: both kinds
    assert 0 < costs.filler_bytes[3] < costs.layer_bytes[3] / 2  # Q1_0 zeros
    assert stage_bytes(costs, 4, 7, 256) - stage_bytes(plain, 4, 7, 256) == costs.filler_bytes[3]
    node = NodeInfo("n", "n:1", 10_000, 1.0)
    slower = _cost(costs, 4, 7, node, 0, False) / _cost(plain, 4, 7, node, 0, False)
    assert slower == pytest.approx(4 / 3, rel=0.25)  # 3 layers and one computing like layer 3
    assert stage_bytes(costs, 0, 4, 256) == stage_bytes(plain, 0, 4, 256)  # both kinds: no filler


def test_rollback_reaches_back_through_batches_and_aborts(model: Model) -> None:
    """Dropping a tail inside the last batch (snapshots), inside an older batch (checkpoint
    and replay) and after an aborted batch leaves the logits plain decoding gives."""
    rng = np.random.default_rng(3)
    prompt, more = model.tokenize(PROMPTS[1]), [int(t) for t in rng.integers(100, 40000, 12)]
    ref = LocalTarget(model, params())
    ref.decode(prompt)
    expect = ref.decode(more[:9], all_logits=True).copy()
    ref.close()

    target = LocalTarget(model, params())
    counters = target.stage.rollback.counters  # type: ignore[union-attr]
    try:
        n = len(prompt)
        target.decode(prompt)
        target.decode(more[:4], all_logits=True)
        target.decode(more[4:10], all_logits=True)
        target.truncate(n + 7)  # 3 back, inside the last batch: a snapshot
        assert target.pos_max()[0] == n + 6  # (waits for the queued work)
        assert counters.snapshot_rollbacks == 1 and counters.restores == 0
        target.truncate(n + 2)  # into the batch before: a checkpoint and 2 rows again
        assert target.pos_max()[0] == n + 1
        assert counters.restores == 1 and counters.replayed_rows == 2
        got = target.decode(more[2:9], all_logits=True)
        assert np.array_equal(got, expect[2:9])
        # a batch aborted mid-compute leaves a half-written state: the stage puts it back
        stage = target.stage
        stage.ctx.request_abort()
        with pytest.raises(InterruptedError):
            stage.compute(DecodeJob.tokens(0, more[9:12], n + 9, outputs="all"))
        stage.ctx.clear_abort()
        assert counters.aborted_batches == 1
        assert target.pos_max()[0] == n + 8
        target.truncate(n + 4)
        assert np.array_equal(target.decode(more[4:9], all_logits=True), expect[4:9])
    finally:
        target.close()


def test_checkpoints_reuse_dropped_buffers_and_restore_exactly(model: Model) -> None:
    """Past the kept checkpoints, each new one is written into the oldest's buffer (a fresh
    one of several MB costs ~5x the copy); a rollback into such a reused checkpoint gives the
    logits plain decoding gives."""
    steps = [1000 + 7 * t for t in range(KEPT_CHECKPOINTS + 6)]
    ref = LocalTarget(model, params())
    ref.decode(model.tokenize(PROMPTS[1]))
    expect = [ref.decode([t]).copy() for t in steps]
    ref.close()
    target = LocalTarget(model, params())
    counters = target.stage.rollback.counters  # type: ignore[union-attr]
    try:
        target.decode(model.tokenize(PROMPTS[1]))
        for t in steps:
            target.decode([t])
        target.pos_max()  # waits for the queued work
        # (+1: the empty sequence's first checkpoint is of another size)
        assert counters.checkpoints > KEPT_CHECKPOINTS + 4 and counters.fresh_buffers <= KEPT_CHECKPOINTS + 1
        back = len(steps) - 3  # three batches back: a checkpoint written over an evicted one's buffer
        target.truncate(target.n_past - 3)
        target.pos_max()
        assert counters.restores == 1
        for i, t in enumerate(steps[back:]):
            assert np.array_equal(target.decode([t]), expect[back + i])
    finally:
        target.close()


def test_truncate_past_the_kept_batches_starts_over(model: Model) -> None:
    """A conversation cut back further than the stages keep their states (many batches
    back): the target forgets it whole and says so; a session then reads it again."""
    target = LocalTarget(model, params())
    try:
        target.decode(model.tokenize(PROMPTS[1]))
        for t in range(20):
            target.decode([1000 + t])
        target.truncate(3)
        assert target.n_past == 0 and target.pos_max()[0] == -1
    finally:
        target.close()


def test_stage_refuses_what_a_recurrent_state_cannot_do(model: Model) -> None:
    stage = Stage(model, first=True, last=True, params=ContextParams(n_ctx=N_CTX, n_threads=THREADS, n_seq_max=2,
                                                                     kv_unified=False))
    try:
        with pytest.raises(PotluckError, match="recurrent state"):
            stage.apply_kv(KvOp.cp(0, 1, 0, 4))
    finally:
        stage.close()


def build(name: str, model: Model, draft: Path | None, **options: object):
    spec = EngineSpec(strategy=name, draft=draft, n_ctx=N_CTX, n_threads=THREADS,
                      strategy_options={"adaptive": False, **options})
    return get_strategy_class(name).build(model, spec)


# on one machine pipeinfer runs as ordinary speculation and auto as sd: slow (-m slow) there
STRATEGIES = [
    ("sd", True, {"max_draft": 4}),
    ("anpd", False, {}),
    ("minions", True, {"ahead": False}),
    ("pearl", False, {}),
    ("pipeinfer", True, {}),
    ("auto", True, {}),
]


RUNS = [
    pytest.param(name, draft, options, where, id=f"{where}-{name}",
                 marks=[pytest.mark.slow] if where == "3-stages" or name in ("pipeinfer", "auto") else [])
    for where in ("one-machine", "3-stages") for name, draft, options in STRATEGIES
]


@pytest.mark.parametrize("name,with_draft,options,where", RUNS)
def test_strategy_is_exact_with_rollbacks(
    model: Model, draft_path: Path, slices, reference, name: str, with_draft: bool, options: dict, where: str
) -> None:
    strategy = build(name, model, draft_path if with_draft else None, **options)
    target = LocalTarget(model, params()) if where == "one-machine" else SplitTarget(slices[THREE], params())
    session = Session(model, target, strategy)
    drafted = accepted = 0
    try:
        for prompt in PROMPTS:
            session.load_messages([])  # a new conversation: the KV cache is cut back
            done = generate(session, prompt)
            assert list(done.tokens) == reference[prompt], (name, where, prompt[:30])
            drafted += done.drafted
            accepted += done.accepted
        assert drafted > accepted, (name, drafted, accepted)  # drafts were rejected
        for stage in stages_of(target):
            c = stage.rollback.counters  # type: ignore[union-attr]
            assert c.snapshot_rollbacks + c.restores > 0, (name, where, c)
    finally:
        session.close()


def test_triforce_is_refused_in_one_line(model: Model) -> None:
    with pytest.raises(PotluckError, match="triforce.*recurrent"):
        build("triforce", model, None)


def test_an_f32_router_refuses_speculation_on_a_hybrid(
    target_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """llama-quantize keeps every router in F32, whose 1-row product sums differently from a
    batch's; a dense or MoE model then runs single steps as 2 rows, but a recurrent state would
    keep the spare row's token. So a published Qwen3.5 MoE GGUF cannot speculate losslessly
    here: strategies that verify are refused in one line, and auto decodes plainly. (The
    fixture's router is Q4_0; the file in F32 has F32 routers.)"""
    path = quantize_model(target_path, tmp_path_factory.mktemp("f32") / "f32.gguf", "F32")
    with Model(path) as m:
        assert m.recurrent and "F32" in weight_types(path)
        exact = m.batch_exact
        assert not exact.speculates and not exact.two_row_steps and "recurrent" in exact.reason
        assert describe_model(path)["speculation"] == f"refused: {exact.reason}"  # potluck models FILE
        with pytest.raises(PotluckError, match="'anpd' cannot be lossless.*F32.*recurrent"):
            open_session(EngineSpec(model=path, strategy="anpd", n_ctx=N_CTX, n_threads=THREADS)).close()
        auto = build("auto", m, None)
        try:
            assert "no exact verify batch" in auto.plain_reason
        finally:
            auto.close()


def test_prompt_cache_brings_conversations_back_exactly(model: Model) -> None:
    """serve's prompt cache: two conversations take turns; each comes back from its kept
    state (recurrent state included) and answers as plain decoding does."""
    from potluck.engine import Message, PromptCache
    from potluck.engine.core.plain import Plain

    def fresh() -> Session:
        return Session(model, LocalTarget(model, params()), Plain())

    def turns(s: Session, first: str) -> list[list[int]]:
        return [list(generate(s, text).tokens) for text in (first, "And then?")]

    a, b = PROMPTS
    refs = {}
    for p in (a, b):
        ref = fresh()
        try:
            refs[p] = turns(ref, p)
        finally:
            ref.close()
    s = fresh()
    cache = PromptCache(max_bytes=1 << 30, max_conversations=4)
    s.use_prompt_cache(cache)
    try:
        history: dict[str, list[Message]] = {}
        got: dict[str, list[list[int]]] = {a: [], b: []}
        for p in (a, b, a, b):  # each conversation's first turn, then its second
            s.load_messages(history.get(p, []))
            done = generate(s, p if p not in history else "And then?")
            got[p].append(list(done.tokens))
            history[p] = list(s.messages)
        assert got == refs
        assert cache.stats().restored >= 2
    finally:
        s.close()


def test_planner_counts_the_recurrent_state_and_its_copies(target_path: Path, model: Model) -> None:
    """A recurrent layer costs its state (llama.cpp's, its snapshots, the checkpoints) instead
    of KV cells per token; the figure is the state llama.cpp really saves."""
    from potluck.engine.cluster.plan import layer_costs, stage_bytes
    from potluck.engine.core.rollback import ROLLBACK_STATES

    costs = layer_costs(target_path)
    assert costs.state_bytes is not None and costs.state_bytes[3] == 0 and costs.state_bytes[0] > 0
    target = LocalTarget(model, params())
    try:
        target.decode(model.tokenize(PROMPTS[0]))
        saved = target.on_compute_thread(lambda: len(target.stage.ctx.recurrent_state(0)))
    finally:
        target.close()
    assert sum(costs.state_bytes) <= saved < sum(costs.state_bytes) * 1.01  # plus a small header
    # layers 0-3: three recurrent, one attention (the only one with cells); the states count
    # with their rollback copies
    assert [b > 0 for b in costs.kv_bytes_per_token[:4]] == [False, False, False, True]
    stateless = stage_bytes(dataclasses.replace(costs, state_bytes=None), 0, 4, N_CTX)
    assert stage_bytes(costs, 0, 4, N_CTX) - stateless == ROLLBACK_STATES * sum(costs.state_bytes[:4])
