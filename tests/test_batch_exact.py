"""Verify batches stay exact on every weight type (engine/core/batch_exact.py): K-quants cap
the batch length, F16/BF16/F32 matrices (an unquantized release; every published mixture's
router) run single steps as 2 rows, and every strategy's greedy output equals plain decoding
with the cap in force."""

from __future__ import annotations

import platform
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from potluck.engine.core.batch_exact import (
    FREE,
    REPACK_GEMM_MAX_ROWS,
    TILED_MAX_ROWS,
    UNLIMITED,
    combine,
    judge,
    model_exactness,
    repacked_types,
    weight_types,
)
from potluck.engine.core.errors import PotluckError
from potluck.engine.core.events import Finished, RoundStats
from potluck.engine.core.runtime import Model, quantize_model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.spec import EngineSpec
from potluck.engine.lab.batch_rows import steps_and_batches
from potluck.engine.lab.fixtures import build_shape
from potluck.engine.loader import open_lanes, open_session
from potluck.engine.speculation.strategies.registry import STRATEGIES

from .support.breadth import beyond
from .support.lanes import Ask, together
from .support.prompts import LONG_PROMPTS
from .support.prompts import PROMPTS as SHORT_PROMPTS

AVX2 = frozenset({"avx2"})
X86 = "x86_64"
PROMPTS = LONG_PROMPTS[:2]  # prose and a code edit: N-gram drafts are accepted and rejected
TOKENS = 40
needs_x86 = pytest.mark.skipif(platform.machine() != X86, reason="the table is checked on x86-64")


def test_the_table_by_weight_type() -> None:
    """What each published kind of file gets, from its types alone."""
    q4_k_m = {"Q4_K": "blk.0.attn_q.weight", "Q6_K": "blk.0.ffn_down.weight", "Q8_0": "token_embd.weight"}
    assert judge(q4_k_m, use_extra_bufts=True, flags=AVX2, machine=X86).max_rows == REPACK_GEMM_MAX_ROWS
    assert judge(q4_k_m, use_extra_bufts=False, flags=AVX2, machine=X86).max_rows == TILED_MAX_ROWS
    moe = {"Q4_0": "blk.0.ffn_up_exps.weight", "F32": "blk.0.ffn_gate_inp.weight"}
    router = judge(moe, use_extra_bufts=True, flags=AVX2, machine=X86)
    assert router.two_row_steps and router.max_rows == UNLIMITED and "ffn_gate_inp" in router.reason
    plain = judge({"Q4_1": "x", "Q8_0": "y", "MXFP4": "z"}, use_extra_bufts=True, flags=AVX2, machine=X86)
    assert not plain.two_row_steps and plain.max_rows == UNLIMITED
    unknown = judge({"TQ1_0": "blk.0.attn_q.weight"}, use_extra_bufts=True, flags=AVX2, machine=X86)
    assert not unknown.speculates and "TQ1_0" in unknown.refusal("anpd")
    assert not judge(q4_k_m, use_extra_bufts=True, flags=frozenset(), machine="aarch64").speculates


def test_a_chain_keeps_to_what_every_stage_allows() -> None:
    """A pipeline's stages judge their own slices on their own CPUs (a worker that repacks Q4_K
    caps batches at 3 rows where the head, without, would allow 7); the chain takes the
    shortest batch, 2-row steps if any stage needs them, and refuses with a stage's reason."""
    q4_k = {"Q4_K": "blk.3.attn_q.weight"}
    head = judge(q4_k, use_extra_bufts=False, flags=AVX2, machine=X86)
    worker = judge(q4_k, use_extra_bufts=True, flags=AVX2, machine=X86)
    router = judge({"F32": "blk.0.ffn_gate_inp.weight"}, use_extra_bufts=True, flags=AVX2, machine=X86)
    both = combine([head, worker, router])
    assert (both.max_rows, both.two_row_steps) == (REPACK_GEMM_MAX_ROWS, True)
    assert "repacked" in both.reason and "ffn_gate_inp" in both.reason
    arm = judge(q4_k, use_extra_bufts=True, flags=frozenset(), machine="aarch64")
    refused = combine([router, arm])
    assert not refused.speculates and refused.reason == arm.reason
    # three stages of a hybrid with an F32 router, refused for one reason: said once
    assert combine([arm, arm, arm]).reason == arm.reason
    assert combine([FREE, FREE]) == FREE and combine([]) == FREE


@pytest.fixture(scope="module")
def kquant_path(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled model as Q4_K_M (Q4_K, Q6_K and Q8_0 matrices): the most published kind."""
    return quantize_model(model_path, tmp_path_factory.mktemp("kquant") / "q4_k_m.gguf", "Q4_K_M", n_threads=2)


@needs_x86
def test_a_pipeline_keeps_to_its_workers_judgment(
    kquant_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether llama.cpp repacks Q4_K is each machine's (off on AMX CPUs, or by
    POTLUCK_EXTRA_BUFTS), so a head and its worker can judge the same weights differently. Here
    the head does not repack and alone would allow 7 rows; its worker repacks and says 3 when
    it loads: the chain keeps to 3."""
    from potluck.app.loopback import running_worker
    from potluck.discovery.auth import keys_from_token
    from potluck.engine.cluster.head import open_pipeline
    from potluck.engine.cluster.transfer import SliceCache
    from potluck.engine.core.backend import cpu_flags, cpu_has_amx

    from .cluster_support import JOIN_S, TOKEN

    if cpu_has_amx() or "Q4_K" not in repacked_types(True, cpu_flags()):
        pytest.skip("this CPU does not repack Q4_K by default")
    monkeypatch.delenv("POTLUCK_EXTRA_BUFTS", raising=False)
    with running_worker(tmp_path, "w", TOKEN) as worker:  # this CPU's default: it repacks
        monkeypatch.setenv("POTLUCK_EXTRA_BUFTS", "0")  # the head's own stage does not
        assert model_exactness(kquant_path, use_extra_bufts=False).max_rows == TILED_MAX_ROWS
        target = open_pipeline(kquant_path, [worker.address], keys_from_token(TOKEN), n_ctx=256,
                               slice_cache=SliceCache(tmp_path / "slices"), join_timeout_s=JOIN_S)
        try:
            assert not target.tail.model.use_extra_bufts
            assert target.exact.max_rows == REPACK_GEMM_MAX_ROWS and "repacked" in target.exact.reason
        finally:
            target.close()


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A qwen3moe fixture in F16, its router in F32 (llama.cpp never quantizes a router): a
    mixture released unquantized. Its F16 and F32 matrices take tinyBLAS from 2 rows on."""
    return quantize_model(build_shape("qwen3moe-small"), tmp_path_factory.mktemp("moe") / "f16.gguf", "F16")


def _rows(model: Model, tokens: list[int], prompt: list[int], *, two_rows: bool) -> np.ndarray:
    """Per row: how far a batch of ``tokens`` after ``prompt`` is from single steps."""
    steps, batches = steps_and_batches(model, prompt, tokens, [len(tokens)], n_threads=2, two_rows=two_rows,
                                       n_ctx=256)
    return np.abs(batches[len(tokens)] - steps).max(axis=1)


@pytest.mark.slow  # the figure behind the cap; every strategy under it runs by default (below)
@needs_x86
def test_the_cap_is_where_batches_stop_being_exact(kquant_path: Path, model_path: Path) -> None:
    """The measured edge: a batch of max_rows rows equals single steps, 8 rows do not."""
    with Model(kquant_path) as m:
        exact = m.batch_exact
        assert exact == model_exactness(kquant_path, use_extra_bufts=m.use_extra_bufts)
        assert exact.max_rows in (REPACK_GEMM_MAX_ROWS, TILED_MAX_ROWS) and not exact.two_row_steps
        prompt = m.tokenize(PROMPTS[0])
        tokens = [int(t) for t in np.random.default_rng(0).integers(100, 40000, size=8)]
        assert _rows(m, tokens[: exact.max_rows], prompt, two_rows=False).max() == 0.0
        assert _rows(m, tokens, prompt, two_rows=False).max() > 0.0
    assert weight_types(model_path).keys() == {"Q4_1", "Q8_0"}  # the bundled model: no cap


@needs_x86
def test_two_row_steps_make_f16_and_f32_matrices_exact(moe_path: Path) -> None:
    """1-row steps differ from every batch; 2-row steps equal batches of every length."""
    with Model(moe_path) as m:
        assert m.batch_exact.two_row_steps and m.batch_exact.max_rows == UNLIMITED
        prompt = m.tokenize(PROMPTS[0])
        tokens = [int(t) for t in np.random.default_rng(1).integers(100, 40000, size=8)]
        assert _rows(m, tokens, prompt, two_rows=True).max() == 0.0
        assert _rows(m, tokens, prompt, two_rows=False).max() > 0.0  # what 1 row did


def _reply(spec: EngineSpec, prompt: str) -> tuple[list[int], int, int, int]:
    """Greedy tokens, tokens drafted, the longest verify batch, single steps run as 2 rows."""
    session = open_session(spec)
    try:
        drafted = 0
        for ev in session.generate(prompt, SamplingParams(), TOKENS):
            if isinstance(ev, RoundStats):
                drafted += ev.drafted
            elif isinstance(ev, Finished):
                target = session.target
                return list(ev.tokens), drafted, target.longest_verify_rows, target.padded_steps  # type: ignore[attr-defined]
        raise AssertionError("no Finished event")
    finally:
        session.close()


def _every_strategy(path: Path, draft: Path) -> Iterator[tuple[str, EngineSpec]]:
    for name, cls in STRATEGIES.items():
        options: dict[str, object] = {} if name in ("plain", "auto") else {"adaptive": False}
        yield name, EngineSpec(model=path, strategy=name, draft=draft if cls.needs_draft else None,
                               n_ctx=512, n_threads=1, strategy_options=options)


@needs_x86
# the K-quant model's cap by default: test_lanes_merge_a_kquant_models_batches_only_within_the_cap
@pytest.mark.parametrize("which", beyond(["kquant", "moe"], keep=["moe"]))
def test_every_strategy_equals_plain_decoding_under_the_cap(
    which: str, kquant_path: Path, moe_path: Path, model_path: Path
) -> None:
    """The K-quant model: every verify batch within the cap; the F16 mixture: single steps as 2 rows.
    The draft model (sd) is the bundled one for the K-quant model, the target itself for the
    mixture (its padded vocabulary matches only itself)."""
    path = kquant_path if which == "kquant" else moe_path
    draft = model_path if which == "kquant" else moe_path
    with Model(path) as m:
        exact = m.batch_exact
    plain = {p: _reply(EngineSpec(model=path, strategy="plain", n_ctx=512, n_threads=1), p) for p in PROMPTS}
    reference = {p: r[0] for p, r in plain.items()}
    assert all((r[3] > 0) == exact.two_row_steps for r in plain.values())  # plain steps ran as 2 rows
    drafted_by = {}
    for name, spec in _every_strategy(path, draft):
        drafted_by[name] = 0
        for prompt in PROMPTS:
            tokens, drafted, longest, padded = _reply(spec, prompt)
            assert tokens == reference[prompt], f"{name} differs from plain decoding on {prompt[:30]!r}"
            assert longest <= exact.max_rows, f"{name} verified {longest} rows, past the cap {exact.max_rows}"
            assert padded == 0 or exact.two_row_steps
            drafted_by[name] += drafted
    assert all(drafted_by[n] > 0 for n in ("anpd", "sd", "pearl", "pipeinfer", "minions")), drafted_by


@needs_x86
def test_lanes_merge_a_kquant_models_batches_only_within_the_cap(kquant_path: Path) -> None:
    """Four conversations speculating on lanes of the K-quant model: the hub merges their jobs
    up to the cap and no further (past it every row of the batch would be summed by the tiled
    kernels), so each reply is plain decoding's, as alone."""
    prompts = [*PROMPTS, *SHORT_PROMPTS[:2]]
    plain = EngineSpec(model=kquant_path, strategy="plain", n_ctx=512, n_threads=1)
    want = [_reply(plain, p)[0] for p in prompts]
    spec = EngineSpec(model=kquant_path, strategy="anpd", n_ctx=512, n_threads=1,
                      strategy_options={"adaptive": False, "max_draft": 6})
    lanes = open_lanes(spec, 4)
    try:
        cap = lanes.hub.target.exact.max_rows
        got = [r[0] for r in together(lanes, [Ask(i, [p], max_tokens=TOKENS) for i, p in enumerate(prompts)])]
        c = lanes.hub.counters
    finally:
        lanes.close()
    assert [list(f.tokens) for f in got] == want
    assert sum(f.drafted for f in got) > 0
    assert c.shared > 0 and c.split_for_exactness > 0 and c.most_shared_rows <= cap < 8, (c, cap)


def test_a_strategy_is_refused_where_no_batch_is_exact(
    model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unchecked weights: a speculative strategy is refused in one line; auto decodes plainly
    and says why."""
    from potluck.engine.core import runtime
    from potluck.engine.core.batch_exact import BatchExactness

    refused = BatchExactness(1, False, "weights of type TQ1_0 (blk.0.attn_q.weight) were not checked row by row")
    monkeypatch.setattr(runtime.Model, "batch_exact", property(lambda self: refused))
    with pytest.raises(PotluckError, match="cannot be lossless on this model: weights of type TQ1_0"):
        open_session(EngineSpec(model=model_path, strategy="anpd", n_ctx=512, n_threads=1))
    session = open_session(EngineSpec(model=model_path, strategy="auto", n_ctx=512, n_threads=1))
    try:
        shown = session.strategy.pick_for_reply(10, SamplingParams())
        assert shown.startswith("auto: plain, no exact verify batch (weights of type TQ1_0")
        tokens = [ev for ev in session.generate(PROMPTS[0], SamplingParams(), 8) if isinstance(ev, Finished)]
        assert len(tokens[0].tokens) == 8
    finally:
        session.close()
