import math

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import DTYPES, TOLERANCE, assert_close, relative_error
from tigon.kernels import reference
from tigon.kernels.ops import jsd as jsd_module
from tigon.kernels.ops.jsd import jsd

IGNORE = -100

# Each option alone (on logits unless said otherwise), then combinations.
OPTIONS = {
    "forward_kl": {"beta": 0.0},
    "reverse_kl": {"beta": 1.0},
    "beta": {"beta": 0.3},
    "temperature": {"temperature": 2.5},
    "label": {"label": True},
    "ignore_index": {"label": True, "ignore_index": 3},
    "sum": {"reduction": "sum"},
    "mean": {"reduction": "mean"},
    "none": {"reduction": "none"},
    "log_probs": {"from_logits": False},
}
COMBINED = {
    "forward_kl+temperature+label+sum": {"beta": 0.0, "temperature": 0.7, "label": True, "reduction": "sum"},
    "reverse_kl+temperature+label+none": {"beta": 1.0, "temperature": 3.0, "label": True, "reduction": "none"},
    "beta+temperature+label+mean": {"beta": 0.8, "temperature": 1.5, "label": True, "reduction": "mean"},
    "log_probs+beta+label+none": {"from_logits": False, "beta": 0.1, "label": True, "reduction": "none"},
    "log_probs+reverse_kl+label": {"from_logits": False, "beta": 1.0, "label": True},
}


def make_inputs(rows, vocab, dtype, device, seed, from_logits=True, ignore_index=IGNORE):
    """Student and teacher logits (or log-probabilities) and labels with a few ignored tokens, never all."""
    torch.manual_seed(seed)
    student = torch.randn(rows, vocab, device=device) * 2
    teacher = torch.randn(rows, vocab, device=device) * 2
    if not from_logits:
        student, teacher = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    label = torch.randint(0, vocab, (rows,), device=device)
    label[:: max(2, rows // 3)] = ignore_index
    return student.to(dtype), teacher.to(dtype), label


def run_case(rows, vocab, dtype, device, seed=0, grad_scale=1.0, **options):
    """Kernel vs the float64 reference: loss and student gradient."""
    options = {"from_logits": True, **options}
    with_label = options.pop("label", False)
    student, teacher, label = make_inputs(
        rows, vocab, dtype, device, seed, options["from_logits"], options.get("ignore_index", IGNORE)
    )
    label = label if with_label else None
    x = student.clone().requires_grad_(True)
    x64 = student.double().requires_grad_(True)
    out = jsd(x, teacher, label, **options)
    ref = reference.jsd(x64, teacher.double(), label, **options)
    assert out.dtype == torch.float32
    if options.get("reduction") == "none":
        assert out.shape == (rows,)
        grad = torch.randn(rows, device=device, dtype=torch.float64)
    else:
        grad = torch.tensor(grad_scale, device=device, dtype=torch.float64)
    out.backward(grad.float())
    ref.backward(grad)
    assert_close(out, ref, dtype, "loss")
    # Tiny gradients land in float16's subnormals: allow twice the error of rounding the exact gradient.
    rounding = relative_error(x64.grad.to(dtype), x64.grad)
    assert_close(x.grad, x64.grad, dtype, "dstudent", scale=max(1.0, 2 * rounding / TOLERANCE[dtype]))
    assert x.grad.dtype == dtype


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_probabilities_below_float32_range(beta, device):
    """Log-probabilities down to about -400, so that many probabilities underflow float32, the student's, the
    teacher's or both: the reference's loss and gradient, and no NaN (the mixture's log is floored). (On logits
    this sharp, the softmax gradient is all cancellation, so the inputs are log-probabilities.)"""
    torch.manual_seed(0)
    student = torch.log_softmax(torch.randn(5, 301, device=device) * 60, -1)
    teacher = torch.log_softmax(torch.randn(5, 301, device=device) * 60, -1)
    assert (student < -104).float().mean() > 0.5  # exp underflows float32 below -104
    x = student.clone().requires_grad_(True)
    x64 = student.double().requires_grad_(True)
    out = jsd(x, teacher, beta=beta, from_logits=False)
    ref = reference.jsd(x64, teacher.double(), beta=beta, from_logits=False)
    out.backward()
    ref.backward()
    assert not torch.isnan(x.grad).any()
    assert_close(out, ref, torch.float32, "loss")
    assert_close(x.grad, x64.grad, torch.float32, "dstudent")


# One class on logits: both softmaxes are 1 and the loss is exactly 0 (test_single_class_logits).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab,from_logits", [(1, False), (7, False), (7, True), (1003, False), (1003, True)])
def test_matches_reference(vocab, from_logits, dtype, device):
    run_case(3 if vocab > 1000 else 13, vocab, dtype, device, from_logits=from_logits)


def test_single_class_logits(device):
    """A vocabulary of one: the loss and the gradient are 0, not NaN."""
    student, teacher, label = make_inputs(5, 1, torch.float32, device, 0)
    for beta in (0.0, 0.5, 1.0):
        x = student.clone().requires_grad_(True)
        loss = jsd(x, teacher, label, beta=beta, from_logits=True)
        loss.backward()
        assert abs(loss.item()) < 1e-6 and x.grad.abs().max() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option(name, dtype, device):
    run_case(9, 127, dtype, device, **OPTIONS[name])


def test_float16_gradients_within_their_rounding(device):
    """With "mean" the gradients are about 1 / (tokens * V**2), float16 subnormals: no closer than rounding allows."""
    run_case(9, 127, torch.float16, device, reduction="mean", label=True, beta=0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(COMBINED))
def test_combined_options(name, dtype, device):
    run_case(9, 257, dtype, device, **COMBINED[name])


@pytest.mark.parametrize("name", ["beta+temperature+label+mean", "log_probs+beta+label+none"])
def test_many_vocabulary_chunks(name, device, monkeypatch):
    """A small chunk forces the online softmax across many chunks, a ragged last one included."""
    monkeypatch.setattr(jsd_module, "MAX_BLOCK_V", 16)
    run_case(5, 203, torch.float32, device, **COMBINED[name])


def test_incoming_gradient_scale(device):
    run_case(9, 65, torch.float32, device, grad_scale=3.5, label=True)
    run_case(9, 65, torch.bfloat16, device, grad_scale=-0.25, beta=1.0, from_logits=False)


def test_reference_matches_the_definitions():
    """The oracle against the textbook formulas: KL both ways, and the mixture JSD with plain probabilities."""
    torch.manual_seed(0)
    s, t = torch.randn(6, 9, dtype=torch.float64) * 2, torch.randn(6, 9, dtype=torch.float64) * 2
    temperature = 1.7
    q, p = torch.softmax(s / temperature, -1), torch.softmax(t / temperature, -1)

    def kl(a, b):
        return (a * (a.log() - b.log())).sum(-1)

    def run(beta, **options):
        return reference.jsd(s, t, beta=beta, temperature=temperature, from_logits=True, **options)

    torch.testing.assert_close(run(0.0, reduction="none"), kl(p, q))
    torch.testing.assert_close(run(1.0, reduction="none"), kl(q, p))
    for beta in (0.5, 0.2):
        m = beta * p + (1 - beta) * q
        torch.testing.assert_close(run(beta, reduction="none"), beta * kl(p, m) + (1 - beta) * kl(q, m))
    js = 0.5 * kl(p, (p + q) / 2) + 0.5 * kl(q, (p + q) / 2)
    assert (js <= math.log(2)).all()
    label = torch.tensor([1, IGNORE, 2, 3, IGNORE, 0])
    valid = label != IGNORE
    torch.testing.assert_close(run(0.5, label=label), js[valid].sum() / 4)
    torch.testing.assert_close(run(0.5, label=label, reduction="mean"), js[valid].sum() / (4 * 9))
    torch.testing.assert_close(run(0.5, label=label, reduction="sum"), js[valid].sum())
    torch.testing.assert_close(run(0.5), js.mean())
    forward = F.kl_div(torch.log_softmax(s / temperature, -1), p, reduction="batchmean")
    torch.testing.assert_close(run(0.0), forward)


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize("from_logits", [True, False])
def test_all_tokens_ignored_gives_zero_loss_and_zero_gradients(reduction, from_logits, device):
    student, teacher, _ = make_inputs(6, 19, torch.float32, device, 0, from_logits)
    label = torch.full((6,), IGNORE, device=device)
    x = student.clone().requires_grad_(True)
    loss = jsd(x, teacher, label, beta=0.3, reduction=reduction, from_logits=from_logits)
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros_like(loss))
    assert torch.equal(x.grad, torch.zeros_like(x.grad))
    ref = reference.jsd(
        student.double(), teacher.double(), label, beta=0.3, reduction=reduction, from_logits=from_logits
    )
    assert torch.equal(ref, torch.zeros_like(ref))


def test_batched_strided_inputs_and_int32_labels(device):
    """(B, T, V) inputs with (B, T) labels; a row-strided view is read in place, a column-strided one copied."""
    torch.manual_seed(0)
    base = torch.randn(2, 5, 2 * 33, device=device)
    teacher = torch.randn(2, 5, 33, device=device)
    label = torch.randint(0, 33, (2, 5), device=device, dtype=torch.int32)
    label[0, 1] = IGNORE
    for student in (base[..., :33], base[..., ::2]):
        for reduction in ("batchmean", "none"):
            x = student.detach().requires_grad_(True)
            x64 = student.detach().double().requires_grad_(True)
            out = jsd(x, teacher, label, beta=0.4, temperature=1.3, reduction=reduction, from_logits=True)
            ref = reference.jsd(
                x64, teacher.double(), label, beta=0.4, temperature=1.3, reduction=reduction, from_logits=True
            )
            assert out.shape == ref.shape
            out.sum().backward()
            ref.sum().backward()
            assert_close(out, ref, torch.float32, f"loss ({reduction})")
            assert_close(x.grad, x64.grad, torch.float32, f"dstudent ({reduction})")


def test_without_grad(device):
    student, teacher, label = make_inputs(9, 50, torch.float32, device, 0)
    x = student.clone().requires_grad_(True)
    with torch.no_grad():
        loss = jsd(x, teacher, label, beta=0.7, from_logits=True)
    expected = reference.jsd(student.double(), teacher.double(), label, beta=0.7, from_logits=True)
    assert_close(loss, expected, torch.float32, "loss")
    assert torch.equal(x.detach(), student)  # the inputs are never written


def test_second_backward_is_refused(device):
    student, teacher, _ = make_inputs(5, 8, torch.float32, device, 0)
    loss = jsd(student.requires_grad_(True), teacher, from_logits=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()


def test_bad_inputs(device):
    student, teacher, label = make_inputs(4, 8, torch.float32, device, 0)
    cases = [
        (ValueError, "same shape", dict(teacher=teacher[:, :7])),
        (ValueError, "non-empty", dict(student=student[:0], teacher=teacher[:0], label=None)),
        (TypeError, "student has dtype torch.int64", dict(student=student.long())),
        (TypeError, "int64 or int32", dict(label=label.float())),
        (ValueError, "4 tokens", dict(label=label[:3])),
        (ValueError, "beta", dict(beta=1.5)),
        (ValueError, "beta", dict(beta=-0.1)),
        (ValueError, "temperature", dict(temperature=0.0)),
        (ValueError, "from_logits=True", dict(temperature=2.0, from_logits=False)),
        (ValueError, "reduction", dict(reduction="batch")),
        (TypeError, "ignore_index", dict(ignore_index=-100.0)),
        (ValueError, r"teacher.detach\(\)", dict(teacher=teacher.clone().requires_grad_(True))),
        (ValueError, "label is on meta", dict(label=torch.zeros(4, dtype=torch.long, device="meta"))),
    ]
    for error, message, changes in cases:
        args = {"student": student, "teacher": teacher, "label": label, "from_logits": True, **changes}
        with pytest.raises(error, match=message):
            jsd(args.pop("student"), args.pop("teacher"), args.pop("label"), **args)


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{"beta": 0.5}, {"beta": 0.0, "temperature": 2.0}, {"beta": 1.0}])
def test_gpu_real_size(options):
    """4096 tokens x Llama 3's vocabulary in bf16 logits against a float32 reference (its graph takes ~30 GB)."""
    student, teacher, label = make_inputs(4096, 128256, torch.bfloat16, "cuda", 0)
    x = student.clone().requires_grad_(True)
    x32 = student.float().requires_grad_(True)
    out = jsd(x, teacher, label, from_logits=True, **options)
    ref = reference.jsd(x32, teacher.float(), label, from_logits=True, **options)
    out.backward()
    ref.backward()
    assert_close(out, ref, torch.bfloat16, "loss")
    assert_close(x.grad, x32.grad, torch.bfloat16, "dstudent")


@pytest.mark.gpu
def test_gpu_memory_is_the_gradient_buffer():
    """Beyond the inputs, the forward+backward holds the student-sized gradient and a few bytes per row."""
    rows, vocab = 8192, 128256
    student = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    teacher = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    jsd(student, teacher, from_logits=True).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - student.numel() * student.element_size()
    assert extra < 16 * 2**20, f"jsd used {extra / 2**20:.1f} MiB beyond the gradient"


def test_modules_call_the_functional_ops(device):
    from tigon.kernels import functional, modules

    student, teacher, label = make_inputs(5, 17, torch.float32, device, 0)
    loss = modules.JSDLoss(beta=0.2, temperature=2.0, from_logits=True)(student, teacher, label)
    assert torch.equal(loss, functional.jsd(student, teacher, label, beta=0.2, temperature=2.0, from_logits=True))
    log_q, log_p = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    kl = modules.KLDivLoss(reduction="batchmean", log_target=True)(log_q, log_p)
    assert_close(
        kl, F.kl_div(log_q.double(), log_p.double(), reduction="batchmean", log_target=True), torch.float32, "kl"
    )
    hidden, weight = torch.randn(5, 8, device=device), torch.randn(17, 8, device=device)
    fused = modules.FusedLinearJSDLoss(beta=0.0, chunk_size=2)(hidden, weight, hidden, weight * 2, label)
    assert torch.equal(
        fused, functional.fused_linear_jsd(hidden, weight, hidden, weight * 2, label, beta=0.0, chunk_size=2)
    )
