import pytest
import torch

from tests.kernels.helpers import DTYPES, assert_close
from tigon.kernels import reference
from tigon.kernels.ops import fused_linear_cross_entropy as flce_module
from tigon.kernels.ops.fused_linear_cross_entropy import (
    choose_chunk_size,
    fused_linear_cross_entropy,
    max_chunk_tokens,
)

IGNORE = -100
OPTIONS = {
    "class_weight": {"class_weight": "random"},
    "label_smoothing": {"label_smoothing": 0.1},
    "sum": {"reduction": "sum"},
    "none": {"reduction": "none"},
    "z_loss": {"lse_square_scale": 0.05},
    "softcap": {"softcap": 2.5},
    "num_items_in_batch": {"num_items_in_batch": 50},
    "return_z_loss": {"return_z_loss": True, "lse_square_scale": 0.05},
    "fp32_accumulation": {"accumulate_in_fp32": True},
    "token_scaling": {"use_token_scaling": True},
}
COMBINED = {
    "weight+smoothing+z+softcap": {
        "class_weight": "random",
        "label_smoothing": 0.1,
        "lse_square_scale": 0.01,
        "softcap": 3.0,
        "return_z_loss": True,
    },
    "none+weight+smoothing": {"class_weight": "random", "label_smoothing": 0.2, "reduction": "none"},
    "sum+softcap+z": {"softcap": 2.0, "lse_square_scale": 0.02, "reduction": "sum"},
    "token_scaling+none+weight+smoothing+z+softcap": {
        "use_token_scaling": True,
        "reduction": "none",
        "class_weight": "random",
        "label_smoothing": 0.1,
        "lse_square_scale": 0.01,
        "softcap": 3.0,
    },
}


def make_inputs(tokens, hidden, vocab, dtype, device, seed, with_bias=True):
    torch.manual_seed(seed)
    h = torch.randn(tokens, hidden, device=device).to(dtype)
    w = (torch.randn(vocab, hidden, device=device) * 1.5 / hidden**0.5).to(dtype)
    b = (torch.randn(vocab, device=device) * 0.2).to(dtype) if with_bias else None
    target = torch.randint(0, vocab, (tokens,), device=device)
    target[:: max(2, tokens // 3)] = IGNORE
    return h, w, b, target


def resolve(options, vocab, device):
    options = dict(options)
    if options.get("class_weight") == "random":
        options["class_weight"] = torch.rand(vocab, device=device) + 0.5
    return options


def leaves(*tensors, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).clone().requires_grad_(True) for t in tensors]


def run_case(tokens, hidden, vocab, dtype, device, seed=0, with_bias=True, frozen=False, **options):
    """Kernel vs the float64 reference: loss and the hidden, weight and bias gradients."""
    options = resolve(options, vocab, device)
    h, w, b, target = make_inputs(tokens, hidden, vocab, dtype, device, seed, with_bias)
    h, w, b = leaves(h, w, b)
    h64, w64, b64 = leaves(h, w, b, dtype=torch.float64)
    if frozen:
        w.requires_grad_(False)
        w64.requires_grad_(False)
    out = fused_linear_cross_entropy(h, w, target, b, **options)
    options64 = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in options.items()}
    ref = reference.fused_linear_cross_entropy(h64, w64, target, b64, **options64)
    if options.get("return_z_loss"):
        (out, z_out), (ref, z_ref) = out, ref
        assert_close(z_out, z_ref, dtype, "z_loss")
    grad = torch.randn(tokens, dtype=torch.float64, device=device) if options.get("reduction") == "none" else None
    grad = grad if grad is not None else torch.tensor(1.0, dtype=torch.float64, device=device)
    out.backward(grad.float())
    ref.backward(grad)
    assert out.dtype == torch.float32
    assert_close(out, ref, dtype, "loss")
    assert_close(h.grad, h64.grad, dtype, "dhidden")
    if frozen:
        assert w.grad is None
    else:
        assert w.grad.dtype == dtype
        assert_close(w.grad, w64.grad, dtype, "dweight")
    if with_bias:
        assert_close(b.grad, b64.grad, dtype, "dbias")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 32003])
def test_matches_reference(vocab, dtype, device):
    """The second case's 4-token chunks borrow the weight gradient's rows at the large vocabulary; those are filled
    hidden / 4 columns at a time, so there hidden is 256: 504 rows in 8 tiles of 64 columns, the last ragged (at 32,
    500 tiles of 8, each a launch of Triton's interpreter; 8-column tiles are tested at vocab 257 below)."""
    tokens = 9 if vocab > 1000 else 37
    run_case(tokens, 32, vocab, dtype, device)
    run_case(tokens, 256 if vocab > 1000 else 32, vocab, dtype, device, seed=1, with_bias=False, chunk_size=4)


@pytest.mark.parametrize("borrow", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_option(name, dtype, borrow, device):
    """8-token chunks at hidden 32: their logits fill a quarter of the weight gradient and outweigh the hidden
    gradient, so with `borrow_weight_grad` they live there and those rows are filled at the end."""
    run_case(37, 32, 257, dtype, device, chunk_size=8, borrow_weight_grad=borrow, **OPTIONS[name])


@pytest.mark.parametrize("name", list(COMBINED))
def test_combined_options(name, device):
    run_case(37, 24, 257, torch.float32, device, chunk_size=10, **COMBINED[name])
    run_case(37, 48, 257, torch.float32, device, chunk_size=12, **COMBINED[name])  # logits in the weight gradient
    run_case(23, 16, 513, torch.float16, device, seed=2, **COMBINED[name])


@pytest.mark.parametrize("name", ["none", "class_weight", "label_smoothing", "token_scaling"])
def test_borrowed_rows_filled_in_tiles_of_tokens(name, device, monkeypatch):
    """The filling in tiles of 16 tokens x 8 columns (a ragged last tile of each), accumulating over the tiles."""
    monkeypatch.setattr(flce_module, "STRIPE_TILE_BYTES", 8 * 16 * 4)
    assert flce_module.stripe_tile(37, 32, 32, 4) == (8, 16)  # 3 tiles: 13 tokens each, rounded up to 16
    run_case(37, 32, 257, torch.float32, device, chunk_size=8, **OPTIONS[name])


@pytest.mark.parametrize("borrow", [True, False])
@pytest.mark.parametrize(("dtype", "reduction"), [(torch.float32, "mean"), (torch.bfloat16, "none")])
def test_token_accuracy_and_predicted_tokens(dtype, reduction, borrow, device):
    """Each token's argmax from the kernel's pass over its chunk, its accuracy over the non-ignored tokens, with
    token scaling on; loss and gradients as the reference's. In float32 the argmax is the float64 logits' own;
    in bf16 (logits rounded by the chunk's matmul) it is a column within rounding of the float64 maximum."""
    h, w, b, target = make_inputs(37, 32, 257, dtype, device, 7)
    h, w, b = leaves(h, w, b)
    h64, w64, b64 = leaves(h, w, b, dtype=torch.float64)
    flags = {"return_token_accuracy": True, "return_predicted_tokens": True, "reduction": reduction}
    flags["use_token_scaling"] = True
    out = fused_linear_cross_entropy(h, w, target, b, chunk_size=8, borrow_weight_grad=borrow, **flags)
    ref = reference.fused_linear_cross_entropy(h64, w64, target, b64, **flags)
    assert isinstance(out, reference.CrossEntropyOutput) and out.z_loss is None
    valid = target != IGNORE
    predicted = out.predicted_tokens
    assert predicted.dtype == torch.int64 and (predicted[~valid] == -1).all()
    if dtype == torch.float32:
        torch.testing.assert_close(predicted, ref.predicted_tokens, rtol=0, atol=0)
    else:
        logits64 = torch.nn.functional.linear(h64, w64, b64).detach()[valid]
        chosen = logits64.gather(1, predicted[valid, None]).squeeze(1)
        assert (chosen >= logits64.max(1).values - 2**-7 * logits64.abs().max()).all()
    correct = ((predicted == target) & valid).float()
    expected = correct if reduction == "none" else correct.sum() / valid.sum()
    torch.testing.assert_close(out.token_accuracy, expected, rtol=0, atol=1e-7)
    grad = torch.randn(37, dtype=torch.float64, device=device) if reduction == "none" else torch.tensor(1.0)
    out.loss.backward(grad.float().to(device))
    ref.loss.backward(grad.to(device))
    assert_close(out.loss, ref.loss, dtype, "loss")
    assert_close(h.grad, h64.grad, dtype, "dhidden")
    assert_close(w.grad, w64.grad, dtype, "dweight")
    assert_close(b.grad, b64.grad, dtype, "dbias")


def test_predictions_without_gradients(device):
    h, w, b, target = make_inputs(13, 16, 50, torch.float32, device, 8)
    out = fused_linear_cross_entropy(h, w, target, b, return_predicted_tokens=True, chunk_size=4)
    expected = torch.where(target != IGNORE, torch.nn.functional.linear(h, w, b).argmax(-1), -1)
    torch.testing.assert_close(out.predicted_tokens, expected, rtol=0, atol=0)
    assert out.token_accuracy is None


def test_logits_live_in_the_weight_gradient_when_a_quarter_of_it_holds_them(device, monkeypatch):
    filled = []
    fill = flce_module.fill_borrowed_rows
    monkeypatch.setattr(
        flce_module, "fill_borrowed_rows", lambda rows, *args: filled.append(len(rows)) or fill(rows, *args)
    )
    h, w, _, target = make_inputs(37, 32, 257, torch.float32, device, 0, with_bias=False)
    cases = [  # (chunk, borrow_weight_grad, frozen head, rows filled at the end)
        (8, True, False, 72),
        (9, True, False, None),  # more than a quarter of the weight gradient
        (8, False, False, None),
        (8, True, True, None),  # no weight gradient
        (5, True, False, 48),
        (4, True, False, None),  # no more than the hidden gradient
    ]
    for chunk, borrow, frozen, rows in cases:
        filled.clear()
        hl, wl = leaves(h, w)
        wl.requires_grad_(not frozen)
        fused_linear_cross_entropy(hl, wl, target, chunk_size=chunk, borrow_weight_grad=borrow).backward()
        assert filled == ([rows] if rows else []), (chunk, borrow, frozen)
    assert flce_module.borrowed_rows(8192, 1024, 128256, 4096, 2, 2) == 32064  # a quarter of Llama 3's head
    assert flce_module.borrowed_rows(8192, 1024, 128256, 4096, 2, 4) == 16032  # a float32 accumulator: an eighth
    assert flce_module.borrowed_rows(8192, 1025, 128256, 4096, 2, 2) == 0
    assert flce_module.borrowed_rows(8192, 1024, 128256, 2048, 2, 2) == 0  # Llama 3.2 1B: half its head
    assert flce_module.borrowed_rows(16384, 1024, 128256, 4096, 2, 2) == 32064
    assert flce_module.borrowed_rows(32768, 1024, 128256, 4096, 2, 2) == 0  # the chunk is less than dhidden


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_frozen_weight(reduction, device):
    """A frozen head: no weight gradient is computed; hidden and bias still get theirs."""
    run_case(37, 24, 127, torch.float32, device, frozen=True, reduction=reduction, chunk_size=8)


def test_frozen_weight_skips_the_weight_gradient_matmul(device, monkeypatch):
    calls = []
    monkeypatch.setattr(flce_module, "accumulate_product", lambda *args, **kwargs: calls.append(1))
    h, w, _, target = make_inputs(9, 8, 33, torch.float32, device, 0, with_bias=False)
    h.requires_grad_(True)
    fused_linear_cross_entropy(h, w, target).backward()
    assert calls == [] and h.grad is not None


def test_tied_embedding_and_head(device):
    """The head's weight is also the embedding: autograd adds both gradients to the one parameter."""
    torch.manual_seed(0)
    vocab, hidden, tokens = 97, 16, 29
    ids = torch.randint(0, vocab, (tokens,), device=device)
    target = torch.randint(0, vocab, (tokens,), device=device)
    mix = torch.randn(hidden, hidden, device=device) / hidden**0.5
    table = torch.randn(vocab, hidden, device=device)
    grads = []
    for fn, dtype in (
        (fused_linear_cross_entropy, torch.float32),
        (reference.fused_linear_cross_entropy, torch.float64),
    ):
        embedding = torch.nn.Embedding.from_pretrained(table.to(dtype), freeze=False)
        h = torch.tanh(embedding(ids) @ mix.to(dtype))
        fn(h, embedding.weight, target, chunk_size=8).backward()
        grads.append(embedding.weight.grad)
    assert_close(grads[0], grads[1], torch.float32, "tied weight gradient")


def test_chunked_equals_unchunked(device):
    h, w, b, target = make_inputs(23, 24, 301, torch.float32, device, 0)
    results = []
    for chunk_size in (None, 23, 7, 1):
        hl, wl, bl = leaves(h, w, b)
        loss = fused_linear_cross_entropy(hl, wl, target, bl, label_smoothing=0.1, chunk_size=chunk_size)
        loss.backward()
        results.append((loss, hl.grad, wl.grad, bl.grad))
    for chunked in results[1:]:
        for a, b_, what in zip(chunked, results[0], ("loss", "dhidden", "dweight", "dbias"), strict=True):
            assert_close(a, b_, torch.float32, f"{what} chunked vs unchunked", scale=0.1)


def test_gradient_accumulation_with_num_items_in_batch(device):
    """Micro-batches normalized by the whole batch's token count give the big batch's gradients."""
    h, w, b, target = make_inputs(53, 16, 71, torch.float32, device, 4)
    target[torch.rand(53, device=device) < 0.3] = IGNORE
    hb, wb, bb = leaves(h, w, b)
    big = fused_linear_cross_entropy(hb, wb, target, bb, lse_square_scale=0.01)
    big.backward()
    items = int((target != IGNORE).sum())
    hm, wm, bm = leaves(h, w, b)
    total = 0.0
    for rows in torch.arange(53, device=device).tensor_split(4):
        loss = fused_linear_cross_entropy(
            hm[rows], wm, target[rows], bm, lse_square_scale=0.01, num_items_in_batch=items, chunk_size=5
        )
        loss.backward()  # weight and bias gradients accumulate across micro-batches
        total += loss.item()
    assert_close(torch.tensor(total), big.detach().cpu(), torch.float32, "summed micro-batch losses")
    assert_close(hm.grad, hb.grad, torch.float32, "dhidden")
    assert_close(wm.grad, wb.grad, torch.float32, "accumulated dweight")
    assert_close(bm.grad, bb.grad, torch.float32, "accumulated dbias")


def test_reduction_none_scales_each_token_exactly(device):
    """Per-token incoming gradients (zeros and negatives too) reach the weight gradient exactly."""
    h, w, b, target = make_inputs(21, 16, 65, torch.float32, device, 5)
    hl, wl, bl = leaves(h, w, b)
    h64, w64, b64 = leaves(h, w, b, dtype=torch.float64)
    grad = torch.randn(21, dtype=torch.float64, device=device)
    grad[::4] = 0.0
    losses = fused_linear_cross_entropy(hl, wl, target, bl, reduction="none", chunk_size=6)
    (losses * grad.float()).sum().backward()  # the incoming gradient arrives as a strided view
    ref = reference.fused_linear_cross_entropy(h64, w64, target, b64, reduction="none")
    (ref * grad).sum().backward()
    assert_close(losses, ref, torch.float32, "losses")
    for ours, theirs, what in ((hl, h64, "dhidden"), (wl, w64, "dweight"), (bl, b64, "dbias")):
        assert_close(ours.grad, theirs.grad, torch.float32, what)


def test_incoming_gradient_scale(device):
    h, w, b, target = make_inputs(19, 16, 65, torch.bfloat16, device, 6)
    hl, wl, bl = leaves(h, w, b)
    h64, w64, b64 = leaves(h, w, b, dtype=torch.float64)
    (fused_linear_cross_entropy(hl, wl, target, bl) * 2.5).backward()
    (reference.fused_linear_cross_entropy(h64, w64, target, b64) * 2.5).backward()
    for ours, theirs, what in ((hl, h64, "dhidden"), (wl, w64, "dweight"), (bl, b64, "dbias")):
        assert_close(ours.grad, theirs.grad, torch.bfloat16, what)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_targets_ignored(reduction, device):
    h, w, b, _ = make_inputs(11, 16, 40, torch.float32, device, 0)
    hl, wl, bl = leaves(h, w, b)
    target = torch.full((11,), IGNORE, device=device)
    loss = fused_linear_cross_entropy(hl, wl, target, bl, reduction=reduction, label_smoothing=0.1, chunk_size=4)
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros_like(loss))
    for grad in (hl.grad, wl.grad, bl.grad):
        assert torch.equal(grad, torch.zeros_like(grad))


def test_out_of_range_targets(device):
    h, w, _, target = make_inputs(6, 8, 10, torch.float32, device, 0, with_bias=False)
    target[2] = 10
    with pytest.raises(ValueError, match=r"target\[2\] = 10 is out of range.*check_targets=False"):
        fused_linear_cross_entropy(h, w, target)
    losses = fused_linear_cross_entropy(h, w, target, reduction="none", check_targets=False)
    assert torch.isnan(losses[2]) and not torch.isnan(losses[torch.arange(6, device=device) != 2]).any()


def test_without_grad_and_with_transposed_hidden(device):
    h, w, b, target = make_inputs(13, 24, 50, torch.float32, device, 0)
    expected = reference.fused_linear_cross_entropy(h.double(), w.double(), target, b.double(), softcap=4.0)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(h, w, target, b, softcap=4.0, chunk_size=4)
    assert_close(loss, expected, torch.float32, "no-grad loss")
    ht = h.t().contiguous().t().requires_grad_(True)  # column-major hidden
    loss = fused_linear_cross_entropy(ht, w, target, b, softcap=4.0, chunk_size=4)
    loss.backward()
    h64 = h.double().requires_grad_(True)
    reference.fused_linear_cross_entropy(h64, w.double(), target, b.double(), softcap=4.0).backward()
    assert_close(loss, expected, torch.float32, "loss")
    assert_close(ht.grad, h64.grad, torch.float32, "dhidden")


def test_second_backward_is_refused(device):
    h, w, _, target = make_inputs(5, 8, 10, torch.float32, device, 0, with_bias=False)
    h.requires_grad_(True)
    loss = fused_linear_cross_entropy(h, w, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()


def test_chunk_size_rule():
    cpu = torch.device("cpu")
    # Llama 3 vocabulary in bf16: 256.5 KB of logits per token; chunks under a quarter of the weight, equal.
    assert choose_chunk_size(8192, 128256, 4096, 2, cpu) == 1024  # hidden / 4: a quarter of the weight's bytes
    assert choose_chunk_size(32768, 128256, 4096, 2, cpu) == 1024
    assert choose_chunk_size(100, 128256, 4096, 2, cpu) == 100
    assert choose_chunk_size(5000, 262144, 4096, 4, cpu) == 1008  # 1024 fit (1 GiB): 5 chunks, 1000 aligned to 16
    assert choose_chunk_size(1000, 262144, 4096, 4, cpu) == 1000  # one chunk: the tokens, whatever their alignment
    assert choose_chunk_size(2050, 262144, 4096, 4, cpu) == 688  # 3 chunks of 684 rounded up: 688, 688, 674
    assert choose_chunk_size(8192, 128256, 2048, 2, cpu) == 1024  # hidden / 4 is 512: the 1024-token floor
    assert choose_chunk_size(8192, 128256, 64, 2, cpu) == 1024
    assert max_chunk_tokens(128256, 64, 2, min_tokens=1) == 16  # hidden / 4 alone
    assert choose_chunk_size(3, 2**31, 4096, 4, cpu) == 1  # never below one token


def test_bad_inputs(device):
    h, w, b, target = make_inputs(4, 8, 10, torch.float32, device, 0)
    cases = [
        (ValueError, "non-empty 2-D", dict(hidden=h[None])),
        (ValueError, r"\(vocabulary, 8\)", dict(weight=w[:, :7])),
        (TypeError, "cast one to the other", dict(weight=w.half())),
        (ValueError, "bias has shape", dict(bias=b[:9])),
        (TypeError, "bias has dtype", dict(bias=b.half())),
        (ValueError, "4 tokens", dict(target=target[:3])),
        (ValueError, "class_weight has shape", dict(class_weight=torch.ones(9, device=device))),
        (ValueError, "chunk_size", dict(chunk_size=0)),
        (ValueError, "reduction", dict(reduction="avg")),
        (ValueError, "reduction='mean'", dict(num_items_in_batch=3, reduction="none")),
        (TypeError, "use_token_scaling|token_scaling must be True or False", dict(use_token_scaling="yes")),
        (TypeError, "return_predicted_tokens must be True or False", dict(return_predicted_tokens=None)),
    ]
    for error, message, changes in cases:
        args = {"hidden": h, "weight": w, "target": target, "bias": b, **changes}
        with pytest.raises(error, match=message):
            fused_linear_cross_entropy(
                args.pop("hidden"), args.pop("weight"), args.pop("target"), args.pop("bias"), **args
            )


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"label_smoothing": 0.1, "lse_square_scale": 1e-4, "softcap": 30.0}])
def test_gpu_real_size(options):
    """4096 tokens x 4096 hidden x Llama 3's vocabulary in bf16, against a float32 reference."""
    torch.manual_seed(0)
    h, w, _, target = make_inputs(4096, 4096, 128256, torch.bfloat16, "cuda", 0, with_bias=False)
    hl, wl = leaves(h, w)
    loss = fused_linear_cross_entropy(hl, wl, target, **options)
    loss.backward()
    h32, w32 = leaves(h, w, dtype=torch.float32)
    ref = reference.fused_linear_cross_entropy(h32, w32, target, **options)
    ref.backward()
    assert_close(loss, ref, torch.bfloat16, "loss")
    assert_close(hl.grad, h32.grad, torch.bfloat16, "dhidden")
    assert_close(wl.grad, w32.grad, torch.bfloat16, "dweight")


@pytest.mark.gpu
def test_gpu_token_scaling_and_token_accuracy():
    """4096 tokens x 4096 hidden x Llama 3's vocabulary in bf16 with token scaling and the token accuracy,
    against a float32 reference; the argmax may differ from float32's only where bf16 rounding ties the top two."""
    h, w, _, target = make_inputs(4096, 4096, 128256, torch.bfloat16, "cuda", 0, with_bias=False)
    flags = {"use_token_scaling": True, "return_token_accuracy": True, "return_predicted_tokens": True}
    hl, wl = leaves(h, w)
    out = fused_linear_cross_entropy(hl, wl, target, **flags)
    out.loss.backward()
    h32, w32 = leaves(h, w, dtype=torch.float32)
    ref = reference.fused_linear_cross_entropy(h32, w32, target, **flags)
    ref.loss.backward()
    assert_close(out.loss, ref.loss, torch.bfloat16, "loss")
    assert_close(hl.grad, h32.grad, torch.bfloat16, "dhidden")
    assert_close(wl.grad, w32.grad, torch.bfloat16, "dweight")
    # Among 128256 random logits the top two often lie within a bf16 rounding of each other (2.4% of the
    # tokens on an H200), so the check is on values: every predicted token's float32 logit is within two bf16
    # roundings (2^-7 relative) of the float32 maximum.
    logits = h32.detach() @ w32.detach().T
    top = logits.max(dim=-1).values
    predicted = logits.gather(1, out.predicted_tokens.clamp_min(0)[:, None]).squeeze(1)
    kept = out.predicted_tokens >= 0
    assert torch.equal(kept, ref.predicted_tokens >= 0)
    gap = (top - predicted)[kept] / top[kept].abs()
    assert gap.max().item() <= 2**-7, f"a predicted token's logit is {gap.max().item():.2e} under the maximum"
    assert abs(out.token_accuracy.item() - ref.token_accuracy.item()) < 1e-2


@pytest.mark.gpu
def test_gpu_memory_flat_in_tokens():
    """Peak memory beyond the inputs: the gradients and one chunk of logits, whatever the token count."""
    hidden, vocab = 4096, 128256
    w = (torch.randn(vocab, hidden, device="cuda") / 64).to(torch.bfloat16).requires_grad_(True)
    peaks = []
    for tokens in (8192, 16384):
        h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        target = torch.randint(0, vocab, (tokens,), device="cuda")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fused_linear_cross_entropy(h, w, target).backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - before)
        h.grad = w.grad = None
    # float32 weight-gradient accumulator + its bf16 cast + one chunk of logits (1 GiB at most) + dhidden.
    bound = vocab * hidden * (4 + 2) + 2**30 + 16384 * hidden * 2 + 2**28
    assert peaks[1] < bound, f"peak {peaks[1] / 2**30:.2f} GiB above {bound / 2**30:.2f} GiB"
    growth = peaks[1] - peaks[0] - 8192 * hidden * 2  # dhidden grows with the tokens, nothing else may
    assert growth < 2**27, f"peaks {[p / 2**30 for p in peaks]} GiB grow with tokens"


@pytest.mark.gpu
def test_gpu_peak_memory_is_the_gradients_and_one_stripe():
    """At the loss issue's shape the chunks' logits live in the weight gradient: beyond the inputs, the step holds
    the two gradients, one 16 MiB tile of the borrowed rows' filling and the per-token rows."""
    tokens, hidden, vocab = 8192, 4096, 128256
    h, w, _, target = make_inputs(tokens, hidden, vocab, torch.bfloat16, "cuda", 0, with_bias=False)
    hl, wl = leaves(h, w)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fused_linear_cross_entropy(hl, wl, target).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    bound = vocab * hidden * 2 + tokens * hidden * 2 + flce_module.STRIPE_TILE_BYTES + 2**20
    assert peak <= bound, f"peak {peak / 1e6:.1f} MB above {bound / 1e6:.1f} MB"
    h32, w32 = leaves(h, w, dtype=torch.float32)
    reference.fused_linear_cross_entropy(h32, w32, target).backward()
    assert_close(hl.grad, h32.grad, torch.bfloat16, "dhidden")
    assert_close(wl.grad, w32.grad, torch.bfloat16, "dweight")


@pytest.mark.gpu
def test_gpu_chunk_rule_counts_cached_memory_as_free():
    """Memory the caching allocator holds for no tensor counts as free, as torch's own counters say."""
    cuda = torch.device("cuda")
    cached = torch.empty(2**32, dtype=torch.uint8, device=cuda)
    del cached  # 4 GiB now reserved by the allocator, allocated to nothing
    free, _ = torch.cuda.mem_get_info(cuda)
    free += torch.cuda.memory_reserved(cuda) - torch.cuda.memory_allocated(cuda)
    row_bytes = 2**29  # the cached 4 GiB alone is one row of the rule's cap, free / 8 / row_bytes
    expected_rows = free // flce_module.FREE_MEMORY_FRACTION // row_bytes
    assert expected_rows >= 3
    assert flce_module.even_chunk_size(expected_rows, 10**6, row_bytes, cuda) == expected_rows
    assert flce_module.even_chunk_size(expected_rows + 1, 10**6, row_bytes, cuda) < expected_rows
