"""Cluster auth: one shared token gates the cluster; CURVE keys are derived from it.

Every member (head and workers) derives the same two key pairs from the token, so nothing
but the token has to be copied between machines. A machine without the token cannot
compute the server's public key (it cannot even start the CURVE handshake) nor the client
secret key (the worker's ZAP handler refuses any other client key).

Key derivation is scrypt (N=2^15, r=8: about 32 MiB and a tenth of a second per guess), so
someone who sniffed a handshake and tests guesses offline pays that per guess. The salt is
fixed ("potluck-curve-v2"): head and workers must reach the same keys from the token alone,
so a per-cluster random salt would have to travel with the token anyway; the fixed,
product-specific salt still rules out tables computed for other uses of scrypt. What makes
guessing hopeless is the token itself: ``potluck token`` makes 256 random bits, and a token
a person types is refused unless it is worth at least 10^24 guesses, about 80 bits
(:func:`check_token`): zxcvbn's estimate (dictionary words, repeats, sequences, keyboard walks,
dates) of what is left once well-known texts, digests of common passwords and text outside
ASCII are credited for what they are worth (:mod:`.passphrases`).

The token never goes on a command line (``ps`` and ``/proc/PID/cmdline`` show those):
``$POTLUCK_TOKEN``, a token file (``--token-file``) or the saved one (``potluck token``),
created 0600 in a 0700 folder; a token file others can read is refused. ``--token`` still
works for old scripts, with a warning each time.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import secrets
from pathlib import Path

import zmq
import zmq.utils.z85

from ..engine.core import paths
from ..engine.core.errors import PotluckError
from ..engine.core.spec import CurveKeys
from .passphrases import Estimate, estimate

log = logging.getLogger(__name__)

TOKEN_PREFIX = "potluck-"
TOKEN_ENV = "POTLUCK_TOKEN"
KDF_SALT = b"potluck-curve-v2"
KDF_N, KDF_R, KDF_P = 1 << 15, 8, 1
# zxcvbn's guesses_log10, not its score: the score tops out at 10^10 guesses (about 33 bits).
MIN_GUESSES_LOG10 = 24.0  # about 80 bits
# zxcvbn's time grows with the square of the length (65 ms at 100 characters, 250 ms at 200).
# Guessing a token means guessing its start too, so the start's estimate is a lower bound.
SCORED_CHARS = 100


def generate_token() -> str:
    """A fresh random cluster token (256 bits)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_file() -> Path:
    return paths.config_dir() / "cluster.token"


def save_token(token: str, path: Path | None = None) -> Path:
    """Write the token readable by its owner only (0600 from creation, in a 0700 folder)."""
    path = path or token_file()
    paths.private_dir(path.parent)
    paths.write_private(path, (token + "\n").encode("utf-8"))
    return path


def read_token_file(path: Path) -> str:
    """The token in ``path``, refused if other users can read or change the file."""
    try:
        paths.check_private(path)
        token = path.read_text(encoding="utf-8").strip()
    except PermissionError as e:
        raise PotluckError(f"token file refused: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PotluckError(f"cannot read the token file {path}: {e}") from None
    if not token:
        raise PotluckError(f"the token file {path} is empty; make a token with `potluck token`")
    return token


def resolve_token(arg: str | None = None, file: Path | None = None) -> str:
    """The token from ``--token`` (discouraged), ``--token-file``, ``$POTLUCK_TOKEN`` or the saved file."""
    if arg:
        log.warning(
            "--token shows the cluster token to every user of this machine (ps, /proc/PID/cmdline); "
            "pass it in $POTLUCK_TOKEN or a file given with --token-file (chmod 600)"
        )
    token = arg or (read_token_file(Path(file)) if file is not None else None) or os.environ.get(TOKEN_ENV)
    if not token and token_file().exists():
        token = read_token_file(token_file())
    if not token:
        raise PotluckError(
            "no cluster token: run `potluck token` once, then give every machine the same token "
            "in $POTLUCK_TOKEN or a file passed with --token-file (chmod 600)"
        )
    check_token(token)
    return token


def token_estimate(token: str) -> Estimate:
    """The guesses an attacker needs for ``token`` (:mod:`.passphrases`: zxcvbn, less what it
    cannot see); the public ``potluck-`` prefix counts for nothing, and only the first
    :data:`SCORED_CHARS` are scored."""
    return estimate(token.removeprefix(TOKEN_PREFIX), SCORED_CHARS)


def token_guesses_log10(token: str) -> float:
    """log10 of :func:`token_estimate`'s guesses."""
    return token_estimate(token).guesses_log10


def check_token(token: str) -> None:
    """Refuse a token an attacker could guess: below 10^24 guesses (about 80 bits)."""
    found = token_estimate(token)
    if found.guesses_log10 < MIN_GUESSES_LOG10:
        why = f": {found.why}" if found.why else ""
        raise PotluckError(
            f"the cluster token is guessable (about {found.guesses_log10 * math.log2(10):.0f} bits, at least 80 "
            f"needed{why}); make one with `potluck token` and give it to every machine of the cluster"
        )


@functools.lru_cache(maxsize=8)
def keys_from_token(token: str) -> CurveKeys:
    """Both CURVE key pairs of the cluster, derived deterministically from ``token``."""
    check_token(token)
    material = hashlib.scrypt(
        token.encode("utf-8"), salt=KDF_SALT, n=KDF_N, r=KDF_R, p=KDF_P, maxmem=64 << 20, dklen=64
    )
    server_secret = zmq.utils.z85.encode(material[:32])
    client_secret = zmq.utils.z85.encode(material[32:])
    return CurveKeys(
        server_public=zmq.curve_public(server_secret),
        server_secret=server_secret,
        client_public=zmq.curve_public(client_secret),
        client_secret=client_secret,
    )
