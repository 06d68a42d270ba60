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
from potluck.engine.core.reasoning import GEMMA4_THOUGHT, THINK, ThinkSplitter, split_thinking, template_tags, thinks

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


# Gemma 4's thought channel (llama.cpp's common/parsers/gemma4.cpp); gpt-oss's channels differ
GEMMA4_TEMPLATE = "{{ '<|turn>model\n' }}{% if m.content %}{{ m.content.split('<channel|>')[-1] }}{% endif %}"


def test_gemma4_thinks_in_its_thought_channel() -> None:
    """The template says which tags: Gemma 4's splitter waits out its first token (``<|channel>``,
    half the tag) and closes at ``<channel|>``; a reply read without its template (the chat
    app) takes either family; gpt-oss's ``<|channel|>`` is neither."""
    assert template_tags(GEMMA4_TEMPLATE) == GEMMA4_THOUGHT and template_tags(THINKING) == THINK
    assert template_tags("<|start|>assistant<|channel|>final<|message|>") is None
    for splitter in (ThinkSplitter.for_template(GEMMA4_TEMPLATE), ThinkSplitter.of_any_family()):
        parts = [splitter.feed(p) for p in ["<|channel>", "thought\nThe user asks.", "<chan", "nel|>Paris."]]
        parts.append(splitter.finish())
        assert ("".join(r for r, _ in parts), "".join(a for _, a in parts)) == ("The user asks.", "Paris.")
    assert ThinkSplitter.may_open("<|channel>") and ThinkSplitter.may_open("<think>")
    assert not ThinkSplitter.may_open("Hello") and not ThinkSplitter.may_open("")
    assert split_thinking("<|channel>thought\nhmm<channel|>Answer") == ("hmm", "Answer")
    # a trailing empty thought channel, or a lone closing tag, leaves the answer (llama.cpp's parser);
    # a <think> model's answer keeps a tag it writes later
    trailing = ["<|channel>", "thought", "\nhmm", "<channel|>", "Paris.", "<|channel>", "thought", "\n", "<channel|>"]
    for pieces in (trailing, ["Paris.", "<channel|>"]):
        splitter = ThinkSplitter.for_template(GEMMA4_TEMPLATE)
        parts = [splitter.feed(p) for p in pieces] + [splitter.finish()]
        assert "".join(a for _, a in parts) == "Paris." and "".join(r for r, _ in parts) in ("hmm", ""), parts
    assert split_thinking("<think>a</think>b <think>c</think>") == ("a", "b <think>c</think>")
    assert split_thinking("<think>a</think>b") == ("a", "b")


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


def test_serve_splits_gemma4s_thought_channel(tmp_path_factory: pytest.TempPathFactory, model_path: Path) -> None:
    """A template in Gemma 4's family (it strips ``...<channel|>`` from past replies): the
    reply's thought channel is ``reasoning_content``, streamed and whole."""
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.split('<channel|>')[-1] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    grammar = 'root ::= "<|channel>thought\\n" "The user wants a city. " "<channel|>" "Paris."'
    model = with_template(model_path, tmp_path_factory.mktemp("gemma4-thought") / "g.gguf", template)
    for s in start(tmp_path_factory, model, "[sampling]\ntemperature = 0.0\n"):
        c = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="none", max_retries=0, timeout=300)
        r = c.chat.completions.create(model="m", messages=ASK, max_tokens=40, extra_body={"grammar": grammar})
        message = r.choices[0].message
        assert (message.content, message.model_extra["reasoning_content"]) == ("Paris.", "The user wants a city. ")
        chunks = list(c.chat.completions.create(model="m", messages=ASK, max_tokens=40, stream=True,
                                                extra_body={"grammar": grammar}))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        thought = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        assert thought == "The user wants a city. "
        assert "".join(d.content or "" for d in deltas) == "Paris."


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
