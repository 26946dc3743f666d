"""Pure-PyTorch references for every op: the oracle in tests and the fallback on CPU tensors.

Each follows the Hugging Face module it replaces operation by operation, casts included, so on
float64 inputs it is the exact function and on low-precision inputs it rounds where HF rounds.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "llama",
) -> torch.Tensor:
    """Llama: `w * (x / rms(x)).to(x.dtype)`; Gemma: `(x / rms(x) * (offset + w)).to(x.dtype)`, in fp32;
    "none": `x / rms(x) * (offset + w)` in the inputs' own dtypes, no casts."""
    if casting == "none":
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return normed if weight is None else normed * (offset + weight)
    input_dtype = x.dtype
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None:
        return normed.to(input_dtype)
    if casting == "gemma":
        return (normed * (offset + weight.to(normed.dtype))).to(input_dtype)
    return (offset + weight) * normed.to(input_dtype)


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "llama",
) -> tuple[torch.Tensor, torch.Tensor]:
    """`s = x + residual`; returns `(rms_norm(s), s)`."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps, offset, casting), new_residual


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """`torch.nn.LayerNorm` over the last dimension."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding on q `(B, Hq, S, D)` and k `(B, Hk, S, D)`.

    `cos`/`sin` are `(B or 1, S, D)` per token, or, with `position_ids` `(B or 1, S)`, tables of
    shape `(max_positions, D)` indexed by position (packed sequences restart their positions).
    """
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, None], sin[:, None]
    q_out = q * cos.to(q.dtype) + rotate_half(q) * sin.to(q.dtype)
    k_out = k * cos.to(k.dtype) + rotate_half(k) * sin.to(k.dtype)
    return q_out, k_out


def swiglu(
    gate: torch.Tensor, up: torch.Tensor, gate_multiplier: float = 1.0, output_multiplier: float = 1.0
) -> torch.Tensor:
    """`silu(gate) * up`; with Falcon-H1's multipliers `up * silu(gate * gate_multiplier) * output_multiplier`."""
    if gate_multiplier == 1.0 and output_multiplier == 1.0:
        return F.silu(gate) * up
    return up * F.silu(gate * gate_multiplier) * output_multiplier


def geglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    approximate: str = "tanh",
    gate_multiplier: float = 1.0,
    output_multiplier: float = 1.0,
) -> torch.Tensor:
    """`gelu(gate) * up`, with the tanh approximation or the exact erf form (`approximate="none"`); the
    multipliers as in `swiglu`."""
    if gate_multiplier == 1.0 and output_multiplier == 1.0:
        return F.gelu(gate, approximate=approximate) * up
    return up * F.gelu(gate * gate_multiplier, approximate=approximate) * output_multiplier


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """`relu(x) ** 2`, as transformers' `ReLUSquaredActivation` computes it."""
    return torch.square(F.relu(x))


#: torchao's floor under a tensor's absolute maximum: an all-zero tensor scales by the format's maximum / 1e-12
FP8_AMAX_FLOOR = 1e-12


def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    """The absolute maximum of `x` as a float32 scalar (NaN if `x` holds one)."""
    return x.abs().max().to(torch.float32)


def fp8_cast(x: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` scaled by the FP8 format's maximum over `amax` and cast to `dtype` (saturating), with the inverse scale
    `torch._scaled_mm` takes; torchao's tensorwise cast (its scale in float64, then rounded to float32)."""
    fp8_max = torch.finfo(dtype).max
    scale = (fp8_max / amax.to(torch.float64).clamp(min=FP8_AMAX_FLOOR)).to(torch.float32)
    cast = (x.to(torch.float32) * scale).clamp(min=-fp8_max, max=fp8_max).to(dtype)
    return cast, scale.reciprocal()


def fp8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight.T` through FP8 as torchao's tensorwise float8 training computes it: e4m3 input and weight in
    the forward, an e5m2 output gradient in the backward, each with its own dynamic scale."""
    return _FP8LinearReference.apply(x, weight)


class _FP8LinearReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        x2d = x.reshape(-1, x.shape[-1])
        x_fp8, x_inverse = fp8_cast(x2d, fp8_amax(x2d), torch.float8_e4m3fn)
        w_fp8, w_inverse = fp8_cast(weight, fp8_amax(weight), torch.float8_e4m3fn)
        ctx.save_for_backward(x, weight)
        with torch.autocast(x.device.type, enabled=False):
            out = torch._scaled_mm(
                x_fp8, w_fp8.t(), scale_a=x_inverse, scale_b=w_inverse, out_dtype=x.dtype, use_fast_accum=True
            )
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        x2d, grad2d = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        x_fp8, x_inverse = fp8_cast(x2d, fp8_amax(x2d), torch.float8_e4m3fn)
        w_fp8, w_inverse = fp8_cast(weight, fp8_amax(weight), torch.float8_e4m3fn)
        g_fp8, g_inverse = fp8_cast(grad2d, fp8_amax(grad2d), torch.float8_e5m2)
        grad_x = torch._scaled_mm(
            g_fp8, w_fp8.t().contiguous().t(), scale_a=g_inverse, scale_b=w_inverse, out_dtype=grad.dtype
        )
        if not ctx.needs_input_grad[1]:
            return grad_x.view(x.shape), None
        grad_w = torch._scaled_mm(
            g_fp8.t().contiguous(),
            x_fp8.t().contiguous().t(),
            scale_a=g_inverse,
            scale_b=x_inverse,
            out_dtype=grad.dtype,
        )
        return grad_x.view(x.shape), grad_w.to(weight.dtype)


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` with `gate, up = gate_up.chunk(2, -1)`, as Phi-3's and GLM-4's MLPs and the MoE experts do."""
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu(gate, up)


def geglu_packed(gate_up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """`gelu(gate) * up` with `gate, up = gate_up.chunk(2, -1)`."""
    gate, up = gate_up.chunk(2, dim=-1)
    return geglu(gate, up, approximate)


def moe_experts(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """transformers' eager experts loop: each expert's tokens through `down_proj[e] @ (act(gate) * up)`, scaled
    by their routing weight and added into an output of hidden_states' dtype, expert by expert. `activation`:
    "silu", "gelu_tanh" or "gelu_erf"."""
    out = torch.zeros_like(hidden_states)
    for expert in range(gate_up_proj.shape[0]):
        token, slot = torch.where(top_k_index == expert)
        if token.numel() == 0:
            continue
        gate, up = F.linear(hidden_states[token], gate_up_proj[expert]).chunk(2, dim=-1)
        if activation == "silu":
            act = swiglu(gate, up)
        else:
            act = geglu(gate, up, "tanh" if activation == "gelu_tanh" else "none")
        expert_out = F.linear(act, down_proj[expert]) * top_k_weights[token, slot, None]
        out.index_add_(0, token, expert_out.to(out.dtype))
    return out


def out_of_range(target: torch.Tensor, n_classes: int, ignore_index: int) -> torch.Tensor:
    """Where a target is neither `ignore_index` nor a class in [0, n_classes)."""
    return (target != ignore_index) & ((target < 0) | (target >= n_classes))


def check_target_range(target: torch.Tensor, n_classes: int, ignore_index: int) -> None:
    """Raise if a target that is not `ignore_index` lies outside [0, n_classes): one device sync."""
    bad = out_of_range(target, n_classes, ignore_index)
    if bool(bad.any()):
        position = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"target[{position}] = {int(target[position])} is out of range: targets must lie in [0, {n_classes}) "
            f"(the vocabulary size) or equal ignore_index={ignore_index}; fix the labels, or pass "
            "check_targets=False to skip this check (it costs one device sync; a row with a bad target then "
            "gets a NaN loss and a NaN gradient)"
        )


def _safe_divide(total: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """`total / denominator`, and 0 (with zero gradients, not NaN) where the denominator is 0."""
    nonzero = denominator != 0
    return torch.where(nonzero, total / torch.where(nonzero, denominator, 1), 0)


class CrossEntropyOutput(NamedTuple):
    """What the cross-entropy ops return when asked for the token accuracy or the predicted tokens.

    `token_accuracy` is the fraction of non-ignored tokens whose logits' argmax is the target (TRL's
    `mean_token_accuracy`; 0 without such tokens), or with reduction "none" 1.0/0.0 per token (0 where ignored);
    `predicted_tokens` `(N,)` int64 is each token's argmax (-1 where ignored). Absent ones are None.
    """

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None


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
    use_token_scaling: bool = False,
    check_targets: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | CrossEntropyOutput:
    """`F.cross_entropy` on logits `(N, V)` in at least float32, plus softcapping, z-loss and `num_items_in_batch`.

    - `softcap`: the logits become `softcap * tanh(logits / softcap)` first (Gemma 2).
    - The per-token loss is `F.cross_entropy(..., reduction="none")` (class weights and label
      smoothing exactly as torch applies them) plus the z-loss `lse_square_scale * logsumexp^2`
      (not class-weighted); ignored tokens contribute 0 to both.
    - `"mean"` divides the summed cross entropy by the sum of the target weights (the count of
      non-ignored tokens without weights) and the summed z-loss by the count, as torch and
      Liger-Kernel do; with `num_items_in_batch` both are divided by that number instead (what HF
      Trainer passes for gradient accumulation). All targets ignored gives 0, not NaN.
    - With `return_z_loss`, returns `(loss, z_loss)`: `loss` includes the z-loss; `z_loss` is reduced
      the same way and detached (for logging).
    - `use_token_scaling`: each token's loss (z-loss included) times its target's probability, detached.
    - `return_token_accuracy` / `return_predicted_tokens`: a `CrossEntropyOutput` with the argmax of the
      (softcapped) logits and its accuracy over the non-ignored tokens (per token with reduction "none").
    """
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    target = target.long()
    if check_targets:
        check_target_range(target, x.shape[-1], ignore_index)
    class_weight = weight.to(x.dtype) if weight is not None else None
    valid = target != ignore_index
    ce = F.cross_entropy(
        x, target, weight=class_weight, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    z = lse_square_scale * torch.logsumexp(x, dim=-1).square() * valid
    if use_token_scaling:
        probability = x.softmax(-1).gather(-1, torch.where(valid, target, 0)[:, None]).squeeze(-1)
        scale = torch.where(valid, probability, 0).detach()
        ce, z = ce * scale, z * scale
    if reduction == "none":
        loss, z_loss = ce + z, z
    elif reduction == "sum":
        loss, z_loss = ce.sum() + z.sum(), z.sum()
    else:
        if num_items_in_batch is not None:
            items = torch.as_tensor(num_items_in_batch, dtype=x.dtype, device=x.device)
            ce_denominator = z_denominator = items
        else:
            z_denominator = valid.sum().to(x.dtype)
            if class_weight is None:
                ce_denominator = z_denominator
            else:
                ce_denominator = torch.where(valid, class_weight[target.clamp(0, x.shape[-1] - 1)], 0).sum()
        loss, z_loss = _safe_divide(ce.sum(), ce_denominator), _safe_divide(z.sum(), z_denominator)
        loss = loss + z_loss
    if return_token_accuracy or return_predicted_tokens:
        predicted = torch.where(valid, x.argmax(-1), -1).detach()
        correct = ((predicted == target) & valid).float()
        accuracy = correct if reduction == "none" else correct.sum() / valid.sum().clamp_min(1)
        return CrossEntropyOutput(
            loss,
            z_loss.detach() if return_z_loss else None,
            accuracy if return_token_accuracy else None,
            predicted if return_predicted_tokens else None,
        )
    return (loss, z_loss.detach()) if return_z_loss else loss


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    class_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    lse_square_scale: float = 0.0,
    softcap: float | None = None,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    return_z_loss: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    use_token_scaling: bool = False,
    check_targets: bool = True,
    accumulate_in_fp32: bool = True,
    chunk_size: int | None = None,
    borrow_weight_grad: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | CrossEntropyOutput:
    """`cross_entropy(F.linear(hidden, weight, bias), target, weight=class_weight, ...)`, full logits at once.

    `accumulate_in_fp32`, `chunk_size` and `borrow_weight_grad` only steer the fused op's memory use; they are
    accepted and ignored here so both take the same arguments.
    """
    return cross_entropy(
        F.linear(hidden, weight, bias),
        target,
        weight=class_weight,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
        lse_square_scale=lse_square_scale,
        softcap=softcap,
        num_items_in_batch=num_items_in_batch,
        return_z_loss=return_z_loss,
        return_token_accuracy=return_token_accuracy,
        return_predicted_tokens=return_predicted_tokens,
        use_token_scaling=use_token_scaling,
        check_targets=check_targets,
    )


def kl_divergence(
    input: torch.Tensor, target: torch.Tensor, *, reduction: str = "mean", log_target: bool = False
) -> torch.Tensor:
    """`F.kl_div(input, target)` in at least float32: pointwise `target * (log(target) - input)`."""
    dtype = torch.promote_types(torch.promote_types(input.dtype, target.dtype), torch.float32)
    x, y = input.to(dtype), target.to(dtype)
    if reduction == "mean":  # F.kl_div's own "mean" warns that it is not the KL divergence per sample
        return F.kl_div(x, y, reduction="sum", log_target=log_target) / x.numel()
    loss = F.kl_div(x, y, reduction=reduction, log_target=log_target)
    if reduction == "none":
        return loss.to(torch.promote_types(input.dtype, target.dtype))
    return loss.float() if dtype == torch.float32 else loss


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
    """Generalized Jensen-Shannon divergence per token, as TRL's `generalized_jsd_loss`, in at least float32.

    With Q the student's and P the teacher's distribution over the last dimension (log-probabilities
    as given, or `log_softmax(logits / temperature)` with `from_logits`) and M = beta P + (1 - beta) Q:
    beta = 0 gives KL(P || Q), beta = 1 gives KL(Q || P), otherwise beta KL(P || M) + (1 - beta) KL(Q || M).
    Tokens whose `label` is `ignore_index` count 0. "batchmean" divides the sum by the number of
    counted tokens, "mean" by that times the vocabulary size, "sum" does not divide, "none" returns
    one loss per token; no counted token gives 0, not NaN.
    """
    dtype = torch.promote_types(torch.promote_types(student.dtype, teacher.dtype), torch.float32)
    x, y = student.to(dtype), teacher.to(dtype)
    if from_logits:
        x, y = torch.log_softmax(x / temperature, dim=-1), torch.log_softmax(y / temperature, dim=-1)
    if beta == 0:
        pointwise = F.kl_div(x, y, reduction="none", log_target=True)
    elif beta == 1:
        pointwise = F.kl_div(y, x, reduction="none", log_target=True)
    else:
        log_m = torch.logsumexp(torch.stack([y + math.log(beta), x + math.log(1 - beta)]), dim=0)
        pointwise = beta * F.kl_div(log_m, y, reduction="none", log_target=True) + (1 - beta) * F.kl_div(
            log_m, x, reduction="none", log_target=True
        )
    per_token = pointwise.sum(-1)
    if label is not None:
        valid = label.reshape(per_token.shape) != ignore_index
        per_token = torch.where(valid, per_token, 0)
        count = valid.sum().to(dtype)
    else:
        count = torch.tensor(float(per_token.numel()), dtype=dtype, device=per_token.device)
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    if reduction == "mean":
        count = count * x.shape[-1]
    return _safe_divide(per_token.sum(), count)


def fused_linear_jsd(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    label: torch.Tensor | None = None,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    ignore_index: int = -100,
    reduction: str = "batchmean",
    accumulate_in_fp32: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """`jsd(student_hidden @ student_weight.T, teacher_hidden @ teacher_weight.T, from_logits=True, ...)`.

    The full logits at once; `accumulate_in_fp32` and `chunk_size` only steer the fused op's memory
    use and are accepted and ignored here so both take the same arguments.
    """
    return jsd(
        F.linear(student_hidden, student_weight),
        F.linear(teacher_hidden, teacher_weight),
        label,
        beta=beta,
        temperature=temperature,
        ignore_index=ignore_index,
        reduction=reduction,
        from_logits=True,
    )


def sequence_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence of hidden `(B, T, H)`: the summed log-probs of the targets `(B, T)` under the full logits
    `F.linear(hidden, weight, bias)` (in at least float32), and the count of non-ignored targets."""
    logits = F.linear(hidden, weight, bias)
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    valid = target != ignore_index
    token_logps = x.log_softmax(-1).gather(-1, torch.where(valid, target, 0).long().unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, token_logps, 0).sum(-1), valid.sum(-1)


def _preference_ref_logps(
    target: torch.Tensor,
    ref_logps: torch.Tensor | None,
    ref_hidden: torch.Tensor | None,
    ref_weight: torch.Tensor | None,
    ref_bias: torch.Tensor | None,
    ignore_index: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The reference model's summed log-probs: as passed, or from its head (no gradient)."""
    if ref_logps is None:
        with torch.no_grad():
            ref_logps, _ = sequence_logps(ref_hidden, ref_weight, target, ref_bias, ignore_index=ignore_index)
    return ref_logps.detach().to(dtype)


def _average(logps: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Length-normalized log-probs; 0 for a sequence with no targets."""
    return torch.where(counts > 0, logps / counts.clamp_min(1), 0)


def _chosen_nll(chosen_logps: torch.Tensor, chosen_counts: torch.Tensor) -> torch.Tensor:
    """Cross entropy averaged over all chosen target tokens (TRL's NLL term); 0 when there are none."""
    return -chosen_logps.sum() / chosen_counts.sum().clamp_min(1)


def _target_logits_mean(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    per_sequence: bool = False,
) -> torch.Tensor:
    """TRL's logits/chosen: the mean logit over the non-ignored target tokens and the vocabulary (0 without any),
    over all given sequences or per sequence."""
    logits = F.linear(hidden, weight, bias)
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    valid = (target != ignore_index)[..., None]
    dims = (1, 2) if per_sequence else (0, 1, 2)
    return (torch.where(valid, x, 0).sum(dims) / (valid.sum(dims) * x.shape[-1]).clamp_min(1)).detach()


def _paired_logits_means(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor, ignore_index: int
) -> dict[str, torch.Tensor]:
    pairs = hidden.shape[0] // 2
    return {
        "chosen_logits_mean": _target_logits_mean(hidden[:pairs], weight, bias, target[:pairs], ignore_index),
        "rejected_logits_mean": _target_logits_mean(hidden[pairs:], weight, bias, target[pairs:], ignore_index),
    }


def _sigmoid_preference(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def _dpo_pair_loss(
    loss_type: str, chosen: torch.Tensor, rejected: torch.Tensor, chosen_avg: torch.Tensor,
    rejected_avg: torch.Tensor, beta: float, eps: float, tau: float,
) -> torch.Tensor:  # fmt: skip
    """TRL's per-pair DPO loss of `loss_type` on the log-ratios (and their per-token averages)."""
    margin = beta * (chosen - rejected)
    table = {
        "sigmoid": lambda: _sigmoid_preference(margin, eps),
        "hinge": lambda: (1 - margin).clamp_min(0),
        "ipo": lambda: (chosen_avg - rejected_avg - 1 / (2 * beta)).square(),
        "exo_pair": lambda: (
            torch.sigmoid(margin) * (F.logsigmoid(margin) - math.log(1 - eps))
            + torch.sigmoid(-margin) * (F.logsigmoid(-margin) - math.log(eps))
        ),
        "nca_pair": lambda: (
            -F.logsigmoid(beta * chosen) - F.logsigmoid(-beta * chosen) / 2 - F.logsigmoid(-beta * rejected) / 2
        ),
        "robust": lambda: (-(1 - eps) * F.logsigmoid(margin) + eps * F.logsigmoid(-margin)) / (1 - 2 * eps),
        "bco_pair": lambda: -F.logsigmoid(beta * chosen) - F.logsigmoid(-beta * rejected),
        "sppo_hard": lambda: (chosen - 1 / (2 * beta)).square() + (rejected + 1 / (2 * beta)).square(),
        "apo_zero": lambda: 1 - torch.sigmoid(beta * chosen) + torch.sigmoid(beta * rejected),
        "apo_down": lambda: torch.sigmoid(beta * chosen) + 1 - torch.sigmoid(margin),
        "discopop": lambda: (
            -F.logsigmoid(margin) * (1 - torch.sigmoid(margin / tau)) + torch.exp(-margin) * torch.sigmoid(margin / tau)
        ),
        "sigmoid_norm": lambda: -F.logsigmoid(beta * (chosen_avg - rejected_avg)),
    }
    return table[loss_type]()


def fused_linear_dpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ref_logps: torch.Tensor | None = None,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str | list[str] | tuple[str, ...] = "sigmoid",
    loss_weights: list[float] | tuple[float, ...] | None = None,
    average_log_prob: bool = False,
    rpo_alpha: float | None = None,
    discopop_tau: float = 0.05,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's DPO on the full logits: with log-ratios `x = logp - ref` (summed log-probs, or averaged over the
    target tokens with `average_log_prob`), the mean over pairs of each `loss_type`'s per-pair loss (TRL's
    formulas; "sft" is the chosen tokens' mean NLL), weighted by `loss_weights` and summed, plus `rpo_alpha`
    times that NLL; rewards `beta * x`."""
    logps, counts = sequence_logps(hidden, weight, target, bias, ignore_index=ignore_index)
    ref = _preference_ref_logps(target, ref_logps, ref_hidden, ref_weight, ref_bias, ignore_index, logps.dtype)
    if average_log_prob:
        logps, ref = _average(logps, counts), _average(ref, counts)
    pairs = hidden.shape[0] // 2
    ratios = logps - ref
    averages = _average(ratios, counts)
    summed, _ = sequence_logps(hidden[:pairs], weight, target[:pairs], bias, ignore_index=ignore_index)
    nll = _chosen_nll(summed, counts[:pairs])
    types = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    weights = list(loss_weights) if loss_weights is not None else [1.0] * len(types)
    loss = rpo_alpha * nll if rpo_alpha is not None else 0
    for name, type_weight in zip(types, weights, strict=True):
        if name == "sft":
            loss = loss + type_weight * nll
        elif name in ("aot", "aot_unpaired"):  # TRL's: sort over the batch, then the sigmoid loss
            chosen, rejected = logps[:pairs], logps[pairs:]
            if name == "aot":
                delta = torch.sort(chosen - rejected).values - torch.sort(ref[:pairs] - ref[pairs:]).values
            else:
                delta = torch.sort(ratios[:pairs]).values - torch.sort(ratios[pairs:]).values
            loss = loss + type_weight * _sigmoid_preference(beta * delta, label_smoothing).mean()
        else:
            per_pair = _dpo_pair_loss(
                name, ratios[:pairs], ratios[pairs:], averages[:pairs], averages[pairs:], beta, label_smoothing,
                discopop_tau,
            )  # fmt: skip
            loss = loss + type_weight * per_pair.mean()
    metrics = {
        "chosen_rewards": (beta * ratios[:pairs]).detach(),
        "rejected_rewards": (beta * ratios[pairs:]).detach(),
        "chosen_logps": logps[:pairs].detach(),
        "rejected_logps": logps[pairs:].detach(),
        **_paired_logits_means(hidden, weight, bias, target, ignore_index),
    }
    if rpo_alpha is not None or "sft" in types:
        metrics["nll_loss"] = nll.detach()
    return loss, metrics


def fused_linear_cpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    alpha: float = 1.0,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's CPO sigmoid loss: mean over pairs of the smoothed `-log sigmoid(beta * (c - r))` on summed
    log-probs, plus `alpha` times the chosen tokens' mean NLL; rewards `beta * logp`."""
    logps, counts = sequence_logps(hidden, weight, target, bias, ignore_index=ignore_index)
    pairs = hidden.shape[0] // 2
    chosen, rejected = logps[:pairs], logps[pairs:]
    nll = _chosen_nll(chosen, counts[:pairs])
    loss = _sigmoid_preference(beta * (chosen - rejected), label_smoothing).mean() + alpha * nll
    metrics = {
        "chosen_rewards": (beta * chosen).detach(),
        "rejected_rewards": (beta * rejected).detach(),
        "chosen_logps": chosen.detach(),
        "rejected_logps": rejected.detach(),
        "nll_loss": nll.detach(),
        **_paired_logits_means(hidden, weight, bias, target, ignore_index),
    }
    return loss, metrics


def fused_linear_simpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    alpha: float = 0.0,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SimPO (TRL's CPO `loss_type="simpo"`): `z = beta * (avg_c - avg_r) - gamma` on length-normalized
    log-probs, mean of the smoothed `-log sigmoid(z)`, plus `alpha` times the chosen NLL; rewards `beta * avg`."""
    logps, counts = sequence_logps(hidden, weight, target, bias, ignore_index=ignore_index)
    pairs = hidden.shape[0] // 2
    average = _average(logps, counts)
    chosen, rejected = average[:pairs], average[pairs:]
    nll = _chosen_nll(logps[:pairs], counts[:pairs])
    loss = _sigmoid_preference(beta * (chosen - rejected) - gamma, label_smoothing).mean() + alpha * nll
    metrics = {
        "chosen_rewards": (beta * chosen).detach(),
        "rejected_rewards": (beta * rejected).detach(),
        "chosen_logps": chosen.detach(),
        "rejected_logps": rejected.detach(),
        "nll_loss": nll.detach(),
        **_paired_logits_means(hidden, weight, bias, target, ignore_index),
    }
    return loss, metrics


def fused_linear_orpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    nll_target: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's ORPO: chosen NLL `- beta * mean(log sigmoid(log_odds))` with, on length-normalized log-probs,
    `log_odds = (c - r) - (log1p(-exp(c)) - log1p(-exp(r)))`. A pair whose odds are undefined (a sequence
    without targets, or of probability 1) has log-odds and ratio 0. `nll_target` (its chosen half) replaces
    `target` in the NLL."""
    logps, counts = sequence_logps(hidden, weight, target, bias, ignore_index=ignore_index)
    pairs = hidden.shape[0] // 2
    average = _average(logps, counts)
    chosen, rejected = average[:pairs], average[pairs:]
    defined = (chosen < 0) & (rejected < 0)
    c, r = torch.where(defined, chosen, -1.0), torch.where(defined, rejected, -1.0)
    log_odds = torch.where(defined, (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r))), 0)
    ratio = torch.where(defined, F.logsigmoid(log_odds), 0)
    if nll_target is None:
        nll = _chosen_nll(logps[:pairs], counts[:pairs])
    else:
        h_chosen = hidden[:pairs]
        nll_logps, nll_counts = sequence_logps(h_chosen, weight, nll_target[:pairs], bias, ignore_index=ignore_index)
        nll = _chosen_nll(nll_logps, nll_counts)
    metrics = {
        "chosen_rewards": (beta * chosen).detach(),
        "rejected_rewards": (beta * rejected).detach(),
        "chosen_logps": chosen.detach(),
        "rejected_logps": rejected.detach(),
        "nll_loss": nll.detach(),
        "log_odds_ratio": ratio.mean().detach(),
        "log_odds_chosen": log_odds.mean().detach(),
        **_paired_logits_means(hidden, weight, bias, target, ignore_index),
    }
    return nll - beta * ratio.mean(), metrics


def fused_linear_kto(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    desirable: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ref_logps: torch.Tensor | None = None,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    kl: float | torch.Tensor | None = None,
    kl_hidden: torch.Tensor | None = None,
    kl_target: torch.Tensor | None = None,
    ref_kl_logps: torch.Tensor | None = None,
    ref_kl_hidden: torch.Tensor | None = None,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
    average_log_prob: bool = False,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """TRL's KTO on summed (or with `average_log_prob` averaged) log-probs: with `x = logp - ref`, the mean over
    samples of `desirable_weight * (1 - sigmoid(beta * (x - kl)))` (desirable samples) or
    `undesirable_weight * (1 - sigmoid(beta * (kl - x)))` (undesirable ones). `kl` is given,
    or `clamp(mean(kl_logps - ref_kl_logps), min=0)` over the mismatched KL batch, detached.
    `loss_type="apo_zero_unpaired"`: `1 - sigmoid(beta * x)` (desirable) or `sigmoid(beta * x)` (undesirable)."""
    logps, counts = sequence_logps(hidden, weight, target, bias, ignore_index=ignore_index)
    ref = _preference_ref_logps(target, ref_logps, ref_hidden, ref_weight, ref_bias, ignore_index, logps.dtype)
    if average_log_prob:
        logps, ref = _average(logps, counts), _average(ref, counts)
    if kl is None and loss_type == "kto":
        with torch.no_grad():
            kl_logps, kl_counts = sequence_logps(kl_hidden, weight, kl_target, bias, ignore_index=ignore_index)
            ref_kl = _preference_ref_logps(
                kl_target, ref_kl_logps, ref_kl_hidden, ref_weight, ref_bias, ignore_index, logps.dtype
            )
            if average_log_prob:
                kl_logps, ref_kl = _average(kl_logps, kl_counts), _average(ref_kl, kl_counts)
            kl = (kl_logps - ref_kl).mean().clamp(min=0)
    x = logps - ref
    if loss_type == "apo_zero_unpaired":
        kl = torch.zeros((), dtype=logps.dtype, device=logps.device)
        losses = torch.where(
            desirable, desirable_weight * (1 - torch.sigmoid(beta * x)), undesirable_weight * torch.sigmoid(beta * x)
        )
    else:
        kl = torch.as_tensor(kl, dtype=logps.dtype, device=logps.device).detach()
        losses = torch.where(
            desirable,
            desirable_weight * (1 - torch.sigmoid(beta * (x - kl))),
            undesirable_weight * (1 - torch.sigmoid(beta * (kl - x))),
        )
    metrics = {
        "rewards": (beta * x).detach(),
        "logps": logps.detach(),
        "logits_mean": _target_logits_mean(hidden, weight, bias, target, ignore_index, per_sequence=True),
        "kl": kl,
    }
    return losses.mean(), metrics
