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

`swiglu_packed` / `geglu_packed` take gate and up packed in one tensor [..., 2 * I] (a fused
gate_up_proj's output) and have their own kernel pair, described where it starts below.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tigon.kernels import reference
from tigon.kernels.utils import DATA_COUNTS, LAUNCH_OPTIONS, check_float, check_same_device, next_power_of_2, use_triton

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
def _gated_forward_kernel(
    GATE,
    UP,
    OUT,
    n_elements,
    gate_multiplier,
    output_multiplier,
    ACTIVATION: tl.constexpr,
    HAS_MULTIPLIERS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    g = tl.load(GATE + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_MULTIPLIERS:
        g = g * gate_multiplier
        u = u * output_multiplier
    out = _activation(g, ACTIVATION) * u
    tl.store(OUT + offsets, out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _gated_backward_kernel(
    GRAD,
    GATE,
    UP,
    DGATE,
    DUP,
    n_elements,
    gate_multiplier,
    output_multiplier,
    ACTIVATION: tl.constexpr,
    HAS_MULTIPLIERS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n_elements
    grad = tl.load(GRAD + offsets, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GATE + offsets, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(UP + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_MULTIPLIERS:  # out = act(m_g g) * (m_o u): d gate = grad m_o u act' m_g, d up = grad act m_o
        g = g * gate_multiplier
        grad = grad * output_multiplier
    act, derivative = _activation_and_derivative(g, ACTIVATION)
    dgate = grad * u * derivative
    if HAS_MULTIPLIERS:
        dgate = dgate * gate_multiplier
    tl.store(DGATE + offsets, dgate.to(DGATE.dtype.element_ty), mask=mask)
    tl.store(DUP + offsets, (grad * act).to(DUP.dtype.element_ty), mask=mask)


def gated_forward(
    gate: torch.Tensor, up: torch.Tensor, activation: str, multipliers: tuple[float, float] = (1.0, 1.0)
) -> torch.Tensor:
    """Launch the forward kernel on contiguous `gate` and `up`; returns act(gate * m_g) * up * m_o for
    `multipliers` (m_g, m_o)."""
    out = torch.empty_like(gate)
    n = gate.numel()
    if n > 0:
        _gated_forward_kernel[(triton.cdiv(n, BLOCK),)](
            gate, up, out, n, *multipliers, ACTIVATION=activation, HAS_MULTIPLIERS=multipliers != (1.0, 1.0),
            BLOCK=BLOCK, num_warps=NUM_WARPS, **LAUNCH_OPTIONS,
        )  # fmt: skip
    return out


def gated_backward(
    grad: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    in_place: bool,
    multipliers: tuple[float, float] = (1.0, 1.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel on contiguous tensors; with `in_place`, (dgate, dup) reuse (gate, up)."""
    dgate, dup = (gate, up) if in_place else (torch.empty_like(gate), torch.empty_like(up))
    n = gate.numel()
    if n > 0:
        _gated_backward_kernel[(triton.cdiv(n, BLOCK),)](
            grad, gate, up, dgate, dup, n, *multipliers, ACTIVATION=activation,
            HAS_MULTIPLIERS=multipliers != (1.0, 1.0), BLOCK=BLOCK, num_warps=NUM_WARPS, **LAUNCH_OPTIONS,
        )  # fmt: skip
    return dgate, dup


def check_multipliers(gate_multiplier: float, output_multiplier: float) -> tuple[float, float]:
    """(gate_multiplier, output_multiplier) as finite floats; raise naming a bad one."""
    for name, value in (("gate_multiplier", gate_multiplier), ("output_multiplier", output_multiplier)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{name}={value!r} must be a finite number (1.0 for none)")
    return float(gate_multiplier), float(output_multiplier)


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
    def forward(ctx, gate, up, activation, in_place_backward, multipliers):
        out = gated_forward(gate.contiguous(), up.contiguous(), activation, multipliers)
        ctx.save_for_backward(gate, up)
        ctx.activation, ctx.in_place, ctx.multipliers = activation, in_place_backward, multipliers
        return out.view(gate.shape)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        dgate, dup = gated_backward(
            grad.contiguous(), gate.contiguous(), up.contiguous(), ctx.activation, ctx.in_place, ctx.multipliers
        )
        return dgate.view(gate.shape), dup.view(up.shape), None, None, None


@torch.library.custom_op("tigon::gated_activation", mutates_args=())
def gated_op(
    gate: torch.Tensor, up: torch.Tensor, activation: str, gate_multiplier: float, output_multiplier: float
) -> torch.Tensor:
    """`act(gate * m_g) * up * m_o` as an opaque op for torch.compile (out-of-place backward)."""
    multipliers = (gate_multiplier, output_multiplier)
    return gated_forward(gate.contiguous(), up.contiguous(), activation, multipliers).view(gate.shape)


@gated_op.register_fake
def _(gate, up, activation, gate_multiplier, output_multiplier):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("tigon::gated_activation_backward", mutates_args=())
def gated_backward_op(
    grad: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    gate_multiplier: float,
    output_multiplier: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    multipliers = (gate_multiplier, output_multiplier)
    dgate, dup = gated_backward(
        grad.contiguous(), gate.contiguous(), up.contiguous(), activation, in_place=False, multipliers=multipliers
    )
    return dgate.view(gate.shape), dup.view(up.shape)


@gated_backward_op.register_fake
def _(grad, gate, up, activation, gate_multiplier, output_multiplier):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _gated_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.options = inputs[2:]


def _gated_grad(ctx, grad):
    gate, up = ctx.saved_tensors
    return *gated_backward_op(grad, gate, up, *ctx.options), None, None, None


gated_op.register_autograd(_gated_grad, setup_context=_gated_setup)


def _gated(
    gate: torch.Tensor, up: torch.Tensor, activation: str, in_place_backward: bool, multipliers: tuple[float, float]
) -> torch.Tensor:
    if torch.compiler.is_compiling():  # an opaque op; the in-place backward is an eager-mode saving
        return gated_op(gate, up, activation, *multipliers)
    return GatedActivationFunction.apply(gate, up, activation, in_place_backward, multipliers)


def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    in_place_backward: bool = False,
    *,
    gate_multiplier: float = 1.0,
    output_multiplier: float = 1.0,
) -> torch.Tensor:
    """`silu(gate * gate_multiplier) * up * output_multiplier` elementwise; `gate` and `up` share shape, dtype and
    device.

    The multipliers are Falcon-H1's `mlp_multipliers` (its down multiplier moved before the linear
    `down_proj`); at 1.0 the kernel compiles without them. Non-contiguous inputs are copied to contiguous
    memory first. `in_place_backward=True` (contiguous inputs only) writes dgate into gate's memory and dup
    into up's: the caller must not read gate or up after the backward (fine for the outputs of the gate/up
    projections, which nothing else reads).
    """
    check_gated_inputs(gate, up, in_place_backward)
    multipliers = check_multipliers(gate_multiplier, output_multiplier)
    if not use_triton("swiglu", gate):
        return reference.swiglu(gate, up, *multipliers)
    return _gated(gate, up, "silu", in_place_backward, multipliers)


def geglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    approximate: str = "tanh",
    in_place_backward: bool = False,
    *,
    gate_multiplier: float = 1.0,
    output_multiplier: float = 1.0,
) -> torch.Tensor:
    """`gelu(gate * gate_multiplier, approximate) * up * output_multiplier` elementwise, `approximate` "tanh" or
    "none" as in `F.gelu`.

    Inputs, multipliers, non-contiguous copies and `in_place_backward` behave as in `swiglu`.
    """
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate={approximate!r} is not one of {tuple(APPROXIMATIONS)} (as in F.gelu)")
    check_gated_inputs(gate, up, in_place_backward)
    multipliers = check_multipliers(gate_multiplier, output_multiplier)
    if not use_triton("geglu", gate):
        return reference.geglu(gate, up, approximate, *multipliers)
    return _gated(gate, up, APPROXIMATIONS[approximate], in_place_backward, multipliers)


# Packed variant: one `gate_up` tensor [..., 2 * I], gate in the first half of the last dimension and up
# in the second, as a fused gate_up_proj produces it (Phi-3, GLM-4, the transformers 5.x MoE experts).
# Its own kernel pair, so the contiguous kernels above stay as they are: a 2-D grid of (row blocks,
# column blocks) tiles, so no element needs an integer division to find its row; rows are addressed
# through a row stride with 64-bit offsets, so a row-strided view needs no copy. The backward writes
# d(gate_up) as one [..., 2 * I] tensor (what the fused Linear's backward takes, no torch.cat); with
# `in_place_backward` it overwrites gate_up itself.

PACKED_ELEMENTS = 4096  # elements of one program's BLOCK_M x BLOCK_N tile
PACKED_MAX_BLOCK_N = 1024
MAX_COLUMN_BLOCKS = 65535  # the CUDA limit on the grid's second dimension
MAX_PACKED_COLUMNS = MAX_COLUMN_BLOCKS * PACKED_MAX_BLOCK_N


@triton.jit(do_not_specialize=DATA_COUNTS)
def _packed_forward_kernel(
    GATE_UP,
    OUT,
    n_rows,
    n_cols,
    stride_in,
    stride_out,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    gate = GATE_UP + rows[:, None] * stride_in + cols[None, :]
    g = tl.load(gate, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate + n_cols, mask=mask, other=0.0).to(tl.float32)
    out = _activation(g, ACTIVATION) * u
    tl.store(OUT + rows[:, None] * stride_out + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=DATA_COUNTS)
def _packed_backward_kernel(
    GRAD,
    GATE_UP,
    DGATE_UP,
    n_rows,
    n_cols,
    stride_grad,
    stride_in,
    stride_dgate_up,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    grad = tl.load(GRAD + rows[:, None] * stride_grad + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gate = GATE_UP + rows[:, None] * stride_in + cols[None, :]
    g = tl.load(gate, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate + n_cols, mask=mask, other=0.0).to(tl.float32)
    act, derivative = _activation_and_derivative(g, ACTIVATION)
    dgate = DGATE_UP + rows[:, None] * stride_dgate_up + cols[None, :]
    # Each program reads its gate and up elements before writing the same positions: safe in place.
    tl.store(dgate, (grad * u * derivative).to(DGATE_UP.dtype.element_ty), mask=mask)
    tl.store(dgate + n_cols, (grad * act).to(DGATE_UP.dtype.element_ty), mask=mask)


def _packed_launch(n_rows: int, n_cols: int) -> tuple[tuple[int, int], int, int]:
    """(grid, BLOCK_M, BLOCK_N): tiles of PACKED_ELEMENTS, at most PACKED_MAX_BLOCK_N columns wide."""
    block_n = min(next_power_of_2(n_cols), PACKED_MAX_BLOCK_N)
    block_m = PACKED_ELEMENTS // block_n
    return (triton.cdiv(n_rows, block_m), triton.cdiv(n_cols, block_n)), block_m, block_n


def _matrix(x: torch.Tensor) -> torch.Tensor:
    """`x` as (rows, last dim) with a unit column stride: a view where the layout allows, else a copy."""
    matrix = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    if matrix.shape[1] > 1 and matrix.stride(1) != 1:
        matrix = matrix.contiguous()
    return matrix


def _writable_rows(gate_up: torch.Tensor) -> torch.Tensor | None:
    """`gate_up` as a (rows, 2I) view the backward may overwrite (unit column stride, rows that do not
    overlap), or None when its layout has no such view."""
    width = gate_up.shape[-1]
    try:
        matrix = gate_up.view(-1, width)
    except RuntimeError:
        return None
    if matrix.stride(1) != 1 or (matrix.shape[0] > 1 and matrix.stride(0) < width):
        return None
    return matrix


def packed_forward(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """Launch the packed forward kernel; returns act(gate) * up of shape [..., I]."""
    matrix = _matrix(gate_up)
    n_rows, n_cols = matrix.shape[0], matrix.shape[1] // 2
    out = torch.empty((n_rows, n_cols), dtype=gate_up.dtype, device=gate_up.device)
    if n_rows > 0 and n_cols > 0:
        grid, block_m, block_n = _packed_launch(n_rows, n_cols)
        _packed_forward_kernel[grid](
            matrix,
            out,
            n_rows,
            n_cols,
            matrix.stride(0),
            out.stride(0),
            ACTIVATION=activation,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=NUM_WARPS,
            **LAUNCH_OPTIONS,
        )
    return out.view(*gate_up.shape[:-1], n_cols)


def packed_backward(grad: torch.Tensor, gate_up: torch.Tensor, activation: str, in_place: bool) -> torch.Tensor:
    """Launch the packed backward kernel; returns d(gate_up), written over gate_up's memory with `in_place`."""
    width = gate_up.shape[-1]
    n_cols = width // 2
    dgate_up = _writable_rows(gate_up) if in_place and gate_up.numel() > 0 else None
    if dgate_up is None:  # out of place (or nothing to write)
        matrix = _matrix(gate_up)
        dgate_up = torch.empty(matrix.shape, dtype=gate_up.dtype, device=gate_up.device)
    else:
        matrix = dgate_up
    n_rows = matrix.shape[0]
    if n_rows > 0 and n_cols > 0:
        grad_matrix = _matrix(grad)
        grid, block_m, block_n = _packed_launch(n_rows, n_cols)
        _packed_backward_kernel[grid](
            grad_matrix,
            matrix,
            dgate_up,
            n_rows,
            n_cols,
            grad_matrix.stride(0),
            matrix.stride(0),
            dgate_up.stride(0),
            ACTIVATION=activation,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=NUM_WARPS,
            **LAUNCH_OPTIONS,
        )
    return dgate_up.view(gate_up.shape)


def check_packed_input(gate_up: torch.Tensor, in_place_backward: bool) -> None:
    check_float("gate_up", gate_up)
    if gate_up.dim() == 0:
        raise ValueError("gate_up is a scalar; it must have a last dimension of 2 * intermediate_size (gate, then up)")
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(
            f"gate_up has shape {tuple(gate_up.shape)}: its last dimension, {width}, is odd; it must hold gate "
            "then up, 2 * intermediate_size values (e.g. the output of a fused gate_up_proj). For separate "
            "tensors use swiglu(gate, up) / geglu(gate, up)"
        )
    if width // 2 > MAX_PACKED_COLUMNS:
        raise ValueError(
            f"gate_up's last dimension, {width}, is wider than 2 * {MAX_PACKED_COLUMNS} (the kernel's grid "
            "limit); call swiglu(gate, up) / geglu(gate, up) on its two halves instead"
        )
    if in_place_backward and gate_up.numel() > 0 and not torch.compiler.is_compiling():
        if _writable_rows(gate_up) is None:
            raise ValueError(
                f"in_place_backward=True writes d(gate_up) into gate_up's memory, so gate_up must be rows with a "
                f"contiguous last dimension that do not overlap (a Linear's output, or a row slice of one); got "
                f"shape {tuple(gate_up.shape)} and strides {gate_up.stride()}. Call .contiguous() on it first or "
                "pass in_place_backward=False"
            )


class PackedGatedActivationFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, activation, in_place_backward):
        ctx.save_for_backward(gate_up)
        ctx.activation, ctx.in_place = activation, in_place_backward
        return packed_forward(gate_up, activation)

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        return packed_backward(grad, gate_up, ctx.activation, ctx.in_place), None, None


@torch.library.custom_op("tigon::gated_activation_packed", mutates_args=())
def packed_op(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """`act(gate) * up` from a packed `gate_up` as an opaque op for torch.compile (out-of-place backward)."""
    return packed_forward(gate_up, activation)


@packed_op.register_fake
def _(gate_up, activation):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op("tigon::gated_activation_packed_backward", mutates_args=())
def packed_backward_op(grad: torch.Tensor, gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    return packed_backward(grad, gate_up, activation, in_place=False)


@packed_backward_op.register_fake
def _(grad, gate_up, activation):
    return gate_up.new_empty(gate_up.shape)


def _packed_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.activation = inputs[1]


def _packed_grad(ctx, grad):
    (gate_up,) = ctx.saved_tensors
    return packed_backward_op(grad, gate_up, ctx.activation), None


packed_op.register_autograd(_packed_grad, setup_context=_packed_setup)


def _packed(gate_up: torch.Tensor, activation: str, in_place_backward: bool) -> torch.Tensor:
    if torch.compiler.is_compiling():  # an opaque op; the in-place backward is an eager-mode saving
        return packed_op(gate_up, activation)
    return PackedGatedActivationFunction.apply(gate_up, activation, in_place_backward)


def swiglu_packed(gate_up: torch.Tensor, in_place_backward: bool = False) -> torch.Tensor:
    """`silu(gate) * up` with `gate, up = gate_up.chunk(2, -1)`: [..., 2 * I] in, [..., I] out.

    For a fused gate_up projection (Phi-3, GLM-4, MoE experts). Rows may be strided (a row slice);
    other layouts are copied first. The backward returns d(gate_up) as one tensor; with
    `in_place_backward=True` it is written over gate_up's memory, so the caller must not read gate_up
    after the backward (fine for a projection's output, which nothing else reads).
    """
    check_packed_input(gate_up, in_place_backward)
    if not use_triton("swiglu_packed", gate_up):
        return reference.swiglu_packed(gate_up)
    return _packed(gate_up, "silu", in_place_backward)


def geglu_packed(gate_up: torch.Tensor, approximate: str = "tanh", in_place_backward: bool = False) -> torch.Tensor:
    """`gelu(gate, approximate) * up` with `gate, up = gate_up.chunk(2, -1)`, `approximate` "tanh" or "none".

    Inputs and `in_place_backward` behave as in `swiglu_packed`.
    """
    if approximate not in APPROXIMATIONS:
        raise ValueError(f"approximate={approximate!r} is not one of {tuple(APPROXIMATIONS)} (as in F.gelu)")
    check_packed_input(gate_up, in_place_backward)
    if not use_triton("geglu_packed", gate_up):
        return reference.geglu_packed(gate_up, approximate)
    return _packed(gate_up, APPROXIMATIONS[approximate], in_place_backward)
