"""Functional API: every tigon op, plus Hugging Face-compatible call signatures."""

from __future__ import annotations

import torch

from tigon.kernels.ops.cpo import fused_linear_cpo
from tigon.kernels.ops.cross_entropy import cross_entropy
from tigon.kernels.ops.dpo import fused_linear_dpo
from tigon.kernels.ops.fp8_linear import fp8_linear
from tigon.kernels.ops.fused_add_rms_norm import fused_add_rms_norm
from tigon.kernels.ops.fused_linear_cross_entropy import fused_linear_cross_entropy
from tigon.kernels.ops.fused_linear_jsd import fused_linear_jsd
from tigon.kernels.ops.fused_linear_preference import sequence_logps
from tigon.kernels.ops.gated_activation import geglu, geglu_packed, swiglu, swiglu_packed
from tigon.kernels.ops.jsd import jsd
from tigon.kernels.ops.kl_divergence import kl_divergence
from tigon.kernels.ops.kto import fused_linear_kto
from tigon.kernels.ops.layer_norm import layer_norm
from tigon.kernels.ops.moe_experts import moe_experts
from tigon.kernels.ops.orpo import fused_linear_orpo
from tigon.kernels.ops.relu_squared import relu_squared
from tigon.kernels.ops.rms_norm import rms_norm
from tigon.kernels.ops.rope import rope
from tigon.kernels.ops.simpo import fused_linear_simpo

__all__ = [
    "apply_rotary_pos_emb",
    "apply_rotary_pos_emb_one",
    "cross_entropy",
    "fp8_linear",
    "fused_add_rms_norm",
    "fused_linear_cpo",
    "fused_linear_cross_entropy",
    "fused_linear_dpo",
    "fused_linear_jsd",
    "fused_linear_kto",
    "fused_linear_orpo",
    "fused_linear_simpo",
    "geglu",
    "geglu_packed",
    "jsd",
    "kl_divergence",
    "layer_norm",
    "moe_experts",
    "relu_squared",
    "rms_norm",
    "rope",
    "sequence_logps",
    "swiglu",
    "swiglu_packed",
]


def apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for `transformers.models.llama.modeling_llama.apply_rotary_pos_emb`.

    `cos`/`sin` are the rotary module's per-token `(B, S, D)` outputs; `position_ids` is accepted
    and ignored there, as in transformers. `unsqueeze_dim=2` means q/k are `(B, S, H, D)`; `unsqueeze_dim=0`
    takes `(S, D)` tables shared by the whole batch (Pixtral's vision tower), q/k `(B, H, S, D)`.
    """
    if unsqueeze_dim == 1 or (unsqueeze_dim == 0 and cos.dim() == 2):
        return rope(q, k, cos, sin)
    if unsqueeze_dim == 2:
        q_out, k_out = rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    raise ValueError(
        f"unsqueeze_dim must be 1 (q is B,H,S,D), 2 (q is B,S,H,D) or 0 (q is B,H,S,D and cos/sin are S,D tables), "
        f"got {unsqueeze_dim} with cos/sin of shape {tuple(cos.shape)}"
    )


def apply_rotary_pos_emb_one(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> torch.Tensor:
    """Drop-in for Gemma 4's one-tensor `apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim)`.

    Gemma 4 rotates queries and keys in separate calls (its key-sharing layers rotate no keys), so this runs
    tigon's RoPE on `x` alone: `x` as q, beside a key of zero heads that the kernel never reads.
    """
    none = x.narrow(2 if unsqueeze_dim == 2 else 1, 0, 0)
    return apply_rotary_pos_emb(x, none, cos, sin, unsqueeze_dim=unsqueeze_dim)[0]
