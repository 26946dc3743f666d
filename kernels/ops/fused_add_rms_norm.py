"""Residual add fused with RMSNorm: `s = x + residual; y = rms_norm(s)`, returning `(y, s)`.

A decoder layer adds the attention (or MLP) output to the residual stream and normalizes the
sum for the next block. Done apart, that is three passes over the activations; fused, the sum is
written once beside the normed output. Backward adds the residual stream's incoming gradient
to the norm's input gradient in the same pass, and both inputs receive that one gradient.
The kernels are RMSNorm's own (`rms_norm.py`), run with the residual enabled.
"""

from __future__ import annotations

import torch

from tigon.kernels import reference
from tigon.kernels.ops.rms_norm import check_rms_norm_inputs, rms_norm_backward, rms_norm_backward_op, rms_norm_forward
from tigon.kernels.utils import rows_view, use_triton


class FusedAddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, casting, in_place_backward):
        x2d = rows_view(x)
        y, rstd, new_residual = rms_norm_forward(x2d, weight, eps, offset, casting, residual2d=rows_view(residual))
        ctx.save_for_backward(new_residual, weight, rstd)
        ctx.offset, ctx.casting, ctx.in_place, ctx.x_shape = offset, casting, in_place_backward, x.shape
        ctx.set_materialize_grads(False)  # an unused new residual then costs no zero-filled read
        return y.view(*x.shape[:-1], y.shape[-1]), new_residual.view(x.shape)

    @staticmethod
    def backward(ctx, dy, dresidual):
        new_residual, weight, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(new_residual)
        dx, dweight = rms_norm_backward(
            rows_view(dy),
            new_residual,
            weight,
            rstd,
            ctx.offset,
            ctx.casting,
            ctx.in_place,
            grad_residual2d=rows_view(dresidual) if dresidual is not None else None,
        )
        dx = dx.view(ctx.x_shape)
        return dx, dx, dweight, None, None, None, None


@torch.library.custom_op("tigon::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, casting: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward as an opaque op for torch.compile: (y, x + residual, rstd); the backward is RMSNorm's op."""
    y, rstd, new_residual = rms_norm_forward(rows_view(x), weight, eps, offset, casting, residual2d=rows_view(residual))
    return y.view(*x.shape[:-1], y.shape[-1]), new_residual.view(x.shape), rstd


@fused_add_rms_norm_op.register_fake
def _(x, residual, weight, eps, offset, casting):
    dtype = torch.promote_types(weight.dtype, x.dtype) if weight is not None and casting != "gemma" else x.dtype
    rows = x.numel() // x.shape[-1]
    return x.new_empty(x.shape, dtype=dtype), x.new_empty(x.shape), x.new_empty(rows, dtype=torch.float32)


def _fused_add_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], inputs[2], output[2])
    ctx.offset, ctx.casting = inputs[4], inputs[5]


def _fused_add_grad(ctx, dy, dresidual, _):
    new_residual, weight, rstd = ctx.saved_tensors
    dx, dweight = rms_norm_backward_op(dy, new_residual, weight, rstd, ctx.offset, ctx.casting, dresidual)
    return dx, dx, dweight if weight is not None else None, None, None, None


fused_add_rms_norm_op.register_autograd(_fused_add_grad, setup_context=_fused_add_setup)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "llama",
    in_place_backward: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns `(rms_norm(x + residual), x + residual)`; options as in `rms_norm`."""
    check_rms_norm_inputs(x, weight, casting)
    if not isinstance(residual, torch.Tensor) or residual.shape != x.shape:
        shape = tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__
        raise ValueError(f"residual has shape {shape} but x has shape {tuple(x.shape)}; they must match")
    if residual.dtype != x.dtype:
        raise TypeError(f"residual has dtype {residual.dtype} but x has {x.dtype}; cast one to the other")
    if residual.device != x.device:
        raise ValueError(f"residual is on {residual.device} but x is on {x.device}; move it to x.device")
    if not use_triton("fused_add_rms_norm", x):
        return reference.fused_add_rms_norm(x, residual, weight, eps, offset, casting)
    if torch.compiler.is_compiling():
        return fused_add_rms_norm_op(x, residual, weight, eps, offset, casting)[:2]
    return FusedAddRMSNormFunction.apply(x, residual, weight, eps, offset, casting, in_place_backward)
