"""Every tigon custom op's fake implementation describes its real outputs: shapes, dtypes and strides.

A compiled graph is traced with the fake implementations and runs the real ops, so a stride the fake gets
wrong turns a later `view` in the traced graph into a runtime error (a transposed input, as a query/key norm
over (batch, heads, tokens, head_dim) sees it, is the common case). `torch.library.opcheck` runs each op for
real and under fake tensors and compares, then traces it with AOTAutograd, on contiguous and on transposed
or row-strided inputs, on the CPU and on a GPU.
"""

import pytest
import torch
from torch.library import opcheck

import tigon.kernels.functional  # noqa: F401  (imports every op's file: registers every tigon:: op)

ops = torch.ops.tigon


@pytest.fixture(autouse=True, params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Each test on the CPU (Triton's interpreter) and, marked gpu, on a GPU: new tensors land on it."""
    with torch.device(request.param):
        yield request.param


def heads(batch: int = 2, tokens: int = 7, n_heads: int = 3, head_dim: int = 16) -> torch.Tensor:
    """(batch, heads, tokens, head_dim) as attention transposes it out of (batch, tokens, heads, head_dim)."""
    return torch.randn(batch, tokens, n_heads, head_dim).transpose(1, 2)


def strided_rows(rows: int = 6, cols: int = 24) -> torch.Tensor:
    """A (rows, cols) slice of a wider matrix: the last dimension contiguous, the rows further apart."""
    return torch.randn(rows, cols + 8)[:, :cols]


LAYOUTS = {
    "contiguous": lambda: torch.randn(2, 7, 3, 16),
    "transposed heads": heads,
    "strided rows": lambda: strided_rows(6, 16),
}


LAYOUT_PARAMS = [pytest.param(make, id=name) for name, make in LAYOUTS.items()]


@pytest.mark.parametrize("make", LAYOUT_PARAMS)
@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_rms_norm(make, casting):
    torch.manual_seed(0)
    x, weight = make(), torch.randn(16)
    opcheck(ops.rms_norm.default, (x, weight, 1e-6, 1.0 if casting == "gemma" else 0.0, casting))
    _, rstd = ops.rms_norm(x, weight, 1e-6, 0.0, casting)
    dy = torch.randn(x.shape)
    opcheck(ops.rms_norm_backward.default, (dy, x, weight, rstd, 0.0, casting))
    opcheck(ops.rms_norm_backward.default, (dy, x, None, rstd, 0.0, casting))


@pytest.mark.parametrize("make", LAYOUT_PARAMS)
def test_fused_add_rms_norm(make):
    torch.manual_seed(0)
    x, residual, weight = make(), make(), torch.randn(16)
    opcheck(ops.fused_add_rms_norm.default, (x, residual, weight, 1e-6, 0.0, "llama"))
    _, new_residual, rstd = ops.fused_add_rms_norm(x, residual, weight, 1e-6, 0.0, "llama")
    opcheck(ops.rms_norm_backward.default, (make(), new_residual, weight, rstd, 0.0, "llama", make()))


@pytest.mark.parametrize("make", LAYOUT_PARAMS)
def test_layer_norm(make):
    torch.manual_seed(0)
    x, weight, bias = make(), torch.randn(16), torch.randn(16)
    opcheck(ops.layer_norm.default, (x, weight, bias, 1e-5))
    _, mean, rstd = ops.layer_norm(x, weight, bias, 1e-5)
    opcheck(ops.layer_norm_backward.default, (make(), x, weight, bias, mean, rstd))
    opcheck(ops.layer_norm_backward.default, (make(), x, None, None, mean, rstd))


@pytest.mark.parametrize("make", LAYOUT_PARAMS)
def test_element_wise_activations(make):
    torch.manual_seed(0)
    gate, up, grad = make(), make(), make()
    opcheck(ops.gated_activation.default, (gate, up, "swiglu", 1.0, 0.5))
    opcheck(ops.gated_activation_backward.default, (grad, gate, up, "geglu", 1.0, 1.0))
    opcheck(ops.relu_squared.default, (gate,))
    opcheck(ops.relu_squared_backward.default, (grad, gate))


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided rows"])
def test_packed_gated_activation(strided):
    torch.manual_seed(0)
    gate_up = strided_rows(6, 32) if strided else torch.randn(2, 3, 32)
    opcheck(ops.gated_activation_packed.default, (gate_up, "swiglu"))
    grad = torch.randn(*gate_up.shape[:-1], 16)
    opcheck(ops.gated_activation_packed_backward.default, (grad, gate_up, "swiglu"))


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed heads"])
@pytest.mark.parametrize("positions", [False, True], ids=["tables per row", "position ids"])
def test_rope(transposed, positions):
    torch.manual_seed(0)
    q, k = (heads(2, 7, 4), heads(2, 7, 2)) if transposed else (torch.randn(2, 4, 7, 16), torch.randn(2, 2, 7, 16))
    if positions:
        cos, sin, position_ids = torch.randn(1, 12, 16), torch.randn(1, 12, 16), torch.randint(0, 12, (2, 7))
    else:
        cos, sin, position_ids = torch.randn(2, 7, 16), torch.randn(2, 7, 16), None
    for backward in (False, True):
        opcheck(ops.rope.default, (q, k, cos, sin, position_ids, backward))


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided rows"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fused_linear_cross_entropy(strided, reduction):
    torch.manual_seed(0)
    hidden = strided_rows(6, 24) if strided else torch.randn(6, 24)
    weight, target = torch.randn(40, 24), torch.randint(0, 40, (6,))
    target[1] = -100
    want = [True, True, False]
    options = (-100, 0.0, reduction, 0.0, None, False, False, False, True, True, None, False, want)
    opcheck(ops.fused_linear_cross_entropy.default, (hidden, weight, target, None, None, None, *options))
    if reduction == "none":
        backward = (-100, 0.0, 0.0, None, False, True, None, False, want)
        grad_rows = torch.randn(6)
        opcheck(
            ops.fused_linear_cross_entropy_backward.default, (grad_rows, hidden, weight, target, None, None, *backward)
        )


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided rows"])
def test_fp8_absolute_maximum_and_cast(strided):
    torch.manual_seed(0)
    x = strided_rows(8, 24) if strided else torch.randn(8, 24)
    x = x.to(torch.bfloat16)
    opcheck(ops.fp8_amax.default, (x,))
    amax = ops.fp8_amax(x)
    for rows, transposed in ((True, True), (True, False), (False, True)):
        opcheck(ops.fp8_cast.default, (x, amax, torch.float8_e4m3fn, rows, transposed))
