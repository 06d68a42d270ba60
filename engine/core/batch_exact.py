"""How long a verify batch may be, for each row to equal a single step, from a model's weight types.

Lossless speculation rests on one fact: row i of a k-row batch computes exactly what the i-th
of k single-token steps computes. ggml-cpu keeps that only where every matrix product takes
the same kernel for 1 row and for k rows. Which kernel it takes depends on the weight type,
on whether the weights were repacked (extra buffer types) and on the row count
(docs/facts.md, "verify batches vs single steps, by weight type"; read from
ggml-cpu.c ``ggml_compute_forward_mul_mat``, llamafile/sgemm.cpp, tiled/tiled.cpp and
repack.cpp of the llama.cpp that llama-cpp-python 0.3.36 vendors):

- F32, F16, BF16 (and IQ4_NL that was not repacked): llamafile's tinyBLAS from 2 rows on,
  ``vec_dot`` for 1 row; the two sum in different orders. Every published mixture keeps its
  router (``ffn_gate_inp``) in F32. Cure: a single step runs as 2 rows (the token again at
  the next position, both rows' logits asked for, the spare cell trimmed), so every batch
  takes tinyBLAS; exact at every row count then.
- K-quants and the IQ types of ggml's tiled kernels (Q2_K ... Q6_K, IQ4_XS, IQ1/2/3): the
  tiled kernel from 8 rows on, ``vec_dot`` below: at most 7 rows.
- Q4_K repacked for AVX2 (and Q2_K for AVX-512): the repacked GEMM takes rows in groups of 4,
  the GEMV the rest: at most 3 rows.
- Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, MXFP4, and the repacked Q4_0/IQ4_NL/MXFP4: exact at every
  row count measured (up to 64).

``scripts/batch_exactness.py`` measures these on small models of every type and prints this
module's prediction beside the measurement: rerun it when llama.cpp changes. Cheap at load:
the tensor index of the GGUF only, no probe.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .backend import cpu_flags
from .errors import PotluckError

UNLIMITED = 48  # the most rows a verify batch ever holds (flash attention, docs/facts.md §3)

# tinyBLAS from 2 rows, vec_dot for 1: exact once single steps run as 2 rows
TWO_ROW_TYPES = frozenset({"F32", "F16", "BF16", "IQ4_NL"})
# ggml's tiled kernels from 8 rows (tiled.cpp ggml_tiled_min_batch)
TILED_TYPES = frozenset({"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                         "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"})
TILED_MAX_ROWS = 7
# the same kernel at every row count
INVARIANT_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "MXFP4"})
REPACK_GEMM_MAX_ROWS = 3  # repack.cpp: GEMM over groups of 4 rows, GEMV for the rest

# tensors no matrix product reads (a token's row is looked up; a convolution; the cache)
NOT_MULTIPLIED = ("token_embd.weight", "ssm_conv1d.weight", "per_layer_token_embd.weight", "pos_embd.weight")


@dataclass(frozen=True)
class BatchExactness:
    """What keeps a model's verify batches exact: ``max_rows`` rows at most (1: none can be),
    and ``two_row_steps``: single steps run as 2 rows. ``reason`` says why, in one line."""

    max_rows: int
    two_row_steps: bool
    reason: str

    @property
    def speculates(self) -> bool:
        return self.max_rows >= 2

    def refusal(self, strategy: str) -> str:
        return (f"strategy {strategy!r} cannot be lossless on this model: {self.reason}; "
                f"use --strategy plain (scripts/batch_exactness.py measures it)")


FREE = BatchExactness(UNLIMITED, False, "every weight type exact at any batch")


def repacked_types(use_extra_bufts: bool, flags: frozenset[str]) -> frozenset[str]:
    """Types ggml-cpu repacks on this CPU (repack.cpp ``ggml_repack_get_optimal_repack_type``,
    x86 paths), where extra buffer types are on."""
    if not use_extra_bufts or "avx2" not in flags:
        return frozenset()
    types = {"Q4_0", "Q4_K", "IQ4_NL", "MXFP4"}
    if "avx512f" in flags:
        types.add("Q2_K")
    return frozenset(types)


def judge(types: dict[str, str], *, use_extra_bufts: bool, flags: frozenset[str] | None = None,
          machine: str | None = None) -> BatchExactness:
    """``types``: weight type name -> one tensor of that type (for the reason), over the
    tensors a matrix product reads."""
    flags = cpu_flags() if flags is None else flags
    machine = platform.machine() if machine is None else machine
    if machine not in ("x86_64", "AMD64"):
        return BatchExactness(1, False, f"ggml-cpu's kernels on {machine} were not checked row by row")
    repacked = repacked_types(use_extra_bufts, flags)
    max_rows, two_rows, why = UNLIMITED, False, []
    for t in sorted(types):
        name = types[t]
        if t in repacked and t in ("Q4_K", "Q2_K"):
            max_rows = min(max_rows, REPACK_GEMM_MAX_ROWS)
            why.append(f"{t} repacked ({name}): {REPACK_GEMM_MAX_ROWS} rows")
        elif t in TILED_TYPES:
            max_rows = min(max_rows, TILED_MAX_ROWS)
            why.append(f"{t} ({name}): {TILED_MAX_ROWS} rows")
        elif t in TWO_ROW_TYPES:  # repacked IQ4_NL is exact either way
            two_rows = True
            why.append(f"{t} ({name}): single steps as 2 rows")
        elif t not in INVARIANT_TYPES and t not in repacked:
            return BatchExactness(1, False, f"weights of type {t} ({name}) were not checked row by row")
    return BatchExactness(max_rows, two_rows, "; ".join(why)) if why else FREE


def weight_types(path: Path) -> dict[str, str]:
    """Type name -> one tensor of that type, over the tensors of ``path`` a matrix product reads
    (a tied output layer reads ``token_embd``; a filler layer's zeros read as zeros whatever
    the kernel)."""
    from .gguf_tools import tensor_index

    tensors = tensor_index(path)
    tied = not any(t.name == "output.weight" for t in tensors)
    out: dict[str, str] = {}
    for t in tensors:
        read_as_embd = tied and t.name == "token_embd.weight"
        if t.n_dims < 2 or t.zeroed or (t.name.endswith(NOT_MULTIPLIED) and not read_as_embd):
            continue
        out.setdefault(t.type_name, t.name)
    return out


def model_exactness(path: Path, *, use_extra_bufts: bool, recurrent: bool = False) -> BatchExactness:
    """``recurrent``: the model keeps a recurrent state (Mamba, Gated DeltaNet), which would
    take a spare row's token in for good: a model that needs 2-row steps then gets no exact
    verify batch (an F32 router, as every published Qwen3.5 MoE GGUF)."""
    exact = judge(weight_types(path), use_extra_bufts=use_extra_bufts)
    if exact.two_row_steps and recurrent:
        return BatchExactness(1, False, f"{exact.reason}, which a recurrent state cannot take "
                                        "(its single steps stay 1 row, docs/facts.md §37)")
    return exact


def combine(parts: Iterable[BatchExactness]) -> BatchExactness:
    """What keeps every part exact at once (a pipeline's stages, each judged on its own slice,
    weights and CPU): the shortest batch, and 2-row steps if any stage needs them."""
    parts = list(parts)
    if not parts:
        return FREE
    reasons = list(dict.fromkeys(p.reason for p in parts if p is not FREE and p.reason))
    joined = "; ".join(reasons) or FREE.reason
    max_rows = min(p.max_rows for p in parts)
    if max_rows < 2:  # the stages that cannot speculate say why, alone (each reason once)
        return BatchExactness(max_rows, False, "; ".join(dict.fromkeys(p.reason for p in parts if p.max_rows < 2)))
    return BatchExactness(max_rows, any(p.two_row_steps for p in parts), joined)


def check_speculation(exact: BatchExactness, strategy: str) -> None:
    """Refuse a speculative strategy no batch length keeps lossless, in one line."""
    if not exact.speculates:
        raise PotluckError(exact.refusal(strategy))
