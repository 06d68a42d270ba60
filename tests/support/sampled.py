"""The statistical check every strategy's sampled output goes through (plain, sd, anpd, pearl,
minions, triforce here; pipeinfer over split stages in tests/test_pipeinfer.py).

A reply's first round only samples the prompt's own logits (speculation never delays the first
token), so each trial starts from the prompt less its last token, with logits that give that
token for sure; the second round then drafts and verifies right after the whole prompt, and its
first token must follow the target's filtered, penalised distribution there, whatever was
drafted. One chi-square test per setting, at one significance level that the exact verifier
passes and a verifier with a broken residual fails (each module keeps that control).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from potluck.engine.core.grammar import GrammarSpec, ReplyGrammar
from potluck.engine.core.runtime import ContextParams, Grammar, Model
from potluck.engine.core.sampling import Candidates, Sampler, SamplingParams
from potluck.engine.core.strategy import Generation, Round, Strategy
from potluck.engine.core.target import LocalTarget, Target

from .distributions import chisquare_pvalue, constrained_probs, dense_probs

# Several temperatures with llama.cpp's filters, and the penalties: what the strategies must keep.
SETTINGS = {
    "llama.cpp defaults": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
    "hot, top-p only": SamplingParams(temperature=1.4, top_p=0.9),  # no top-k: the whole vocabulary
    "cool, top-k and min-p": SamplingParams(temperature=0.5, top_k=12, min_p=0.02),
    "penalties": SamplingParams(temperature=1.0, top_k=40, repeat_penalty=1.1, frequency_penalty=0.6,
                                presence_penalty=0.4),
}
DEFAULTS = SETTINGS["llama.cpp defaults"]
TRIALS = 150
ALPHA = 1e-3  # one significance level: the exact verifier passes it, the broken one must not


def generation(target: Target, prompt: list[int], first_logits: np.ndarray, seed: int, model: Model,
               params: SamplingParams = DEFAULTS, max_new: int = 8, grammar: GrammarSpec | None = None) -> Generation:
    """A reply's state after ``prompt``; with ``grammar``, the reply follows it (close the
    sampler's grammar after the reply)."""
    seeds = np.random.SeedSequence(seed)
    history = list(prompt)
    return Generation(
        run_id=seed,
        target=target,
        sampler=Sampler(params, np.random.default_rng(seeds),
                        ReplyGrammar.open(model, grammar, history) if grammar else None),
        seeds=seeds,
        history=history,
        first_logits=first_logits,
        max_new=max_new,
        is_eog=model.is_eog,
    )


def next_round(g: Generation, rounds: Iterator[Round]) -> Round:
    """The next round, its tokens then added to the conversation as the session does."""
    rnd = next(rounds)
    g.history.extend(rnd.tokens)
    g.n_new += len(rnd.tokens)
    return rnd


def verified_tokens(
    model: Model, strategy: Strategy, text: str, params: SamplingParams = DEFAULTS, trials: int = TRIALS,
    context: ContextParams | None = None, grammar: str | None = None,
) -> tuple[list[int], np.ndarray]:
    """The first token the verifier chose right after the prompt ``text`` in each of ``trials``
    replies (one seed each), and the target's exact distribution there (module docstring).
    Plain decoding drafts nothing: its second round is a plain draw there.

    ``grammar``: GBNF the replies follow, whose first token is the prompt's last
    (``{last}`` in it stands for that token's id); the distribution is then the constrained one
    (tests/support/distributions.py)."""
    target = LocalTarget(model, context or ContextParams(n_ctx=256, n_threads=1))
    *head, last = model.tokenize(text, add_special=True)
    target.decode(head)  # then the last token alone, as each trial's verify batch computes it
    logits = target.decode([last])[-1].copy()
    spec = GrammarSpec(grammar.replace("{last}", str(last))) if grammar else None
    if spec is None:
        p = dense_probs(logits, params, [*head, last])
    else:
        with Grammar(model, spec.text) as after_last:
            after_last.accept(last)
            allowed = after_last.allows(np.arange(model.n_vocab))
        p = constrained_probs(logits, params, [*head, last], allowed)
    certain = np.full(model.n_vocab, -100.0, dtype=np.float32)
    certain[last] = 100.0
    out = []
    try:
        for seed in range(trials):
            target.truncate(len(head))
            g = generation(target, head, certain, seed, model, params, grammar=spec)
            strategy.prepare(g)
            rounds = strategy.run(g)
            try:
                assert next_round(g, rounds).tokens == [last]  # undrafted, from the given logits
                rnd = next_round(g, rounds)
                assert rnd.drafted > 0 or strategy.name == "plain"  # the verifier chose this token
                out.append(rnd.tokens[0])
            finally:
                rounds.close()
                if g.sampler.grammar is not None:
                    g.sampler.grammar.close()
    finally:
        target.close()
    return out, p


def chi2_pvalue(tokens: list[int], p: np.ndarray) -> float:
    """Goodness of fit against p, likely tokens as their own bins and the tail lumped. A token
    of probability zero (one the filters removed) fails it outright."""
    counts = np.bincount(tokens, minlength=p.shape[0]).astype(float)
    if counts[p == 0].sum() > 0:
        return 0.0
    n = len(tokens)
    big = np.flatnonzero(p * n >= 5)
    obs = [*counts[big], n - counts[big].sum()]
    exp = [*(p[big] * n), n - (p[big] * n).sum()]
    if exp[-1] < 1e-9:
        obs, exp = obs[:-1], exp[:-1]
    return chisquare_pvalue(obs, exp)


def broken_residual(p: Candidates, q: Candidates | None, x: int) -> Candidates:
    """The classic bug: resample from p itself after a rejection."""
    return p
