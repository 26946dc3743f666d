"""The transformers 5.x MoE experts (3-D gate_up_proj/down_proj parameters) swapped to GatedExperts, and
the grouped experts op (`moe_experts`) GatedExperts runs under transformers' "grouped_mm" implementation.

This file is not part of the compat run (tests/compat runs the patching tests against transformers 4.x,
which keeps one MLP module per expert and has none of this), so nothing here is skipped there.
"""

import copy

import pytest
import torch

from tests.kernels.families import FAMILY_CASES, assert_lora_adapters_kept, assert_same_training_step, tiny
from tests.kernels.families import moe_experts as transformers_experts
from tests.kernels.helpers import DTYPES, as_float64, assert_close, leaf, saved_bytes
from tigon.kernels import modules, reference
from tigon.kernels.ops import moe_experts as op
from tigon.kernels.patching import apply

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_experts_follow_the_models_experts_implementation(implementation, restore_rope):
    """GatedExperts runs transformers' loop ("eager") or its function for the implementation, with tigon's
    activation; a later `set_experts_implementation` reaches the swapped module (it shares the config)."""
    baseline = tiny("qwen3_moe", **FAMILY_CASES["qwen3_moe"].overrides)
    baseline.set_experts_implementation(implementation)
    patched = copy.deepcopy(baseline)
    assert apply(patched).applied["gated_experts"] == 1
    assert_same_training_step(baseline, patched, torch.randint(0, 131, (2, 9)))
    for model in (baseline, patched):
        model.zero_grad()
        model.set_experts_implementation("grouped_mm")
    assert patched.model.layers[0].mlp.experts.config._experts_implementation == "grouped_mm"
    assert_same_training_step(baseline, patched, torch.randint(0, 131, (2, 9)))


def test_lora_adapters_stay_on_the_experts_parameters(restore_rope):
    """PEFT LoRA on Mixtral's 3-D expert parameters (`target_parameters`) survives the swap to GatedExperts."""
    targets = dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    assert_lora_adapters_kept("mixtral", targets)


def routing(tokens: int, experts: int, top_k: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_k_index, top_k_weights): top_k distinct experts a token, none of them the last expert (an expert
    with no token must get zero gradients)."""
    index = torch.stack([torch.randperm(experts - 1)[:top_k] for _ in range(tokens)]).to(device)
    return index, torch.rand(tokens, top_k, device=device)


# (tokens, hidden, experts, intermediate, top_k), dtype. In bf16 and fp16 the output has five roundings in a
# chain (gate_up, the activation, the expert output, its weighted copy, the sum), so the error is about 6e-3
# there, transformers' own grouped_mm path included, hence twice the dtype's tolerance. The one-token case is
# checked in fp32 only: its routing-weight gradient, two dot products that may cancel, is as far off in
# transformers' bf16 path (up to 5e-2 over random seeds).
OP_CASES = [((1, 16, 3, 8, 2), torch.float32)] + [
    (shape, dtype) for shape in [(13, 48, 5, 40, 2), (37, 32, 9, 24, 4)] for dtype in DTYPES
]


@pytest.mark.parametrize("activation", op.ACTIVATIONS)
@pytest.mark.parametrize(("shape", "dtype"), OP_CASES, ids=str)
def test_moe_experts_match_reference(shape, dtype, activation, device):
    """Output and the gradients of all four differentiable inputs against transformers' loop in float64."""
    tokens, hidden, experts, inner, top_k = shape
    torch.manual_seed(sum(shape) + len(activation))
    index, weights = routing(tokens, experts, top_k, device)
    inputs = [
        leaf(torch.randn(tokens, hidden, device=device), dtype),
        leaf(torch.randn(experts, 2 * inner, hidden, device=device) / hidden**0.5, dtype),
        leaf(torch.randn(experts, hidden, inner, device=device) / inner**0.5, dtype),
        leaf(weights, dtype),
    ]
    out = op.moe_experts(*inputs[:3], index, inputs[3], activation)
    grad = torch.randn_like(out)
    out.backward(grad)
    exact = [as_float64(tensor) for tensor in inputs]
    expected = reference.moe_experts(*exact[:3], index, exact[3], activation)
    expected.backward(grad.double())
    assert out.dtype == dtype
    scale = 1.0 if dtype == torch.float32 else 2.0
    assert_close(out, expected, dtype, f"{activation} output", scale)
    names = ("hidden_states", "gate_up_proj", "down_proj", "top_k_weights")
    for name, ours, theirs in zip(names, inputs, exact, strict=True):
        assert_close(ours.grad, theirs.grad, dtype, f"{activation} grad of {name}", scale)
    assert not inputs[1].grad[-1].any() and not inputs[2].grad[-1].any(), "an expert with no token has a gradient"


@pytest.mark.parametrize("frozen", ["hidden_states", "experts", "top_k_weights"])
def test_moe_experts_skip_the_gradients_nobody_needs(frozen, device):
    """With some inputs frozen (LoRA elsewhere, frozen experts), the others' gradients still match."""
    torch.manual_seed(10)
    theirs, config = transformers_experts("qwen3_moe", "grouped_mm")
    theirs = theirs.to(device)
    ours = modules.GatedExperts.from_module(copy.deepcopy(theirs), config)
    index, weights = routing(11, 5, 2, device)
    hidden = torch.randn(11, 48, device=device)
    results = []
    for experts in (theirs, ours):
        x, w = hidden.clone().requires_grad_(frozen != "hidden_states"), weights.clone()
        w.requires_grad_(frozen != "top_k_weights")
        for parameter in experts.parameters():
            parameter.requires_grad_(frozen != "experts")
        experts(x, index, w).square().sum().backward()
        results.append([x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad])
    for name, got, expected in zip(("hidden", "weights", "gate_up_proj", "down_proj"), *reversed(results), strict=True):
        assert (got is None) == (expected is None), name
        if expected is not None:
            assert_close(got, expected, torch.float32, f"grad of {name}")


def test_moe_experts_keep_only_gate_up_for_backward(device):
    """Per token-expert pair the op keeps gate_up (2I values) and its int64 sort position, beyond its inputs
    and parameters; transformers' grouped_mm also keeps the gathered input (H), the activation (I) and the
    expert output (H). At Qwen3-30B-A3B's sizes that is 24 KiB a token instead of 100 KiB, in each layer."""
    torch.manual_seed(11)
    tokens, top_k = 24, 2
    theirs, config = transformers_experts("qwen3_moe", "grouped_mm")  # H 48, I 40, 5 experts
    theirs = theirs.to(device, torch.bfloat16)
    ours = modules.GatedExperts.from_module(copy.deepcopy(theirs), config)
    index, weights = routing(tokens, 5, top_k, device)
    hidden = torch.randn(tokens, 48, device=device, dtype=torch.bfloat16, requires_grad=True)
    weights = weights.to(torch.bfloat16).requires_grad_(True)
    kept = {}
    for name, experts in (("theirs", theirs), ("ours", ours)):
        exclude = [hidden, weights, *experts.parameters()]
        kept[name] = saved_bytes(lambda experts=experts: experts(hidden, index, weights), exclude)
    pairs, width = tokens * top_k, 2  # bf16
    assert kept["ours"] == pairs * (2 * 40 * width + 8) + 5 * 4  # gate_up, int64 order, int32 expert offsets
    assert kept["theirs"] >= pairs * (2 * 48 + 3 * 40) * width, kept  # x, gate_up, act, y (+ index vectors)


def test_experts_under_autocast_weights_run_the_op(device, monkeypatch):
    """fp32 experts with bf16 routing weights (autocast's router): the op runs in fp32, as transformers does."""
    torch.manual_seed(12)
    theirs, config = transformers_experts("qwen3_moe", "grouped_mm")
    theirs = theirs.to(device)
    ours = modules.GatedExperts.from_module(copy.deepcopy(theirs), config)
    calls = []
    apply_op = op.MoEExpertsFunction.apply
    monkeypatch.setattr(op.MoEExpertsFunction, "apply", lambda *args: calls.append(1) or apply_op(*args))
    index, weights = routing(9, 5, 2, device)
    hidden, weights = torch.randn(9, 48, device=device), weights.to(torch.bfloat16)
    assert_close(ours(hidden, index, weights), theirs(hidden, index, weights), torch.float32, "output")
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_routing_weights_run_the_op_in_float32_sums(dtype, device, monkeypatch):
    """A router that keeps its weights in float32 (DeepSeek-V2's) beside half-precision experts: the op runs
    (transformers' grouped_mm would scale and sum in float32 rows), each token's weighted sum taken in float32
    and rounded once, so it is as close to float64 as transformers' function, gradients included."""
    torch.manual_seed(13)
    theirs, config = transformers_experts("qwen3_moe", "grouped_mm")
    theirs = theirs.to(device, dtype)
    ours = modules.GatedExperts.from_module(copy.deepcopy(theirs), config)
    calls = []
    apply_op = op.MoEExpertsFunction.apply
    monkeypatch.setattr(op.MoEExpertsFunction, "apply", lambda *args: calls.append(1) or apply_op(*args))
    index, weights = routing(23, 5, 3, device)
    hidden, grad = torch.randn(23, 48, device=device), torch.randn(23, 48, device=device)
    results = {}
    for name, experts in (("ours", ours), ("theirs", theirs)):
        x, w = hidden.to(dtype).requires_grad_(True), weights.clone().requires_grad_(True)
        out = experts(x, index, w)
        out.backward(grad.to(dtype))
        results[name] = [out, x.grad, w.grad, experts.gate_up_proj.grad, experts.down_proj.grad]
    exact = [as_float64(t) for t in (hidden.to(dtype), theirs.gate_up_proj, theirs.down_proj, weights)]
    out = reference.moe_experts(*exact[:3], index, exact[3])
    out.backward(grad.to(dtype).double())
    results["exact"] = [out, exact[0].grad, exact[3].grad, exact[1].grad, exact[2].grad]
    assert calls == [1] and results["ours"][0].dtype == dtype and results["ours"][2].dtype == torch.float32
    # Triton's interpreter rounds float32 to bfloat16 by truncation, twice round-to-nearest's error, where
    # torch's CPU ops round to nearest: on the CPU tigon's bf16 roundings may be up to twice as far.
    factor = 2.0 if dtype == torch.bfloat16 and str(device) == "cpu" else 1.05
    names = ("output", "hidden_states", "top_k_weights", "gate_up_proj", "down_proj")
    for name, got, theirs_value, expected in zip(names, *results.values(), strict=True):
        error = ((got.double() - expected).norm() / expected.norm()).item()
        transformers_error = ((theirs_value.double() - expected).norm() / expected.norm()).item()
        assert error <= factor * transformers_error + 1e-6, (name, error, transformers_error)


def test_moe_experts_reject_bad_inputs():
    hidden, gate_up, down = torch.randn(4, 8), torch.randn(3, 12, 8), torch.randn(3, 8, 6)
    index, weights = torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2)
    with pytest.raises(ValueError, match=r"must be \(E, 2I, H\) \(gate rows first\) and \(E, H, I\)"):
        op.moe_experts(hidden, gate_up[:, :10], down, index, weights)
    with pytest.raises(ValueError, match="top_k_index must be an integer"):
        op.moe_experts(hidden, gate_up, down, index.float(), weights)
    with pytest.raises(ValueError, match=r"with the 4 tokens of hidden_states"):
        op.moe_experts(hidden, gate_up, down, index[:3], weights[:3])
    with pytest.raises(TypeError, match="must share one dtype"):
        op.moe_experts(hidden, gate_up.half(), down, index, weights)
    with pytest.raises(TypeError, match=r"top_k_weights must be the experts' dtype \(torch.float32\) or float32"):
        op.moe_experts(hidden, gate_up, down, index, weights.half())
    with pytest.raises(ValueError, match="activation='relu'"):
        op.moe_experts(hidden, gate_up, down, index, weights, "relu")
