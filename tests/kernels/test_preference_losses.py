"""Fused linear DPO, CPO, SimPO, ORPO and KTO against their float64 references (full logits, formulas)."""

import pytest
import torch

from tests.kernels.helpers import DTYPES, IGNORE, assert_close, leaves, make_inputs
from tigon.kernels import functional, modules, reference
from tigon.kernels.ops import fused_linear_preference

# A loss on summed log-probs multiplies each token's logit rounding (bf16: 2^-8 relative) by beta times the
# sequence length in its gradient factor, so the default betas are TRL's (0.1 on summed log-probs); larger
# ones are tested in fp32 and fp16.
LOSSES = {
    "dpo": (functional.fused_linear_dpo, reference.fused_linear_dpo, {"beta": 0.1, "ref": "hidden"}),
    "cpo": (functional.fused_linear_cpo, reference.fused_linear_cpo, {"beta": 0.1}),
    "simpo": (functional.fused_linear_simpo, reference.fused_linear_simpo, {"beta": 2.0, "gamma": 0.5}),
    "orpo": (functional.fused_linear_orpo, reference.fused_linear_orpo, {"beta": 0.5}),
    "kto": (functional.fused_linear_kto, reference.fused_linear_kto, {"beta": 0.1, "ref": "hidden", "kl": 0.2}),
}
OPTIONS = {
    "dpo": [
        {"beta": 0.05, "label_smoothing": 0.2, "ref": "logps"},
        {"beta": 1.0, "ref": "hidden", "ignore_index": 3},
    ],
    "cpo": [{"beta": 0.2, "alpha": 0.0, "label_smoothing": 0.1}, {"beta": 1.0, "alpha": 2.0}],
    "simpo": [{"beta": 2.5, "gamma": 1.2, "label_smoothing": 0.1, "alpha": 1.0}],
    "orpo": [{"beta": 1.0, "ignore_index": 3}],
    "kto": [
        {"beta": 0.3, "ref": "logps", "kl": "computed", "desirable_weight": 1.5, "undesirable_weight": 0.7},
        {"beta": 1.0, "ref": "hidden", "kl": "computed-ref-hidden", "desirable": "all"},
    ],
}
OP_ONLY = ("chunk_size", "accumulate_in_fp32", "check_targets")


def resolve(name, options, h, w, b, target, device):
    """Turn the test's shorthand ("ref": "hidden", "kl": "computed", ...) into tensors, in the inputs' dtype."""
    options = dict(options)
    sequences, tokens, hidden = h.shape
    ref = options.pop("ref", None)
    if ref == "hidden" or options.get("kl") == "computed-ref-hidden":
        options["ref_hidden"] = torch.randn(sequences, tokens, hidden, device=device).to(h.dtype)
        options["ref_weight"] = (w.detach().float() + 0.3 * torch.randn_like(w, dtype=torch.float32)).to(h.dtype)
        options["ref_bias"] = None if b is None else (torch.randn_like(b, dtype=torch.float32) * 0.2).to(h.dtype)
    elif ref == "logps":
        options["ref_logps"] = torch.randn(sequences, device=device) * 3 - 10
    kl = options.get("kl")
    if kl in ("computed", "computed-ref-hidden"):
        options.pop("kl")
        options["kl_hidden"] = torch.randn(sequences, tokens, hidden, device=device).to(h.dtype)
        options["kl_target"] = target.roll(1, 0)
        if kl == "computed":
            options["ref_kl_logps"] = torch.randn(sequences, device=device) * 3 - 14
        else:
            options["ref_kl_hidden"] = torch.randn(sequences, tokens, hidden, device=device).to(h.dtype)
    if name == "kto":
        flags = options.pop("desirable", "mixed")
        options["desirable"] = torch.ones(sequences, dtype=torch.bool, device=device)
        if flags == "mixed":
            options["desirable"][1::3] = False
    return options


def as_reference(options):
    """The reference's options: float64 tensors, without the fused op's steering options."""
    return {
        k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
        for k, v in options.items()
        if k not in OP_ONLY
    }


def run_case(
    name, pairs, tokens, hidden, vocab, dtype, device, seed=0, with_bias=True, frozen=False, grad_scale=1.0, **options
):
    """Fused op vs the float64 reference: loss, every metric, and the hidden, weight and bias gradients."""
    fused, ref_fn, defaults = LOSSES[name]
    options = {**defaults, **options}
    ignore_index = options.get("ignore_index", IGNORE)
    h, w, b, target = make_inputs(2 * pairs, tokens, hidden, vocab, dtype, device, seed, with_bias, ignore_index)
    options = resolve(name, options, h, w, b, target, device)
    hl, wl, bl = leaves(h, w, b)
    h64, w64, b64 = leaves(h, w, b, dtype=torch.float64)
    if frozen:
        wl.requires_grad_(False)
        w64.requires_grad_(False)
    loss, metrics = fused(hl, wl, target, bias=bl, **options)
    ref_loss, ref_metrics = ref_fn(h64, w64, target, bias=b64, **as_reference(options))
    (loss * grad_scale).backward()
    (ref_loss * grad_scale).backward()
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert_close(loss, ref_loss, dtype, f"{name} loss")
    assert set(metrics) == set(ref_metrics)
    for key, value in metrics.items():
        assert not value.requires_grad, f"{key} is not detached"
        assert_close(value, ref_metrics[key], dtype, f"{name} {key}")
    assert_close(hl.grad, h64.grad, dtype, f"{name} dhidden")
    if frozen:
        assert wl.grad is None
    else:
        assert wl.grad.dtype == dtype
        assert_close(wl.grad, w64.grad, dtype, f"{name} dweight")
    if with_bias:
        assert_close(bl.grad, b64.grad, dtype, f"{name} dbias")
    return loss, metrics


@pytest.mark.parametrize("vocab,dtype", [(1, torch.float32)] + [(v, d) for v in (7, 1003) for d in DTYPES])
@pytest.mark.parametrize("name", list(LOSSES))
def test_matches_reference(name, vocab, dtype, device):
    run_case(name, 2, 7, 16, vocab, dtype, device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "name,index", [(name, index) for name, variants in OPTIONS.items() for index in range(len(variants))]
)
def test_options(name, index, dtype, device):
    run_case(name, 3, 9, 24, 61, dtype, device, seed=index + 1, chunk_size=2, **OPTIONS[name][index])


DPO_TYPES = {
    "sigmoid": {},
    "hinge": {},
    "ipo": {},
    "exo_pair": {"label_smoothing": 1e-3},
    "nca_pair": {},
    "robust": {"label_smoothing": 0.1},
    "bco_pair": {},
    "sppo_hard": {},
    "apo_zero": {},
    "apo_down": {},
    "discopop": {"discopop_tau": 0.5},
    "sigmoid_norm": {"beta": 2.0},
    "aot": {},
    "aot_unpaired": {"label_smoothing": 0.1},
    "sft": {},
}


@pytest.mark.parametrize("loss_type", list(DPO_TYPES))
def test_dpo_loss_types(loss_type, device):
    """Each of TRL's DPO loss types, in one chunk (the combined cases below run several)."""
    run_case("dpo", 2, 5, 16, 31, torch.float32, device, seed=5, loss_type=loss_type, **DPO_TYPES[loss_type])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "options",
    [
        {"loss_type": ["sigmoid", "ipo", "sft"], "loss_weights": [0.5, 2.0, 0.3], "ref": "logps"},
        {"loss_type": "apo_zero", "average_log_prob": True, "rpo_alpha": 0.7, "beta": 1.0},
        {"loss_type": "bco_pair", "average_log_prob": True, "beta": 2.0},
        {"loss_type": ["aot", "sigmoid", "sft"], "loss_weights": [1.0, 0.5, 0.2], "beta": 2.0},
        {"loss_type": "aot_unpaired", "average_log_prob": True, "rpo_alpha": 0.5, "beta": 2.0, "ref": "logps"},
    ],
)
def test_dpo_combined_types_average_log_prob_and_rpo(options, dtype, device):
    run_case("dpo", 3, 9, 24, 61, dtype, device, seed=6, chunk_size=2, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "options",
    [
        {"average_log_prob": True, "beta": 1.0, "ref": "logps", "kl": "computed"},
        {"loss_type": "apo_zero_unpaired", "kl": None, "ref": "logps", "desirable_weight": 1.3},
        {"loss_type": "apo_zero_unpaired", "kl": None, "average_log_prob": True, "beta": 2.0},
    ],
)
def test_kto_average_log_prob_and_apo_zero_unpaired(options, dtype, device):
    run_case("kto", 3, 9, 24, 61, dtype, device, seed=9, chunk_size=2, **options)


def test_kto_bad_options(device):
    h, w, _, target = make_inputs(3, 5, 8, 33, torch.float32, device, 0, with_bias=False)
    desirable = torch.tensor([True, False, True], device=device)
    ref = torch.zeros(3, device=device)
    with pytest.raises(ValueError, match="is not one of"):
        functional.fused_linear_kto(h, w, target, desirable, ref_logps=ref, kl=0.0, loss_type="bco")
    with pytest.raises(ValueError, match="no reference point"):
        functional.fused_linear_kto(h, w, target, desirable, ref_logps=ref, kl=0.0, loss_type="apo_zero_unpaired")


@pytest.mark.parametrize(("dtype", "chunk_size"), [(torch.float32, 1), (torch.bfloat16, 2)])
def test_orpo_nll_target(dtype, chunk_size, device):
    """The NLL term against targets of its own: tokens where both, either or neither target counts."""
    torch.manual_seed(10)
    nll_target = torch.randint(0, 61, (6, 9), device=device)
    nll_target[:, -2:] = IGNORE
    nll_target[1] = IGNORE  # a chosen sequence with no NLL targets
    loss, metrics = run_case("orpo", 3, 9, 24, 61, dtype, device, seed=11, chunk_size=chunk_size, nll_target=nll_target)
    h, w, _, target = make_inputs(6, 9, 24, 61, dtype, device, 11)
    _, plain_metrics = functional.fused_linear_orpo(h, w, target, beta=0.5)
    assert metrics["nll_loss"] != plain_metrics["nll_loss"]


def test_dpo_bad_options(device):
    h, w, _, target = make_inputs(4, 5, 8, 33, torch.float32, device, 0, with_bias=False)
    ref = torch.zeros(4, device=device)
    cases = [
        ({"loss_type": "kto_pair"}, "is not one of"),
        ({"loss_type": ["sigmoid", "ipo"], "loss_weights": [1.0]}, "one per type"),
        ({"loss_type": "exo_pair"}, "0 < label_smoothing < 1"),
        ({"loss_type": "robust", "label_smoothing": 0.5}, "0 <= label_smoothing < 0.5"),
        ({"loss_type": "discopop", "discopop_tau": 0.0}, "discopop_tau"),
        ({"rpo_alpha": -1.0}, "rpo_alpha"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            functional.fused_linear_dpo(h, w, target, ref_logps=ref, **options)
    with pytest.raises(ValueError, match=r"nll_target has shape \(4, 4\)"):
        functional.fused_linear_orpo(h, w, target, nll_target=target[:, :4])


@pytest.mark.parametrize("name", list(LOSSES))
def test_odd_shapes_chunks_and_no_bias(name, device):
    """Odd sequence length, one pair (or sequence) per chunk, no bias, fp32 weight-gradient accumulation."""
    run_case(name, 2, 11, 8, 127, torch.float32, device, seed=7, with_bias=False, chunk_size=1, accumulate_in_fp32=True)
    run_case(name, 1, 1, 4, 33, torch.float16, device, seed=8)


@pytest.mark.parametrize("name", list(LOSSES))
def test_chunked_equals_unchunked(name, device):
    results = []
    for chunk_size in (None, 1):
        loss, metrics = run_case(name, 3, 5, 16, 50, torch.float32, device, seed=3, chunk_size=chunk_size)
        results.append((loss, metrics))
    for loss, metrics in results[1:]:
        assert_close(loss, results[0][0], torch.float32, "loss chunked vs unchunked", scale=0.1)
        for key, value in metrics.items():
            assert_close(value, results[0][1][key], torch.float32, f"{key} chunked vs unchunked", scale=0.1)


@pytest.mark.parametrize(
    ("n_sequences", "seq_len", "group", "groups"),
    [(32, 512, 2, 2), (16, 512, 1, 4), (8, 4096, 2, 1), (4, 100, 2, 2)],
)
def test_a_chunk_holds_whole_groups_up_to_half_the_weight_in_logits(n_sequences, seq_len, group, groups):
    """At hidden 4096 and vocabulary 128256 a chunk takes up to 2048 tokens (hidden / 2): 2 pairs of 512, 4 single
    sequences of 512; a longer pair still gets a chunk of its own; a small batch is one chunk."""
    got = fused_linear_preference.groups_per_chunk(n_sequences, seq_len, group, 128256, 4096, 2, torch.device("cpu"))
    assert got == groups


@pytest.mark.parametrize("name", list(LOSSES))
def test_frozen_head_and_incoming_gradient(name, device):
    run_case(name, 2, 6, 16, 40, torch.float32, device, seed=4, frozen=True, grad_scale=2.5)


def test_frozen_head_skips_the_weight_gradient_matmul(device, monkeypatch):
    calls = []
    monkeypatch.setattr("tigon.kernels.ops.fused_linear_preference.accumulate_product", lambda *a, **k: calls.append(1))
    h, w, _, target = make_inputs(4, 5, 8, 33, torch.float32, device, 0, with_bias=False)
    h.requires_grad_(True)
    loss, _ = functional.fused_linear_cpo(h, w, target)
    loss.backward()
    assert calls == [] and h.grad is not None


@pytest.mark.parametrize("name", list(LOSSES))
def test_sequences_without_targets(name, device):
    """A chosen and a rejected sequence with every target ignored: finite loss and gradients, as the reference."""
    fused, ref_fn, defaults = LOSSES[name]
    h, w, b, target = make_inputs(6, 5, 16, 23, torch.float32, device, 5)
    target[0] = IGNORE
    target[4] = IGNORE
    options = resolve(name, defaults, h, w, b, target, device)
    hl, wl, bl = leaves(h, w, b)
    h64, w64, b64 = leaves(h, w, b, dtype=torch.float64)
    loss, metrics = fused(hl, wl, target, bias=bl, **options)
    ref_loss, ref_metrics = ref_fn(h64, w64, target, bias=b64, **as_reference(options))
    loss.backward()
    ref_loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(m).all() for m in metrics.values())
    assert_close(loss, ref_loss, torch.float32, "loss")
    for key, value in metrics.items():
        assert_close(value, ref_metrics[key], torch.float32, key)
    for ours, theirs, what in ((hl, h64, "dhidden"), (wl, w64, "dweight"), (bl, b64, "dbias")):
        assert_close(ours.grad, theirs.grad, torch.float32, what)
    assert torch.equal(hl.grad[0], torch.zeros_like(hl.grad[0]))  # no targets: no gradient into that sequence


@pytest.mark.parametrize("name", list(LOSSES))
def test_all_targets_ignored(name, device):
    fused, _, defaults = LOSSES[name]
    h, w, b, _ = make_inputs(4, 5, 8, 11, torch.float32, device, 6)
    target = torch.full((4, 5), IGNORE, device=device)
    options = resolve(name, defaults, h, w, b, target, device)
    hl, wl, bl = leaves(h, w, b)
    loss, metrics = fused(hl, wl, target, bias=bl, **options)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(m).all() for m in metrics.values())
    for grad in (hl.grad, wl.grad, bl.grad):
        assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("name", ["dpo", "kto"])
def test_reference_logps_passed_equal_computed(name, device):
    """Reference log-probs computed in the chunked pass equal those computed first and passed in."""
    fused, _, defaults = LOSSES[name]
    h, w, b, target = make_inputs(4, 6, 16, 45, torch.float32, device, 9)
    options = resolve(name, defaults, h, w, b, target, device)
    computed, computed_metrics = fused(h, w, target, bias=b, chunk_size=1, **options)
    ref_logps = functional.sequence_logps(
        options.pop("ref_hidden"), options.pop("ref_weight"), target, options.pop("ref_bias")
    )
    expected, _ = reference.sequence_logps(h.double(), w.double(), target, b.double())
    assert_close(functional.sequence_logps(h, w, target, b, chunk_size=3), expected, torch.float32, "sequence_logps")
    passed, passed_metrics = fused(h, w, target, bias=b, ref_logps=ref_logps, **options)  # float64 is accepted
    assert_close(passed, computed, torch.float32, "loss", scale=0.1)
    for key, value in passed_metrics.items():
        assert_close(value, computed_metrics[key], torch.float32, key, scale=0.1)


@pytest.mark.parametrize("name", list(LOSSES))
def test_modules_match_functional(name, device):
    classes = {
        "dpo": modules.FusedLinearDPOLoss,
        "cpo": modules.FusedLinearCPOLoss,
        "simpo": modules.FusedLinearSimPOLoss,
        "orpo": modules.FusedLinearORPOLoss,
        "kto": modules.FusedLinearKTOLoss,
    }
    fused, _, defaults = LOSSES[name]
    h, w, b, target = make_inputs(4, 5, 8, 19, torch.float32, device, 2)
    options = resolve(name, defaults, h, w, b, target, device)
    expected, _ = fused(h, w, target, bias=b, **options)
    module = classes[name](**{key: options.pop(key) for key in ("beta", "gamma") if key in options})
    if name == "kto":
        loss, _ = module(h, w, target, options.pop("desirable"), b, **options)
    else:
        loss, _ = module(h, w, target, b, **options)
    assert torch.equal(loss, expected)
    assert f"beta={defaults['beta']}" in repr(module)


@pytest.mark.parametrize("name", list(LOSSES))
def test_reference_fallback(name, device, monkeypatch):
    """Where no Triton kernel can run (CPU without the interpreter), the op returns the reference's result."""
    fused, ref_fn, defaults = LOSSES[name]
    monkeypatch.setattr(f"tigon.kernels.ops.{name}.use_triton", lambda op, tensor: False)
    h, w, b, target = make_inputs(4, 5, 8, 19, torch.float32, device, 3)
    options = resolve(name, defaults, h, w, b, target, device)
    loss, metrics = fused(h, w, target, bias=b, **options)
    expected, expected_metrics = ref_fn(h, w, target, bias=b, **options)
    assert torch.equal(loss, expected) and metrics.keys() == expected_metrics.keys()


def test_without_grad_and_second_backward(device):
    h, w, b, target = make_inputs(4, 5, 8, 19, torch.float32, device, 1)
    ref_logps = torch.randn(4, device=device)
    expected, _ = reference.fused_linear_dpo(h.double(), w.double(), target, b.double(), ref_logps=ref_logps.double())
    with torch.no_grad():
        loss, _ = functional.fused_linear_dpo(h, w, target, b, ref_logps=ref_logps)
    assert_close(loss, expected, torch.float32, "no-grad loss")
    hl = h.clone().requires_grad_(True)
    loss, _ = functional.fused_linear_dpo(hl, w, target, b, ref_logps=ref_logps)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per forward"):
        loss.backward()


def test_bad_inputs(device):
    h, w, b, target = make_inputs(4, 5, 8, 10, torch.float32, device, 0)
    ref = torch.zeros(4, device=device)
    flags = torch.tensor([True, False, True, False], device=device)
    bad_target = target.clone()
    bad_target[1, 2] = 10
    dpo, kto, orpo = functional.fused_linear_dpo, functional.fused_linear_kto, functional.fused_linear_orpo
    cases = [
        (orpo, (h[:3], w, target[:3]), {}, ValueError, "count must be even"),
        (orpo, (h[0], w, target[0]), {}, ValueError, "3-D"),
        (orpo, (h, w[:, :7], target), {}, ValueError, r"\(vocabulary, 8\)"),
        (orpo, (h, w.half(), target), {}, TypeError, "cast one to the other"),
        (orpo, (h, w, target, b[:9]), {}, ValueError, "bias has shape"),
        (orpo, (h, w, target[:, :4]), {}, ValueError, r"must be \(4, 5\)"),
        (orpo, (h, w, target.float()), {}, TypeError, "int64 or int32"),
        (orpo, (h, w, bad_target), {}, ValueError, r"target\[7\] = 10 is out of range"),
        (orpo, (h, w, target), {"beta": 0.0}, ValueError, "beta=0.0"),
        (orpo, (h, w, target), {"chunk_size": 0}, ValueError, "chunk_size"),
        (dpo, (h, w, target), {}, ValueError, "needs the reference model's log-probs"),
        (dpo, (h, w, target), {"ref_logps": ref[:3]}, ValueError, r"must be \(4,\)"),
        (dpo, (h, w, target), {"ref_logps": ref, "ref_hidden": h, "ref_weight": w}, ValueError, "not both"),
        (dpo, (h, w, target), {"ref_hidden": h}, ValueError, "both ref_hidden and ref_weight"),
        (dpo, (h, w, target), {"ref_hidden": h.half(), "ref_weight": w.half()}, TypeError, "share one logits"),
        (dpo, (h, w, target), {"ref_logps": ref, "label_smoothing": 0.7}, ValueError, "label_smoothing"),
        (kto, (h, w, target, flags), {"ref_logps": ref}, ValueError, "reference point"),
        (kto, (h, w, target, flags.long()), {"ref_logps": ref, "kl": 0.0}, TypeError, "bool tensor"),
        (kto, (h, w, target, flags), {"ref_logps": ref, "kl": torch.zeros(2)}, ValueError, "one-element"),
        (kto, (h, w, target, flags), {"ref_logps": ref, "kl": 0.0, "kl_hidden": h}, ValueError, "not both"),
        (
            kto,
            (h, w, target, flags),
            {"ref_logps": ref, "kl_hidden": h, "kl_target": target},
            ValueError,
            "exactly one of ref_kl_logps or ref_kl_hidden",
        ),
    ]
    for fn, args, kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            fn(*args, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(LOSSES))
def test_gpu_real_size(name):
    """8 pairs (16 sequences) x 512 tokens x 4096 hidden x Llama 3's vocabulary in bf16, against float32."""
    fused, ref_fn, defaults = LOSSES[name]
    h, w, _, target = make_inputs(16, 512, 4096, 128256, torch.bfloat16, "cuda", 0, with_bias=False)
    h = h / 8
    options = resolve(name, defaults, h, w, None, target, "cuda")
    hl, wl = leaves(h, w)
    loss, metrics = fused(hl, wl, target, **options)
    loss.backward()
    h32, w32 = leaves(h, w, dtype=torch.float32)
    ref_options = {
        k: (v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in options.items()
    }
    ref_loss, ref_metrics = ref_fn(h32, w32, target, **ref_options)
    ref_loss.backward()
    assert_close(loss, ref_loss, torch.bfloat16, "loss")
    for key, value in metrics.items():
        assert_close(value, ref_metrics[key], torch.bfloat16, key)
    assert_close(hl.grad, h32.grad, torch.bfloat16, "dhidden")
    assert_close(wl.grad, w32.grad, torch.bfloat16, "dweight")


@pytest.mark.gpu
def test_gpu_dpo_memory():
    """Peak memory beyond the inputs: the gradients, one chunk of logits, and small per-chunk buffers."""
    pairs, tokens, hidden, vocab = 16, 512, 4096, 128256
    h, w, _, target = make_inputs(2 * pairs, tokens, hidden, vocab, torch.bfloat16, "cuda", 0, with_bias=False)
    hl, wl = leaves(h / 8, w)
    ref_hidden = (torch.randn_like(h) / 8).to(torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss, _ = functional.fused_linear_dpo(hl, wl, target, ref_hidden=ref_hidden, ref_weight=w)
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    chunk_logits = 2 * tokens * vocab * 2  # one pair per chunk at this shape
    bound = 2 * vocab * hidden * 2 + hl.numel() * 2 * 2 + chunk_logits + 2**28
    assert peak < bound, f"peak {peak / 2**30:.2f} GiB above {bound / 2**30:.2f} GiB"
