"""tigon's FP8 linear: its casts write torch's FP8 bytes, its products are torchao's tensorwise recipe.

The casts are compared byte for byte with torch's own conversion (`reference.fp8_cast`), over every bfloat16 value
at scales that make normal, subnormal, saturated and zero results; the layer, forward and backward, with the
reference that casts with torch and runs the same `torch._scaled_mm` products. On the GPU the same comparisons
run at a real layer's size, and against torchao's Float8Linear where torchao is installed.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from tests.kernels.helpers import relative_error
from tigon.kernels import reference
from tigon.kernels.modules import FP8Linear
from tigon.kernels.ops.fp8_linear import E4M3, E5M2, fp8_amax, fp8_cast, fp8_linear

FORMATS = [E4M3, E5M2]
# absolute maxima that put the bfloat16 values into every range of each format: most saturate at 1e-20, most
# underflow at 1e30, zero and infinity take torchao's floor and an infinite scale's zeros
AMAXES = [1.0, 3.0e-3, 7.0, 1e5, 1e30, 1e-20, 0.0, float("inf")]


def every_bfloat16(device: str) -> torch.Tensor:
    """All 65,536 bfloat16 bit patterns (NaNs and infinities included) as a 256 x 256 matrix."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32, device=device).to(torch.int16)
    return bits.view(torch.bfloat16).reshape(256, 256)


def same_bytes(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """Equal FP8 tensors, NaN for NaN: a NaN's sign is whatever the hardware's multiply gave it."""
    nan = ref.float().isnan()
    bytes_out, bytes_ref = out.view(torch.uint8), ref.view(torch.uint8)
    return torch.equal(out.float().isnan(), nan) and torch.equal(bytes_out[~nan], bytes_ref[~nan])


@pytest.mark.parametrize("dtype", FORMATS, ids=str)
@pytest.mark.parametrize("amax", AMAXES)
def test_casts_write_torchs_bytes_for_every_bfloat16(dtype, amax, device):
    x = every_bfloat16(device)
    amax = torch.tensor(amax, device=device)
    cast, cast_t, inverse_scale = fp8_cast(x, amax, dtype, True, True)
    ref, ref_inverse = reference.fp8_cast(x, amax, dtype)
    assert cast.dtype == dtype and cast_t.shape == (256, 256)
    assert same_bytes(cast, ref)
    assert same_bytes(cast_t, ref.t())
    assert torch.equal(inverse_scale, ref_inverse)


def test_a_nan_absolute_maximum_makes_every_element_nan(device):
    x = torch.randn(32, 48, device=device)
    x[5, 7] = float("nan")
    amax = fp8_amax(x)
    assert amax.isnan()
    cast, cast_t, inverse_scale = fp8_cast(x, amax, E4M3, True, True)
    assert cast.float().isnan().all() and cast_t.float().isnan().all() and inverse_scale.isnan()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1), (3, 127), (65, 1), (37, 200), (1, 4097)], ids=str)
def test_amax_and_casts_at_odd_shapes(shape, dtype, device):
    torch.manual_seed(shape[1])
    x = (torch.randn(shape, device=device) * 20).to(dtype)
    x.view(-1)[-1] = -1000.0  # the maximum in the last element, negative
    amax = fp8_amax(x)
    assert amax.dtype == torch.float32 and amax.item() == 1000.0
    for fmt in FORMATS:
        rows, transposed, inverse_scale = fp8_cast(x, amax, fmt, True, True)
        ref, ref_inverse = reference.fp8_cast(x, amax, fmt)
        assert same_bytes(rows, ref) and same_bytes(transposed, ref.t()) and torch.equal(inverse_scale, ref_inverse)
        only_t = fp8_cast(x, amax, fmt, False, True)
        assert only_t[0].numel() == 0 and same_bytes(only_t[1], ref.t())


def test_amax_of_a_row_strided_matrix(device):
    """A slice of wider rows: the cast reads the stride, the absolute maximum the elements."""
    wide = torch.randn(48, 80, device=device, dtype=torch.bfloat16)
    x = wide[:, 16:64]
    amax = fp8_amax(x)
    assert amax.item() == x.abs().max().item()
    cast, _, _ = fp8_cast(x, amax, E4M3, True, False)
    assert same_bytes(cast, reference.fp8_cast(x, amax, E4M3)[0])


def layer_inputs(tokens, k, n, x_dtype, w_dtype, device, seed):
    torch.manual_seed(seed)
    x = torch.randn(tokens, k, device=device, dtype=x_dtype).requires_grad_()
    w = (torch.randn(n, k, device=device) / k**0.5).to(w_dtype).requires_grad_()
    grad = torch.randn(tokens, n, device=device, dtype=x_dtype)
    return x, w, grad


def run(linear, x, w, grad):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = linear(x, w)
    y.backward(grad)
    return y, x.grad, w.grad


@pytest.mark.parametrize(
    ("x_dtype", "w_dtype"),
    [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)],
    ids=str,
)
@pytest.mark.parametrize(("tokens", "k", "n"), [(16, 16, 16), (48, 80, 112), (64, 32, 208)], ids=str)
def test_layer_forward_and_backward_equal_the_reference(tokens, k, n, x_dtype, w_dtype, device):
    x, w, grad = layer_inputs(tokens, k, n, x_dtype, w_dtype, device, seed=tokens + k + n)
    y, dx, dw = run(fp8_linear, x, w, grad)
    ref_y, ref_dx, ref_dw = run(reference.fp8_linear, x, w, grad)
    assert y.dtype == x_dtype and dx.dtype == x_dtype and dw.dtype == w_dtype
    assert torch.equal(y, ref_y) and torch.equal(dx, ref_dx) and torch.equal(dw, ref_dw)
    # and FP8's own accuracy against the exact product: 3 mantissa bits (e4m3), 2 for the gradient (e5m2)
    exact = x.detach().double() @ w.detach().double().t()
    assert relative_error(y, exact) < 0.06
    assert relative_error(dx, grad.double() @ w.detach().double()) < 0.12
    assert relative_error(dw, grad.double().t() @ x.detach().double()) < 0.12


@pytest.mark.parametrize("tokens", [48, 80], ids=str)
def test_keep_input_gives_the_same_gradients_and_keeps_the_input_not_a_copy(tokens, device):
    x, w, grad = layer_inputs(tokens, 64, 32, torch.bfloat16, torch.float32, device, seed=tokens)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        y = fp8_linear(x, w, keep_input=True)
    y.backward(grad)
    assert any(t.data_ptr() == x.data_ptr() and t.dtype == x.dtype for t in kept)  # x's own memory
    assert not any(t.dtype == E4M3 and t.shape == (64, tokens) for t in kept)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        fp8_linear(x.detach().requires_grad_(), w)
    assert any(t.dtype == E4M3 and t.shape == (64, tokens) for t in kept)  # without it: x's transposed cast
    ref_y, ref_dx, ref_dw = run(reference.fp8_linear, x, w, grad)
    assert torch.equal(y, ref_y) and torch.equal(x.grad, ref_dx) and torch.equal(w.grad, ref_dw)


def test_leading_dimensions_bias_and_frozen_weight(device):
    x, w, grad = layer_inputs(96, 48, 32, torch.bfloat16, torch.float32, device, seed=5)
    bias = torch.randn(32, device=device, requires_grad=True)
    x3 = x.detach().view(2, 48, 48).requires_grad_()
    y = fp8_linear(x3, w, bias)
    y.backward(grad.view(2, 48, 32))
    ref_y, ref_dx, ref_dw = run(reference.fp8_linear, x, w, grad)
    assert y.shape == (2, 48, 32)
    assert torch.equal(y.view(96, 32), ref_y + bias.to(torch.bfloat16))
    assert torch.equal(x3.grad.view(96, 48), ref_dx) and torch.equal(w.grad, ref_dw)
    assert relative_error(bias.grad, grad.double().sum(0)) < 1e-2  # summed in bf16
    frozen = w.detach()
    x.grad = None
    fp8_linear(x, frozen).backward(grad)
    assert torch.equal(x.grad, ref_dx)


def test_module_casts_its_input_to_the_autocast_dtype(device):
    linear = torch.nn.Linear(64, 32, bias=False, device=device)
    module = FP8Linear.from_linear(linear)
    assert module.weight is linear.weight
    x = torch.randn(16, 64, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        y = module(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, reference.fp8_linear(x.to(torch.bfloat16), linear.weight))


@pytest.mark.parametrize(
    ("tokens", "k", "n", "problem"),
    [
        (24, 32, 32, "the weight's gradient .* 24 here.*pad the batch to 32"),
        (16, 40, 32, "in_features is 40"),
        (16, 32, 20, "out_features is 20"),
    ],
)
def test_sizes_that_are_not_multiples_of_16_are_refused_with_the_fix(tokens, k, n, problem, device):
    x, w, _ = layer_inputs(tokens, k, n, torch.bfloat16, torch.float32, device, seed=1)
    with pytest.raises(ValueError, match=f"fp8_linear: {problem}"):
        fp8_linear(x, w)


def test_any_token_count_without_the_weights_gradient(device):
    """Generation (no gradient) and a frozen weight take any number of tokens: only the weight gradient's product
    reduces over them."""
    x, w, grad = layer_inputs(48, 32, 48, torch.bfloat16, torch.float32, device, seed=2)
    x, grad = x.detach()[:7].requires_grad_(), grad[:7]
    with torch.no_grad():
        assert torch.equal(fp8_linear(x, w), reference.fp8_linear(x, w))
    frozen = w.detach()
    fp8_linear(x, frozen).backward(grad)
    x_ref = x.detach().clone().requires_grad_()
    reference.fp8_linear(x_ref, frozen).backward(grad)
    assert torch.equal(x.grad, x_ref.grad)


def test_mismatched_weight_is_refused(device):
    x, w, _ = layer_inputs(16, 32, 32, torch.bfloat16, torch.float32, device, seed=1)
    with pytest.raises(ValueError, match=r"the weight must be \(out_features, 48\)"):
        fp8_linear(torch.randn(16, 48, device=device, dtype=torch.bfloat16), w)


def test_a_weight_or_bias_on_another_device_is_refused_with_the_fix():
    x, w, _ = layer_inputs(16, 32, 32, torch.bfloat16, torch.float32, "cpu", seed=1)
    with pytest.raises(ValueError, match=r"weight is on meta but x is on cpu; move it with weight.to\(x.device\)"):
        fp8_linear(x, w.to("meta"))
    with pytest.raises(ValueError, match=r"bias is on meta but x is on cpu"):
        fp8_linear(x, w, torch.zeros(32, device="meta"))


def test_compiled_projections_of_one_input_cast_it_once_and_cast_weights_in_the_backward(device):
    """q, k and v of one input, compiled with Inductor's partitioner: the forward graph casts the input once and
    keeps its transposed cast once; the weights' transposed casts stay inside the backward op, not kept from the
    forward. The gradients are the eager reference's."""
    graphs = []

    def capture(graph, _):
        graphs.append(graph.code)
        return graph

    backend = aot_autograd(fw_compiler=capture, bw_compiler=capture, partition_fn=min_cut_rematerialization_partition)
    torch.manual_seed(0)
    weights = [torch.randn(32, 48, device=device, requires_grad=True) for _ in range(3)]

    def projections(x, linear):
        return sum(linear(x, w).float().square().sum() for w in weights)

    x = torch.randn(64, 48, device=device, dtype=torch.bfloat16, requires_grad=True)
    torch.compile(projections, backend=backend)(x, fp8_linear).backward()
    compiled = [w.grad for w in weights] + [x.grad]
    for tensor in [*weights, x]:
        tensor.grad = None
    projections(x, reference.fp8_linear).backward()
    assert all(torch.equal(a, b) for a, b in zip(compiled, [w.grad for w in weights] + [x.grad], strict=True))
    forward, backward = graphs
    assert forward.count("tigon.fp8_cast.default(view") == 1  # the shared input, once
    assert forward.count("tigon.fp8_cast.default") == 4  # and the three weights
    assert backward.count("tigon.fp8_linear_backward.default") == 3 and "fp8_cast" not in backward


@pytest.mark.gpu
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_real_layer_equals_the_reference_and_torchao(w_dtype):
    """A Llama-3-8B MLP projection's size (4096 tokens, 4096 -> 14336 and back), on the FP8 tensor cores, with the
    input's transposed cast kept and made in the backward."""
    for tokens, k, n in [(4096, 4096, 14336), (4096, 14336, 4096), (272, 4096, 1024)]:
        x, w, grad = layer_inputs(tokens, k, n, torch.bfloat16, w_dtype, "cuda", seed=k)
        y, dx, dw = run(fp8_linear, x, w, grad)
        ref = run(reference.fp8_linear, x, w, grad)
        assert torch.equal(y, ref[0]) and torch.equal(dx, ref[1]) and torch.equal(dw, ref[2])
        kept = run(lambda x, w: fp8_linear(x, w, keep_input=True), x, w, grad)
        assert all(torch.equal(a, b) for a, b in zip(kept, ref, strict=True))
        if importlib.util.find_spec("torchao") is not None:
            from torchao.float8 import Float8LinearConfig
            from torchao.float8.float8_linear import Float8Linear

            linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=w_dtype)
            linear.weight.data.copy_(w.detach())
            torchao_linear = Float8Linear.from_float(linear, Float8LinearConfig.from_recipe_name("tensorwise"))
            torchao_x = x.detach().clone().requires_grad_()
            torchao_y = torchao_linear(torchao_x)
            torchao_y.backward(grad)
            torchao_dx, torchao_dw = torchao_x.grad, torchao_linear.weight.grad
            assert torch.equal(y, torchao_y) and torch.equal(dx, torchao_dx) and torch.equal(dw, torchao_dw)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FORMATS, ids=str)
def test_gpu_casts_of_a_large_tensor_write_torchs_bytes(dtype):
    torch.manual_seed(7)
    x = torch.randn(8192, 14336, device="cuda", dtype=torch.bfloat16) * 3
    amax = fp8_amax(x)
    assert amax.item() == x.abs().max().float().item()
    cast, cast_t, inverse_scale = fp8_cast(x, amax, dtype, True, True)
    ref, ref_inverse = reference.fp8_cast(x, amax, dtype)
    assert same_bytes(cast, ref) and same_bytes(cast_t, ref.t()) and torch.equal(inverse_scale, ref_inverse)
