"""Squared ReLU, ``relu(x) ** 2``: the activation of Nemotron's ungated MLP (up_proj, relu², down_proj).

transformers computes it as ``relu`` then ``square``: autograd keeps relu's output, and the backward writes
the square's gradient and then relu's, each a tensor as large as the up-projection's output. Here one pass
writes the output, autograd keeps only the input, and one pass writes ``dx = 2 relu(x) dy``; with
``in_place_backward`` that gradient overwrites x (the up-projection's output, which nothing else reads).

Both passes compute in float32 and round once to the input dtype. One 1-D grid walks the flattened tensors with
64-bit offsets, so any shape and size works.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon.kernels import reference
from tigon.kernels.utils import LAUNCH_OPTIONS, check_float, use_triton

BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _forward_kernel(X, OUT, n_elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    x = tl.maximum(tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32), 0.0)
    tl.store(OUT + offsets, (x * x).to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _backward_kernel(GRAD, X, DX, n_elements, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    grad = tl.load(GRAD + offsets, mask=mask, other=0.0).to(tl.float32)
    x = tl.maximum(tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32), 0.0)
    tl.store(DX + offsets, (grad * x * 2.0).to(DX.dtype.element_ty), mask=mask)


def relu_squared_forward(x: torch.Tensor) -> torch.Tensor:
    """Launch the forward kernel on a contiguous `x`."""
    out = torch.empty_like(x)
    n = x.numel()
    if n > 0:
        _forward_kernel[(triton.cdiv(n, BLOCK),)](x, out, n, BLOCK=BLOCK, num_warps=NUM_WARPS, **LAUNCH_OPTIONS)
    return out


def relu_squared_backward(grad: torch.Tensor, x: torch.Tensor, in_place: bool) -> torch.Tensor:
    """Launch the backward kernel on contiguous tensors; with `in_place`, dx reuses x."""
    dx = x if in_place else torch.empty_like(x)
    n = x.numel()
    if n > 0:
        _backward_kernel[(triton.cdiv(n, BLOCK),)](grad, x, dx, n, BLOCK=BLOCK, num_warps=NUM_WARPS, **LAUNCH_OPTIONS)
    return dx


class ReLUSquaredFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, in_place_backward):
        ctx.save_for_backward(x)
        ctx.in_place = in_place_backward
        return relu_squared_forward(x.contiguous()).view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return relu_squared_backward(grad.contiguous(), x.contiguous(), ctx.in_place).view(x.shape), None


@torch.library.custom_op("tigon::relu_squared", mutates_args=())
def relu_squared_op(x: torch.Tensor) -> torch.Tensor:
    """`relu(x) ** 2` as an opaque op for torch.compile (out-of-place backward)."""
    return relu_squared_forward(x.contiguous()).view(x.shape)


@relu_squared_op.register_fake
def _(x):
    return x.new_empty(x.shape)


@torch.library.custom_op("tigon::relu_squared_backward", mutates_args=())
def relu_squared_backward_op(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return relu_squared_backward(grad.contiguous(), x.contiguous(), in_place=False).view(x.shape)


@relu_squared_backward_op.register_fake
def _(grad, x):
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _grad(ctx, grad):
    (x,) = ctx.saved_tensors
    return relu_squared_backward_op(grad, x)


relu_squared_op.register_autograd(_grad, setup_context=_setup)


def relu_squared(x: torch.Tensor, in_place_backward: bool = False) -> torch.Tensor:
    """`relu(x) ** 2` elementwise (transformers' `relu2`, `ReLUSquaredActivation`).

    A non-contiguous `x` is copied to contiguous memory first. `in_place_backward=True` (contiguous `x` only)
    writes the input's gradient into x's memory: the caller must not read x after the backward (fine for an
    up-projection's output, which nothing else reads).
    """
    check_float("x", x)
    if in_place_backward and not x.is_contiguous() and not torch.compiler.is_compiling():
        raise ValueError(
            "in_place_backward=True writes the gradient into x's memory, so x must be contiguous; call "
            ".contiguous() on it first or pass in_place_backward=False"
        )
    if not use_triton("relu_squared", x):
        return reference.relu_squared(x)
    if torch.compiler.is_compiling():  # an opaque op; the in-place backward is an eager-mode saving
        return relu_squared_op(x)
    return ReLUSquaredFunction.apply(x, in_place_backward)
