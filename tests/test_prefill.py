"""The "f16" KV setting (fast prefill) stays exact, and contexts reach the training length.

With an F16 cache a single-token step over >= 512 KV cells on more than one thread takes
ggml-cpu's split-KV flash-attention path and differs from a verify batch (docs/facts.md §3);
the "f16" setting runs 1-token steps on one thread, which computes them like batch rows,
while prompts keep every thread and F16's tiled prefill path.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from potluck.engine.core import validate as limits
from potluck.engine.core.errors import PotluckError
from potluck.engine.core.events import Finished
from potluck.engine.core.kv_state import GGML_TYPE_F16
from potluck.engine.core.plain import Plain
from potluck.engine.core.runtime import Context, ContextParams, Model
from potluck.engine.core.spec import EngineSpec
from potluck.engine.lab.benchmark import load_prompts
from potluck.engine.loader import open_session, target_params

from .support.breadth import beyond

THREADS = 2


def _steps_vs_batch(model: Model, single_step_threads: int) -> float:
    """Max |logit diff| between 12 single steps and the same 12 tokens as one batch, after
    700 tokens of context (past 512 cells), F16 cache, batches on 2 threads."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(100, 20_000, 700).tolist()
    cont = rng.integers(100, 20_000, 12).tolist()
    params = ContextParams(n_ctx=2048, n_threads=THREADS, kv_type=GGML_TYPE_F16,
                           single_step_threads=single_step_threads)
    with Context(model, params) as ctx:
        for i in range(0, len(prompt), 512):
            ctx.run_tokens(prompt[i : i + 512], i)
        singles = []
        for j, tok in enumerate(cont):
            ctx.run_tokens([tok], len(prompt) + j)
            singles.append(ctx.logits_row(-1).copy())
        ctx.seq_rm(0, len(prompt))
        ctx.run_tokens(cont, len(prompt), outputs="all")
        return float(np.abs(np.array(singles) - ctx.logits(len(cont))).max())


@pytest.mark.slow  # single steps vs batches by default: test_engine_exact, test_batch_exact
def test_f16_single_steps_on_one_thread_compute_like_batches(model: Model) -> None:
    assert _steps_vs_batch(model, single_step_threads=1) == 0.0
    assert _steps_vs_batch(model, single_step_threads=0) > 0.0  # the split-KV path this avoids


def test_set_threads_keeps_single_steps_on_one_thread(model: Model) -> None:
    with Context(model, ContextParams(n_ctx=256, n_threads=THREADS, single_step_threads=1)) as ctx:
        assert ctx.threads() == (1, THREADS)
        ctx.set_threads(THREADS)  # what pearl does when its gate closes
        assert ctx.threads() == (1, THREADS)


def test_kv_setting_maps_to_the_context(model: Model) -> None:
    params = target_params(model, EngineSpec(kv_cache="f16", n_threads=THREADS), Plain)
    assert params.kv_type == GGML_TYPE_F16 and params.single_step_threads == 1
    with pytest.raises(PotluckError, match="--kv must be one of bf16, f16"):
        limits.kv_cache("q8_0")


def _reply(spec: EngineSpec, prompt: str, max_tokens: int = 64) -> Finished:
    session = open_session(spec)
    try:
        return [ev for ev in session.generate(prompt, max_tokens=max_tokens) if isinstance(ev, Finished)][0]
    finally:
        session.close()


PROMPT = load_prompts("long")[0][:3_300] + "\n\nRepeat the first two sentences of the chronicle word for word."


@pytest.fixture(scope="module")
def plain_f16() -> Finished:
    """Plain decoding of a ~750-token prompt with the F16 cache (1-token steps on 1 thread)."""
    done = _reply(EngineSpec(n_ctx=2048, n_threads=THREADS, kv_cache="f16"), PROMPT)
    assert done.prompt_tokens > 600  # past 512 cells
    return done


@pytest.mark.slow  # past 512 cells by default: the staged prefill tests below
def test_f16_speculation_equals_plain_past_512_cells(plain_f16: Finished) -> None:
    """anpd's verify batches (2 threads) against plain single steps (1 thread): token for token."""
    spec = _reply(EngineSpec(strategy="anpd", n_ctx=2048, n_threads=THREADS, kv_cache="f16",
                             strategy_options={"adaptive": False}), PROMPT)
    assert spec.tokens == plain_f16.tokens
    assert spec.accepted > 0 and spec.drafted > spec.accepted


@pytest.mark.slow  # TriForce beside a staged prefill runs by default (test_triforce.py)
def test_f16_triforce_equals_plain(plain_f16: Finished) -> None:
    """TriForce's retrieval sequence beside sequence 0 in an F16 cache (a small budget so
    that this prompt counts as long)."""
    options = {"adaptive": False, "min_context": 0, "budget": 64, "sinks": 8, "recent": 32, "stride": 16}
    session = open_session(EngineSpec(strategy="triforce", n_ctx=2048, n_threads=THREADS, kv_cache="f16",
                                      strategy_options=options))
    try:
        done = [ev for ev in session.generate(PROMPT, max_tokens=64) if isinstance(ev, Finished)][0]
        c = session.strategy.counters  # type: ignore[attr-defined]
    finally:
        session.close()
    assert done.tokens == plain_f16.tokens
    assert c.long_replies == 1 and c.rebuilds >= 2 and c.retrieval_drafted > c.retrieval_accepted > 0


def test_context_up_to_the_training_length(model: Model) -> None:
    assert model.n_ctx_train == 8192
    session = open_session(EngineSpec(n_ctx=8192))
    try:
        assert session.target.n_ctx == 8192
    finally:
        session.close()
    with pytest.raises(PotluckError) as err:
        open_session(EngineSpec(n_ctx=8193))
    assert "trained on" in str(err.value) and "--ctx 8192" in str(err.value) and "\n" not in str(err.value)


def test_context_meter() -> None:
    from potluck.app.tui.widgets import context_meter

    assert context_meter(0, 8192, 8) == "░" * 8
    assert context_meter(4096, 8192, 8) == "████░░░░"
    assert context_meter(9000, 8192, 8) == "█" * 8
    assert context_meter(5, 0) == "—"  # no context yet


@pytest.fixture(scope="module")
def plain_staged() -> Finished:
    """Plain decoding of the same prompt with the default cache: the prompt prefills in an F16
    twin, the reply decodes in BF16 (core/staged_prefill.py)."""
    done = _reply(EngineSpec(n_ctx=2048, n_threads=THREADS), PROMPT)
    assert done.prompt_tokens > 600  # past 512 cells
    return done


TRIFORCE_SMALL = {"min_context": 0, "budget": 64, "sinks": 8, "recent": 32, "stride": 16}


# By default TriForce runs after a staged prefill in test_triforce.py (its long replies, the
# twin's counters asserted) and the twin's hand-over is proven in test_staged_prefill.py.
@pytest.mark.parametrize("strategy", beyond(["anpd", "sd", "pearl", "minions", "pipeinfer", "triforce"], keep=[]))
def test_every_strategy_equals_plain_after_a_staged_prefill(
    strategy: str, plain_staged: Finished, weak_draft: Path
) -> None:
    """Every strategy's target prefills the prompt in the F16 twin (counted) and decodes past
    512 cells with 2 threads, token for token as plain decoding (the first 24 tokens of plain's
    reply: the draft model's own prefill is most of the time)."""
    options: dict[str, object] = {"adaptive": False, **(TRIFORCE_SMALL if strategy == "triforce" else {})}
    draft = weak_draft if strategy in ("sd", "pearl", "minions", "pipeinfer") else None
    session = open_session(EngineSpec(strategy=strategy, draft=draft, n_ctx=2048, n_threads=THREADS,
                                      strategy_options=options))
    try:
        done = [ev for ev in session.generate(PROMPT, max_tokens=24) if isinstance(ev, Finished)][0]
        prefill = session.target.stage.prefill.counters  # type: ignore[attr-defined]
    finally:
        session.close()
    assert done.tokens == plain_staged.tokens[:24]
    assert prefill.staged_jobs == 2 and prefill.handovers == 1  # 512 + the rest, in the twin
    assert done.drafted > 0 and done.accepted > 0
