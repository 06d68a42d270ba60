"""A cached slice's integrity proof: verified by sha256 once, on receipt, then sealed by the
file's identity so that each later load costs one ``stat``, not a full re-hash (a 2 GB slice
re-hashed before every load costs seconds on the worker).

The seal (``<sha256>.seal`` beside the slice) records the device, inode, size, mtime and
ctime the file had when its sha256 was last verified. Any change made through the file
system after that moves at least one of them: a write in place moves mtime *and* ctime, and
restoring mtime with ``utime`` moves ctime again (the kernel sets ctime; no call sets it
back), truncation moves the size, a replaced file has another inode. So a matching seal
proves the bytes are the ones verified, against other programs, other users with write
access, our own interrupted writes and restored backups. It does not protect against
changes below the file system (a failing disk's bit rot, writes to the raw block device)
or a root user who moves the system clock back around a write: file-system checksums
(btrfs, ZFS scrubs) cover those. A broken seal is not an error by itself: the slice is
re-hashed, and resealed if it still matches its sha256.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ..core.errors import PotluckError

log = logging.getLogger(__name__)

HASH_BLOCK = 4 << 20


class SliceCorrupted(PotluckError):
    """A cached slice no longer matches the sha256 it is stored under."""


@dataclass(frozen=True)
class Seal:
    sha256: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path, sha256: str) -> Seal:
        st = os.stat(path)
        return cls(sha256, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def seal_path(path: Path) -> Path:
    return path.with_suffix(".seal")


def hash_into(h, path: Path) -> int:  # noqa: ANN001 - hashlib's hash type is private
    """Feed ``path``'s bytes to the hash ``h``, a block at a time; returns how many."""
    n = 0
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            h.update(block)
            n += len(block)
    return n


def seal(path: Path, sha256: str) -> None:
    """Record ``path``'s identity now that its bytes are known to hash to ``sha256``."""
    tmp = seal_path(path).with_suffix(".seal-tmp")
    tmp.write_text(json.dumps(asdict(Seal.of(path, sha256))), encoding="ascii")
    tmp.replace(seal_path(path))


def unseal(path: Path) -> None:
    seal_path(path).unlink(missing_ok=True)


def sealed(path: Path, sha256: str) -> bool:
    """Whether ``path`` still has the identity recorded when it was verified (one stat)."""
    try:
        recorded = Seal(**json.loads(seal_path(path).read_text(encoding="ascii")))
        return recorded == Seal.of(path, sha256)
    except (OSError, ValueError, TypeError):
        return False


def check_slice(path: Path, sha256: str) -> bool:
    """Prove ``path`` holds ``sha256``'s bytes: by its seal, else by a full re-hash (then
    resealed). Returns whether it had to re-hash; raises :class:`SliceCorrupted` if the bytes
    differ (the caller drops the file)."""
    if sealed(path, sha256):
        return False
    log.info("slice %s: its seal does not match the file (changed since it was verified); re-hashing",
             sha256[:12])
    h = hashlib.sha256()
    hash_into(h, path)
    if h.hexdigest() != sha256:
        unseal(path)
        raise SliceCorrupted(f"cached slice {sha256[:12]} does not match its sha256 (corrupted on disk)")
    seal(path, sha256)
    return True
