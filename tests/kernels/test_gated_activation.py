import pytest
import torch

from tests.kernels.helpers import DTYPES, as_float64, assert_close, leaf
from tigon.kernels import reference
from tigon.kernels.ops import gated_activation
from tigon.kernels.ops.gated_activation import geglu, geglu_packed, swiglu, swiglu_packed

# activation -> (kernel op, reference op)
ACTIVATIONS = {
    "silu": (swiglu, reference.swiglu),
    "gelu_tanh": (lambda g, u, **kw: geglu(g, u, approximate="tanh", **kw), reference.geglu),
    "gelu_erf": (
        lambda g, u, **kw: geglu(g, u, approximate="none", **kw),
        lambda g, u: reference.geglu(g, u, approximate="none"),
    ),
}
SHAPES = [(1,), (3,), (127,), (4097,), (37, 127), (2, 5, 4097)]


def check_against_reference(gate, up, activation, dtype, in_place=False, scale=1.0):
    """Run the kernel on (gate, up) leaves, forward and backward, and compare with float64."""
    op, ref_op = ACTIVATIONS[activation]
    y = op(gate, up, in_place_backward=in_place)
    grad = torch.randn_like(y)
    y.backward(grad.clone())

    gate64, up64 = as_float64(gate), as_float64(up)
    y64 = ref_op(gate64, up64)
    y64.backward(grad.double())

    assert y.dtype == dtype and y.shape == gate.shape
    assert_close(y, y64, dtype, f"{activation} y", scale)
    assert_close(gate.grad, gate64.grad, dtype, f"{activation} dgate", scale)
    assert_close(up.grad, up64.grad, dtype, f"{activation} dup", scale)


def run_case(shape, dtype, device, activation, gate_scale=1.0):
    torch.manual_seed(sum(shape) * 11 + len(activation))
    gate = leaf(torch.randn(shape, device=device) * gate_scale, dtype)
    up = leaf(torch.randn(shape, device=device), dtype)
    check_against_reference(gate, up, activation, dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(shape, dtype, activation, device):
    run_case(shape, dtype, device, activation)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # interpreter: exp(+large) = inf
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_magnitude_gate(dtype, activation, device):
    """Gate values around +-10 reach the saturating tails of sigmoid, tanh and erf."""
    run_case((4097,), dtype, device, activation, gate_scale=10.0)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # interpreter: exp(+large) = inf
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_saturated_tails_are_finite(activation, device):
    gate = torch.tensor([-1e4, -100.0, -30.0, -10.0, 10.0, 30.0, 100.0, 1e4], device=device).requires_grad_(True)
    up = torch.ones_like(gate).requires_grad_(True)
    check_against_reference(gate, up, activation, torch.float32)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_backward(dtype, activation, device):
    """dgate and dup land in the memory of gate and up (here intermediates, as in an MLP)."""
    torch.manual_seed(3)
    gate_leaf = leaf(torch.randn(37, 127, device=device), dtype)
    up_leaf = leaf(torch.randn(37, 127, device=device), dtype)
    gate, up = gate_leaf * 1, up_leaf * 1
    gate_ptr, up_ptr = gate.data_ptr(), up.data_ptr()
    captured = {}
    gate.register_hook(lambda g: captured.update(dgate=g.data_ptr()))
    up.register_hook(lambda g: captured.update(dup=g.data_ptr()))

    op, ref_op = ACTIVATIONS[activation]
    gate64, up64 = as_float64(gate), as_float64(up)  # copied before the backward overwrites gate and up
    y = op(gate, up, in_place_backward=True)
    grad = torch.randn_like(y)
    y.backward(grad.clone())
    y64 = ref_op(gate64, up64)
    y64.backward(grad.double())

    assert captured == {"dgate": gate_ptr, "dup": up_ptr}
    assert_close(y, y64, dtype, "y")
    assert_close(gate_leaf.grad, gate64.grad, dtype, "dgate")
    assert_close(up_leaf.grad, up64.grad, dtype, "dup")


def test_default_backward_leaves_inputs_intact(device):
    gate = torch.randn(5, 16, device=device, requires_grad=True)
    up = torch.randn(5, 16, device=device, requires_grad=True)
    before = gate.detach().clone(), up.detach().clone()
    swiglu(gate, up).sum().backward()  # sum() hands the backward a stride-0 gradient
    assert torch.equal(gate.detach(), before[0]) and torch.equal(up.detach(), before[1])
    assert gate.grad.data_ptr() != gate.data_ptr()


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_non_contiguous_inputs(activation, device):
    torch.manual_seed(4)
    gate_up = torch.randn(12, 2 * 33, device=device)
    gate = gate_up[:, :33].detach().requires_grad_(True)  # halves of a fused projection
    up = gate_up[:, 33:].detach().requires_grad_(True)
    check_against_reference(gate, up, activation, torch.float32)
    transposed = torch.randn(7, 9, 5, device=device).transpose(0, 2).detach().requires_grad_(True)
    check_against_reference(
        transposed, torch.randn(5, 9, 7, device=device).requires_grad_(True), activation, torch.float32
    )


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", [(0,), (4, 0, 8)], ids=str)
def test_empty(shape, activation, device):
    op = ACTIVATIONS[activation][0]
    gate = torch.empty(shape, device=device, requires_grad=True)
    up = torch.empty(shape, device=device, requires_grad=True)
    y = op(gate, up)
    y.backward(torch.empty_like(y))
    assert y.shape == shape and gate.grad.shape == shape and up.grad.shape == shape


def test_scalar(device):
    gate = torch.tensor(1.5, device=device, requires_grad=True)
    up = torch.tensor(-2.0, device=device, requires_grad=True)
    check_against_reference(gate, up, "silu", torch.float32)


MULTIPLIED = {
    "silu": (swiglu, reference.swiglu, {}),
    "gelu_tanh": (geglu, reference.geglu, {"approximate": "tanh"}),
    "gelu_erf": (geglu, reference.geglu, {"approximate": "none"}),
}


@pytest.mark.parametrize("activation", list(MULTIPLIED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_place", [False, True])
def test_gate_and_output_multipliers(in_place, dtype, activation, device):
    """Falcon-H1's MLP multipliers: `act(gate * m_g) * up * m_o`, forward and both gradients, at an odd size."""
    op, ref_op, options = MULTIPLIED[activation]
    torch.manual_seed(5)
    gate = leaf(torch.randn(37, 127, device=device), dtype)
    up = leaf(torch.randn(37, 127, device=device), dtype)
    multipliers = {"gate_multiplier": 0.71875, "output_multiplier": 1.3}
    gate64, up64 = as_float64(gate), as_float64(up)  # before an in-place backward overwrites gate and up
    y = op(gate, up, in_place_backward=in_place, **options, **multipliers)
    grad = torch.randn_like(y)
    y.backward(grad.clone())
    y64 = ref_op(gate64, up64, *options.values(), *multipliers.values())
    y64.backward(grad.double())
    assert_close(y, y64, dtype, f"{activation} y")
    assert_close(gate.grad, gate64.grad, dtype, f"{activation} dgate")
    assert_close(up.grad, up64.grad, dtype, f"{activation} dup")


def test_bad_inputs(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="gate_multiplier=nan must be a finite number"):
        swiglu(x, x, gate_multiplier=float("nan"))
    with pytest.raises(ValueError, match="output_multiplier='2' must be a finite number"):
        geglu(x, x, output_multiplier="2")
    with pytest.raises(ValueError, match=r"gate has shape \(4, 8\) but up has shape \(4, 7\)"):
        swiglu(x, torch.randn(4, 7, device=device))
    with pytest.raises(TypeError, match="dtype torch.int64"):
        swiglu(torch.ones(4, 8, dtype=torch.long, device=device), x)
    with pytest.raises(TypeError, match="gate has dtype torch.float32 but up has dtype torch.bfloat16"):
        geglu(x, x.bfloat16())
    with pytest.raises(ValueError, match="approximate='erf'"):
        geglu(x, x, approximate="erf")
    with pytest.raises(ValueError, match="contiguous"):
        swiglu(x.t(), x.t().contiguous(), in_place_backward=True)
    with pytest.raises(ValueError, match="separate memory"):
        swiglu(x, x, in_place_backward=True)


def test_up_on_another_device():
    with pytest.raises(ValueError, match="up is on meta"):
        swiglu(torch.randn(4, 8), torch.randn(4, 8, device="meta"))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8192, 14336), (4099, 11008), (3, 1000003)], ids=str)
def test_gpu_real_sizes(shape, dtype, activation):
    run_case(shape, dtype, "cuda", activation)
    run_case(shape, dtype, "cuda", activation, gate_scale=4.0)


# The packed variant: gate_up [..., 2I] -> act(gate) * up [..., I], d(gate_up) in one tensor.
PACKED = {
    "silu": (swiglu_packed, reference.swiglu_packed),
    "gelu_tanh": (lambda x, **kw: geglu_packed(x, approximate="tanh", **kw), reference.geglu_packed),
    "gelu_erf": (
        lambda x, **kw: geglu_packed(x, approximate="none", **kw),
        lambda x: reference.geglu_packed(x, approximate="none"),
    ),
}
# I = 1, 3, 127, 4097 (odd, and 4097 spans five 1024-wide column blocks); 1 row, many rows, 3-D; row blocks:
# I = 1 puts 4096 rows in a tile, so 4099 rows take two; I = 127 puts 32, so 37 rows take two.
PACKED_SHAPES = [(2,), (1, 6), (37, 254), (2, 3, 254), (3, 8194), (4099, 2), (5, 2048)]


def check_packed(gate_up, activation, dtype, in_place=False, scale=1.0):
    """The packed op on `gate_up` (a leaf, or an intermediate whose leaf is `gate_up_leaf`) against float64."""
    op, ref_op = PACKED[activation]
    gate_up64 = as_float64(gate_up)  # copied before an in-place backward overwrites gate_up
    y = op(gate_up, in_place_backward=in_place)
    grad = torch.randn_like(y)
    y.backward(grad.clone())
    y64 = ref_op(gate_up64)
    y64.backward(grad.double())
    assert y.dtype == dtype and y.shape == (*gate_up.shape[:-1], gate_up.shape[-1] // 2)
    assert_close(y, y64, dtype, f"{activation} packed y", scale)
    return gate_up64.grad


def run_packed_case(shape, dtype, device, activation, gate_scale=1.0):
    torch.manual_seed(sum(shape) * 13 + len(activation))
    gate_up = torch.randn(shape, device=device)
    gate_up[..., : shape[-1] // 2] *= gate_scale
    gate_up = leaf(gate_up, dtype)
    expected = check_packed(gate_up, activation, dtype)
    assert_close(gate_up.grad, expected, dtype, f"{activation} packed d(gate_up)")


@pytest.mark.parametrize("activation", PACKED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", PACKED_SHAPES, ids=str)
def test_packed_matches_reference(shape, dtype, activation, device):
    run_packed_case(shape, dtype, device, activation)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # interpreter: exp(+large) = inf
@pytest.mark.parametrize("activation", PACKED)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_large_magnitude_gate(dtype, activation, device):
    run_packed_case((3, 2 * 127), dtype, device, activation, gate_scale=10.0)


def test_packed_launch_tiles_cover_every_element():
    assert gated_activation._packed_launch(4099, 1) == ((2, 1), 4096, 1)
    assert gated_activation._packed_launch(37, 127) == ((2, 1), 32, 128)
    assert gated_activation._packed_launch(3, 4097) == ((1, 5), 4, 1024)
    assert gated_activation._packed_launch(8192, 14336) == ((2048, 14), 4, 1024)


@pytest.mark.parametrize("activation", PACKED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_in_place_backward(dtype, activation, device):
    """d(gate_up) lands in gate_up's memory (an intermediate, as a projection's output) and is right."""
    torch.manual_seed(5)
    gate_up_leaf = leaf(torch.randn(2, 19, 2 * 127, device=device), dtype)
    gate_up = gate_up_leaf * 1
    captured = {}
    gate_up.register_hook(lambda g: captured.update(ptr=g.data_ptr(), shape=g.shape))
    expected = check_packed(gate_up, activation, dtype, in_place=True)
    assert captured == {"ptr": gate_up.data_ptr(), "shape": gate_up.shape}
    assert_close(gate_up_leaf.grad, expected, dtype, "d(gate_up)")


@pytest.mark.parametrize("in_place", [False, True])
def test_packed_row_strided_input(in_place, device):
    """A row slice of a wider tensor (row stride 2I + 5) is read, and in place written, without a copy."""
    torch.manual_seed(6)
    wide_leaf = torch.randn(9, 2 * 33 + 5, device=device, requires_grad=True)
    wide = wide_leaf * 1
    gate_up = wide[:, 5:]
    assert gate_up.stride() == (71, 1)
    captured = {}
    gate_up.register_hook(lambda g: captured.update(ptr=g.data_ptr(), stride=g.stride()))
    expected = check_packed(gate_up, "silu", torch.float32, in_place=in_place)
    assert_close(wide_leaf.grad[:, 5:], expected, torch.float32, "d(gate_up)")
    assert torch.equal(wide_leaf.grad[:, :5], torch.zeros(9, 5, device=device))
    if in_place:
        assert captured == {"ptr": gate_up.data_ptr(), "stride": (71, 1)}


@pytest.mark.parametrize("activation", PACKED)
def test_packed_non_contiguous_inputs_are_copied(activation, device):
    torch.manual_seed(7)
    transposed = torch.randn(2 * 21, 6, device=device).t().detach().requires_grad_(True)  # column stride 6
    expected = check_packed(transposed, activation, torch.float32)
    assert_close(transposed.grad, expected, torch.float32, "d(gate_up)")


def test_packed_default_backward_leaves_input_intact(device):
    gate_up = torch.randn(5, 16, device=device, requires_grad=True)
    before = gate_up.detach().clone()
    swiglu_packed(gate_up).sum().backward()  # sum() hands the backward a stride-0 gradient
    assert torch.equal(gate_up.detach(), before)
    assert gate_up.grad.data_ptr() != gate_up.data_ptr()


@pytest.mark.parametrize("activation", PACKED)
@pytest.mark.parametrize("shape", [(0, 6), (4, 0), (3, 0, 8)], ids=str)
@pytest.mark.parametrize("in_place", [False, True])
def test_packed_empty(shape, activation, in_place, device):
    op = PACKED[activation][0]
    gate_up = torch.empty(shape, device=device, requires_grad=True)
    y = op(gate_up * 1, in_place_backward=in_place)
    y.backward(torch.empty_like(y))
    assert y.shape == (*shape[:-1], shape[-1] // 2) and gate_up.grad.shape == shape


def test_packed_bad_inputs(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match=r"shape \(4, 7\): its last dimension, 7, is odd"):
        swiglu_packed(torch.randn(4, 7, device=device))
    with pytest.raises(TypeError, match="gate_up has dtype torch.int64"):
        swiglu_packed(torch.ones(4, 8, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="gate_up has dtype torch.float64"):
        geglu_packed(x.double())
    with pytest.raises(ValueError, match="gate_up is a scalar"):
        swiglu_packed(torch.tensor(1.0, device=device))
    with pytest.raises(ValueError, match="approximate='erf'"):
        geglu_packed(x, approximate="erf")
    with pytest.raises(ValueError, match=r"contiguous last dimension.*strides \(1, 4\)"):
        swiglu_packed(torch.randn(8, 4, device=device).t(), in_place_backward=True)
    with pytest.raises(ValueError, match="do not overlap"):  # expanded rows share memory
        geglu_packed(torch.randn(1, 8, device=device).expand(3, 8), in_place_backward=True)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        swiglu_packed([1.0, 2.0])


@pytest.mark.gpu
@pytest.mark.parametrize("activation", PACKED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(8192, 2 * 14336), (4099, 2 * 11008), (3, 2 * 1000003), (65537, 2 * 3)], ids=str)
def test_packed_gpu_real_sizes(shape, dtype, activation):
    run_packed_case(shape, dtype, "cuda", activation)
    run_packed_case(shape, dtype, "cuda", activation, gate_scale=4.0)
