"""Cluster token strength (issue 20, finding 4; issue 39, item 10) and the ``--token`` warning.

A typed token is refused below 10^24 guesses (about 80 bits), from every source the head and
workers read it from: zxcvbn's estimate once well-known texts, digests of common passwords
and text outside ASCII count for what they are worth; tokens made by ``potluck token`` always
pass."""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from potluck.discovery.auth import (
    MIN_GUESSES_LOG10,
    SCORED_CHARS,
    TOKEN_ENV,
    check_token,
    generate_token,
    keys_from_token,
    resolve_token,
    save_token,
    token_guesses_log10,
)
from potluck.discovery.passphrases import FOREIGN_WORD_GUESSES_LOG10
from potluck.engine.core.errors import PotluckError

# Accepted by the old rule (per-character entropy x length); each is a few dictionary words,
# repeats and sequences to zxcvbn.
GUESSABLE = ["correct horse battery staple", "Summer2024!Summer2024!Summer2024!", "password1234567890abcdef"]


@pytest.mark.parametrize("weak", GUESSABLE)
def test_guessable_passphrases_are_refused_from_every_source(
    weak: str, tmp_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert token_guesses_log10(weak) < MIN_GUESSES_LOG10
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    file = tmp_home / "weak.token"
    file.write_text(weak + "\n")
    file.chmod(0o600)
    monkeypatch.setenv(TOKEN_ENV, weak)
    attempts = [lambda: resolve_token(weak), lambda: resolve_token(None, file), lambda: resolve_token(None)]
    for attempt in [*attempts, lambda: keys_from_token(weak), lambda: check_token("potluck-" + weak)]:
        with pytest.raises(PotluckError) as err:
            attempt()
        message = str(err.value)
        assert len(message.splitlines()) == 1 and "guessable" in message and "potluck token" in message


# Issue 39: each of these scored 106-209 bits with zxcvbn alone (its dictionaries are English).
WELL_KNOWN = [
    "the quick brown fox jumps over the lazy dog",
    "The Quick Brown Fox Jumps Over The Lazy Dog! 1984",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore",
    "Мама мыла раму. Мама мыла раму. Мама мыла раму.",
    "Съешь же ещё этих мягких французских булок, да выпей же чаю",
    "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer",
    "Portez ce vieux whisky au juge blond qui fume",
]
DIGESTS = [
    hashlib.sha256(b"password").hexdigest(),
    hashlib.sha256(b"dragon").hexdigest().upper(),
    hashlib.md5(b"letmein").hexdigest(),
    hashlib.sha1(b"iloveyou").hexdigest(),
    hashlib.sha512(b"qwerty").hexdigest(),
    base64.b64encode(hashlib.sha256(b"monkey").digest()).decode(),
    hashlib.sha256(b"the quick brown fox jumps over the lazy dog").hexdigest(),
]


@pytest.mark.parametrize("text", WELL_KNOWN + DIGESTS)
def test_well_known_texts_and_digests_of_common_passwords_are_refused(text: str) -> None:
    assert token_guesses_log10(text) < MIN_GUESSES_LOG10
    with pytest.raises(PotluckError, match=r"guessable .*(well-known text|of a common password).*`potluck token`"):
        check_token(text)


def test_text_outside_ascii_is_credited_a_conservative_floor() -> None:
    """zxcvbn has no dictionary of other languages: a word outside ASCII is credited as one
    of 100 common words, however long; the refusal says so and points to `potluck token`."""
    russian = "Вдруг сквозь туман проступили очертания древнего замка на холме"  # 9 words
    assert token_guesses_log10(russian) == pytest.approx(9 * FOREIGN_WORD_GUESSES_LOG10)
    with pytest.raises(PotluckError, match=r"outside ASCII count as common words.*`potluck token`"):
        check_token(russian)
    with pytest.raises(PotluckError, match="outside ASCII"):
        check_token("吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。")
    # what zxcvbn can score keeps its estimate beside the floor
    strong = generate_token().removeprefix("potluck-")
    check_token(russian + " " + strong)


def test_digests_of_random_bytes_and_strong_passphrases_still_pass() -> None:
    check_token(hashlib.sha256(os.urandom(32)).hexdigest())
    check_token("the quick brown fox jumps over the lazy dog " + generate_token().removeprefix("potluck-"))


def test_generated_tokens_always_pass() -> None:
    scores = [token_guesses_log10(generate_token()) for _ in range(100)]
    # 3,000 of them scored 40.1 at the least (report of issue 20): far from the bound.
    assert min(scores) > MIN_GUESSES_LOG10 + 10, min(scores)
    for _ in range(20):
        check_token(generate_token())


def test_only_the_start_of_a_long_token_is_scored() -> None:
    """zxcvbn's time grows with the square of the length; what it does not see cannot make a
    token pass, so a long token whose start is guessable is refused."""
    strong = generate_token().removeprefix("potluck-")
    check_token("x" * 20 + strong)
    with pytest.raises(PotluckError, match="guessable"):
        check_token("x" * SCORED_CHARS + strong)


def test_token_on_the_command_line_is_warned_about(
    tmp_home: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    token = generate_token()
    file = save_token(token, tmp_home / "cluster.token")
    with caplog.at_level(logging.WARNING, logger="potluck.discovery.auth"):
        assert resolve_token(None, file) == token
        monkeypatch.setenv(TOKEN_ENV, token)
        assert resolve_token(None) == token
        assert not caplog.records  # neither a file nor the environment is on the command line
        assert resolve_token(token) == token
    (rec,) = caplog.records
    assert "/proc/PID/cmdline" in rec.getMessage() and "--token-file" in rec.getMessage()


def test_worker_with_a_guessable_token_on_the_command_line(tmp_home: Path) -> None:
    """The real CLI: one warning line for --token, then one refusal line naming `potluck token`."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env["POTLUCK_HOME"] = str(tmp_home)
    out = subprocess.run(
        [sys.executable, "-m", "potluck.app.cli", "worker", "--no-zeroconf", "--port", "0",
         "--token", "correct horse battery staple"],
        capture_output=True, text=True, timeout=120, env=env, stdin=subprocess.DEVNULL,
    )
    lines = out.stderr.splitlines()
    assert out.returncode == 2 and len(lines) == 2, out.stderr
    assert "--token shows the cluster token" in lines[0]
    assert lines[1].startswith("potluck: error: the cluster token is guessable") and "`potluck token`" in lines[1]
