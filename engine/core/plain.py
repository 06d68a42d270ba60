"""Plain decoding: one target decode per token. The reference every other strategy must
match token for token."""

from __future__ import annotations

from collections.abc import Iterator

from .errors import PotluckError
from .jobs import GroupCancelled, Ticket
from .strategy import Generation, Round, Strategy


class Plain(Strategy):
    name = "plain"
    needs_exact_batches = False
    shares_batches = True
    description = "plain decoding, one token per target step"

    def __init__(self) -> None:
        self.sent_ahead = 0  # steps sent before their round was handed on
        self.dropped = 0  # of those, steps the reply's end left unread (tests)

    def run(self, g: Generation) -> Iterator[Round]:
        """Each token's step is sent before its round is handed on, so the reply's own work
        (the session, the events, serve's stream) overlaps the target's compute instead of
        sitting between two steps (docs/facts.md §34). A reply that ends where nothing could
        foresee it (a stop string, a cancel) drops that one step again."""
        target = g.target
        logits = g.first_logits
        ticket: Ticket | None = None
        try:
            while True:
                token = g.sampler.sample(logits, g.history)
                # Ahead only where the session will surely ask for the step: not after an end
                # of generation or the reply's last token, and not into the context's last cell
                # (the session reads the room from n_past, which the step in flight counts).
                if not g.is_eog(token) and g.remaining >= 2:
                    ticket = target.append([token], target.new_group())
                    self.sent_ahead += 1
                yield Round(tokens=[token], rows=[logits])
                if g.done or g.remaining <= 0:
                    return
                if ticket is None:
                    logits = target.decode([token])[0]
                else:
                    sent, ticket = ticket, None
                    try:
                        logits = target.wait(sent)[0]
                    except BaseException:
                        self._drop(g, sent, waited=True)
                        raise
        finally:
            if ticket is not None:
                self._drop(g, ticket, waited=False)

    def _drop(self, g: Generation, ticket: Ticket, *, waited: bool) -> None:
        """Forget a step sent ahead: cancel it, redeem its ticket, trim its cell."""
        self.dropped += 1
        target = g.target
        try:
            target.cancel(ticket.group)
            if not waited:
                try:
                    target.wait(ticket)
                except GroupCancelled:
                    pass
            target.truncate(target.n_past - 1)
        except PotluckError:  # best effort: on a target that just broke, its own error is what matters
            pass
