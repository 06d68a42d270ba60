"""Who may talk to the server: API keys, Host and Origin checks, CORS (safe by default).

- The server binds 127.0.0.1 unless told otherwise; any other address needs an API key, read
  from a 0600 file (one key, or one ``NAME KEY`` a line), ``$POTLUCK_API_KEY`` or ``--api-key``
  (shown in /proc, so it warns), compared in constant time. Keys a guesser could find are
  refused at start (zxcvbn, like the cluster token), and an address that keeps sending wrong
  keys is slowed to a try a second (429 with Retry-After, the key not even compared).
- Each key names whose conversations the prompt cache keeps: a request only ever reuses its
  own key's (one client cannot read another's prompt through ``cached_tokens`` or timing).
  Without keys, or with one key shared by everyone, every client shares one cache.
- A web page the user visits can reach a localhost server through DNS rebinding (its own name
  resolving to 127.0.0.1): such a request carries the page's name in ``Host`` and its origin in
  ``Origin``, so both are checked against loopback names, the bind address and the configured
  extras. Pages from allowed origins get CORS headers (and answered preflights), others 403.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import math
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from zxcvbn import zxcvbn

from ...engine import PotluckError, paths

log = logging.getLogger("potluck.serve")

KEY_ENV = "POTLUCK_API_KEY"
DEFAULT_KEY_NAME = "default"
MIN_KEY_CHARS = 16
# zxcvbn's guesses_log10: repeats, words, dates and keyboard walks score far below this; 16
# random characters above it. With wrong keys slowed to one a second per address, 10^12
# guesses take tens of thousands of years.
MIN_KEY_GUESSES_LOG10 = 12.0
SCORED_KEY_CHARS = 64
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_key(key: str, where: str) -> str:
    if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
        raise PotluckError(f"the API key in {where} must be at least {MIN_KEY_CHARS} characters without spaces")
    guesses = float(zxcvbn(key[:SCORED_KEY_CHARS], max_length=SCORED_KEY_CHARS)["guesses_log10"])
    if guesses < MIN_KEY_GUESSES_LOG10:
        raise PotluckError(
            f"the API key in {where} is guessable (about {guesses * math.log2(10):.0f} bits, "
            f"{MIN_KEY_GUESSES_LOG10 * math.log2(10):.0f} needed); make one with "
            "python3 -c 'import secrets; print(secrets.token_urlsafe(24))'"
        )
    return key


def parse_key_lines(text: str, where: str) -> dict[str, str]:
    """One key alone (named ``default``), or one ``NAME KEY`` a line; # starts a comment."""
    lines = [line.split() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if len(lines) == 1 and len(lines[0]) == 1:
        return {DEFAULT_KEY_NAME: check_key(lines[0][0], where)}
    keys: dict[str, str] = {}
    for n, fields in enumerate(lines, 1):
        if len(fields) != 2:
            raise PotluckError(f"{where}: line {n} must be NAME KEY (one named key a line)")
        name, key = fields
        if name in keys:
            raise PotluckError(f"{where}: the name {name!r} is given twice")
        if key in keys.values():
            raise PotluckError(f"{where}: {name} has the same key as another name; give each its own")
        keys[name] = check_key(key, f"{where} ({name})")
    if not keys:
        raise PotluckError(f"{where} holds no key")
    return keys


def read_api_keys(path: str | os.PathLike[str] | None, given: str | None = None) -> dict[str, str]:
    """Key name -> key, from ``--api-key`` (``given``), the file at ``path`` (mode 0600 or
    stricter) or ``$POTLUCK_API_KEY``; empty: no key."""
    if given is not None and path is not None:
        raise PotluckError("pass either --api-key or --api-key-file, not both")
    if given is not None:
        key = check_key(given.strip(), "--api-key")
        log.warning("--api-key shows the key to every user of this machine (ps, /proc/PID/cmdline); "
                    f"pass it in ${KEY_ENV} or a file given with --api-key-file (chmod 600)")
        return {DEFAULT_KEY_NAME: key}
    if path is not None:
        p = Path(path).expanduser()
        try:
            paths.check_private(p)
            text = p.read_text(encoding="utf-8")
        except PermissionError as e:
            raise PotluckError(f"the API key file: {e}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise PotluckError(f"cannot read the API key file {p} ({getattr(e, 'strerror', None) or e})") from None
        return parse_key_lines(text, str(p))
    key = os.environ.get(KEY_ENV, "").strip()
    return {DEFAULT_KEY_NAME: check_key(key, f"${KEY_ENV}")} if key else {}


@dataclass
class WrongKeyThrottle:
    """Wrong keys from one address: a burst, then one try a second (a token bucket per address,
    the oldest addresses forgotten past ``max_addresses``)."""

    burst: float = 10.0
    per_s: float = 1.0
    max_addresses: int = 4096
    _buckets: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict)

    def wait_s(self, address: str, now: float | None = None) -> float:
        """Seconds until ``address`` may try a key again (0: now)."""
        tokens, _ = self._level(address, time.monotonic() if now is None else now)
        return 0.0 if tokens >= 1 else (1 - tokens) / self.per_s

    def failed(self, address: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        tokens, _ = self._level(address, now)
        self._buckets[address] = (tokens - 1, now)
        self._buckets.move_to_end(address)
        while len(self._buckets) > self.max_addresses:
            self._buckets.popitem(last=False)

    def _level(self, address: str, now: float) -> tuple[float, float]:
        tokens, at = self._buckets.get(address, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.per_s), now


@dataclass(frozen=True)
class Guard:
    """The checks every request passes before it reaches a route."""

    bind_host: str
    api_keys: dict[str, str] = field(default_factory=dict)  # name -> key; empty: no key
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    throttle: WrongKeyThrottle = field(default_factory=WrongKeyThrottle)

    def __post_init__(self) -> None:
        if not is_loopback(self.bind_host) and not self.api_keys:
            raise PotluckError(
                f"binding {self.bind_host} exposes the server beyond this machine: set an API key "
                f"(--api-key-file FILE with mode 0600, or ${KEY_ENV}), or bind 127.0.0.1"
            )

    def key_name(self, authorization: str | None) -> str | None:
        """The name of the key ``authorization`` carries ("" without keys); None: no valid key."""
        if not self.api_keys:
            return ""
        scheme, _, given = (authorization or "").partition(" ")
        given_bytes = given.strip().encode()
        found = None
        for name, key in self.api_keys.items():  # every key compared: the time says nothing
            if hmac.compare_digest(given_bytes, key.encode()) and scheme.lower() == "bearer":
                found = name
        return found

    def host_allowed(self, host_header: str | None) -> bool:
        if not host_header:
            return False
        host = urlsplit(f"//{host_header}").hostname or ""
        names = {*LOOPBACK_NAMES, self.bind_host.strip("[]"), *self.allowed_hosts}
        if host in names or host.strip("[]") in names:
            return True
        # bound to every interface with a key: any name that reaches it must still show the key
        return self.bind_host in ("0.0.0.0", "::") and bool(self.api_keys)

    def origin_allowed(self, origin: str | None) -> bool:
        """Requests without Origin come from programs, not pages; a page's must be allowed."""
        if origin is None:
            return True
        if origin in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.hostname is not None and is_loopback(parts.hostname)
