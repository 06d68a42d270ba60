"""`potluck generate`: one reply to one prompt, streamed to stdout (scriptable)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import TextIO

from ...engine import (
    PLAIN,
    Finished,
    PlanChanged,
    RenderedReader,
    ReplyStarted,
    ThinkSplitter,
    TokenText,
    is_harmony,
    open_session,
    printable,
    thinks,
    validate,
)
from ..cli import COMMANDS
from .common import (
    add_cluster_args,
    add_model_args,
    add_sampling_args,
    engine_spec,
    read_prompt,
    sampling_params,
    with_cluster,
)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help=COMMANDS["generate"],
        description="Generate one reply to PROMPT (or stdin) and stream it to stdout: plain greedy decoding "
        "unless --strategy or --temp say otherwise; --json prints one object at the end.",
    )
    add_model_args(p)
    add_sampling_args(p)
    add_cluster_args(p)
    p.add_argument(
        "--kv", default="bf16", choices=sorted(validate.KV_CACHES),
        help="KV cache: bf16 (default: exact, prompts prefilled at F16's speed) or f16 (an F16 cache "
        "throughout, exact by running single-token steps on one thread; rarely worth it)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object at the end, nothing else")
    p.add_argument("prompt", nargs="?", help="the user message ('-' or omitted: read stdin)")


def run(args: argparse.Namespace) -> int:
    # Every value is checked (engine.limits) before stdin is read or anything is loaded.
    sampling = sampling_params(args)
    spec = replace(engine_spec(args), kv_cache=args.kv)
    prompt = read_prompt(args.prompt)
    session = open_session(with_cluster(spec, args))
    try:
        finished: Finished | None = None
        shown = ReplyText(None)
        for event in session.generate(prompt, sampling, args.max_tokens):
            if isinstance(event, ReplyStarted):
                shown = ReplyText(reply_splitter(session.model.chat_template or "", event.thinking_opened))
            elif isinstance(event, TokenText) and not args.json:
                shown.feed(event.text)
            elif isinstance(event, PlanChanged):  # a worker was lost and the head carried on
                print(f"potluck: {printable(event.reason)}", file=sys.stderr, flush=True)  # it names workers
            elif isinstance(event, Finished):
                finished = event
        assert finished is not None
        if args.json:
            print(json.dumps(result_json(finished), ensure_ascii=False))
        else:
            shown.end()
    finally:
        session.close()
    return 0


def reply_splitter(template: str, opened: bool) -> ThinkSplitter | RenderedReader | None:
    """What tells the reply's thinking from its answer as it streams: gpt-oss's channels, a
    ``<think>`` block (``opened``: by the rendered prompt itself, ReplyStarted says), or nothing."""
    if is_harmony(template):
        return RenderedReader()
    return ThinkSplitter.for_template(template, opened) if opened or thinks(template) else None


class ReplyText:
    """Where a streamed reply's text goes: stdout. A reasoning model's (a ``<think>`` block,
    gpt-oss's channels) is split as it streams: the answer to stdout, the thinking to stderr,
    neither tags nor markers, so a pipe gets the answer alone."""

    def __init__(self, splitter: ThinkSplitter | RenderedReader | None, out: TextIO | None = None,
                 err: TextIO | None = None) -> None:
        self.splitter = splitter
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self._thinking = False  # the last text went to err

    def feed(self, text: str) -> None:
        if self.splitter is None:
            self._write(self.out, text)
        else:
            self._show(*self.splitter.feed(text))

    def end(self) -> None:
        if self.splitter is not None:
            self._show(*self.splitter.finish())
        self._write(self.err if self._thinking else self.out, "\n")

    def _show(self, reasoning: str, content: str) -> None:
        if reasoning:
            self._thinking = True
            self._write(self.err, reasoning)
        if content:
            if self._thinking:  # the answer starts below the thinking
                self._thinking = False
                self._write(self.err, "\n")
            self._write(self.out, content)

    @staticmethod
    def _write(stream: TextIO, text: str) -> None:
        stream.write(text)
        stream.flush()


def result_json(f: Finished) -> dict[str, object]:
    out: dict[str, object] = {
        "text": f.text,
        "tokens": list(f.tokens),
        "finish_reason": f.reason,
        "strategy": f.strategy,
        "tokens_per_s": round(f.tokens_per_s, 3),
        "prompt_tokens": f.prompt_tokens,
        "prompt_tokens_per_s": round(f.prefill_tokens_per_s, 3),
        "ttft_s": round(f.ttft_s, 4),
        "decode_s": round(f.decode_s, 4),
    }
    if f.strategy != PLAIN:  # every other strategy drafts: scripts read these, even at 0
        out.update(
            drafted=f.drafted,
            accepted=f.accepted,
            acceptance_rate=round(f.acceptance_rate or 0.0, 4),
            mean_accepted_len=round(f.mean_accepted_len or 0.0, 4),
        )
    out.update(f.extra)
    return out
