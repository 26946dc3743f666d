import pytest
import torch

from tests.kernels.helpers import DTYPES, as_float64, assert_close, leaf, relative_error
from tigon.kernels import reference
from tigon.kernels.ops.rms_norm import rms_norm

HIDDEN = [1, 3, 127, 128, 4097]
ROWS = 37  # not a multiple of any block size


def run_case(rows, hidden, dtype, device, casting="llama", offset=0.0, with_weight=True, in_place=False):
    torch.manual_seed(hidden * 7 + rows)
    x = leaf(torch.randn(rows, hidden, device=device), dtype)
    weight = leaf(torch.rand(hidden, device=device) + 0.5, dtype) if with_weight else None
    y = rms_norm(x, weight, eps=1e-6, offset=offset, casting=casting, in_place_backward=in_place)
    dy = torch.randn_like(y)
    y.backward(dy.clone())  # an in-place backward overwrites the gradient it is given

    x64 = as_float64(x)
    w64 = as_float64(weight) if with_weight else None
    y64 = reference.rms_norm(x64, w64, eps=1e-6, offset=offset, casting=casting)
    y64.backward(dy.double())

    assert y.dtype == dtype
    assert_close(y, y64, dtype, "y")
    assert_close(x.grad, x64.grad, dtype, "dx")
    if with_weight:
        # dW sums over rows: its rounding is the output's, so it gets the same tolerance.
        assert_close(weight.grad, w64.grad, dtype, "dweight")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_llama_casting(hidden, dtype, device):
    run_case(ROWS, hidden, dtype, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [3, 127, 4097])
def test_gemma_casting_with_offset(hidden, dtype, device):
    run_case(ROWS, hidden, dtype, device, casting="gemma", offset=1.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [3, 127])
def test_no_casting(hidden, dtype, device):
    run_case(ROWS, hidden, dtype, device, casting="none")
    run_case(ROWS, hidden, dtype, device, casting="none", offset=1.0, with_weight=False)


def test_no_casting_rounds_where_pytorch_rounds(device):
    """In fp16 (which Triton's interpreter rounds to nearest, as the GPU does) "none" is the plain module computed
    in fp16: within one fp16 rounding of it (a row's mean square may land one unit apart, summed in another
    order), and as close to the float64 result as it is. An fp32 weight promotes the output, as in PyTorch."""
    torch.manual_seed(2)
    x = torch.randn(ROWS, 127, device=device).half() * 3
    weight = (torch.rand(127, device=device) + 0.5).half()
    plain = reference.rms_norm(x, weight, eps=1e-6, offset=1.0, casting="none")
    y = rms_norm(x, weight, eps=1e-6, offset=1.0, casting="none")
    exact = reference.rms_norm(x.double(), weight.double(), eps=1e-6, offset=1.0, casting="none")
    assert relative_error(y, plain) < 2**-11
    assert relative_error(y, exact) < 1.1 * relative_error(plain, exact)
    y32 = rms_norm(x, weight.float(), casting="none")
    assert y32.dtype == torch.float32
    assert relative_error(y32, reference.rms_norm(x, weight.float(), casting="none")) < 2**-11


@pytest.mark.parametrize("dtype", DTYPES)
def test_without_weight(dtype, device):
    run_case(ROWS, 127, dtype, device, with_weight=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_in_place_backward(dtype, device):
    run_case(ROWS, 255, dtype, device, in_place=True)


def test_many_rows_use_several_programs_per_band(device):
    run_case(1031, 64, torch.float32, device)


def test_empty_batch_gives_empty_outputs_and_a_zero_weight_gradient(device):
    """No rows: the backward launches no programs (it divided by zero before) and dW is exactly zero."""
    x = torch.randn(0, 64, device=device, requires_grad=True)
    weight = torch.rand(64, device=device, requires_grad=True)
    y = rms_norm(x, weight)
    y.sum().backward()
    assert y.shape == x.shape and x.grad.shape == x.shape
    assert torch.equal(weight.grad, torch.zeros_like(weight))


def test_in_place_backward_reuses_gradient_memory(device):
    x = torch.randn(5, 16, device=device, requires_grad=True)
    weight = torch.ones(16, device=device, requires_grad=True)
    dy = torch.randn(5, 16, device=device)
    captured = {}
    y = rms_norm(x, weight, in_place_backward=True)
    y.register_hook(lambda grad: captured.update(ptr=grad.data_ptr()))
    y.backward(dy)
    assert x.grad.data_ptr() == captured["ptr"]


def test_non_contiguous_input(device):
    torch.manual_seed(0)
    base = torch.randn(12, 2 * 33, device=device)
    x = base[:, ::2].detach().requires_grad_(True)  # stride 2 in the hidden dimension
    weight = torch.rand(33, device=device, requires_grad=True)
    y = rms_norm(x, weight)
    y.sum().backward()
    x64, w64 = as_float64(x), as_float64(weight)
    reference.rms_norm(x64, w64).sum().backward()
    assert_close(y, reference.rms_norm(x64, w64), torch.float32, "y")
    assert_close(x.grad, x64.grad, torch.float32, "dx")
    assert_close(weight.grad, w64.grad, torch.float32, "dweight")


def test_transposed_rows_three_dims(device):
    torch.manual_seed(1)
    x = torch.randn(4, 6, 40, device=device).transpose(0, 1).detach().requires_grad_(True)
    y = rms_norm(x, None)
    x64 = as_float64(x)
    assert_close(y, reference.rms_norm(x64, None), torch.float32, "y")


def test_bad_inputs(device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="hidden size"):
        rms_norm(x, torch.ones(7, device=device))
    with pytest.raises(TypeError, match="dtype torch.int64"):
        rms_norm(torch.ones(4, 8, dtype=torch.long, device=device))
    with pytest.raises(ValueError, match="casting"):
        rms_norm(x, torch.ones(8, device=device), casting="mistral")
    with pytest.raises(ValueError, match="non-empty"):
        rms_norm(torch.randn(4, 0, device=device))


def test_weight_on_another_device():
    x = torch.randn(4, 8, device="cpu")
    weight = torch.ones(8, device="meta")
    with pytest.raises(ValueError, match="weight is on meta"):
        rms_norm(x, weight)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(16384, 4096), (4099, 8192), (333, 16384), (2048, 5120)])
def test_gpu_real_sizes(shape, dtype):
    run_case(*shape, dtype, "cuda")
    run_case(*shape, dtype, "cuda", casting="gemma", offset=1.0)
    run_case(*shape, dtype, "cuda", casting="none")


def test_cpu_without_interpreter_uses_reference_and_logs_once():
    """Without TRITON_INTERPRET, CPU tensors take the reference path, announced once per op."""
    import os
    import subprocess
    import sys

    code = (
        "import logging, torch; logging.basicConfig(level=logging.WARNING, format='%(message)s');"
        "from tigon.kernels import functional as F, reference;"
        "x = torch.randn(3, 8); w = torch.rand(8);"
        "assert torch.equal(F.rms_norm(x, w), reference.rms_norm(x, w)); F.rms_norm(x, w); F.swiglu(x, x)"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    lines = [line for line in result.stderr.splitlines() if "reference runs instead" in line]
    assert len(lines) == 2 and "rms_norm" in lines[0] and "swiglu" in lines[1], result.stderr
