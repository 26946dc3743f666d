"""The transformers 5.x MoE experts (3-D gate_up_proj/down_proj parameters) swapped to GatedExperts.

This file is not part of the compat run (tests/compat runs the patching tests against transformers 4.x,
which keeps one MLP module per expert and has none of this), so nothing here is skipped there.
"""

import copy

import pytest
import torch

from tests.kernels.test_patching import FAMILY_CASES, assert_lora_adapters_kept, assert_same_training_step, tiny
from tigon.kernels.patching import apply

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("implementation", ["eager", "batched_mm"])
def test_experts_follow_the_models_experts_implementation(implementation, restore_rope):
    """GatedExperts runs transformers' loop ("eager") or its function for the implementation, with tigon's
    activation; a later `set_experts_implementation` reaches the swapped module (it shares the config)."""
    baseline = tiny("qwen3_moe", **FAMILY_CASES["qwen3_moe"][0])
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
