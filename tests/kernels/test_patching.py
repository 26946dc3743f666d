"""Patching a whole Hugging Face model: same loss and gradients, and a clear report."""

import copy
import logging

import pytest
import torch

from tests.kernels.helpers import relative_error
from tigon.kernels import modules
from tigon.kernels.patching import apply

transformers = pytest.importorskip("transformers")


def tiny(model_type: str):
    common = dict(
        hidden_size=64,
        intermediate_size=160,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=131,
        max_position_embeddings=64,
        head_dim=16,
    )
    config = transformers.AutoConfig.for_model(model_type, **common)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma"])
def test_patched_model_matches_eager(model_type, restore_rope):
    baseline = tiny(model_type)
    patched = copy.deepcopy(baseline)
    batch = torch.randint(0, 131, (2, 19))
    expected = baseline(input_ids=batch, labels=batch)
    expected.loss.backward()

    report = apply(patched)
    got = patched(input_ids=batch, labels=batch)
    got.loss.backward()

    layers = baseline.config.num_hidden_layers
    assert report.applied["gated_mlp"] == layers and report.applied["rope"] == 1
    assert report.applied["rms_norm"] >= 2 * layers + 1
    assert abs(got.loss.item() - expected.loss.item()) < 1e-5
    assert relative_error(got.logits, expected.logits) < 1e-5
    for (name, theirs), (_, ours) in zip(baseline.named_parameters(), patched.named_parameters(), strict=True):
        assert relative_error(ours.grad, theirs.grad) < 1e-4, name
    assert isinstance(patched.model.layers[0].mlp, modules.GatedMLP)


def test_only_requested_kernels_are_applied(restore_rope):
    model = tiny("llama")
    report = apply(model, rope=False, swiglu=False)
    assert set(report.applied) == {"rms_norm"}
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"


def test_unsupported_model_type_warns_and_names_what_was_not_applied(caplog):
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)
    model = transformers.GPT2LMHeadModel(config)
    with caplog.at_level(logging.WARNING, logger="tigon.kernels"):
        report = apply(model)
    assert report.applied == {} and report.skipped == ["rms_norm", "rope", "swiglu"]
    assert "'gpt2' has no kernel table entry" in caplog.text
    assert "not applied: rms_norm, rope, swiglu" in str(report)


def test_demo_runs_on_cpu(capsys, restore_rope):
    from tigon.kernels import demo

    demo.main(["--steps", "1"])
    printed = capsys.readouterr().out
    assert "Triton's interpreter" in printed and "losses agree" in printed
