"""A Linear layer's products in FP8 with one dynamic scale per tensor: torchao's tensorwise float8 training, with
tigon's casts.

    y = fp8_linear(x, weight)   # x (..., K), weight (N, K): y (..., N) in x's dtype

The forward multiplies x and the weight in float8_e4m3fn; the backward multiplies the output gradient, in
float8_e5m2, with each of them. Every operand is scaled by its format's largest value over the tensor's absolute
maximum (448 for e4m3, 57344 for e5m2), and the products run on FP8 tensor cores (`torch._scaled_mm`, fast
accumulation in the forward only). The numbers are torchao's bit for bit: the same scales, casts that round to
nearest even and saturate as torch's conversion does, the same three products on the same operands.

What is tigon's is the memory traffic around the products. An FP8 product on Hopper reads both operands along
the reduced dimension, so the weight gradient needs x and the output gradient transposed: one pass reads a tile
and writes it in FP8 both as it is and transposed, and the backward keeps x's transposed FP8 copy (one byte an
element) instead of x, or x itself where the op that made x keeps it anyway (`keep_input`). The weight is cast
again in the backward, transposed, from the forward's absolute maximum. Under torch.compile the casts are opaque
custom ops, which Inductor's common-subexpression pass merges where several projections read one input (q, k and
v), so that input is cast and kept once.

The casts write the FP8 bit patterns with integer arithmetic (the rounding of torch's conversion), so Triton's
interpreter on a CPU writes the same bytes as a GPU. The weight's dimensions must be multiples of 16, and so must
the tokens when the weight trains (its gradient's product reduces over them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon.kernels import reference
from tigon.kernels.utils import LAUNCH_OPTIONS, check_float, check_same_device, multiprocessor_count, use_triton

E4M3 = torch.float8_e4m3fn  # input and weight
E5M2 = torch.float8_e5m2  # output gradient

AMAX_BLOCK = 4096
AMAX_PROGRAMS_PER_SM = 8
CAST_WARPS = 4


def _float32_at_or_above(value: float) -> float:
    """The smallest float32 not below `value`: `amax < it` in float32 is `amax < value` exactly."""
    rounded = torch.tensor(value, dtype=torch.float64).to(torch.float32)
    if rounded.to(torch.float64).item() < value:
        rounded = torch.nextafter(rounded, torch.tensor(float("inf")))
    return rounded.item()


AMAX_FLOOR = _float32_at_or_above(reference.FP8_AMAX_FLOOR)
#: the scale of a tensor whose absolute maximum is under the floor, as torchao computes it (float64, rounded)
FLOOR_SCALE = {
    dtype: (torch.finfo(dtype).max / torch.tensor(reference.FP8_AMAX_FLOOR, dtype=torch.float64)).float().item()
    for dtype in (E4M3, E5M2)
}


@triton.jit
def _amax_kernel(X, AMAX, n_elements, BLOCK: tl.constexpr):
    """max |x| over the programs' strided blocks, as the float32's bits (integer order is float order for
    non-negative floats, and a NaN's bits exceed infinity's, so a NaN wins) in one atomic max."""
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(tl.program_id(0) * BLOCK, n_elements, tl.num_programs(0) * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        x = tl.load(X + offsets, mask=offsets < n_elements, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    tl.atomic_max(AMAX, tl.max(acc, axis=0))


@triton.jit
def _fp8_bits(value, IS_E4M3: tl.constexpr):
    """float32 -> the FP8 bit pattern as torch converts (c10's fp8e4m3fn / fp8e5m2 from fp32): a normal result
    rounds its mantissa to nearest even with integer adds; a subnormal one adds the power of two whose float32
    spacing is the format's smallest step, which rounds the same way; NaN stays NaN."""
    bits = value.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    if IS_E4M3:  # normal from 2^-6, 3 mantissa bits, subnormal step 2^-9 (2^14's spacing); 0x7F is NaN
        subnormal = (magnitude.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
        normal = (magnitude + ((7 - 127) << 23) + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20
        code = tl.where(magnitude < (121 << 23), subnormal, normal)
        code = tl.where(magnitude >= (1087 << 20), 0x7F, code)
    else:  # normal from 2^-14, 2 mantissa bits, subnormal step 2^-16 (2^7's spacing); 0x7C infinity, 0x7F NaN
        subnormal = (magnitude.to(tl.float32, bitcast=True) + 128.0).to(tl.int32, bitcast=True) - (134 << 23)
        normal = (magnitude + ((15 - 127) << 23) + 0xFFFFF + ((magnitude >> 21) & 1)) >> 21
        code = tl.where(magnitude < (113 << 23), subnormal, normal)
        code = tl.where(magnitude >= (143 << 23), tl.where(magnitude > 0x7F800000, 0x7F, 0x7C), code)
    return code | sign


@triton.jit
def _cast_kernel(
    X,
    AMAX,
    OUT,
    OUT_T,
    INVERSE_SCALE,
    n_rows,
    n_cols,
    stride_x,
    amax_floor,
    floor_scale,
    FP8_MAX: tl.constexpr,
    IS_E4M3: tl.constexpr,
    ROWS: tl.constexpr,
    TRANSPOSED: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    PACKED_WORDS: tl.constexpr,
):
    """One tile of x scaled, saturated and cast, written as it is (OUT) and/or transposed (OUT_T)."""
    amax = tl.load(AMAX).to(tl.float32, bitcast=True)
    scale = tl.where(amax < amax_floor, floor_scale, tl.math.div_rn(tl.full((), FP8_MAX, tl.float32), amax))
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(INVERSE_SCALE, tl.math.div_rn(tl.full((), 1.0, tl.float32), scale))
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scaled = x * scale
    scaled = tl.where(scaled > FP8_MAX, FP8_MAX, scaled)  # comparisons leave a NaN as it is, as torch's clamp does
    scaled = tl.where(scaled < -FP8_MAX, -FP8_MAX, scaled)
    code = _fp8_bits(scaled, IS_E4M3)
    if ROWS:
        tl.store(OUT + rows[:, None].to(tl.int64) * n_cols + cols[None, :], code.to(tl.uint8), mask=mask)
    if TRANSPOSED:
        if PACKED_WORDS:  # 4 consecutive rows' bytes as one little-endian int32 of the transposed output
            quads = tl.reshape(code & 0xFF, (BLOCK_ROWS // 4, 4, BLOCK_COLS))
            words = tl.sum(quads << (tl.arange(0, 4) * 8)[None, :, None], axis=1)
            word_rows = tl.program_id(0) * (BLOCK_ROWS // 4) + tl.arange(0, BLOCK_ROWS // 4)
            word_mask = (word_rows < n_rows // 4)[None, :] & (cols < n_cols)[:, None]
            word_offsets = cols[:, None].to(tl.int64) * (n_rows // 4) + word_rows[None, :]
            tl.store(OUT_T + word_offsets, tl.trans(words), mask=word_mask)
        else:
            offsets = cols[:, None].to(tl.int64) * n_rows + rows[None, :]
            tl.store(OUT_T + offsets, tl.trans(code.to(tl.uint8)), mask=tl.trans(mask))


def amax_forward(x: torch.Tensor) -> torch.Tensor:
    """max |x| of a contiguous tensor as a float32 scalar."""
    bits = torch.zeros((), dtype=torch.int32, device=x.device)
    n = x.numel()
    if n > 0:
        programs = min(triton.cdiv(n, AMAX_BLOCK), multiprocessor_count(x.device) * AMAX_PROGRAMS_PER_SM)
        _amax_kernel[(programs,)](x, bits, n, BLOCK=AMAX_BLOCK, num_warps=8, **LAUNCH_OPTIONS)
    return bits.view(torch.float32)


def _cast_config(n_rows: int, rows: bool, transposed: bool) -> tuple[int, int, bool]:
    """(tile rows, tile columns, transposed layout stored as 4-byte words) for a cast. On an H200
    (`python -m benchmarks.fp8_linear --sweep`, docs/benchmarks.md) storing the transpose as words of four rows'
    bytes took a quarter to a third off a cast of both layouts; one layout takes byte stores in wide tiles."""
    if rows and transposed and n_rows % 4 == 0:
        return 128, 64, True
    return 64, 128, False


def cast_forward(
    x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, rows: bool, transposed: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A (R, C) matrix with a contiguous last dimension cast to FP8 at the scale its `amax` gives: (the cast,
    R x C or empty; the cast transposed, C x R or empty; the inverse scale)."""
    n_rows, n_cols = x.shape
    out = torch.empty((n_rows, n_cols) if rows else (0,), dtype=torch.uint8, device=x.device)
    out_t = torch.empty((n_cols, n_rows) if transposed else (0,), dtype=torch.uint8, device=x.device)
    block_rows, block_cols, packed_words = _cast_config(n_rows, rows, transposed)
    inverse_scale = torch.empty((), dtype=torch.float32, device=x.device)
    grid = (max(1, triton.cdiv(n_rows, block_rows)), max(1, triton.cdiv(n_cols, block_cols)))
    _cast_kernel[grid](
        x,
        amax.view(torch.int32),
        out,
        out_t.view(torch.int32) if packed_words else out_t,
        inverse_scale,
        n_rows,
        n_cols,
        x.stride(0),
        AMAX_FLOOR,
        FLOOR_SCALE[dtype],
        FP8_MAX=torch.finfo(dtype).max,
        IS_E4M3=dtype == E4M3,
        ROWS=rows,
        TRANSPOSED=transposed,
        BLOCK_ROWS=block_rows,
        BLOCK_COLS=block_cols,
        PACKED_WORDS=packed_words,
        num_warps=CAST_WARPS,
        enable_fp_fusion=False,  # x * scale rounds to float32 before the clamp, as torch's
    )
    return out.view(dtype), out_t.view(dtype), inverse_scale


@torch.library.custom_op("tigon::fp8_amax", mutates_args=())
def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 scalar: what a tensorwise FP8 scale is computed from."""
    if not use_triton("fp8_linear", x):
        return reference.fp8_amax(x)
    return amax_forward(x.contiguous())


@fp8_amax.register_fake
def _(x):
    return x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("tigon::fp8_cast", mutates_args=())
def fp8_cast(
    x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, rows: bool, transposed: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A matrix in FP8 `dtype` at its `amax`'s scale: (as it is, or empty; transposed and contiguous, or empty;
    the inverse scale `torch._scaled_mm` takes)."""
    if not use_triton("fp8_linear", x):
        cast, inverse_scale = reference.fp8_cast(x, amax, dtype)
        empty = cast.new_empty(0)
        return (cast if rows else empty), (cast.t().contiguous() if transposed else empty), inverse_scale
    if x.stride(-1) != 1:
        x = x.contiguous()
    return cast_forward(x, amax, dtype, rows, transposed)


@fp8_cast.register_fake
def _(x, amax, dtype, rows, transposed):
    n_rows, n_cols = x.shape
    return (
        x.new_empty((n_rows, n_cols) if rows else (0,), dtype=dtype),
        x.new_empty((n_cols, n_rows) if transposed else (0,), dtype=dtype),
        x.new_empty((), dtype=torch.float32),
    )


@torch.library.custom_op("tigon::fp8_linear_backward", mutates_args=())
def fp8_linear_backward(
    grad: torch.Tensor,
    x_kept: torch.Tensor,
    x_amax: torch.Tensor,
    x_inverse_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_amax: torch.Tensor,
    need_x: bool,
    need_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_x or empty, grad_weight or empty) from the output gradient, x as the forward kept it (its transposed
    FP8 cast, or x itself) and the weight. One opaque op, so that a compiled graph casts the weight for it in the
    backward, not ahead in the forward where its cast would be kept from one to the other."""
    g_fp8, g_t, g_inverse = fp8_cast(grad, fp8_amax(grad), E5M2, need_x, need_weight)
    grad_x = grad_weight = grad.new_empty(0)
    if need_x:
        _, w_t, w_inverse = fp8_cast(weight, weight_amax, E4M3, False, True)
        grad_x = torch._scaled_mm(g_fp8, w_t.t(), scale_a=g_inverse, scale_b=w_inverse, out_dtype=grad.dtype)
    if need_weight:
        x_t = x_kept if x_kept.dtype == E4M3 else fp8_cast(x_kept, x_amax, E4M3, False, True)[1]
        grad_weight = torch._scaled_mm(g_t, x_t.t(), scale_a=g_inverse, scale_b=x_inverse_scale, out_dtype=grad.dtype)
        grad_weight = grad_weight.to(weight.dtype)
    return grad_x, grad_weight


@fp8_linear_backward.register_fake
def _(grad, x_kept, x_amax, x_inverse_scale, weight, weight_amax, need_x, need_weight):
    return (
        grad.new_empty((grad.shape[0], weight.shape[1]) if need_x else (0,)),
        weight.new_empty(weight.shape if need_weight else (0,)),
    )


class FP8LinearFunction(torch.autograd.Function):
    """x (M, K) @ weight (N, K).T in FP8; keeps x's transposed FP8 cast (or x itself, `keep_input`) and the
    absolute maxima."""

    @staticmethod
    def forward(ctx, x, weight, trains_weight, keep_input):
        x_amax = fp8_amax(x)
        x_fp8, x_t, x_inverse = fp8_cast(x, x_amax, E4M3, True, trains_weight and not keep_input)
        w_amax = fp8_amax(weight)
        w_fp8, _, w_inverse = fp8_cast(weight, w_amax, E4M3, True, False)
        ctx.save_for_backward(x if keep_input else x_t, x_amax, x_inverse, weight, w_amax)
        with torch.autocast(x.device.type, enabled=False):  # CPU autocast changes `_scaled_mm`'s result
            return torch._scaled_mm(
                x_fp8, w_fp8.t(), scale_a=x_inverse, scale_b=w_inverse, out_dtype=x.dtype, use_fast_accum=True
            )

    @staticmethod
    def backward(ctx, grad):
        need_x, need_weight = ctx.needs_input_grad[:2]
        grad_x, grad_weight = fp8_linear_backward(grad, *ctx.saved_tensors, need_x, need_weight)
        return (grad_x if need_x else None), (grad_weight if need_weight else None), None, None


def check_fp8_linear_inputs(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, trains_weight: bool
) -> None:
    check_float("x", x)
    check_float("weight", weight)
    check_same_device("x", x, weight=weight, bias=bias)
    if weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fp8_linear: x has {x.shape[-1]} features and weight has shape {tuple(weight.shape)}; the weight must "
            f"be (out_features, {x.shape[-1]})"
        )
    for name, size in (("in_features", weight.shape[1]), ("out_features", weight.shape[0])):
        if size % 16:
            raise ValueError(
                f"fp8_linear: {name} is {size}, and FP8 matrix products take multiples of 16; keep this layer in bf16"
            )
    tokens = x.numel() // x.shape[-1]
    if trains_weight and tokens % 16:
        raise ValueError(
            f"fp8_linear: the weight's gradient reduces over the tokens (x's leading dimensions), {tokens} here, and "
            f"FP8 matrix products take multiples of 16; pad the batch to {-(-tokens // 16) * 16} tokens"
        )


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_input: bool = False
) -> torch.Tensor:
    """`x @ weight.T + bias` with the products in FP8 (e4m3 forward, e5m2 output gradient, one dynamic scale per
    tensor), the output in x's dtype. Cast x to the compute dtype first (bf16): the weight may stay float32.

    `keep_input=True` keeps x itself for the backward, which casts it then, instead of an FP8 copy made in the
    forward: for an input that the op producing it keeps anyway (attention keeps its output, which the output
    projection reads), so the copy would be memory spent twice."""
    trains_weight = weight.requires_grad and torch.is_grad_enabled()
    check_fp8_linear_inputs(x, weight, bias, trains_weight)
    out = FP8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, trains_weight, keep_input)
    out = out.view(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias.to(out.dtype)
