import pytest
import torch

from tests.kernels.helpers import DTYPES, as_float64, assert_close, leaf
from tigon.kernels import reference
from tigon.kernels.ops.fused_add_rms_norm import fused_add_rms_norm


def run_case(rows, hidden, dtype, device, casting="llama", offset=0.0, with_weight=True, in_place=False):
    torch.manual_seed(hidden + 3 * rows)
    x = leaf(torch.randn(rows, hidden, device=device), dtype)
    residual = leaf(torch.randn(rows, hidden, device=device), dtype)
    weight = leaf(torch.rand(hidden, device=device) + 0.5, dtype) if with_weight else None
    y, new_residual = fused_add_rms_norm(x, residual, weight, 1e-6, offset, casting, in_place_backward=in_place)
    dy, dres = torch.randn_like(y), torch.randn_like(new_residual)
    torch.autograd.backward([y, new_residual], [dy.clone(), dres.clone()])

    x64, r64 = as_float64(x), as_float64(residual)
    w64 = as_float64(weight) if with_weight else None
    y64, s64 = reference.fused_add_rms_norm(x64, r64, w64, 1e-6, offset, casting)
    torch.autograd.backward([y64, s64], [dy.double(), dres.double()])

    assert_close(new_residual, s64, dtype, "new residual")
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    assert_close(residual.grad, r64.grad, dtype, "dresidual")
    if with_weight:
        assert_close(weight.grad, w64.grad, dtype, "dweight")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 3, 127, 4097])
def test_llama(hidden, dtype, device):
    run_case(37, hidden, dtype, device)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_and_no_weight(dtype, device):
    run_case(37, 129, dtype, device, casting="gemma", offset=1.0)
    run_case(37, 129, dtype, device, with_weight=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_casting(dtype, device):
    run_case(37, 129, dtype, device, casting="none")


def test_in_place_backward_and_many_rows(device):
    run_case(1031, 64, torch.float32, device, in_place=True)


def test_only_normed_output_used(device):
    """When the new residual gets no gradient, backward must not read one."""
    torch.manual_seed(0)
    x, residual = torch.randn(9, 33, device=device, requires_grad=True), torch.randn(9, 33, device=device)
    weight = torch.rand(33, device=device, requires_grad=True)
    y, _ = fused_add_rms_norm(x, residual, weight)
    y.sum().backward()
    x64, w64 = as_float64(x), as_float64(weight)
    reference.rms_norm(x64 + residual.double(), w64).sum().backward()
    assert_close(x.grad, x64.grad, torch.float32, "dx")
    assert_close(weight.grad, w64.grad, torch.float32, "dweight")


def test_bad_inputs(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="residual has shape"):
        fused_add_rms_norm(x, torch.randn(4, 9, device=device))
    with pytest.raises(TypeError, match="residual has dtype"):
        fused_add_rms_norm(x, torch.randn(4, 8, device=device, dtype=torch.float16))
    with pytest.raises(ValueError, match="hidden size"):
        fused_add_rms_norm(x, x, torch.ones(3, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16384, 4096), (4099, 8192)])
def test_gpu_real_sizes(shape, dtype):
    run_case(*shape, dtype, "cuda")


def test_only_new_residual_used_three_dims(device):
    torch.manual_seed(2)
    x = torch.randn(2, 5, 24, device=device, requires_grad=True)
    residual = torch.randn(2, 5, 24, device=device, requires_grad=True)
    _, new_residual = fused_add_rms_norm(x, residual, torch.ones(24, device=device))
    new_residual.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x)) and torch.equal(residual.grad, torch.ones_like(residual))
