"""GGUF files: describe, hash, slice into layer ranges, and merge/repeat layer ranges.

Slicing follows the recipe verified in docs/facts.md §5: copy every key/value, set
``<arch>.block_count`` to the slice's layer count, keep ``token_embd``, ``output_norm`` and
``output``, and keep ``blk.i.*`` for the chosen layers renumbered from 0. Tensors are
copied raw (quantized bytes untouched). What a slice rewrites beyond that (per-layer patterns
indexed by the original layer, such as Gemma 3's sliding windows) is its architecture's entry
in :mod:`.archs`; architectures not in that table are refused.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from . import archs
from .errors import ModelError, PotluckError

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


class _ArrayParts(Sequence):
    """A key's parts (see gguf's ``ReaderField``) where the value is a long array: the key's
    and the array's own parts, then one part per number or a (length, bytes) pair per string,
    each made when it is read. A reader of a 49k-token vocabulary built ~300,000 numpy views
    that almost nothing reads (llama.cpp reads the vocabulary itself): ~0.25 s a header."""

    def __init__(self, head: list, plain: np.ndarray, starts: list[int] | None, values: np.ndarray | None) -> None:
        self.head, self.plain, self.values = head, plain, values
        self.starts = starts  # strings: where each one's length starts, then where the last ends
        self.per = 2 if starts is not None else 1
        self.n = len(starts) - 1 if starts is not None else len(values)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self.head) + self.per * self.n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i < len(self.head):
            return self.head[i]
        j, k = divmod(i - len(self.head), self.per)
        if self.starts is None:
            return self.values[j : j + 1]  # type: ignore[index]
        at = self.starts[j]
        return self.plain[at : at + 8].view(np.uint64) if k == 0 else self.plain[at + 8 : self.starts[j + 1]]


def _fast_reader_class():
    """GGUFReader whose header parsing slices a plain ndarray view of the memmap, walks arrays
    without recursing once per element, and makes an array's per-element parts when read.

    The stock reader slices the ``np.memmap`` once per vocabulary string, and memmap's
    ``__array_finalize__`` makes that ~4x slower; it also recurses into ``_get_field_parts``
    for each element of every array (the vocabulary, its scores, types and merges). The
    default model's header took 0.86 s and Gemma 3's 262k-token one 3.8 s; with the first two
    fixes 0.16 s and 0.52 s, and with :class:`_ArrayParts` 0.08 s for the default model. The
    fields, parts and offsets are the same arrays over the same bytes
    (``tests/test_engine_units.py`` compares them with the element-wise walk).
    """
    import gguf

    string, array = gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY

    class FastReader(gguf.GGUFReader):
        def _plain(self) -> np.ndarray:
            plain = self.__dict__.get("_plain_view")
            if plain is None:
                plain = self.__dict__["_plain_view"] = self.data.view(np.ndarray)
            return plain

        def _get(self, offset, dtype, count=1, override_order=None):  # type: ignore[override]
            dt = np.dtype(dtype)
            count = int(count)
            arr = self._plain()[offset : offset + dt.itemsize * count].view(dtype=dt)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

        def _build_fields(self, offs, count):  # type: ignore[override]
            """gguf's own loop, but a long array's parts stay an :class:`_ArrayParts`, and where
            each key's value ends is kept (``value_ends``: a slice copies values as bytes)."""
            self.value_ends: dict[str, int] = {}
            for _ in range(count):
                orig_offs = offs
                kv_klen, kv_kdata = self._get_str(offs)
                offs += int(kv_klen.nbytes + kv_kdata.nbytes)
                raw_kv_type = self._get(offs, np.uint32)
                offs += int(raw_kv_type.nbytes)
                head = [kv_klen, kv_kdata, raw_kv_type]
                size, parts, idxs, types = self._get_field_parts(offs, raw_kv_type[0])
                if isinstance(parts, _ArrayParts):
                    parts.head = head + parts.head
                else:
                    parts = head + parts
                name = str(bytes(kv_kdata), encoding="utf-8")
                self._push_field(gguf.ReaderField(orig_offs, name, parts, [i + 3 for i in idxs], types), skip_sum=True)
                offs += size
                self.value_ends[name] = offs
            return offs

        def _get_field_parts(self, orig_offs, raw_type):  # type: ignore[override]
            if raw_type != array or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            itype, n, offs = gguf.GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
            nptype = self.gguf_scalar_to_np.get(itype)
            head: list[np.ndarray] = [raw_itype, alen]
            plain = self._plain()
            if itype == string:  # one (length, bytes) pair of parts per string
                if 8 * n > len(plain) - offs:
                    raise ValueError(f"an array of {n} strings runs past the end of the file")
                buf, starts = memoryview(plain), [0] * (n + 1)
                for i in range(n):
                    starts[i] = offs
                    offs += 8 + int.from_bytes(buf[offs : offs + 8], "little")
                starts[n] = offs
                if offs > len(plain):
                    raise ValueError("a string array runs past the end of the file")
                parts = _ArrayParts(head, plain, starts, None)
                return offs - orig_offs, parts, list(range(3, 2 * n + 2, 2)), [array, itype]
            if nptype is None:  # an array of arrays: the element-wise walk
                return super()._get_field_parts(orig_offs, raw_type)
            values = self._get(offs, nptype, n)
            if len(values) != n:
                raise ValueError(f"an array of {n} values runs past the end of the file")
            parts = _ArrayParts(head, plain, None, values)  # one part per element, as the stock reader's
            return 12 + int(values.nbytes), parts, list(range(2, n + 2)), [array, itype]

    return FastReader


def open_reader(path: Path):  # -> gguf.GGUFReader
    """A GGUF reader over ``path`` (header and tensor index), refusing what is not a GGUF file."""
    if not path.exists():
        raise ModelError(f"model file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelError(f"not a GGUF model file: {path}")
    try:
        return _fast_reader_class()(str(path), "r")
    except Exception as e:  # truncated or corrupt: numpy memmap / struct errors
        raise ModelError(f"could not read GGUF {path}: the file is truncated or corrupt ({e})") from None


_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type -> bytes
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@dataclass(frozen=True)
class TensorEntry:
    name: str
    n_dims: int
    type_name: str  # ggml's name: "Q4_K", "F32", ...
    zeroed: bool = False  # of a layer the slice holds as zeros (:data:`ZEROED_LAYERS_KEY`)


_INT_ELEMENT = {4: "I", 5: "i", 10: "Q", 11: "q"}  # GGUF integer value types, as struct codes


def file_version(path: Path) -> tuple[Path, int, int]:
    """``path`` resolved, its size and its modification time: the key of what is read once per
    file version (a file rewritten in place is read again)."""
    path = Path(path).resolve()
    st = path.stat()
    return path, st.st_size, st.st_mtime_ns


def tensor_index(path: Path) -> list[TensorEntry]:
    """Name, rank and type of every tensor, from the header alone (read once per file version:
    every session a process opens on a model asks, and skipping a 49k-token vocabulary's
    strings takes 0.1 s)."""
    try:
        version = file_version(path)
    except OSError as e:
        raise ModelError(f"could not read GGUF {path}: {e.strerror}") from None
    return list(_tensor_index_of_version(*version))


@functools.lru_cache(maxsize=8)
def _tensor_index_of_version(path: Path, size: int, mtime_ns: int) -> tuple[TensorEntry, ...]:
    """gguf-py's reader builds an object per array element (a 262k-token vocabulary takes
    seconds); this skips the values but :data:`ZEROED_LAYERS_KEY`'s. Its map closes on return:
    a stage's own map of its slice is the only one (llama.cpp's, advised for random reads)."""
    import mmap
    import struct

    import gguf

    def skip_value(buf: mmap.mmap, at: int, vtype: int) -> int:
        if vtype in _GGUF_SCALAR:
            return at + _GGUF_SCALAR[vtype]
        if vtype == _GGUF_STRING:
            return at + 8 + struct.unpack_from("<Q", buf, at)[0]
        if vtype != _GGUF_ARRAY:
            raise ModelError(f"could not read GGUF {path}: unknown value type {vtype}")
        etype, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if etype in _GGUF_SCALAR:
            return at + count * _GGUF_SCALAR[etype]
        if etype == _GGUF_STRING:  # a vocabulary: the hot loop
            length = struct.Struct("<Q").unpack_from
            for _ in range(count):
                at += 8 + length(buf, at)[0]
            return at
        for _ in range(count):
            at = skip_value(buf, at, etype)
        return at

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            magic, _version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
            if magic != b"GGUF":
                raise ModelError(f"not a GGUF model file: {path}")
            at = 24
            zeroed: tuple[str, ...] = ()
            for _ in range(n_kv):
                n = struct.unpack_from("<Q", buf, at)[0]
                key, at = bytes(buf[at + 8 : at + 8 + n]), at + 8 + n
                vtype = struct.unpack_from("<I", buf, at)[0]
                if key == _ZEROED_KEY and vtype == _GGUF_ARRAY:
                    etype, count = struct.unpack_from("<IQ", buf, at + 4)
                    if etype in _INT_ELEMENT:
                        layers = struct.unpack_from(f"<{count}{_INT_ELEMENT[etype]}", buf, at + 16)
                        zeroed = tuple(f"blk.{j}." for j in layers)
                at = skip_value(buf, at + 4, vtype)
            out = []
            for _ in range(n_tensors):
                n = struct.unpack_from("<Q", buf, at)[0]
                name = bytes(buf[at + 8 : at + 8 + n]).decode("utf-8", errors="replace")
                at += 8 + n
                n_dims = struct.unpack_from("<I", buf, at)[0]
                at += 4 + 8 * n_dims
                ttype = struct.unpack_from("<I", buf, at)[0]
                at += 12  # type, offset
                try:
                    type_name = gguf.GGMLQuantizationType(ttype).name
                except ValueError:
                    type_name = f"type {ttype}"
                out.append(TensorEntry(name, n_dims, type_name, name.startswith(zeroed)))
            return tuple(out)
    except (OSError, ValueError, struct.error) as e:
        raise ModelError(f"could not read GGUF {path}: the file is truncated or corrupt ({e})") from None


def _field_value(field) -> object:
    return field.contents()


def describe(path: Path) -> dict[str, object]:
    """Architecture, layer count (the trunk: next-token blocks left out), sizes, experts, whether
    a split over machines is exact (``split_problem``: None, or why not) and what a stage of it
    keeps (``cache``, its table entry's; None outside the table): read from the header without
    loading weights."""
    path = Path(path)
    h = archs.read_header(open_reader(path))
    n_expert, n_used, n_shared = archs.experts(h)
    return {
        "path": str(path),
        "arch": h.arch,
        "n_layer": h.n_layer,
        "n_embd": h.int_of("embedding_length"),
        "n_vocab": h.n_vocab,
        "size_mb": path.stat().st_size / 1e6,
        "n_expert": n_expert,
        "n_expert_used": n_used,
        "n_expert_shared": n_shared,
        "split_problem": archs.unsplittable_reason(h),
        "cache": archs.ARCHS[h.arch].cache if h.arch in archs.ARCHS else None,
    }


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class _Raw(bytes):
    """A key's value as the source file holds it (its bytes after the value type): copied
    into a new header as it is, not decoded and packed again element by element."""


def _header_writer(path: Path, arch: str):  # -> gguf.GGUFWriter
    """A GGUFWriter that writes :class:`_Raw` values as they are. A 49k-token vocabulary's
    strings, scores, types and merges took ~0.25 s to decode and pack per slice header (a
    262k one over a second); copied, they take ~1 ms."""
    import gguf

    class HeaderWriter(gguf.GGUFWriter):
        def _pack_val(self, val, vtype, add_vtype, sub_type=None):  # type: ignore[override]
            if isinstance(val, _Raw):
                return (self._pack("I", vtype) if add_vtype else b"") + val
            return super()._pack_val(val, vtype, add_vtype, sub_type)

    return HeaderWriter(str(path), arch=arch, use_temp_file=False)


def _raw_value(reader, field) -> _Raw | None:
    """``field``'s value bytes in ``reader``'s file (from :func:`open_reader`), or None where they
    cannot be copied as they are (a file of the other byte order: the writer writes little-endian)."""
    if reader.byte_order != "I":
        return None
    start = field.offset + 8 + int(field.parts[0][0]) + 4  # after the key (length, bytes) and the value type
    return _Raw(reader.data[start : reader.value_ends[field.name]].tobytes())


def _copy_fields(
    reader, writer, arch: str, n_layer_new: int, layer_map: Sequence[int], *, vocab: bool = True
) -> None:
    """``vocab=False``: leave the tokenizer and the vocabulary size out. ``writer``: from
    :func:`_header_writer` (values it does not change are copied as raw bytes)."""
    import gguf

    n_layer = reader_n_layer(reader, arch)
    for field in reader.fields.values():
        name = field.name
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if not vocab and (name.startswith("tokenizer.") or name == f"{arch}.vocab_size"):
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value: object = None
        if name == f"{arch}.block_count":
            value = n_layer_new
        elif (
            vtype == gguf.GGUFValueType.ARRAY
            and name.startswith(f"{arch}.")
            and len(field.data) == n_layer
            and len(field.types) == 2  # an array of numbers or strings, not of arrays
            and not name.startswith(f"{arch}.tokenizer")
        ):
            old = _field_value(field)
            value = [old[i] for i in layer_map]  # per-layer arrays follow their layers
        if value is None:
            value = _raw_value(reader, field)
        if value is None:
            value = _field_value(field)
        writer.add_key_value(name, value, vtype, sub_type=sub_type)


def copy_fields(reader, writer, prefix: str) -> None:
    """Copy every key/value whose name starts with ``prefix`` (``"tokenizer."``), types kept."""
    import gguf

    for field in reader.fields.values():
        if field.name.startswith(prefix):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, _field_value(field), field.types[0], sub_type=sub_type)


def reader_n_layer(reader, arch: str) -> int:
    return int(_field_value(reader.fields[f"{arch}.block_count"]))


@dataclass(frozen=True)
class SliceLayout:
    """A GGUF made of another one's layers, as bytes to stream rather than a file to write:
    its header (built here, a few MB at most), then each tensor's bytes read from the
    source by range, each padded to the alignment exactly as GGUFWriter pads it. So a slice
    can be hashed, sent or written without a second copy of the model on disk or in memory."""

    src: Path
    header: bytes  # magic, key/values and tensor infos, padded to the data alignment
    parts: tuple[tuple[int, int, int], ...]  # (offset in the slice, offset in src, bytes)
    size: int
    ones: tuple[tuple[int, bytes], ...] = ()  # (offset in the slice, bytes): a layer of zeros' scales

    @functools.cached_property
    def recipe(self) -> str:
        """A digest of how the slice is made of its source (header and parts): with the
        source's sha256 it names the slice's bytes, whatever version of potluck laid it out."""
        return hashlib.sha256(self.header + repr((self.parts, self.size, self.ones)).encode()).hexdigest()[:16]

    def iter_bytes(self, start: int = 0, chunk_bytes: int = 4 << 20) -> Iterator[bytes]:
        """The slice's bytes from ``start`` to the end, at most ``chunk_bytes`` at a time."""
        pos = start
        with open(self.src, "rb") as f:
            while pos < self.size:
                n = min(chunk_bytes, self.size - pos)
                yield self._read(f, pos, n)
                pos += n

    def _read(self, f, pos: int, n: int) -> bytes:
        out = bytearray(n)  # zeros: the padding between tensors
        end = pos + n
        if pos < len(self.header):
            head = self.header[pos:end]
            out[: len(head)] = head
        i = bisect.bisect_right(self.parts, (pos, float("inf"), 0)) - 1
        for at, src_at, size in self.parts[max(i, 0):]:
            if at >= end:
                break
            lo, hi = max(pos, at), min(end, at + size)
            if lo < hi:
                out[lo - pos : hi - pos] = os.pread(f.fileno(), hi - lo, src_at + lo - at)
        for at, data in self.ones:
            lo, hi = max(pos, at), min(end, at + len(data))
            if lo < hi:
                out[lo - pos : hi - pos] = data[lo - at : hi - at]
        return bytes(out)

    def sha256(self) -> str:
        h = hashlib.sha256()
        for block in self.iter_bytes():
            h.update(block)
        return h.hexdigest()

    def write_to(self, dst: Path) -> Path:
        """Write the slice as a file (via ``dst.part``, renamed once whole)."""
        dst = Path(dst)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".part")
        with open(tmp, "wb") as out:
            for block in self.iter_bytes():
                out.write(block)
        tmp.replace(dst)
        return dst


def layer_layout(src: Path, layer_map: Sequence[int], *, stage: bool = False, head: bool = False) -> SliceLayout:
    """The layout of a GGUF whose layer j is ``src``'s layer ``layer_map[j]`` (slices, merges).

    Embeddings, final norm and output head are always kept (a slice needs them to load; the
    stages that do not use them skip them at run time). ``stage``: a worker's slice. It never
    computes the output matrix (the head does), which is then written as zeros of a type
    llama.cpp does not repack (Q4_1): mapped and never read, it costs the stage no memory,
    where a Q4_0 one was copied into memory of its own on machines with extra buffer types
    (docs/facts.md §17). A stage after the first reads no token ids either: where the model
    allows (:func:`middle_stage_vocab`) its slice has no vocabulary (tokenizer "none",
    :data:`STAGE_VOCAB` dummy tokens, embeddings and output as stubs of that many rows), so
    llama.cpp does not size its buffers by the model's vocabulary.

    ``head``: the cluster head's slice, the output norm and matrix behind ``layer_map``'s
    layers as zeros (llama.cpp loads no model of 0 layers; a zero layer adds exactly 0 to the
    residual stream), each mixture layer cut to one routed expert, one used (they are all
    zeros), and the embeddings, which it never reads, zeros of the smallest type their rows
    allow (:data:`ZERO_BLOCKS`). The workers compute every real layer.
    """
    src = Path(src)
    layout = _layout_of_version(*file_version(src), tuple(layer_map), stage or head, head)
    return replace(layout, src=src) if layout.src != src else layout


STUB_OUTPUT_BLOCK = (32, 20)  # Q4_1: 32 weights in 20 bytes, and no repacked layout in llama.cpp's CPU backend
# A slice's layers whose weights are all zeros (a filler), which llama.cpp ignores: no kernel
# choice changes what a zero matrix gives, so judging the slice's batches leaves them out
ZEROED_LAYERS_KEY = "potluck.zeroed_layers"
_ZEROED_KEY = ZEROED_LAYERS_KEY.encode()
# Weights no stage reads (embeddings) or that are zeros (a filler layer, archs.Arch.filler), as
# the fewest bytes a row of zeros can take: (type, weights, bytes) a block, the first whose block
# divides the row. Zero bytes are zeros in each; llama.cpp multiplies and looks up rows of both.
ZERO_BLOCKS = (("Q1_0", 128, 18), ("MXFP4", 32, 17))
# The vocabulary of a stage between the first and the last: it reads no token ids and computes
# no logits, so its slice says "none" with this many dummy tokens (llama.cpp's vocab type NONE)
STAGE_VOCAB = 32


def middle_stage_vocab(tensors) -> int:  # tensors: the model's gguf ReaderTensors
    """Tokens a stage between the first and the last is sliced with: :data:`STAGE_VOCAB`, or
    0 (the whole vocabulary) where the model cannot do without it: embeddings that are not
    whole Q4_1 rows (the stubs' type), or another tensor outside the layers sized by the
    vocabulary (an output bias). The slicer and the planner both ask this."""
    by_name = {t.name: t for t in tensors}
    embd = by_name.get("token_embd.weight")
    if embd is None or _stub_output(embd, STAGE_VOCAB) is None:
        return 0
    n_vocab = int(embd.shape[1])
    sized_by_vocab = [
        n for n, t in by_name.items()
        if not _BLK.match(n) and n not in ("token_embd.weight", "output.weight") and n_vocab in tuple(t.shape)
    ]
    return 0 if sized_by_vocab else STAGE_VOCAB


def _stub_output(t, rows: int | None = None) -> tuple[tuple[int, int], int] | None:
    """(numpy byte shape, bytes) of ``t`` (the output matrix) as Q4_1 zeros, ``rows`` rows
    (None: as many as ``t``), or None where its rows are not whole Q4_1 blocks."""
    return _stub_of(t, *STUB_OUTPUT_BLOCK, rows)


def _stub_of(t, per: int, nbytes: int, rows: int | None = None) -> tuple[tuple[int, ...], int] | None:
    """(numpy byte shape, bytes) of ``t`` as blocks of ``per`` weights in ``nbytes``, ``rows``
    rows of 2 dimensions (None: ``t``'s own rows and dimensions), or None where its rows are not
    whole blocks."""
    n_in = int(t.shape[0])
    if n_in % per:
        return None
    width = n_in // per * nbytes
    if rows is not None:
        return (rows, width), rows * width
    outer = tuple(int(d) for d in reversed(t.shape[1:]))
    return (*outer, width), int(np.prod(outer)) * width


def _zeros_of(t) -> tuple[tuple[int, ...], int, str] | None:
    """(numpy byte shape, bytes, type) of ``t`` as zeros of the smallest :data:`ZERO_BLOCKS`
    type its rows allow, or None where none is smaller than ``t``."""
    for qtype, per, nbytes in ZERO_BLOCKS:
        form = _stub_of(t, per, nbytes)
        if form is not None:
            return (*form, qtype) if form[1] < int(t.n_bytes) else None
    return None


def filler_bytes(tensors, n_layer: int, n_expert: int = 0, keep_experts: int = 0) -> tuple[int, ...]:
    """[n_layer] bytes each layer takes as zeros: as a slice's filler (archs.Arch.filler), which
    the planner counts in a stage of one kind of layer, or with ``keep_experts`` routed experts
    of ``n_expert`` (the head's slice: :func:`layer_layout`). ``tensors``: gguf ReaderTensors."""
    out = [0] * n_layer
    for t in tensors:
        m = _BLK.match(t.name)
        if m and int(m.group(1)) < n_layer:
            out[int(m.group(1))] += _filler_zeros(t, n_expert, keep_experts)[1]
    return tuple(out)


def _filler_zeros(t, n_expert: int = 0, keep_experts: int = 0) -> tuple[tuple[int, ...], int, str]:
    """A filler layer's tensor as zeros: a quantized matrix (weights multiplied) in the smallest
    type, anything else (norms, a state's constants, F32 routers) as its own type's zeros.
    ``keep_experts``: a tensor stacked per routed expert (:data:`_PER_EXPERT`, ``n_expert`` of
    them) keeps that many (0: all)."""
    small = _zeros_of(t) if len(t.shape) >= 2 and t.tensor_type.name not in ("F32", "F16", "BF16") else None
    shape, nbytes, qtype = small or (tuple(t.data.shape), int(t.n_bytes), t.tensor_type.name)
    if keep_experts and int(t.shape[-1]) == n_expert and _PER_EXPERT.match(t.name.split(".", 2)[-1]):
        # stacked on the last dimension, the outermost in bytes
        shape, nbytes = (keep_experts, *shape[1:]), nbytes // n_expert * keep_experts
    return shape, nbytes, qtype


# a layer's tensors stacked per routed expert on their last dimension: the experts, their
# biases and scales (Gemma 4's), the router and its bias (DeepSeek's and GLM's selection bias)
_PER_EXPERT = re.compile(r"^(ffn_(gate|up|down|gate_up)_exps|ffn_gate_inp|exp_probs_b)\.(weight|bias|scale)$")
# A head slice's zeroed mixture layers keep this many routed experts, used by every token (in
# groups of as many), so they read next to nothing: these keys are set to it.
HEAD_EXPERTS = 1
HEAD_EXPERT_KEYS = ("expert_count", "expert_used_count", "expert_group_count", "expert_group_used_count")


@functools.lru_cache(maxsize=8)
def _layout_of_version(
    src: Path, size: int, mtime_ns: int, layer_map: tuple[int, ...], stage: bool = False, head: bool = False
) -> SliceLayout:
    """One layout per file version and layer map: a head reopening its pipeline (a rebuild,
    a new session in the same process) lays out the same slices again, and building a
    header from a 49k-token vocabulary takes a second. It holds the header's bytes only (a
    few MB), no map of the model."""
    import gguf

    r = _reader_of_version(src, size, mtime_ns)
    h = archs.read_header(r)
    rules = archs.require_splittable(h, src.name)
    arch = h.arch
    archs.check_layer_map(h, layer_map)
    lo, hi = min(layer_map), max(layer_map) + 1
    if list(layer_map) == list(range(lo, hi)):  # a stage's range (merges repeat layers)
        why = archs.slice_rules(h).why_not(lo, hi)
        if why is not None:
            raise PotluckError(f"cannot split {src.name} at layers {lo}-{hi - 1}: they {why}")
    by_layer: dict[int, list] = {}
    others: list = []
    unread = rules.unread(h, layer_map)
    filler = rules.filler_layer(h, layer_map)
    full_map = list(layer_map) if filler is None else [filler, *layer_map]
    for t in r.tensors:
        if t.name in unread:
            continue
        m = _BLK.match(t.name)
        if m:
            by_layer.setdefault(int(m.group(1)), []).append((m.group(2), t))
        else:
            others.append((t.name, t))
    ordered: list[tuple[str, object]] = [(n, t) for n, t in others if n == "token_embd.weight"]
    for j, i in enumerate(full_map):
        ordered += [(f"blk.{j}.{suffix}", t) for suffix, t in by_layer.get(i, [])]
    ordered += [(n, t) for n, t in others if n != "token_embd.weight"]
    stub = {}  # name -> (byte shape, bytes, type): tensors written as zeros
    zeroed = list(range(len(full_map))) if head else [] if filler is None else [0]
    n_expert = h.int_of("expert_count")
    ones: dict[str, bytes] = {}  # a layer of zeros' scales of its whole output: ones (F32)
    keep = HEAD_EXPERTS if head and n_expert else 0
    for j in zeroed:
        for suffix, t in by_layer.get(full_map[j], []):
            stub[f"blk.{j}.{suffix}"] = _filler_zeros(t, n_expert, keep)
            if suffix in rules.output_scales:
                if t.tensor_type.name != "F32":
                    raise PotluckError(f"cannot lay out {src.name}: {t.name} scales a layer's output and is "
                                       f"{t.tensor_type.name}, not F32 (archs.Arch.output_scales)")
                ones[f"blk.{j}.{suffix}"] = np.ones(int(np.prod(t.shape)), np.float32).tobytes()
    # A worker's stage after the first reads hidden states and hands hidden states on: with the
    # whole vocabulary, llama.cpp would give each of its contexts a logits buffer and an
    # output-layer compute buffer of n_batch x n_vocab floats it never uses (docs/facts.md §17).
    middle = stage and not head and min(layer_map) > 0
    vocab_free = middle and middle_stage_vocab(r.tensors) > 0
    if stage and not head:
        tensors = dict(ordered)
        # tied embeddings: llama.cpp would repack a duplicate of the embeddings as the output;
        # an explicit output matrix of their shape takes its place
        output = tensors.get("output.weight", tensors.get("token_embd.weight"))
        rows = STAGE_VOCAB if vocab_free else None
        form = _stub_output(output, rows) if output is not None else None
        if form is not None:
            if "output.weight" not in tensors:
                ordered.append(("output.weight", output))
            stub["output.weight"] = (*form, "Q4_1")
        if vocab_free:  # same width as the output (checked by middle_stage_vocab)
            stub["token_embd.weight"] = (*_stub_output(tensors["token_embd.weight"], rows), "Q4_1")
    named = dict(ordered)
    unread_embd = "token_embd.weight" not in stub and {"token_embd.weight", "output.weight"} <= set(named)
    if stage and min(layer_map) > 0 and unread_embd:  # tied embeddings are the head's output: kept
        form_embd = _zeros_of(named["token_embd.weight"])
        if form_embd is not None:
            stub["token_embd.weight"] = form_embd
    with tempfile.TemporaryDirectory(prefix="potluck-header-") as tmp:
        header_path = Path(tmp) / "header.gguf"
        w = _header_writer(header_path, arch)
        _copy_fields(r, w, arch, len(full_map), full_map, vocab=not vocab_free)
        if vocab_free:
            w.add_tokenizer_model("none")
            w.add_vocab_size(STAGE_VOCAB)
        for key, value in rules.rewrites(h, full_map).items():
            _set_kv(w, r, f"{arch}.{key}", value)
        if head and n_expert:
            for key in HEAD_EXPERT_KEYS:
                if h.int_of(key):
                    _set_kv(w, r, f"{arch}.{key}", HEAD_EXPERTS)
        if zeroed:
            w.add_array(ZEROED_LAYERS_KEY, zeroed)
        for name, t in ordered:
            if name in stub:
                shape, nbytes, qtype = stub[name]
                dtype = np.dtype({"F32": np.float32, "F16": np.float16}.get(qtype, np.uint8))
                w.add_tensor_info(name, shape, dtype, nbytes, gguf.GGMLQuantizationType[qtype])
            else:
                w.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)  # type: ignore[attr-defined]
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        w.close()
        header = header_path.read_bytes()
    align = w.data_alignment
    header += bytes(gguf.GGUFWriter.ggml_pad(len(header), align) - len(header))
    parts, filled, at = [], [], len(header)
    for name, t in ordered:
        if name in stub:  # no part: the bytes between parts read as zeros
            if name in ones:
                filled.append((at, ones[name]))
            at += gguf.GGUFWriter.ggml_pad(stub[name][1], align)
            continue
        parts.append((at, int(t.data_offset), int(t.n_bytes)))  # type: ignore[attr-defined]
        at += gguf.GGUFWriter.ggml_pad(int(t.n_bytes), align)  # type: ignore[attr-defined]
    return SliceLayout(src, header, tuple(parts), at, tuple(filled))


@functools.lru_cache(maxsize=4)
def _reader_of_version(path: Path, size: int, mtime_ns: int):  # -> gguf.GGUFReader
    """One parsed header per file version: a head lays out every stage's slice and its own
    from the same model (parsing a 49k-token vocabulary takes a second or more)."""
    return open_reader(path)


def file_header(path: Path) -> archs.Header:
    """The header of ``path`` as it is now (read once per file version: a session sizes its
    kept conversations with it after every reply)."""
    return _header_of_version(*file_version(path))


@functools.lru_cache(maxsize=4)
def _header_of_version(path: Path, size: int, mtime_ns: int) -> archs.Header:
    return archs.read_header(_reader_of_version(path, size, mtime_ns))


def forget_parsed_headers() -> None:
    """Drop the parsed headers (and with them the reader's map of the file): a head that has
    laid out its slices keeps no page of the model resident (a model too big for it)."""
    _reader_of_version.cache_clear()
    _header_of_version.cache_clear()


def write_layers(src: Path, dst: Path, layer_map: Sequence[int]) -> Path:
    """Write :func:`layer_layout` ``(src, layer_map)`` to ``dst``."""
    return layer_layout(src, layer_map).write_to(dst)


def _drop_kv(writer, key: str) -> None:
    for kv in getattr(writer, "kv_data", []):
        if isinstance(kv, dict):
            kv.pop(key, None)


def _set_kv(writer, reader, key: str, value: object) -> None:
    """Set ``key`` (dropping any copied value): an array, or a number of the source's type for
    that key (llama.cpp checks a key's type), uint32 where the source has none."""
    import gguf

    _drop_kv(writer, key)
    if isinstance(value, list):
        writer.add_array(key, value)
        return
    f = reader.fields.get(key)
    vtype = f.types[0] if f is not None and f.types[0] != gguf.GGUFValueType.ARRAY else gguf.GGUFValueType.UINT32
    writer.add_key_value(key, value, vtype)


def slice_layers(src: Path, dst: Path, lo: int, hi: int) -> Path:
    """Layers ``[lo, hi)`` of ``src`` as a standalone GGUF."""
    return write_layers(src, dst, list(range(lo, hi)))


def merge_layer_ranges(src: Path, dst: Path, ranges: Sequence[tuple[int, int]]) -> Path:
    """A deeper "passthrough" model: the given inclusive ranges of ``src``'s layers in order.

    ``[(0, 29), (0, 29)]`` repeats all 30 layers of the 135M model twice (60 layers).
    """
    layer_map = [i for lo, hi in ranges for i in range(lo, hi + 1)]
    return write_layers(src, dst, layer_map)


def parse_recipe(recipe: str) -> list[tuple[int, int]]:
    """``"0-29,0-29"`` -> ``[(0, 29), (0, 29)]``; ``"0-29x4"`` repeats a range."""
    ranges: list[tuple[int, int]] = []
    for part in recipe.split(","):
        part = part.strip()
        times = 1
        if "x" in part:
            part, t = part.split("x")
            times = int(t)
        lo, hi = (int(v) for v in part.split("-"))
        ranges += [(lo, hi)] * times
    return ranges
