"""cuDNN's fused attention on ragged tensors against float32 attention over each document alone.

    python -m pytest -m gpu tests/runtime/test_cudnn_attention_gpu.py

Needs a Hopper or Blackwell GPU and `nvidia-cudnn-frontend`. The output and the three gradients are within bf16's
(fp16's) rounding of float32 math over each document, and as close as PyTorch's variable-length flash kernel is.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tigon.runtime import cudnn_attention

pytestmark = pytest.mark.gpu
LENGTHS = [1, 7, 130, 370, 3, 211, 64, 253, 517, 1000]  # odd lengths, one token to a thousand


@pytest.fixture(autouse=True)
def nondeterministic():
    """The kernel runs only where PyTorch's deterministic algorithms are off (the suite turns them on)."""
    torch.use_deterministic_algorithms(False)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b).norm() / b.norm())


def documents(lengths, heads, kv_heads, head_dim, dtype, seed=0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    tokens = sum(lengths)
    q, k, v = (
        torch.randn(tokens, h, head_dim, device="cuda", dtype=dtype, generator=generator).requires_grad_()
        for h in (heads, kv_heads, kv_heads)
    )
    grad = torch.randn(tokens, heads, head_dim, device="cuda", dtype=dtype, generator=generator)
    starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    return q, k, v, grad, starts


def alone(q, k, v, grad, lengths, scale=None):
    """float32 causal attention over each document by itself: the output and the gradients of q, k and v."""
    leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
    outputs, start = [], 0
    for length in lengths:
        qs, ks, vs = (x[start : start + length].transpose(0, 1)[None] for x in leaves)
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True, scale=scale)
        outputs.append(out[0].transpose(0, 1))
        start += length
    out = torch.cat(outputs)
    out.backward(grad.float())
    return [out.detach(), *(leaf.grad for leaf in leaves)]


def gradients_of(out, q, k, v, grad):
    for x in (q, k, v):
        x.grad = None
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 64), (4, 4, 128)])
def test_each_document_attends_as_if_alone(dtype, heads, kv_heads, head_dim):
    from torch.nn.attention.varlen import varlen_attn

    q, k, v, grad, starts = documents(LENGTHS, heads, kv_heads, head_dim, dtype)
    assert cudnn_attention.supports(q, k, 0.0, None)
    want = alone(q, k, v, grad, LENGTHS)
    got = gradients_of(cudnn_attention.attend(q, k, v, starts, max(LENGTHS)), q, k, v, grad)
    flash = gradients_of(
        varlen_attn(q, k, v, starts, starts, max(LENGTHS), max(LENGTHS), window_size=(-1, 0)), q, k, v, grad
    )
    for name, mine, theirs, exact in zip(("out", "dq", "dk", "dv"), got, flash, want, strict=True):
        error, flash_error = relative(mine, exact), relative(theirs, exact)
        assert error < 1e-2, (name, error)
        assert error < 1.25 * flash_error + 1e-4, (name, error, flash_error)


def test_a_scale_other_than_the_default_applies():
    q, k, v, grad, starts = documents(LENGTHS[:4], 4, 2, 64, torch.bfloat16)
    want = alone(q, k, v, grad, LENGTHS[:4], scale=0.3)
    got = gradients_of(cudnn_attention.attend(q, k, v, starts, max(LENGTHS[:4]), scale=0.3), q, k, v, grad)
    assert all(relative(mine, exact) < 1e-2 for mine, exact in zip(got, want, strict=True))


def test_batches_of_one_bucket_share_their_graphs():
    """A different document count and longest document within the same power-of-two buckets builds no graph."""
    cudnn_attention.graphs.cache_clear()
    for lengths in ([40, 900, 3], [600, 20, 300, 1, 2]):  # 3 and 5 documents (bucket 16), longest 900, 600 (1024)
        q, k, v, grad, starts = documents(lengths, 4, 2, 64, torch.bfloat16)
        got = gradients_of(cudnn_attention.attend(q, k, v, starts, max(lengths)), q, k, v, grad)
        want = alone(q, k, v, grad, lengths)
        assert all(relative(mine, exact) < 1e-2 for mine, exact in zip(got, want, strict=True))
    assert cudnn_attention.graphs.cache_info().currsize == 1


def test_deterministic_algorithms_and_head_dims_off_multiples_of_16_take_another_kernel():
    q, k, *_ = documents(LENGTHS, 6, 3, 72, torch.bfloat16)
    assert not cudnn_attention.supports(q, k, 0.0, None)
    q, k, *_ = documents(LENGTHS, 8, 2, 64, torch.bfloat16)
    assert cudnn_attention.supports(q, k, 0.0, None)
    torch.use_deterministic_algorithms(True)
    assert not cudnn_attention.supports(q, k, 0.0, None)


def test_compiles_into_one_graph():
    q, k, v, grad, starts = documents(LENGTHS, 8, 2, 64, torch.bfloat16)

    def layer(q, k, v):
        return cudnn_attention.attend(q * 1.5, k, v, starts, max(LENGTHS)) * 2

    eager = gradients_of(layer(q, k, v), q, k, v, grad)
    compiled = gradients_of(torch.compile(layer, fullgraph=True)(q, k, v), q, k, v, grad)
    assert all(relative(a, b.float()) < 1e-2 for a, b in zip(compiled, eager, strict=True))


def test_the_backward_needs_memory_for_the_tokens_not_for_every_document_at_the_longest():
    """61 documents of 32,768 tokens, the longest 2048 (graphs for 64 documents of 2048), where cuDNN's first plan
    takes 17 GB: the backward's allocations beyond its gradients stay within four float32 copies of q. A cuDNN plan
    may take two (the workspace bound); where none fits, PyTorch's flash kernel runs the documents in about 2.3."""
    from tigon.runtime import attention

    lengths = [512] * 60 + [2048]
    q, k, v, grad, starts = documents(lengths, 32, 8, 64, torch.bfloat16)
    out = attention._documents_attention(q, k, v, starts, max(lengths), None, 0.0, None)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out.backward(grad)
    gradients = sum(x.numel() * x.element_size() for x in (q, k, v))
    beyond = torch.cuda.max_memory_allocated() - before - gradients
    assert beyond <= 4 * q.numel() * 4, (beyond, q.numel() * 4)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_shape_cudnn_builds_no_graph_for_takes_the_flash_kernel(monkeypatch, compiled):
    """The op itself falls back, so a compiled layer does too: the output and the three gradients as flash's."""

    def refuse(*args, **kwargs):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(cudnn_attention, "Graphs", refuse)
    monkeypatch.setattr(cudnn_attention, "REFUSED", set())
    cudnn_attention.graphs.cache_clear()
    q, k, v, grad, starts = documents(LENGTHS, 8, 2, 64, torch.bfloat16)

    def layer(q, k, v):
        return cudnn_attention.attend(q, k, v, starts, max(LENGTHS))

    run = torch.compile(layer, fullgraph=True) if compiled else layer
    with pytest.warns(UserWarning, match="no kernel for this shape; these documents take PyTorch's varlen flash"):
        got = gradients_of(run(q, k, v), q, k, v, grad)
    want = alone(q, k, v, grad, LENGTHS)
    assert all(relative(mine, exact) < 1e-2 for mine, exact in zip(got, want, strict=True))
    cudnn_attention.graphs.cache_clear()
