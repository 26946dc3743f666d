"""The `ForSequenceClassification` heads of the families that have one: the same decoder kernels as the causal LM,
the same logits, loss and gradients as unpatched, and a report that says the fused loss does not apply."""

import copy

import pytest
import torch

from tests.kernels.families import FAMILY_CASES, rope_functions, rope_functions_set, shipped, tiny
from tests.kernels.helpers import relative_error
from tigon.kernels.patching import apply

transformers = pytest.importorskip("transformers")

LABELS = 3


def classifier(model_type: str, overrides: dict):
    """The family's sequence classifier with the tiny causal LM's config, or None when the family has none."""
    config = tiny(model_type, **overrides).config
    config.num_labels = LABELS
    try:
        torch.manual_seed(0)
        return transformers.AutoModelForSequenceClassification.from_config(config)
    except ValueError:  # transformers maps no ForSequenceClassification class to this config
        return None


# The table's families transformers gives no ForSequenceClassification class.
NO_CLASSIFIER = [
    "qwen3_5_moe",
    "gemma4_text",
    "granite",
    "deepseek_v4",
    "glm4_moe",
    "falcon_h1",
    "llama4_text",
    "llama4",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "gemma4",
    "mllama",
    "phi4_multimodal",
    "llava",
    "paligemma",
    "internvl",
    "mistral3",
    "glm4v",
    "glm4v_moe",
    "smolvlm",
    "muse_glimmer",
]


def test_which_families_have_a_classifier():
    """Over the families the installed transformers ships."""
    missing = [
        name for name, case in FAMILY_CASES.items() if shipped(name) and classifier(name, case.overrides) is None
    ]
    assert missing == [name for name in NO_CLASSIFIER if shipped(name)]


@pytest.mark.parametrize("model_type", [name for name in FAMILY_CASES if name not in NO_CLASSIFIER])
def test_patched_classifier_matches_eager(model_type, restore_rope):
    overrides = FAMILY_CASES[model_type].overrides
    baseline = classifier(model_type, overrides)
    patched = copy.deepcopy(baseline)
    ropes = rope_functions()  # transformers' own: the baseline runs them, not tigon's module-wide RoPE
    report = apply(patched)
    causal_lm_report = apply(tiny(model_type, **overrides))
    assert report.applied == {k: v for k, v in causal_lm_report.applied.items() if k != "fused_linear_cross_entropy"}
    assert report.skipped[-1].startswith(f"fused_linear_cross_entropy ({type(baseline).__name__} has no")

    ids = torch.randint(1, 131, (2, 7), generator=torch.Generator().manual_seed(5))
    labels = torch.tensor([0, 2])
    with rope_functions_set(ropes):
        expected = baseline(input_ids=ids, labels=labels)
        expected.loss.backward()
    got = patched(input_ids=ids, labels=labels)
    got.loss.backward()
    assert abs(got.loss.item() - expected.loss.item()) < 1e-5
    assert relative_error(got.logits, expected.logits) < 1e-5
    for (name, theirs), (_, ours) in zip(baseline.named_parameters(), patched.named_parameters(), strict=True):
        if theirs.grad is not None:
            assert relative_error(ours.grad, theirs.grad) < 1e-4, name
