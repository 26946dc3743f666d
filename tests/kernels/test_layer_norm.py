import pytest
import torch

from tests.kernels.helpers import DTYPES, as_float64, assert_close, leaf
from tigon.kernels import reference
from tigon.kernels.ops import layer_norm as layer_norm_module
from tigon.kernels.ops.layer_norm import layer_norm
from tigon.kernels.utils import persistent_grid

HIDDEN = [1, 3, 127, 128, 4097]
ROWS = 37  # not a multiple of any block size


def run_case(rows, hidden, dtype, device, with_weight=True, with_bias=True, in_place=False, offset=0.0):
    torch.manual_seed(hidden * 7 + rows)
    x = leaf(torch.randn(rows, hidden, device=device) + offset, dtype)
    weight = leaf(torch.rand(hidden, device=device) + 0.5, dtype) if with_weight else None
    bias = leaf(torch.randn(hidden, device=device), dtype) if with_bias else None
    y = layer_norm(x, weight, bias, eps=1e-5, in_place_backward=in_place)
    dy = torch.randn_like(y)
    y.backward(dy.clone())  # an in-place backward overwrites the gradient it is given

    assert y.dtype == dtype
    if hidden == 1:
        check_hidden_one(x, weight, bias, y, dy)
        return

    x64 = as_float64(x)
    w64 = as_float64(weight) if with_weight else None
    b64 = as_float64(bias) if with_bias else None
    y64 = reference.layer_norm(x64, w64, b64, eps=1e-5)
    y64.backward(dy.double())

    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    # dW and dB sum over rows: their rounding is the output's, so they get the same tolerance.
    if with_weight:
        assert_close(weight.grad, w64.grad, dtype, "dweight")
    if with_bias:
        assert_close(bias.grad, b64.grad, dtype, "dbias")


def check_hidden_one(x, weight, bias, y, dy):
    """With one feature x - mean(x) is exactly 0, so y is the bias and dx, dweight are exactly 0.

    A relative error against those zeros means nothing (F.layer_norm's own float64 backward leaves
    ~1e-13 of rounding there), so the exact values are checked instead; dbias is still sum(dy).
    """
    expected_y = bias.detach().expand_as(y) if bias is not None else torch.zeros_like(y)
    assert torch.equal(y.detach(), expected_y), "y: expected exactly the bias"
    assert torch.equal(x.grad, torch.zeros_like(x)), "dx: expected exact zeros"
    if weight is not None:
        assert torch.equal(weight.grad, torch.zeros_like(weight)), "dweight: expected exact zeros"
    if bias is not None:
        assert_close(bias.grad, dy.double().sum(0), bias.dtype, "dbias")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_weight_and_bias(hidden, dtype, device):
    run_case(ROWS, hidden, dtype, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [1, 127])
@pytest.mark.parametrize("with_weight, with_bias", [(True, False), (False, True), (False, False)])
def test_optional_weight_and_bias(with_weight, with_bias, hidden, dtype, device):
    run_case(ROWS, hidden, dtype, device, with_weight=with_weight, with_bias=with_bias)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [128, 4097])
def test_large_mean_offset(hidden, dtype, device):
    # Inputs near 100 with unit spread: a one-pass E[x^2] - E[x]^2 variance would cancel badly.
    run_case(ROWS, hidden, dtype, device, offset=100.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_backward(dtype, device):
    run_case(ROWS, 255, dtype, device, in_place=True)


def test_many_rows_use_several_programs_per_band(device):
    run_case(1031, 64, torch.float32, device)


@pytest.mark.parametrize("hidden", [64, 16385])
def test_empty_batch_gives_empty_outputs_and_zero_parameter_gradients(hidden, device):
    """No rows: the backward launches no programs (it divided by zero before) and dW, dB are exactly zero."""
    x = torch.randn(2, 0, hidden, device=device, requires_grad=True)
    weight = torch.rand(hidden, device=device, requires_grad=True)
    bias = torch.rand(hidden, device=device, requires_grad=True)
    y = layer_norm(x, weight, bias)
    y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape
    assert torch.equal(weight.grad, torch.zeros_like(weight)) and torch.equal(bias.grad, torch.zeros_like(bias))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hidden, with_weight, with_bias, in_place",
    [(8193, True, True, False), (16385, True, True, True), (8193, True, False, True), (8193, False, True, False)],
)
def test_wide_rows_take_the_column_kernels(hidden, with_weight, with_bias, in_place, dtype, device, monkeypatch):
    """Rows 16384 wide (next power of two) and wider: dW/dB by blocks of columns over several bands of rows,
    dx by chunks of each row; with an in-place backward dx overwrites dy only after dW/dB have read it. 13 rows:
    on the CPU, 2 bands of 2 row blocks each, the last block ragged (each row is a program of Triton's interpreter
    in the forward and dx kernels, so more rows add time and no case)."""
    monkeypatch.setattr(layer_norm_module, "WIDE_DWDB_PROGRAMS_PER_SM", 3)  # several bands of rows here too
    block_m, block_c = layer_norm_module.WIDE_DWDB_TILE
    bands, _ = persistent_grid(13, block_m, 3, torch.device(device), -(-hidden // block_c))
    assert bands >= 2
    run_case(13, hidden, dtype, device, with_weight, with_bias, in_place)


def test_in_place_backward_reuses_gradient_memory(device):
    x = torch.randn(5, 16, device=device, requires_grad=True)
    weight = torch.ones(16, device=device, requires_grad=True)
    bias = torch.zeros(16, device=device, requires_grad=True)
    dy = torch.randn(5, 16, device=device)
    captured = {}
    y = layer_norm(x, weight, bias, in_place_backward=True)
    y.register_hook(lambda grad: captured.update(ptr=grad.data_ptr()))
    y.backward(dy)
    assert x.grad.data_ptr() == captured["ptr"]


def test_non_contiguous_input(device):
    torch.manual_seed(0)
    base = torch.randn(12, 2 * 33, device=device)
    x = base[:, ::2].detach().requires_grad_(True)  # stride 2 in the hidden dimension
    weight = torch.rand(33, device=device, requires_grad=True)
    bias = torch.randn(33, device=device, requires_grad=True)
    y = layer_norm(x, weight, bias)
    dy = torch.randn(12, 33, device=device)
    y.backward(dy.clone())
    x64, w64, b64 = as_float64(x), as_float64(weight), as_float64(bias)
    y64 = reference.layer_norm(x64, w64, b64)
    y64.backward(dy.double())
    assert_close(y, y64, torch.float32, "y")
    assert_close(x.grad, x64.grad, torch.float32, "dx")
    assert_close(weight.grad, w64.grad, torch.float32, "dweight")
    assert_close(bias.grad, b64.grad, torch.float32, "dbias")


def test_transposed_rows_three_dims(device):
    torch.manual_seed(1)
    x = torch.randn(4, 6, 40, device=device).transpose(0, 1).detach().requires_grad_(True)
    y = layer_norm(x)
    y.sum().backward()  # an expanded (stride 0) incoming gradient
    x64 = as_float64(x)
    y64 = reference.layer_norm(x64, None, None)
    y64.sum().backward()
    assert_close(y, y64, torch.float32, "y")
    # The gradient of sum(y) is ~0 for LayerNorm without weight: compare absolutely.
    assert (x.grad - x64.grad).abs().max().item() < 1e-5


def test_bad_inputs(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="weight has shape"):
        layer_norm(x, torch.ones(7, device=device))
    with pytest.raises(ValueError, match="bias has shape"):
        layer_norm(x, torch.ones(8, device=device), torch.zeros(9, device=device))
    with pytest.raises(TypeError, match="dtype torch.int64"):
        layer_norm(torch.ones(4, 8, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="bias has dtype torch.int32"):
        layer_norm(x, None, torch.zeros(8, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="non-empty"):
        layer_norm(torch.randn(4, 0, device=device))
    with pytest.raises(ValueError, match="above the 65536"):
        layer_norm(torch.empty(1, 65537, device=device))


@pytest.mark.parametrize("name", ["weight", "bias"])
def test_parameter_on_another_device(name):
    x = torch.randn(4, 8, device="cpu")
    params = {name: torch.ones(8, device="meta")}
    with pytest.raises(ValueError, match=f"{name} is on meta"):
        layer_norm(x, **params)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16384, 4096), (4099, 8192), (333, 16384)])
def test_gpu_real_sizes(shape, dtype):
    run_case(*shape, dtype, "cuda")
    run_case(*shape, dtype, "cuda", with_weight=False, with_bias=False, offset=100.0)
