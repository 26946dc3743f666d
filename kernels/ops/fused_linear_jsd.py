"""Fused linear JSD: `jsd(student_hidden @ student_weight.T, teacher_hidden @ teacher_weight.T)` without full logits.

The tokens are processed in chunks. For each chunk the forward

1. computes the student's and the teacher's logits with one cuBLAS matmul each, into two reused
   buffers (the two heads may have different hidden sizes; they share the vocabulary),
2. runs the JSD kernel (`jsd.py`) on the logits: it takes `log_softmax(logits / temperature)` of both
   online and writes the gradient of the reduced loss over the student's logits buffer,
3. turns it into the student's gradients right away: `grad_hidden[chunk] = dlogits @ student_weight`,
   `grad_weight += dlogits.T @ student_hidden[chunk]` (float32 accumulator with `accumulate_in_fp32`).

So at most one chunk of each model's logits exists at a time, the teacher's softmax never exists
outside registers, and the backward only scales the finished gradients by the incoming gradient
(skipped when it is 1). The teacher gets no gradient. With `reduction="none"` the forward computes
only the losses and the backward repeats the chunked pass with each token's incoming gradient folded
in, as `fused_linear_cross_entropy` does.

Chunk size (`choose_chunk_size` here): a quarter of the tokens, kept between `student hidden / 16` and
`student hidden / 4` tokens (256 and 1024 at hidden 4096, bf16 heads: both heads' logits then take a 16th and a
quarter of the student weight's bytes at their itemsize); then capped by free GPU memory / 8 and split into equal
chunks. `chunk_size=` overrides it. Each chunk re-reads and re-writes the whole weight gradient, in a product
that runs at half its rate at 256 tokens (docs/benchmarks.md), so a pass takes four chunks until the upper bound
takes over; large chunks cost memory that a few tokens do not pay back. With this rule the op stays under
Liger-Kernel's memory at every benchmarked token count (docs/benchmarks.md, "Distillation losses").
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from tigon.kernels import reference
from tigon.kernels.ops.cross_entropy import scale_saved_gradients
from tigon.kernels.ops.fused_linear_cross_entropy import accumulate_product, even_chunk_size, max_chunk_tokens
from tigon.kernels.ops.jsd import JSDOptions, check_jsd_options, check_label, jsd_rows, loss_scale, reduce_rows
from tigon.kernels.utils import (
    autocast_operands,
    check_chunk_size,
    check_float,
    check_same_device,
    eager_under_compile,
    gather_dtensors,
    use_triton,
)

CHUNKS_PER_PASS = 4


def choose_chunk_size(n_tokens: int, vocab: int, hidden: int, itemsize: int, device: torch.device) -> int:
    """Tokens per chunk: `n_tokens / CHUNKS_PER_PASS` within [hidden / 16, hidden / 4] tokens of both heads'
    logits (`itemsize` is the two heads' together), under free GPU memory / 8, split evenly."""
    smallest = max_chunk_tokens(vocab, hidden, itemsize, weight_fraction=16, min_tokens=1)
    largest = max_chunk_tokens(vocab, hidden, itemsize, weight_fraction=4, min_tokens=1)
    max_rows = min(largest, max(smallest, -(-n_tokens // CHUNKS_PER_PASS)))
    return even_chunk_size(n_tokens, max_rows, vocab * itemsize, device)


def chunked_pass(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    label: torch.Tensor | None,
    scale: torch.Tensor,
    options: JSDOptions,
    chunk_size: int | None,
    accumulate_in_fp32: bool,
    want: tuple[bool, bool],
    row_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One pass over the token chunks; returns (loss_rows, grad_hidden, grad_weight) of the student.

    `want` says which of (student hidden, student weight) get a gradient; `row_scale` multiplies each
    token's logits gradient (the `reduction="none"` backward).
    """
    want_hidden, want_weight = want
    n_tokens, hidden_size = student_hidden.shape
    vocab = student_weight.shape[0]
    device = student_hidden.device
    write_grad = want_hidden or want_weight
    loss_rows = torch.empty(n_tokens, dtype=torch.float32, device=device)
    accumulate_dtype = torch.float32 if accumulate_in_fp32 else student_weight.dtype
    grad_hidden = torch.empty_like(student_hidden, memory_format=torch.contiguous_format) if want_hidden else None
    grad_weight = torch.empty((vocab, hidden_size), dtype=accumulate_dtype, device=device) if want_weight else None

    itemsize = student_hidden.element_size() + teacher_hidden.element_size()
    chunk = chunk_size or choose_chunk_size(n_tokens, vocab, hidden_size, itemsize, device)
    rows = min(chunk, n_tokens)
    student_buffer = torch.empty((rows, vocab), dtype=student_hidden.dtype, device=device)
    teacher_buffer = torch.empty((rows, vocab), dtype=teacher_hidden.dtype, device=device)
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        hidden_chunk = student_hidden[start:end]
        student_logits = student_buffer[: end - start]
        teacher_logits = teacher_buffer[: end - start]
        torch.mm(hidden_chunk, student_weight.t(), out=student_logits)
        torch.mm(teacher_hidden[start:end], teacher_weight.t(), out=teacher_logits)
        jsd_rows(
            student_logits,
            teacher_logits,
            label[start:end] if label is not None else None,
            scale,
            options,
            True,
            student_logits if write_grad else None,
            loss_rows[start:end],
            row_scale[start:end] if row_scale is not None else None,
        )
        if want_hidden:
            torch.mm(student_logits, student_weight, out=grad_hidden[start:end])
        if want_weight:
            accumulate_product(grad_weight, student_logits.t(), hidden_chunk, first=start == 0)
    student_logits = teacher_logits = student_buffer = teacher_buffer = None  # freed before the cast below
    if grad_weight is not None:
        grad_weight = grad_weight.to(student_weight.dtype)
    return loss_rows, grad_hidden, grad_weight


class FusedLinearJSDFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, student_hidden, student_weight, teacher_hidden, teacher_weight, label, options, accumulate, chunk_size
    ):
        want = (ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        scale = loss_scale(label, student_hidden.shape[0], student_weight.shape[0], options, student_hidden.device)
        ctx.options, ctx.accumulate, ctx.chunk_size, ctx.want = options, accumulate, chunk_size, want
        tensors = (student_hidden, student_weight, teacher_hidden, teacher_weight, label, scale)
        with torch.autocast(student_hidden.device.type, enabled=False):
            if options.reduction == "none":  # per-token incoming gradients: the backward repeats the pass
                loss_rows, _, _ = chunked_pass(*tensors, options, chunk_size, accumulate, (False, False))
                ctx.save_for_backward(*tensors)
            else:
                loss_rows, grad_hidden, grad_weight = chunked_pass(*tensors, options, chunk_size, accumulate, want)
                ctx.save_for_backward(grad_hidden, grad_weight)
        return reduce_rows(loss_rows, options)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        if ctx.options.reduction == "none":
            tensors = ctx.saved_tensors
            with torch.autocast(tensors[0].device.type, enabled=False):
                _, grad_hidden, grad_weight = chunked_pass(
                    *tensors, ctx.options, ctx.chunk_size, ctx.accumulate, ctx.want, row_scale=grad_loss
                )
        else:
            grad_hidden, grad_weight = scale_saved_gradients(ctx, "fused_linear_jsd", grad_loss)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _check_head(role: str, hidden: torch.Tensor, weight: torch.Tensor) -> None:
    check_float(f"{role}_hidden", hidden)
    check_float(f"{role}_weight", weight)
    if hidden.dim() != 2 or hidden.shape[0] == 0 or hidden.shape[1] == 0:
        raise ValueError(
            f"{role}_hidden has shape {tuple(hidden.shape)}; it must be a non-empty 2-D (tokens, hidden) tensor: "
            f"flatten with {role}_hidden.reshape(-1, {role}_hidden.shape[-1])"
        )
    if weight.dim() != 2 or weight.shape[0] == 0 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"{role}_weight has shape {tuple(weight.shape)} but {role}_hidden has shape {tuple(hidden.shape)}; the "
            f"head's weight must be (vocabulary, {hidden.shape[1]}), as nn.Linear(hidden, vocabulary).weight"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"{role}_weight has dtype {weight.dtype} but {role}_hidden has dtype {hidden.dtype}; cast one to the "
            f"other (e.g. {role}_hidden.to({role}_weight.dtype)), or run under torch.autocast, which casts both"
        )


def check_fused_linear_jsd_inputs(
    student_hidden: torch.Tensor,
    student_weight: torch.Tensor,
    teacher_hidden: torch.Tensor,
    teacher_weight: torch.Tensor,
    label: torch.Tensor | None,
    options: JSDOptions,
    chunk_size: int | None,
) -> None:
    """Raise a ValueError/TypeError that names the problem and the fix."""
    _check_head("student", student_hidden, student_weight)
    _check_head("teacher", teacher_hidden, teacher_weight)
    if teacher_hidden.shape[0] != student_hidden.shape[0]:
        raise ValueError(
            f"teacher_hidden has {teacher_hidden.shape[0]} tokens but student_hidden has {student_hidden.shape[0]}; "
            "pass the hidden states of both models for the same tokens"
        )
    if teacher_weight.shape[0] != student_weight.shape[0]:
        raise ValueError(
            f"teacher_weight has vocabulary {teacher_weight.shape[0]} but student_weight has "
            f"{student_weight.shape[0]}; the two heads must share the vocabulary (pad or slice the larger head)"
        )
    check_label(label, student_hidden.shape[0], "student_hidden.shape[0]")
    check_same_device(
        "student_hidden",
        student_hidden,
        student_weight=student_weight,
        teacher_hidden=teacher_hidden,
        teacher_weight=teacher_weight,
        label=label,
    )
    check_jsd_options(options)
    check_chunk_size("chunk_size", chunk_size, "tokens")
    if torch.is_grad_enabled():
        for name, tensor in (("teacher_hidden", teacher_hidden), ("teacher_weight", teacher_weight)):
            if tensor.requires_grad:
                raise ValueError(
                    f"{name} gets no gradient from tigon's fused_linear_jsd (the teacher is fixed); "
                    f"pass {name}.detach()"
                )


@eager_under_compile
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
    """Generalized JSD of `student_hidden @ student_weight.T` against `teacher_hidden @ teacher_weight.T`.

    Student hidden `(N, Hs)` and weight `(V, Hs)`, teacher hidden `(N, Ht)` and weight `(V, Ht)`; the
    two heads may differ in hidden size and dtype. The loss is `tigon.kernels.functional.jsd` on the
    logits (`from_logits=True`) with `beta`, `temperature`, `ignore_index` on the optional `label`
    `(N,)` and `reduction` ("batchmean": the mean over non-ignored tokens, "sum", "mean", "none"). The
    full `(N, V)` logits never exist (see the module docstring for the chunking; `chunk_size`
    overrides it). Gradients go to the student's hidden states and weight only, computed in the
    forward; one backward per forward. `accumulate_in_fp32` sums the weight gradient over chunks in
    float32. Under an enabled `torch.autocast` for their device, the hidden states and heads are cast to the
    autocast dtype first, as `nn.Linear`'s operands are (each gradient comes back in its input's dtype); outside
    autocast each hidden state must have its head's dtype. DTensor arguments (sharded
    heads) are gathered with `full_tensor()`, as in `fused_linear_cross_entropy`.
    """
    options = JSDOptions(beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction)
    student_hidden, student_weight, teacher_hidden, teacher_weight, label = gather_dtensors(
        student_hidden, student_weight, teacher_hidden, teacher_weight, label
    )
    student_hidden, student_weight, teacher_hidden, teacher_weight = autocast_operands(
        student_hidden, student_weight, teacher_hidden, teacher_weight
    )
    check_fused_linear_jsd_inputs(
        student_hidden, student_weight, teacher_hidden, teacher_weight, label, options, chunk_size
    )
    if not use_triton("fused_linear_jsd", student_hidden):
        return reference.fused_linear_jsd(
            student_hidden,
            student_weight,
            teacher_hidden,
            teacher_weight,
            label,
            beta=beta,
            temperature=temperature,
            ignore_index=ignore_index,
            reduction=reduction,
        )
    label = label.reshape(-1).contiguous() if label is not None else None
    if torch.is_grad_enabled() and (student_hidden.requires_grad or student_weight.requires_grad):
        return FusedLinearJSDFunction.apply(
            student_hidden,
            student_weight,
            teacher_hidden,
            teacher_weight,
            label,
            options,
            accumulate_in_fp32,
            chunk_size,
        )
    scale = loss_scale(label, student_hidden.shape[0], student_weight.shape[0], options, student_hidden.device)
    with torch.autocast(student_hidden.device.type, enabled=False):
        loss_rows, _, _ = chunked_pass(
            student_hidden,
            student_weight,
            teacher_hidden,
            teacher_weight,
            label,
            scale,
            options,
            chunk_size,
            accumulate_in_fp32,
            (False, False),
        )
    return reduce_rows(loss_rows, options)
