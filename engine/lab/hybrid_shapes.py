"""Random-weight GGUFs in the shape of Qwen3.5's mixture-of-experts hybrid (``qwen35moe``).

Qwen3.5 MoE mixes three Gated DeltaNet layers (linear attention: a recurrent state per
sequence, no KV cell per position) with one gated full-attention layer
(``full_attention_interval`` 4), every layer a routed MoE (8 of 256 experts for 35B-A3B) plus a
sigmoid-gated shared expert, and one multi-token-prediction (MTP) block after the trunk. The
published 35B-A3B dimensions are :data:`HYBRID_SHAPES` ``"qwen35moe-35b-a3b"``; ``layers``
builds fewer trunk layers of the same width. ``"qwen35moe-small"`` is the test suite's.

The weights follow :mod:`.fixtures`' rule (a projection of a unit-RMS input has weights of std
1/sqrt(cols), so every output is of unit scale): activations stay finite at any depth. The
recurrent layers get decays and gates of real magnitudes (``ssm_a`` = -A with A in [1, 8],
``dt`` bias 1): the state forgets at a rate that depends on the token, and the router's
logits have a spread of about 1.5, so different tokens pick different experts.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..core.errors import ModelError
from ..core.gguf_tools import copy_fields
from ..core.paths import fixtures_dir
from .fixtures import LOGIT_STD, QK_GAIN, tensor_info, tensor_values, tokenizer_reader

log = logging.getLogger(__name__)

ARCH = "qwen35moe"
ROUTER_LOGIT_STD = 1.5  # spread of the router's logits: the top-k set changes token to token


@dataclass(frozen=True)
class HybridShape:
    """Qwen3.5 MoE's dimensions (names as in its config.json)."""

    n_layer: int  # trunk layers (num_hidden_layers)
    n_embd: int  # hidden_size
    n_head: int  # full attention: num_attention_heads
    n_head_kv: int
    head_dim: int  # full attention's head width (256 in every Qwen3.5)
    n_k_heads: int  # linear attention: linear_num_key_heads
    n_v_heads: int  # linear_num_value_heads
    ssm_head_dim: int  # linear_key_head_dim = linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim
    n_expert: int
    n_expert_used: int
    n_ff_exp: int  # moe_intermediate_size
    n_ff_shexp: int  # shared_expert_intermediate_size
    # the router's weights: "f32" as llama-quantize leaves them in every published GGUF, or
    # "q4_0". With F32, a batch computes the router's logits through llamafile's sgemm and a
    # single step through ggml's dot product, whose sums round differently: batches are then
    # not bit-identical to single steps (docs/facts.md §30), and no speculation is exact
    router: str = "f32"
    tied: bool = False  # the output matrix is token_embd (small Qwen3.5s) or its own (the MoEs)
    # scale of what each layer adds to the residual stream: below 1, the input token's own
    # embedding (and what attention copies) still shows in the logits at the end
    residual_gain: float = 1.0
    full_attention_interval: int = 4
    n_mtp: int = 1  # MTP blocks after the trunk (mtp_num_hidden_layers)
    rope_base: float = 10_000_000.0
    ctx_train: int = 262_144

    @property
    def n_rot(self) -> int:
        return self.head_dim // 4  # partial_rotary_factor 0.25

    @property
    def rope_sections(self) -> list[int]:
        """M-RoPE sections (t, h, w, 0) over n_rot / 2 frequencies: [11, 11, 10, 0] at 64."""
        half = self.n_rot // 2
        t = h = math.ceil(half / 3)
        return [t, h, half - t - h, 0]

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.ssm_head_dim

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.ssm_head_dim

    def is_recurrent(self, i: int) -> bool:
        return i < self.n_layer and (i + 1) % self.full_attention_interval != 0


HYBRID_SHAPES: dict[str, HybridShape] = {
    # Qwen/Qwen3.5-35B-A3B (and Qwen3.6-35B-A3B, the same shape)
    "qwen35moe-35b-a3b": HybridShape(40, 2048, 16, 2, 256, 16, 32, 128, 4, 256, 8, 512, 512),
    # the suite's: three full-attention layers (3, 7, 11) among nine recurrent ones, an MTP block,
    # a quantized router so that batches compute like single steps (the exactness it tests),
    # tied embeddings and a weak residual (its greedy replies repeat tokens: N-gram drafts happen)
    "qwen35moe-small": HybridShape(12, 256, 4, 2, 64, 2, 4, 64, 4, 8, 2, 128, 128, router="q4_0", tied=True,
                                    residual_gain=0.3),
}


def hybrid_shape_path(name: str, seed: int, n_layer: int | None = None) -> Path:
    depth = "" if n_layer is None else f"-{n_layer}l"
    return fixtures_dir() / f"{name}{depth}-q4_0-seed{seed}.gguf"


# (name, dims, how to fill it): dims (rows, cols) of a Q4_0 matrix, (n_expert, rows, cols) of
# Q4_0 experts, or an f32 vector / matrix shape; fill ("q4", std), ("normal", std),
# ("const", value) or ("neg_uniform", (lo, hi))
Spec = tuple[str, tuple[int, ...], tuple[str, object]]


def _layer_plan(s: HybridShape, i: int, *, mtp: bool = False) -> list[Spec]:
    e, g = s.n_embd, s.residual_gain
    blk = f"blk.{i}."
    out: list[Spec] = [
        (blk + "attn_norm.weight", (e,), ("const", 1.0)),
        (blk + "post_attention_norm.weight", (e,), ("const", 1.0)),
    ]
    if mtp or not s.is_recurrent(i):
        q, kv = s.n_head * s.head_dim, s.n_head_kv * s.head_dim
        qk = QK_GAIN * e ** -0.5
        out += [
            (blk + "attn_q.weight", (2 * q, e), ("q4", qk)),  # query and its output gate
            (blk + "attn_k.weight", (kv, e), ("q4", qk)),
            (blk + "attn_v.weight", (kv, e), ("q4", e ** -0.5)),
            (blk + "attn_output.weight", (e, q), ("q4", g * q ** -0.5)),
            (blk + "attn_q_norm.weight", (s.head_dim,), ("const", QK_GAIN)),
            (blk + "attn_k_norm.weight", (s.head_dim,), ("const", QK_GAIN)),
        ]
    else:
        conv_dim = 2 * s.key_dim + s.value_dim
        out += [
            (blk + "attn_qkv.weight", (conv_dim, e), ("q4", e ** -0.5)),
            (blk + "attn_gate.weight", (s.value_dim, e), ("q4", e ** -0.5)),
            (blk + "ssm_conv1d.weight", (conv_dim, s.conv_kernel), ("normal", s.conv_kernel ** -0.5)),
            (blk + "ssm_dt.bias", (s.n_v_heads,), ("const", 1.0)),
            (blk + "ssm_a", (s.n_v_heads,), ("neg_uniform", (1.0, 8.0))),
            (blk + "ssm_beta.weight", (s.n_v_heads, e), ("q4", e ** -0.5)),
            (blk + "ssm_alpha.weight", (s.n_v_heads, e), ("q4", e ** -0.5)),
            (blk + "ssm_norm.weight", (s.ssm_head_dim,), ("const", 1.0)),
            (blk + "ssm_out.weight", (e, s.value_dim), ("q4", g * s.value_dim ** -0.5)),
        ]
    router = "normal" if s.router == "f32" else "q4"
    out += [
        (blk + "ffn_gate_inp.weight", (s.n_expert, e), (router, ROUTER_LOGIT_STD * e ** -0.5)),
        (blk + "ffn_gate_exps.weight", (s.n_expert, s.n_ff_exp, e), ("q4", e ** -0.5)),
        (blk + "ffn_up_exps.weight", (s.n_expert, s.n_ff_exp, e), ("q4", e ** -0.5)),
        (blk + "ffn_down_exps.weight", (s.n_expert, e, s.n_ff_exp), ("q4", g * s.n_ff_exp ** -0.5)),
        (blk + "ffn_gate_inp_shexp.weight", (e,), ("normal", e ** -0.5)),
        (blk + "ffn_gate_shexp.weight", (s.n_ff_shexp, e), ("q4", e ** -0.5)),
        (blk + "ffn_up_shexp.weight", (s.n_ff_shexp, e), ("q4", e ** -0.5)),
        (blk + "ffn_down_shexp.weight", (e, s.n_ff_shexp), ("q4", g * s.n_ff_shexp ** -0.5)),
    ]
    if mtp:  # the next-token block: its own norms and the projection of [embedding, hidden]
        out += [
            (blk + "nextn.enorm.weight", (e,), ("const", 1.0)),
            (blk + "nextn.hnorm.weight", (e,), ("const", 1.0)),
            (blk + "nextn.eh_proj.weight", (e, 2 * e), ("q4", (2 * e) ** -0.5)),
        ]
    return out


def tensor_plan(s: HybridShape, n_vocab: int) -> list[Spec]:
    plan: list[Spec] = [("token_embd.weight", (n_vocab, s.n_embd), ("q4", LOGIT_STD / math.sqrt(s.n_embd)))]
    for i in range(s.n_layer):
        plan += _layer_plan(s, i)
    for i in range(s.n_layer, s.n_layer + s.n_mtp):
        plan += _layer_plan(s, i, mtp=True)
    plan.append(("output_norm.weight", (s.n_embd,), ("const", 1.0)))
    if not s.tied:
        plan.append(("output.weight", (n_vocab, s.n_embd), ("q4", LOGIT_STD / math.sqrt(s.n_embd))))
    return plan


def _add_hparams(w, s: HybridShape, n_vocab: int) -> None:  # noqa: ANN001 - gguf.GGUFWriter
    a = ARCH
    w.add_block_count(s.n_layer + s.n_mtp)
    w.add_uint32(f"{a}.nextn_predict_layers", s.n_mtp)
    w.add_context_length(s.ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_feed_forward_length(0)
    w.add_head_count(s.n_head)
    w.add_head_count_kv(s.n_head_kv)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_freq_base(s.rope_base)
    w.add_rope_dimension_count(s.n_rot)
    w.add_array(f"{a}.rope.dimension_sections", s.rope_sections)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(s.n_expert)
    w.add_expert_used_count(s.n_expert_used)
    w.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)
    w.add_uint32(f"{a}.expert_shared_feed_forward_length", s.n_ff_shexp)
    w.add_uint32(f"{a}.ssm.conv_kernel", s.conv_kernel)
    w.add_uint32(f"{a}.ssm.state_size", s.ssm_head_dim)
    w.add_uint32(f"{a}.ssm.group_count", s.n_k_heads)
    w.add_uint32(f"{a}.ssm.time_step_rank", s.n_v_heads)
    w.add_uint32(f"{a}.ssm.inner_size", s.value_dim)
    w.add_uint32(f"{a}.full_attention_interval", s.full_attention_interval)
    w.add_vocab_size(n_vocab)


def _values(rng: np.random.Generator, dims: tuple[int, ...], fill: tuple[str, object]) -> np.ndarray:
    """The shared builder's fills, and ``("neg_uniform", (lo, hi))``: a decay rate -A per head."""
    kind, arg = fill
    if kind == "neg_uniform":
        lo, hi = arg  # type: ignore[misc]
        return (-rng.uniform(lo, hi, size=dims)).astype(np.float32)
    return tensor_values(rng, dims, fill)  # type: ignore[arg-type]


def build_hybrid_shape(
    name: str, seed: int = 0, *, layers: int | None = None, src: Path | None = None, force: bool = False
) -> Path:
    """A GGUF with random weights in the shape ``name`` (:data:`HYBRID_SHAPES`), ``layers``
    trunk layers if given, the bundled model's tokenizer; the same bytes for the same seed."""
    import gguf

    if name not in HYBRID_SHAPES:
        raise ModelError(f"unknown shape {name!r}; pick one of {', '.join(HYBRID_SHAPES)}")
    s = HYBRID_SHAPES[name]
    if layers is not None:
        if layers < 1:
            raise ModelError(f"--layers must be at least 1, got {layers}")
        s = replace(s, n_layer=layers)
    dst = hybrid_shape_path(name, seed, layers)
    if dst.exists() and not force:
        return dst
    reader = tokenizer_reader(src)
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    log.info("building %s (%s, %d layers x %d) from random weights", dst.name, ARCH, s.n_layer, s.n_embd)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".part")
    w = gguf.GGUFWriter(str(tmp), arch=ARCH, use_temp_file=False)
    w.add_name(f"potluck random {ARCH} {name} (seed {seed})")
    _add_hparams(w, s, n_vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    copy_fields(reader, w, "tokenizer.")
    plan = tensor_plan(s, n_vocab)
    for tname, dims, fill in plan:
        tensor_info(w, tname, dims, fill)  # type: ignore[arg-type]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for i, (_, dims, fill) in enumerate(plan):
        w.write_tensor_data(_values(np.random.default_rng([seed, i]), dims, fill))
    w.close()
    tmp.replace(dst)
    return dst
