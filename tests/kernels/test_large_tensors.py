"""Tensors past 2^31 elements: every kernel indexes with 64-bit offsets (GPU only: 4+ GB inputs)."""

import pytest
import torch

from tests.kernels.helpers import assert_close
from tigon.kernels import functional as F
from tigon.kernels import reference

pytestmark = pytest.mark.gpu
BIG = 2**31 + 4096 * 3  # elements: just past what 32-bit offsets can address


def tail(tensor: torch.Tensor, rows: int = 3) -> torch.Tensor:
    return tensor.reshape(-1, tensor.shape[-1])[-rows:].float()


def test_rms_norm_and_layer_norm_past_2_31_elements():
    hidden = 4096
    x = torch.randn(BIG // hidden, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    y = F.rms_norm(x, w)
    assert_close(tail(y), reference.rms_norm(tail(x.detach()), w.float()), torch.bfloat16, "rms_norm tail rows")
    y.backward(torch.ones_like(y))
    x_tail = tail(x.detach()).requires_grad_(True)
    reference.rms_norm(x_tail, w.float()).sum().backward()
    assert_close(tail(x.grad), x_tail.grad, torch.bfloat16, "rms_norm dx tail rows")
    del y
    x.grad = None
    with torch.no_grad():
        y = F.layer_norm(x, w, w)
    assert_close(tail(y), reference.layer_norm(tail(x.detach()), w.float(), w.float()), torch.bfloat16, "layer_norm")


def test_swiglu_past_2_31_elements():
    gate = torch.randn(BIG // 4096, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn_like(gate, requires_grad=True)
    out = F.swiglu(gate, up)
    assert_close(tail(out), reference.swiglu(tail(gate.detach()), tail(up.detach())), torch.bfloat16, "swiglu")
    out.backward(torch.ones_like(out))
    g, u = tail(gate.detach()).requires_grad_(True), tail(up.detach()).requires_grad_(True)
    reference.swiglu(g, u).sum().backward()
    assert_close(tail(gate.grad), g.grad, torch.bfloat16, "swiglu dgate")
    assert_close(tail(up.grad), u.grad, torch.bfloat16, "swiglu dup")


def test_swiglu_packed_past_2_31_elements():
    gate_up = torch.randn(BIG // 4096, 2 * 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = F.swiglu_packed(gate_up)
    assert_close(tail(out), reference.swiglu_packed(tail(gate_up.detach())), torch.bfloat16, "swiglu_packed")
    out.backward(torch.ones_like(out))
    x = tail(gate_up.detach()).requires_grad_(True)
    reference.swiglu_packed(x).sum().backward()
    assert_close(tail(gate_up.grad), x.grad, torch.bfloat16, "swiglu_packed d(gate_up)")


def test_rope_past_2_31_elements():
    heads, dim = 32, 128
    seq = BIG // (heads * dim)
    q = torch.randn(1, seq, heads, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, seq, 8, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    angles = torch.rand(1, seq, dim // 2, device="cuda") * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q_out, k_out = F.rope(q, k, cos, sin)
    q_ref, k_ref = reference.rope(q[:, :, -3:].float(), k[:, :, -3:].float(), cos[:, -3:], sin[:, -3:])
    assert_close(q_out[:, :, -3:].float(), q_ref, torch.bfloat16, "rope q, last tokens")
    assert_close(k_out[:, :, -3:].float(), k_ref, torch.bfloat16, "rope k, last tokens")
