"""Convergence: a small model trained with and without tigon's kernels follows the same curve.

Each family is built from a config, trained with AdamW for 30 steps on fixed random data (fp32),
once as transformers builds it and once after `tigon.kernels.apply` (on the CPU: RMSNorm, the gated
MLP and the fused linear cross entropy, plus RoPE for Llama; on the GPU every kernel that fits).
Compared, with the bounds below:
- per-step training loss: |ours - theirs| <= 1e-4 * theirs (rounding differences, which Adam
  amplifies over the steps, stay near 1e-6 here);
- final parameters: ||ours - theirs|| / ||theirs|| < 1e-4 for every tensor;
- evaluation logits on held-out rows (eval mode, so the patched forward returns them): relative
  error < 1e-4;
and the loss must fall by a third, so the test compares real training. On the CPU the kernels run
through Triton's interpreter at tiny sizes; the GPU variant runs every family at real widths
(hidden 1024, vocabulary 32,000) with the looser bounds stated there.
"""

import copy

import pytest
import torch

from tests.kernels.helpers import relative_error
from tests.kernels.test_patching import FAMILY_CASES
from tigon.kernels.patching import apply

transformers = pytest.importorskip("transformers")

STEPS = 30
LOSS_BOUND, PARAM_BOUND, LOGITS_BOUND = 1e-4, 1e-4, 1e-4
GPU_BOUNDS = (1e-2, 5e-2, 5e-2)  # why: see the GPU variant

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=2,
    vocab_size=1000,
    max_position_embeddings=64,
    pad_token_id=0,
)
CPU_FAMILIES = {
    "llama": {},
    "qwen3": {},
    "gemma2": {},  # final_logit_softcapping=30 and attention softcapping, as the family defaults
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
}


def build(model_type: str, size: dict, overrides: dict) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(model_type, **size, **overrides)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def train(model: torch.nn.Module, data: torch.Tensor, held_out: torch.Tensor, batch: int, device: str):
    """(per-step losses, final parameters, eval logits) after STEPS AdamW steps cycling over `data`."""
    model = model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        rows = data[(step * batch) % len(data) :][:batch].to(device)
        loss = model(input_ids=rows, labels=rows).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=held_out.to(device)).logits
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}, logits


def assert_same_training(
    model_type: str,
    size: dict,
    overrides: dict,
    shape: tuple[int, int, int],
    device: str,
    bounds: tuple[float, float, float] = (LOSS_BOUND, PARAM_BOUND, LOGITS_BOUND),
    kernels: dict | None = None,
):
    rows, length, batch = shape
    generator = torch.Generator().manual_seed(1)
    data = torch.randint(1, size["vocab_size"], (rows, length), generator=generator)
    held_out = torch.randint(1, size["vocab_size"], (2, length), generator=generator)
    baseline = build(model_type, size, overrides)
    patched = copy.deepcopy(baseline)
    report = apply(patched, **(kernels or {}))
    assert report.applied["rms_norm"] > 0 and report.applied["fused_linear_cross_entropy"] == 1

    theirs = train(baseline, data, held_out, batch, device)
    ours = train(patched, data, held_out, batch, device)

    assert theirs[0][-1] < theirs[0][0] * 2 / 3, f"the loss did not fall: {theirs[0]}"
    assert abs(ours[0][0] - theirs[0][0]) <= LOSS_BOUND * theirs[0][0], "step 0 (same weights): the losses differ"
    loss_error = max(abs(got - want) / want for got, want in zip(ours[0], theirs[0], strict=True))
    param_error = max(relative_error(ours[1][name], want) for name, want in theirs[1].items())
    logits_error = relative_error(ours[2], theirs[2])
    print(f"{model_type}: loss {loss_error:.2e}, parameters {param_error:.2e}, eval logits {logits_error:.2e}")
    loss_bound, param_bound, logits_bound = bounds
    assert loss_error <= loss_bound, f"per-step losses differ by {loss_error:.2e} (relative)"
    assert param_error < param_bound, f"final parameters differ by {param_error:.2e} (relative)"
    assert logits_error < logits_bound, f"eval logits differ by {logits_error:.2e} (relative)"


@pytest.mark.parametrize("model_type", list(CPU_FAMILIES))
def test_tiny_model_trains_the_same_with_kernels(model_type, restore_rope):
    # RoPE launches one program per token, about 12 ms each in the interpreter: Llama runs it, the others
    # leave it to the GPU variant (its exactness is in test_rope.py), which keeps the file near 60 s on one core.
    kernels = dict(rope=model_type == "llama")
    assert_same_training(model_type, TINY, CPU_FAMILIES[model_type], shape=(4, 8, 1), device="cpu", kernels=kernels)


REAL_WIDTHS = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_hidden_layers=2,
    vocab_size=32000,
    max_position_embeddings=1024,
    pad_token_id=0,
)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", list(FAMILY_CASES))
def test_every_family_trains_the_same_with_kernels_on_gpu(model_type, restore_rope):
    overrides = FAMILY_CASES[model_type][0]
    if "moe_intermediate_size" in overrides:
        overrides = {**overrides, "moe_intermediate_size": 704}
    # Open (issue 4): on an H200 step 0 (same weights) agrees within 1e-4 for every family, but the later
    # steps drift apart by amounts that change from run to run (largest per-step loss difference 6e-3 in
    # one run, 0.48 in the next), beyond these bounds for 11 of 12 families. Whether that is AdamW
    # amplifying rounding at lr 3e-3 or a kernel difference at real widths is not settled yet.
    assert_same_training(model_type, REAL_WIDTHS, overrides, shape=(8, 256, 4), device="cuda", bounds=GPU_BOUNDS)
