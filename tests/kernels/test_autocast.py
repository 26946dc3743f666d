"""The fused linear ops under torch.autocast: bf16 (or fp16) hidden states with float32 heads, as `nn.Linear`
takes them.

Each op is compared with its reference run under the same autocast (the reference's `F.linear` casts as
`nn.Linear` does), forward and backward, and each gradient must come back in its input's own dtype.
"""

import contextlib

import pytest
import torch

from tests.kernels.helpers import assert_close
from tigon.kernels import functional, reference

IGNORE = -100


def leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]


def compare(out, ref, grads, ref_grads, inputs, dtype, what):
    """Loss and every gradient within the autocast dtype's tolerance; each gradient in its input's dtype."""
    assert_close(out, ref, dtype, f"{what} loss")
    for name, grad, ref_grad, tensor in zip(("hidden", "weight", "bias"), grads, ref_grads, inputs, strict=True):
        if tensor is None:
            continue
        assert grad is not None and grad.dtype == tensor.dtype, f"{what}: d{name} {grad and grad.dtype} != input's"
        assert_close(grad, ref_grad, dtype, f"{what} d{name}")


def head(vocab, hidden, device, seed, bias=True):
    torch.manual_seed(seed)
    w = torch.randn(vocab, hidden, device=device) * 1.5 / hidden**0.5
    b = torch.randn(vocab, device=device) * 0.2 if bias else None
    return w, b


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_linear_cross_entropy(reduction, device):
    dtype = torch.bfloat16
    w, b = head(37, 24, device, 0)
    h = torch.randn(13, 24, device=device).to(dtype)
    target = torch.randint(0, 37, (13,), device=device)
    target[::4] = IGNORE
    grad = torch.randn(13, device=device) if reduction == "none" else torch.tensor(1.0, device=device)
    runs = []
    for fn in (functional.fused_linear_cross_entropy, reference.fused_linear_cross_entropy):
        hl, wl, bl = leaves(h, w, b)
        with torch.autocast(device, dtype=dtype):
            loss = fn(hl, wl, target, bl, reduction=reduction, chunk_size=5)
        loss.backward(grad)
        runs.append((loss, (hl.grad, wl.grad, bl.grad)))
    (out, grads), (ref, ref_grads) = runs
    compare(out, ref, grads, ref_grads, (h, w, b), dtype, "fused_linear_cross_entropy")


def test_fused_linear_cross_entropy_fp32_inputs_run_in_the_autocast_dtype(device):
    """Under autocast even float32 operands are cast, as nn.Linear's are: the same loss as bf16 operands give."""
    dtype = torch.bfloat16
    w, _ = head(37, 24, device, 1, bias=False)
    h = torch.randn(13, 24, device=device)
    target = torch.randint(0, 37, (13,), device=device)
    with torch.autocast(device, dtype=dtype):
        loss = functional.fused_linear_cross_entropy(h, w, target)
    expected = functional.fused_linear_cross_entropy(h.to(dtype), w.to(dtype), target)
    torch.testing.assert_close(loss, expected, rtol=0, atol=0)


def test_fused_linear_jsd(device):
    dtype = torch.bfloat16
    ws, _ = head(37, 16, device, 2, bias=False)
    wt, _ = head(37, 24, device, 3, bias=False)
    hs = torch.randn(11, 16, device=device).to(dtype)
    ht = torch.randn(11, 24, device=device)
    label = torch.randint(0, 37, (11,), device=device)
    label[::3] = IGNORE
    runs = []
    for fn in (functional.fused_linear_jsd, reference.fused_linear_jsd):
        hl, wl = leaves(hs, ws)
        with torch.autocast(device, dtype=dtype):
            loss = fn(hl, wl, ht, wt, label, beta=0.3, temperature=1.5)
        loss.backward()
        runs.append((loss, (hl.grad, wl.grad, None)))
    (out, grads), (ref, ref_grads) = runs
    compare(out, ref, grads, ref_grads, (hs, ws, None), dtype, "fused_linear_jsd")


PREFERENCE = {
    "dpo": (functional.fused_linear_dpo, reference.fused_linear_dpo, {"beta": 0.1}),
    "cpo": (functional.fused_linear_cpo, reference.fused_linear_cpo, {"beta": 0.1}),
    "simpo": (functional.fused_linear_simpo, reference.fused_linear_simpo, {"beta": 2.0, "gamma": 0.5}),
    "orpo": (functional.fused_linear_orpo, reference.fused_linear_orpo, {"beta": 0.5}),
    "kto": (functional.fused_linear_kto, reference.fused_linear_kto, {"beta": 0.1}),
}


@pytest.mark.parametrize("name", list(PREFERENCE))
def test_preference_losses(name, device):
    dtype = torch.bfloat16
    fn, ref_fn, options = PREFERENCE[name]
    w, b = head(29, 16, device, 4)
    h = torch.randn(4, 6, 16, device=device).to(dtype)
    target = torch.randint(0, 29, (4, 6), device=device)
    target[:, 0] = IGNORE
    options = dict(options)
    if name in ("dpo", "kto"):  # the reference head in float32, the hidden states in the autocast dtype
        options["ref_hidden"] = torch.randn(4, 6, 16, device=device).to(dtype)
        options["ref_weight"] = w + 0.3 * torch.randn_like(w)
        options["ref_bias"] = torch.randn_like(b) * 0.2
    if name == "kto":
        options["kl_hidden"] = torch.randn(4, 6, 16, device=device).to(dtype)
        options["kl_target"] = target.roll(1, 0)
        options["ref_kl_hidden"] = torch.randn(4, 6, 16, device=device)
        args = (torch.tensor([True, False, True, True], device=device),)
    else:
        args = ()
    runs = []
    for loss_fn in (fn, ref_fn):
        hl, wl, bl = leaves(h, w, b)
        with torch.autocast(device, dtype=dtype):
            loss, metrics = loss_fn(hl, wl, target, *args, bl, **options)
        loss.backward()
        runs.append((loss, (hl.grad, wl.grad, bl.grad), metrics))
    (out, grads, metrics), (ref, ref_grads, ref_metrics) = runs
    compare(out, ref, grads, ref_grads, (h, w, b), dtype, name)
    for key, value in ref_metrics.items():
        assert_close(metrics[key], value.float(), dtype, f"{name} {key}")


def test_sequence_logps(device):
    dtype = torch.bfloat16
    w, b = head(29, 16, device, 5)
    h = torch.randn(3, 5, 16, device=device).to(dtype)
    target = torch.randint(0, 29, (3, 5), device=device)
    with torch.autocast(device, dtype=dtype):
        out = functional.sequence_logps(h, w, target, b)
        ref, _ = reference.sequence_logps(h, w, target, b)
    assert_close(out, ref, dtype, "sequence_logps")


def test_mismatched_dtypes_outside_autocast_are_refused(device):
    w, b = head(10, 8, device, 6)
    h = torch.randn(4, 8, device=device, dtype=torch.bfloat16)
    target = torch.randint(0, 10, (4,), device=device)
    for context in (contextlib.nullcontext(), torch.autocast(device, enabled=False)):
        with context, pytest.raises(TypeError, match="cast one to the other.*torch.autocast"):
            functional.fused_linear_cross_entropy(h, w, target, b)
    with pytest.raises(TypeError, match="torch.autocast"):
        functional.fused_linear_jsd(h, w, h, w)
    with pytest.raises(TypeError, match="torch.autocast"):
        functional.fused_linear_dpo(h[None].expand(2, 4, 8), w, target[None].expand(2, 4), ref_logps=torch.zeros(2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_cuda_autocast(dtype):
    """CUDA autocast at a real-sized head: fp32 master weights, hidden states in the autocast dtype."""
    torch.manual_seed(0)
    w = torch.randn(32000, 1024, device="cuda") / 32
    h = torch.randn(2048, 1024, device="cuda").to(dtype)
    target = torch.randint(0, 32000, (2048,), device="cuda")
    runs = []
    for fn in (functional.fused_linear_cross_entropy, reference.fused_linear_cross_entropy):
        hl, wl = leaves(h, w)
        with torch.autocast("cuda", dtype=dtype):
            loss = fn(hl, wl, target)
        loss.backward()
        runs.append((loss, (hl.grad, wl.grad, None)))
    (out, grads), (ref, ref_grads) = runs
    compare(out, ref, grads, ref_grads, (h, w, None), dtype, "cuda autocast fused_linear_cross_entropy")
    hp = torch.randn(4, 256, 1024, device="cuda").to(dtype)
    tp = torch.randint(0, 32000, (4, 256), device="cuda")
    runs = []
    for fn in (functional.fused_linear_dpo, reference.fused_linear_dpo):
        hl, wl = leaves(hp, w)
        with torch.autocast("cuda", dtype=dtype):
            loss, _ = fn(hl, wl, tp, ref_logps=torch.full((4,), -2000.0, device="cuda"))
        loss.backward()
        runs.append((loss, (hl.grad, wl.grad, None)))
    (out, grads), (ref, ref_grads) = runs
    compare(out, ref, grads, ref_grads, (hp, w, None), dtype, "cuda autocast fused_linear_dpo")
