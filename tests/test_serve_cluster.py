"""`potluck serve --nodes` over loopback workers: the split model answers exactly what one
machine answers, and /health and /metrics show the chain's stages."""

from __future__ import annotations

from collections.abc import Iterator
from urllib.request import urlopen

import openai
import pytest

from potluck.app.loopback import stop_workers
from potluck.app.serve.launch import RunningServer, start_server, stop_server
from potluck.engine import EngineSpec, Finished, SamplingParams, open_session

from .cluster_support import JOIN_S, TOKEN, WorkerProc, start_workers
from .support.conversations import interleave_turns
from .support.serving import ask_at_once


@pytest.fixture(scope="module")
def cluster_server(loopback_pool: list[WorkerProc], tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[RunningServer]:
    home = tmp_path_factory.mktemp("serve-cluster-home")
    token_file = home / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    (home / "config").mkdir()
    (home / "config" / "config.toml").write_text("[sampling]\ntemperature = 0.0\n")  # greedy unless asked
    nodes = ",".join(w.address for w in loopback_pool[:2])
    running = start_server(home, ["--nodes", nodes, "--token-file", str(token_file), "--split", "0,15,30",
                                  "--join-timeout", str(JOIN_S)],
                           timeout_s=300)
    try:
        yield running
    finally:
        stop_server(running.proc)
    assert "Traceback" not in running.log()


def test_a_split_model_answers_exactly_like_one_machine(cluster_server: RunningServer) -> None:
    client = openai.OpenAI(base_url=f"{cluster_server.base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    turns = ["Hi! Who are you?", "What can you do?"]
    local = open_session(EngineSpec())
    try:
        want = [[e for e in local.generate(t, SamplingParams(), 16) if isinstance(e, Finished)][-1].text for t in turns]
    finally:
        local.close()
    history: list[dict[str, str]] = []
    for turn, expected in zip(turns, want):
        history.append({"role": "user", "content": turn})
        r = client.chat.completions.create(model="any", messages=history, max_tokens=16)
        assert r.choices[0].message.content == expected
        history.append({"role": "assistant", "content": expected})
    # the session's own conversation is reused on the workers too (turn 2 continues turn 1)
    assert r.model_extra["potluck"]["reused_tokens"] > 0
    health = cluster_server.health()
    stages = health["cluster"]["stages"]
    assert [s["layers"] for s in stages] == [[0, 15], [15, 30]] and all(s["state"] == "ok" for s in stages)
    # /metrics: each stage's layers, traffic and health, by node
    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(f"{cluster_server.base_url}/metrics", timeout=60) as reply:
        samples = [s for f in text_string_to_metric_families(reply.read().decode()) for s in f.samples]
    layers = {s.labels["node"]: s.value for s in samples if s.name == "potluck:stage_layers"}
    assert sorted(layers.values()) == [15, 15] and set(layers) == {s["node"] for s in stages}
    assert all(s.value > 0 for s in samples if s.name == "potluck:stage_bytes_total")
    assert [s.value for s in samples if s.name == "potluck:stage_up"] == [1, 1]


def test_four_clients_at_once_keep_the_stages_busy_and_each_answer_is_exact(cluster_server: RunningServer) -> None:
    """Four official clients at once: their steps travel as micro-batches, several in the
    pipeline at once (each stage computes one conversation's while the others compute
    theirs), and each client gets exactly what one machine answers it alone."""
    client = openai.OpenAI(base_url=f"{cluster_server.base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    prompts = ["What is a cat?", "Say hello.", "What is 2+2?", "Name a planet."]
    local = open_session(EngineSpec())
    try:
        want = {}
        for p in prompts:
            local.load_messages([])
            want[p] = [e for e in local.generate(p, SamplingParams(), 24) if isinstance(e, Finished)][-1].text
    finally:
        local.close()
    before = cluster_server.health()["batching"]
    got = ask_at_once(client, prompts, 24)
    after = cluster_server.health()["batching"]
    assert got == want
    assert after["overlapped"] > before["overlapped"] and after["most_in_flight"] >= 2


def test_interleaved_conversations_each_reuse_their_prefix_on_the_workers(cluster_server: RunningServer) -> None:
    """Several conversations are kept in cluster mode: each worker keeps its own layers' cells
    under a slot (nothing crosses the network), and each conversation's turn 2 continues
    from them exactly as the same conversation continued turn by turn on one machine."""
    client = openai.OpenAI(base_url=f"{cluster_server.base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    convs = {"a": ["Name a fruit.", "Another one?"], "b": ["Name a river.", "How long is it?"]}
    want = {}
    for name, turns in convs.items():
        local = open_session(EngineSpec())
        try:
            want[name] = [[e for e in local.generate(t, SamplingParams(), 12) if isinstance(e, Finished)][-1].text
                          for t in turns]
        finally:
            local.close()
    before = cluster_server.health()["prompt_cache"]
    interleave_turns(client, convs, want, max_tokens=12)  # turn 2 from the workers' slots
    after = cluster_server.health()["prompt_cache"]
    assert after["restored"] >= before["restored"] + 2 and after["kept"] >= before["kept"] + 2
    assert 0 < after["bytes_used"] <= after["max_bytes"]


def test_a_worker_lost_between_requests_is_replaced_and_answers_stay_exact(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Issue 23, left over: a worker of `serve --nodes` dies between two requests. The next
    request still answers exactly what one machine answers (the head rebuilds its chain over
    what is left), /health names the lost worker, and the server lives on."""
    tmp = tmp_path_factory.mktemp("serve-lost")
    workers = start_workers(tmp / "workers", ["s0", "s1"])
    home = tmp / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "config.toml").write_text("[sampling]\ntemperature = 0.0\n")
    token_file = home / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    nodes = ",".join(w.address for w in workers)
    running = start_server(home, ["--nodes", nodes, "--token-file", str(token_file), "--split", "0,15,30",
                                  "--join-timeout", str(JOIN_S)],
                           timeout_s=300)
    try:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0, timeout=600)
        prompts = ["Name a colour.", "Name a fruit."]
        want = []
        for p in prompts:  # each request is a conversation of its own
            local = open_session(EngineSpec())
            try:
                want.append([e for e in local.generate(p, SamplingParams(), 12) if isinstance(e, Finished)][-1].text)
            finally:
                local.close()
        ask = lambda p: client.chat.completions.create(  # noqa: E731
            model="any", messages=[{"role": "user", "content": p}], max_tokens=12).choices[0].message.content
        assert ask(prompts[0]) == want[0]
        workers[1].proc.kill()  # the last stage, gone without a word
        workers[1].proc.wait(30)
        assert ask(prompts[1]) == want[1]
        health = running.health()
        assert health["status"] == "ready"
        lost = {n["node"] for n in health["cluster"]["lost"]}
        assert workers[1].node_id in lost, health["cluster"]
        assert workers[1].node_id not in {s["node"] for s in health["cluster"]["stages"]}
        kept = health["prompt_cache"]
        assert ask(prompts[0]) == want[0]  # and it goes on: its kept cells went with the old chain, a miss
        after = running.health()["prompt_cache"]
        assert after["restored"] == kept["restored"] and after["lost"] == kept["lost"] + 1
    finally:
        stop_server(running.proc)
        stop_workers([w.proc for w in workers])
    assert "Traceback" not in running.log()
