"""Prompts prefill in an F16 twin and hand their cells to the BF16 cache (core/staged_prefill.py).

What must hold: the converted state loads where llama.cpp expects it; the twin computes a
prompt exactly as an F16 context would, whatever the thread count; after the hand-over single
steps equal verify batches (the BF16 property every strategy relies on); a cancel reaches a
prompt computing in the twin. Every strategy against plain decoding on this path is in
tests/test_prefill.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from potluck.engine.core.jobs import DecodeJob, GroupCancelled
from potluck.engine.core.kv_state import (
    _TO_BF16,
    _TO_F16,
    GGML_TYPE_BF16,
    GGML_TYPE_F16,
    KvStateError,
    bf16_from_f16,
    convert_seq_state,
)
from potluck.engine.core.runtime import Context, ContextParams, Model
from potluck.engine.core.staged_prefill import MIN_ROWS
from potluck.engine.core.target import LocalTarget

THREADS = 2
RNG = np.random.default_rng(7)
PROMPT = RNG.integers(100, 20_000, 700).tolist()  # past 512 cells
FOLLOW = RNG.integers(100, 20_000, 12).tolist()


def _target(model: Model, n_threads: int = THREADS, **kw: object) -> LocalTarget:
    return LocalTarget(model, ContextParams(n_ctx=2048, n_threads=n_threads, **kw))  # type: ignore[arg-type]


def test_value_tables_match_the_float_reference() -> None:
    f16 = np.arange(1 << 16, dtype=np.uint16)
    as_f32 = f16.view(np.float16).astype(np.float32)
    finite = np.isfinite(as_f32)
    # every finite F16 value lands on the BF16 value nearest to it (ties to even)
    back = (_TO_BF16.astype(np.uint32) << 16).view(np.float32)
    assert np.all(np.abs(back[finite] - as_f32[finite]) <= np.abs(as_f32[finite]) * 2.0**-8)
    assert np.isnan(back[np.isnan(as_f32)]).all() and np.array_equal(back[np.isinf(as_f32)], as_f32[np.isinf(as_f32)])
    assert np.array_equal(_TO_BF16, bf16_from_f16(f16))
    # BF16 values inside F16's normal range survive the round trip; past it they saturate
    bf16 = np.arange(1 << 16, dtype=np.uint16)
    f32 = (bf16.astype(np.uint32) << 16).view(np.float32)
    normal = np.isfinite(f32) & (np.abs(f32) >= 2.0**-14) & (np.abs(f32) <= 65504)
    assert np.array_equal(_TO_BF16[_TO_F16][normal], bf16[normal])
    big = np.float32(1e6).view(np.uint32) >> 16
    assert _TO_F16[big] == 0x7BFF and _TO_F16[big | 0x8000] == 0xFBFF  # +-65504, not inf


def _state(model: Model, kv_type: int, n: int = 80, **kw: object) -> bytearray:
    with Context(model, ContextParams(n_ctx=256, n_threads=THREADS, kv_type=kv_type, **kw)) as ctx:  # type: ignore[arg-type]
        ctx.run_tokens(PROMPT[:n], 0)
        return ctx.seq_state(0)


def test_converted_states_load_into_the_other_cache_type(model: Model) -> None:
    bf16 = _state(model, GGML_TYPE_BF16)
    original = bytes(bf16)
    as_f16 = convert_seq_state(bytearray(original), GGML_TYPE_F16, n_stream=1)
    with Context(model, ContextParams(n_ctx=256, kv_type=GGML_TYPE_F16)) as f16_ctx:
        f16_ctx.set_seq_state(0, as_f16)
        assert f16_ctx.seq_pos_max(0) == 79
    # BF16 -> F16 -> BF16 gives every value back but those outside F16's normal range
    back = np.frombuffer(bytes(convert_seq_state(as_f16, GGML_TYPE_BF16, n_stream=1)), np.uint16)
    before = np.frombuffer(original, np.uint16)
    changed = (before[back != before].astype(np.uint32) << 16).view(np.float32)
    assert changed.size < before.size // 100
    assert np.all((np.abs(changed) < 2.0**-14) | (np.abs(changed) > 65504))
    # a context with a KV stream per sequence takes the cells into sequence 0's own stream
    two = convert_seq_state(bytearray(original), GGML_TYPE_BF16, n_stream=2)
    with Context(model, ContextParams(n_ctx=256, n_seq_max=2, kv_unified=False)) as ctx:
        ctx.set_seq_state(0, two)
        assert (ctx.seq_pos_max(0), ctx.seq_pos_max(1)) == (79, -1)


def test_states_it_cannot_convert_are_refused_in_one_line() -> None:
    with pytest.raises(KvStateError, match="wrong magic"):
        convert_seq_state(bytearray(b"\0" * 16), GGML_TYPE_BF16, n_stream=1)
    header = (0xAF143CD8).to_bytes(4, "little") + bytes(4)
    stream = (1).to_bytes(4, "little") + (1).to_bytes(4, "little")  # 1 stream, 1 cell
    cell = bytes(4) + (1).to_bytes(4, "little") + bytes(4)
    q8 = bytes(4) + (1).to_bytes(4, "little") + (8).to_bytes(4, "little") + (34).to_bytes(8, "little") + bytes(34)
    with pytest.raises(KvStateError, match="ggml type 8"):
        convert_seq_state(bytearray(header + stream + cell + q8), GGML_TYPE_BF16, n_stream=1)
    # read as cells with M-RoPE's extension (6 words, not 3), the same bytes end inside the cell
    with pytest.raises(KvStateError, match="ends inside its cells"):
        convert_seq_state(bytearray(header + stream + cell), GGML_TYPE_BF16, n_stream=1, cell_ext=True)


def _prompt_logits_and_steps(target: LocalTarget) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prompt's last logits, 12 single steps after it, and the same 12 tokens as a batch."""
    last = target.decode(PROMPT)[-1].copy()
    singles = np.stack([target.decode([t])[-1].copy() for t in FOLLOW])
    target.truncate(len(PROMPT))
    batch = target.decode(FOLLOW, all_logits=True)
    return last, singles, batch


def test_a_prompt_prefills_in_the_twin_and_decodes_exactly_after_the_hand_over(model: Model) -> None:
    staged = _target(model)
    try:
        last, singles, batch = _prompt_logits_and_steps(staged)
        c = staged.stage.prefill.counters  # type: ignore[union-attr]
        assert c.staged_jobs == 2 and c.handovers == 1  # 512 + 188 rows, handed back at the first step
        assert np.array_equal(singles, batch)  # single steps past 512 cells equal a verify batch
        assert staged.stage.prefill.twin is None  # type: ignore[union-attr]  # closed after the hand-over
    finally:
        staged.close()
    # what an F16 context computes for the same chunks, on one thread: the twin's result
    with Context(model, ContextParams(n_ctx=2048, n_threads=1, kv_type=GGML_TYPE_F16)) as f16:
        f16.run_tokens(PROMPT[:512], 0)
        f16.run_tokens(PROMPT[512:], 512)
        assert np.array_equal(f16.logits_row(-1), last)
    # the BF16 cache alone computes the prompt otherwise: the path really changed
    plain_bf16 = _target(model, f16_prefill=False)
    try:
        assert not np.array_equal(plain_bf16.decode(PROMPT)[-1], last)
        assert plain_bf16.stage.prefill is None
    finally:
        plain_bf16.close()


def test_short_batches_and_side_sequences_stay_in_the_bf16_cache(model: Model) -> None:
    target = _target(model)
    try:
        target.decode(PROMPT[: MIN_ROWS - 1])
        target.decode(PROMPT[MIN_ROWS - 1 : MIN_ROWS + 8])
        assert target.stage.prefill.counters.staged_jobs == 0  # type: ignore[union-attr]
        target.decode(PROMPT[MIN_ROWS + 8 : 2 * MIN_ROWS + 8])  # a chunk of 64 at the end: staged
        assert target.stage.prefill.counters.staged_jobs == 1  # type: ignore[union-attr]
        assert target.pos_max()[0] == 2 * MIN_ROWS + 7  # seq 0's length, the twin's included
    finally:
        target.close()


def test_a_cancel_reaches_a_prompt_in_the_twin(model: Model) -> None:
    target = _target(model)
    try:
        target.decode(PROMPT[:100])
        group = target.new_group()
        long = RNG.integers(100, 20_000, 512).tolist()
        tickets = [target.submit(DecodeJob.tokens(group, long, 100))]
        deadline = time.monotonic() + 30
        while target.runner.running_group != group and time.monotonic() < deadline:
            time.sleep(0.001)
        target.cancel(group)
        with pytest.raises(GroupCancelled):
            target.wait(tickets[0])
        assert target.runner.counters.aborted == 1
        # it was aborted in the twin: the first 100 tokens were handed back, so only that
        # batch opened it, and nothing has handed it back since
        assert target.stage.prefill.active  # type: ignore[union-attr]
        assert target.pos_max()[0] == 99  # the aborted batch left nothing behind
        # and the conversation goes on as if the batch never ran
        after = target.decode(PROMPT[100:200])[-1].copy()
    finally:
        target.close()
    fresh = _target(model)
    try:
        fresh.decode(PROMPT[:100])
        assert np.array_equal(fresh.decode(PROMPT[100:200])[-1], after)
    finally:
        fresh.close()


@pytest.mark.slow
def test_the_twin_computes_alike_on_one_thread_and_two(model: Model) -> None:
    one, two = _target(model, n_threads=1), _target(model, n_threads=2)
    try:
        assert np.array_equal(one.decode(PROMPT)[-1], two.decode(PROMPT)[-1])
        assert one.stage.prefill.counters.staged_jobs == two.stage.prefill.counters.staged_jobs == 2  # type: ignore[union-attr]
    finally:
        one.close()
        two.close()


def test_a_split_model_stages_alike_the_whole_model(model: Model, model_path: Path, tmp_path: Path) -> None:
    """Two turns, the second a staged chunk after cells already in the BF16 cache (converted
    into the twin and back): three in-process stages give the whole model's logits. A stage
    must never decide over its own layers' values (layer 0's hold values F16 cannot)."""
    from potluck.engine.core.gguf_tools import slice_layers

    from .support.split_target import SplitTarget

    bounds = [(0, 9), (9, 21), (21, 30)]
    models = [Model(slice_layers(model_path, tmp_path / f"{lo}.gguf", lo, hi)) for lo, hi in bounds]
    whole = _target(model)
    split = SplitTarget(models, ContextParams(n_ctx=2048, n_threads=THREADS))
    try:
        for t in (whole, split):
            t.decode(PROMPT[:100])  # turn 1: staged from an empty sequence
            t.decode(FOLLOW[:3])  # its reply: single steps in BF16 (the hand-over first)
        turn_2 = PROMPT[100:300]
        want = whole.decode(turn_2, all_logits=True).copy()
        assert np.array_equal(split.decode(turn_2, all_logits=True), want)
        assert np.array_equal(split.decode(FOLLOW[3:8], all_logits=True), whole.decode(FOLLOW[3:8], all_logits=True))
        assert all(s.prefill.counters.staged_jobs == 2 for s in split.stages)  # type: ignore[union-attr]
        assert whole.stage.prefill.counters.handovers == 2  # type: ignore[union-attr]
    finally:
        whole.close()
        split.close()
        for m in models:
            m.close()
