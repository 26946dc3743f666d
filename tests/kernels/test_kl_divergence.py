import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import DTYPES, TOLERANCE, assert_close, relative_error
from tigon.kernels import reference
from tigon.kernels.ops import kl_divergence as kl_module
from tigon.kernels.ops.kl_divergence import kl_divergence

REDUCTIONS = ["batchmean", "sum", "mean", "none"]


def make_inputs(rows, vocab, dtype, device, seed, log_target=False, target_dtype=None):
    """Student log-probabilities and a teacher distribution (some probabilities exactly 0 without log_target)."""
    torch.manual_seed(seed)
    student = torch.log_softmax(torch.randn(rows, vocab, device=device) * 2, -1).to(dtype)
    teacher_logits = torch.randn(rows, vocab, device=device) * 2
    if log_target:
        teacher = torch.log_softmax(teacher_logits, -1)
    else:
        teacher = torch.softmax(teacher_logits, -1)
        teacher[:, ::5] = 0.0  # xlogy: 0 * log 0 counts 0
    return student, teacher.to(target_dtype or dtype)


def run_case(rows, vocab, dtype, device, seed=0, grad_scale=1.0, target_dtype=None, **options):
    """Kernel vs the float64 reference: loss and input gradient."""
    student, teacher = make_inputs(rows, vocab, dtype, device, seed, options.get("log_target", False), target_dtype)
    x = student.clone().requires_grad_(True)
    x64 = student.double().requires_grad_(True)
    out = kl_divergence(x, teacher, **options)
    ref = reference.kl_divergence(x64, teacher.double(), **options)
    if options.get("reduction") == "none":
        assert out.dtype == torch.promote_types(dtype, teacher.dtype) and out.shape == student.shape
        grad = torch.randn(out.shape, device=device, dtype=torch.float64)
    else:
        assert out.dtype == torch.float32 and out.dim() == 0
        grad = torch.tensor(grad_scale, device=device, dtype=torch.float64)
    out.backward(grad.float())
    ref.backward(grad)
    assert_close(out, ref, dtype, "loss")
    # "mean" gradients are about 1 / (rows * V**2): float16 subnormals, allow twice the error of rounding them.
    rounding = relative_error(x64.grad.to(dtype), x64.grad)
    assert_close(x.grad, x64.grad, dtype, "dinput", scale=max(1.0, 2 * rounding / TOLERANCE[dtype]))
    assert x.grad.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 1003])
def test_matches_reference(vocab, dtype, device):
    rows = 3 if vocab > 1000 else 13
    run_case(rows, vocab, dtype, device)
    run_case(rows, vocab, dtype, device, seed=1, log_target=True, reduction="none")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("log_target", [False, True])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_each_reduction_and_log_target(reduction, log_target, dtype, device):
    run_case(9, 127, dtype, device, reduction=reduction, log_target=log_target)


def test_many_vocabulary_chunks(device, monkeypatch):
    monkeypatch.setattr(kl_module, "MAX_BLOCK_V", 16)
    monkeypatch.setattr(kl_module, "BACKWARD_BLOCK", 16)
    for reduction in REDUCTIONS:
        run_case(5, 203, torch.float32, device, reduction=reduction, log_target=reduction == "sum")


def test_incoming_gradient_and_mixed_dtypes(device):
    run_case(19, 65, torch.float32, device, grad_scale=-2.5)
    run_case(19, 65, torch.bfloat16, device, grad_scale=3.0, target_dtype=torch.float32, log_target=True)
    run_case(19, 65, torch.float16, device, target_dtype=torch.float32, reduction="none")


def test_reference_matches_torch_and_the_formula():
    """The oracle: F.kl_div's semantics, batchmean dividing by the first dimension of a 3-D input."""
    torch.manual_seed(0)
    x = torch.log_softmax(torch.randn(2, 3, 11, dtype=torch.float64), -1)
    y = torch.softmax(torch.randn(2, 3, 11, dtype=torch.float64), -1)
    y[..., 0] = 0.0
    pointwise = torch.where(y > 0, y * (y.log() - x), 0.0)
    torch.testing.assert_close(reference.kl_divergence(x, y, reduction="none"), pointwise)
    torch.testing.assert_close(reference.kl_divergence(x, y, reduction="batchmean"), pointwise.sum() / 2)
    torch.testing.assert_close(reference.kl_divergence(x, y), pointwise.mean())  # torch's default
    log_y = torch.log_softmax(torch.randn(2, 3, 11, dtype=torch.float64), -1)
    torch.testing.assert_close(
        reference.kl_divergence(x, log_y, reduction="sum", log_target=True), (log_y.exp() * (log_y - x)).sum()
    )
    assert F.kl_div(x, y, reduction="batchmean") == reference.kl_divergence(x, y, reduction="batchmean")


def test_three_dimensional_and_non_contiguous_inputs(device):
    """(B, T, V) input: batchmean divides by B; a column-strided input is copied, a row-strided one is not."""
    torch.manual_seed(0)
    base = torch.log_softmax(torch.randn(3, 5, 2 * 41, device=device), -1)
    for student in (base[..., :41], base[..., ::2]):
        teacher = torch.softmax(torch.randn(3, 5, 41, device=device), -1)
        for reduction in REDUCTIONS:
            x = student.detach().requires_grad_(True)
            x64 = student.detach().double().requires_grad_(True)
            out = kl_divergence(x, teacher, reduction=reduction)
            ref = reference.kl_divergence(x64, teacher.double(), reduction=reduction)
            out.sum().backward()
            ref.sum().backward()
            assert_close(out, ref, torch.float32, f"loss ({reduction})")
            assert_close(x.grad, x64.grad, torch.float32, f"dinput ({reduction})")


def test_without_grad(device):
    student, teacher = make_inputs(9, 50, torch.float32, device, 0)
    with torch.no_grad():
        loss = kl_divergence(student.requires_grad_(True), teacher)
    assert_close(loss, reference.kl_divergence(student.double(), teacher.double()), torch.float32, "loss")
    assert kl_divergence(student.detach(), teacher, reduction="sum").grad_fn is None


def test_reduced_loss_takes_one_backward_and_pointwise_loss_many(device):
    """A reduced loss's gradient is written in the forward and scaled in place by the backward, so a second
    backward is refused; the pointwise loss computes its gradient in the backward and allows any number."""
    student, teacher = make_inputs(5, 8, torch.float32, device, 0)
    loss = kl_divergence(student.clone().requires_grad_(True), teacher, reduction="batchmean")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()
    x = student.clone().requires_grad_(True)
    out = kl_divergence(x, teacher, reduction="none")
    out.sum().backward(retain_graph=True)
    out.sum().backward()
    assert torch.equal(x.grad, -2 * teacher)
    assert torch.equal(x.detach(), student)  # the input is never written


def test_bad_inputs(device):
    student, teacher = make_inputs(4, 8, torch.float32, device, 0)
    cases = [
        (ValueError, "same shape", dict(target=teacher[:, :7])),
        (ValueError, "non-empty", dict(input=student[:0], target=teacher[:0])),
        (ValueError, "non-empty", dict(input=student[0, 0], target=teacher[0, 0])),
        (TypeError, "input has dtype torch.int64", dict(input=student.long())),
        (TypeError, "target has dtype torch.int64", dict(target=teacher.long())),
        (ValueError, "reduction", dict(reduction="avg")),
        (TypeError, "log_target must be a bool", dict(log_target=1)),
        (ValueError, r"target.detach\(\)", dict(target=teacher.clone().requires_grad_(True))),
        (ValueError, "target is on meta", dict(target=torch.empty(4, 8, device="meta"))),
    ]
    for error, message, changes in cases:
        args = {"input": student, "target": teacher, "reduction": "batchmean", "log_target": False, **changes}
        with pytest.raises(error, match=message):
            kl_divergence(args.pop("input"), args.pop("target"), **args)


@pytest.mark.gpu
@pytest.mark.parametrize("log_target", [False, True])
def test_gpu_real_size(log_target):
    """8192 tokens x Llama 3's vocabulary in bf16 against a float32 reference."""
    student, teacher = make_inputs(8192, 128256, torch.bfloat16, "cuda", 0, log_target)
    for reduction in ("batchmean", "none"):
        x = student.clone().requires_grad_(True)
        x32 = student.float().requires_grad_(True)
        out = kl_divergence(x, teacher, reduction=reduction, log_target=log_target)
        ref = reference.kl_divergence(x32, teacher.float(), reduction=reduction, log_target=log_target)
        out.float().sum().backward()
        ref.sum().backward()
        assert_close(out, ref, torch.bfloat16, "loss")
        assert_close(x.grad, x32.grad, torch.bfloat16, "dinput")
        del x, x32, out, ref
