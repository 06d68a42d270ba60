"""Sampled output keeps the target's distribution: plain and every speculative strategy on one
machine, at several temperatures with llama.cpp's filters (top-k, top-p, min-p) and with the
penalties, on the bundled model (pipeinfer over split stages: tests/test_pipeinfer.py).

Each case checks the first token the verifier chose after a prompt, over seeded replies,
against the target's exact filtered distribution there (tests/support/sampled.py). Each
speculative strategy also runs once with a verifier whose residual is broken, which must fail
the same test: drafts were rejected, and the check can see it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import pytest

from potluck.engine.core.runtime import ContextParams, Model
from potluck.engine.core.spec import EngineSpec
from potluck.engine.core.strategy import Strategy
from potluck.engine.speculation import inflight, verify
from potluck.engine.speculation.strategies.registry import get_strategy_class
from potluck.engine.speculation.strategies.triforce import TriForce

from .support.breadth import beyond
from .support.prompts import RAW_PROMPTS
from .support.sampled import ALPHA, DEFAULTS, SETTINGS, broken_residual, chi2_pvalue, verified_tokens

# A document long enough for TriForce's retrieval level with a small cache (its own options
# below): the reply drafts with the target over the chosen chunks.
LEDGER = (
    "Ledger of the harbour office. Ship Aurora left for Lisbon with wool and tin. Ship Borealis "
    "left for Genoa with salt and tin. Ship Calypso left for Lisbon with wool and copper. Ship "
    "Dauntless left for Genoa with salt and copper. Ship Aurora returned from Lisbon with wine. "
    "Ship Borealis returned from Genoa with oil. Ship Calypso returned from Lisbon with"
)
TRIFORCE_OPTIONS = {"min_context": 32, "budget": 16, "chunk": 8, "sinks": 4, "recent": 16, "gamma1": 2}

# name: (strategy options, uses the weak draft, prompt). One draft a round is enough: the
# token checked is decided by the first draft (kept, or the residual drawn instead).
CASES: dict[str, tuple[dict[str, object], bool, str]] = {
    "plain": ({}, False, RAW_PROMPTS["sd"]),
    "anpd": ({"max_draft": 1}, False, RAW_PROMPTS["anpd"]),
    "sd": ({"max_draft": 1}, True, RAW_PROMPTS["sd"]),
    "pearl": ({}, True, RAW_PROMPTS["sd"]),
    "minions": ({"max_draft": 1, "ahead": False}, True, RAW_PROMPTS["anpd"]),
    "triforce": ({"max_draft": 1, **TRIFORCE_OPTIONS}, False, LEDGER),
}
THREADS = {"pearl": 2}  # PEARL runs the draft and the target on a core each


@pytest.fixture(scope="module")
def strategies(model: Model, weak_draft: Path) -> Iterator[dict[str, Strategy]]:
    built: dict[str, Strategy] = {}
    for name, (options, draft, _) in CASES.items():
        if name != "plain":
            options = {**options, "adaptive": False}  # draft every round, whatever it costs here
        spec = EngineSpec(strategy=name, draft=weak_draft if draft else None, n_ctx=2048,
                          n_threads=THREADS.get(name, 1), strategy_options=options)
        built[name] = get_strategy_class(name).build(model, spec)
    yield built
    for strategy in built.values():
        strategy.close()


def context(model: Model, name: str) -> ContextParams:
    if name == "triforce":  # a second KV stream for the retrieval cache, and the keys it scores
        return ContextParams(n_ctx=512, n_threads=1, n_seq_max=2, kv_unified=False,
                             observe=TriForce.observed_tensors(model))
    return ContextParams(n_ctx=256, n_threads=1)


# Every strategy at llama.cpp's defaults by default; the other settings are breadth: each filter
# and penalty is verified exactly (the whole joint, not a sample) in test_spec_sampling.py, and
# penalties through a strategy's rounds in test_pipeinfer.py.
@pytest.mark.parametrize(("name", "setting"), beyond([(n, s) for n in CASES for s in SETTINGS],
                                                     keep=[(n, "llama.cpp defaults") for n in CASES]))
def test_sampled_tokens_follow_the_target_distribution(
    name: str, setting: str, model: Model, strategies: dict[str, Strategy]
) -> None:
    tokens, p = verified_tokens(model, strategies[name], CASES[name][2], SETTINGS[setting],
                                context=context(model, name))
    assert chi2_pvalue(tokens, p) > ALPHA


@pytest.mark.parametrize("name", beyond([n for n in CASES if n != "plain"], keep=["sd"]))
def test_a_broken_residual_is_caught(
    name: str, model: Model, strategies: dict[str, Strategy], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same check with a verifier that resamples from p after a rejection must fail."""
    monkeypatch.setattr(inflight, "verify_chain", functools.partial(verify.verify_chain, residual_fn=broken_residual))
    monkeypatch.setattr(inflight, "judge", functools.partial(verify.judge, residual_fn=broken_residual))
    tokens, p = verified_tokens(model, strategies[name], CASES[name][2], DEFAULTS, context=context(model, name))
    assert chi2_pvalue(tokens, p) < ALPHA


# --------------------------------------------------------------------------- under a grammar

# After the prompt's last token: a space, then a letter from b to z. Each prompt's likeliest
# continuations hold refused ones (" and"; " apples", which anpd drafts; " a") beside allowed
# ones, so the constrained distribution is the filtered one restricted and renormalized.
LETTERS = 'root ::= <[{last}]> " " [b-z] [a-z]*'
# Digits right after it: none of the filtered candidates is allowed, so the filters run again
# over the allowed tokens alone (the grammar's fallback).
DIGITS = 'root ::= <[{last}]> [0-9]+'


# a draft model under a grammar by default: test_a_broken_residual_is_caught_under_a_grammar
@pytest.mark.parametrize("name", beyond(list(CASES), keep=["plain", "anpd"]))
def test_sampled_tokens_follow_the_constrained_distribution(
    name: str, model: Model, strategies: dict[str, Strategy]
) -> None:
    """Structured output keeps the target's constrained distribution with every strategy:
    drafts the grammar refuses are rejected, the residual comes from the constrained p."""
    tokens, p = verified_tokens(model, strategies[name], CASES[name][2], DEFAULTS,
                                context=context(model, name), grammar=LETTERS)
    assert chi2_pvalue(tokens, p) > ALPHA


@pytest.mark.parametrize("name", beyond(["plain", "sd"], keep=["plain"]))
def test_sampled_tokens_where_the_grammar_refuses_every_candidate(
    name: str, model: Model, strategies: dict[str, Strategy]
) -> None:
    tokens, p = verified_tokens(model, strategies[name], CASES[name][2], DEFAULTS,
                                context=context(model, name), grammar=DIGITS)
    assert chi2_pvalue(tokens, p) > ALPHA
    assert all(model.token_bytes(t).isdigit() for t in tokens) and len(set(tokens)) > 3


@pytest.mark.parametrize("name", ["sd"])
def test_a_broken_residual_is_caught_under_a_grammar(
    name: str, model: Model, strategies: dict[str, Strategy], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft model drafts within a grammar that leaves the prompt's likeliest words (its
    drafts differ from the target's choices often enough for a wrong residual to show). Where
    a draft is refused, as anpd's " apples" is, p gives it nothing and p's residual after it is
    p itself: no residual can be wrong there."""
    monkeypatch.setattr(inflight, "verify_chain", functools.partial(verify.verify_chain, residual_fn=broken_residual))
    monkeypatch.setattr(inflight, "judge", functools.partial(verify.judge, residual_fn=broken_residual))
    tokens, p = verified_tokens(model, strategies[name], CASES[name][2], DEFAULTS, context=context(model, name),
                                grammar='root ::= <[{last}]> " " [a-z]+')
    assert chi2_pvalue(tokens, p) < ALPHA
