"""A sequence's KV state, moved between an F16 and a BF16 cache.

Why: an F16 cache prefills a prompt about twice as fast as BF16 (flash attention's tiled path,
docs/facts.md §3), but its single-token steps past 512 cells take a split-KV path that differs
from verify batches; a BF16 cache decodes exactly and faster deep in a context. So a long
prompt is computed in an F16 context and its cells are handed to the BF16 context that decodes
(:mod:`.staged_prefill`). llama.cpp refuses a state whose cache type differs from the
context's, so the bytes are rewritten here: same layout, the type ids and values converted.

The layout is llama.cpp's ``llama_state_seq_get_data`` (little-endian): a header, then
``llama_kv_cache::state_write`` for one sequence, one section per KV cache (two for
interleaved sliding-window models)::

    u32 magic (0xaf143cd8), i32 seq_id
    u32 n_stream
    per stream: u32 cell_count; if cell_count:
        cell_count x (i32 pos, u32 n_seq_id (=1), [ext,] i32 seq_id)   # cell metadata
        # ext: i32 x, i32 y, i32 token, when the model's RoPE has several positions (M-RoPE)
        u32 v_trans (=0 with flash attention), u32 n_layer
        n_layer x (i32 k_type, u64 k_row_bytes, cell_count x k_row_bytes)
        n_layer x (i32 v_type, u64 v_row_bytes, cell_count x v_row_bytes)   # unless K only (MLA)

F16 and BF16 take two bytes per value, so a state keeps its size and is rewritten in place.
Anything else in the layout (transposed V, several non-empty streams) raises
:class:`KvStateError`, and the caller keeps computing in one cache type.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

GGML_TYPE_F16 = 1
GGML_TYPE_BF16 = 30
_TYPES = (GGML_TYPE_F16, GGML_TYPE_BF16)
_MAGIC = 0xAF143CD8  # llama-context.cpp's io_magic


class KvStateError(ValueError):
    """A state this module cannot rewrite: a layout it does not know (the same for every
    stage of a model, so a split decides as the whole model does)."""


# -- values: 16 bits to 16 bits, so a lookup table of 65,536 entries does each direction


def bf16_from_f16(raw: np.ndarray) -> np.ndarray:
    """uint16 F16 bits -> uint16 BF16 bits, rounded to nearest even like ggml's fp32->bf16
    (the reference the tables are built from)."""
    f32 = raw.view(np.float16).astype(np.float32)
    bits = f32.view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    nan = np.isnan(f32)
    rounded[nan] = ((bits[nan] >> 16) | 64).astype(np.uint16)
    return rounded


def f16_from_bf16(raw: np.ndarray) -> np.ndarray:
    """uint16 BF16 bits -> uint16 F16 bits, rounded to nearest; finite values past F16's range
    saturate at +-65504 (an F16 cache would hold those as inf). Value by value, never refused,
    so a model computes alike whole and split into stages: a refusal decided over a stage's
    layers would differ between the two (docs/facts.md §25)."""
    f32 = (raw.astype(np.uint32) << 16).view(np.float32)
    finite = np.isfinite(f32)
    f32 = np.where(finite, np.clip(f32, -65504.0, 65504.0), f32)
    return f32.astype(np.float16).view(np.uint16)


_ALL = np.arange(1 << 16, dtype=np.uint16)
_TO_BF16 = bf16_from_f16(_ALL)
_TO_F16 = f16_from_bf16(_ALL)


@functools.cache
def _translate() -> Callable[[np.ndarray, np.ndarray], None]:
    """values[i] = table[values[i]], in place, compiled by numba on first use (importing numba
    costs 0.4 s: not at the CLI's start). ~12 ms for 50M values, against 570 ms for numpy's
    float conversions."""
    import numba

    @numba.njit(cache=True, nogil=True)
    def translate(values: np.ndarray, table: np.ndarray) -> None:  # pragma: no cover - compiled
        for i in range(values.size):
            values[i] = table[values[i]]

    return translate


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel now, not at the first hand-over."""
    _translate()(np.zeros(1, np.uint16), _TO_BF16)


# -- layout


@dataclass(frozen=True)
class _Section:
    """One KV cache's part of the state: its stream count and its one filled stream."""

    n_stream: int
    filled_at: int  # offset of the filled stream's cell_count (-1: no cells)
    filled_end: int
    end: int


def _u32(buf: bytearray, at: int) -> int:
    return struct.unpack_from("<I", buf, at)[0]


def convert_seq_state(
    state: bytearray, to_type: int, *, n_stream: int, values: bool = True, cell_ext: bool = False
) -> bytearray:
    """``state`` (one sequence, F16 or BF16 cells) with its values in ``to_type``, laid out
    for a context with ``n_stream`` KV streams (1 unless it has one per sequence). The values
    are converted in place; the result is ``state`` itself unless the stream count changes.
    ``values``: whether the cache keeps V rows (not with multi-head latent attention: the
    layout does not say, and a K-only section read as K and V runs into the next one);
    ``cell_ext``: whether each cell carries M-RoPE's extension (``Model.kv_cell_ext``; the
    layout does not say either)."""
    if to_type not in _TYPES:
        raise KvStateError(f"only F16 and BF16 caches are converted, not ggml type {to_type}")
    if n_stream < 1:
        raise KvStateError("a context has at least one KV stream")
    if len(state) < 8 or _u32(state, 0) != _MAGIC:
        raise KvStateError("not a llama.cpp sequence state (wrong magic)")
    sections: list[_Section] = []
    blocks: list[tuple[int, int, int]] = []  # (type offset, data offset, bytes) of each K/V block
    at = 8
    while at < len(state):
        section = _read_section(state, at, blocks, 2 if values else 1, 6 if cell_ext else 3)
        sections.append(section)
        at = section.end
    translate = _translate()
    table = _TO_BF16 if to_type == GGML_TYPE_BF16 else _TO_F16
    for type_at, data_at, n_bytes in blocks:
        if _u32(state, type_at) != to_type:
            translate(np.frombuffer(state, np.uint16, n_bytes // 2, data_at), table)
            struct.pack_into("<i", state, type_at, to_type)
    if all(s.n_stream == n_stream for s in sections):
        return state
    return _relayout(state, sections, n_stream)


def _read_section(
    state: bytearray, at: int, blocks: list[tuple[int, int, int]], per_layer: int, cell_words: int
) -> _Section:
    """Check one KV cache's section starting at ``at`` and note its K/V blocks (``per_layer``:
    2, K and V, or 1, K only; ``cell_words``: a cell's metadata in 4-byte words, 3 or 6)."""
    n_stream = _u32(state, at)
    at += 4
    filled_at = filled_end = -1
    for _ in range(n_stream):
        count_at = at
        cell_count = _u32(state, at)
        at += 4
        if not cell_count:
            continue
        if filled_at >= 0:
            raise KvStateError("the state holds cells of several KV streams; convert one sequence at a time")
        filled_at = count_at
        if at + 4 * cell_words * cell_count > len(state):
            raise KvStateError("the state ends inside its cells")
        meta = np.frombuffer(state, np.int32, cell_words * cell_count, at).reshape(cell_count, cell_words)
        if not (meta[:, 1] == 1).all():  # (pos, n_seq_id, [ext,] seq_id) per cell
            raise KvStateError("a cell of the state belongs to several sequences or none")
        at += 4 * cell_words * cell_count
        v_trans, n_layer = struct.unpack_from("<II", state, at)
        at += 8
        if v_trans:
            raise KvStateError("a transposed V cache (flash attention off) is not converted")
        for _ in range(per_layer * n_layer):  # K of every layer, then V of every layer
            if at + 12 > len(state):
                raise KvStateError("the state ends inside its KV blocks")
            kind, row_bytes = struct.unpack_from("<iQ", state, at)
            if kind not in _TYPES or row_bytes % 2:
                raise KvStateError(f"a KV cache of ggml type {kind} is not converted (F16 and BF16 are)")
            n_bytes = cell_count * row_bytes
            if at + 12 + n_bytes > len(state):
                raise KvStateError("the state ends inside its KV data")
            blocks.append((at, at + 12, n_bytes))
            at += 12 + n_bytes
        filled_end = at
    return _Section(n_stream, filled_at, filled_end, at)


def _relayout(state: bytearray, sections: list[_Section], n_stream: int) -> bytearray:
    """The same cells under ``n_stream`` streams: the filled stream first, the rest empty
    (llama.cpp puts a sequence's cells in that sequence's own stream whatever their index)."""
    out = bytearray(state[:8])
    empty = struct.pack("<I", 0)
    for s in sections:
        out += struct.pack("<I", n_stream)
        if s.filled_at < 0:
            out += empty * n_stream
            continue
        out += state[s.filled_at : s.filled_end]  # its cell_count, metadata and data
        out += empty * (n_stream - 1)
    return out
