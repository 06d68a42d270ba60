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
a person types is refused unless it is long and varied enough (:func:`check_token`).

The token never goes on a command line (``ps`` shows those): ``$POTLUCK_TOKEN``, a token
file (``--token-file``) or the saved one (``potluck token``), created 0600 in a 0700
folder; a token file others can read is refused.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import secrets
from collections import Counter
from pathlib import Path

import zmq
import zmq.utils.z85

from ..engine.core import paths
from ..engine.core.errors import PotluckError
from ..engine.core.spec import CurveKeys

TOKEN_PREFIX = "potluck-"
TOKEN_ENV = "POTLUCK_TOKEN"
KDF_SALT = b"potluck-curve-v2"
KDF_N, KDF_R, KDF_P = 1 << 15, 8, 1
MIN_TOKEN_CHARS = 20
MIN_TOKEN_BITS = 96.0


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


def token_bits(token: str) -> float:
    """A conservative estimate of the token's randomness: its length times the Shannon
    entropy of its characters (the fixed ``potluck-`` prefix counts for nothing)."""
    body = token.removeprefix(TOKEN_PREFIX)
    if not body:
        return 0.0
    counts = Counter(body)
    n = len(body)
    per_char = -sum(c / n * math.log2(c / n) for c in counts.values())
    return per_char * n


def check_token(token: str) -> None:
    if len(token) < MIN_TOKEN_CHARS:
        raise PotluckError(
            f"the cluster token is too short ({len(token)} characters, at least {MIN_TOKEN_CHARS}); "
            "make one with `potluck token`"
        )
    if token_bits(token) < MIN_TOKEN_BITS:
        raise PotluckError(
            f"the cluster token is too predictable (about {token_bits(token):.0f} bits, at least "
            f"{MIN_TOKEN_BITS:.0f}); make a random one with `potluck token`"
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
