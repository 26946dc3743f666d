"""Fused linear cross entropy: `cross_entropy(hidden @ weight.T + bias, target)` without the full logits.

The tokens are processed in chunks. For each chunk the forward

1. computes the chunk's logits with one cuBLAS matmul (`torch.mm` / `torch.addmm` into a reused buffer),
2. runs the cross-entropy kernel (`cross_entropy.py`), which writes the gradient of the reduced loss
   into that same buffer,
3. turns it into the input gradients right away: `grad_hidden[chunk] = dlogits @ weight`,
   `grad_weight += dlogits.T @ hidden[chunk]` (float32 accumulator with `accumulate_in_fp32`) and
   `grad_bias += dlogits.sum(0)`.

So at most one chunk of logits exists at a time, and the backward only scales the finished gradients
by the incoming gradient (skipped when it is 1). With `reduction="none"` the incoming gradient is one
factor per token, which cannot be applied to `grad_weight` afterwards; then the forward computes only
the losses and the backward repeats the chunked pass with each token's factor folded into its logits
gradient (one more matmul per chunk, still exact).

Chunk size: the largest token count whose logits (`chunk * V * itemsize` bytes) stay under
`min(MAX_CHUNK_LOGITS_BYTES = 1 GiB, free GPU memory / 8, max(the weight's bytes / 4, 1024 tokens' logits))`,
where free memory counts what the driver reports plus what PyTorch's caching allocator holds unused; then
the tokens are split into equal chunks of at most that size. The weight term makes a chunk `hidden / 4`
tokens (1,024 for a 4096-wide model), and never fewer than `MIN_CHUNK_TOKENS = 1024` while memory allows:
each chunk re-reads and re-writes `grad_weight`, so smaller chunks cost time, and larger ones cost logits
memory. Below about 1024 tokens the weight gradient's accumulating matmul falls well under its full rate, which
is why narrow models (hidden 2048 would give 512-token chunks) still take 1024. Time against memory per chunk
size is in docs/benchmarks.md ("Fused linear cross entropy: time against memory"). `chunk_size=` overrides the
rule.

Where the chunk's logits live (`borrow_weight_grad=True`, the default): the weight gradient exists before the
first chunk and fills only as chunks add to it, so its first `R` rows (the logits' bytes, rounded to 8 rows)
hold the chunk's logits instead of a buffer of their own. The chunks add to `grad_weight[R:]` only, the
cross-entropy kernel also stores each token's logsumexp, and after the last chunk `fill_borrowed_rows` writes
the first `R` rows in 16 MiB tiles (1024 columns by 8192 tokens): the tile's logits again, their gradient from
the stored logsumexp (`gradient_columns`: bit for bit what the full-row kernel writes), and their product with
the tile's hidden states. Exact, at `R / 3V` more matmul work. It applies when the chunk's logits take at most
a quarter of the weight gradient and more than the hidden gradient (`borrowed_rows`): the filling costs time
in proportion to the tokens while the memory it saves stays one chunk. It trades a little time for memory:
the step then peaks under Liger-Kernel's memory (docs/benchmarks.md has both, per GPU). The filling's tiles are
whole multiples of 8 columns, so that their rows stay 16-byte aligned: cuBLAS falls back to much slower kernels
on unaligned rows.

`accumulate_in_fp32=False` (the default) sums the weight gradient in the weight's dtype: at 8192 x 4096 x
128256 its error against an fp32 sum was 6.6e-4 (bf16 rounding itself is 3.9e-3), while the fp32
accumulator and its final cast hold 3 bytes more per weight element (3.2 GB peak there).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch.autograd.function import once_differentiable

from tigon.kernels import reference
from tigon.kernels.ops.cross_entropy import (
    CrossEntropyOutput,
    LossOptions,
    check_loss_options,
    check_target,
    cross_entropy_rows,
    gradient_columns,
    loss_output,
    loss_scales,
    reduce_rows,
    scale_saved_gradients,
)
from tigon.kernels.reference import check_target_range
from tigon.kernels.utils import (
    autocast_operands,
    check_chunk_size,
    check_float,
    check_same_device,
    check_vector,
    gather_dtensors,
    logger,
    use_triton,
)

MAX_CHUNK_LOGITS_BYTES = 1 << 30
FREE_MEMORY_FRACTION = 8  # a chunk's logits take at most 1/8 of the free GPU memory
MIN_CHUNK_TOKENS = 1024  # below this the weight gradient's per-chunk re-read and re-write shows in the time
WEIGHT_GRAD_SHARE = 4  # a chunk's logits are held in the weight gradient when they take at most 1/4 of it
STRIPE_ALIGN = 8  # borrowed rows and their stripes come in multiples of 8 columns: 16-byte aligned matmul operands
TOKEN_ALIGN = 16  # tokens a chunk and a tile are a multiple of (`aligned_tokens`)
STRIPE_TILE_BYTES = 1 << 24  # the borrowed rows' filling holds 16 MiB of logits: 8192 tokens x 1024 bf16 columns


def borrowed_rows(n_tokens: int, chunk: int, vocab: int, hidden: int, itemsize: int, grad_itemsize: int) -> int:
    """Rows of the weight gradient `(vocab, hidden)` of `grad_itemsize`-byte floats that hold a chunk's logits
    `(chunk, vocab)` of `itemsize`-byte floats, or 0 (a buffer of their own): when those logits take more than
    1 / WEIGHT_GRAD_SHARE of the weight gradient, or no more than the hidden gradient `(n_tokens, hidden)`. Filling
    the borrowed rows costs time in proportion to the tokens while the memory it saves stays one chunk, so it
    serves where that chunk would be the larger part of the op's memory beyond the weight gradient."""
    logits_bytes, row_bytes = min(chunk, n_tokens) * vocab * itemsize, hidden * grad_itemsize
    if logits_bytes * WEIGHT_GRAD_SHARE > vocab * row_bytes or logits_bytes <= n_tokens * hidden * itemsize:
        return 0
    rows = -(-logits_bytes // row_bytes)
    return min(vocab, -(-rows // STRIPE_ALIGN) * STRIPE_ALIGN)


def stripe_tile(n_tokens: int, rows: int, hidden: int, itemsize: int) -> tuple[int, int]:
    """(columns, tokens) of one tile of logits when the borrowed rows are filled: hidden / 4 columns, aligned, and
    the tokens in equal tiles of at most STRIPE_TILE_BYTES of logits (`aligned_tokens`), so that the filling's memory
    is flat in tokens."""
    columns = min(rows, max(STRIPE_ALIGN, hidden // 4 // STRIPE_ALIGN * STRIPE_ALIGN))
    tiles = -(-n_tokens * columns * itemsize // STRIPE_TILE_BYTES)
    limit = max(1, STRIPE_TILE_BYTES // (columns * itemsize))
    return columns, aligned_tokens(-(-n_tokens // tiles), n_tokens, limit)


def logits_buffer_bytes(
    n_tokens: int, chunk: int, vocab: int, hidden: int, itemsize: int, grad_itemsize: int | None
) -> int:
    """Bytes the pass allocates for logits beyond the gradients: one chunk's buffer, or, when the chunk lives in the
    weight gradient (of `grad_itemsize`-byte floats; None without one), one tile of the borrowed rows' filling."""
    rows = borrowed_rows(n_tokens, chunk, vocab, hidden, itemsize, grad_itemsize) if grad_itemsize else 0
    if rows:
        columns, tokens = stripe_tile(n_tokens, rows, hidden, itemsize)
        return columns * tokens * itemsize
    return min(chunk, n_tokens) * vocab * itemsize


def max_chunk_tokens(
    vocab: int, hidden: int, itemsize: int, weight_fraction: int = 4, min_tokens: int = MIN_CHUNK_TOKENS
) -> int:
    """The most tokens a chunk may hold, free memory aside: logits under 1 GiB and under the larger of
    weight bytes / `weight_fraction` and `min_tokens` tokens' logits (the planner counts the same)."""
    row = vocab * itemsize
    budget = min(MAX_CHUNK_LOGITS_BYTES, max(vocab * hidden * itemsize // weight_fraction, min_tokens * row))
    return max(1, budget // row)


def choose_chunk_size(
    n_tokens: int,
    vocab: int,
    hidden: int,
    itemsize: int,
    device: torch.device,
    weight_fraction: int = 4,
) -> int:
    """Tokens per chunk: `max_chunk_tokens`, and on a GPU logits under free memory / 8; split evenly."""
    max_rows = max_chunk_tokens(vocab, hidden, itemsize, weight_fraction)
    return even_chunk_size(n_tokens, max_rows, vocab * itemsize, device)


def even_chunk_size(n_tokens: int, max_rows: int, row_bytes: int, device: torch.device) -> int:
    """Tokens per chunk: at most `max_rows`, and on a GPU rows of `row_bytes` under free memory / 8; the tokens split
    into equal chunks (`aligned_tokens`), the last the rest."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        # Memory the caching allocator holds for no tensor counts as free. One nested query: memory_reserved and
        # memory_allocated each flatten every allocator statistic in Python, about 0.5 ms a call.
        stats = torch.cuda.memory_stats_as_nested_dict(device)
        free += stats["reserved_bytes"]["all"]["current"] - stats["allocated_bytes"]["all"]["current"]
        max_rows = max(1, min(max_rows, free // FREE_MEMORY_FRACTION // row_bytes))
    chunks = -(-n_tokens // max_rows)
    return aligned_tokens(-(-n_tokens // chunks), n_tokens, max_rows)


def aligned_tokens(size: int, n_tokens: int, limit: int) -> int:
    """`size` tokens a chunk or tile, rounded up to a multiple of TOKEN_ALIGN (under TOKEN_ALIGN more than `size`, a
    sliver of the memory budgets behind `limit`; as it is where `limit` is below TOKEN_ALIGN) and at most `n_tokens`:
    each slice of the pass's outputs then starts at an aligned address whatever the token count, so Triton compiles
    one kernel variant, not one per alignment as micro-batches' token counts change."""
    if limit < TOKEN_ALIGN:
        return size
    return min(n_tokens, -(-size // TOKEN_ALIGN) * TOKEN_ALIGN)


@functools.cache
def _warn_rounded_accumulation(device_type: str) -> None:
    logger.warning(
        "tigon.kernels.fused_linear_cross_entropy: this PyTorch cannot write a bf16/fp16 matmul into a float32 "
        "output on %s, so each chunk's weight gradient is rounded to the input dtype before it is added to the "
        "float32 accumulator",
        device_type,
    )


_MIXED_MATMUL = {"cuda": True}  # whether torch.mm/addmm(out_dtype=float32) works on a device type


def accumulate_product(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool) -> None:
    """`acc = a @ b` (first chunk) or `acc += a @ b`, with `acc` possibly float32 for bf16/fp16 `a`, `b`."""
    if acc.dtype == a.dtype:
        if first:
            torch.mm(a, b, out=acc)
        else:
            acc.addmm_(a, b)
        return
    device_type = acc.device.type
    if _MIXED_MATMUL.get(device_type, False):
        try:
            if first:
                torch.mm(a, b, out_dtype=acc.dtype, out=acc)
            else:
                torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
            return
        except (TypeError, RuntimeError, NotImplementedError):  # older PyTorch: no out_dtype, or not into self
            _MIXED_MATMUL[device_type] = False
    if device_type == "cuda":
        _warn_rounded_accumulation(device_type)
    product = torch.mm(a, b)
    if first:
        acc.copy_(product)
    else:
        acc.add_(product)


def logits_into(out: torch.Tensor, hidden: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> None:
    """`out = hidden @ weight_t (+ bias)` in one cuBLAS call into `out`."""
    if bias is None:
        torch.mm(hidden, weight_t, out=out)
    else:
        torch.addmm(bias, hidden, weight_t, out=out)


def chunked_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    scales: torch.Tensor,
    options: LossOptions,
    chunk_size: int | None,
    accumulate_in_fp32: bool,
    want: tuple[bool, bool, bool],
    row_scale: torch.Tensor | None = None,
    borrow_weight_grad: bool = True,
) -> tuple[torch.Tensor | None, ...]:
    """One pass over the token chunks; returns (loss_rows, z_rows, predicted, grad_hidden, grad_weight, grad_bias),
    `predicted` each token's argmax where `options` asks for it, else None.

    `want` says which of (hidden, weight, bias) get a gradient; `row_scale` multiplies each token's
    logits gradient (the `reduction="none"` backward); `borrow_weight_grad` holds the logits in the weight
    gradient's first rows where `borrowed_rows` allows (module docstring).
    """
    want_hidden, want_weight, want_bias = want
    n_tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    device = hidden.device
    write_grad = want_hidden or want_weight or want_bias
    loss_rows = torch.empty(n_tokens, dtype=torch.float32, device=device)
    z_rows = torch.empty_like(loss_rows) if options.return_z_loss else None
    predicted = torch.empty(n_tokens, dtype=torch.int64, device=device) if options.wants_predictions else None
    accumulate_dtype = torch.float32 if accumulate_in_fp32 else weight.dtype
    grad_hidden = torch.empty((n_tokens, hidden_size), dtype=hidden.dtype, device=device) if want_hidden else None
    grad_weight = torch.empty((vocab, hidden_size), dtype=accumulate_dtype, device=device) if want_weight else None
    grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if want_bias else None

    chunk = min(n_tokens, chunk_size or choose_chunk_size(n_tokens, vocab, hidden_size, hidden.element_size(), device))
    borrowed = 0
    if want_weight and borrow_weight_grad:
        itemsize = hidden.element_size()
        borrowed = borrowed_rows(n_tokens, chunk, vocab, hidden_size, itemsize, grad_weight.element_size())
    token_scales = None
    if borrowed:
        buffer = grad_weight.view(-1).view(hidden.dtype)[: chunk * vocab].view(chunk, vocab)
        lse_rows = torch.empty_like(loss_rows)
        token_scales = torch.empty_like(loss_rows) if options.token_scaling else None
    else:
        buffer = torch.empty((chunk, vocab), dtype=hidden.dtype, device=device)
        lse_rows = None
    weight_t = weight.t()
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        hidden_chunk = hidden[start:end]
        logits = buffer[: end - start]
        logits_into(logits, hidden_chunk, weight_t, bias)
        cross_entropy_rows(
            logits,
            target[start:end],
            class_weight,
            scales,
            options,
            write_grad,
            loss_rows[start:end],
            z_rows[start:end] if z_rows is not None else None,
            row_scale[start:end] if row_scale is not None else None,
            lse_rows[start:end] if lse_rows is not None else None,
            predicted[start:end] if predicted is not None else None,
            token_scales[start:end] if token_scales is not None else None,
        )
        if want_hidden:
            torch.mm(logits, weight, out=grad_hidden[start:end])
        if want_weight:
            accumulate_product(grad_weight[borrowed:], logits[:, borrowed:].t(), hidden_chunk, first=start == 0)
        if want_bias:
            grad_bias += logits.sum(0, dtype=torch.float32)
    logits = buffer = None  # free the chunk buffer before the weight gradient's cast
    if borrowed:
        if token_scales is not None:  # the filling applies each token's scale as a row factor
            row_scale = token_scales if row_scale is None else token_scales * row_scale
        fill_borrowed_rows(
            grad_weight[:borrowed], hidden, weight, target, bias, class_weight, scales, options, lse_rows, row_scale
        )
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return loss_rows, z_rows, predicted, grad_hidden, grad_weight, grad_bias


def fill_borrowed_rows(
    grad_rows: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    scales: torch.Tensor,
    options: LossOptions,
    lse_rows: torch.Tensor,
    row_scale: torch.Tensor | None,
) -> None:
    """Write the weight gradient's first rows `grad_rows` (the ones that held the chunks' logits), a tile of columns
    and tokens at a time (`stripe_tile`): the tile's logits again, their gradient from each token's logsumexp, then
    `grad_rows[columns] (+)= dlogits.T @ hidden[tokens]`."""
    n_tokens, hidden_size = hidden.shape
    rows = grad_rows.shape[0]
    columns, tokens = stripe_tile(n_tokens, rows, hidden_size, hidden.element_size())
    buffer = torch.empty(columns * tokens, dtype=hidden.dtype, device=hidden.device)
    for top in range(0, rows, columns):
        bottom = min(top + columns, rows)
        weight_t = weight[top:bottom].t()
        for start in range(0, n_tokens, tokens):
            end = min(start + tokens, n_tokens)
            hidden_tile = hidden[start:end]
            logits = buffer[: (end - start) * (bottom - top)].view(end - start, bottom - top)
            logits_into(logits, hidden_tile, weight_t, bias[top:bottom] if bias is not None else None)
            gradient_columns(
                logits, top, weight.shape[0], lse_rows[start:end], target[start:end], class_weight, scales, options,
                row_scale[start:end] if row_scale is not None else None,
            )  # fmt: skip
            accumulate_product(grad_rows[top:bottom], logits.t(), hidden_tile, first=start == 0)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, class_weight, options, accumulate_in_fp32, chunk_size, borrow):
        want = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3])
        scales = loss_scales(target, class_weight, weight.shape[0], options)
        ctx.options, ctx.accumulate_in_fp32, ctx.chunk_size, ctx.want = options, accumulate_in_fp32, chunk_size, want
        ctx.borrow = borrow
        with torch.autocast(hidden.device.type, enabled=False):
            if options.reduction == "none":
                # Per-token incoming gradients: the backward repeats the pass with them (see module docstring).
                loss_rows, z_rows, predicted, *_ = chunked_pass(
                    hidden, weight, target, bias, class_weight, scales, options, chunk_size, accumulate_in_fp32,
                    (False, False, False),
                )  # fmt: skip
                ctx.save_for_backward(hidden, weight, target, bias, class_weight, scales)
            else:
                loss_rows, z_rows, predicted, grad_hidden, grad_weight, grad_bias = chunked_pass(
                    hidden, weight, target, bias, class_weight, scales, options, chunk_size, accumulate_in_fp32, want,
                    borrow_weight_grad=borrow,
                )  # fmt: skip
                ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        loss, z_loss = reduce_rows(loss_rows, z_rows, options)
        ctx.mark_non_differentiable(*(t for t in (z_loss, predicted) if t is not None))
        return loss, z_loss, predicted

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, *_):
        if ctx.options.reduction == "none":
            hidden, weight, target, bias, class_weight, scales = ctx.saved_tensors
            options = dataclasses.replace(ctx.options, return_token_accuracy=False, return_predicted_tokens=False)
            with torch.autocast(hidden.device.type, enabled=False):
                _, _, _, grad_hidden, grad_weight, grad_bias = chunked_pass(
                    hidden, weight, target, bias, class_weight, scales, options, ctx.chunk_size,
                    ctx.accumulate_in_fp32, ctx.want, row_scale=grad_loss, borrow_weight_grad=ctx.borrow,
                )  # fmt: skip
        else:
            grad_hidden, grad_weight, grad_bias = scale_saved_gradients(ctx, "fused_linear_cross_entropy", grad_loss)
        return grad_hidden, grad_weight, None, grad_bias, None, None, None, None, None


@torch.library.custom_op("tigon::fused_linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    num_items_in_batch: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    lse_square_scale: float,
    softcap: float | None,
    return_z_loss: bool,
    token_scaling: bool,
    want_predictions: bool,
    check_targets: bool,
    accumulate_in_fp32: bool,
    chunk_size: int | None,
    borrow_weight_grad: bool,
    want: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward as an opaque op for torch.compile: (loss, z_loss, predicted, grad_hidden, grad_weight, grad_bias).

    The gradients are those of the reduced loss (empty where not wanted, and always with reduction "none",
    whose backward is `fused_linear_cross_entropy_backward_op`); `predicted` is each token's argmax with
    `want_predictions`, else empty. The target check runs inside.
    """
    options = LossOptions(
        ignore_index, label_smoothing, reduction, lse_square_scale, softcap, num_items_in_batch, return_z_loss,
        token_scaling, return_predicted_tokens=want_predictions,
    )  # fmt: skip
    if check_targets:
        check_target_range(target, weight.shape[0], ignore_index)
    target = target.contiguous()
    scales = loss_scales(target, class_weight, weight.shape[0], options)
    want = tuple(want) if reduction != "none" else (False, False, False)
    with torch.autocast(hidden.device.type, enabled=False):
        loss_rows, z_rows, *rest = chunked_pass(
            hidden, weight, target, bias, class_weight, scales, options, chunk_size, accumulate_in_fp32, want,
            borrow_weight_grad=borrow_weight_grad,
        )  # fmt: skip
    loss, z_loss = reduce_rows(loss_rows, z_rows, options)
    predicted, *grads = rest
    if predicted is None:
        predicted = target.new_empty(0, dtype=torch.int64)
    fresh = [loss, z_loss, predicted, *grads]  # outputs may not alias each other: a new empty tensor per missing one
    return tuple(t if t is not None else loss_rows.new_empty(0) for t in fresh)


@fused_linear_cross_entropy_op.register_fake
def _(hidden, weight, target, bias, class_weight, num_items_in_batch, ignore_index, label_smoothing, reduction,
      lse_square_scale, softcap, return_z_loss, token_scaling, want_predictions, check_targets, accumulate_in_fp32,
      chunk_size, borrow_weight_grad, want):  # fmt: skip
    rows = hidden.new_empty(() if reduction != "none" else hidden.shape[:1], dtype=torch.float32)
    predicted = target.new_empty(target.shape if want_predictions else 0, dtype=torch.int64)
    grads = [
        t.new_empty(t.shape) if on and reduction != "none" else rows.new_empty(0)
        for t, on in zip((hidden, weight, bias), want, strict=True)
    ]
    return rows, rows.new_empty(rows.shape if return_z_loss else 0), predicted, *grads


@torch.library.custom_op("tigon::fused_linear_cross_entropy_backward", mutates_args=())
def fused_linear_cross_entropy_backward_op(
    grad_rows: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    lse_square_scale: float,
    softcap: float | None,
    token_scaling: bool,
    accumulate_in_fp32: bool,
    chunk_size: int | None,
    borrow_weight_grad: bool,
    want: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reduction="none": the chunked pass again, each token's logits gradient scaled by its incoming gradient."""
    options = LossOptions(ignore_index, label_smoothing, "none", lse_square_scale, softcap, token_scaling=token_scaling)
    target = target.contiguous()
    scales = loss_scales(target, class_weight, weight.shape[0], options)
    with torch.autocast(hidden.device.type, enabled=False):
        _, _, _, *grads = chunked_pass(
            hidden, weight, target, bias, class_weight, scales, options, chunk_size, accumulate_in_fp32, tuple(want),
            row_scale=grad_rows.contiguous(), borrow_weight_grad=borrow_weight_grad,
        )  # fmt: skip
    return tuple(g if g is not None else hidden.new_empty(0) for g in grads)


@fused_linear_cross_entropy_backward_op.register_fake
def _(grad_rows, hidden, weight, target, bias, class_weight, ignore_index, label_smoothing, lse_square_scale, softcap,
      token_scaling, accumulate_in_fp32, chunk_size, borrow_weight_grad, want):  # fmt: skip
    return tuple(
        t.new_empty(t.shape) if on else hidden.new_empty(0) for t, on in zip((hidden, weight, bias), want, strict=True)
    )


def _flce_setup(ctx, inputs, output):
    hidden, weight, target, bias, class_weight, _, ignore_index, label_smoothing, reduction = inputs[:9]
    lse_square_scale, softcap, _, token_scaling, _, _, accumulate_in_fp32, chunk_size, borrow_weight_grad = inputs[9:18]
    ctx.want, ctx.reduction = inputs[18], reduction
    if reduction == "none":
        ctx.save_for_backward(hidden, weight, target, bias, class_weight)
        ctx.options = (
            ignore_index, label_smoothing, lse_square_scale, softcap, token_scaling, accumulate_in_fp32, chunk_size,
            borrow_weight_grad,
        )  # fmt: skip
    else:
        ctx.save_for_backward(*output[3:])


def _flce_grad(ctx, grad_loss, *_):
    if ctx.reduction == "none":
        hidden, weight, target, bias, class_weight = ctx.saved_tensors
        grads = fused_linear_cross_entropy_backward_op(
            grad_loss, hidden, weight, target, bias, class_weight, *ctx.options, ctx.want
        )
    else:
        grads = [grad * grad_loss.to(grad.dtype) for grad in ctx.saved_tensors]
    grad_hidden, grad_weight, grad_bias = (grad if on else None for grad, on in zip(grads, ctx.want, strict=True))
    return (grad_hidden, grad_weight, None, grad_bias) + (None,) * 15


fused_linear_cross_entropy_op.register_autograd(_flce_grad, setup_context=_flce_setup)


def check_fused_linear_cross_entropy_inputs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    options: LossOptions,
    chunk_size: int | None,
) -> None:
    check_float("hidden", hidden)
    check_float("weight", weight)
    if hidden.dim() != 2 or hidden.shape[0] == 0 or hidden.shape[1] == 0:
        raise ValueError(
            f"hidden has shape {tuple(hidden.shape)}; it must be a non-empty 2-D (tokens, hidden) tensor: "
            "flatten with hidden.reshape(-1, hidden.shape[-1]) and target.reshape(-1)"
        )
    if weight.dim() != 2 or weight.shape[0] == 0 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight has shape {tuple(weight.shape)} but hidden has shape {tuple(hidden.shape)}; the head's "
            f"weight must be (vocabulary, {hidden.shape[1]}), as nn.Linear(hidden, vocabulary).weight"
        )
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"weight has dtype {weight.dtype} but hidden has dtype {hidden.dtype}; cast one to the other "
            "(e.g. hidden.to(weight.dtype)), or run under torch.autocast, which casts both as it does for nn.Linear"
        )
    check_vector("bias", bias, weight.shape[0], "the vocabulary size (weight.shape[0])")
    if bias is not None and bias.dtype != hidden.dtype:
        raise TypeError(f"bias has dtype {bias.dtype} but hidden has dtype {hidden.dtype}; cast it to hidden's dtype")
    check_target(target, hidden.shape[0], "hidden.shape[0]")
    check_vector("class_weight", class_weight, weight.shape[0], "the vocabulary size (weight.shape[0])")
    check_same_device("hidden", hidden, weight=weight, target=target, bias=bias, class_weight=class_weight)
    check_loss_options(options, class_weight, "class_weight")
    check_chunk_size("chunk_size", chunk_size, "tokens")


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
    use_token_scaling: bool = False,
    return_token_accuracy: bool = False,
    return_predicted_tokens: bool = False,
    check_targets: bool = True,
    accumulate_in_fp32: bool = False,
    chunk_size: int | None = None,
    borrow_weight_grad: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | CrossEntropyOutput:
    """`cross_entropy(hidden @ weight.T + bias, target, ...)` for hidden `(N, H)`, weight `(V, H)`, target `(N,)`.

    Takes every option of `tigon.kernels.functional.cross_entropy` (`return_token_accuracy` and
    `return_predicted_tokens` included: the argmax comes from the kernel's pass over each chunk); the class weights
    are called `class_weight` here because `weight` is the head's. `use_token_scaling` multiplies each token's loss
    and gradient by its target's predicted probability, detached (Liger-Kernel's option of that name). The full
    `(N, V)` logits never exist: see the module docstring for the chunking and the chunk-size rule (`chunk_size`
    overrides it). The input
    gradients are computed during the forward (when `hidden`, `weight` or `bias` require them), so
    the backward is a scale by the incoming gradient; one backward per forward. `accumulate_in_fp32`
    sums the weight gradient over chunks in float32 (cast to the weight's dtype at the end).
    `borrow_weight_grad` holds each chunk's logits in the weight gradient's first rows where they fit in a
    quarter of it and outweigh the hidden gradient, and fills those rows at the end (the module docstring):
    no logits buffer, for a quarter of the vocabulary's logits product again; `False` gives the chunk a buffer
    of its own. A frozen head (`weight.requires_grad=False`) skips its gradient; a head tied to the embedding works as
    autograd adds both gradients. Under an enabled `torch.autocast` for their device, hidden, weight and bias are
    cast to the autocast dtype first, as `nn.Linear`'s operands are (each gradient comes back in its input's
    dtype); outside autocast they must share one dtype.
    A DTensor argument (a sharded weight) is gathered with `full_tensor()`, which is differentiable: the
    weight gradient returns to each rank's shard (this rank's gradient, not summed over ranks).
    """
    options = LossOptions(
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
        lse_square_scale=lse_square_scale,
        softcap=softcap,
        num_items_in_batch=num_items_in_batch,
        return_z_loss=return_z_loss,
        token_scaling=use_token_scaling,
        return_token_accuracy=return_token_accuracy,
        return_predicted_tokens=return_predicted_tokens,
    )
    hidden, weight, target, bias, class_weight = gather_dtensors(hidden, weight, target, bias, class_weight)
    hidden, weight, bias = autocast_operands(hidden, weight, bias)
    check_fused_linear_cross_entropy_inputs(hidden, weight, target, bias, class_weight, options, chunk_size)
    if not use_triton("fused_linear_cross_entropy", hidden):
        return reference.fused_linear_cross_entropy(
            hidden,
            weight,
            target,
            bias,
            class_weight=class_weight,
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
    tensors = (hidden, weight, bias)
    if torch.compiler.is_compiling():  # opaque ops, target check included: no graph break
        if num_items_in_batch is not None and not isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = torch.tensor(float(num_items_in_batch))
        grad = torch.is_grad_enabled()
        loss, z_loss, predicted, *_ = fused_linear_cross_entropy_op(
            hidden, weight, target, bias, class_weight, num_items_in_batch, ignore_index, label_smoothing, reduction,
            lse_square_scale, softcap, return_z_loss, use_token_scaling, options.wants_predictions, check_targets,
            accumulate_in_fp32, chunk_size, borrow_weight_grad,
            [grad and t is not None and t.requires_grad for t in tensors],
        )  # fmt: skip
        return loss_output(loss, z_loss if return_z_loss else None, predicted, target, options)
    if check_targets:
        check_target_range(target, weight.shape[0], ignore_index)
    target = target.contiguous()
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        loss, z_loss, predicted = FusedLinearCrossEntropyFunction.apply(
            hidden, weight, target, bias, class_weight, options, accumulate_in_fp32, chunk_size, borrow_weight_grad
        )
        return loss_output(loss, z_loss, predicted, target, options)
    scales = loss_scales(target, class_weight, weight.shape[0], options)
    with torch.autocast(hidden.device.type, enabled=False):
        loss_rows, z_rows, predicted, *_ = chunked_pass(
            hidden, weight, target, bias, class_weight, scales, options, chunk_size, accumulate_in_fp32,
            (False, False, False),
        )  # fmt: skip
    loss, z_loss = reduce_rows(loss_rows, z_rows, options)
    return loss_output(loss, z_loss, predicted, target, options)
