"""Cluster auth: one shared token gates the cluster; CURVE keys are derived from it.

Every member (head and workers) derives the same two key pairs from the token, so nothing
but the token has to be copied between machines. A machine without the token cannot
compute the server's public key (it cannot even start the CURVE handshake) nor the client
secret key (the worker's ZAP handler refuses any other client key).
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

import zmq
import zmq.utils.z85

from ..engine import paths
from ..engine.errors import PotluckError
from ..engine.pipeline.transport import CurveKeys

TOKEN_PREFIX = "potluck-"
TOKEN_ENV = "POTLUCK_TOKEN"


def generate_token() -> str:
    """A fresh random cluster token (256 bits)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def token_file() -> Path:
    return paths.config_dir() / "cluster.token"


def save_token(token: str) -> Path:
    path = token_file()
    path.write_text(token + "\n", encoding="utf-8")
    path.chmod(0o600)
    return path


def resolve_token(arg: str | None) -> str:
    """The token from ``--token``, else ``$POTLUCK_TOKEN``, else the saved file."""
    token = arg or os.environ.get(TOKEN_ENV)
    if not token and token_file().exists():
        token = token_file().read_text(encoding="utf-8").strip()
    if not token:
        raise PotluckError(
            "no cluster token: run `potluck token` once, then pass the same token to every "
            "machine with --token (or $POTLUCK_TOKEN)"
        )
    check_token(token)
    return token


def check_token(token: str) -> None:
    if len(token) < 16:
        raise PotluckError("the cluster token is too short; make one with `potluck token`")


def _secret(token: str, role: str) -> bytes:
    digest = hashlib.sha256(f"potluck-curve-v1/{role}/{token}".encode()).digest()
    return zmq.utils.z85.encode(digest)


def keys_from_token(token: str) -> CurveKeys:
    """Both CURVE key pairs of the cluster, derived deterministically from ``token``."""
    check_token(token)
    server_secret = _secret(token, "server")
    client_secret = _secret(token, "client")
    return CurveKeys(
        server_public=zmq.curve_public(server_secret),
        server_secret=server_secret,
        client_public=zmq.curve_public(client_secret),
        client_secret=client_secret,
    )
