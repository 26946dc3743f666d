import pytest
import torch

from tests.kernels.helpers import DTYPES, as_float64, assert_close, leaf, peak_bytes
from tigon.kernels import reference
from tigon.kernels.modules import ReLUSquared
from tigon.kernels.ops.relu_squared import relu_squared

SHAPES = [(1,), (3,), (127,), (4097,), (37, 127), (2, 5, 4097)]


def check_against_reference(x: torch.Tensor, dtype: torch.dtype, in_place: bool = False) -> None:
    """The kernel on leaf `x`, forward and backward, against float64."""
    x64 = as_float64(x)  # copied before an in-place backward overwrites x
    y = relu_squared(x, in_place_backward=in_place)
    grad = torch.randn_like(y)
    y.backward(grad.clone())
    y64 = reference.relu_squared(x64)
    y64.backward(grad.double())
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(shape, dtype, device):
    torch.manual_seed(sum(shape))
    check_against_reference(leaf(torch.randn(shape, device=device) * 3, dtype), dtype)


def test_negative_inputs_and_zero_give_zero_and_no_gradient(device):
    x = torch.tensor([-1e4, -2.5, -1e-30, 0.0, 1e-30, 2.5, 300.0], device=device, requires_grad=True)
    y = relu_squared(x)
    y.backward(torch.ones_like(y))
    assert y.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 6.25, 90000.0]  # 1e-30 squared underflows float32
    assert x.grad.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, 2e-30, 5.0, 600.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_backward(dtype, device):
    """dx lands in x's memory (here an intermediate, as an up-projection's output in an MLP)."""
    torch.manual_seed(3)
    x_leaf = leaf(torch.randn(37, 127, device=device), dtype)
    x = x_leaf * 1
    pointer, captured = x.data_ptr(), {}
    x.register_hook(lambda g: captured.update(dx=g.data_ptr()))
    x64 = as_float64(x)
    y = relu_squared(x, in_place_backward=True)
    grad = torch.randn_like(y)
    y.backward(grad.clone())
    y64 = reference.relu_squared(x64)
    y64.backward(grad.double())
    assert captured == {"dx": pointer}
    assert_close(y, y64, dtype, "y")
    assert_close(x_leaf.grad, x64.grad, dtype, "dx")


def test_default_backward_leaves_the_input_intact(device):
    x = torch.randn(5, 16, device=device, requires_grad=True)
    before = x.detach().clone()
    relu_squared(x).sum().backward()  # sum() hands the backward a stride-0 gradient
    assert torch.equal(x.detach(), before) and x.grad.data_ptr() != x.data_ptr()
    assert torch.equal(x.grad, 2 * before.clamp(min=0))


def test_non_contiguous_and_empty_inputs(device):
    torch.manual_seed(4)
    check_against_reference(torch.randn(7, 9, 5, device=device).transpose(0, 2).requires_grad_(True), torch.float32)
    empty = torch.empty(4, 0, 8, device=device, requires_grad=True)
    y = relu_squared(empty)
    y.backward(torch.empty_like(y))
    assert y.shape == empty.shape and empty.grad.shape == empty.shape


def test_bad_inputs(device):
    with pytest.raises(TypeError, match="dtype torch.int64"):
        relu_squared(torch.ones(4, 8, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="x must be contiguous"):
        relu_squared(torch.randn(4, 8, device=device).t(), in_place_backward=True)


def test_module_is_transformers_relu2(device):
    """The module replaces transformers' `ACT2FN["relu2"]` with the same values and gradients."""
    from transformers.activations import ACT2FN

    torch.manual_seed(5)
    x = torch.randn(3, 11, 64, device=device)
    ours, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    (ReLUSquared()(ours * 1) * x).sum().backward()  # an intermediate input, as the up-projection's output
    (ACT2FN["relu2"](theirs) * x).sum().backward()
    assert torch.allclose(ours.grad, theirs.grad, rtol=1e-6, atol=1e-6)
    assert torch.allclose(ReLUSquared()(x), ACT2FN["relu2"](x), rtol=1e-6, atol=0)


def test_an_mlp_step_peaks_under_transformers_relu2():
    """Nemotron's MLP, up_proj -> relu² -> down_proj, forward and backward: transformers' relu then square keep
    relu's output and write the square's gradient through more tensors of the up-projection's size; tigon's keeps
    the input and writes its gradient over it. Measured here: 1.6 of those tensors less at the peak."""
    from transformers.activations import ACT2FN

    torch.manual_seed(7)
    up, down = torch.nn.Linear(64, 256, bias=False), torch.nn.Linear(256, 64, bias=False)
    x, grad = torch.randn(512, 64, requires_grad=True), torch.randn(512, 64)
    made_before = [x, grad, *up.parameters(), *down.parameters()]
    peaks = {}
    for name, activation in (("transformers", ACT2FN["relu2"]), ("tigon", ReLUSquared())):
        peaks[name] = peak_bytes(lambda act=activation: down(act(up(x))).backward(grad), made_before)
        for tensor in made_before:
            tensor.grad = None
    assert peaks["transformers"] - peaks["tigon"] >= 1.5 * 512 * 256 * 4, peaks


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16384, 9216), (3, 1000003)], ids=str)
def test_gpu_real_sizes(shape, dtype):
    torch.manual_seed(6)
    check_against_reference(leaf(torch.randn(shape, device="cuda") * 3, dtype), dtype)
