"""Conversations sent to `potluck serve` the way chat clients send them (the whole history every
turn), shared by the one-machine and the cluster server tests."""

from __future__ import annotations

import openai


def interleave_turns(client: openai.OpenAI, convs: dict[str, list[str]], want: dict[str, list[str]],
                     max_tokens: int) -> None:
    """Turn 1 of every conversation, then turn 2 of every one, ...: each reply is ``want``'s, and
    from turn 2 on the whole earlier turn (prompt and reply) comes from the server's cache."""
    history: dict[str, list[dict[str, str]]] = {name: [] for name in convs}
    first_prompt: dict[str, int] = {}
    for i in range(max(map(len, convs.values()))):
        for name, turns in convs.items():
            if i >= len(turns):
                continue
            history[name].append({"role": "user", "content": turns[i]})
            r = client.chat.completions.create(model="any", messages=history[name], max_tokens=max_tokens)
            assert r.choices[0].message.content == want[name][i], (name, i)
            if i == 0:
                first_prompt[name] = r.usage.prompt_tokens
            else:
                assert r.model_extra["potluck"]["reused_tokens"] >= first_prompt[name], (name, i)
            history[name].append({"role": "assistant", "content": r.choices[0].message.content})
