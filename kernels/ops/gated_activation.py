"""Gated MLP activations: SwiGLU ``silu(gate) * up`` and GeGLU ``gelu(gate) * up``, one pass each way.

The forward reads gate and up once and writes the product; eager PyTorch instead writes the
activation to memory and reads it back for the multiply. The backward recomputes the activation
from gate instead of saving it, so autograd keeps only gate and up, and reads grad, gate and up
once to write dgate and dup. With ``in_place_backward`` those two gradients overwrite gate and up,
which saves two activation-sized buffers at the MLP's peak memory (Liger-Kernel always does this).

Everything is computed in float32 and rounded once to the input dtype; the derivatives are the
exact ones, not approximations. The tanh GELU uses ``0.5 * (1 + tanh(z)) = sigmoid(2z)`` (and
``1 - tanh(z)^2 = 4 s (1 - s)``), the same function without the cancellation of ``1 + tanh`` near -1.
One 1-D grid walks the flattened tensors with 64-bit offsets, so any shape and any size works.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon.kernels import reference
from tigon.kernels.utils import check_float, check_same_device, use_triton

APPROXIMATIONS = {"tanh": "gelu_tanh", "none": "gelu_erf"}
BLOCK = 4096
NUM_WARPS = 8

TWO_SQRT_2_OVER_PI = tl.constexpr(1.5957691216057308)  # 2 * sqrt(2 / pi): tanh(z) = 2 sigmoid(2z) - 1
GELU_CUBIC = tl.constexpr(0.044715)
THREE_GELU_CUBIC = tl.constexpr(0.134145)
INV_SQRT_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


# Constants multiply tensors from the right: the interpreter's `constexpr * tensor` is not a tensor.


@triton.jit
def _activation(g, ACTIVATION: tl.constexpr):
    """act(g) on float32 values."""
    if ACTIVATION == "silu":
        act = g * tl.sigmoid(g)
    elif ACTIVATION == "gelu_tanh":
        act = g * tl.sigmoid(g * (1.0 + g * g * GELU_CUBIC) * TWO_SQRT_2_OVER_PI)
    else:
        act = 0.5 * g * (1.0 + tl.math.erf(g * INV_SQRT_2))
    return act


@triton.jit
def _activation_and_derivative(g, ACTIVATION: tl.constexpr):
    """(act(g), act'(g)) on float32 values."""
    if ACTIVATION == "silu":
        s = tl.sigmoid(g)
        act = g * s
        derivative = s * (1.0 + g * (1.0 - s))
    elif ACTIVATION == "gelu_tanh":
        g2 = g * g
        s = tl.sigmoid(g * (1.0 + g2 * GELU_CUBIC) * TWO_SQRT_2_OVER_PI)
        act = g * s
        derivative = s * (1.0 + g * (1.0 - s) * (1.0 + g2 * THREE_GELU_CUBIC) * TWO_SQRT_2_OVER_PI)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(g * INV_SQRT_2))
        act = g * cdf
        derivative = cdf + g * tl.exp(-0.5 * g * g) * INV_SQRT_2PI
    return act, derivative


@triton.jit
def _gated_forward_kernel(GATE, UP, OUT, n_elements, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    g = tl.load(GATE + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offsets, mask=mask, other=0.0).to(tl.float32)
    out = _activation(g, ACTIVATION) * u
    tl.store(OUT + offsets, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _gated_backward_kernel(GRAD, GATE, UP, DGATE, DUP, n_elements, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    grad = tl.load(GRAD + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GATE + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offsets, mask=mask, other=0.0).to(tl.float32)
    act, derivative = _activation_and_derivative(g, ACTIVATION)
    tl.store(DGATE + offsets, (grad * u * derivative).to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + offsets, (grad * act).to(DUP.dtype.element_ty), mask=mask)


def gated_forward(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """Launch the forward kernel on contiguous `gate` and `up`; returns act(gate) * up."""
    out = torch.empty_like(gate)
    n = gate.numel()
    if n > 0:
        _gated_forward_kernel[(triton.cdiv(n, BLOCK),)](
            gate, up, out, n, ACTIVATION=activation, BLOCK=BLOCK, num_warps=NUM_WARPS
        )
    return out


def gated_backward(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str, in_place: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel on contiguous tensors; with `in_place`, (dgate, dup) reuse (gate, up)."""
    dgate, dup = (gate, up) if in_place else (torch.empty_like(gate), torch.empty_like(up))
    n = gate.numel()
    if n > 0:
        _gated_backward_kernel[(triton.cdiv(n, BLOCK),)](
            grad, gate, up, dgate, dup, n, ACTIVATION=activation, BLOCK=BLOCK, num_warps=NUM_WARPS
        )
    return dgate, dup


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte of memory."""
    a_start, b_start = a.data_ptr(), b.data_ptr()
    return a_start < b_start + b.nbytes and b_start < a_start + a.nbytes


def check_gated_inputs(gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool) -> None:
    check_float("gate", gate)
    check_float("up", up)
    if gate.dtype != up.dtype:
        raise TypeError(f"gate has dtype {gate.dtype} but up has dtype {up.dtype}; cast one to the other's dtype")
    check_same_device("gate", gate, up=up)
    if gate.shape != up.shape:
        raise ValueError(
            f"gate has shape {tuple(gate.shape)} but up has shape {tuple(up.shape)}; they must have the same shape"
        )
    if in_place_backward and not torch.compiler.is_compiling():  # compiled code never writes in place
        if not (gate.is_contiguous() and up.is_contiguous()):
            raise ValueError(
                "in_place_backward=True writes the gradients into gate's and up's memory, so both must be "
                "contiguous; call .contiguous() on them first or pass in_place_backward=False"
            )
        if gate.numel() > 0 and _overlap(gate, up):
            raise ValueError(
                "in_place_backward=True needs gate and up in separate memory (the gradients overwrite them); "
                "pass in_place_backward=False"
            )


class GatedActivationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, activation, in_place_backward):
        out = gated_forward(gate.contiguous(), up.contiguous(), activation)
        ctx.save_for_backward(gate, up)
        ctx.activation, ctx.in_place = activation, in_place_backward
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        dgate, dup = gated_backward(grad.contiguous(), gate.contiguous(), up.contiguous(), ctx.activation, ctx.in_place)
        return dgate.view(gate.shape), dup.view(up.shape), None, None


@torch.library.custom_op("tigon::gated_activation", mutates_args=())
def gated_op(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """`act(gate) * up` as an opaque op for torch.compile (out-of-place backward)."""
    return gated_forward(gate.contiguous(), up.contiguous(), activation).view(gate.shape)


@gated_op.register_fake
def _(gate, up, activation):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("tigon::gated_activation_backward", mutates_args=())
def gated_backward_op(
    grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str
) -> tuple[torch.Tensor, torch.Tensor]:
    dgate, dup = gated_backward(grad.contiguous(), gate.contiguous(), up.contiguous(), activation, in_place=False)
    return dgate.view(gate.shape), dup.view(up.shape)


@gated_backward_op.register_fake
def _(grad, gate, up, activation):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _gated_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.activation = inputs[2]


def _gated_grad(ctx, grad):
    gate, up = ctx.saved_tensors
    return *gated_backward_op(grad, gate, up, ctx.activation), None


gated_op.register_autograd(_gated_grad, setup_context=_gated_setup)


def _gated(gate: torch.Tensor, up: torch.Tensor, activation: str, in_place_backward: bool) -> torch.Tensor:
    if torch.compiler.is_compiling():  # an opaque op; the in-place backward is an eager-mode saving
        return gated_op(gate, up, activation)
    return GatedActivationFunction.apply(gate, up, activation, in_place_backward)


def swiglu(gate: torch.Tensor, up: torch.Tensor, in_place_backward: bool = False) -> torch.Tensor:
    """`silu(gate) * up` elementwise; `gate` and `up` share shape, dtype and device.

    Non-contiguous inputs are copied to contiguous memory first. `in_place_backward=True` (contiguous
    inputs only) writes dgate into gate's memory and dup into up's: the caller must not read gate or up
    after the backward (fine for the outputs of the gate/up projections, which nothing else reads).
    """
    check_gated_inputs(gate, up, in_place_backward)
    if not use_triton("swiglu", gate):
        return reference.swiglu(gate, up)
    return _gated(gate, up, "silu", in_place_backward)


def geglu(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh", in_place_backward: bool = False
) -> torch.Tensor:
    """`gelu(gate, approximate) * up` elementwise, `approximate` "tanh" or "none" as in `F.gelu`.

    Inputs, non-contiguous copies and `in_place_backward` behave as in `swiglu`.
    """
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate={approximate!r} is not one of {tuple(APPROXIMATIONS)} (as in F.gelu)")
    check_gated_inputs(gate, up, in_place_backward)
    if not use_triton("geglu", gate):
        return reference.geglu(gate, up, approximate)
    return _gated(gate, up, APPROXIMATIONS[approximate], in_place_backward)
