"""The driver of the fused linear preference losses (DPO, ORPO, SimPO, CPO, KTO).

Each loss file (``dpo.py``, ``cpo.py``, ``simpo.py``, ``orpo.py``, ``kto.py``) holds a `PreferenceLoss`: the loss's
options, their checks, its formula as a function of one chunk's per-sequence log-probs (``chunk_loss``) and its
metrics. `fused_linear_preference` runs any of them: it casts the operands under autocast, checks the inputs every
loss shares (heads, targets, the reference model's inputs, ``nll_target``, chunking), falls back to the loss's
float reference on the full logits where no kernel runs, and otherwise runs the chunked pass below, with autograd.

Each of these losses is a function of per-sequence log-probabilities of the targets,

    logp[b] = sum_t log_softmax(hidden[b, t] @ weight.T + bias)[target[b, t]]   over t with target != ignore_index

(and of the token counts ``n[b]`` for the length-normalized ones), so its gradient with respect to the
logits of token ``(b, t)`` is ``dL/dlogp[b] * (onehot(target) - softmax(logits))``: the cross-entropy
gradient times one factor per sequence. The batch is processed in chunks of whole groups (a pair of
sequences for the paired losses, whose batch holds the chosen rows then the rejected rows as TRL and
Liger-Kernel lay it out; one sequence for KTO). For each chunk:

1. one cuBLAS matmul writes the chunk's logits into a reused buffer (with ``ref_hidden``/``ref_weight``,
   the reference model's logits go through the same buffer first, without gradient);
2. the cross-entropy kernel (``cross_entropy.py``, reduction "sum") returns each token's ``-logp``;
3. the chunk's share of the loss and ``dL/dlogp[b]`` for its sequences come from autograd on those few
   float64 numbers (the loss's ``chunk_loss``, a function of ``logp``, ``n`` and the reference log-probs);
4. the kernel runs again with that factor as its per-row scale and overwrites the logits with
   ``dL/dlogits``;
5. two more matmuls give ``grad_hidden`` for the chunk and add the chunk's share to ``grad_weight``
   (and ``grad_bias``), exactly as in ``fused_linear_cross_entropy``.

So there is one forward and two gradient matmuls per chunk, at most one chunk of logits exists, and
the backward only scales the finished gradients by the incoming gradient (skipped when it is 1).
The mean-logit metrics TRL logs need no pass over the logits: a token's logits summed over the
vocabulary are ``hidden . sum_v weight[v] + sum(bias)``, one matrix-vector product per chunk.

Chunk size: ``choose_chunk_size`` of ``fused_linear_cross_entropy`` with logits of up to half the weight's
bytes (``hidden / 2`` tokens, twice cross entropy's ``hidden / 4``) gives the tokens per chunk; a chunk holds
as many whole groups as fit, and at least one. ``chunk_size=`` sets the groups per chunk. Two pairs a chunk
(512-token sequences at hidden 4096) is the most that keeps DPO with a reference head under Liger-Kernel's
memory; one pair is slower, four are faster but larger (``benchmarks/tune_fused_linear_preference.py``; the
table is in docs/benchmarks.md, "Alignment losses").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Any, ClassVar

import torch
from torch.autograd.function import once_differentiable

from tigon.kernels import reference
from tigon.kernels.ops.cross_entropy import LossOptions, cross_entropy_rows, loss_scales, scale_saved_gradients
from tigon.kernels.ops.fused_linear_cross_entropy import accumulate_product, choose_chunk_size, logits_into
from tigon.kernels.reference import check_target_range
from tigon.kernels.utils import (
    autocast_operands,
    check_chunk_size,
    check_float,
    check_same_device,
    check_vector,
    eager_under_compile,
    reject_dtensor,
    use_triton,
)

ChunkLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]
"""(logps, counts, ref_logps, rows) of one chunk's sequences, float64 -> that chunk's share of the loss.

For a paired loss the chunk's first half are chosen sequences and the second half their rejected
partners; `rows` are the batch rows of the chunk's sequences, in that order.
"""


@dataclass
class PassResult:
    """What a chunked pass returns besides the gradients: the loss (float64 scalar, 0 without a loss) and,
    per sequence, float64 and detached, the summed target log-probs, the reference's (or None), and the
    logits summed over the vocabulary and over the target tokens."""

    loss: torch.Tensor
    logps: torch.Tensor
    ref_logps: torch.Tensor | None
    logits_sums: torch.Tensor
    nll: torch.Tensor | None = None


@dataclass(frozen=True)
class PassSettings:
    """How the chunked pass runs: batch layout, ignored target, chunking, weight-gradient accumulation, and an
    NLL term of a paired batch's chosen sequences against targets of their own (`nll_target`, the batch's shape;
    its chosen half is read), added to the loss divided by its non-ignored chosen tokens."""

    paired: bool
    ignore_index: int = -100
    chunk_size: int | None = None
    accumulate_in_fp32: bool = False
    nll_target: torch.Tensor | None = None


def safe_average(logps: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """`logps / counts`, and 0 for a sequence with no target tokens."""
    return torch.where(counts > 0, logps / counts.clamp_min(1), 0.0)


def metric_logps(batch: Batch, result: PassResult, average_log_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's and the reference's sequence log-probs as DPO's and KTO's metrics report them: summed, or with
    `average_log_prob` averaged over each sequence's target tokens."""
    logps, ref = result.logps, result.ref_logps
    if average_log_prob:
        return safe_average(logps, batch.counts), safe_average(ref, batch.counts)
    return logps, ref


def logits_mean(logits_sums: torch.Tensor, counts: torch.Tensor, vocab: int) -> torch.Tensor:
    """Mean logit over the given sequences' target tokens and the vocabulary (TRL's logits/chosen); 0 without tokens."""
    return logits_sums.sum() / (counts.sum() * vocab).clamp_min(1)


def chosen_token_count(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Target tokens of the chosen half of a paired batch (at least 1): the NLL term's denominator, float64."""
    return (target[: target.shape[0] // 2] != ignore_index).sum().to(torch.float64).clamp_min(1)


def _chunks(n_sequences: int, paired: bool, per_chunk: int, device: torch.device) -> list[torch.Tensor]:
    """Batch rows of each chunk: `per_chunk` groups (pairs: chosen rows, then their rejected partners)."""
    groups = n_sequences // 2 if paired else n_sequences
    chunks = []
    for start in range(0, groups, per_chunk):
        rows = torch.arange(start, min(start + per_chunk, groups), device=device)
        chunks.append(torch.cat([rows, rows + groups]) if paired else rows)
    return chunks


def _logits_into(
    out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: torch.Tensor
) -> torch.Tensor:
    """Write `hidden[rows] @ weight.T + bias` into `out` ((rows * T, V)); returns the gathered hidden rows."""
    hidden_rows = hidden.index_select(0, rows).reshape(-1, hidden.shape[-1])
    logits_into(out, hidden_rows, weight.t(), bias)
    return hidden_rows


WEIGHT_FRACTION = 2  # a chunk's logits take up to the weight's bytes / 2


def groups_per_chunk(
    n_sequences: int, seq_len: int, group: int, vocab: int, hidden: int, itemsize: int, device: torch.device
) -> int:
    """Whole groups (pairs, or single sequences) a chunk holds under the chunk rule; at least one."""
    tokens = choose_chunk_size(n_sequences * seq_len, vocab, hidden, itemsize, device, weight_fraction=WEIGHT_FRACTION)
    return max(1, tokens // (group * seq_len))


def chunked_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | torch.Tensor | None,
    loss_fn: ChunkLoss | None,
    settings: PassSettings,
    want: tuple[bool, bool, bool],
) -> tuple[PassResult, tuple[torch.Tensor | None, ...]]:
    """One pass over the chunks: (result, (grad_hidden, grad_weight, grad_bias)).

    `ref` is either the reference log-probs (B,) or (ref_hidden, ref_weight, ref_bias) to compute them
    chunk by chunk, or None. `loss_fn=None` computes only the log-probs (the loss is then 0).
    """
    n_sequences, seq_len, hidden_size = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    want_hidden, want_weight, want_bias = want
    write_grad = loss_fn is not None and any(want)
    options = LossOptions(ignore_index=settings.ignore_index, reduction="sum")
    flat_target = target.reshape(-1)
    scales = loss_scales(flat_target, None, vocab, options)  # reduction "sum": unit scales, no sync
    counts = (target != settings.ignore_index).sum(1).to(torch.float64)
    group = 2 if settings.paired else 1
    per_chunk = settings.chunk_size or groups_per_chunk(
        n_sequences, seq_len, group, vocab, hidden_size, hidden.element_size(), device
    )
    chunks = _chunks(n_sequences, settings.paired, per_chunk, device)
    nll_target = settings.nll_target
    if nll_target is not None:  # d NLL / d(-logp of a chosen token under its NLL target): one factor
        nll_scale = 1.0 / chosen_token_count(nll_target, settings.ignore_index)
        nll = torch.zeros((), dtype=torch.float64, device=device)

    logps = torch.empty(n_sequences, dtype=torch.float64, device=device)
    logits_sums = torch.empty_like(logps)
    column_sum = weight.sum(0, dtype=torch.float32)  # (H,): a token's logits summed over the vocabulary, less bias
    bias_sum = bias.sum(dtype=torch.float32) if bias is not None else 0.0
    if isinstance(ref, torch.Tensor):
        ref_logps = ref.detach().to(torch.float64).clone()
    else:
        ref_logps = torch.empty_like(logps) if ref is not None else None
    loss = torch.zeros((), dtype=torch.float64, device=device)
    accumulate_dtype = torch.float32 if settings.accumulate_in_fp32 else weight.dtype
    grad_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format) if want_hidden else None
    grad_weight = torch.empty((vocab, hidden_size), dtype=accumulate_dtype, device=device) if want_weight else None
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if want_bias else None

    max_rows = chunks[0].numel() * seq_len
    buffer = torch.empty((max_rows, vocab), dtype=hidden.dtype, device=device)
    neg_logp = torch.empty(max_rows, dtype=torch.float32, device=device)
    for index, rows in enumerate(chunks):
        n = rows.numel()
        logits, token_loss = buffer[: n * seq_len], neg_logp[: n * seq_len]
        target_rows = target.index_select(0, rows).reshape(-1)
        if isinstance(ref, tuple):
            ref_hidden, ref_weight, ref_bias = ref
            _logits_into(logits, ref_hidden, ref_weight, ref_bias, rows)
            cross_entropy_rows(logits, target_rows, None, scales, options, False, token_loss)
            ref_logps[rows] = -token_loss.view(n, seq_len).sum(1, dtype=torch.float64)
        hidden_rows = _logits_into(logits, hidden, weight, bias, rows)
        token_logits_sum = torch.mv(hidden_rows.float(), column_sum) + bias_sum
        token_logits_sum = torch.where(target_rows != settings.ignore_index, token_logits_sum, 0.0)
        logits_sums[rows] = token_logits_sum.view(n, seq_len).sum(1, dtype=torch.float64)
        cross_entropy_rows(logits, target_rows, None, scales, options, False, token_loss)
        chunk_logps = -token_loss.view(n, seq_len).sum(1, dtype=torch.float64)
        logps[rows] = chunk_logps
        if loss_fn is None:
            continue
        if nll_target is not None:  # the chosen half's logits against the NLL targets, before the gradient
            chosen = n // 2 * seq_len
            nll_rows = nll_target.index_select(0, rows[: n // 2]).reshape(-1)
            nll_loss = torch.empty(chosen, dtype=torch.float32, device=device)
            cross_entropy_rows(logits[:chosen], nll_rows, None, scales, options, False, nll_loss)
            chunk_nll = nll_loss.sum(dtype=torch.float64)
            nll += chunk_nll
            loss += nll_scale * chunk_nll
        chunk_ref = ref_logps[rows] if ref_logps is not None else None
        if not write_grad:
            loss += loss_fn(chunk_logps, counts[rows], chunk_ref, rows)
            continue
        with torch.enable_grad():
            leaf = chunk_logps.requires_grad_(True)
            chunk_loss = loss_fn(leaf, counts[rows], chunk_ref, rows)
            (dloss_dlogp,) = torch.autograd.grad(chunk_loss, leaf)
        loss += chunk_loss.detach()
        # d loss / d logits = dL/dlogp[b] * (onehot - softmax) = -dL/dlogp[b] * (gradient of the token's CE)
        row_scale = (-dloss_dlogp).to(torch.float32).repeat_interleave(seq_len)
        if nll_target is None:
            cross_entropy_rows(logits, target_rows, None, scales, options, True, token_loss, row_scale=row_scale)
        else:
            _write_gradient_with_nll(logits, target_rows, nll_rows, row_scale, nll_scale, scales, options, token_loss)
        if want_hidden:
            grad_hidden.index_copy_(0, rows, torch.mm(logits, weight).view(n, seq_len, hidden_size))
        if want_weight:
            accumulate_product(grad_weight, logits.t(), hidden_rows, first=index == 0)
        if want_bias:
            grad_bias += logits.sum(0, dtype=torch.float32)
    logits = buffer = None  # free the chunk buffer before the weight gradient's cast
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    result = PassResult(loss, logps, ref_logps, logits_sums, nll if nll_target is not None else None)
    return result, (grad_hidden, grad_weight, grad_bias)


def _write_gradient_with_nll(
    logits: torch.Tensor,
    target_rows: torch.Tensor,
    nll_rows: torch.Tensor,
    row_scale: torch.Tensor,
    nll_scale: torch.Tensor,
    scales: torch.Tensor,
    options: LossOptions,
    token_loss: torch.Tensor,
) -> None:
    """Overwrite a chunk's logits with `a (softmax - onehot(t)) + c (softmax - onehot(t_nll))` on its chosen half
    (`a` the row's preference factor, `c = nll_scale`, each term only where its target is not ignored) and the
    preference term alone on its rejected half: one kernel pass with target `t` (or `t_nll` where `t` is ignored)
    and factor `a + c`, then two elements a row moved where both targets count."""
    ignore = options.ignore_index
    chosen = nll_rows.shape[0]
    main_valid = target_rows[:chosen] != ignore
    nll_valid = nll_rows != ignore
    combined = target_rows.clone()
    combined[:chosen] = torch.where(main_valid, target_rows[:chosen], nll_rows)
    scale = row_scale.clone()
    scale[:chosen] = torch.where(main_valid, row_scale[:chosen], 0.0) + torch.where(nll_valid, nll_scale, 0.0)
    cross_entropy_rows(logits, combined, None, scales, options, True, token_loss, row_scale=scale)
    shift = torch.where(main_valid & nll_valid, nll_scale, 0.0).to(logits.dtype)  # no host sync: 0 elsewhere
    row = torch.arange(chosen, device=logits.device)
    logits.index_put_((row, torch.where(main_valid, target_rows[:chosen], 0)), shift, accumulate=True)
    logits.index_put_((row, torch.where(nll_valid, nll_rows, 0)), -shift, accumulate=True)


class FusedLinearPreferenceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, ref, loss_fn, settings):
        want = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        with torch.autocast(hidden.device.type, enabled=False):
            result, grads = chunked_pass(hidden, weight, bias, target, ref, loss_fn, settings, want)
        ctx.save_for_backward(*grads)
        outputs = (result.logps, result.logits_sums, result.ref_logps, result.nll)
        ctx.mark_non_differentiable(*(t for t in outputs if t is not None))
        return (result.loss.float(), *outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, *_):
        return (*scale_saved_gradients(ctx, "fused linear preference loss", grad_loss), None, None, None, None)


def run_preference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | torch.Tensor | None,
    loss_fn: ChunkLoss,
    settings: PassSettings,
) -> PassResult:
    """The loss (float32, differentiable) and the detached per-sequence results of one chunked pass."""
    target = target.contiguous()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias)):
        loss, logps, logits_sums, ref_logps, nll = FusedLinearPreferenceFunction.apply(
            hidden, weight, bias, target, ref, loss_fn, settings
        )
        return PassResult(loss, logps, ref_logps, logits_sums, nll)
    with torch.autocast(hidden.device.type, enabled=False):
        result, _ = chunked_pass(hidden, weight, bias, target, ref, loss_fn, settings, (False, False, False))
    result.loss = result.loss.float()
    return result


def run_whole_batch(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ref: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | torch.Tensor | None,
    loss_fn: ChunkLoss,
    settings: PassSettings,
) -> PassResult:
    """A loss of the whole batch's log-probs (`PreferenceLoss.batch_loss`): a first pass computes every sequence's
    log-probs (and the reference's), autograd on the loss gives `dL/dlogp` of each, and the chunked pass then writes
    the gradients with those factors (as the loss linear in each log-prob, whose gradient is the same). One more
    forward matmul per chunk than a chunked loss; the reference head runs once."""
    if settings.nll_target is not None:
        raise ValueError("a whole-batch preference loss takes no nll_target")
    target = target.contiguous()
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        first, _ = chunked_pass(hidden, weight, bias, target, ref, None, settings, (False, False, False))
    counts = (target != settings.ignore_index).sum(1).to(torch.float64)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    with torch.enable_grad():
        leaf = first.logps.clone().requires_grad_(True)
        value = loss_fn(leaf, counts, first.ref_logps, rows)
        (factors,) = torch.autograd.grad(value, leaf)

    def linear(logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None, rows: torch.Tensor):
        return (factors[rows] * logps).sum()

    result = run_preference(hidden, weight, bias, target, first.ref_logps, linear, settings)
    result.loss = result.loss + (value.detach().float() - result.loss.detach())  # the loss's value, linear's gradient
    return result


@eager_under_compile
def sequence_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Per-sequence summed target log-probs (B,) float64 of `hidden @ weight.T + bias`, chunked, without gradient.

    hidden `(B, T, H)`, target `(B, T)` with `ignore_index` where no token is scored; `chunk_size` is
    sequences per chunk. This is what the losses take as `ref_logps` (e.g. precomputed once per dataset).
    """
    hidden, weight, bias = autocast_operands(hidden, weight, bias)
    settings = PassSettings(paired=False, ignore_index=ignore_index, chunk_size=chunk_size)
    check_preference_inputs(hidden, weight, target, bias, None, None, None, None, settings, False, True)
    if not use_triton("sequence_logps", hidden):
        with torch.no_grad():
            logps, _ = reference.sequence_logps(hidden, weight, target, bias, ignore_index=ignore_index)
        return logps.to(torch.float64)
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        result, _ = chunked_pass(hidden, weight, bias, target.contiguous(), None, None, settings, (False,) * 3)
    return result.logps


def check_head(
    hidden_name: str,
    hidden: torch.Tensor,
    weight_name: str,
    weight: torch.Tensor,
    bias_name: str,
    bias: torch.Tensor | None,
) -> None:
    """hidden (B, T, H) non-empty, weight (V, H), bias (V,), all of one float dtype; no DTensors."""
    reject_dtensor("preference loss", **{hidden_name: hidden, weight_name: weight, bias_name: bias})
    check_float(hidden_name, hidden)
    check_float(weight_name, weight)
    if hidden.dim() != 3 or 0 in hidden.shape:
        raise ValueError(
            f"{hidden_name} has shape {tuple(hidden.shape)}; it must be a non-empty 3-D (sequences, tokens, hidden) "
            "tensor, the last hidden states of the batch before the head"
        )
    if weight.dim() != 2 or weight.shape[0] == 0 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"{weight_name} has shape {tuple(weight.shape)} but {hidden_name} has shape {tuple(hidden.shape)}; the "
            f"head's weight must be (vocabulary, {hidden.shape[2]}), as nn.Linear(hidden, vocabulary).weight"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"{weight_name} has dtype {weight.dtype} but {hidden_name} has dtype {hidden.dtype}; cast one to the other "
            f"(e.g. {hidden_name}.to({weight_name}.dtype)), or run under torch.autocast, which casts both"
        )
    check_vector(bias_name, bias, weight.shape[0], f"the vocabulary size ({weight_name}.shape[0])")
    if bias is not None and bias.dtype != hidden.dtype:
        raise TypeError(f"{bias_name} has dtype {bias.dtype} but {hidden_name} has dtype {hidden.dtype}; cast it")
    check_same_device(hidden_name, hidden, **{weight_name: weight, bias_name: bias})


def check_sequence_target(name: str, target: torch.Tensor, hidden_name: str, hidden: torch.Tensor) -> None:
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(target).__name__}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} has dtype {target.dtype}; it must hold token ids as int64 or int32 ({name}.long())")
    if tuple(target.shape) != tuple(hidden.shape[:2]):
        raise ValueError(
            f"{name} has shape {tuple(target.shape)} but {hidden_name} has shape {tuple(hidden.shape)}; it must be "
            f"{tuple(hidden.shape[:2])}, one target per token (ignore_index for prompt and padding tokens)"
        )
    check_same_device(hidden_name, hidden, **{name: target})


def check_per_sequence(
    name: str, values: torch.Tensor, n_sequences: int, hidden: torch.Tensor, floating: bool = False
) -> None:
    """A per-sequence tensor (reference log-probs, KTO flags) must be 1-D with one entry per row of hidden."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(values).__name__}")
    if floating and not values.is_floating_point():
        raise TypeError(f"{name} has dtype {values.dtype}; it must hold log-probs as floats ({name}.float())")
    if values.shape != (n_sequences,):
        raise ValueError(
            f"{name} has shape {tuple(values.shape)}; it must be ({n_sequences},), one value per sequence "
            "(per row of hidden, in the same order)"
        )
    check_same_device("hidden", hidden, **{name: values})


def check_preference_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    ref_hidden: torch.Tensor | None,
    ref_weight: torch.Tensor | None,
    ref_bias: torch.Tensor | None,
    settings: PassSettings,
    needs_ref: bool,
    check_targets: bool,
) -> None:
    """Validate what every fused linear preference loss takes; raise naming the problem and the fix."""
    check_head("hidden", hidden, "weight", weight, "bias", bias)
    check_sequence_target("target", target, "hidden", hidden)
    n_sequences = hidden.shape[0]
    if settings.paired and n_sequences % 2:
        raise ValueError(
            f"hidden has {n_sequences} sequences; a paired loss takes the chosen sequences then their rejected "
            "partners (torch.cat([chosen, rejected])), so the count must be even"
        )
    if isinstance(settings.ignore_index, bool) or not isinstance(settings.ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {settings.ignore_index!r}")
    check_chunk_size("chunk_size", settings.chunk_size, "pairs, or sequences for KTO,")
    if ref_logps is not None and ref_hidden is not None:
        raise ValueError("pass either ref_logps or ref_hidden/ref_weight (to compute them), not both")
    if ref_logps is not None:
        check_per_sequence("ref_logps", ref_logps, n_sequences, hidden, floating=True)
    elif ref_hidden is not None or ref_weight is not None:
        if ref_hidden is None or ref_weight is None:
            raise ValueError("computing the reference log-probs needs both ref_hidden and ref_weight")
        check_head("ref_hidden", ref_hidden, "ref_weight", ref_weight, "ref_bias", ref_bias)
        if ref_hidden.shape[:2] != hidden.shape[:2] or ref_weight.shape[0] != weight.shape[0]:
            raise ValueError(
                f"ref_hidden {tuple(ref_hidden.shape)} / ref_weight {tuple(ref_weight.shape)} must cover the same "
                f"sequences, tokens and vocabulary as hidden {tuple(hidden.shape)} / weight {tuple(weight.shape)}"
            )
        if ref_hidden.dtype != hidden.dtype:
            raise TypeError(
                f"ref_hidden has dtype {ref_hidden.dtype} but hidden has {hidden.dtype}; both heads share one logits "
                "buffer, so cast the reference inputs to hidden's dtype"
            )
        check_same_device("hidden", hidden, ref_hidden=ref_hidden)
    elif needs_ref:
        raise ValueError(
            "this loss needs the reference model's log-probs: pass ref_logps (one summed log-prob per sequence), "
            "or ref_hidden and ref_weight (and ref_bias) to compute them in the same chunked pass"
        )
    if check_targets:
        check_target_range(target.reshape(-1), weight.shape[0], settings.ignore_index)
    if settings.nll_target is not None:
        check_sequence_target("nll_target", settings.nll_target, "hidden", hidden)
        if check_targets:
            check_target_range(settings.nll_target.reshape(-1), weight.shape[0], settings.ignore_index)


def check_unit_interval(name: str, value: float, upper: float = 1.0) -> None:
    if not 0.0 <= value <= upper:
        raise ValueError(f"{name}={value} must lie in [0, {upper}]")


def check_positive(name: str, value: float) -> None:
    if not 0.0 < value < float("inf"):
        raise ValueError(f"{name}={value} must be a finite number > 0")


def reference_source(
    ref_logps: torch.Tensor | None,
    ref_hidden: torch.Tensor | None,
    ref_weight: torch.Tensor | None,
    ref_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | torch.Tensor | None:
    """What `chunked_pass` takes as `ref`: the log-probs themselves, or the reference head to compute them."""
    if ref_logps is not None:
        return ref_logps
    if ref_hidden is not None:
        return (ref_hidden.detach(), ref_weight.detach(), ref_bias.detach() if ref_bias is not None else None)
    return None


@dataclass
class Batch:
    """One call's checked inputs as a loss's hooks read them: the policy head and targets, the reference head (or
    None), `nll_target`, the target settings, and the loss's own inputs by name (KTO's `desirable` and KL batch)."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    target: torch.Tensor
    ref_hidden: torch.Tensor | None
    ref_weight: torch.Tensor | None
    ref_bias: torch.Tensor | None
    nll_target: torch.Tensor | None
    ignore_index: int
    check_targets: bool
    inputs: dict[str, Any]

    @property
    def pairs(self) -> int:
        """Pairs of a paired batch (its first half chosen, its second half rejected)."""
        return self.hidden.shape[0] // 2

    @property
    def vocab(self) -> int:
        return self.weight.shape[0]

    @cached_property
    def counts(self) -> torch.Tensor:
        """Target tokens per sequence (int64)."""
        return (self.target != self.ignore_index).sum(1)

    @cached_property
    def chosen_tokens(self) -> torch.Tensor:
        """Target tokens of the chosen half (at least 1, float64): the NLL term's denominator."""
        return chosen_token_count(self.target, self.ignore_index)


@dataclass(frozen=True)
class PreferenceLoss(ABC):
    """One preference loss: its options (the dataclass's fields), their checks, its formula and its metrics.

    `fused_linear_preference` does the rest for every loss: autocast, the shared input checks, the fallback to
    `REFERENCE` where no kernel runs, the chunked pass and its autograd. The class says how: `NAME` is the public
    op (what the fallback logs), `PAIRED` a batch of chosen sequences then their rejected partners (else single
    sequences), `NEEDS_REF` that the reference model's log-probs are required, and `OPERANDS` the loss's own inputs
    that autocast casts with the head.
    """

    NAME: ClassVar[str]
    REFERENCE: ClassVar[Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]]
    PAIRED: ClassVar[bool] = True
    NEEDS_REF: ClassVar[bool] = False
    OPERANDS: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def check(self, batch: Batch) -> None:
        """Validate the options and the loss's own inputs; raise naming the problem and the fix."""

    def prepare(self, batch: Batch) -> None:
        """Derive, on the kernel path before the pass, inputs the formula needs from other inputs (KTO's reference
        point from its KL batch); nothing by default."""
        return None

    @abstractmethod
    def chunk_loss(self, batch: Batch) -> ChunkLoss:
        """The formula: one chunk's share of the loss from its sequences' log-probs (see `ChunkLoss`)."""

    def batch_loss(self, batch: Batch) -> ChunkLoss | None:
        """The formula over the whole batch's log-probs at once, for a loss that ranks the batch's sequences against
        each other (so no chunk's share can be computed alone); None (the default): the loss is a sum of chunks'."""
        return None

    @abstractmethod
    def metrics(self, batch: Batch, result: PassResult) -> dict[str, torch.Tensor]:
        """The metrics TRL logs, from the pass's per-sequence results: detached, float32."""

    def options(self) -> dict[str, Any]:
        """The options by name, as the op and its reference take them."""
        return {field.name: getattr(self, field.name) for field in fields(self)}


def paired_metrics(
    batch: Batch, result: PassResult, logps: torch.Tensor, rewards: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The metrics every paired loss logs: rewards and log-probs (as the loss defines them, per sequence) split
    into the chosen and the rejected halves, and each half's mean logit."""
    pairs, counts = batch.pairs, batch.counts
    return {
        "chosen_rewards": rewards[:pairs].float(),
        "rejected_rewards": rewards[pairs:].float(),
        "chosen_logps": logps[:pairs].float(),
        "rejected_logps": logps[pairs:].float(),
        "chosen_logits_mean": logits_mean(result.logits_sums[:pairs], counts[:pairs], batch.vocab).float(),
        "rejected_logits_mean": logits_mean(result.logits_sums[pairs:], counts[pairs:], batch.vocab).float(),
    }


def chosen_nll(batch: Batch, result: PassResult) -> torch.Tensor:
    """The chosen tokens' mean negative log-likelihood under `target` (float32, detached)."""
    return (-result.logps[: batch.pairs].sum() / batch.chosen_tokens).float()


def fused_linear_preference(
    loss: PreferenceLoss,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    ref_logps: torch.Tensor | None = None,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    nll_target: torch.Tensor | None = None,
    inputs: dict[str, Any] | None = None,
    ignore_index: int,
    check_targets: bool,
    accumulate_in_fp32: bool,
    chunk_size: int | None,
    use_triton: Callable[[str, torch.Tensor], bool],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`loss` of `hidden @ weight.T + bias` and its metrics: what every fused linear preference op runs.

    Casts the head's operands under autocast, checks the shared inputs and then `loss.check`s its own, returns
    `loss.REFERENCE` on the full logits where `use_triton(loss.NAME, hidden)` says no kernel runs (each op passes
    its module's dispatch rule, so that one op can be sent to the reference alone), and otherwise runs the chunked
    pass on `loss.chunk_loss` with autograd. `inputs` are the loss's own inputs by name; the reference gets them,
    with the reference-model inputs and `nll_target` where given.
    """
    inputs = dict(inputs or {})
    operands = autocast_operands(
        hidden, weight, bias, ref_hidden, ref_weight, ref_bias, *(inputs[name] for name in loss.OPERANDS)
    )
    hidden, weight, bias, ref_hidden, ref_weight, ref_bias = operands[:6]
    inputs.update(zip(loss.OPERANDS, operands[6:], strict=True))
    settings = PassSettings(
        paired=loss.PAIRED, ignore_index=ignore_index, chunk_size=chunk_size, accumulate_in_fp32=accumulate_in_fp32,
        nll_target=nll_target,
    )  # fmt: skip
    check_preference_inputs(
        hidden, weight, target, bias, ref_logps, ref_hidden, ref_weight, ref_bias, settings, loss.NEEDS_REF,
        check_targets,
    )  # fmt: skip
    batch = Batch(
        hidden, weight, bias, target, ref_hidden, ref_weight, ref_bias, nll_target, ignore_index, check_targets, inputs
    )
    loss.check(batch)
    if not use_triton(loss.NAME, hidden):
        given = {
            "ref_logps": ref_logps, "ref_hidden": ref_hidden, "ref_weight": ref_weight, "ref_bias": ref_bias,
            "nll_target": nll_target, **inputs,
        }  # fmt: skip
        given = {name: value for name, value in given.items() if value is not None}
        return loss.REFERENCE(hidden, weight, target, bias=bias, **given, **loss.options(), ignore_index=ignore_index)
    loss.prepare(batch)
    if nll_target is not None:
        settings = replace(settings, nll_target=nll_target.contiguous())
    source = reference_source(ref_logps, ref_hidden, ref_weight, ref_bias)
    whole = loss.batch_loss(batch)
    if whole is not None:
        result = run_whole_batch(hidden, weight, bias, target, source, whole, settings)
    else:
        result = run_preference(hidden, weight, bias, target, source, loss.chunk_loss(batch), settings)
    return result.loss, loss.metrics(batch, result)
