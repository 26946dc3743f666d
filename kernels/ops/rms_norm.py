"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * (offset + weight), one read and one write per pass.

Three casting conventions, the first two exact matches of their Hugging Face modules:
- ``"llama"``: normalize in float32, cast to the input dtype, then multiply by the weight.
- ``"gemma"``: normalize and scale in float32, cast once at the end (Gemma also uses offset 1).
- ``"none"``: no casts, the module written plainly in the input's dtype (Liger-Kernel's casting mode of that
  name): each step (square, mean, ``+ eps``, rsqrt, the product with the weight) is rounded to the input dtype
  where PyTorch rounds it; the kernel computes each step in float32 and rounds it there. The backward is
  Llama's, from the rounded ``rstd`` and normalized rows the forward used.

The forward kernel also serves the fused residual add (``fused_add_rms_norm.py``): with
``HAS_RESIDUAL`` it adds the residual first and writes the new residual stream beside the output.
The backward kernel runs a persistent grid: each program walks a contiguous band of rows and
keeps its share of the weight gradient in registers, so dW costs one small partial-sum matrix
instead of a second pass over the activations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon.kernels import reference
from tigon.kernels.utils import (
    LAUNCH_OPTIONS,
    RowKernelShapes,
    check_float,
    check_same_device,
    check_vector,
    rows_view,
    use_triton,
)

CASTING_MODES = ("llama", "gemma", "none")
MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_forward_kernel(
    X,
    stride_x,
    R,
    stride_r,
    S,
    stride_s,
    Y,
    stride_y,
    W,
    RSTD,
    n_rows,
    n_cols,
    eps,
    offset,
    HAS_WEIGHT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    GEMMA_CASTING: tl.constexpr,
    NO_CASTING: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]

    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(S + rows[:, None] * stride_s + cols[None, :], x, mask=mask)
    x = x.to(tl.float32)
    if NO_CASTING:  # every step rounded to the input dtype, as PyTorch computes the module in that dtype
        dtype = X.dtype.element_ty
        square = (x * x).to(dtype).to(tl.float32)
        mean_square = (tl.sum(square, axis=1) / n_cols).to(dtype).to(tl.float32)
        rstd = tl.math.rsqrt((mean_square + eps).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    else:
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    normed = x * rstd[:, None]

    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32) + offset
        if GEMMA_CASTING:
            y = normed * w[None, :]
        else:
            if NO_CASTING:  # offset + weight in the weight's dtype
                w = w.to(W.dtype.element_ty).to(tl.float32)
            y = normed.to(X.dtype.element_ty).to(tl.float32) * w[None, :]
    else:
        y = normed
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_backward_kernel(
    DY,
    stride_dy,
    X,
    stride_x,
    W,
    RSTD,
    DS,
    stride_ds,
    DX,
    stride_dx,
    DW_PARTIAL,
    n_rows,
    n_cols,
    offset,
    rows_per_program,
    HAS_WEIGHT: tl.constexpr,
    HAS_DS: tl.constexpr,
    GEMMA_CASTING: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + offset
        dw = tl.zeros((BLOCK_N,), dtype=tl.float32)

    first_row = pid.to(tl.int64) * rows_per_program
    last_row = tl.minimum(first_row + rows_per_program, n_rows)
    for start in range(first_row, last_row, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < last_row
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        normed = x * rstd[:, None]
        if HAS_WEIGHT:
            grad_normed = dy * w[None, :]
            if GEMMA_CASTING:
                dw += tl.sum(dy * normed, axis=0)
            else:
                dw += tl.sum(dy * normed.to(X.dtype.element_ty).to(tl.float32), axis=0)
        else:
            grad_normed = dy
        projection = tl.sum(grad_normed * normed, axis=1) / n_cols
        dx = rstd[:, None] * (grad_normed - normed * projection[:, None])
        if HAS_DS:
            dx += tl.load(DS + rows[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)

    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw, mask=col_mask)


# Launch shapes by row width, measured on an H200 with benchmarks/tune.py (see RowKernelShapes).
LAUNCH_SHAPES = RowKernelShapes(
    forward={1024: (4, 4), 2048: (4, 4), 4096: (2, 16), 8192: (1, 16)},
    backward={1024: (4, 4, 4, 1), 2048: (4, 4, 2, 1), 4096: (4, 8, 1, 2), 8192: (2, 16, 2, 1)},
    wide_forward=(1, 16),
    wide_backward=(1, 16, 2, 1),
)
_forward_config = LAUNCH_SHAPES.forward_config
_backward_config = LAUNCH_SHAPES.backward_config


def check_rms_norm_inputs(x: torch.Tensor, weight: torch.Tensor | None, casting: str) -> None:
    check_float("x", x)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last (hidden) dimension, got shape {tuple(x.shape)}")
    check_vector("weight", weight, x.shape[-1], "the hidden size (x.shape[-1])")
    check_same_device("x", x, weight=weight)
    if casting not in CASTING_MODES:
        raise ValueError(f"casting={casting!r} is not one of {CASTING_MODES}")
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(
            f"hidden size {x.shape[-1]} is above the {MAX_HIDDEN} a single-pass RMSNorm kernel holds; "
            "use tigon.kernels.reference.rms_norm for such sizes"
        )


def rms_norm_forward(
    x2d: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    offset: float,
    casting: str,
    residual2d: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch the forward kernel on a (rows, hidden) view; returns (y, rstd, new_residual)."""
    n_rows, n_cols = x2d.shape
    out_dtype = x2d.dtype
    if weight is not None and casting != "gemma":
        out_dtype = torch.promote_types(weight.dtype, x2d.dtype)
    y = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x2d.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    new_residual = torch.empty_like(x2d) if residual2d is not None else None
    block_m, block_n, num_warps = _forward_config(n_cols)
    _rms_norm_forward_kernel[(triton.cdiv(n_rows, block_m),)](
        x2d,
        x2d.stride(0),
        residual2d if residual2d is not None else x2d,
        residual2d.stride(0) if residual2d is not None else 0,
        new_residual if new_residual is not None else x2d,
        new_residual.stride(0) if new_residual is not None else 0,
        y,
        y.stride(0),
        weight if weight is not None else x2d,
        rstd,
        n_rows,
        n_cols,
        eps,
        offset,
        HAS_WEIGHT=weight is not None,
        HAS_RESIDUAL=residual2d is not None,
        GEMMA_CASTING=casting == "gemma",
        NO_CASTING=casting == "none",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        **LAUNCH_OPTIONS,
    )
    return y, rstd, new_residual


def rms_norm_backward(
    dy2d: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    casting: str,
    in_place: bool,
    grad_residual2d: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the backward kernel; returns (dx, dweight). With `in_place`, dx reuses dy's memory."""
    n_rows, n_cols = x2d.shape
    if in_place and dy2d.dtype == x2d.dtype and dy2d.is_contiguous():
        dx = dy2d
    else:
        dx = torch.empty_like(x2d)
    block_m, block_n, num_warps, num_stages, programs, rows_per_program = _backward_config(n_rows, n_cols, x2d.device)
    dw_partial = None
    if weight is not None:
        dw_partial = torch.empty((programs, n_cols), dtype=torch.float32, device=x2d.device)
    _rms_norm_backward_kernel[(programs,)](
        dy2d,
        dy2d.stride(0),
        x2d,
        x2d.stride(0),
        weight if weight is not None else x2d,
        rstd,
        grad_residual2d if grad_residual2d is not None else x2d,
        grad_residual2d.stride(0) if grad_residual2d is not None else 0,
        dx,
        dx.stride(0),
        dw_partial if dw_partial is not None else rstd,
        n_rows,
        n_cols,
        offset,
        rows_per_program,
        HAS_WEIGHT=weight is not None,
        HAS_DS=grad_residual2d is not None,
        GEMMA_CASTING=casting == "gemma",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        **LAUNCH_OPTIONS,
    )
    dweight = dw_partial.sum(0).to(weight.dtype) if weight is not None else None
    return dx, dweight


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset, casting, in_place_backward):
        x2d = rows_view(x)
        y, rstd, _ = rms_norm_forward(x2d, weight, eps, offset, casting)
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.offset, ctx.casting, ctx.in_place = offset, casting, in_place_backward
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, rstd = ctx.saved_tensors
        dx, dweight = rms_norm_backward(rows_view(dy), x2d, weight, rstd, ctx.offset, ctx.casting, ctx.in_place)
        return dx.view(dy.shape), dweight, None, None, None, None


@torch.library.custom_op("tigon::rms_norm", mutates_args=())
def rms_norm_op(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward as an opaque op for torch.compile: returns (y, rstd)."""
    y, rstd, _ = rms_norm_forward(rows_view(x), weight, eps, offset, casting)
    return y.view(*x.shape[:-1], y.shape[-1]), rstd


@rms_norm_op.register_fake
def _(x, weight, eps, offset, casting):
    dtype = torch.promote_types(weight.dtype, x.dtype) if weight is not None and casting != "gemma" else x.dtype
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@torch.library.custom_op("tigon::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    offset: float,
    casting: str,
    grad_residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dweight) out of place (plus `grad_residual` for the fused add); dweight is empty without a weight."""
    dx, dweight = rms_norm_backward(
        rows_view(dy),
        rows_view(x),
        weight,
        rstd,
        offset,
        casting,
        in_place=False,
        grad_residual2d=rows_view(grad_residual) if grad_residual is not None else None,
    )
    return dx.view(x.shape), dweight if dweight is not None else x.new_empty(0)


@rms_norm_backward_op.register_fake
def _(dy, x, weight, rstd, offset, casting, grad_residual=None):
    return x.new_empty(x.shape), weight.new_empty(weight.shape) if weight is not None else x.new_empty(0)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, _, offset, casting = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.offset, ctx.casting = offset, casting


def _rms_norm_grad(ctx, dy, _):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = rms_norm_backward_op(dy, x, weight, rstd, ctx.offset, ctx.casting)
    return dx, dweight if weight is not None else None, None, None, None


rms_norm_op.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "llama",
    in_place_backward: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last dimension of `x`.

    `weight=None` gives the weightless variant; Gemma is `offset=1.0, casting="gemma"`; `casting="none"` computes
    the plain module in the input's dtype, rounding where PyTorch would (the module docstring).
    `in_place_backward` writes the input gradient into the incoming gradient's memory, which
    saves one activation-sized buffer when nothing else reads that gradient.
    """
    check_rms_norm_inputs(x, weight, casting)
    if not use_triton("rms_norm", x):
        return reference.rms_norm(x, weight, eps, offset, casting)
    if torch.compiler.is_compiling():  # an opaque op, out-of-place backward: no graph break
        return rms_norm_op(x, weight, eps, offset, casting)[0]
    return RMSNormFunction.apply(x, weight, eps, offset, casting, in_place_backward)
