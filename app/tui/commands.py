"""What the app can do, said once: the help screen's key list and the command palette's
commands both come from :data:`ACTIONS` (the keys from the user's [keys])."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial

from textual.command import DiscoveryHit, Hit, Hits, Provider

from ..config import KeySettings

# action -> (the palette's title, what it does). Order: the help screen's.
ACTIONS: dict[str, tuple[str, str]] = {
    "stop": ("Stop the reply", "stop the reply (its text is kept); otherwise back to the input"),
    "new_conversation": ("New conversation", "start an empty conversation"),
    "regenerate": ("Regenerate", "answer the last prompt again; earlier answers are kept"),
    "previous_answer": ("Earlier answer", "show the last reply's earlier version (on a message: its own)"),
    "next_answer": ("Later answer", "show the last reply's later version"),
    "edit_prompt": ("Edit the last prompt", "put it back in the input: sending resends from there"),
    "search": ("Search", "search every conversation"),
    "settings": ("Settings", "this chat's sampling, reply length, seed, strategy; the context size"),
    "picker": ("Model", "pick the model, a draft and the strategy (or open a GGUF by path)"),
    "cluster": ("Cluster", "split the model over workers found on the LAN"),
    "replan": ("Re-plan the cluster", "reopen the cluster over the workers found now"),
    "system_prompt": ("System prompt", "edit this conversation's system prompt"),
    "rename_conversation": ("Rename", "rename this conversation"),
    "delete_conversation": ("Delete", "delete this conversation"),
    "previous_conversation": ("Previous conversation", "open the conversation above"),
    "next_conversation": ("Next conversation", "open the conversation below"),
    "copy_reply": ("Copy the reply", "copy the last reply"),
    "copy_code": ("Copy the code block", "copy the last reply's last code block"),
    "export": ("Export", "write this conversation as Markdown"),
    "toggle_panels": ("Panels", "show or hide the side panels"),
    "log": ("Log", "warnings and errors of this run"),
    "help": ("Help", "this list of keys"),
    "quit": ("Quit", "quit potluck (the history is saved as you go)"),
}

# Keys that belong to a widget, not to the app.
INPUT_KEYS = [
    ("enter", "send"),
    ("ctrl+j (shift+enter)", "new line"),
    ("up", "in an empty input: the last prompts, one by one"),
    ("tab / shift+tab", "move between the input, the messages and the lists"),
]
MESSAGE_KEYS = [
    ("y", "copy the focused message"),
    ("b", "copy its code blocks, one by one"),
    ("e", "edit your message and resend from there"),
    ("left / right", "the message's other versions"),
]


def help_sections(keys: KeySettings) -> list[tuple[str, list[tuple[str, str]]]]:
    app_rows = [(getattr(keys, action).replace(",", ", "), what) for action, (_, what) in ACTIONS.items()]
    return [("Everywhere", app_rows), ("In the input", INPUT_KEYS), ("On a focused message", MESSAGE_KEYS)]


class AppCommands(Provider):
    """The command palette (ctrl+p): the app's own commands, each with its key."""

    def _commands(self) -> Iterable[tuple[str, str, str]]:
        keys = self.app.settings.keys  # type: ignore[attr-defined]
        for action, (title, what) in ACTIONS.items():
            yield title, f"{what} ({getattr(keys, action).split(',')[0]})", action

    async def discover(self) -> Hits:
        for title, what, action in self._commands():
            yield DiscoveryHit(title, partial(self.app.run_action, action), help=what)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, what, action in self._commands():
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), partial(self.app.run_action, action), help=what)
