"""Rotary position embedding (RoPE) on q and k in one kernel, forward and backward.

Matches ``reference.rope``, i.e. ``x * cos + rotate_half(x) * sin`` with the halves of the head
dim written out: ``y1 = x1*cos1 - x2*sin1`` and ``y2 = x2*cos2 + x1*sin2``. Nothing assumes the
two halves of cos/sin are equal. The backward is the transposed rotation,
``dx1 = dy1*cos1 + dy2*sin2`` and ``dx2 = dy2*cos2 - dy1*sin1``: the same kernel with the sines
swapped and negated (``BACKWARD``), so it needs only cos/sin, not q and k.

RoPE moves bytes and does almost no math, so the kernel is built around memory traffic: one
program per token (b, s) loads that token's cos/sin row once (from a per-token tensor, or from a
table row picked by ``position_ids``) and rotates every q head and every k head of the token as
2-D tiles [heads, D/2], computing in float32. It issues all its loads before any store, so the
q and k traffic overlap; a second grid dimension splits the heads only when a tile would pass
``MAX_TILE`` elements. It reads q and k through all four strides, so the non-contiguous
``view(B, S, H, D).transpose(1, 2)`` views Hugging Face builds are never copied. Offsets are
64-bit, so tensors past 2^31 elements work.

No gradient flows to cos, sin or position_ids: they come from a rotary embedding that is not
trained (Hugging Face computes them under ``torch.no_grad``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tigon.kernels import reference
from tigon.kernels.utils import DATA_COUNTS, LAUNCH_OPTIONS, check_float, check_same_device, next_power_of_2, use_triton

MAX_TILE = 4096  # elements of one half-tile [heads, D/2] a program holds at a time
POSITION_DTYPES = (torch.int64, torch.int32)


@triton.jit
def _load_heads(X, stride_h, stride_d, heads, n_heads, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Both halves of heads `heads` of one token as float32 [heads, HALF] tiles; X points at head 0, dim 0."""
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads < n_heads)[:, None] & (cols < HALF)[None, :]
    first = X + heads[:, None] * stride_h + cols[None, :] * stride_d
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF * stride_d, mask=mask, other=0.0).to(tl.float32)
    return x1, x2


@triton.jit
def _store_rotated(
    Y, stride_h, stride_d, heads, n_heads, x1, x2, cos1, cos2, sin1, sin2, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr
):
    """y1 = x1*cos1 - x2*sin1 and y2 = x2*cos2 + x1*sin2 into heads `heads` of one token."""
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads < n_heads)[:, None] & (cols < HALF)[None, :]
    first = Y + heads[:, None] * stride_h + cols[None, :] * stride_d
    y1 = x1 * cos1[None, :] - x2 * sin1[None, :]
    y2 = x2 * cos2[None, :] + x1 * sin2[None, :]
    tl.store(first, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(first + HALF * stride_d, y2.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=DATA_COUNTS)
def _rope_kernel(
    Q,
    stride_qb,
    stride_qh,
    stride_qs,
    stride_qd,
    QO,
    stride_qob,
    stride_qoh,
    stride_qos,
    stride_qod,
    K,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    KO,
    stride_kob,
    stride_koh,
    stride_kos,
    stride_kod,
    COS,
    stride_cb,
    stride_cs,
    stride_cd,
    SIN,
    stride_sb,
    stride_ss,
    stride_sd,
    POS,
    stride_pb,
    stride_ps,
    seq_len,
    n_q_heads,
    n_k_heads,
    HALF: tl.constexpr,
    HAS_POSITIONS: tl.constexpr,
    BACKWARD: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    b = token // seq_len
    s = token % seq_len
    if HAS_POSITIONS:
        row = tl.load(POS + b * stride_pb + s * stride_ps).to(tl.int64)
    else:
        row = s

    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    cos_row = COS + b * stride_cb + row * stride_cs
    sin_row = SIN + b * stride_sb + row * stride_ss
    cos1 = tl.load(cos_row + cols * stride_cd, mask=col_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_row + (cols + HALF) * stride_cd, mask=col_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_row + cols * stride_sd, mask=col_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_row + (cols + HALF) * stride_sd, mask=col_mask, other=0.0).to(tl.float32)
    if BACKWARD:
        # The transposed rotation: y1 = x1*cos1 + x2*sin2, y2 = x2*cos2 - x1*sin1.
        sin_a = -sin2
        sin_b = -sin1
    else:
        sin_a = sin1
        sin_b = sin2

    # Every load is issued before any store, so the q and k traffic of the token overlap.
    head_block = tl.program_id(1).to(tl.int64)
    q_heads = head_block * BLOCK_HQ + tl.arange(0, BLOCK_HQ)
    k_heads = head_block * BLOCK_HK + tl.arange(0, BLOCK_HK)
    q1, q2 = _load_heads(Q + b * stride_qb + s * stride_qs, stride_qh, stride_qd, q_heads, n_q_heads, HALF, BLOCK_HALF)
    k1, k2 = _load_heads(K + b * stride_kb + s * stride_ks, stride_kh, stride_kd, k_heads, n_k_heads, HALF, BLOCK_HALF)
    _store_rotated(
        QO + b * stride_qob + s * stride_qos,
        stride_qoh,
        stride_qod,
        q_heads,
        n_q_heads,
        q1,
        q2,
        cos1,
        cos2,
        sin_a,
        sin_b,
        HALF,
        BLOCK_HALF,
    )
    _store_rotated(
        KO + b * stride_kob + s * stride_kos,
        stride_koh,
        stride_kod,
        k_heads,
        n_k_heads,
        k1,
        k2,
        cos1,
        cos2,
        sin_a,
        sin_b,
        HALF,
        BLOCK_HALF,
    )


def _table_strides(table: torch.Tensor) -> tuple[int, int, int]:
    """(batch, row, dim) strides of cos/sin; batch stride 0 when it broadcasts over the batch."""
    if table.dim() == 2:
        return 0, table.stride(0), table.stride(1)
    return (0 if table.shape[0] == 1 else table.stride(0)), table.stride(1), table.stride(2)


def _position_strides(position_ids: torch.Tensor | None) -> tuple[int, int]:
    if position_ids is None:
        return 0, 0
    if position_ids.dim() == 1:
        return 0, position_ids.stride(0)
    return (0 if position_ids.shape[0] == 1 else position_ids.stride(0)), position_ids.stride(1)


def _launch_config(n_q_heads: int, n_k_heads: int, head_dim: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_HQ, BLOCK_HK, BLOCK_HALF, head blocks per token, num_warps), in plain integer math:
    the op is short enough that host time shows, and triton's helpers cost microseconds a call."""
    block_half = next_power_of_2(head_dim // 2)
    max_heads = max(1, MAX_TILE // block_half)
    block_hq = min(next_power_of_2(n_q_heads), max_heads)
    block_hk = min(next_power_of_2(n_k_heads), max_heads)
    head_blocks = max(-(-n_q_heads // block_hq), -(-n_k_heads // block_hk), 1)
    # About 512 elements of each half per warp, rounded up to a power of two: measured best on H200 from tiny
    # [4+4, 32] tiles (1 warp) to [16+16, 128] (8 warps), and Llama's [32+8, 64] (8 warps, faster than 4 at
    # 1024-8192 tokens).
    warps = next_power_of_2(max(1, -(-(block_hq + block_hk) * block_half // 512)))
    return block_hq, block_hk, block_half, head_blocks, min(16, warps)


def check_rope_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
) -> None:
    for name, tensor in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_float(name, tensor)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"q and k must be 4-D (batch, heads, seq_len, head_dim), got shapes {tuple(q.shape)} and "
            f"{tuple(k.shape)}; from (batch, seq_len, heads, head_dim) use .transpose(1, 2)"
        )
    batch, _, seq_len, head_dim = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, seq_len, head_dim):
        raise ValueError(
            f"q has shape {tuple(q.shape)} but k has shape {tuple(k.shape)}; they must agree in batch, "
            "seq_len and head_dim (only the head count may differ)"
        )
    if head_dim == 0 or head_dim % 2:
        raise ValueError(f"RoPE needs an even head dim, got head_dim={head_dim} (q.shape[-1])")
    if position_ids is not None and not isinstance(position_ids, torch.Tensor):
        raise TypeError(f"position_ids must be a torch.Tensor or None, got {type(position_ids).__name__}")
    check_same_device("q", q, k=k, cos=cos, sin=sin, position_ids=position_ids)
    if cos.shape != sin.shape:
        raise ValueError(f"cos has shape {tuple(cos.shape)} but sin has shape {tuple(sin.shape)}; they must match")
    if cos.shape[-1] != head_dim:
        raise ValueError(
            f"cos/sin have last dim {cos.shape[-1]} but the head dim (q.shape[-1]) is {head_dim}; they must match"
        )

    if position_ids is None:
        per_token = (cos.dim() == 2 and cos.shape[0] == seq_len) or (
            cos.dim() == 3 and cos.shape[0] in (1, batch) and cos.shape[1] == seq_len
        )
        if not per_token:
            raise ValueError(
                f"cos/sin have shape {tuple(cos.shape)}; without position_ids they must be per token, "
                f"({batch} or 1, {seq_len}, {head_dim}) or ({seq_len}, {head_dim}); to index a "
                "(max_positions, head_dim) table pass position_ids"
            )
        return
    if position_ids.dtype not in POSITION_DTYPES:
        raise TypeError(
            f"position_ids has dtype {position_ids.dtype}; it must be an integer tensor "
            "(torch.int64 or torch.int32), e.g. position_ids.long()"
        )
    if not (
        (position_ids.dim() == 1 and position_ids.shape[0] == seq_len)
        or (position_ids.dim() == 2 and position_ids.shape[0] in (1, batch) and position_ids.shape[1] == seq_len)
    ):
        raise ValueError(
            f"position_ids has shape {tuple(position_ids.shape)}; it must be ({batch} or 1, {seq_len}) "
            "(batch, seq_len of q)"
        )
    if cos.dim() != 2:
        raise ValueError(
            f"with position_ids, cos/sin must be 2-D tables (max_positions, {head_dim}), got shape {tuple(cos.shape)}"
        )


def rope_rotate(
    x_q: torch.Tensor,
    x_k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel: rotate (q, k), or with `backward` apply the transposed rotation to their gradients."""
    batch, n_q_heads, seq_len, head_dim = x_q.shape
    n_k_heads = x_k.shape[1]
    out_q, out_k = torch.empty_like(x_q), torch.empty_like(x_k)
    if batch * seq_len == 0:
        return out_q, out_k
    block_hq, block_hk, block_half, head_blocks, num_warps = _launch_config(n_q_heads, n_k_heads, head_dim)
    _rope_kernel[(batch * seq_len, head_blocks)](
        x_q,
        *x_q.stride(),
        out_q,
        *out_q.stride(),
        x_k,
        *x_k.stride(),
        out_k,
        *out_k.stride(),
        cos,
        *_table_strides(cos),
        sin,
        *_table_strides(sin),
        position_ids if position_ids is not None else cos,
        *_position_strides(position_ids),
        seq_len,
        n_q_heads,
        n_k_heads,
        HALF=head_dim // 2,
        HAS_POSITIONS=position_ids is not None,
        BACKWARD=backward,
        BLOCK_HQ=block_hq,
        BLOCK_HK=block_hk,
        BLOCK_HALF=block_half,
        num_warps=num_warps,
        **LAUNCH_OPTIONS,
    )
    return out_q, out_k


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, position_ids):
        ctx.save_for_backward(cos, sin, position_ids)
        return rope_rotate(q, k, cos, sin, position_ids, backward=False)

    @staticmethod
    def backward(ctx, dq_out, dk_out):
        cos, sin, position_ids = ctx.saved_tensors
        dq, dk = rope_rotate(dq_out, dk_out, cos, sin, position_ids, backward=True)
        return dq, dk, None, None, None


@torch.library.custom_op("tigon::rope", mutates_args=())
def rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None,
    backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_rotate` as an opaque op for torch.compile (the backward is the same op, transposed)."""
    return rope_rotate(q, k, cos, sin, position_ids, backward)


@rope_op.register_fake
def _(q, k, cos, sin, position_ids, backward):
    return torch.empty_like(q), torch.empty_like(k)


def _rope_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs[2:5])


def _rope_grad(ctx, dq_out, dk_out):
    cos, sin, position_ids = ctx.saved_tensors
    return *rope_op(dq_out, dk_out, cos, sin, position_ids, True), None, None, None, None


rope_op.register_autograd(_rope_grad, setup_context=_rope_setup)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding on q `(B, Hq, S, D)` and k `(B, Hk, S, D)`; returns `(q_rotated, k_rotated)`.

    `cos`/`sin` are per token, `(B or 1, S, D)` or `(S, D)`, or, with `position_ids` `(B or 1, S)` or `(S,)`,
    tables `(max_positions, D)` indexed by position (packed sequences restart their positions);
    positions must be below `cos.shape[0]` (they are not checked on the device). Any float dtype
    is accepted for cos/sin; the math runs in float32. Outputs keep q's and k's dtypes and layouts.
    No gradient is computed for cos, sin or position_ids.
    """
    check_rope_inputs(q, k, cos, sin, position_ids)
    if not use_triton("rope", q):
        return reference.rope(q, k, cos, sin, position_ids)
    if torch.compiler.is_compiling():
        return rope_op(q, k, cos, sin, position_ids, False)
    return RoPEFunction.apply(q, k, cos, sin, position_ids)
