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


def check_target_range(target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """Raise if a target that is not `ignore_index` lies outside [0, n_classes): one device sync."""
    bad = (target != ignore_index) & ((target < 0) | (target >= n_classes))
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"target[{position}] = {int(target[position])} is out of range: targets must lie in [0, {n_classes}) "
            f"(the vocabulary size) or equal ignore_index={ignore_index}; fix the labels, or pass "
            "check_targets=False to skip this check (it costs one device sync; a row with a bad target then "
            "gets a NaN loss and a NaN gradient)"
        )


def _safe_divide(total: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """`total / denominator`, and 0 (with zero gradients, not NaN) where the denominator is 0."""
    nonzero = denominator != 0
    return torch.where(nonzero, total / torch.where(nonzero, denominator, 1), 0)


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    return_z_loss: bool = False,
    check_targets: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`F.cross_entropy` on logits `(N, V)` in at least float32, plus softcapping, z-loss and `num_items_in_batch`.

    - `softcap`: the logits become `softcap * tanh(logits / softcap)` first (Gemma 2).
    - The per-token loss is `F.cross_entropy(..., reduction="none")` (class weights and label
      smoothing exactly as torch applies them) plus the z-loss `lse_square_scale * logsumexp^2`
      (not class-weighted); ignored tokens contribute 0 to both.
    - `"mean"` divides the summed cross entropy by the sum of the target weights (the count of
      non-ignored tokens without weights) and the summed z-loss by the count, as torch and
      Liger-Kernel do; with `num_items_in_batch` both are divided by that number instead (what HF
      Trainer passes for gradient accumulation). All targets ignored gives 0, not NaN.
    - With `return_z_loss`, returns `(loss, z_loss)`: `loss` includes the z-loss; `z_loss` is reduced
      the same way and detached (for logging).
    """
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    target = target.long()
    if check_targets:
        check_target_range(target, x.shape[-1], ignore_index)
    class_weight = weight.to(x.dtype) if weight is not None else None
    valid = target != ignore_index
    ce = F.cross_entropy(
        x, target, weight=class_weight, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    z = lse_square_scale * torch.logsumexp(x, dim=-1).square() * valid
    if reduction == "none":
        loss, z_loss = ce + z, z
    elif reduction == "sum":
        loss, z_loss = ce.sum() + z.sum(), z.sum()
    else:
        if num_items_in_batch is not None:
            items = torch.as_tensor(num_items_in_batch, dtype=x.dtype, device=x.device)
            ce_denominator = z_denominator = items
        else:
            z_denominator = valid.sum().to(x.dtype)
            if class_weight is None:
                ce_denominator = z_denominator
            else:
                ce_denominator = torch.where(valid, class_weight[target.clamp(0, x.shape[-1] - 1)], 0).sum()
        loss, z_loss = _safe_divide(ce.sum(), ce_denominator), _safe_divide(z.sum(), z_denominator)
        loss = loss + z_loss
    return (loss, z_loss.detach()) if return_z_loss else loss


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    class_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    return_z_loss: bool = False,
    check_targets: bool = True,
    accumulate_in_fp32: bool = True,
    chunk_size: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`cross_entropy(F.linear(hidden, weight, bias), target, weight=class_weight, ...)`, full logits at once.

    `accumulate_in_fp32` and `chunk_size` only steer the fused op's memory use; they are accepted and
    ignored here so both take the same arguments.
    """
    return cross_entropy(
        F.linear(hidden, weight, bias),
        target,
        weight=class_weight,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
        lse_square_scale=lse_square_scale,
        softcap=softcap,
        num_items_in_batch=num_items_in_batch,
        return_z_loss=return_z_loss,
        check_targets=check_targets,
    )
