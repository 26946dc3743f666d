"""Generalized Jensen-Shannon divergence between a student and a teacher distribution over the vocabulary.

Per token, with Q the student's and P the teacher's distribution (X = log Q, Y = log P: the inputs
themselves when they are log-probabilities, or `log_softmax(logits / temperature)` with
`from_logits=True`) and the mixture M = beta P + (1 - beta) Q, as in the GKD paper (Agarwal et al.,
2024) and TRL's `generalized_jsd_loss`:

    beta = 0:       KL(P || Q) = sum_j P_j (Y_j - X_j)                         (forward KL)
    beta = 1:       KL(Q || P) = sum_j Q_j (X_j - Y_j)                         (reverse KL)
    0 < beta < 1:   beta KL(P || M) + (1 - beta) KL(Q || M)
                    = sum_j beta P_j (Y_j - log M_j) + (1 - beta) Q_j (X_j - log M_j)

with log M = log(beta P + (1 - beta) Q), its argument floored at the smallest normal float: where both
probabilities underflow, both terms are zero anyway, and no NaN comes of it.
The gradient with respect to the student's log-probabilities X is

    g_j = -P_j,   Q_j (X_j - Y_j + 1),   (1 - beta) Q_j (X_j - log M_j)          (beta = 0, 1, else)

and with respect to the student's logits s (X = log_softmax(s / T)): (g_j - Q_j sum_k g_k) / T.
Temperature is not squared back in (as in TRL and Liger-Kernel); multiply the loss by T^2 if you want
Hinton's scaling. The teacher gets no gradient.

One program owns one row (a persistent grid). On logits, pass 1 walks the vocabulary in chunks with
an online softmax for both models (running maxima and rescaled sums), pass 2 sums the loss and
`sum_k g_k`, pass 3 writes the gradient (at beta = 0, `sum_k g_k = -1` and pass 2 writes it); on
log-probabilities one pass does both. The forward writes
the gradient of the reduced loss (into a new buffer here, into the student's logits chunk in the fused
linear op); the backward only scales it by the incoming gradient. Reduction: "batchmean" (sum over
tokens / number of non-ignored tokens), "sum", "mean" (batchmean / V, as TRL's `jsd.mean()`) or
"none" (one loss per token). The normalizer is computed on the device: no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from tigon.kernels import reference
from tigon.kernels.ops.cross_entropy import LOG2E, scale_saved_gradients
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
FULL_CHUNK_WARPS = 8
SMALLEST_NORMAL = tl.constexpr(2.0**-126)  # float32


@triton.jit
def _online_lse(m, d, z):
    """One step of an online logsumexp: running max m and sum d of exp(z - m) after the chunk z.

    Exponentials here and in `_terms` are `exp2` of the argument times log2(e): `tl.exp` adds a subnormal range fix
    of three instructions per call, and a subnormal probability changes no sum here."""
    m_new = tl.maximum(m, tl.max(z, axis=0))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a chunk of only -inf stays finite
    d = d * tl.exp2((m - m_ref) * LOG2E) + tl.sum(tl.exp2(z * LOG2E - m_ref * LOG2E), axis=0)
    return m_new, d


@triton.jit
def _terms(x, y, beta, BETA_MODE: tl.constexpr):
    """(pointwise loss, d loss / d x, Q = exp(x)) for student log-probabilities x and teacher ones y."""
    q = tl.exp2(x * LOG2E)
    if BETA_MODE == 0:
        p = tl.exp2(y * LOG2E)
        loss = p * (y - x)
        grad = -p
    elif BETA_MODE == 1:
        loss = q * (x - y)
        grad = loss + q
    else:
        p = tl.exp2(y * LOG2E)
        log_m = tl.log(tl.maximum(beta * p + (1.0 - beta) * q, SMALLEST_NORMAL))
        grad = (1.0 - beta) * q * (x - log_m)
        loss = beta * p * (y - log_m) + grad
    return loss, grad, q


@triton.jit(do_not_specialize=DATA_COUNTS)
def _jsd_kernel(
    S,
    stride_s,
    T,
    stride_t,
    GRAD,
    stride_grad,
    LABEL,
    SCALE,
    ROW_SCALE,
    stride_row_scale,
    LOSS,
    n_rows,
    n_cols,
    ignore_index,
    beta,
    inv_temperature,
    FROM_LOGITS: tl.constexpr,
    HAS_LABEL: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr,
    WRITE_GRAD: tl.constexpr,
    BETA_MODE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    offsets = tl.arange(0, BLOCK_V)
    for row in range(tl.program_id(0).to(tl.int64), n_rows, tl.num_programs(0)):
        s_row = S + row * stride_s
        t_row = T + row * stride_t
        g_row = GRAD + row * stride_grad
        ignored = False
        if HAS_LABEL:
            ignored = tl.load(LABEL + row) == ignore_index
        if ignored:
            tl.store(LOSS + row, 0.0)
            if WRITE_GRAD:
                zeros = tl.zeros((BLOCK_V,), dtype=GRAD.dtype.element_ty)
                for start in range(0, n_cols, BLOCK_V):
                    cols = start + offsets
                    tl.store(g_row + cols, zeros, mask=cols < n_cols)
        else:
            scale = tl.load(SCALE)
            coef = scale
            if HAS_ROW_SCALE:
                coef = coef * tl.load(ROW_SCALE + row * stride_row_scale).to(tl.float32)
            lse_s = 0.0
            lse_t = 0.0
            if FROM_LOGITS:  # pass 1: both log-normalizers, online
                m_s = float("-inf")
                d_s = 0.0
                m_t = float("-inf")
                d_t = 0.0
                for start in range(0, n_cols, BLOCK_V):
                    cols = start + offsets
                    mask = cols < n_cols
                    zs = tl.load(s_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_temperature
                    zt = tl.load(t_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_temperature
                    m_s, d_s = _online_lse(m_s, d_s, tl.where(mask, zs, float("-inf")))
                    m_t, d_t = _online_lse(m_t, d_t, tl.where(mask, zt, float("-inf")))
                lse_s = m_s + tl.log(d_s)
                lse_t = m_t + tl.log(d_t)

            # pass 2: the loss and sum_k g_k (on log-probabilities the gradient itself, written at once)
            loss = 0.0
            grad_sum = 0.0
            for start in range(0, n_cols, BLOCK_V):
                cols = start + offsets
                mask = cols < n_cols
                x = tl.load(s_row + cols, mask=mask, other=0.0).to(tl.float32)
                y = tl.load(t_row + cols, mask=mask, other=0.0).to(tl.float32)
                if FROM_LOGITS:
                    x = x * inv_temperature - lse_s
                    y = y * inv_temperature - lse_t
                pointwise, grad, q = _terms(x, y, beta, BETA_MODE)
                loss += tl.sum(tl.where(mask, pointwise, 0.0), axis=0)
                if FROM_LOGITS:
                    if BETA_MODE == 0:  # g = -P sums to -1, so d/ds = (Q - P) / T is known already
                        if WRITE_GRAD:
                            grad = (q + grad) * (coef * inv_temperature)
                            tl.store(g_row + cols, grad.to(GRAD.dtype.element_ty), mask=mask)
                    else:
                        grad_sum += tl.sum(tl.where(mask, grad, 0.0), axis=0)
                elif WRITE_GRAD:
                    tl.store(g_row + cols, (grad * coef).to(GRAD.dtype.element_ty), mask=mask)
            tl.store(LOSS + row, loss * scale)

            # pass 3 (logits): through the softmax, d/ds_j = (g_j - Q_j sum_k g_k) / T
            if FROM_LOGITS and WRITE_GRAD and BETA_MODE != 0:
                coef = coef * inv_temperature
                for start in range(0, n_cols, BLOCK_V):
                    cols = start + offsets
                    mask = cols < n_cols
                    x = tl.load(s_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_temperature - lse_s
                    y = tl.load(t_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_temperature - lse_t
                    _, grad, q = _terms(x, y, beta, BETA_MODE)
                    tl.store(g_row + cols, ((grad - q * grad_sum) * coef).to(GRAD.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class JSDOptions:
    """The options shared by `jsd` and `fused_linear_jsd`."""

    beta: float = 0.5
    temperature: float = 1.0
    ignore_index: int = -100
    reduction: str = "batchmean"


def check_jsd_options(options: JSDOptions) -> None:
    """Raise on a reduction, beta, temperature or ignore_index outside what the kernel computes."""
    if options.reduction not in REDUCTIONS:
        raise ValueError(f"reduction={options.reduction!r} is not one of {REDUCTIONS}")
    if isinstance(options.beta, bool) or not isinstance(options.beta, (int, float)) or not 0 <= options.beta <= 1:
        raise ValueError(
            f"beta={options.beta!r} must be a number in [0, 1] (0: forward KL(teacher || student), "
            "1: reverse KL(student || teacher), 0.5: the symmetric JSD)"
        )
    temperature = options.temperature
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < float("inf"):
        raise ValueError(f"temperature={temperature!r} must be a finite number > 0 (1.0 leaves the logits as they are)")
    if isinstance(options.ignore_index, bool) or not isinstance(options.ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {options.ignore_index!r}")


def check_label(label: torch.Tensor | None, n_rows: int, rows_name: str) -> None:
    """An optional label must hold one integer per token (row)."""
    if label is None:
        return
    if not isinstance(label, torch.Tensor):
        raise TypeError(f"label must be a torch.Tensor or None, got {type(label).__name__}")
    if label.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"label has dtype {label.dtype}; it must hold token ids as int64 or int32 (label.long())")
    if label.numel() != n_rows:
        raise ValueError(
            f"label has shape {tuple(label.shape)} but there are {n_rows} tokens ({rows_name}); pass one label per "
            "token (only its comparison with ignore_index is used)"
        )


def loss_scale(
    label: torch.Tensor | None, n_rows: int, n_cols: int, options: JSDOptions, device: torch.device
) -> torch.Tensor:
    """float32 one-element tensor: the reduction's normalizer, computed on the device (no host sync)."""
    if options.reduction in ("sum", "none"):
        return torch.ones(1, dtype=torch.float32, device=device)
    if label is None:
        count = torch.full((1,), float(n_rows), dtype=torch.float32, device=device)
    else:
        count = (label != options.ignore_index).sum().to(torch.float32).reshape(1)
    if options.reduction == "mean":
        count = count * n_cols
    return torch.where(count != 0, 1.0 / count, 0.0)


def beta_mode(beta: float) -> int:
    """The kernel's BETA_MODE: 0 forward KL, 1 reverse KL, 2 the mixture JSD."""
    return 0 if beta == 0 else 1 if beta == 1 else 2


def jsd_rows(
    student: torch.Tensor,
    teacher: torch.Tensor,
    label: torch.Tensor | None,
    scale: torch.Tensor,
    options: JSDOptions,
    from_logits: bool,
    grad_out: torch.Tensor | None,
    loss_out: torch.Tensor,
    row_scale: torch.Tensor | None = None,
) -> None:
    """Launch the kernel on student and teacher rows `(rows, V)` with unit column stride.

    Writes each row's scaled loss into `loss_out` and, when `grad_out` is given (it may be `student`
    itself), the gradient of the reduced loss with respect to the student (times `row_scale[row]`).
    """
    n_rows, n_cols = student.shape
    block_v = min(next_power_of_2(n_cols), MAX_BLOCK_V)
    programs = max(1, min(n_rows, multiprocessor_count(student.device) * PROGRAMS_PER_SM))
    grad = grad_out if grad_out is not None else student
    _jsd_kernel[(programs,)](
        student,
        student.stride(0),
        teacher,
        teacher.stride(0),
        grad,
        grad.stride(0),
        label if label is not None else scale,
        scale,
        row_scale if row_scale is not None else scale,
        row_scale.stride(0) if row_scale is not None else 0,
        loss_out,
        n_rows,
        n_cols,
        options.ignore_index,
        float(options.beta),
        1.0 / options.temperature,
        FROM_LOGITS=from_logits,
        HAS_LABEL=label is not None,
        HAS_ROW_SCALE=row_scale is not None,
        WRITE_GRAD=grad_out is not None,
        BETA_MODE=beta_mode(options.beta),
        BLOCK_V=block_v,
        num_warps=FULL_CHUNK_WARPS if block_v == MAX_BLOCK_V else warps_for(block_v),
        **LAUNCH_OPTIONS,
    )


def reduce_rows(loss_rows: torch.Tensor, options: JSDOptions) -> torch.Tensor:
    """Per-row losses (already scaled by the reduction's normalizer) to the returned loss."""
    return loss_rows if options.reduction == "none" else loss_rows.sum()


def _forward(
    student: torch.Tensor,
    teacher: torch.Tensor,
    label: torch.Tensor | None,
    options: JSDOptions,
    from_logits: bool,
    want_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss, gradient of the reduced loss with respect to the student as (rows, V), or None)."""
    s, t = rows_view(student), rows_view(teacher)
    n_rows, n_cols = s.shape
    label = label.reshape(-1).contiguous() if label is not None else None
    scale = loss_scale(label, n_rows, n_cols, options, s.device)
    loss_rows = torch.empty(n_rows, dtype=torch.float32, device=s.device)
    grad = torch.empty((n_rows, n_cols), dtype=student.dtype, device=s.device) if want_grad else None
    jsd_rows(s, t, label, scale, options, from_logits, grad, loss_rows)
    loss = reduce_rows(loss_rows, options)
    return (loss.view(student.shape[:-1]) if options.reduction == "none" else loss), grad


class JSDFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, student, teacher, label, options, from_logits):
        loss, grad = _forward(student, teacher, label, options, from_logits, want_grad=True)
        ctx.save_for_backward(grad)
        ctx.shape = student.shape
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        (grad,) = scale_saved_gradients(ctx, "jsd", grad_loss.reshape(-1) if grad_loss.dim() > 0 else grad_loss)
        return grad.view(ctx.shape), None, None, None, None


def check_jsd_inputs(
    student: torch.Tensor, teacher: torch.Tensor, label: torch.Tensor | None, options: JSDOptions
) -> None:
    """Raise a ValueError/TypeError that names the problem and the fix."""
    check_float("student", student)
    check_float("teacher", teacher)
    if student.dim() == 0 or student.numel() == 0:
        raise ValueError(
            f"student has shape {tuple(student.shape)}; it must be a non-empty (..., vocabulary) tensor, "
            "e.g. (tokens, vocabulary)"
        )
    if teacher.shape != student.shape:
        raise ValueError(
            f"teacher has shape {tuple(teacher.shape)} but student has shape {tuple(student.shape)}; both must be "
            "(..., vocabulary) with the same shape"
        )
    check_label(label, student.numel() // student.shape[-1], "student's rows")
    check_same_device("student", student, teacher=teacher, label=label)
    check_jsd_options(options)
    if teacher.requires_grad and torch.is_grad_enabled():
        raise ValueError("teacher gets no gradient from tigon's jsd; pass teacher.detach()")


@eager_under_compile
def jsd(
    student: torch.Tensor,
    teacher: torch.Tensor,
    label: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "batchmean",
    from_logits: bool = False,
) -> torch.Tensor:
    """Generalized JSD between student and teacher distributions `(..., V)` (see the module docstring).

    With `from_logits=False` (the default, as Liger-Kernel's `LigerJSD`) both inputs are
    log-probabilities, used as given; with `from_logits=True` they are logits and the kernel takes
    `log_softmax(x / temperature)` itself (TRL's `generalized_jsd_loss`). `beta=0` is the forward KL
    KL(teacher || student), `beta=1` the reverse KL(student || teacher). Tokens whose `label` (one per
    row, optional) equals `ignore_index` count 0. `reduction`: "batchmean" (sum / number of counted
    tokens; 0 if there are none), "sum", "mean" (batchmean / V) or "none" (per token, shape `(...)`).
    The loss is float32. Only the student gets a gradient (in its dtype), computed in the forward into
    a buffer of the student's size; one backward per forward.
    """
    options = JSDOptions(beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction)
    check_jsd_inputs(student, teacher, label, options)
    if not from_logits and temperature != 1.0:
        raise ValueError(
            f"temperature={temperature} applies to logits: pass from_logits=True with logits, or temperature=1.0 "
            "with log-probabilities"
        )
    if not use_triton("jsd", student):
        return reference.jsd(
            student,
            teacher,
            label,
            beta=beta,
            temperature=temperature,
            ignore_index=ignore_index,
            reduction=reduction,
            from_logits=from_logits,
        )
    if torch.is_grad_enabled() and student.requires_grad:
        return JSDFunction.apply(student, teacher, label, options, from_logits)
    loss, _ = _forward(student, teacher, label, options, from_logits, want_grad=False)
    return loss
