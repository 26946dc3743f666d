"""KL divergence `F.kl_div(input, target)` over rows of a vocabulary: one program per row, chunks of the row.

`input` holds the student's log-probabilities `x`, `target` the teacher's probabilities `y` (or their
logs `log y` with `log_target=True`). Pointwise, as in `F.kl_div`:

    log_target=False:  loss[j] = y[j] * log(y[j]) - y[j] * x[j]      (0 * log 0 = 0, torch's xlogy)
    log_target=True:   loss[j] = exp(y[j]) * (y[j] - x[j])

and the gradient with respect to the input is `-y[j]` (`-exp(y[j])`) times the reduction's factor and
the incoming gradient. For a reduced loss the forward writes that gradient while it reads both inputs,
and the backward only scales it by the incoming gradient (skipped when that is 1): one read of each
input and one write, where computing it in the backward would read the target a second time. With
reduction "none" the incoming gradient is one factor per element, so the forward keeps the target and
the backward reads it and that gradient and writes the result. The target gets no gradient.

Reductions as in `F.kl_div`: "batchmean" (sum / input.shape[0], the mathematically correct KL
divergence per sample), "sum", "mean" (sum / number of elements) and "none" (the pointwise loss).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from tigon.kernels import reference
from tigon.kernels.ops.cross_entropy import scale_saved_gradients
from tigon.kernels.utils import (
    DATA_COUNTS,
    LAUNCH_OPTIONS,
    check_float,
    check_same_device,
    eager_under_compile,
    multiprocessor_count,
    next_power_of_2,
    rows_view,
    use_triton,
    warps_for,
)

REDUCTIONS = ("batchmean", "sum", "mean", "none")
MAX_BLOCK_V = 4096  # vocabulary elements one program handles per step
PROGRAMS_PER_SM = 64
BACKWARD_BLOCK = 4096  # elements per program of the backward kernel


@triton.jit
def _pointwise(x, y, LOG_TARGET: tl.constexpr):
    if LOG_TARGET:
        return tl.exp(y) * (y - x)
    return y * tl.log(tl.where(y == 0.0, 1.0, y)) - y * x  # 0 * log 0 = 0; a negative y gives NaN, as in torch


@triton.jit(do_not_specialize=DATA_COUNTS)
def _kl_div_forward_kernel(
    X,
    stride_x,
    Y,
    stride_y,
    OUT,
    stride_out,
    GRAD,
    stride_grad,
    n_rows,
    n_cols,
    scale,
    LOG_TARGET: tl.constexpr,
    POINTWISE: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # Each program walks rows pid, pid + programs, ...; masked lanes read x = y = 0, whose loss is 0.
    # WRITE_GRAD: GRAD = d(reduced loss)/dx = -y * scale (-exp(y) * scale with LOG_TARGET).
    offsets = tl.arange(0, BLOCK_V)
    for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
        total = 0.0
        for start in range(0, n_cols, BLOCK_V):
            cols = start + offsets
            mask = cols < n_cols
            x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
            loss = _pointwise(x, y, LOG_TARGET)
            if WRITE_GRAD:
                p = tl.exp(y) if LOG_TARGET else y
                tl.store(GRAD + row * stride_grad + cols, (-p * scale).to(GRAD.dtype.element_ty), mask=mask)
            if POINTWISE:
                tl.store(OUT + row * stride_out + cols, loss.to(OUT.dtype.element_ty), mask=mask)
            else:
                total += tl.sum(loss, axis=0)
        if not POINTWISE:
            tl.store(OUT + row, total * scale)


@triton.jit
def _kl_div_backward_kernel(
    Y,
    stride_y,
    G,
    stride_g_row,
    stride_g_col,
    GRAD,
    stride_grad,
    n_cols,
    blocks_per_row,
    LOG_TARGET: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """GRAD[row, j] = -y[j] (or -exp(y[j])) * G[row, j]: reduction "none", G the pointwise incoming gradient
    (possibly broadcast: strides 0)."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // blocks_per_row
    cols = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    y = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g_row + cols * stride_g_col, mask=mask, other=0.0).to(tl.float32)
    if LOG_TARGET:
        y = tl.exp(y)
    tl.store(GRAD + row * stride_grad + cols, (-y * g).to(GRAD.dtype.element_ty), mask=mask)


def _reduction_scale(shape: torch.Size, reduction: str) -> float:
    if reduction == "batchmean":
        return 1.0 / shape[0]
    if reduction == "mean":
        return 1.0 / shape.numel()
    return 1.0


def _forward(
    x: torch.Tensor,
    y: torch.Tensor,
    shape: torch.Size,
    reduction: str,
    log_target: bool,
    grad: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reduced loss (float32) or, with reduction "none", the pointwise loss in the promoted dtype; with
    `grad` (a reduced loss only) also the loss's gradient with respect to `x`, written into it."""
    n_rows, n_cols = x.shape
    pointwise = reduction == "none"
    if pointwise:
        out = torch.empty((n_rows, n_cols), dtype=torch.promote_types(x.dtype, y.dtype), device=x.device)
    else:
        out = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    block_v = min(next_power_of_2(n_cols), MAX_BLOCK_V)
    programs = max(1, min(n_rows, multiprocessor_count(x.device) * PROGRAMS_PER_SM))
    _kl_div_forward_kernel[(programs,)](
        x,
        x.stride(0),
        y,
        y.stride(0),
        out,
        out.stride(0),
        grad if grad is not None else out,
        grad.stride(0) if grad is not None else 0,
        n_rows,
        n_cols,
        _reduction_scale(shape, reduction),
        LOG_TARGET=log_target,
        POINTWISE=pointwise,
        WRITE_GRAD=grad is not None,
        BLOCK_V=block_v,
        num_warps=warps_for(block_v),
        **LAUNCH_OPTIONS,
    )
    return out.view(shape) if pointwise else out.sum()


class KLDivergenceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, target, reduction, log_target):
        x, y = rows_view(input), rows_view(target)
        ctx.shape, ctx.dtype, ctx.reduction, ctx.log_target = input.shape, input.dtype, reduction, log_target
        if reduction == "none":
            ctx.save_for_backward(y)
            return _forward(x, y, input.shape, reduction, log_target)
        grad = torch.empty(x.shape, dtype=input.dtype, device=input.device)
        ctx.save_for_backward(grad)
        return _forward(x, y, input.shape, reduction, log_target, grad)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        if ctx.reduction != "none":
            (grad,) = scale_saved_gradients(ctx, "kl_divergence", grad_out)
            return grad.view(ctx.shape), None, None, None
        (y,) = ctx.saved_tensors
        n_rows, n_cols = y.shape
        g = grad_out.reshape(n_rows, n_cols)  # a view when it can be (also of a broadcast gradient)
        stride_row, stride_col = g.stride()
        grad = torch.empty((n_rows, n_cols), dtype=ctx.dtype, device=y.device)
        block = min(next_power_of_2(n_cols), BACKWARD_BLOCK)
        blocks_per_row = triton.cdiv(n_cols, block)
        _kl_div_backward_kernel[(n_rows * blocks_per_row,)](
            y,
            y.stride(0),
            g,
            stride_row,
            stride_col,
            grad,
            grad.stride(0),
            n_cols,
            blocks_per_row,
            LOG_TARGET=ctx.log_target,
            BLOCK=block,
            num_warps=min(8, warps_for(block)),
            **LAUNCH_OPTIONS,
        )
        return grad.view(ctx.shape), None, None, None


def check_kl_divergence_inputs(input: torch.Tensor, target: torch.Tensor, reduction: str, log_target: bool) -> None:
    """Raise a ValueError/TypeError that names the problem and the fix."""
    check_float("input", input)
    check_float("target", target)
    if input.dim() == 0 or input.numel() == 0:
        raise ValueError(
            f"input has shape {tuple(input.shape)}; it must be a non-empty tensor of log-probabilities "
            "(..., vocabulary), e.g. (tokens, vocabulary)"
        )
    if target.shape != input.shape:
        raise ValueError(
            f"target has shape {tuple(target.shape)} but input has shape {tuple(input.shape)}; pass the teacher's "
            "(log-)probabilities with the same shape as the student's log-probabilities (no broadcasting)"
        )
    check_same_device("input", input, target=target)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not one of {REDUCTIONS}")
    if not isinstance(log_target, bool):
        raise TypeError(f"log_target must be a bool, got {log_target!r}")
    if target.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            "target (the teacher's distribution) gets no gradient from tigon's kl_divergence; pass target.detach()"
        )


@eager_under_compile
def kl_divergence(
    input: torch.Tensor, target: torch.Tensor, *, reduction: str = "mean", log_target: bool = False
) -> torch.Tensor:
    """`F.kl_div(input, target, reduction=..., log_target=...)`: KL(target || exp(input)) over the last dimension.

    `input` is the student's log-probabilities `(..., V)` (e.g. `log_softmax(logits)`), `target` the
    teacher's probabilities of the same shape, or their logarithms with `log_target=True` (more
    accurate for small probabilities). Pointwise `target * (log(target) - input)`; `reduction` is
    "mean" (torch's default: sum / number of elements), "batchmean" (sum / input.shape[0], the true
    KL divergence per sample, what distillation wants), "sum" or "none" (pointwise, in the promoted
    dtype of the two inputs). Reduced losses are float32. Only `input` gets a gradient: pass a detached target.
    Inputs may be any float dtypes; rows that are not contiguous are copied.
    """
    check_kl_divergence_inputs(input, target, reduction, log_target)
    if not use_triton("kl_divergence", input):
        return reference.kl_divergence(input, target, reduction=reduction, log_target=log_target)
    if torch.is_grad_enabled() and input.requires_grad:
        return KLDivergenceFunction.apply(input, target, reduction, log_target)
    return _forward(rows_view(input), rows_view(target), input.shape, reduction, log_target)
