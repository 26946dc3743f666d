"""Pure-PyTorch references for every op: the oracle in tests and the fallback on CPU tensors.

Each follows the Hugging Face module it replaces operation by operation, casts included, so on
float64 inputs it is the exact function and on low-precision inputs it rounds where HF rounds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "llama",
) -> torch.Tensor:
    """Llama: `w * (x / rms(x)).to(x.dtype)`; Gemma: `(x / rms(x) * (offset + w)).to(x.dtype)`, in fp32."""
    input_dtype = x.dtype
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return normed.to(input_dtype)
    if casting == "gemma":
        return (normed * (offset + weight.to(normed.dtype))).to(input_dtype)
    return (offset + weight) * normed.to(input_dtype)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`s = x + residual`; returns `(rms_norm(s), s)`."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps, offset, casting), new_residual


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """`torch.nn.LayerNorm` over the last dimension."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding on q `(B, Hq, S, D)` and k `(B, Hk, S, D)`.

    `cos`/`sin` are `(B or 1, S, D)` per token, or, with `position_ids` `(B or 1, S)`, tables of
    shape `(max_positions, D)` indexed by position (packed sequences restart their positions).
    """
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, None], sin[:, None]
    q_out = q * cos.to(q.dtype) + rotate_half(q) * sin.to(q.dtype)
    k_out = k * cos.to(k.dtype) + rotate_half(k) * sin.to(k.dtype)
    return q_out, k_out


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`."""
    return F.silu(gate) * up


def geglu(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """`gelu(gate) * up`, with the tanh approximation or the exact erf form (`approximate="none"`)."""
    return F.gelu(gate, approximate=approximate) * up
