"""Slice distribution: the head streams each slice to its worker in chunks, straight from the
source GGUF (a header built here, then tensor byte ranges: gguf_tools.SliceLayout), unless
the worker already holds that sha256. Neither side holds a whole slice in memory, and the
head never writes a copy of the workers' layers to its disk: only the layers it computes
itself become a file (llama.cpp maps a file), on first use.

The head's index lives in :func:`potluck.engine.core.paths.slices_dir`: it remembers the
sha256 of each source (by path, size and mtime) and of each slice (by source sha256 and
layer range), so a second run hashes nothing it hashed before. The worker verifies the
sha256 of what it received before keeping it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core import paths
from ..core.errors import PotluckError
from ..core.gguf_tools import SliceLayout, file_sha256, layer_layout
from . import wire

CHUNK_BYTES = 4 << 20
INDEX_NAME = "index.json"

Progress = Callable[[str, int, int], None]  # (what, and at what rate; bytes done, bytes total)


@dataclass(frozen=True)
class SliceFile:
    """Layers ``[lo, hi)`` of a source GGUF, streamed from it (:attr:`layout`)."""

    layout: SliceLayout
    sha256: str
    size: int
    lo: int
    hi: int
    folder: Path
    source_sha256: str = ""  # the whole model's: a worker holding it cuts the slice itself

    @property
    def path(self) -> Path:
        """The slice as a file here, written on first use: only for what this machine loads
        itself (the head's output layer, a fallback stage)."""
        path = self.folder / f"{self.sha256[:24]}-{self.lo}-{self.hi}.gguf"
        if not path.is_file() or path.stat().st_size != self.size:
            self.layout.write_to(path)
        return path


@dataclass
class TransferStats:
    bytes_sent: int = 0
    seconds: float = 0.0
    files_sent: int = 0
    files_cached: int = 0
    resumed_bytes: int = 0  # bytes an earlier, interrupted transfer had delivered already

    @property
    def mb_per_s(self) -> float:
        return self.bytes_sent / self.seconds / 1e6 if self.seconds > 0 else 0.0


class SliceCache:
    """The head's slices by (source sha256, layer range), with an index of known hashes."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = Path(folder) if folder is not None else paths.slices_dir()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._index_path = self.folder / INDEX_NAME
        try:
            self._index: dict[str, str] = json.loads(self._index_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            self._index = {}

    def _save(self) -> None:
        tmp = self._index_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self._index, indent=0), encoding="utf-8")
        tmp.replace(self._index_path)

    def sha256_of(self, path: Path) -> str:
        """sha256 of ``path``, remembered by (path, size, mtime) so big models hash once."""
        st = path.stat()
        key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        sha = self._index.get(key)
        if sha is None:
            sha = file_sha256(path)
            self._index[key] = sha
            self._save()
        return sha

    def known_ranges(self, src: Path) -> frozenset[tuple[int, int]]:
        """The layer ranges of ``src`` this cache has sliced (the planner prefers them)."""
        prefix = f"slice|{self.sha256_of(Path(src))}|"
        ranges = (key[len(prefix):].split("|")[0].split("-") for key in self._index if key.startswith(prefix))
        return frozenset((int(lo), int(hi)) for lo, hi in ranges)

    def slices(self, src: Path, bounds: list[int]) -> list[SliceFile]:
        """The slices for consecutive ranges of ``bounds`` (hashed once, then remembered)."""
        src = Path(src)
        src_sha = self.sha256_of(src)
        out: list[SliceFile] = []
        for lo, hi in zip(bounds, bounds[1:]):
            out.append(self._file("slice", src_sha, layer_layout(src, range(lo, hi), stage=True), lo, hi))
        return out

    def head_slice(self, src: Path, zeroed: tuple[int, int]) -> SliceFile:
        """The head's slice: the output layer behind layers ``zeroed`` as zeros."""
        src = Path(src)
        lo, hi = zeroed
        return self._file("head", self.sha256_of(src), layer_layout(src, range(lo, hi), head=True), lo, hi)

    def _file(self, kind: str, src_sha: str, layout: SliceLayout, lo: int, hi: int) -> SliceFile:
        key = f"{kind}|{src_sha}|{lo}-{hi}|{layout.recipe}"  # a new layout of the range is hashed anew
        sha = self._index.get(key)
        if sha is None:
            sha = layout.sha256()  # reads the source's ranges once, a chunk at a time
            self._index[key] = sha
            self._save()
        return SliceFile(layout, sha, layout.size, lo, hi, self.folder, src_sha)


class LocalModels:
    """The GGUF files a worker already holds (``potluck worker --models DIR``), by sha256:
    hashed once (the index remembers each file by path, size and mtime), so a head's offer
    naming one of them is answered by cutting the slice here instead of receiving it."""

    def __init__(self, folder: Path, index_dir: Path) -> None:
        hashes = SliceCache(index_dir)
        self.folder = Path(folder)
        self.by_sha = {hashes.sha256_of(p): p for p in sorted(self.folder.glob("*.gguf")) if p.is_file()}

    def layout(self, source_sha256: str, lo: int, hi: int) -> SliceLayout | None:
        """The slice of layers ``[lo, hi)`` of the model ``source_sha256``, if it is here."""
        src = self.by_sha.get(source_sha256)
        return layer_layout(src, range(lo, hi), stage=True) if src is not None else None


def chunks(sl: SliceFile, chunk_bytes: int = CHUNK_BYTES, start: int = 0):
    """Yield :class:`.wire.Chunk` messages covering the slice from byte ``start``."""
    import numpy as np

    offset = start
    for block in sl.layout.iter_bytes(start, chunk_bytes):
        yield wire.Chunk(sl.sha256, offset, sl.size, np.frombuffer(block, dtype="u1"))
        offset += len(block)


def send_slice(
    request: Callable[[wire.Message], wire.Message],
    sl: SliceFile,
    stats: TransferStats,
    progress: Progress | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Offer the slice; stream it if the worker lacks it, from where an earlier transfer of
    it stopped (the worker keeps what it received). ``request`` sends and awaits the reply."""
    reply = request(wire.Offer(sl.sha256, sl.size, sl.source_sha256, sl.lo, sl.hi))
    if not isinstance(reply, wire.OfferReply):
        raise PotluckError(f"the worker answered a slice offer with {reply.TYPE!r}")
    what = f"layers {sl.lo}-{sl.hi}"
    if reply.have:
        stats.files_cached += 1
        if progress:
            progress(what + " (cached)", sl.size, sl.size)
        return
    if not 0 <= reply.received < sl.size:
        raise PotluckError(f"the worker holds {reply.received} bytes of a {sl.size}-byte slice")
    stats.resumed_bytes += reply.received
    t0 = time.perf_counter()
    done = reply.received
    if progress and done:
        progress(what, done, sl.size)
    for chunk in chunks(sl, chunk_bytes, done):
        ack = request(chunk)
        if not isinstance(ack, wire.ChunkAck):
            raise PotluckError(f"the worker answered a slice chunk with {ack.TYPE!r}")
        done = ack.received
        stats.bytes_sent += chunk.data.size
        if progress:  # the rate rides in the label while bytes move; the last call names the slice
            rate = (done - reply.received) / max(time.perf_counter() - t0, 1e-9) / 1e6
            progress(what if done == sl.size else f"{what}, {rate:,.0f} MB/s", done, sl.size)
    stats.seconds += time.perf_counter() - t0
    stats.files_sent += 1
