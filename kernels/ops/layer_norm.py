"""LayerNorm: y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias, one read and one write per pass.

Matches ``torch.nn.functional.layer_norm`` over the last dimension: statistics and the affine
transform run in float32 whatever the input dtype, and the output is cast once to the input dtype.
The row is held in registers, so the variance is taken around the already-known mean (two passes
over registers, not over memory), which stays exact for inputs with a large offset.

The forward kernel stores mean and rstd per row so the backward need not recompute them. The
backward kernel runs a persistent grid: each program walks a contiguous band of rows and keeps
its share of the weight and bias gradients in registers, so dW and dB cost two small partial-sum
matrices instead of a second pass over the activations. Rows 16384 wide and wider do not fit one
program with those accumulators (its registers spill): there dW and dB come from a kernel over blocks of
columns, and dx from one that walks each row's column chunks twice (row sums, then dx), one more read
of x and dy in all: 0.70 ms against the spilling kernel's 1.18 at 16384 x 16384 bf16 on an H200.
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
    persistent_grid,
    rows_view,
    use_triton,
)

MAX_HIDDEN = 65536


@triton.jit
def _layer_norm_forward_kernel(
    X,
    stride_x,
    Y,
    stride_y,
    W,
    B,
    MEAN,
    RSTD,
    n_rows,
    n_cols,
    eps,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]

    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    centered = tl.where(mask, x - mean[:, None], 0.0)
    rstd = tl.math.rsqrt(tl.sum(centered * centered, axis=1) / n_cols + eps)
    tl.store(MEAN + rows, mean, mask=row_mask)
    tl.store(RSTD + rows, rstd, mask=row_mask)

    y = centered * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_backward_kernel(
    DY,
    stride_dy,
    X,
    stride_x,
    W,
    MEAN,
    RSTD,
    DX,
    stride_dx,
    DW_PARTIAL,
    DB_PARTIAL,
    n_rows,
    n_cols,
    rows_per_program,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_BIAS:
        db = tl.zeros((BLOCK_N,), dtype=tl.float32)

    first_row = pid.to(tl.int64) * rows_per_program
    last_row = tl.minimum(first_row + rows_per_program, n_rows)
    for start in range(first_row, last_row, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < last_row
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if HAS_WEIGHT:
            grad_xhat = dy * w[None, :]
            dw += tl.sum(dy * xhat, axis=0)
        else:
            grad_xhat = dy
        if HAS_BIAS:
            db += tl.sum(dy, axis=0)
        grad_mean = tl.sum(grad_xhat, axis=1) / n_cols
        projection = tl.sum(grad_xhat * xhat, axis=1) / n_cols
        dx = rstd[:, None] * (grad_xhat - grad_mean[:, None] - xhat * projection[:, None])
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)

    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + pid.to(tl.int64) * n_cols + cols, dw, mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + pid.to(tl.int64) * n_cols + cols, db, mask=col_mask)


@triton.jit
def _layer_norm_backward_wide_dx_kernel(
    DY,
    stride_dy,
    X,
    stride_x,
    W,
    MEAN,
    RSTD,
    DX,
    stride_dx,
    n_cols,
    HAS_WEIGHT: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """dx of one row too wide to hold: its two row sums over column chunks, then dx chunk by chunk."""
    row = tl.program_id(0).to(tl.int64)
    mean = tl.load(MEAN + row)
    rstd = tl.load(RSTD + row)
    sum_grad = tl.zeros((CHUNK,), dtype=tl.float32)
    sum_projection = tl.zeros((CHUNK,), dtype=tl.float32)
    for start in range(0, n_cols, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        mask = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        grad_xhat = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            grad_xhat = grad_xhat * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        sum_grad += grad_xhat
        sum_projection += grad_xhat * xhat
    grad_mean = tl.sum(sum_grad, axis=0) / n_cols
    projection = tl.sum(sum_projection, axis=0) / n_cols
    for start in range(0, n_cols, CHUNK):  # the row's second read mostly hits the cache
        cols = start + tl.arange(0, CHUNK)
        mask = cols < n_cols
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        grad_xhat = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            grad_xhat = grad_xhat * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        xhat = (x - mean) * rstd
        dx = rstd * (grad_xhat - grad_mean - xhat * projection)
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_backward_wide_dwdb_kernel(
    DY,
    stride_dy,
    X,
    stride_x,
    MEAN,
    RSTD,
    DW_PARTIAL,
    DB_PARTIAL,
    n_rows,
    n_cols,
    rows_per_program,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """dW and dB partial sums of one block of columns over one band of rows (rows too wide to hold)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    band = tl.program_id(1).to(tl.int64)
    col_mask = cols < n_cols
    dw = tl.zeros((BLOCK_C,), dtype=tl.float32)
    db = tl.zeros((BLOCK_C,), dtype=tl.float32)
    first_row = band * rows_per_program
    last_row = tl.minimum(first_row + rows_per_program, n_rows)
    for start in range(first_row, last_row, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < last_row
        mask = row_mask[:, None] & col_mask[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            dw += tl.sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db += tl.sum(dy, axis=0)
    if HAS_WEIGHT:
        tl.store(DW_PARTIAL + band * n_cols + cols, dw, mask=col_mask)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + band * n_cols + cols, db, mask=col_mask)


# Rows this wide (next power of two) take the two wide-row kernels: one program holding the whole row and its
# dW/dB accumulators spills registers (measured 42% of copy at 16384 on an H200).
WIDE_BACKWARD_BLOCK = 16384
# Measured on an H200 at 16384 x 16384 bf16 (backward 1.18 ms in one spilling kernel): dx in 4096-column
# chunks with 16 warps 0.45 ms; dW/dB in (4 rows, 2048 columns) tiles, 4 warps, 4 programs per SM 0.25 ms.
WIDE_DX_CHUNK, WIDE_DX_WARPS = 4096, 16
WIDE_DWDB_TILE, WIDE_DWDB_WARPS = (4, 2048), 4  # (rows, columns) per step of the dW/dB kernel
WIDE_DWDB_PROGRAMS_PER_SM = 4

# Launch shapes by row width, measured on an H200 with benchmarks/tune.py (see RowKernelShapes).
LAUNCH_SHAPES = RowKernelShapes(
    forward={1024: (4, 4), 2048: (4, 4), 4096: (2, 8), 8192: (1, 8)},
    backward={1024: (4, 4, 4, 1), 2048: (4, 4, 2, 1), 4096: (2, 4, 2, 1), 8192: (1, 8, 2, 1)},
    wide_forward=(1, 8),
    narrow_backward_elements=4096,
)
_forward_config = LAUNCH_SHAPES.forward_config
_backward_config = LAUNCH_SHAPES.backward_config


def check_layer_norm_inputs(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> None:
    check_float("x", x)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must have a non-empty last (hidden) dimension, got shape {tuple(x.shape)}")
    check_vector("weight", weight, x.shape[-1], "the hidden size (x.shape[-1])")
    check_vector("bias", bias, x.shape[-1], "the hidden size (x.shape[-1])")
    check_same_device("x", x, weight=weight, bias=bias)
    if x.shape[-1] > MAX_HIDDEN:
        raise ValueError(
            f"hidden size {x.shape[-1]} is above the {MAX_HIDDEN} a single-pass LayerNorm kernel holds; "
            "use tigon.kernels.reference.layer_norm for such sizes"
        )


def layer_norm_forward(
    x2d: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel on a (rows, hidden) view; returns (y, mean, rstd)."""
    n_rows, n_cols = x2d.shape
    y = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    block_m, block_n, num_warps = _forward_config(n_cols)
    _layer_norm_forward_kernel[(triton.cdiv(n_rows, block_m),)](
        x2d,
        x2d.stride(0),
        y,
        y.stride(0),
        weight if weight is not None else x2d,
        bias if bias is not None else x2d,
        mean,
        rstd,
        n_rows,
        n_cols,
        eps,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        **LAUNCH_OPTIONS,
    )
    return y, mean, rstd


def layer_norm_backward(
    dy2d: torch.Tensor,
    x2d: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    in_place: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launch the backward kernel; returns (dx, dweight, dbias). With `in_place`, dx reuses dy's memory."""
    n_rows, n_cols = x2d.shape
    if in_place and dy2d.dtype == x2d.dtype and dy2d.is_contiguous():
        dx = dy2d
    else:
        dx = torch.empty_like(x2d)
    if triton.next_power_of_2(n_cols) >= WIDE_BACKWARD_BLOCK:
        partials = _wide_backward(dy2d, x2d, weight, bias, mean, rstd, dx)
    else:
        partials = _backward(dy2d, x2d, weight, bias, mean, rstd, dx)
    dweight = dbias = None
    if weight is not None and bias is not None and weight.dtype == bias.dtype:
        dweight, dbias = partials.sum(1).to(weight.dtype).unbind(0)
    else:
        dweight = partials[0].sum(0).to(weight.dtype) if weight is not None else None
        dbias = partials[1].sum(0).to(bias.dtype) if bias is not None else None
    return dx, dweight, dbias


def _backward(dy2d, x2d, weight, bias, mean, rstd, dx) -> torch.Tensor:
    """One persistent kernel: dx, and per program its rows' dW and dB sums; returns the (2, programs, hidden)
    partials (dW and dB share one buffer, so one reduction and one cast finish both)."""
    n_rows, n_cols = x2d.shape
    block_m, block_n, num_warps, num_stages, programs, rows_per_program = _backward_config(n_rows, n_cols, x2d.device)
    partials = torch.empty((2, programs, n_cols), dtype=torch.float32, device=x2d.device)
    _layer_norm_backward_kernel[(programs,)](
        dy2d,
        dy2d.stride(0),
        x2d,
        x2d.stride(0),
        weight if weight is not None else x2d,
        mean,
        rstd,
        dx,
        dx.stride(0),
        partials[0],
        partials[1],
        n_rows,
        n_cols,
        rows_per_program,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        **LAUNCH_OPTIONS,
    )
    return partials


def _wide_backward(dy2d, x2d, weight, bias, mean, rstd, dx) -> torch.Tensor:
    """Rows too wide to hold: dW and dB by blocks of columns first (dx may overwrite dy), then dx row by row."""
    n_rows, n_cols = x2d.shape
    block_m, block_c = WIDE_DWDB_TILE
    col_blocks = triton.cdiv(n_cols, block_c)
    bands, rows_per_program = persistent_grid(n_rows, block_m, WIDE_DWDB_PROGRAMS_PER_SM, x2d.device, col_blocks)
    partials = torch.empty((2, bands, n_cols), dtype=torch.float32, device=x2d.device)
    if weight is not None or bias is not None:
        _layer_norm_backward_wide_dwdb_kernel[(col_blocks, bands)](
            dy2d,
            dy2d.stride(0),
            x2d,
            x2d.stride(0),
            mean,
            rstd,
            partials[0],
            partials[1],
            n_rows,
            n_cols,
            rows_per_program,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            BLOCK_M=block_m,
            BLOCK_C=block_c,
            num_warps=WIDE_DWDB_WARPS,
            **LAUNCH_OPTIONS,
        )
    _layer_norm_backward_wide_dx_kernel[(n_rows,)](
        dy2d,
        dy2d.stride(0),
        x2d,
        x2d.stride(0),
        weight if weight is not None else x2d,
        mean,
        rstd,
        dx,
        dx.stride(0),
        n_cols,
        HAS_WEIGHT=weight is not None,
        CHUNK=WIDE_DX_CHUNK,
        num_warps=WIDE_DX_WARPS,
        **LAUNCH_OPTIONS,
    )
    return partials


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, in_place_backward):
        x2d = rows_view(x)
        y, mean, rstd = layer_norm_forward(x2d, weight, bias, eps)
        ctx.save_for_backward(x2d, weight, bias, mean, rstd)
        ctx.in_place = in_place_backward
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = layer_norm_backward(rows_view(dy), x2d, weight, bias, mean, rstd, ctx.in_place)
        return dx.view(dy.shape), dweight, dbias, None, None


@torch.library.custom_op("tigon::layer_norm", mutates_args=())
def layer_norm_op(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward as an opaque op for torch.compile: (y, mean, rstd)."""
    y, mean, rstd = layer_norm_forward(rows_view(x), weight, bias, eps)
    return y.view(x.shape), mean, rstd


@layer_norm_op.register_fake
def _(x, weight, bias, eps):
    rows = x.numel() // x.shape[-1]
    return x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("tigon::layer_norm_backward", mutates_args=())
def layer_norm_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) out of place; empty where there is no weight or bias."""
    dx, dweight, dbias = layer_norm_backward(rows_view(dy), rows_view(x), weight, bias, mean, rstd, in_place=False)
    if dbias is not None:
        dbias = dbias.clone()  # dweight and dbias share one buffer; an op's outputs may not alias
    return dx.view(x.shape), *(g if g is not None else x.new_empty(0) for g in (dweight, dbias))


@layer_norm_backward_op.register_fake
def _(dy, x, weight, bias, mean, rstd):
    return x.new_empty(x.shape), *(t.new_empty(t.shape) if t is not None else x.new_empty(0) for t in (weight, bias))


def _layer_norm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1], inputs[2], output[1], output[2])


def _layer_norm_grad(ctx, dy, *_):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = layer_norm_backward_op(dy, x, weight, bias, mean, rstd)
    return dx, dweight if weight is not None else None, dbias if bias is not None else None, None


layer_norm_op.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    in_place_backward: bool = False,
) -> torch.Tensor:
    """LayerNorm over the last dimension of `x`, as `torch.nn.functional.layer_norm`.

    `weight` and `bias` are each optional. `in_place_backward` writes the input gradient into the
    incoming gradient's memory, which saves one activation-sized buffer when nothing else reads
    that gradient.
    """
    check_layer_norm_inputs(x, weight, bias)
    if not use_triton("layer_norm", x):
        return reference.layer_norm(x, weight, bias, eps)
    if torch.compiler.is_compiling():
        return layer_norm_op(x, weight, bias, eps)[0]
    return LayerNormFunction.apply(x, weight, bias, eps, in_place_backward)
