"""Plain decoding is exact: against llama-cpp-python's own high-level generation (an
independent oracle), across runs, across layer splits, and across conversation turns."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from potluck.engine.core.chat import Message
from potluck.engine.core.events import Finished
from potluck.engine.core.gguf_tools import slice_layers
from potluck.engine.core.kv_state import GGML_TYPE_BF16
from potluck.engine.core.plain import Plain
from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.sampling import SamplingParams
from potluck.engine.core.session import Session
from potluck.engine.core.spec import EngineSpec
from potluck.engine.core.target import LocalTarget
from potluck.engine.loader import open_session

from .support.prompts import PROMPTS
from .support.split_target import SplitTarget

MAX_TOKENS = 48


def reply(
    session: Session, text: str | None, sampling: SamplingParams = SamplingParams(), n: int = MAX_TOKENS
) -> Finished:
    events = list(session.generate(text, sampling, n))
    assert isinstance(events[-1], Finished)
    return events[-1]


@pytest.fixture()
def session(model: Model) -> Iterator[Session]:
    s = Session(model, LocalTarget(model, ContextParams(n_ctx=2048)), Plain())
    yield s
    s.target.close()


def prompt_tokens(session: Session, text: str) -> list[int]:
    return session.prompt_for([*session.messages, Message("user", text)]).tokens()


@pytest.fixture(scope="module")
def oracle(model_path: Path) -> Iterator[object]:
    """llama-cpp-python's high-level ``Llama``, with the AMX workaround patched in."""
    import llama_cpp
    import llama_cpp.llama_cpp as lc

    original = lc.llama_model_default_params

    def no_extra_bufts():  # the high-level class cannot set this field itself
        params = original()
        params.use_extra_bufts = False
        return params

    lc.llama_model_default_params = no_extra_bufts
    try:
        llm = llama_cpp.Llama(
            str(model_path), n_ctx=2048, n_batch=512, flash_attn=True, verbose=False, n_threads=2,
            type_k=GGML_TYPE_BF16, type_v=GGML_TYPE_BF16,  # potluck's KV type (runtime.ContextParams)
        )
    finally:
        lc.llama_model_default_params = original
    yield llm
    llm.close()


@pytest.mark.parametrize("prompt", PROMPTS[:3])
def test_greedy_matches_llama_cpp_python_oracle(session: Session, oracle, model: Model, prompt: str) -> None:
    tokens = prompt_tokens(session, prompt)
    ours = reply(session, prompt)
    expected: list[int] = []
    for tok in oracle.generate(tokens, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        expected.append(tok)
        if model.is_eog(tok) or len(expected) == MAX_TOKENS:
            break
    assert list(ours.tokens) == expected
    assert len(expected) > 5


def test_greedy_repeats_across_runs(model: Model) -> None:
    runs = []
    for _ in range(2):
        s = Session(model, LocalTarget(model, ContextParams(n_ctx=1024)), Plain())
        runs.append([reply(s, p, n=24).tokens for p in PROMPTS[3:5]])
        s.target.close()
    assert runs[0] == runs[1]


def test_seeded_sampling_is_reproducible_and_seed_dependent(model: Model) -> None:
    def sample(seed: int) -> tuple[int, ...]:
        s = Session(model, LocalTarget(model, ContextParams(n_ctx=1024)), Plain())
        params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=seed)
        out = reply(s, "Tell me a story about a dragon.", params, n=24).tokens
        s.target.close()
        return out

    a, b, c = sample(7), sample(7), sample(8)
    assert a == b
    assert a != c


# three stages by default: test_archs_exact (every architecture over 2 and 3 stages)
@pytest.mark.parametrize("bounds", [(0, 13, 30), pytest.param((0, 7, 19, 30), marks=pytest.mark.slow)],
                         ids=["2-stages", "3-stages"])
def test_layer_split_logits_identical(model: Model, model_path: Path, tmp_path: Path, bounds: tuple[int, ...]) -> None:
    slices = [
        Model(slice_layers(model_path, tmp_path / f"s{i}.gguf", lo, hi))
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))
    ]
    params = ContextParams(n_ctx=512)
    whole = LocalTarget(model, params)
    split = SplitTarget(slices, params)
    try:
        assert [m.n_layer for m in slices] == [hi - lo for lo, hi in zip(bounds, bounds[1:])]
        tokens = model.tokenize("<|im_start|>user\nName a fruit that is yellow.<|im_end|>\n<|im_start|>assistant\n")
        ref = whole.decode(tokens, all_logits=True).copy()
        got = split.decode(tokens, all_logits=True)
        assert np.array_equal(ref, got)
        tok = int(np.argmax(ref[-1]))
        for _ in range(32):
            ref1 = whole.decode([tok])[0].copy()
            assert np.array_equal(ref1, split.decode([tok])[0])
            tok = int(np.argmax(ref1))
        # Trimming the tail on every stage keeps them in step (speculative rejection).
        whole.truncate(len(tokens) + 10)
        split.truncate(len(tokens) + 10)
        assert np.array_equal(whole.decode([tok])[0], split.decode([tok])[0])
    finally:
        split.close()
        whole.close()
        for m in reversed(slices):
            m.close()


def test_second_turn_decodes_only_new_tokens(session: Session) -> None:
    first = reply(session, "Hi! What is 2+2?", n=24)
    assert first.prefill_tokens == first.prompt_tokens
    second = reply(session, "And 3+3?", n=24)
    new_tokens = second.prompt_tokens - (first.prompt_tokens + len(first.tokens))
    # Only the turn's new text (plus the pending last token of the previous reply) is processed.
    assert second.prefill_tokens <= new_tokens + 1
    assert second.prefill_tokens < second.prompt_tokens / 2


def test_turn_by_turn_replay_reproduces_conversation(model: Model) -> None:
    turns = ["Hi! Who are you?", "What can you do?", "Thanks, bye."]

    def converse() -> list[tuple[int, ...]]:
        s = Session(model, LocalTarget(model, ContextParams(n_ctx=2048)), Plain(), system="Be brief.")
        out = [reply(s, t, n=32).tokens for t in turns]
        s.target.close()
        return out

    assert converse() == converse()


def test_cancel_and_regenerate_keep_kv_consistent(model: Model) -> None:
    s = Session(model, LocalTarget(model, ContextParams(n_ctx=2048)), Plain())
    stream = s.generate("Count from one to twenty in words.", SamplingParams(), 64)
    for i, event in enumerate(stream):
        if i == 10:
            s.cancel()
        if isinstance(event, Finished):
            assert event.reason == "cancelled"
    assert s.target.n_past <= s.conversation_tokens
    regenerated = list(s.regenerate(SamplingParams(), 32))[-1]
    fresh = Session(model, LocalTarget(model, ContextParams(n_ctx=2048)), Plain())
    expected = reply(fresh, "Count from one to twenty in words.", n=32)
    assert regenerated.tokens == expected.tokens
    s.target.close()
    fresh.target.close()


def test_open_session_defaults_decode(tmp_home: Path) -> None:
    """The default load path (extra buffer types off on AMX CPUs) decodes without crashing."""
    s = open_session(EngineSpec(n_ctx=512))
    try:
        assert reply(s, "Hello", n=4).tokens
    finally:
        s.close()


@pytest.mark.parametrize("n_kv", [100, pytest.param(700, marks=pytest.mark.slow)])
def test_verify_batches_equal_single_steps_with_all_threads_at_long_context(model: Model, n_kv: int) -> None:
    """Regression: with an F16 KV cache and 2 threads, single steps past 512 KV cells took a
    split-KV attention path and differed from batches (speculation was not lossless). One
    thread computes the same logits too: the shared plain-decoding references rely on it."""
    filler = model.tokenize(" The quick brown fox jumps over the lazy dog and runs far away.")
    prompt = (filler * 100)[:n_kv]
    follow = model.tokenize(" Sure, here is a function that sorts numbers in a list")[:8]
    target = LocalTarget(model, ContextParams(n_ctx=2048, n_threads=2))
    try:
        target.decode(prompt)
        singles = np.stack([target.decode([t])[0].copy() for t in follow])
        for k in (2, 8):
            target.truncate(n_kv)
            assert np.array_equal(singles[:k], target.decode(follow[:k], all_logits=True))
    finally:
        target.close()
    one = LocalTarget(model, ContextParams(n_ctx=2048, n_threads=1))
    try:
        one.decode(prompt)
        assert np.array_equal(singles, np.stack([one.decode([t])[0].copy() for t in follow]))
    finally:
        one.close()


@pytest.mark.slow  # past 512 cells with two threads by default: test_prefill
def test_anpd_equals_plain_past_512_cells_with_two_threads(model: Model) -> None:
    """The symptom of the regression above, end to end: a long reply with all threads."""
    from potluck.engine.core.spec import EngineSpec
    from potluck.engine.lab.benchmark import load_prompts
    from potluck.engine.speculation.strategies.registry import get_strategy_class

    # a prompt past 512 cells, so every step of the reply is too
    prompt = load_prompts("long")[0][:3_000] + "\n\nRepeat the first two sentences of the chronicle word for word."
    outputs = []
    for name in ("plain", "anpd"):
        strategy = get_strategy_class(name).build(model, EngineSpec(strategy=name, n_threads=2))
        s = Session(model, LocalTarget(model, ContextParams(n_ctx=2048, n_threads=2)), strategy)
        finished = reply(s, prompt, n=96)
        assert finished.prompt_tokens > 512 and len(finished.tokens) > 48
        outputs.append(finished.tokens)
        s.close()
    assert outputs[0] == outputs[1]
