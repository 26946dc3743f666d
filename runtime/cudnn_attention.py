"""Packed documents' attention through cuDNN's fused attention kernel on ragged tensors.

    if supports(q, k, dropout, window):
        out = attend(q, k, v, cu_seq_lens, max_length, scale)   # (tokens, heads, dim) each, causal per document

cuDNN's fused attention (SDPA's default kernel on Hopper) also takes documents of different lengths laid back to
back ("THD": tokens, heads, dim), each located by a ragged offset, with the causal mask inside each document. On
an H200 it runs a packed micro-batch's forward and backward 1.35x-1.5x faster than PyTorch's variable-length flash
kernel at the same error (docs/benchmarks.md). PyTorch reaches it only through nested tensors, whose path in
torch 2.11 is slow and returns wrong gradients for these shapes, so tigon builds the cuDNN graphs itself with
NVIDIA's cuDNN frontend (`nvidia-cudnn-frontend`, part of tigon's runtime extra on Linux).

A graph pair (forward, backward) is built once per shape bucket, which costs a second or two the first time: the
documents' count, the longest document and the token count each rounded up to a power of two, the extra documents
empty. The softmax statistics the backward reads stay ragged, one float per token and head, as flash's do, and the
backward's float32 accumulators are sized by the token count's bucket (left to cuDNN, they would be sized for every
document at the longest one's length). Plans that need more workspace than two float32 copies of q are not taken:
some of cuDNN's backward plans would hold every document's full score matrix (17 GB for 64 documents of 2048).
A bucket cuDNN builds no graph for runs PyTorch's varlen flash kernel inside the same op, with a warning naming it,
so eager and compiled layers fall back alike.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

HALF = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 128  # cuDNN's ragged kernels' limit
HEAD_DIM_MULTIPLE = 16  # below it cuDNN sizes the backward's accumulators for every document at the longest
ARCHITECTURES = (9, 10)  # Hopper and Blackwell data-centre GPUs: ragged softmax statistics in the backward


@functools.cache
def frontend() -> Any:
    """The cuDNN frontend module (`cudnn`), or None where it is not installed."""
    try:
        import cudnn
    except ImportError:
        return None
    return cudnn


def supports(query: torch.Tensor, key: torch.Tensor, dropout: float, window: int | None) -> bool:
    """Whether `attend` runs these (tokens, heads, dim) q and k: a CUDA Hopper or Blackwell GPU, half precision,
    no dropout or sliding window, head dim a multiple of 16 up to 128, and the cuDNN frontend installed. Not under
    PyTorch's deterministic algorithms (`training.deterministic`), which take flash's deterministic backward: cuDNN's
    needs more workspace than `attend` allows."""
    head_dim = query.shape[-1]
    return (
        query.is_cuda
        and not torch.are_deterministic_algorithms_enabled()
        and query.dtype in HALF
        and not dropout
        and window is None
        and head_dim % HEAD_DIM_MULTIPLE == 0
        and head_dim <= MAX_HEAD_DIM
        and query.shape[1] % key.shape[1] == 0
        and torch.cuda.get_device_capability(query.device)[0] in ARCHITECTURES
        and frontend() is not None
    )


def bucket(count: int, smallest: int) -> int:
    """`count` rounded up to a power of two, at least `smallest`: how many graphs a run builds stays small."""
    return max(smallest, 1 << (max(count, 1) - 1).bit_length())


def ragged_layout(cu_seq_lens: torch.Tensor, batch: int, heads: int, kv_heads: int, head_dim: int):
    """The graph's per-document inputs for `batch` documents (the real ones, then empty ones): int32 lengths
    (batch, 1, 1, 1), and int64 element offsets (batch + 1, 1, 1, 1) of q/o, k/v and the statistics."""
    starts = cu_seq_lens.to(torch.int64)
    starts = torch.cat([starts, starts[-1:].expand(batch + 1 - starts.numel())])
    lengths = (starts[1:] - starts[:-1]).to(torch.int32).view(batch, 1, 1, 1)
    starts = starts.view(batch + 1, 1, 1, 1)
    return lengths, starts * (heads * head_dim), starts * (kv_heads * head_dim), starts * heads


class Graphs:
    """The forward and backward cuDNN graphs of one shape bucket, and the workspace they need."""

    def __init__(self, dtype: torch.dtype, batch: int, heads: int, kv_heads: int, length: int, tokens: int,
                 head_dim: int, scale: float, handle) -> None:  # fmt: skip
        cudnn = frontend()
        io = cudnn.data_type.BFLOAT16 if dtype == torch.bfloat16 else cudnn.data_type.HALF
        self.handle, self.batch = handle, batch

        def graph():
            return cudnn.pygraph(
                io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT,
                compute_data_type=cudnn.data_type.FLOAT, handle=handle,
            )  # fmt: skip

        def offsets(g, name):
            return g.tensor(name=name, dim=(batch + 1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.INT64)

        def ragged(g, name, count, offset):
            """A (batch, heads, length, dim) view of (tokens, heads, dim) memory, documents at ragged offsets."""
            stride = (count * head_dim, head_dim, count * head_dim, 1)
            t = g.tensor(name=name, dim=(batch, count, length, head_dim), stride=stride, data_type=io)
            t.set_ragged_offset(offset)
            return t

        def output(t, count, offset):
            t.set_output(True).set_dim((batch, count, length, head_dim))
            t.set_stride((count * head_dim, head_dim, count * head_dim, 1))
            t.set_ragged_offset(offset)

        def statistics(t, offset):
            """(tokens, heads) float32 memory: one statistic per token and head."""
            t.set_data_type(cudnn.data_type.FLOAT).set_dim((batch, heads, length, 1)).set_stride((heads, 1, heads, 1))
            t.set_ragged_offset(offset)
            return t

        def lengths(g):
            return g.tensor(name="lengths", dim=(batch, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.INT32)

        causal = dict(
            attn_scale=scale, use_padding_mask=True, diagonal_alignment=cudnn.diagonal_alignment.TOP_LEFT,
            diagonal_band_right_bound=0,
        )  # fmt: skip

        forward = graph()
        f = {name: offsets(forward, name) for name in ("q_offsets", "kv_offsets", "stats_offsets")}
        f["lengths"] = lengths(forward)
        f["q"] = ragged(forward, "q", heads, f["q_offsets"])
        f["k"] = ragged(forward, "k", kv_heads, f["kv_offsets"])
        f["v"] = ragged(forward, "v", kv_heads, f["kv_offsets"])
        f["out"], f["stats"] = forward.sdpa(
            name="attention", q=f["q"], k=f["k"], v=f["v"], generate_stats=True, seq_len_q=f["lengths"],
            seq_len_kv=f["lengths"], **causal,
        )  # fmt: skip
        output(f["out"], heads, f["q_offsets"])
        f["stats"].set_output(True)
        statistics(f["stats"], f["stats_offsets"])

        backward = graph()
        b = {name: offsets(backward, name) for name in ("q_offsets", "kv_offsets", "stats_offsets")}
        b["lengths"] = lengths(backward)
        for name, count, offset in (("q", heads, "q_offsets"), ("k", kv_heads, "kv_offsets"),
                                    ("v", kv_heads, "kv_offsets"), ("out", heads, "q_offsets"),
                                    ("grad", heads, "q_offsets")):  # fmt: skip
            b[name] = ragged(backward, name, count, b[offset])
        b["stats"] = statistics(
            backward.tensor(name="stats", dim=(batch, heads, length, 1), stride=(heads, 1, heads, 1)),
            b["stats_offsets"],
        )
        b["dq"], b["dk"], b["dv"] = backward.sdpa_backward(
            name="attention_backward", q=b["q"], k=b["k"], v=b["v"], o=b["out"], dO=b["grad"], stats=b["stats"],
            seq_len_q=b["lengths"], seq_len_kv=b["lengths"], max_total_seq_len_q=tokens, max_total_seq_len_kv=tokens,
            **causal,
        )  # fmt: skip
        for name, count, offset in (("dq", heads, "q_offsets"), ("dk", kv_heads, "kv_offsets"),
                                    ("dv", kv_heads, "kv_offsets")):  # fmt: skip
            output(b[name], count, b[offset])

        for g in (forward, backward):
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.deselect_workspace_greater_than(2 * tokens * heads * head_dim * 4)
            g.check_support()
            g.build_plans()
        self.forward, self.backward, self.f, self.b = forward, backward, f, b
        self.workspace = max(forward.get_workspace_size(), backward.get_workspace_size())

    def run(self, graph, pack: dict, device: torch.device) -> None:
        """Execute `graph` on the current stream with `pack` ({graph tensor: torch tensor})."""
        frontend().set_stream(handle=self.handle, stream=torch.cuda.current_stream(device).cuda_stream)
        workspace = torch.empty(self.workspace, dtype=torch.uint8, device=device)
        graph.execute(pack, workspace, handle=self.handle)


@functools.cache
def _handle(device_index: int):
    with torch.cuda.device(device_index):
        return frontend().create_handle()


class Unsupported(RuntimeError):
    """cuDNN built no graph for this shape (its version or GPU lacks a kernel): the caller takes another kernel."""


REFUSED: set[tuple] = set()  # shape buckets cuDNN built no graph for, not tried again


@functools.lru_cache(maxsize=64)
def graphs(device_index: int, dtype: torch.dtype, batch: int, heads: int, kv_heads: int, length: int, tokens: int,
           head_dim: int, scale: float) -> Graphs:  # fmt: skip
    """The graphs of one shape bucket on one GPU, built on first use; `Unsupported` where cuDNN builds none."""
    key = (device_index, dtype, batch, heads, kv_heads, length, tokens, head_dim, scale)
    if key in REFUSED:
        raise Unsupported(f"cuDNN built no attention graph for {key}")
    try:
        with torch.cuda.device(device_index):
            return Graphs(dtype, batch, heads, kv_heads, length, tokens, head_dim, scale, _handle(device_index))
    except (RuntimeError, frontend().cudnnGraphNotSupportedError) as error:
        REFUSED.add(key)
        raise Unsupported(f"cuDNN built no attention graph for {key}: {error}") from error


def _prepared(q: torch.Tensor, k: torch.Tensor, cu_seq_lens: torch.Tensor, max_length: int, scale: float):
    """The graphs of these tensors' shape bucket and their ragged layout (`ragged_layout`), for either pass; None
    where cuDNN builds no graph for the bucket, said once (the warning names it)."""
    try:
        g = graphs(
            q.device.index if q.device.index is not None else torch.cuda.current_device(), q.dtype,
            bucket(cu_seq_lens.numel() - 1, 16), q.shape[1], k.shape[1], bucket(max_length, 64),
            bucket(q.shape[0], 1024), q.shape[2], scale,
        )  # fmt: skip
    except Unsupported as error:
        warnings.warn(f"{error}; these documents take PyTorch's varlen flash kernel", stacklevel=2)
        return None
    return g, *ragged_layout(cu_seq_lens, g.batch, q.shape[1], k.shape[1], q.shape[2])


@torch.library.custom_op("tigon::cudnn_varlen_attention", mutates_args=())
def attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens: torch.Tensor, max_length: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention within each document: the output and the softmax statistics (tokens, heads) in fp32.

    Where cuDNN builds no graph for the shape, PyTorch's varlen flash kernel computes the same function, its
    log-sum-exp standing for the statistics (the backward takes the same kernel), in eager and compiled code alike.
    """
    prepared = _prepared(q, k, cu_seq_lens, max_length, scale)
    if prepared is None:
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seq_lens, cu_seq_lens, max_length, max_length, 0.0, True, False, scale=scale
        )
        return out, lse.t().contiguous()  # flash's (heads, tokens)
    g, lengths, q_offsets, kv_offsets, stats_offsets = prepared
    out = torch.empty_like(q)
    stats = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    f = g.f
    g.run(g.forward, {
        f["q"]: q, f["k"]: k, f["v"]: v, f["out"]: out, f["stats"]: stats, f["lengths"]: lengths,
        f["q_offsets"]: q_offsets, f["kv_offsets"]: kv_offsets, f["stats_offsets"]: stats_offsets,
    }, q.device)  # fmt: skip
    return out, stats


@attention_op.register_fake
def _attention_fake(q, k, v, cu_seq_lens, max_length, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.custom_op("tigon::cudnn_varlen_attention_backward", mutates_args=())
def attention_backward_op(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, stats: torch.Tensor,
    cu_seq_lens: torch.Tensor, max_length: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The gradients of q, k and v."""
    prepared = _prepared(q, k, cu_seq_lens, max_length, scale)
    if prepared is None:  # the forward took the flash kernel too
        no_dropout = torch.zeros(2, dtype=torch.uint64, device=q.device), torch.empty(0, device=q.device)
        return torch.ops.aten._flash_attention_backward(
            grad, q, k, v, out, stats.t().contiguous(), cu_seq_lens, cu_seq_lens, max_length, max_length, 0.0, True,
            *no_dropout, scale=scale,
        )  # fmt: skip
    g, lengths, q_offsets, kv_offsets, stats_offsets = prepared
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    b = g.b
    g.run(g.backward, {
        b["q"]: q, b["k"]: k, b["v"]: v, b["out"]: out, b["grad"]: grad, b["stats"]: stats, b["lengths"]: lengths,
        b["q_offsets"]: q_offsets, b["kv_offsets"]: kv_offsets, b["stats_offsets"]: stats_offsets,
        b["dq"]: dq, b["dk"]: dk, b["dv"]: dv,
    }, q.device)  # fmt: skip
    return dq, dk, dv


@attention_backward_op.register_fake
def _attention_backward_fake(grad, q, k, v, out, stats, cu_seq_lens, max_length, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output) -> None:
    q, k, v, cu_seq_lens, max_length, scale = inputs
    out, stats = output
    ctx.save_for_backward(q, k, v, out, stats, cu_seq_lens)
    ctx.max_length, ctx.scale = max_length, scale


def _grad(ctx, grad_out, grad_stats):
    q, k, v, out, stats, cu_seq_lens = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(
        grad_out.contiguous(), q, k, v, out, stats, cu_seq_lens, ctx.max_length, ctx.scale
    )
    return dq, dk, dv, None, None, None


attention_op.register_autograd(_grad, setup_context=_setup)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seq_lens: torch.Tensor, max_length: int,
    scale: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention within each document of (tokens, heads, dim) q, k, v; k and v may have fewer heads.

    `cu_seq_lens` holds the documents' int32 start offsets, then the token count (`document_boundaries`);
    `max_length` is the longest document. Returns (tokens, heads, dim).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    out, _ = attention_op(q.contiguous(), k.contiguous(), v.contiguous(), cu_seq_lens, int(max_length), scale)
    return out
