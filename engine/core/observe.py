"""Reading tensors out of a running llama.cpp graph: ggml's own accessors (:func:`ggml`) and a
numba-compiled ``cb_eval`` callback (:func:`native_observer`) that copies named tensors into
:class:`ObservedBuffers` without entering Python (docs/facts.md §13).

Used by :class:`~.runtime.Context` to capture a stage's hidden states and to observe
attention rows (TriForce); nothing here decides what to observe.
"""

from __future__ import annotations

import ctypes
import importlib.util
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .errors import DecodeError

# --------------------------------------------------------------------------- ggml helpers for capture


def _ggml_base() -> ctypes.CDLL:
    # llama_cpp's own folder, found without importing it (runtime, backend and batch are its only importers)
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llama_cpp is not installed")
    libdir = Path(next(iter(spec.submodule_search_locations))).resolve() / "lib"
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        p = libdir / name
        if p.exists():
            lib = ctypes.CDLL(str(p))
            lib.ggml_get_name.restype = ctypes.c_char_p
            lib.ggml_get_name.argtypes = [ctypes.c_void_p]
            lib.ggml_nbytes.restype = ctypes.c_size_t
            lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
            lib.ggml_backend_tensor_get.restype = None
            lib.ggml_backend_tensor_get.argtypes = [
                ctypes.c_void_p,
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_size_t,
            ]
            return lib
    raise RuntimeError(f"libggml-base not found in {libdir}")


_ggml_lib: ctypes.CDLL | None = None


def ggml() -> ctypes.CDLL:
    global _ggml_lib
    if _ggml_lib is None:
        _ggml_lib = _ggml_base()
    return _ggml_lib


# --------------------------------------------------------------------------- native observer

_observer_lock = threading.Lock()
_observer_address: int | None = None
_functions: tuple[int, int, int, int] | None = None


def native_observer() -> int:
    """Address of a ``cb_eval`` callback compiled by numba that copies the named tensors
    without entering Python: llama.cpp asks about every graph node (~900 per step of a
    30-layer model), and a Python callback costs ~1 µs each plus the GIL.

    ``user_data`` points to the control block of an :class:`ObservedBuffers`. Once the
    stopping name is copied the callback returns false: llama.cpp skips the rest of the graph
    (a stage's capture: what follows its last layer is the unused output layer). Compiled once
    and cached on disk (observe_kernel.py); loading it costs a process numba's import."""
    global _observer_address
    with _observer_lock:
        if _observer_address is None:
            from .observe_kernel import observe

            _observer_address = int(observe.address)
        return _observer_address


def _function_addresses() -> tuple[int, int, int, int]:
    """This process's addresses of the C functions the callback calls (its control block's)."""
    global _functions
    if _functions is None:
        lib = ggml()
        libc = ctypes.CDLL(None)
        get_name, nbytes, tensor_get, strncmp = (
            ctypes.cast(f, ctypes.c_void_p).value or 0
            for f in (lib.ggml_get_name, lib.ggml_nbytes, lib.ggml_backend_tensor_get, libc.strncmp))
        if not (get_name and nbytes and tensor_get and strncmp):
            raise RuntimeError("ggml's tensor accessors or libc's strncmp have no address")
        _functions = (get_name, nbytes, tensor_get, strncmp)
    return _functions


class ObservedBuffers:
    """The control block and data regions :func:`native_observer` writes into."""

    def __init__(self, names: Sequence[str], region_bytes: int, stop: str | None = None) -> None:
        """``stop``: one of ``names`` after which the graph ends (the rest is not computed)."""
        from .observe_kernel import HEAD_WORDS, NAME_WORDS  # the block's layout is the callback's

        n = len(names)
        self.names = list(names)
        region_words = -(-region_bytes // 8)
        self._written_at = HEAD_WORDS + NAME_WORDS * n
        data_at = self._written_at + 3 * n
        self.ctl = np.zeros(data_at + n * region_words, dtype=np.int64)
        self.ctl[0], self.ctl[1] = n, len(self.ctl)
        self.ctl[2] = self.names.index(stop) if stop is not None else -1
        self.ctl[3:HEAD_WORDS] = _function_addresses()
        raw = self.ctl.view(np.uint8)
        for i, name in enumerate(names):
            encoded = name.encode()
            if len(encoded) >= NAME_WORDS * 8:
                raise ValueError(f"tensor name too long to observe: {name}")
            at = (HEAD_WORDS + NAME_WORDS * i) * 8
            raw[at : at + len(encoded)] = np.frombuffer(encoded, dtype=np.uint8)
            self.ctl[self._written_at + n + i] = (data_at + i * region_words) * 8  # byte offset
            self.ctl[self._written_at + 2 * n + i] = region_words * 8  # bytes
        self._raw = raw

    @property
    def address(self) -> int:
        return int(self.ctl.ctypes.data)

    def clear(self) -> None:
        n = len(self.names)
        self.ctl[self._written_at : self._written_at + n] = 0

    def rows(self, n_rows: int) -> dict[str, np.ndarray]:
        """Each name's rows of the last run, [n_rows, width] float32 (copies)."""
        n, out = len(self.names), {}
        for i, name in enumerate(self.names):
            size = int(self.ctl[self._written_at + i])
            if size < 0:
                raise DecodeError(f"tensor {name} is larger than its observation buffer")
            if size == 0:
                continue
            at = int(self.ctl[self._written_at + n + i])
            out[name] = self._raw[at : at + size].view(np.float32).reshape(n_rows, -1).copy()
        return out
