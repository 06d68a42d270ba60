"""Plain decoding: one target decode per token. The reference every other strategy must
match token for token."""

from __future__ import annotations

from collections.abc import Iterator

from .strategy import Generation, Round, Strategy


class Plain(Strategy):
    name = "plain"
    needs_exact_batches = False
    shares_batches = True
    description = "plain decoding, one token per target step"

    def run(self, g: Generation) -> Iterator[Round]:
        logits = g.first_logits
        while True:
            token = g.sampler.sample(logits, g.history)
            yield Round(tokens=[token], rows=[logits])
            if g.done or g.remaining <= 0:
                return
            logits = g.target.decode([token])[0]
