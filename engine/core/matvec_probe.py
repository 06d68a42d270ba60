"""How fast this machine runs llama.cpp's own kernel for a decode step: ggml's Q4_0
matrix-vector product, timed through ``libggml`` by ctypes.

A decode step is mostly such products over weights streamed from memory. numpy's float
multiply-adds over 1 MiB, the speed score until protocol 16, moved 1.4x between hosts of the
same kind while decoding did not (docs/facts.md §33): how float SIMD compares with llama.cpp's
integer dot products depends on the CPU. This times the integer kernel itself, with the
threads llama.cpp will use, over a matrix larger than a core's caches. No model is mapped:
ggml computes on a matrix of its own, filled here.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import time
from pathlib import Path

import numpy as np

from .errors import PotluckError

GGML_TYPE_F32, GGML_TYPE_Q4_0 = 0, 2
Q4_0_BLOCK = (32, 18)  # weights, bytes: an F16 scale and 16 bytes of 4-bit weights
PROBE_COLS, PROBE_ROWS = 4096, 8192  # 18.9 MB of Q4_0: past a core's L2, as a model's layers are


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


@functools.cache
def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """libggml-base and libggml-cpu from llama-cpp-python's package (not importing it: a
    worker measures at start and maps no model itself)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise PotluckError("llama-cpp-python is not installed: reinstall potluck")
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    try:
        base = ctypes.CDLL(str(lib / "libggml-base.so"))
        cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"))
    except OSError as e:
        raise PotluckError(f"cannot load llama.cpp's ggml libraries from {lib}: {e}") from None
    vp = ctypes.c_void_p
    base.ggml_init.restype, base.ggml_init.argtypes = vp, [_InitParams]
    base.ggml_new_tensor_2d.restype = vp
    base.ggml_new_tensor_2d.argtypes = [vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    base.ggml_mul_mat.restype, base.ggml_mul_mat.argtypes = vp, [vp, vp, vp]
    base.ggml_new_graph.restype, base.ggml_new_graph.argtypes = vp, [vp]
    base.ggml_build_forward_expand.restype, base.ggml_build_forward_expand.argtypes = None, [vp, vp]
    base.ggml_get_data.restype, base.ggml_get_data.argtypes = vp, [vp]
    base.ggml_free.restype, base.ggml_free.argtypes = None, [vp]
    cpu.ggml_graph_compute_with_ctx.restype = ctypes.c_int
    cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
    cpu.ggml_cpu_init.restype, cpu.ggml_cpu_init.argtypes = None, []
    cpu.ggml_cpu_init()
    return base, cpu


def q4_0_matvec_gbps(threads: int, trials: int) -> float:
    """Q4_0 weight bytes per second through ggml's matrix-vector product on ``threads``
    threads, the best of ``trials`` (the best: other processes and cold pages only slow it)."""
    base, cpu = _libs()
    per_block, block_bytes = Q4_0_BLOCK
    n_bytes = PROBE_COLS * PROBE_ROWS // per_block * block_bytes
    ctx = base.ggml_init(_InitParams(n_bytes + (16 << 20), None, False))
    if not ctx:
        raise PotluckError("ggml could not allocate the speed probe's matrix")
    try:
        w = base.ggml_new_tensor_2d(ctx, GGML_TYPE_Q4_0, PROBE_COLS, PROBE_ROWS)
        x = base.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, PROBE_COLS, 1)
        blocks = np.ctypeslib.as_array((ctypes.c_uint8 * n_bytes).from_address(base.ggml_get_data(w)))
        blocks = blocks.reshape(-1, block_bytes)
        # one random block everywhere: the kernel reads every byte alike, whatever its value
        quants = np.random.default_rng(0).integers(0, 256, block_bytes - 2, dtype=np.uint8)
        blocks[:, 2:] = quants
        blocks[:, :2] = np.frombuffer(np.float16(1 / 64).tobytes(), np.uint8)  # finite scales
        np.ctypeslib.as_array((ctypes.c_float * PROBE_COLS).from_address(base.ggml_get_data(x)))[:] = 1.0
        y = base.ggml_mul_mat(ctx, w, x)
        rows = np.ctypeslib.as_array((ctypes.c_float * PROBE_ROWS).from_address(base.ggml_get_data(y)))
        rows[:] = np.nan  # the memory may hold an earlier probe's rows: only a product can pass the check
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, y)
        best = float("inf")
        for _ in range(max(1, trials)):
            t0 = time.perf_counter()
            if cpu.ggml_graph_compute_with_ctx(ctx, graph, max(1, threads)) != 0:
                raise PotluckError("ggml failed to compute the speed probe")
            best = min(best, time.perf_counter() - t0)
        # every row is the sum of its weights, (nibble - 8) / 64 each: a library whose structures
        # differ from these (another llama-cpp-python) computes something else, and says so here
        nibbles = np.concatenate([quants & 15, quants >> 4]).astype(np.int64) - 8
        expected = PROBE_COLS // per_block * int(nibbles.sum()) / 64
        if not np.allclose(rows, expected, rtol=1e-2, atol=0.5):
            raise PotluckError(f"llama.cpp's speed probe computed {rows[0]:g} where {expected:g} was due: "
                               "reinstall potluck (llama-cpp-python's ggml is not the one it was built for)")
        return n_bytes / best / 1e9
    finally:
        base.ggml_free(ctx)
