"""Who may talk to the server: API key, Host and Origin checks (safe by default).

- The server binds 127.0.0.1 unless told otherwise; any other address needs an API key, read
  from a 0600 file or ``$POTLUCK_API_KEY`` and compared in constant time.
- A web page the user visits can reach a localhost server through DNS rebinding (its own name
  resolving to 127.0.0.1): such a request carries the page's name in ``Host`` and its origin in
  ``Origin``, so both are checked against loopback names, the bind address and the configured
  extras.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ...engine import PotluckError, paths

KEY_ENV = "POTLUCK_API_KEY"
MIN_KEY_CHARS = 16
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_api_key(path: str | os.PathLike[str] | None) -> str | None:
    """The key from ``path`` (which must be mode 0600 or stricter) or ``$POTLUCK_API_KEY``."""
    if path is not None:
        p = Path(path).expanduser()
        try:
            paths.check_private(p)
            text = p.read_text(encoding="utf-8")
        except PermissionError as e:
            raise PotluckError(f"the API key file: {e}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise PotluckError(f"cannot read the API key file {p} ({getattr(e, 'strerror', None) or e})") from None
        key = text.strip()
        where = str(p)
    else:
        key = os.environ.get(KEY_ENV, "").strip()
        where = f"${KEY_ENV}"
        if not key:
            return None
    if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
        raise PotluckError(f"the API key in {where} must be at least {MIN_KEY_CHARS} characters without spaces")
    return key


@dataclass(frozen=True)
class Guard:
    """The checks every request passes before it reaches a route."""

    bind_host: str
    api_key: str | None
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not is_loopback(self.bind_host) and self.api_key is None:
            raise PotluckError(
                f"binding {self.bind_host} exposes the server beyond this machine: set an API key "
                f"(--api-key-file FILE with mode 0600, or ${KEY_ENV}), or bind 127.0.0.1"
            )

    def authorized(self, authorization: str | None) -> bool:
        if self.api_key is None:
            return True
        scheme, _, given = (authorization or "").partition(" ")
        # compare_digest takes the same time wherever the strings differ
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.api_key.encode())

    def host_allowed(self, host_header: str | None) -> bool:
        if not host_header:
            return False
        host = urlsplit(f"//{host_header}").hostname or ""
        names = {*LOOPBACK_NAMES, self.bind_host.strip("[]"), *self.allowed_hosts}
        if host in names or host.strip("[]") in names:
            return True
        # bound to every interface with a key: any name that reaches it must still show the key
        return self.bind_host in ("0.0.0.0", "::") and self.api_key is not None

    def origin_allowed(self, origin: str | None) -> bool:
        """Requests without Origin come from programs, not pages; a page's must be allowed."""
        if origin is None:
            return True
        if origin in self.allowed_origins:
            return True
        parts = urlsplit(origin)
        return parts.scheme in ("http", "https") and parts.hostname is not None and is_loopback(parts.hostname)
