"""The worker's slice cache: files by sha256 under a byte quota (:class:`SliceStore`) and the
uploads being received into it (:class:`SliceUploads`).

An upload is offered (``offer``: size and sha256), then sent in order (``chunk``), hashed as
it arrives and committed only when the hash matches; then it is sealed (slice_seal.py), so a
later load proves its bytes with one ``stat`` instead of a full re-hash. An upload cut off
(the head went away, a new head joined) keeps its ``.part`` file: the next offer of that
sha256 re-hashes what is there and the head resumes from its end. At most
:data:`MAX_UPLOADS` are open or kept at once; a newer offer drops the oldest, so an offer
flood holds no more disk than that.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..core import paths
from ..core.errors import PotluckError
from . import wire
from .slice_seal import SliceCorrupted, check_slice, hash_into, seal, seal_path, unseal
from .transfer import LocalModels

log = logging.getLogger(__name__)

DISK_MARGIN_BYTES = 256 << 20  # never fill the disk to the last byte
MAX_UPLOADS = 2  # slices being received at once; a newer offer drops the oldest


@dataclass
class Upload:
    total: int
    received: int
    part: Path
    fd: int
    hasher: hashlib._Hash

    def close(self) -> None:
        """Stop receiving; keep what arrived (if anything did) for a later offer to resume."""
        try:
            os.close(self.fd)
        except OSError:
            pass
        if self.received == 0:
            self.part.unlink(missing_ok=True)

    def discard(self) -> None:
        self.close()
        self.part.unlink(missing_ok=True)


class SliceStore:
    """The worker's slices by sha256 under a byte quota, least recently used evicted first.

    ``.part`` files left by an earlier run are kept for resuming (beyond :data:`MAX_UPLOADS`,
    the oldest go); a finished upload is fsynced before it is renamed into place and sealed;
    files are private to the user (0600 in a 0700 folder). Nothing is trusted because it is
    here: :meth:`has` proves a slice by its seal, or re-hashes it, before every use.
    """

    def __init__(self, folder: Path, quota_bytes: int) -> None:
        self.folder = paths.private_dir(Path(folder))
        self.quota = quota_bytes
        self.trim_parts(MAX_UPLOADS)

    def path(self, sha: str) -> Path:
        return self.folder / f"{sha}.gguf"

    def trim_parts(self, keep: int, spare: str = "") -> None:
        """Keep the ``keep`` newest partial uploads (and ``spare``'s), remove the rest."""
        parts = sorted(self.folder.glob("*.part"), key=lambda p: p.stat().st_mtime, reverse=True)
        for stale in [p for p in parts if p.stem != spare][keep:]:
            stale.unlink(missing_ok=True)
            log.info("removed a partial upload: %s", stale.name)

    def has(self, sha: str) -> bool:
        """Whether the slice is here and proven intact (its seal, else a full re-hash); a
        slice whose bytes no longer match is removed, so the head sends it again."""
        path = self.path(sha)
        if not path.is_file():
            return False
        try:
            check_slice(path, sha)
        except SliceCorrupted as e:
            log.warning("%s; removed, it will be received again", e)
            path.unlink(missing_ok=True)
            return False
        except OSError as e:
            log.warning("slice %s cannot be read (%s)", sha[:12], e)
            return False
        return True

    def touch(self, sha: str) -> None:
        """Mark the slice used now (least recently used slices go first). The mark is on its
        seal, never on the slice: a time set on the slice moves its ctime, which breaks the
        seal, and the next load would re-hash the whole slice. An unsealed slice (it is
        re-hashed before use anyway) is marked itself."""
        for path in (seal_path(self.path(sha)), self.path(sha)):
            try:
                os.utime(path)
                return
            except OSError:
                continue

    def _last_used(self, path: Path) -> float:
        """When the slice was last used: its seal's time (see :meth:`touch`), else its own."""
        times = [path.stat().st_mtime]
        try:
            times.append(seal_path(path).stat().st_mtime)
        except OSError:
            pass
        return max(times)

    def used(self) -> int:
        return sum(p.stat().st_size for p in self.folder.glob("*.gguf"))

    def make_room(self, size: int, reserved: int, keep: set[str]) -> None:
        """Evict least recently used slices (never ``keep``) until ``size`` more bytes fit
        the quota and the disk; refuse if they cannot."""
        if size + reserved > self.quota:
            raise PotluckError(
                f"a slice of {size >> 20} MB does not fit this worker's slice cache quota of "
                f"{self.quota >> 20} MB (start it with a larger --cache-quota-mb)"
            )
        files = sorted(self.folder.glob("*.gguf"), key=self._last_used)
        used = sum(p.stat().st_size for p in files)
        for victim in files:
            free = shutil.disk_usage(self.folder).free - DISK_MARGIN_BYTES - reserved
            if used + reserved + size <= self.quota and size <= free:
                return
            if victim.stem in keep:
                continue
            used -= victim.stat().st_size
            victim.unlink(missing_ok=True)
            unseal(victim)
            log.info("evicted slice %s from the cache (quota %d MB)", victim.stem[:12], self.quota >> 20)
        free = shutil.disk_usage(self.folder).free - DISK_MARGIN_BYTES - reserved
        if used + reserved + size > self.quota or size > free:
            raise PotluckError(
                f"a slice of {size >> 20} MB does not fit: {max(free, 0) >> 20} MB free on disk, "
                f"{used >> 20} of {self.quota >> 20} MB of the cache quota in use"
            )

    def begin(self, sha: str, size: int) -> Upload:
        """Open the upload of ``sha``, continuing a ``.part`` kept from an earlier attempt
        (its bytes re-hashed from disk: a hash state cannot be saved)."""
        part = self.folder / f"{sha}.part"
        hasher = hashlib.sha256()
        received = 0
        if part.is_file() and 0 < part.stat().st_size < size:
            received = hash_into(hasher, part)
            log.info("resuming slice %s at %d of %d bytes", sha[:12], received, size)
        else:
            part.unlink(missing_ok=True)
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        return Upload(size, received, part, fd, hasher)

    def cut_locally(self, models: LocalModels, msg: wire.Offer, keep: set[str]) -> bool:
        """Write the offered slice from a model this worker holds (``--models``), hashed as it
        is written and kept only if it matches the offer's sha256 (a head whose slicing
        differs from ours sends it as usual)."""
        layout = models.layout(msg.source_sha256, msg.layer_lo, msg.layer_hi) if msg.source_sha256 else None
        if layout is None or layout.size != msg.size:
            return False
        self.make_room(msg.size, 0, keep)
        part = self.folder / f"{msg.sha256}.local"
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        up = Upload(msg.size, 0, part, fd, hashlib.sha256())
        for block in layout.iter_bytes():
            view = memoryview(block)
            while view:
                view = view[os.write(fd, view):]
            up.hasher.update(block)
            up.received += len(block)
        if up.hasher.hexdigest() != msg.sha256:
            log.warning("slice %s cut from the local %s differs from the head's; receiving it",
                        msg.sha256[:12], layout.src.name)
            up.discard()
            return False
        self.commit(up, msg.sha256)
        log.info("cut slice %s (layers %d-%d) from the local %s: nothing to receive", msg.sha256[:12],
                 msg.layer_lo, msg.layer_hi, layout.src.name)
        return True

    def commit(self, up: Upload, sha: str) -> None:
        """fsync the finished upload, rename it into place, fsync the folder."""
        os.fsync(up.fd)
        os.close(up.fd)
        up.part.replace(self.path(sha))
        seal(self.path(sha), sha)  # verified just now: later loads check the seal, not the bytes
        try:
            dfd = os.open(self.folder, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(dfd)
        except OSError:
            pass
        finally:
            os.close(dfd)


class SliceUploads:
    """The uploads in progress into one :class:`SliceStore`, oldest first."""

    def __init__(self, store: SliceStore, models: LocalModels | None = None) -> None:
        self.store = store
        self.models = models  # models this worker holds whole (--models): slices are cut here
        self.open: dict[str, Upload] = {}

    def drop(self) -> None:
        """Stop every upload in progress (a new head, a release), keeping what arrived."""
        for up in self.open.values():
            up.close()
        self.open.clear()

    def offer(self, msg: wire.Offer, keep: set[str]) -> wire.OfferReply:
        """Whether the slice is here already; if not, make room (never evicting ``keep``)
        and open its upload, saying how many of its bytes are here from an earlier attempt."""
        if self.store.has(msg.sha256):
            self.store.touch(msg.sha256)
            return wire.OfferReply(msg.sha256, True, 0)
        if self.models is not None and self.store.cut_locally(self.models, msg, keep):
            return wire.OfferReply(msg.sha256, True, 0)
        old = self.open.pop(msg.sha256, None)
        if old is not None:
            old.close()
        while len(self.open) >= MAX_UPLOADS:  # a newer offer wins over the oldest one
            self.open.pop(next(iter(self.open))).discard()
        self.store.trim_parts(MAX_UPLOADS - 1, spare=msg.sha256)
        reserved = sum(u.total - u.received for u in self.open.values())
        self.store.make_room(msg.size, reserved, keep)
        up = self.store.begin(msg.sha256, msg.size)
        self.open[msg.sha256] = up
        return wire.OfferReply(msg.sha256, False, up.received)

    def chunk(self, msg: wire.Chunk) -> wire.ChunkAck:
        """Write the next part of an offered slice; commit it once whole and verified."""
        up = self.open.get(msg.sha256)
        if up is None:
            raise PotluckError("chunk for a file that was not offered")
        if msg.total != up.total or msg.offset != up.received:
            raise PotluckError(f"chunk at {msg.offset} but {up.received} bytes received so far")
        data = msg.data.tobytes()
        view = memoryview(data)
        while view:
            view = view[os.write(up.fd, view):]
        up.hasher.update(data)
        up.received += len(data)
        done = up.received == up.total
        if done:
            del self.open[msg.sha256]
            if up.hasher.hexdigest() != msg.sha256:
                up.discard()
                raise PotluckError("received slice does not match its sha256; discarded")
            self.store.commit(up, msg.sha256)
            log.info("received slice %s (%d bytes)", msg.sha256[:12], up.total)
        return wire.ChunkAck(msg.sha256, up.received, done)
