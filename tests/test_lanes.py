"""Several conversations decoded together (engine/core/lanes.py): the rows of different
conversations in one batch compute exactly what each computes alone, and every lane's answer
is plain decoding's (greedy) or its own seeded sample, whatever the other lanes do. Counters
prove that the rows really shared batches (docs/facts.md §32)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from potluck.engine import EngineSpec, Finished, Lanes, Message, PromptCache, SamplingParams, open_lanes, open_session
from potluck.engine.core.batch import Batch
from potluck.engine.core.runtime import Context, ContextParams, Model

from .support.lanes import Ask, scripted_lanes, together
from .support.prompts import LONG_PROMPTS, PROMPTS
from .support.references import plain_conversation, plain_reply

N_CTX = 2048
TOKENS = 24


@pytest.fixture(scope="module")
def plain_lanes() -> Iterator[Lanes]:
    lanes = open_lanes(EngineSpec(strategy="plain", n_ctx=N_CTX, n_threads=1), 4)
    yield lanes
    lanes.close()


def fresh(lanes: Lanes) -> None:
    for s in lanes.sessions:
        s.load_messages([])


def test_rows_of_several_conversations_in_one_batch_equal_each_alone(model: Model) -> None:
    """Logits, not just tokens: four conversations in their own KV streams, uneven rows per
    conversation and per step (llama.cpp splits such a batch into several ubatches), a batch
    of more rows than a verify batch ever takes, against each conversation alone. One thread,
    the cheapest on a busy machine: rows do not depend on the thread count with a BF16 cache
    (docs/facts.md §3; two threads gave 0.0 as well, §32)."""
    prompts = [f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n" for p in PROMPTS[:4]]
    toks = [model.tokenize(p) for p in prompts]
    steps = 60
    alone = []
    for t in toks:
        with Context(model, ContextParams(n_ctx=512, n_batch=128, n_threads=1)) as ctx:
            ctx.run_tokens(t, 0)
            rows, seq = [ctx.logits_row(-1).copy()], []
            for i in range(steps):
                seq.append(int(np.argmax(rows[-1])))
                ctx.run_tokens([seq[-1]], len(t) + i)
                rows.append(ctx.logits_row(-1).copy())
        alone.append((seq, rows))
    params = ContextParams(n_ctx=512, n_batch=128, n_seq_max=4, n_threads=1, kv_unified=False)
    with Context(model, params) as ctx, Batch(128, n_seq_max=1) as batch:
        for s, t in enumerate(toks):
            ctx.run_tokens(t, 0, seq_id=s)
        done = [0] * 4
        widest = worst = 0.0
        step = 0
        while min(done) < steps:
            step += 1
            # 1..30 rows a conversation: 60 rows in the widest batch
            width = [min(steps - done[s], 1 if step % 4 == s else 1 + (11 * s + 7 * step) % 30) for s in range(4)]
            ids = [alone[s][0][done[s] + j] for s in range(4) for j in range(width[s])]
            pos = [len(toks[s]) + done[s] + j for s in range(4) for j in range(width[s])]
            seqs = [[s] for s in range(4) for _ in range(width[s])]
            batch.set_tokens(ids, pos, seqs, "all")
            ctx.run_batch(batch)
            got = ctx.logits(len(ids))
            r = 0
            for s in range(4):
                for j in range(width[s]):
                    worst = max(worst, float(np.abs(got[r] - alone[s][1][done[s] + j + 1]).max()))
                    r += 1
                done[s] += width[s]
            widest = max(widest, len(ids))
    assert widest > 48
    assert worst == 0.0


def test_four_conversations_share_every_step_and_each_equals_plain(model: Model, plain_lanes: Lanes) -> None:
    fresh(plain_lanes)
    before = plain_lanes.hub.counters.batches
    got = [r[0] for r in together(plain_lanes, [Ask(i, [p]) for i, p in enumerate(PROMPTS[:4])])]
    for p, fin in zip(PROMPTS[:4], got):
        assert list(fin.tokens) == plain_reply(model, p, TOKENS, n_ctx=N_CTX)
    c = plain_lanes.hub.counters
    assert c.most_lanes == 4 and c.shared >= 1
    assert c.batches - before < sum(len(f.tokens) for f in got) / 2  # steps were shared, not taken in turn


def test_a_seeded_sample_on_a_lane_repeats_the_sample_alone(plain_lanes: Lanes) -> None:
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=4321)
    alone = open_session(EngineSpec(strategy="plain", n_ctx=N_CTX, n_threads=1))
    try:
        *_, want = alone.generate(PROMPTS[1], sampled, TOKENS)
    finally:
        alone.close()
    fresh(plain_lanes)
    got = together(plain_lanes, [Ask(0, [PROMPTS[0]]), Ask(1, [PROMPTS[1]], sampled),
                                 Ask(2, [PROMPTS[2]], SamplingParams(temperature=0.7, seed=1))])
    assert isinstance(want, Finished) and got[1][0].text == want.text


@pytest.mark.slow  # the twin across other lanes' batches, chunk by chunk, by default: the test below
def test_a_long_prompt_beside_decoding_lanes_is_exact(model: Model, plain_lanes: Lanes) -> None:
    """A prompt of two chunks (the first computed in the F16 twin) enters while three lanes
    decode: the twin keeps its sequence across their batches, so every position is computed
    as alone."""
    long_prompt = "Summarize this log:\n" + "\n".join(
        f"{i:03d} worker-{i % 7} joined the chain at layer {i % 30} after {i * 13 % 97} ms" for i in range(40))
    fresh(plain_lanes)
    stage = plain_lanes.hub.target.stage  # type: ignore[attr-defined]
    staged = stage.prefill.counters.staged_jobs
    chunks = plain_lanes.hub.counters.prompt_chunks
    asks = [Ask(i, [p], max_tokens=48) for i, p in enumerate(PROMPTS[:3])] + [Ask(3, [long_prompt], max_tokens=16)]
    got = [r[0] for r in together(plain_lanes, asks)]
    assert got[3].prompt_tokens > 512
    for ask, fin in zip(asks, got):
        assert list(fin.tokens) == plain_reply(model, ask.turns[0], ask.max_tokens, n_ctx=N_CTX)
    assert stage.prefill.counters.staged_jobs > staged
    assert plain_lanes.hub.counters.prompt_chunks > chunks


@pytest.mark.parametrize("strategy", ["anpd", pytest.param("sd", marks=pytest.mark.slow)])
def test_verify_batches_of_several_conversations_share_a_batch(model: Model, weak_draft: Path, strategy: str) -> None:
    """Speculation on every lane, drafting every round (adaptive off): verify batches of
    several conversations go to the target together and every answer is plain decoding's."""
    spec = EngineSpec(strategy=strategy, n_ctx=N_CTX, n_threads=1, draft=weak_draft if strategy == "sd" else None,
                      strategy_options={"adaptive": False, "max_draft": 6})
    prompts = [*LONG_PROMPTS[1:3], "Repeat after me three times: the quick brown fox jumps over the lazy dog.",
               PROMPTS[1]]
    lanes = open_lanes(spec, 4)
    try:
        got = [r[0] for r in together(lanes, [Ask(i, [p], max_tokens=40) for i, p in enumerate(prompts)])]
        c = lanes.hub.counters
    finally:
        lanes.close()
    for p, fin in zip(prompts, got):
        assert list(fin.tokens) == plain_reply(model, p, 40, n_ctx=N_CTX)
    assert sum(f.drafted for f in got) > 0 and sum(f.accepted for f in got) > 0
    assert c.shared_verify > 0  # a batch held two conversations' verify batches
    assert c.most_lanes == 4


def test_a_kept_conversation_continues_exactly_on_another_lane(model: Model, plain_lanes: Lanes) -> None:
    """Turn 1 on lane 1; lane 1 takes another conversation (turn 1 goes to the prompt cache);
    turn 2 comes back on lane 2: its cells are put into lane 2's stream, and the reply is the
    one a single session gives turn by turn."""
    turns = ["Name a river.", "How long is it?"]
    want = plain_conversation(model, turns, [TOKENS, TOKENS], n_ctx=N_CTX)
    cache = PromptCache(256 * 10**6, 8)
    for s in plain_lanes.sessions:
        s.use_prompt_cache(cache)
    try:
        fresh(plain_lanes)
        ((first,),) = together(plain_lanes, [Ask(1, [turns[0]])])
        together(plain_lanes, [Ask(1, [PROMPTS[3]], history=[])])
        history = [Message("user", turns[0]), Message("assistant", first.text)]
        ((second,),) = together(plain_lanes, [Ask(2, [turns[1]], history=history)])
    finally:
        for s in plain_lanes.sessions:
            s.prompt_cache = None
    assert [list(first.tokens), list(second.tokens)] == want
    assert cache.stats().restored == 1 and second.prompt_tokens - second.prefill_tokens > len(first.tokens)


def test_a_prompt_in_the_twin_stays_there_across_other_conversations_batches(model: Model) -> None:
    """A lane's prompt chunks may reach the target with another lane's batch between them (the
    hub forwards what each lane posts as it comes). The F16 twin keeps its sequence meanwhile:
    handed back between the chunks, its F16 cells would be rounded to BF16 and back, and the
    second chunk would compute other numbers than alone."""
    from potluck.engine.core.jobs import DecodeJob
    from potluck.engine.core.target import LocalTarget

    text = "Summarize this log:\n" + "\n".join(f"{i:03d} worker-{i % 7} joined at layer {i % 30}" for i in range(30))
    toks = model.tokenize(text)
    first, second = toks[:160], toks[160:]
    assert len(second) >= 64  # both chunks are computed in the twin
    other = model.tokenize("Hello there, how are you today?")

    def last_logits(streams: int, between: bool) -> tuple[np.ndarray, int]:
        t = LocalTarget(model, ContextParams(n_ctx=512, n_seq_max=streams, kv_unified=streams == 1, n_threads=1))
        try:
            seq = streams - 1
            t.wait(t.submit(DecodeJob.tokens(1, first, 0, seq_id=seq)))
            if between:
                t.wait(t.submit(DecodeJob.tokens(2, other, 0, seq_id=0)))
            out = t.wait(t.submit(DecodeJob.tokens(3, second, len(first), seq_id=seq)))
            return out, t.stage.prefill.counters.handovers
        finally:
            t.close()

    alone, _ = last_logits(1, between=False)
    shared, handovers = last_logits(2, between=True)
    assert handovers == 0  # the other sequence's batch left the twin open
    assert np.array_equal(alone, shared)


def test_a_batch_waits_for_busy_lanes_and_a_cancel_reaches_a_waiting_job(model: Model) -> None:
    """The hub's rules on a real target: a lane's step waits while another decoding lane is
    still busy (its row may join); cancelling the waiting step settles it at once, never
    computed; a lane decoding alone sends its step to the target itself (solo), and goes
    through the hub again once another lane decodes, after its solo step is done."""
    from potluck.engine.core.jobs import DecodeJob, GroupCancelled
    from potluck.engine.core.lanes import LaneHub
    from potluck.engine.core.target import LocalTarget

    target = LocalTarget(model, ContextParams(n_ctx=256, n_seq_max=2, kv_unified=False, n_threads=1))
    hub = LaneHub(target, 2)
    try:
        lane0, lane1 = hub.lanes
        hub.activate(0)
        hub.activate(1)  # busy: it has posted nothing yet
        toks = model.tokenize("Hello")
        ticket = lane0.submit(DecodeJob.tokens(lane0.new_group(), toks, 0))
        for _ in range(3):
            hub.step(0.01)
        assert not lane0.poll(ticket) and hub.counters.batches == 0
        lane0.cancel(ticket.group)
        with pytest.raises(GroupCancelled):
            lane0.wait(ticket)
        hub.activate(1, False)  # lane 0 decodes alone now: its step goes at once, from its thread
        again = lane0.submit(DecodeJob.tokens(lane0.new_group(), toks, 0))
        assert lane0.wait(again).shape == (1, model.n_vocab) and hub.counters.solo == 1
        assert target.runner.counters.finished == 1  # the cancelled step never reached llama.cpp
        solo = lane0.submit(DecodeJob.tokens(lane0.new_group(), toks, 1))
        hub.activate(1)  # a second conversation: the next steps share a batch, after the solo one
        steps = [lane.submit(DecodeJob.tokens(lane.new_group(), toks, 2 if lane is lane0 else 0))
                 for lane in (lane0, lane1)]
        while not all(lane.poll(t) for lane, t in zip((lane0, lane1), steps)):
            hub.step(0.01)
        assert lane0.wait(solo).shape == (1, model.n_vocab) and hub.counters.solo == 2
        assert [lane.wait(t).shape for lane, t in zip((lane0, lane1), steps)] == [(1, model.n_vocab)] * 2
        assert hub.counters.batches == 1 and hub.counters.shared == 1
    finally:
        hub.close()


def test_a_recurrent_model_gets_one_lane_that_rolls_back_as_alone() -> None:
    """A hybrid recurrent model (qwen35moe) rolls back sequence 0's state only
    (core/rollback.py): asked for four lanes it gets one, which knows it is recurrent, so
    anpd's rejected drafts go back through the stage's rollback and the reply is plain
    decoding's. The lone lane sends its jobs to the target itself (solo), rejections included."""
    from potluck.engine.lab.hybrid_shapes import build_hybrid_shape

    path = build_hybrid_shape("qwen35moe-small")
    prompt = "Repeat after me: the cat sat on the mat, the cat sat on the mat, the cat sat on the mat."
    with Model(path) as model:
        expected = plain_reply(model, prompt, 48, n_ctx=512)
    spec = EngineSpec(model=path, strategy="anpd", strategy_options={"adaptive": False}, n_ctx=512, n_threads=1)
    lanes = open_lanes(spec, 4)
    try:
        assert len(lanes.sessions) == 1 and lanes.sessions[0].target.recurrent
        ((reply,),) = together(lanes, [Ask(0, [prompt], SamplingParams(temperature=0.0), 48)])
        assert list(reply.tokens) == expected
        assert reply.drafted > reply.accepted  # drafts were rejected, and rolled back
        # alone: its jobs from its own thread (one waits for the hub where its KV operation, a
        # rejected tail's trim, is still in the hub's queue: order first)
        assert lanes.hub.counters.solo > 0
        c = lanes.hub.target.stage.rollback.counters  # type: ignore[attr-defined]
        assert c.snapshot_rollbacks + c.restores > 0, c
    finally:
        lanes.close()


def test_a_request_never_takes_the_lane_of_another_keys_conversation() -> None:
    """The server hands a request to the free lane whose conversation it continues, counting
    only its own API key's: another key's request that begins with the same text goes to the
    least recently used lane instead, so the owner's next turn still finds its conversation
    there (the reuse itself is refused per key in Session; this is the lane choice). The
    engine thread with scripted lanes, no model."""
    import asyncio
    from types import SimpleNamespace

    from potluck.app.serve.engine_thread import EngineThread, Job
    from potluck.app.serve.protocol import GenerationRequest

    async def ask(engine: EngineThread, owner: str, text: str) -> None:
        job = Job(GenerationRequest("chat", SamplingParams(), 1), asyncio.get_running_loop(), owner=owner)
        engine.submit(job)
        engine.ready(job, SimpleNamespace(text=text))  # type: ignore[arg-type]
        assert (await asyncio.wait_for(job.events.get(), 10))[0] == "done"

    async def main() -> None:
        engine = EngineThread(lambda: lanes, max_queue=4)
        engine.start()
        engine.loaded.wait(10)
        await ask(engine, "carol", "Carol's question")  # lane 0
        await ask(engine, "alice", "The door PIN is 493817. Hello!")  # lane 1, the least recently used
        await ask(engine, "bob", "The door PIN is 493817. Hello!")  # not alice's lane 1: lane 0
        await ask(engine, "alice", "The door PIN is 493817. Hello! And more")  # her own lane 1
        engine.stop()

    lanes, ran = scripted_lanes(2)
    asyncio.run(main())
    assert [(lane, owner) for lane, owner, _ in ran] == [(0, "carol"), (1, "alice"), (0, "bob"), (1, "alice")]
