"""Attention over packed documents without a dense mask: cuDNN's or PyTorch's variable-length kernel.

    name = transformers_name(config.model.attn_implementation)   # what the model is built with
    inputs = model_inputs(batch, config.model.attn_implementation)  # tigon.runtime.data: adds the boundaries

A packed row holds several documents; attention must not cross them. SDPA can only be told so by a dense
(B, 1, T, T) mask, which costs O(T^2) memory and forces its memory-efficient kernel. "varlen" instead hands
the documents' boundaries (`cu_seq_lens_q/k`, cumulative token offsets over the flattened batch, and the
longest document) to a variable-length kernel: no mask exists, and each document attends only to itself. On
Hopper and Blackwell GPUs with NVIDIA's cuDNN frontend installed that is cuDNN's fused attention on ragged
tensors (`tigon.runtime.cudnn_attention`, the faster); elsewhere, or with a sliding window,
`torch.nn.attention.varlen.varlen_attn`, PyTorch's flash-attention kernel for variable-length sequences
(torch 2.10+, CUDA, bf16/fp16). `model_inputs` derives the boundaries from position ids once per batch, on the
batch's (CPU) copy, and drops the padding: rows lose their tokens after the last labelled one and are
concatenated into one.

Where neither kernel can run (a CPU, float32 without autocast, dropout, an older torch) the same boundaries
drive exact per-document SDPA, so a "varlen" config trains anywhere. Rows that are one document each get no
boundaries and take SDPA's causal kernel (cuDNN or flash). "auto" is "varlen" where CUDA is available and
"sdpa" (the dense mask) elsewhere.

Transformers knows this attention as `VARLEN`; it builds no mask for it. A 2D padding mask is accepted
when the padding follows the tokens (causal attention never reads it); padding before tokens is refused.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from typing import Any

import torch
import torch.nn.functional as F

from tigon.runtime import cudnn_attention
from tigon.runtime.host_copies import to_device

VARLEN = "tigon_varlen"  # the name tigon's variable-length attention is registered under in transformers
HALF = cudnn_attention.HALF  # the dtypes both variable-length kernels take
IMPLEMENTATIONS = ("varlen", "sdpa", "eager", "flash_attention_2", "flex_attention")  # what "auto" leaves


def resolve(attn_implementation: str) -> str:
    """The attention a run takes: "auto" is "varlen" where CUDA is available, else "sdpa"; others as given."""
    if attn_implementation == "auto":
        return "varlen" if torch.cuda.is_available() else "sdpa"
    return attn_implementation


def transformers_name(attn_implementation: str) -> str:
    """The `attn_implementation` to build a Hugging Face model with (tigon's own is registered on first use)."""
    resolved = resolve(attn_implementation)
    if resolved != "varlen":
        return resolved
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, right_padding_mask)
    return VARLEN


def document_boundaries(
    position_ids: torch.Tensor, lengths: torch.Tensor | None = None, device: torch.device | str | None = None
) -> dict[str, Any]:
    """Keyword arguments that tell `varlen_attention` where the documents of a packed batch are.

    A document starts at every position id 0 and at the start of every row. With `lengths`, only each row's
    first `lengths[row]` tokens count (the batch the model gets holds just those, rows concatenated).
    `cu_seq_lens_q` (= `_k`) holds the int32 offsets of the starts over the flattened tokens, then their count;
    `max_length_q` (= `_k`) is the longest document. Computed where `position_ids` is (the CPU copy of a batch
    needs no GPU synchronization), the offsets are then copied to `device` without waiting for it.
    """
    if not isinstance(position_ids, torch.Tensor) or position_ids.ndim != 2 or position_ids.numel() == 0:
        got = tuple(position_ids.shape) if isinstance(position_ids, torch.Tensor) else type(position_ids).__name__
        raise ValueError(f"position_ids must be a non-empty (batch, length) tensor, got {got}")
    if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
        raise ValueError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
    starts = position_ids == 0
    starts[:, 0] = True
    if lengths is not None:
        starts = starts[torch.arange(position_ids.shape[1], device=position_ids.device) < lengths[:, None]]
    flat = starts.flatten().nonzero().flatten()
    ends = torch.cat([flat, flat.new_tensor([starts.numel()])])
    longest = int((ends[1:] - ends[:-1]).max())
    offsets = to_device(ends.to(torch.int32), device or position_ids.device)
    return {"cu_seq_lens_q": offsets, "cu_seq_lens_k": offsets, "max_length_q": longest, "max_length_k": longest}


def right_padding_mask(attention_mask: torch.Tensor | None = None, **_: Any) -> None:
    """Transformers' mask hook for `VARLEN`: no mask is built; a padding mask is checked to pad after the tokens."""
    if attention_mask is None:
        return None
    keep = attention_mask.to(torch.int8)
    if bool((keep[:, 1:] > keep[:, :-1]).any()):
        raise ValueError(
            "varlen attention takes padding only after the tokens (right padding), and this attention_mask has "
            "padding before tokens: pad on the right, or set model.attn_implementation: sdpa"
        )
    return None


@functools.cache
def _torch_varlen():
    """`torch.nn.attention.varlen.varlen_attn` and its parameter names, or None before torch 2.10."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, set(inspect.signature(varlen_attn).parameters)


def _kernel_options(
    query: torch.Tensor, key: torch.Tensor, dropout: float, window: int | None, scale: float | None = None
) -> dict | None:
    """varlen_attn's causal (and windowed, grouped-query, scaled) options, or None where its kernel cannot run."""
    found = _torch_varlen()
    head_dim = query.shape[-1]
    if found is None or not query.is_cuda or query.dtype not in HALF or dropout or head_dim % 8 or head_dim > 256:
        return None
    _, params = found
    options: dict[str, Any] = {}
    if "scale" in params:
        options["scale"] = scale
    elif scale is not None and scale != head_dim**-0.5:
        return None
    if "window_size" in params:  # torch 2.11+: (left, right); (-1, 0) is causal
        options["window_size"] = (-1 if window is None else window - 1, 0)
    elif window is None:  # torch 2.10
        options["is_causal"] = True
    else:
        return None
    if "enable_gqa" in params and key.shape[1] != query.shape[1]:
        options["enable_gqa"] = True  # earlier versions take fewer key/value heads without being told
    return options


def _per_document(q, k, v, offsets: torch.Tensor, scale, dropout: float, window: int | None) -> torch.Tensor:
    """Exact causal SDPA over each document of the flattened (tokens, heads, dim) q, k, v in turn."""
    outputs = []
    bounds = offsets.tolist()
    for start, end in itertools.pairwise(bounds):
        qs, ks, vs = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        mask = None
        if window is not None and end - start > window:
            index = torch.arange(end - start, device=q.device)
            distance = index[:, None] - index[None, :]
            mask = (distance >= 0) & (distance < window)
        out = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, is_causal=mask is None, dropout_p=dropout, scale=scale,
            enable_gqa=ks.shape[1] != qs.shape[1],
        )  # fmt: skip
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs)


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    max_length_q: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: (B, H, T, D) query, (B, H_kv, T, D) key and value -> (B, T, H, D).

    With `cu_seq_lens_q` (from `document_boundaries`) each document attends causally to itself only; without,
    the rows attend causally as wholes through transformers' SDPA function.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if softcap is not None:
        raise ValueError(
            "attention logit softcapping (e.g. Gemma 2) has no varlen kernel: set model.attn_implementation: eager"
        )
    if not getattr(module, "is_causal", True):
        raise ValueError("varlen attention is causal, this model's is not: set model.attn_implementation: sdpa")
    batch, heads, length, head_dim = query.shape
    window = sliding_window if sliding_window is not None and sliding_window < key.shape[2] else None
    if cu_seq_lens_q is None and window is not None and length == key.shape[2]:
        cu_seq_lens_q = torch.arange(0, batch * length + 1, length, dtype=torch.int32, device=query.device)
        max_length_q = length  # one document a row, whose window no mask carries
    if cu_seq_lens_q is None or (attention_mask is not None and attention_mask.ndim == 4):
        if window is not None:  # cached attention (generation): the window as a mask over the cache
            if attention_mask is not None:
                raise ValueError(
                    f"varlen attention cannot apply the sliding window ({sliding_window}) on top of a 4D "
                    "attention_mask: set model.attn_implementation: sdpa"
                )
            queries = torch.arange(key.shape[2] - length, key.shape[2], device=query.device)
            distance = queries[:, None] - torch.arange(key.shape[2], device=query.device)[None, :]
            attention_mask = ((distance >= 0) & (distance < window))[None, None]
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if torch.is_autocast_enabled(query.device.type):  # as SDPA under autocast: attend in the autocast dtype
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    q, k, v = (x.transpose(1, 2).reshape(batch * length, x.shape[1], head_dim) for x in (query, key, value))
    out = _documents_attention(q, k, v, cu_seq_lens_q, max_length_q, scaling, dropout, window)
    return out.view(batch, length, heads, head_dim), None


def _documents_attention(q, k, v, offsets, longest: int, scale, dropout: float, window: int | None) -> torch.Tensor:
    """Causal attention within each document of (tokens, heads, dim) q, k, v: cuDNN's ragged kernel, else PyTorch's
    varlen flash kernel, else per-document SDPA."""
    if cudnn_attention.supports(q, k, dropout, window):
        return cudnn_attention.attend(q, k, v, offsets, longest, scale)
    options = _kernel_options(q, k, dropout, window, scale)
    if options is None:
        return _per_document(q, k, v, offsets, scale, dropout, window)
    varlen_attn, _ = _torch_varlen()
    return varlen_attn(q, k, v, offsets, offsets, longest, longest, **options)
