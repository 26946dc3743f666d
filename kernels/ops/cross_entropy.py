"""Cross entropy over logits (N, V): one program per row, online softmax, gradient written in place.

Per token ``i`` with target ``t`` (``z`` = the logits, or ``softcap * tanh(logits / softcap)``):

    lse  = logsumexp(z)
    ce   = (1 - eps) * w[t] * (lse - z[t]) + eps / V * sum_j w[j] * (lse - z[j])   (torch's label smoothing)
    zl   = lse_square_scale * lse^2                                             (z-loss, not class-weighted)
    loss = ce * ce_scale + zl * z_scale

with ``w = 1`` without class weights and ``ce_scale``/``z_scale`` the reduction's normalizers (``"mean"``:
1 / sum of the target weights and 1 / count of non-ignored tokens; ``num_items_in_batch``: 1 / that
number for both; ``"sum"``/``"none"``: 1). The gradient of that loss with respect to the logits is

    dz[j] = p[j] * (ce_scale * ((1 - eps) * w[t] + eps / V * sum(w)) + z_scale * 2 * lse_square_scale * lse)
            - ce_scale * eps / V * w[j] - [j == t] * ce_scale * (1 - eps) * w[t]

times ``1 - tanh^2`` with softcapping. The normalizers are computed on the device from the targets
before the launch (no host sync), so the kernel knows the final gradient of the reduced loss.

One program owns one row. Pass 1 walks the vocabulary in ``BLOCK_V`` chunks with an online softmax
(running max and rescaled sum of exponentials, one pair per lane of consecutive logits, combined once a row),
so any vocabulary size works (262,144 and up);
pass 2 reads the row again, last chunk first so that what pass 1 read last still comes from L2, and,
when a gradient is wanted, overwrites the logits with ``dz``. Both passes load the next chunk before
working on the current one, so a program keeps two chunks' loads in flight. So
forward computes loss and gradient in one launch and no second vocabulary-sized tensor exists; the
backward only scales that buffer by the incoming gradient (and skips even that when it is 1).
Ignored rows skip both passes: they write zeros. A target out of range (only reachable with
``check_targets=False``) gives that row a NaN loss and a NaN gradient instead of a wild read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from tigon.kernels import reference
from tigon.kernels.reference import CrossEntropyOutput, check_target_range
from tigon.kernels.utils import (
    DATA_COUNTS,
    LAUNCH_OPTIONS,
    check_float,
    check_same_device,
    check_vector,
    eager_under_compile,
    gpu_name,
    multiprocessor_count,
    next_power_of_2,
    use_triton,
    warps_for,
)

REDUCTIONS = ("mean", "sum", "none")
SCALE_BLOCK = 4096  # elements per step of the backward's scaling kernel
SCALE_PROGRAMS_PER_SM = 16
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _softcap(x, cap):
    """(cap * tanh(x / cap), tanh(x / cap)) in float32; tanh from one exp of a non-positive number."""
    u = x / cap
    e = tl.exp(tl.abs(u) * -2.0)
    t = (1.0 - e) / (1.0 + e)
    t = tl.where(u < 0, -t, t)
    return t * cap, t


@triton.jit
def _gradient_coefficients(
    lse,
    w_t,
    SCALES,
    ROW_SCALE,
    poison,
    label_smoothing,
    lse_square_scale,
    n_cols,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
):
    """(p_coef, uniform_coef, target_coef) of a row's gradient ``p[j] * p_coef - w[j] * uniform_coef - [j == t] *
    target_coef`` (module docstring), times the row's incoming factor at ROW_SCALE; `poison` (NaN for a target out
    of range, else 0) rides in the coefficients."""
    ce_scale = tl.load(SCALES)
    target_coef = w_t * (1.0 - label_smoothing) * ce_scale
    p_coef = target_coef
    uniform_coef = 0.0
    if HAS_SMOOTHING:
        uniform_coef = ce_scale * (label_smoothing / n_cols)
        p_coef += uniform_coef * tl.load(SCALES + 2)
    if HAS_Z:
        p_coef += lse * lse_square_scale * tl.load(SCALES + 1) * 2.0
    if HAS_ROW_SCALE:
        g = tl.load(ROW_SCALE).to(tl.float32)
        target_coef = target_coef * g
        p_coef = p_coef * g
        uniform_coef = uniform_coef * g
    return p_coef + poison, uniform_coef, target_coef + poison


@triton.jit
def _logit_gradient(
    x,
    cols,
    is_target,
    lse_log2,
    p_coef,
    uniform_coef,
    target_coef,
    CLASS_WEIGHT,
    softcap,
    mask,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    """The gradient at logits `x` (columns `cols` of the vocabulary) from their row's coefficients, in float32."""
    z = x.to(tl.float32)
    if HAS_SOFTCAP:
        z, tanh_z = _softcap(z, softcap)
    grad = tl.exp2(z * LOG2E - lse_log2) * p_coef
    if HAS_SMOOTHING:
        if HAS_WEIGHT:
            grad -= tl.load(CLASS_WEIGHT + cols, mask=mask, other=0.0).to(tl.float32) * uniform_coef
        else:
            grad -= uniform_coef
    grad = tl.where(is_target, grad - target_coef, grad)
    if HAS_SOFTCAP:
        grad = grad * (1.0 - tanh_z * tanh_z)
    return grad


@triton.jit(do_not_specialize=DATA_COUNTS)
def _cross_entropy_kernel(
    X,
    stride_x,
    TARGET,
    CLASS_WEIGHT,
    SCALES,
    ROW_SCALE,
    stride_row_scale,
    LOSS,
    Z_LOSS,
    LSE,
    PRED,
    TOKEN_SCALE,
    n_rows,
    n_cols,
    ignore_index,
    label_smoothing,
    lse_square_scale,
    softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    STORE_Z: tl.constexpr,
    STORE_LSE: tl.constexpr,
    STORE_PRED: tl.constexpr,
    TOKEN_SCALING: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    LANE: tl.constexpr,
):
    # Each program walks rows pid, pid + programs, ... (one row each when programs >= rows).
    offsets = tl.arange(0, BLOCK_V)
    tile = tl.arange(0, BLOCK_V // LANE)[:, None] * LANE + tl.arange(0, LANE)[None, :]  # a chunk as lanes
    for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
        x_row = X + row * stride_x
        target = tl.load(TARGET + row).to(tl.int64)
        if target == ignore_index:
            tl.store(LOSS + row, 0.0)
            if STORE_Z:
                tl.store(Z_LOSS + row, 0.0)
            if STORE_LSE:
                tl.store(LSE + row, 0.0)
            if STORE_PRED:
                tl.store(PRED + row, -1)
            if TOKEN_SCALING:
                tl.store(TOKEN_SCALE + row, 0.0)
            if WRITE_GRAD:
                zeros = tl.zeros((BLOCK_V,), dtype=X.dtype.element_ty)
                for start in range(0, n_cols, BLOCK_V):
                    cols = start + offsets
                    tl.store(x_row + cols, zeros, mask=cols < n_cols)
        else:
            in_range = (target >= 0) & (target < n_cols)
            t_index = tl.where(in_range, target, 0)
            ce_scale = tl.load(SCALES)
            z_scale = tl.load(SCALES + 1)
            weight_total = tl.load(SCALES + 2)
            poison = tl.where(in_range, 0.0, float("nan"))

            # Pass 1: online softmax, sum_j w[j] z[j] for smoothing. Each lane of LANE consecutive logits keeps its own
            # running max m and rescaled sum d of exp(z - m), so a chunk costs no reduction across threads (no
            # barrier); the lanes are combined once a row. The next chunk's load is issued before this chunk's
            # arithmetic (register double buffering), and its lines are asked to stay in L2 for pass 2. Positions
            # past the row's end load as -inf, so that they drop out of max and sum with no select per logit.
            # Exponentials are exp2 of z * log2(e) - m * log2(e), one fused multiply-add and one MUFU.EX2 a logit
            # (tl.exp adds a subnormal range fix of three instructions).
            m = tl.full((BLOCK_V // LANE,), float("-inf"), tl.float32)
            d = tl.zeros((BLOCK_V // LANE,), tl.float32)
            smooth = tl.zeros((BLOCK_V // LANE, LANE), dtype=tl.float32)
            best = tl.zeros((BLOCK_V // LANE,), tl.int32)  # with STORE_PRED: each lane's first column at its max m
            x_next = tl.load(x_row + tile, mask=tile < n_cols, other=float("-inf"), eviction_policy="evict_last")
            for start in range(0, n_cols, BLOCK_V):
                cols = start + tile
                z = x_next.to(tl.float32)
                x_next = tl.load(
                    x_row + BLOCK_V + cols,
                    mask=BLOCK_V + cols < n_cols,
                    other=float("-inf"),
                    eviction_policy="evict_last",
                )
                if HAS_SOFTCAP or HAS_SMOOTHING:
                    mask = cols < n_cols
                    z = tl.where(mask, z, 0.0)
                    if HAS_SOFTCAP:
                        z, _ = _softcap(z, softcap)
                    if HAS_SMOOTHING:
                        if HAS_WEIGHT:
                            smooth += tl.load(CLASS_WEIGHT + cols, mask=mask, other=0.0).to(tl.float32) * z
                        else:
                            smooth += z
                    z = tl.where(mask, z, float("-inf"))
                z_max = tl.max(z, axis=1)
                if STORE_PRED:
                    first = tl.min(tl.where(z == z_max[:, None], cols, n_cols), axis=1)
                    best = tl.where(z_max > m, first, best)
                m_new = tl.maximum(m, z_max)
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane of only -inf logits stays finite
                d = d * tl.exp2((m - m_ref) * LOG2E) + tl.sum(tl.exp2(z * LOG2E - (m_ref * LOG2E)[:, None]), axis=1)
                m = m_new
            m_row = tl.max(m, axis=0)
            m_ref = tl.where(m_row == float("-inf"), 0.0, m_row)
            lse = m_row + tl.log(tl.sum(d * tl.exp2((m - m_ref) * LOG2E), axis=0))

            z_t = tl.load(x_row + t_index).to(tl.float32)
            if HAS_SOFTCAP:
                z_t, _ = _softcap(z_t, softcap)
            if HAS_WEIGHT:
                w_t = tl.load(CLASS_WEIGHT + t_index).to(tl.float32)
            else:
                w_t = 1.0
            ce = (lse - z_t) * w_t * (1.0 - label_smoothing)
            if HAS_SMOOTHING:
                ce += (lse * weight_total - tl.sum(tl.sum(smooth, axis=1), axis=0)) * (label_smoothing / n_cols)
            loss = ce * ce_scale
            z_loss = 0.0
            if HAS_Z:
                z_loss = lse * lse * lse_square_scale * z_scale
                loss += z_loss
            if TOKEN_SCALING:  # the row's loss and gradient times its target's probability, a constant
                token_scale = tl.exp(z_t - lse)
                loss *= token_scale
                z_loss *= token_scale
                tl.store(TOKEN_SCALE + row, token_scale + poison)
            tl.store(LOSS + row, loss + poison)
            if STORE_Z:
                tl.store(Z_LOSS + row, z_loss + poison)
            if STORE_LSE:
                tl.store(LSE + row, lse)
            if STORE_PRED:  # the first column holding the row's maximum, as torch.argmax
                tl.store(PRED + row, tl.min(tl.where(m == m_row, best, n_cols), axis=0).to(tl.int64))

            # Pass 2: overwrite the logits with the gradient of the (reduced) loss. It walks the row backwards,
            # so that the chunks pass 1 read last are re-read while still in L2, prefetching as pass 1 does. The
            # poison rides in the coefficients (NaN times anything is NaN), and the target is found by comparing
            # 32-bit offsets within the chunk, one instruction a logit.
            if WRITE_GRAD:
                p_coef, uniform_coef, target_coef = _gradient_coefficients(
                    lse, w_t, SCALES, ROW_SCALE + row * stride_row_scale, poison, label_smoothing, lse_square_scale,
                    n_cols, HAS_SMOOTHING, HAS_Z, HAS_ROW_SCALE,
                )  # fmt: skip
                if TOKEN_SCALING:
                    p_coef *= token_scale
                    uniform_coef *= token_scale
                    target_coef *= token_scale
                lse_log2 = lse * LOG2E
                t_local = t_index.to(tl.int32)
                last = (n_cols - 1) // BLOCK_V * BLOCK_V
                x_next = tl.load(
                    x_row + last + offsets, mask=last + offsets < n_cols, other=0.0, eviction_policy="evict_first"
                )
                for back in range(0, n_cols, BLOCK_V):
                    start = last - back
                    cols = start + offsets
                    mask = cols < n_cols
                    x = x_next
                    x_next = tl.load(
                        x_row + cols - BLOCK_V, mask=cols >= BLOCK_V, other=0.0, eviction_policy="evict_first"
                    )
                    grad = _logit_gradient(
                        x, cols, offsets == t_local - start, lse_log2, p_coef, uniform_coef, target_coef,
                        CLASS_WEIGHT, softcap, mask, HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP,
                    )  # fmt: skip
                    tl.store(x_row + cols, grad.to(X.dtype.element_ty), mask=mask, cache_modifier=".cs")


@triton.jit
def _gradient_columns_kernel(
    X,
    stride_x,
    col_offset,
    n_window,
    LSE,
    TARGET,
    CLASS_WEIGHT,
    SCALES,
    ROW_SCALE,
    stride_row_scale,
    n_cols,
    ignore_index,
    label_smoothing,
    lse_square_scale,
    softcap,
    HAS_WEIGHT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Overwrite logits X (rows, n_window), columns [col_offset, col_offset + n_window) of an n_cols vocabulary,
    with the loss gradient, from each row's logsumexp in LSE: pass 2 of `_cross_entropy_kernel` on a window."""
    row = tl.program_id(0).to(tl.int64)
    local = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = local < n_window
    pointers = X + row * stride_x + local
    target = tl.load(TARGET + row).to(tl.int64)
    if target == ignore_index:
        tl.store(pointers, tl.zeros((BLOCK,), dtype=X.dtype.element_ty), mask=mask)
    else:
        in_range = (target >= 0) & (target < n_cols)
        t_index = tl.where(in_range, target, 0)
        poison = tl.where(in_range, 0.0, float("nan"))
        if HAS_WEIGHT:
            w_t = tl.load(CLASS_WEIGHT + t_index).to(tl.float32)
        else:
            w_t = 1.0
        lse = tl.load(LSE + row)
        p_coef, uniform_coef, target_coef = _gradient_coefficients(
            lse, w_t, SCALES, ROW_SCALE + row * stride_row_scale, poison, label_smoothing, lse_square_scale, n_cols,
            HAS_SMOOTHING, HAS_Z, HAS_ROW_SCALE,
        )  # fmt: skip
        grad = _logit_gradient(
            tl.load(pointers, mask=mask, other=0.0), col_offset + local, local == t_index - col_offset,
            lse * LOG2E, p_coef, uniform_coef, target_coef, CLASS_WEIGHT, softcap, mask,
            HAS_WEIGHT, HAS_SMOOTHING, HAS_SOFTCAP,
        )  # fmt: skip
        tl.store(pointers, grad.to(X.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=DATA_COUNTS)
def _scale_kernel(
    X, stride_x, G, stride_g, n_cols, n_blocks, blocks_per_row, PER_ROW: tl.constexpr, BLOCK: tl.constexpr
):
    """X[row, :] *= G[row * stride_g] in place, skipped (no read, no write) where that factor is 1.

    Programs stride over the row blocks; with one factor for all rows (not PER_ROW) each program reads it
    once and returns at once when it is 1, so the skip costs a few programs, not one per block.
    """
    g = tl.load(G).to(tl.float32)
    end = n_blocks
    if not PER_ROW:
        end = tl.where(g == 1.0, 0, n_blocks)
    for block in range(tl.program_id(0), end, tl.num_programs(0)):
        row = block // blocks_per_row
        if PER_ROW:
            g = tl.load(G + row * stride_g).to(tl.float32)
        if g != 1.0:
            cols = (block % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
            mask = cols < n_cols
            pointers = X + row.to(tl.int64) * stride_x + cols
            x = tl.load(pointers, mask=mask, other=0.0).to(tl.float32)
            tl.store(pointers, (x * g).to(X.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class LossOptions:
    """The cross-entropy options shared by `cross_entropy` and `fused_linear_cross_entropy`."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    reduction: str = "mean"
    lse_square_scale: float = 0.0
    softcap: float | None = None
    num_items_in_batch: int | float | torch.Tensor | None = None
    return_z_loss: bool = False
    token_scaling: bool = False
    return_token_accuracy: bool = False
    return_predicted_tokens: bool = False

    @property
    def wants_predictions(self) -> bool:
        """Whether the kernel stores each row's argmax (for the token accuracy or the predicted tokens)."""
        return self.return_token_accuracy or self.return_predicted_tokens


def token_accuracy(predicted: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """float32 accuracy of the argmax `predicted` against `target` over the non-ignored tokens (see
    `CrossEntropyOutput`), with no host sync."""
    valid = target != ignore_index
    correct = (predicted == target) & valid
    if reduction == "none":
        return correct.float()
    return correct.sum(dtype=torch.float32) / valid.sum(dtype=torch.float32).clamp_min(1)


def loss_output(
    loss: torch.Tensor,
    z_loss: torch.Tensor | None,
    predicted: torch.Tensor | None,
    target: torch.Tensor,
    options: LossOptions,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | CrossEntropyOutput:
    """The loss alone, `(loss, z_loss)` with `return_z_loss` only, else a `CrossEntropyOutput`."""
    if not options.wants_predictions:
        return (loss, z_loss) if options.return_z_loss else loss
    accuracy = None
    if options.return_token_accuracy:
        accuracy = token_accuracy(predicted, target, options.ignore_index, options.reduction)
    return CrossEntropyOutput(loss, z_loss, accuracy, predicted if options.return_predicted_tokens else None)


def check_loss_options(options: LossOptions, class_weight: torch.Tensor | None, weight_name: str) -> None:
    if options.reduction not in REDUCTIONS:
        raise ValueError(f"reduction={options.reduction!r} is not one of {REDUCTIONS}")
    if isinstance(options.ignore_index, bool) or not isinstance(options.ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {options.ignore_index!r}")
    for flag in ("return_z_loss", "return_token_accuracy", "return_predicted_tokens", "token_scaling"):
        if not isinstance(getattr(options, flag), bool):
            raise TypeError(f"{flag} must be True or False, got {getattr(options, flag)!r}")
    if not 0.0 <= options.label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={options.label_smoothing} must lie in [0, 1] (as in F.cross_entropy)")
    if not 0.0 <= options.lse_square_scale < float("inf"):
        raise ValueError(
            f"lse_square_scale={options.lse_square_scale} must be a finite number >= 0 (0 turns z-loss off)"
        )
    if options.softcap is not None and not 0.0 < options.softcap < float("inf"):
        raise ValueError(f"softcap={options.softcap} must be a finite number > 0, or None for no softcapping")
    items = options.num_items_in_batch
    if items is not None:
        if options.reduction != "mean":
            raise ValueError(
                f"num_items_in_batch replaces the mean's denominator, so it needs reduction='mean', "
                f"got reduction={options.reduction!r}"
            )
        if isinstance(items, torch.Tensor):
            if items.numel() != 1:
                raise ValueError(
                    f"num_items_in_batch must be a number or a one-element tensor, got {tuple(items.shape)}"
                )
        elif isinstance(items, bool) or not isinstance(items, (int, float)) or not items > 0:
            raise ValueError(f"num_items_in_batch must be a positive number or a one-element tensor, got {items!r}")
    if class_weight is not None and class_weight.requires_grad and torch.is_grad_enabled():
        raise ValueError(
            f"{weight_name} (the class weights) gets no gradient from tigon's cross entropy; "
            f"pass {weight_name}.detach()"
        )


def check_target(target: torch.Tensor, n_rows: int, rows_name: str) -> None:
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"target has dtype {target.dtype}; it must hold class indices as int64 or int32 (target.long())"
        )
    if target.dim() != 1 or target.shape[0] != n_rows:
        raise ValueError(
            f"target has shape {tuple(target.shape)} but there are {n_rows} tokens ({rows_name}); it must be 1-D "
            "with one class index per token (flatten it with target.reshape(-1))"
        )


def check_cross_entropy_inputs(
    logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None, options: LossOptions
) -> None:
    check_float("logits", logits)
    if logits.dim() != 2:
        raise ValueError(
            f"logits has shape {tuple(logits.shape)}; it must be 2-D (tokens, vocabulary): flatten with "
            "logits.reshape(-1, logits.shape[-1]) and target.reshape(-1)"
        )
    n_rows, n_cols = logits.shape
    if n_rows == 0 or n_cols == 0:
        raise ValueError(f"logits has shape {tuple(logits.shape)}: an empty batch or vocabulary has no loss")
    check_target(target, n_rows, "logits.shape[0]")
    check_vector("weight", weight, n_cols, "the vocabulary size (logits.shape[1])")
    check_same_device("logits", logits, target=target, weight=weight)
    check_loss_options(options, weight, "weight")


def _reciprocal(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x != 0, 1.0 / x, 0.0)


def loss_scales(
    target: torch.Tensor, class_weight: torch.Tensor | None, n_classes: int, options: LossOptions
) -> torch.Tensor:
    """float32 [ce_scale, z_scale, sum of class weights] on the target's device, with no host sync."""
    device = target.device
    items = options.num_items_in_batch
    if options.reduction != "mean":
        ce_scale = z_scale = torch.ones((), dtype=torch.float32, device=device)
    elif items is not None:
        if isinstance(items, torch.Tensor):
            items = items.to(device=device, dtype=torch.float32).reshape(())
        else:
            items = torch.full((), float(items), dtype=torch.float32, device=device)
        ce_scale = z_scale = _reciprocal(items)
    else:
        valid = target != options.ignore_index
        z_scale = _reciprocal(valid.sum().to(torch.float32))
        if class_weight is None:
            ce_scale = z_scale
        else:
            target_weights = class_weight.to(torch.float32)[target.clamp(0, n_classes - 1)]
            ce_scale = _reciprocal(torch.where(valid, target_weights, 0.0).sum())
    if class_weight is not None:
        weight_total = class_weight.sum(dtype=torch.float32)
    else:
        weight_total = torch.full((), float(n_classes), dtype=torch.float32, device=device)
    return torch.stack([ce_scale, z_scale, weight_total])


class ChunkLaunch(NamedTuple):
    """How the kernel is launched: chunks of at most `chunk_bytes` of logits, `warps` for a full chunk,
    `programs_per_sm` (64 covers 8192 rows with one program a row; fewer walk several rows each), and `lane`,
    the consecutive logits that share one running (max, sum) in pass 1 (a lane as wide as the chunk makes the
    program reduce across its threads at every chunk instead of once a row)."""

    chunk_bytes: int
    warps: int
    programs_per_sm: int
    lane: int = 8


# From benchmarks/tune_cross_entropy.py at 8192 x 128256 bf16 (docs/benchmarks.md): a program a row with 32 warps and
# a (max, sum) per lane of 8 logits on both GPUs measured; the H200 is fastest with 8192-wide bf16 chunks (8 logits
# a thread, 1.367 ms, 72% of copy), the H100 with 16384-wide ones (1.612 ms, 87%). Chunks copied ahead into shared
# memory (tl.range(num_stages=)) instead of prefetched into registers measured slower on both.
DEFAULT_LAUNCH = ChunkLaunch(chunk_bytes=16384, warps=32, programs_per_sm=64)  # the H200's; GPUs not measured
LAUNCH_BY_GPU = {"NVIDIA H100 80GB HBM3": ChunkLaunch(chunk_bytes=32768, warps=32, programs_per_sm=64)}


def _launch_config(n_rows: int, n_cols: int, element_size: int, device: torch.device) -> tuple[int, int, int, int]:
    """(programs, BLOCK_V, num_warps, LANE) for logits (n_rows, n_cols) of `element_size`-byte floats on `device`."""
    launch = LAUNCH_BY_GPU.get(gpu_name(device), DEFAULT_LAUNCH)
    full_chunk = launch.chunk_bytes // element_size
    block_v = min(next_power_of_2(n_cols), full_chunk)
    programs = max(1, min(n_rows, multiprocessor_count(device) * launch.programs_per_sm))
    warps = launch.warps if block_v == full_chunk else warps_for(block_v)
    return programs, block_v, warps, min(launch.lane, block_v)


def _option_flags(options: LossOptions, class_weight: torch.Tensor | None, row_scale: torch.Tensor | None) -> dict:
    """The kernels' compile-time switches for the loss options in use."""
    return {
        "HAS_WEIGHT": class_weight is not None,
        "HAS_SMOOTHING": options.label_smoothing > 0,
        "HAS_Z": options.lse_square_scale > 0,
        "HAS_SOFTCAP": options.softcap is not None,
        "HAS_ROW_SCALE": row_scale is not None,
    }


def cross_entropy_rows(
    logits: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    scales: torch.Tensor,
    options: LossOptions,
    write_grad: bool,
    loss_out: torch.Tensor,
    z_out: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    pred_out: torch.Tensor | None = None,
    token_scale_out: torch.Tensor | None = None,
) -> None:
    """Launch the kernel on logits (rows, V) with a unit column stride.

    Writes each row's scaled loss into `loss_out` (z-loss into `z_out`, logsumexp into `lse_out`, the argmax
    column into `pred_out`, -1 for an ignored row); with `write_grad`, the gradient of the reduced loss (times
    `row_scale[row]` if given) overwrites `logits`. With `options.token_scaling` each row's loss and gradient are
    multiplied by its target's probability, written into `token_scale_out` (0 for an ignored row) if given.
    """
    n_rows, n_cols = logits.shape
    if options.token_scaling and token_scale_out is None:
        token_scale_out = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    programs, block_v, num_warps, lane = _launch_config(n_rows, n_cols, logits.element_size(), logits.device)
    _cross_entropy_kernel[(programs,)](
        logits,
        logits.stride(0),
        target,
        class_weight if class_weight is not None else scales,
        scales,
        row_scale if row_scale is not None else scales,
        row_scale.stride(0) if row_scale is not None else 0,
        loss_out,
        z_out if z_out is not None else loss_out,
        lse_out if lse_out is not None else loss_out,
        pred_out if pred_out is not None else target,
        token_scale_out if token_scale_out is not None else loss_out,
        n_rows,
        n_cols,
        options.ignore_index,
        options.label_smoothing,
        options.lse_square_scale,
        options.softcap if options.softcap is not None else 1.0,
        **_option_flags(options, class_weight, row_scale),
        STORE_Z=z_out is not None,
        STORE_LSE=lse_out is not None,
        STORE_PRED=pred_out is not None,
        TOKEN_SCALING=options.token_scaling,
        WRITE_GRAD=write_grad,
        BLOCK_V=block_v,
        LANE=lane,
        num_warps=num_warps,
        **LAUNCH_OPTIONS,
    )


GRADIENT_COLUMNS_BLOCK = 1024


def gradient_columns(
    logits: torch.Tensor,
    col_offset: int,
    n_cols: int,
    lse: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    scales: torch.Tensor,
    options: LossOptions,
    row_scale: torch.Tensor | None = None,
) -> None:
    """Overwrite `logits` (rows, W), columns `[col_offset, col_offset + W)` of an `n_cols` vocabulary with unit
    column stride, with the gradient of the reduced loss, given each row's logsumexp `lse` from
    `cross_entropy_rows(lse_out=...)`: the same numbers the full row's kernel writes there."""
    n_rows, n_window = logits.shape
    block = min(GRADIENT_COLUMNS_BLOCK, next_power_of_2(n_window))
    _gradient_columns_kernel[(n_rows, triton.cdiv(n_window, block))](
        logits,
        logits.stride(0),
        col_offset,
        n_window,
        lse,
        target,
        class_weight if class_weight is not None else scales,
        scales,
        row_scale if row_scale is not None else scales,
        row_scale.stride(0) if row_scale is not None else 0,
        n_cols,
        options.ignore_index,
        options.label_smoothing,
        options.lse_square_scale,
        options.softcap if options.softcap is not None else 1.0,
        **_option_flags(options, class_weight, row_scale),
        BLOCK=block,
        num_warps=warps_for(block),
        **LAUNCH_OPTIONS,
    )


def scale_in_place(tensor: torch.Tensor, grad: torch.Tensor) -> None:
    """`tensor *= grad` in place: `grad` a scalar, or one factor per row of a 2-D `tensor` with unit column stride.

    Blocks whose factor is exactly 1 are skipped, so the common `loss.backward()` costs no pass over
    memory and needs no host sync to find that out.
    """
    if tensor.numel() == 0:
        return
    per_row = grad.numel() != 1
    if per_row:
        matrix, stride_g = tensor, grad.stride(0)
    else:
        grad, stride_g = grad.reshape(1), 0
        matrix = tensor.view(1, -1) if tensor.is_contiguous() else tensor
    n_rows, n_cols = matrix.shape
    blocks_per_row = triton.cdiv(n_cols, SCALE_BLOCK)
    n_blocks = n_rows * blocks_per_row
    programs = min(n_blocks, multiprocessor_count(tensor.device) * SCALE_PROGRAMS_PER_SM)
    _scale_kernel[(programs,)](
        matrix,
        matrix.stride(0),
        grad,
        stride_g,
        n_cols,
        n_blocks,
        blocks_per_row,
        PER_ROW=per_row,
        BLOCK=SCALE_BLOCK,
        num_warps=8,
        **LAUNCH_OPTIONS,
    )


def scale_saved_gradients(ctx, op: str, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The backward of an op that computed its input gradients in the forward: scale the saved ones in place by
    the incoming gradient `grad` and return them. A second scaling would be wrong, so a second backward raises."""
    if getattr(ctx, "backward_done", False):
        raise RuntimeError(
            f"tigon {op} computes its gradients in the forward and scales them in place, so it supports one "
            "backward per forward; run the forward again instead of retain_graph=True"
        )
    ctx.backward_done = True
    grads = ctx.saved_tensors
    for saved in grads:
        if saved is not None:
            scale_in_place(saved, grad)
    return grads


def reduce_rows(
    loss_rows: torch.Tensor, z_rows: torch.Tensor | None, options: LossOptions
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row losses (already scaled by the reduction's normalizers) to the returned loss and z-loss."""
    if options.reduction == "none":
        return loss_rows, z_rows
    return loss_rows.sum(), (z_rows.sum() if z_rows is not None else None)


def cross_entropy_forward(
    logits2d: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    options: LossOptions,
    write_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(loss, z_loss or None, each row's argmax or None) of the kernel on `logits2d`."""
    n_rows, n_cols = logits2d.shape
    scales = loss_scales(target, class_weight, n_cols, options)
    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=logits2d.device)
    z_rows = torch.empty_like(loss_rows) if options.return_z_loss else None
    predicted = torch.empty(n_rows, dtype=torch.int64, device=logits2d.device) if options.wants_predictions else None
    cross_entropy_rows(
        logits2d, target, class_weight, scales, options, write_grad, loss_rows, z_rows, pred_out=predicted
    )
    return *reduce_rows(loss_rows, z_rows, options), predicted


def unit_column_stride(logits: torch.Tensor) -> torch.Tensor:
    """`logits` itself when each row is contiguous (any row stride), else a contiguous copy."""
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        return logits.contiguous()
    return logits


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, weight, options):
        logits2d = unit_column_stride(logits)
        loss, z_loss, predicted = cross_entropy_forward(logits2d, target, weight, options, write_grad=True)
        # The logits now hold the gradient: tell autograd, so that a node that saved them for its own
        # backward (tanh, softmax, ...) fails loudly there instead of computing with the wrong numbers.
        torch.autograd.graph.increment_version(logits2d)
        ctx.save_for_backward(logits2d)
        ctx.mark_non_differentiable(*(t for t in (z_loss, predicted) if t is not None))
        return loss, z_loss, predicted

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, *_):
        (grad_logits,) = scale_saved_gradients(ctx, "cross_entropy", grad_loss)  # held in the logits' memory
        # A fresh tensor on the same memory: AccumulateGrad adopts it as a leaf's .grad instead of copying
        # it (it copies gradients whose tensor is still referenced elsewhere, here by ctx).
        return grad_logits.detach(), None, None, None


@eager_under_compile
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
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    check_targets: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | CrossEntropyOutput:
    """Cross entropy of logits `(N, V)` against class indices `target` `(N,)`, as `F.cross_entropy`.

    `weight` (class weights, `(V,)`), `ignore_index`, `label_smoothing` and `reduction` ("mean", "sum",
    "none") behave exactly as in `F.cross_entropy`, except that a mean over no targets is 0, not NaN.
    `softcap` applies `softcap * tanh(logits / softcap)` first (Gemma 2). `lse_square_scale` adds the
    z-loss `lse_square_scale * logsumexp(logits)^2` per non-ignored token (not class-weighted; the mean
    divides it by the token count); `return_z_loss=True` returns `(loss, z_loss)`, where `loss` already
    includes the z-loss and `z_loss` (detached) is for logging. `num_items_in_batch` (reduction "mean")
    divides the summed loss by that number instead of by the number of target tokens, as HF Trainer
    does for gradient accumulation. The loss is float32. `return_token_accuracy` and `return_predicted_tokens`
    return a `CrossEntropyOutput` (loss, z_loss, token_accuracy, predicted_tokens): the argmax of each row comes
    from the kernel's first pass over the logits (the first column at the maximum, as `torch.argmax`; after
    `softcap`, which keeps the order), so asking for it costs no extra read.

    When `logits` requires a gradient, the forward writes the gradient into the logits' own memory
    (so no second `(N, V)` tensor exists): `logits` holds `dloss/dlogits` afterwards, not the logits.
    Pass `logits.clone()` if you still need them. If an earlier op saved the logits for its own
    backward (e.g. a `torch.tanh` softcap: use `softcap=` instead), autograd raises its "modified by
    an inplace operation" error rather than computing a wrong gradient. Logits whose rows are not
    contiguous are copied first. One backward per forward (no `retain_graph`); class weights get no
    gradient.

    `check_targets=True` raises on a target outside `[0, V)` that is not `ignore_index`, at the cost
    of one host-device sync; with `False` such a row gets a NaN loss and gradient.
    """
    options = LossOptions(
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
        lse_square_scale=lse_square_scale,
        softcap=softcap,
        num_items_in_batch=num_items_in_batch,
        return_z_loss=return_z_loss,
        return_token_accuracy=return_token_accuracy,
        return_predicted_tokens=return_predicted_tokens,
    )
    check_cross_entropy_inputs(logits, target, weight, options)
    if check_targets:
        check_target_range(target, logits.shape[1], ignore_index)
    if not use_triton("cross_entropy", logits):
        return reference.cross_entropy(
            logits,
            target,
            weight=weight,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            reduction=reduction,
            lse_square_scale=lse_square_scale,
            softcap=softcap,
            num_items_in_batch=num_items_in_batch,
            return_z_loss=return_z_loss,
            return_token_accuracy=return_token_accuracy,
            return_predicted_tokens=return_predicted_tokens,
            check_targets=False,
        )
    target = target.contiguous()
    if torch.is_grad_enabled() and logits.requires_grad:
        loss, z_loss, predicted = CrossEntropyFunction.apply(logits, target, weight, options)
    else:
        loss, z_loss, predicted = cross_entropy_forward(unit_column_stride(logits), target, weight, options, False)
    return loss_output(loss, z_loss, predicted, target, options)
