"""Reasoning: a thinking template's ``<think>`` block comes back as ``reasoning_content``
(``delta.reasoning_content`` streamed), split as the reply streams, with a ``[server]
reasoning`` switch. The served model is the bundled one with a template that opens the block
(as DeepSeek R1's and Qwen3's thinking mode do), and a grammar writes the thinking, so the
reply's parts are known."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from potluck.app.serve.launch import RunningServer
from potluck.engine.core.reasoning import ThinkSplitter, thinks

from .support.serving import serving
from .support.templated import with_template

THINKING = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
GRAMMAR = 'root ::= "The user wants a city. Paris fits. " "</think>" "\\n\\nParis."'
ASK = [{"role": "user", "content": "Name the capital of France."}]


@pytest.mark.parametrize(("opened", "pieces", "reasoning", "answer"), [
    (False, ["<thi", "nk>\nLet me see.</th", "ink>\n\nHello", " there"], "Let me see.", "Hello there"),
    (False, ["  Hello <think>no</think>"], "", "  Hello <think>no</think>"),
    (True, ["Hmm", "…", "</think>", "\n", "Yes"], "Hmm…", "Yes"),
    (True, ["never closed <"], "never closed <", ""),
    (False, ["<", "b>bold</b>"], "", "<b>bold</b>"),
])
def test_splitter(opened: bool, pieces: list[str], reasoning: str, answer: str) -> None:
    splitter = ThinkSplitter(opened)
    parts = [splitter.feed(p) for p in pieces] + [splitter.finish()]
    assert ("".join(r for r, _ in parts), "".join(a for _, a in parts)) == (reasoning, answer)
    assert thinks(THINKING) and not thinks("{{ messages }}")


@pytest.fixture(scope="module")
def thinking_model(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_template(model_path, tmp_path_factory.mktemp("thinking") / "thinking.gguf", THINKING)


def start(tmp_path_factory: pytest.TempPathFactory, model: Path, config: str) -> Iterator[RunningServer]:
    with serving(tmp_path_factory.mktemp("serve-reasoning"), config, ["-m", str(model), "--ctx", "512"]) as s:
        yield s


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, thinking_model: Path) -> Iterator[openai.OpenAI]:
    for s in start(tmp_path_factory, thinking_model, "[sampling]\ntemperature = 0.0\n"):
        yield openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="none", max_retries=0, timeout=300)


def test_reasoning_content_whole_and_streamed(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=40, extra_body={"grammar": GRAMMAR})
    message = r.choices[0].message
    assert message.content == "Paris."
    assert message.model_extra["reasoning_content"] == "The user wants a city. Paris fits. "
    chunks = list(client.chat.completions.create(model="m", messages=ASK, max_tokens=40, stream=True,
                                                 extra_body={"grammar": GRAMMAR}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == \
        message.model_extra["reasoning_content"]
    assert "".join(d.content or "" for d in deltas) == "Paris."
    # without a grammar the bundled model never closes the block: all of it is thinking
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=8)
    assert r.choices[0].message.content == "" and r.choices[0].message.model_extra["reasoning_content"]


def test_the_switch_leaves_thinking_in_the_content(tmp_path_factory: pytest.TempPathFactory,
                                                   thinking_model: Path) -> None:
    for s in start(tmp_path_factory, thinking_model, "[sampling]\ntemperature = 0.0\n[server]\nreasoning = false\n"):
        c = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="none", max_retries=0, timeout=300)
        r = c.chat.completions.create(model="m", messages=ASK, max_tokens=40, extra_body={"grammar": GRAMMAR})
        assert r.choices[0].message.content == "The user wants a city. Paris fits. </think>\n\nParis."
        assert "reasoning_content" not in (r.choices[0].message.model_extra or {})


def test_generate_prints_the_thinking_on_stderr_and_the_answer_on_stdout(thinking_model: Path, model_path: Path,
                                                                          tmp_path: Path) -> None:
    """`potluck generate` splits a thinking template's reply as it streams, the block the prompt
    opened included: the bundled model never closes it, so all of its reply is thinking (on
    stderr) and stdout gets no answer; a model that does not think prints to stdout as before."""
    import os
    import subprocess
    import sys

    def generate(model: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "potluck.app.cli", "generate", "-m", str(model), "--ctx", "512",
                               "--max-tokens", "8", ASK[0]["content"]], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "POTLUCK_HOME": str(tmp_path)})

    thinking = generate(thinking_model)
    assert thinking.returncode == 0, thinking.stderr
    assert thinking.stdout == "" and thinking.stderr.strip() and "<think>" not in thinking.stderr
    plain = generate(model_path)
    assert plain.returncode == 0 and plain.stdout.strip() and not plain.stderr.strip()
