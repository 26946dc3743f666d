import pytest
import torch

from tests.kernels.helpers import DTYPES, assert_close
from tigon.kernels import reference
from tigon.kernels.ops import fused_linear_jsd as fljsd_module
from tigon.kernels.ops.fused_linear_jsd import choose_chunk_size, fused_linear_jsd

IGNORE = -100
STUDENT_HIDDEN, TEACHER_HIDDEN = 24, 40  # the two heads differ in width
OPTIONS = {
    "forward_kl": {"beta": 0.0},
    "reverse_kl": {"beta": 1.0},
    "beta": {"beta": 0.3},
    "temperature": {"temperature": 2.5},
    "label": {"label": True},
    "ignore_index": {"label": True, "ignore_index": 5},
    "sum": {"reduction": "sum"},
    "mean": {"reduction": "mean"},
    "none": {"reduction": "none"},
    "fp32_accumulation": {"accumulate_in_fp32": True},
    "frozen_student_head": {"frozen": True},
}
COMBINED = {
    "beta+temperature+label+fp32": {"beta": 0.7, "temperature": 1.5, "label": True, "accumulate_in_fp32": True},
    "none+reverse_kl+temperature+label": {"reduction": "none", "beta": 1.0, "temperature": 3.0, "label": True},
    "sum+forward_kl+label+frozen": {"reduction": "sum", "beta": 0.0, "label": True, "frozen": True},
}


def make_inputs(tokens, vocab, dtype, device, seed, teacher_dtype=None, ignore_index=IGNORE):
    torch.manual_seed(seed)
    hs = torch.randn(tokens, STUDENT_HIDDEN, device=device).to(dtype)
    ws = (torch.randn(vocab, STUDENT_HIDDEN, device=device) * 2 / STUDENT_HIDDEN**0.5).to(dtype)
    ht = torch.randn(tokens, TEACHER_HIDDEN, device=device).to(teacher_dtype or dtype)
    wt = (torch.randn(vocab, TEACHER_HIDDEN, device=device) * 2 / TEACHER_HIDDEN**0.5).to(teacher_dtype or dtype)
    label = torch.randint(0, vocab, (tokens,), device=device)
    label[:: max(2, tokens // 3)] = ignore_index
    return hs, ws, ht, wt, label


def leaves(*tensors, dtype=None):
    return [t.detach().to(dtype or t.dtype).clone().requires_grad_(True) for t in tensors]


def run_case(tokens, vocab, dtype, device, seed=0, teacher_dtype=None, frozen=False, **options):
    """Kernel vs the float64 reference: loss and the student's hidden and weight gradients."""
    with_label = options.pop("label", False)
    hs, ws, ht, wt, label = make_inputs(
        tokens, vocab, dtype, device, seed, teacher_dtype, options.get("ignore_index", IGNORE)
    )
    label = label if with_label else None
    h, w = leaves(hs, ws)
    h64, w64 = leaves(hs, ws, dtype=torch.float64)
    if frozen:
        w.requires_grad_(False)
        w64.requires_grad_(False)
    out = fused_linear_jsd(h, w, ht, wt, label, **options)
    options.pop("accumulate_in_fp32", None)
    options.pop("chunk_size", None)
    ref = reference.fused_linear_jsd(h64, w64, ht.double(), wt.double(), label, **options)
    assert out.dtype == torch.float32
    if options.get("reduction") == "none":
        grad = torch.randn(tokens, dtype=torch.float64, device=device)
    else:
        grad = torch.tensor(1.0, dtype=torch.float64, device=device)
    out.backward(grad.float())
    ref.backward(grad)
    assert_close(out, ref, dtype, "loss")
    assert_close(h.grad, h64.grad, dtype, "dhidden")
    assert h.grad.dtype == dtype
    if frozen:
        assert w.grad is None
    else:
        assert w.grad.dtype == dtype
        assert_close(w.grad, w64.grad, dtype, "dweight")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [7, 1003])
def test_matches_reference(vocab, dtype, device):
    tokens = 5 if vocab > 1000 else 13
    run_case(tokens, vocab, dtype, device, label=True)
    run_case(tokens, vocab, dtype, device, seed=1, chunk_size=2, beta=0.2, temperature=2.0)


def test_single_class_vocabulary(device):
    """A vocabulary of one: both softmaxes are 1, so the loss and the gradients are 0, not NaN."""
    hs, ws, ht, wt, label = make_inputs(5, 1, torch.float32, device, 0)
    h, w = leaves(hs, ws)
    loss = fused_linear_jsd(h, w, ht, wt, label, chunk_size=2)
    loss.backward()
    assert abs(loss.item()) < 1e-6 and h.grad.abs().max() < 1e-6 and w.grad.abs().max() < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option(name, dtype, device):
    run_case(11, 127, dtype, device, chunk_size=4, **OPTIONS[name])


@pytest.mark.parametrize("name", list(COMBINED))
def test_combined_options(name, device):
    run_case(11, 257, torch.float32, device, chunk_size=3, **COMBINED[name])
    run_case(9, 129, torch.float16, device, seed=2, **COMBINED[name])


def test_teacher_in_another_dtype(device):
    """A float32 teacher with a bf16 student: each head computes its logits in its own dtype."""
    run_case(11, 127, torch.bfloat16, device, teacher_dtype=torch.float32, label=True, chunk_size=4)


def test_chunked_equals_unchunked(device):
    hs, ws, ht, wt, label = make_inputs(13, 101, torch.float32, device, 0)
    results = []
    for chunk_size in (None, 13, 5, 1):
        h, w = leaves(hs, ws)
        loss = fused_linear_jsd(h, w, ht, wt, label, beta=0.4, temperature=1.2, chunk_size=chunk_size)
        loss.backward()
        results.append((loss, h.grad, w.grad))
    for chunked in results[1:]:
        for a, b, what in zip(chunked, results[0], ("loss", "dhidden", "dweight"), strict=True):
            assert_close(a, b, torch.float32, f"{what} chunked vs unchunked", scale=0.1)


def test_chunk_size_rule_counts_both_heads(device, monkeypatch):
    """The rule sees the student's and the teacher's logits bytes per token together."""
    calls = []
    choose = fljsd_module.choose_chunk_size
    monkeypatch.setattr(fljsd_module, "choose_chunk_size", lambda *args: calls.append(args) or choose(*args))
    hs, ws, ht, wt, label = make_inputs(7, 33, torch.bfloat16, device, 0, teacher_dtype=torch.float32)
    fused_linear_jsd(hs, ws, ht, wt, label)
    assert calls == [(7, 33, STUDENT_HIDDEN, 2 + 4, torch.device(device))]


def test_chunk_size_rule_takes_a_quarter_of_the_tokens_within_its_bounds():
    """n / 4 tokens a chunk, at least hidden / 16 and at most hidden / 4 (bf16 heads: itemsize 2 + 2)."""
    cpu = torch.device("cpu")
    chunks = {n: choose_chunk_size(n, 128256, 4096, 2 + 2, cpu) for n in (7, 100, 1024, 2048, 4096, 8192, 32768)}
    assert chunks == {7: 7, 100: 100, 1024: 256, 2048: 512, 4096: 1024, 8192: 1024, 32768: 1024}
    assert choose_chunk_size(3000, 128256, 4096, 4, cpu) == 752  # a quarter, 750, rounded up to a multiple of 16
    assert choose_chunk_size(5000, 128256, 4096, 4, cpu) == 1008  # over the cap: 5 chunks of 1000, aligned
    assert choose_chunk_size(8192, 128256, 4096, 2 + 4, cpu) == 1024  # fp32 teacher: the same token bounds
    assert choose_chunk_size(8192, 262144, 2048, 4, cpu) == 512  # bounds follow the student's hidden size


def test_reduction_none_scales_each_token_exactly(device):
    """Per-token incoming gradients (zeros and negatives too) reach the weight gradient exactly."""
    hs, ws, ht, wt, label = make_inputs(13, 65, torch.float32, device, 5)
    h, w = leaves(hs, ws)
    h64, w64 = leaves(hs, ws, dtype=torch.float64)
    grad = torch.randn(13, dtype=torch.float64, device=device)
    grad[::4] = 0.0
    losses = fused_linear_jsd(h, w, ht, wt, label, reduction="none", chunk_size=4)
    (losses * grad.float()).sum().backward()  # the incoming gradient arrives as a strided view
    ref = reference.fused_linear_jsd(h64, w64, ht.double(), wt.double(), label, reduction="none")
    (ref * grad).sum().backward()
    assert_close(losses, ref, torch.float32, "losses")
    assert_close(h.grad, h64.grad, torch.float32, "dhidden")
    assert_close(w.grad, w64.grad, torch.float32, "dweight")


def test_incoming_gradient_scale(device):
    hs, ws, ht, wt, label = make_inputs(9, 65, torch.bfloat16, device, 6)
    h, w = leaves(hs, ws)
    h64, w64 = leaves(hs, ws, dtype=torch.float64)
    (fused_linear_jsd(h, w, ht, wt, label, chunk_size=4) * 2.5).backward()
    (reference.fused_linear_jsd(h64, w64, ht.double(), wt.double(), label) * 2.5).backward()
    assert_close(h.grad, h64.grad, torch.bfloat16, "dhidden")
    assert_close(w.grad, w64.grad, torch.bfloat16, "dweight")


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
def test_all_tokens_ignored(reduction, device):
    hs, ws, ht, wt, _ = make_inputs(7, 40, torch.float32, device, 0)
    h, w = leaves(hs, ws)
    label = torch.full((7,), IGNORE, device=device)
    loss = fused_linear_jsd(h, w, ht, wt, label, reduction=reduction, beta=0.3, chunk_size=3)
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros_like(loss))
    assert torch.equal(h.grad, torch.zeros_like(h.grad)) and torch.equal(w.grad, torch.zeros_like(w.grad))


def test_without_grad_and_with_transposed_hidden(device):
    hs, ws, ht, wt, label = make_inputs(9, 50, torch.float32, device, 0)
    expected = reference.fused_linear_jsd(hs.double(), ws.double(), ht.double(), wt.double(), label, temperature=2.0)
    with torch.no_grad():
        loss = fused_linear_jsd(hs, ws, ht, wt, label, temperature=2.0, chunk_size=4)
    assert_close(loss, expected, torch.float32, "no-grad loss")
    h = hs.t().contiguous().t().requires_grad_(True)  # column-major student hidden
    teacher_t = ht.t().contiguous().t()
    loss = fused_linear_jsd(h, ws, teacher_t, wt, label, temperature=2.0, chunk_size=4)
    loss.backward()
    h64 = hs.double().requires_grad_(True)
    reference.fused_linear_jsd(h64, ws.double(), ht.double(), wt.double(), label, temperature=2.0).backward()
    assert_close(loss, expected, torch.float32, "loss")
    assert_close(h.grad, h64.grad, torch.float32, "dhidden")


def test_second_backward_is_refused(device):
    hs, ws, ht, wt, _ = make_inputs(5, 8, torch.float32, device, 0)
    loss = fused_linear_jsd(hs.requires_grad_(True), ws, ht, wt)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()


def test_bad_inputs(device):
    hs, ws, ht, wt, label = make_inputs(4, 10, torch.float32, device, 0)
    cases = [
        (ValueError, "student_hidden has shape", dict(student_hidden=hs[None])),
        (ValueError, rf"\(vocabulary, {STUDENT_HIDDEN}\)", dict(student_weight=ws[:, :7])),
        (ValueError, rf"\(vocabulary, {TEACHER_HIDDEN}\)", dict(teacher_weight=wt[:, :7])),
        (TypeError, "cast one to the other", dict(student_weight=ws.half())),
        (TypeError, "teacher_weight has dtype", dict(teacher_weight=wt.half())),
        (ValueError, "same tokens", dict(teacher_hidden=ht[:3])),
        (ValueError, "share the vocabulary", dict(teacher_weight=wt[:9])),
        (ValueError, "4 tokens", dict(label=label[:3])),
        (TypeError, "int64 or int32", dict(label=label.float())),
        (ValueError, "chunk_size", dict(chunk_size=0)),
        (ValueError, "reduction", dict(reduction="avg")),
        (ValueError, "beta", dict(beta=2.0)),
        (ValueError, "temperature", dict(temperature=-1.0)),
        (ValueError, r"teacher_weight.detach\(\)", dict(teacher_weight=wt.clone().requires_grad_(True))),
        (ValueError, r"teacher_hidden.detach\(\)", dict(teacher_hidden=ht.clone().requires_grad_(True))),
        (ValueError, "teacher_weight is on meta", dict(teacher_weight=torch.empty(10, TEACHER_HIDDEN, device="meta"))),
    ]
    for error, message, changes in cases:
        args = {"student_hidden": hs, "student_weight": ws, "teacher_hidden": ht, "teacher_weight": wt, "label": label}
        args.update(changes)
        with pytest.raises(error, match=message):
            fused_linear_jsd(
                args.pop("student_hidden"),
                args.pop("student_weight"),
                args.pop("teacher_hidden"),
                args.pop("teacher_weight"),
                args.pop("label"),
                **args,
            )


def gpu_inputs(tokens, hidden, vocab, seed=0):
    torch.manual_seed(seed)
    hs = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    ws = (torch.randn(vocab, hidden, device="cuda") / hidden**0.5).to(torch.bfloat16)
    ht = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    wt = (torch.randn(vocab, hidden, device="cuda") * 1.5 / hidden**0.5).to(torch.bfloat16)
    label = torch.randint(0, vocab, (tokens,), device="cuda")
    label[::5] = IGNORE
    return hs, ws, ht, wt, label


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"beta": 0.0, "temperature": 2.0}, {"beta": 1.0}])
def test_gpu_real_size(options):
    """4096 tokens x 4096 hidden x Llama 3's vocabulary in bf16, against a float32 reference."""
    hs, ws, ht, wt, label = gpu_inputs(4096, 4096, 128256)
    h, w = leaves(hs, ws)
    loss = fused_linear_jsd(h, w, ht, wt, label, **options)
    loss.backward()
    h32, w32 = leaves(hs, ws, dtype=torch.float32)
    ref = reference.fused_linear_jsd(h32, w32, ht.float(), wt.float(), label, **options)
    ref.backward()
    assert_close(loss, ref, torch.bfloat16, "loss")
    assert_close(h.grad, h32.grad, torch.bfloat16, "dhidden")
    assert_close(w.grad, w32.grad, torch.bfloat16, "dweight")


@pytest.mark.gpu
def test_gpu_memory_flat_in_tokens():
    """Peak memory beyond the inputs: the student's gradients and one chunk of each head's logits."""
    hidden, vocab = 4096, 128256
    peaks = []
    for tokens in (8192, 16384):
        hs, ws, ht, wt, label = gpu_inputs(tokens, hidden, vocab)
        h, w = leaves(hs, ws)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fused_linear_jsd(h, w, ht, wt, label).backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
        del hs, ws, ht, wt, h, w
    # bf16 weight gradient + two chunks of 1024 tokens of bf16 logits + dhidden + slack.
    bound = vocab * hidden * 2 + 2 * 1024 * vocab * 2 + 16384 * hidden * 2 + 2**27
    assert peaks[1] < bound, f"peak {peaks[1] / 2**30:.2f} GiB above {bound / 2**30:.2f} GiB"
    growth = peaks[1] - peaks[0] - 8192 * hidden * 2  # dhidden grows with the tokens, nothing else may
    assert growth < 2**26, f"peaks {[p / 2**30 for p in peaks]} GiB grow with tokens"
