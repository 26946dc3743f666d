import pytest
import torch
import torch.nn.functional as F

from tests.kernels.helpers import DTYPES, assert_close
from tigon.kernels import reference
from tigon.kernels.ops import cross_entropy as ce_module
from tigon.kernels.ops.cross_entropy import cross_entropy

VOCABS = [1, 7, 32003]
IGNORE = -100

# Each option alone, at values that matter (the z-loss scale is large so its gradient shows).
OPTIONS = {
    "weight": {"weight": "random"},
    "label_smoothing": {"label_smoothing": 0.1},
    "sum": {"reduction": "sum"},
    "none": {"reduction": "none"},
    "z_loss": {"lse_square_scale": 0.05},
    "softcap": {"softcap": 2.5},
    "num_items_in_batch": {"num_items_in_batch": 50},
    "return_z_loss": {"return_z_loss": True, "lse_square_scale": 0.05},
    "ignore_index": {"ignore_index": 3},
}
COMBINED = {
    "weight+smoothing": {"weight": "random", "label_smoothing": 0.2},
    "weight+smoothing+none": {"weight": "random", "label_smoothing": 0.2, "reduction": "none"},
    "everything": {
        "weight": "random",
        "label_smoothing": 0.1,
        "lse_square_scale": 0.01,
        "softcap": 3.0,
        "return_z_loss": True,
    },
    "softcap+z+sum": {"softcap": 2.0, "lse_square_scale": 0.02, "reduction": "sum", "return_z_loss": True},
    "smoothing+num_items": {"label_smoothing": 0.3, "num_items_in_batch": 29, "lse_square_scale": 0.01},
}


def make_inputs(rows, vocab, dtype, device, seed, ignore_index=IGNORE, logit_scale=2.0):
    torch.manual_seed(seed)
    logits = (torch.randn(rows, vocab, device=device) * logit_scale).to(dtype)
    target = torch.randint(0, vocab, (rows,), device=device)
    target[:: max(2, rows // 3)] = ignore_index  # a few ignored tokens, never all
    target[1 % rows] = vocab - 1
    return logits, target


def resolve(options, vocab, device):
    options = dict(options)
    if options.get("weight") == "random":
        options["weight"] = torch.rand(vocab, device=device) + 0.5
    return options


def as64(options):
    return {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in options.items()}


def run_case(rows, vocab, dtype, device, grad_scale=1.0, seed=0, **options):
    """Kernel vs the float64 reference, forward and logits gradient; returns the kernel's outputs."""
    options = resolve(options, vocab, device)
    logits, target = make_inputs(rows, vocab, dtype, device, seed, options.get("ignore_index", IGNORE))
    x = logits.clone().requires_grad_(True)
    x64 = logits.double().requires_grad_(True)
    out = cross_entropy(x, target, **options)
    ref = reference.cross_entropy(x64, target, **as64(options))
    if options.get("return_z_loss"):
        (out, z_out), (ref, z_ref) = out, ref
        assert z_out.dtype == torch.float32 and not z_out.requires_grad
        assert_close(z_out, z_ref, dtype, "z_loss")
    assert out.dtype == torch.float32
    if options.get("reduction") == "none":
        grad = torch.randn(rows, device=device, dtype=torch.float64)
    else:
        grad = torch.tensor(grad_scale, device=device, dtype=torch.float64)
    out.backward(grad.float())
    ref.backward(grad)
    assert_close(out, ref, dtype, "loss")
    assert_close(x.grad, x64.grad, dtype, "dlogits")
    assert x.grad.dtype == dtype
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_matches_reference(vocab, dtype, device):
    run_case(5 if vocab > 1000 else 37, vocab, dtype, device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option(name, dtype, device):
    run_case(37, 127, dtype, device, **OPTIONS[name])


@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option_large_vocab(name, device):
    run_case(3, 32003, torch.bfloat16, device, **OPTIONS[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(COMBINED))
def test_combined_options(name, dtype, device):
    run_case(37, 257, dtype, device, **COMBINED[name])


@pytest.mark.parametrize("lane", [8, 16])
@pytest.mark.parametrize("name", ["plain", "weight+smoothing", "everything"])
def test_many_vocabulary_chunks(name, lane, device, monkeypatch):
    """A small chunk forces the online softmax across many chunks, a ragged last one included, with a running
    (max, sum) per lane of 8 logits (the shipped launches) or one a chunk (lane 16, as wide as the chunk: an
    option the tune script sweeps)."""
    launch = ce_module.ChunkLaunch(chunk_bytes=64, warps=1, programs_per_sm=64, lane=lane)
    monkeypatch.setattr(ce_module, "DEFAULT_LAUNCH", launch)
    monkeypatch.setattr(ce_module, "LAUNCH_BY_GPU", {})
    run_case(11, 203, torch.float32, device, **COMBINED.get(name, {}))  # 16 float32 values a chunk


def tied_inputs(rows: int, vocab: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with exact ties for the maximum: a row of equal logits, one whose maximum sits in two chunks and
    lanes, one whose maximum is the last column; the others random (bf16 rounding makes more ties)."""
    logits, target = make_inputs(rows, vocab, dtype, device, 3)
    logits[2] = 1.0
    logits[3, [5, vocab - 3]] = 9.0
    logits[4, vocab - 1] = 9.0
    target[3], target[4], target[5] = 5, vocab - 1, vocab - 1
    return logits, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("reduction", "options", "chunked"),
    [("mean", {}, False), ("none", {"softcap": 30.0, "label_smoothing": 0.1, "lse_square_scale": 0.01}, True)],
)
def test_token_accuracy_and_predicted_tokens(reduction, options, chunked, dtype, device, monkeypatch):
    """The argmax (first column at the maximum, as torch.argmax) from the kernel's first pass, across vocabulary
    chunks and lanes, and its accuracy over the non-ignored tokens; loss and gradient unchanged."""
    if chunked:  # 256-byte chunks: 64 float32 or 128 bf16 logits, lanes of 8
        launch = ce_module.ChunkLaunch(chunk_bytes=256, warps=1, programs_per_sm=64, lane=8)
        monkeypatch.setattr(ce_module, "DEFAULT_LAUNCH", launch)
        monkeypatch.setattr(ce_module, "LAUNCH_BY_GPU", {})
    logits, target = tied_inputs(37, 203, dtype, device)
    x = logits.clone().requires_grad_(True)
    x64 = logits.double().requires_grad_(True)
    flags = {"return_token_accuracy": True, "return_predicted_tokens": True, "reduction": reduction, **options}
    out = cross_entropy(x, target, **flags)
    ref = reference.cross_entropy(x64, target, **flags)
    assert isinstance(out, ce_module.CrossEntropyOutput) and out.z_loss is None
    assert out.predicted_tokens.dtype == torch.int64
    torch.testing.assert_close(out.predicted_tokens, ref.predicted_tokens, rtol=0, atol=0)
    assert out.predicted_tokens[0] == -1 and out.predicted_tokens[2] == 0 and out.predicted_tokens[3] == 5
    assert out.predicted_tokens[4] == 202
    torch.testing.assert_close(out.token_accuracy, ref.token_accuracy.float(), rtol=0, atol=1e-7)
    grad = torch.randn(37, device=device, dtype=torch.float64) if reduction == "none" else torch.tensor(1.0)
    out.loss.backward(grad.float().to(device))
    ref.loss.backward(grad.to(device))
    assert_close(out.loss, ref.loss, dtype, "loss")
    assert_close(x.grad, x64.grad, dtype, "dlogits")


def test_token_accuracy_alone_and_with_z_loss(device):
    logits, target = tied_inputs(9, 31, torch.float32, device)
    target[:] = logits.argmax(-1)
    target[::2] = IGNORE
    out = cross_entropy(logits, target, return_token_accuracy=True, return_z_loss=True, lse_square_scale=0.1)
    assert out.token_accuracy.item() == 1.0 and out.predicted_tokens is None
    torch.testing.assert_close(out.z_loss, cross_entropy(logits, target, lse_square_scale=0.1, return_z_loss=True)[1])
    target[:] = IGNORE
    assert cross_entropy(logits, target, return_token_accuracy=True).token_accuracy.item() == 0.0


@pytest.mark.parametrize(
    ("gpu", "element_size", "launch"),
    [
        ("NVIDIA H200", 2, (8192, 8192, 32, 8)),
        ("NVIDIA H200", 4, (8192, 4096, 32, 8)),
        ("NVIDIA H100 80GB HBM3", 2, (8192, 16384, 32, 8)),
        ("NVIDIA A10G", 2, (8192, 8192, 32, 8)),
    ],
)
def test_each_gpu_gets_the_launch_measured_fastest_on_it(gpu, element_size, launch, monkeypatch):
    """(programs, chunk, warps, lane) at 8192 x 128256 on a 132-multiprocessor GPU: a program a row with 32 warps
    and a (max, sum) per 8 logits everywhere; the H100 walks 32 KB chunks, the H200 and GPUs not measured 16 KB.
    A vocabulary narrower than a chunk is one chunk, with warps for its width."""
    monkeypatch.setattr(ce_module, "gpu_name", lambda device: gpu)
    monkeypatch.setattr(ce_module, "multiprocessor_count", lambda device: 132)
    assert ce_module._launch_config(8192, 128256, element_size, torch.device("cpu")) == launch
    assert ce_module._launch_config(8192, 1000, element_size, torch.device("cpu"))[1:3] == (1024, 4)


@pytest.mark.parametrize("name", ["plain", *OPTIONS, *COMBINED])
def test_gradient_columns_write_what_the_full_row_kernel_writes(name, device):
    """A window of columns' gradient from the stored logsumexp is the full row kernel's, bit for bit (the
    weight-gradient rows that held fused linear CE's logits are filled with it)."""
    options = resolve({**OPTIONS, **COMBINED}.get(name, {}), 300, device)
    class_weight = options.pop("weight", None)
    loss_options = ce_module.LossOptions(**options)
    logits, target = make_inputs(13, 300, torch.bfloat16, device, 3, ignore_index=loss_options.ignore_index)
    target[4] = 300  # out of range: NaN in both
    scales = ce_module.loss_scales(target, class_weight, 300, loss_options)
    row_scale = torch.randn(13, device=device) if loss_options.reduction == "none" else None
    full = logits.clone()
    losses, lse = torch.empty(13, device=device), torch.empty(13, device=device)
    ce_module.cross_entropy_rows(full, target, class_weight, scales, loss_options, True, losses, None, row_scale, lse)
    for start, end in ((0, 300), (0, 1), (7, 150), (150, 300), (299, 300)):
        window = logits[:, start:end].clone()
        ce_module.gradient_columns(window, start, 300, lse, target, class_weight, scales, loss_options, row_scale)
        assert torch.equal(window.isnan(), full[:, start:end].isnan())
        assert window.isnan()[4].all() and not window[:4].isnan().any()
        assert torch.equal(window.nan_to_num(), full[:, start:end].nan_to_num()), f"columns {start}:{end}"


def test_incoming_gradient_scales_the_in_place_gradient(device):
    run_case(37, 127, torch.float32, device, grad_scale=3.5)
    run_case(37, 127, torch.bfloat16, device, grad_scale=-0.25, label_smoothing=0.1)


@pytest.mark.parametrize("options", [{"grad_scale": 3.5}, {"grad_scale": 1.0}, {"reduction": "none"}])
def test_scaling_strides_over_more_blocks_than_programs(options, device, monkeypatch):
    """The backward's scaling kernel with each program walking several blocks of several rows."""
    monkeypatch.setattr(ce_module, "SCALE_BLOCK", 16)
    monkeypatch.setattr(ce_module, "SCALE_PROGRAMS_PER_SM", 1)
    run_case(13, 203, torch.float32, device, **options)


@pytest.mark.parametrize("vocab", [1, 7, 32003])
def test_reference_matches_torch(vocab):
    """The oracle itself: the reference equals F.cross_entropy in float64 wherever torch defines the loss."""
    torch.manual_seed(vocab)
    rows = 4 if vocab > 1000 else 23
    x = torch.randn(rows, vocab, dtype=torch.float64)
    target = torch.randint(0, vocab, (rows,))
    target[::3] = IGNORE
    weight = torch.rand(vocab, dtype=torch.float64) + 0.5
    for reduction in ("mean", "sum", "none"):
        for options in ({}, {"weight": weight}, {"label_smoothing": 0.15}, {"weight": weight, "label_smoothing": 0.3}):
            ours = reference.cross_entropy(x, target, reduction=reduction, **options)
            theirs = F.cross_entropy(x, target, reduction=reduction, **options)
            torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_reference_softcap_z_loss_and_num_items_formulas():
    torch.manual_seed(0)
    x = torch.randn(9, 13, dtype=torch.float64) * 4
    target = torch.randint(0, 13, (9,))
    target[2] = IGNORE
    valid = target != IGNORE
    capped = 3.0 * torch.tanh(x / 3.0)
    lse = torch.logsumexp(capped, -1)
    per_token = F.cross_entropy(capped, target, reduction="none") + 0.1 * lse.square() * valid
    loss, z_loss = reference.cross_entropy(
        x, target, softcap=3.0, lse_square_scale=0.1, num_items_in_batch=20, return_z_loss=True
    )
    torch.testing.assert_close(loss, per_token.sum() / 20)
    torch.testing.assert_close(z_loss, (0.1 * lse.square() * valid).sum() / 20)
    mean = reference.cross_entropy(x, target, softcap=3.0, lse_square_scale=0.1)
    torch.testing.assert_close(mean, per_token.sum() / valid.sum())


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"weight": "random"},
        {"reduction": "sum"},
        {"reduction": "none"},
        {"num_items_in_batch": 7},
        COMBINED["everything"],
    ],
    ids=["mean", "weighted_mean", "sum", "none", "num_items", "everything"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_targets_ignored_gives_zero_loss_and_zero_gradients(options, dtype, device):
    options = resolve(options, 19, device)
    logits = torch.randn(6, 19, device=device).to(dtype).requires_grad_(True)
    target = torch.full((6,), IGNORE, device=device)
    out = cross_entropy(logits, target, **options)
    ref = reference.cross_entropy(logits.detach().double(), target, **as64(options))
    if options.get("return_z_loss"):
        (out, z_out), (ref, _) = out, ref
        assert torch.equal(z_out, torch.zeros_like(z_out))
    out.sum().backward()
    assert not torch.isnan(out).any() and torch.equal(out, torch.zeros_like(out))
    assert torch.equal(ref, torch.zeros_like(ref))  # the reference agrees: 0, not torch's NaN mean
    assert torch.equal(logits.grad, torch.zeros_like(logits.grad))


def test_out_of_range_targets_raise_a_clear_error(device):
    logits = torch.randn(4, 10, device=device, requires_grad=True)
    for bad in (10, 11, -1, -7):
        target = torch.tensor([1, bad, 2, IGNORE], device=device)
        with pytest.raises(ValueError, match=rf"target\[1\] = {bad} is out of range.*\[0, 10\).*check_targets=False"):
            cross_entropy(logits, target)


def test_unchecked_out_of_range_target_gives_nan_for_its_row_only(device):
    torch.manual_seed(0)
    logits = torch.randn(5, 10, device=device)
    target = torch.tensor([1, 12, 2, IGNORE, -3], device=device)
    x = logits.clone().requires_grad_(True)
    losses = cross_entropy(x, target, reduction="none", check_targets=False)
    losses.backward(torch.ones_like(losses))
    bad = torch.tensor([False, True, False, False, True], device=device)
    assert torch.isnan(losses[bad]).all() and torch.isnan(x.grad[bad]).all()
    good_target = torch.where(bad, 0, target)
    x64 = logits.double().requires_grad_(True)
    ref = reference.cross_entropy(x64, good_target, reduction="none")
    ref.backward(torch.ones_like(ref))
    assert_close(losses[~bad], ref[~bad], torch.float32, "loss of the good rows")
    assert_close(x.grad[~bad], x64.grad[~bad], torch.float32, "dlogits of the good rows")
    assert torch.isnan(cross_entropy(logits, target, check_targets=False))  # the mean shows it


@pytest.mark.parametrize("weighted", [False, True])
def test_gradient_accumulation_with_num_items_in_batch(weighted, device):
    """Micro-batches normalized by the whole batch's token count add up to the big batch's mean."""
    torch.manual_seed(3)
    logits = torch.randn(41, 33, device=device)
    target = torch.randint(0, 33, (41,), device=device)
    target[torch.rand(41, device=device) < 0.3] = IGNORE
    weight = torch.rand(33, device=device) + 0.5 if weighted else None
    big = logits.clone().requires_grad_(True)
    big_loss = cross_entropy(big, target, weight=weight, label_smoothing=0.1)
    big_loss.backward()
    valid = target != IGNORE
    items = (weight[target[valid]].sum() if weighted else valid.sum()).item()
    total, grads = 0.0, []
    for rows in torch.arange(41, device=device).tensor_split(4):
        micro = logits[rows].clone().requires_grad_(True)
        loss = cross_entropy(micro, target[rows], weight=weight, label_smoothing=0.1, num_items_in_batch=items)
        loss.backward()
        total += loss.item()
        grads.append(micro.grad)
    assert_close(torch.tensor(total), big_loss.detach().cpu(), torch.float32, "summed micro-batch losses")
    assert_close(torch.cat(grads), big.grad, torch.float32, "accumulated gradients")


def test_num_items_in_batch_as_a_tensor(device):
    logits, target = make_inputs(13, 21, torch.float32, device, 0)
    loss = cross_entropy(logits, target, num_items_in_batch=torch.tensor(40, device=device))
    assert_close(loss, reference.cross_entropy(logits.double(), target, num_items_in_batch=40), torch.float32, "loss")


def test_gradient_is_written_into_the_logits_memory(device):
    logits, target = make_inputs(9, 50, torch.float32, device, 0)
    x = logits.clone().requires_grad_(True)
    pointer = x.data_ptr()
    loss = cross_entropy(x, target)
    assert not torch.equal(x.detach(), logits)  # the forward already replaced the logits with the gradient
    loss.backward()
    assert x.grad.data_ptr() == pointer


def test_an_op_that_saved_the_logits_fails_loudly_instead_of_silently(device):
    """tanh saves its output for its backward; the in-place gradient must not corrupt it unnoticed."""
    x = torch.randn(4, 9, device=device, requires_grad=True)
    target = torch.randint(0, 9, (4,), device=device)
    loss = cross_entropy(torch.tanh(x) * 1.0, target)  # the product's output is not saved: fine
    loss.backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        cross_entropy(torch.tanh(x), target).backward()


def test_without_grad_the_logits_are_untouched(device):
    logits, target = make_inputs(9, 50, torch.float32, device, 0)
    x = logits.clone().requires_grad_(True)
    with torch.no_grad():
        loss = cross_entropy(x, target, label_smoothing=0.1)
    assert torch.equal(x.detach(), logits)
    assert_close(loss, reference.cross_entropy(logits.double(), target, label_smoothing=0.1), torch.float32, "loss")
    loss = cross_entropy(logits, target)  # a tensor that does not require grad
    assert torch.equal(x.detach(), logits)


def test_second_backward_is_refused(device):
    logits, target = make_inputs(5, 8, torch.float32, device, 0)
    x = logits.clone().requires_grad_(True)
    loss = cross_entropy(x, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()


def test_strided_logits_and_int32_targets(device):
    torch.manual_seed(0)
    for column_step in (1, 2):  # rows 40 * step apart; then columns 2 apart as well (copied first)
        x = torch.randn(7, 40 * column_step, device=device)[:, ::column_step][:, :33].requires_grad_(True)
        logits = x.detach().clone()
        target = torch.randint(0, 33, (7,), device=device, dtype=torch.int32)
        loss = cross_entropy(x, target)
        loss.backward()
        x64 = logits.double().requires_grad_(True)
        ref = reference.cross_entropy(x64, target)
        ref.backward()
        assert_close(loss, ref, torch.float32, "loss")
        assert_close(x.grad, x64.grad, torch.float32, "dlogits")


def test_bad_inputs(device):
    logits = torch.randn(4, 8, device=device)
    target = torch.tensor([0, 1, 2, 3], device=device)
    cases = [
        (ValueError, "2-D", dict(logits=logits[None]), {}),
        (ValueError, "empty batch", dict(logits=logits[:0], target=target[:0]), {}),
        (TypeError, "int64 or int32", dict(target=target.float()), {}),
        (ValueError, "4 tokens", dict(target=target[:3]), {}),
        (TypeError, "dtype torch.int64", dict(logits=logits.long()), {}),
        (ValueError, "vocabulary size", {}, dict(weight=torch.ones(7, device=device))),
        (ValueError, "reduction", {}, dict(reduction="avg")),
        (ValueError, "label_smoothing", {}, dict(label_smoothing=1.5)),
        (ValueError, "lse_square_scale", {}, dict(lse_square_scale=-1.0)),
        (ValueError, "softcap", {}, dict(softcap=0.0)),
        (ValueError, "reduction='mean'", {}, dict(num_items_in_batch=4, reduction="sum")),
        (ValueError, "positive number", {}, dict(num_items_in_batch=0)),
        (ValueError, "detach", {}, dict(weight=torch.ones(8, device=device, requires_grad=True))),
        (TypeError, "ignore_index", {}, dict(ignore_index=1.0)),
        (TypeError, "return_token_accuracy must be True or False", {}, dict(return_token_accuracy=1)),
    ]
    for error, message, tensors, options in cases:
        args = {"logits": logits, "target": target, **tensors}
        with pytest.raises(error, match=message):
            cross_entropy(args["logits"], args["target"], **options)


def test_target_on_another_device():
    with pytest.raises(ValueError, match="target is on meta"):
        cross_entropy(torch.randn(4, 8), torch.zeros(4, dtype=torch.long, device="meta"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_real_size_against_float32_reference(dtype):
    """8192 tokens x Llama 3's vocabulary; the float32 reference keeps the oracle within GPU memory."""
    torch.manual_seed(0)
    rows, vocab = 8192, 128256
    logits = (torch.randn(rows, vocab, device="cuda") * 2).to(dtype)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    target[::7] = IGNORE
    for options in ({}, {"label_smoothing": 0.1, "lse_square_scale": 1e-4, "softcap": 30.0}):
        x32 = logits.detach().float().clone().requires_grad_(True)
        ref = reference.cross_entropy(x32, target, **options)
        ref.backward()
        x = logits.detach().clone().requires_grad_(True)
        out = cross_entropy(x, target, **options)
        out.backward()
        assert_close(out, ref, dtype, "loss")
        assert_close(x.grad, x32.grad, dtype, "dlogits")
        del x32, ref, x, out


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"softcap": 30.0, "reduction": "none"}])
def test_gpu_token_accuracy_and_predicted_tokens(options):
    """8192 tokens x Llama 3's vocabulary in bf16 (ties for the maximum included): the kernel's argmax is
    torch.argmax's, and the loss and gradient are unchanged."""
    torch.manual_seed(1)
    rows, vocab = 8192, 128256
    logits = (torch.randn(rows, vocab, device="cuda") * 2).to(torch.bfloat16)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    target[::7] = IGNORE
    flags = {"return_token_accuracy": True, "return_predicted_tokens": True, **options}
    x = logits.clone().requires_grad_(True)
    out = cross_entropy(x, target, **flags)
    x32 = logits.float().requires_grad_(True)
    ref = reference.cross_entropy(x32, target, **flags)
    torch.testing.assert_close(out.predicted_tokens, ref.predicted_tokens, rtol=0, atol=0)
    torch.testing.assert_close(out.token_accuracy, ref.token_accuracy, rtol=0, atol=1e-6)
    grad = torch.randn_like(out.loss)
    out.loss.backward(grad)
    ref.loss.backward(grad)
    assert_close(out.loss, ref.loss, torch.bfloat16, "loss")
    assert_close(x.grad, x32.grad, torch.bfloat16, "dlogits")


@pytest.mark.gpu
def test_gpu_no_memory_beyond_the_logits():
    rows, vocab = 8192, 128256
    logits = torch.randn(rows, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, vocab, (rows,), device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    cross_entropy(logits, target).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert extra < 16 * 2**20, f"cross entropy used {extra / 2**20:.1f} MiB beyond the logits"


@pytest.mark.gpu
def test_gpu_gemma_vocabulary():
    torch.manual_seed(0)
    logits = torch.randn(64, 262144, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, 262144, (64,), device="cuda")
    x, x32 = logits.clone().requires_grad_(True), logits.float().requires_grad_(True)
    out = cross_entropy(x, target, softcap=30.0)
    out.backward()
    ref = reference.cross_entropy(x32, target, softcap=30.0)
    ref.backward()
    assert_close(out, ref, torch.bfloat16, "loss")
    assert_close(x.grad, x32.grad, torch.bfloat16, "dlogits")
