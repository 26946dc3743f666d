"""The fused linear cross entropy in the patched `*ForCausalLM.forward`: same loss and gradients, no logits."""

import copy
import logging
import re

import pytest
import torch

import tigon.kernels
from tests.kernels.families import (
    FAMILY_CASES,
    TRANSFORMERS_4,
    assert_same_gradients,
    family_params,
    float64_gradients,
    own_failure,
    tiny,
)
from tigon.kernels.patching import FAMILIES, apply
from tigon.kernels.patching.causal_lm import decoder_of, has_fused_loss
from tigon.kernels.patching.last_layer import last_layer_takes_rows

transformers = pytest.importorskip("transformers")

VOCAB = 131
# Head quirks switched on, so the fused path has to reproduce them.
HEAD_OVERRIDES = {
    "gemma2": dict(final_logit_softcapping=3.0),
    "gemma3_text": dict(final_logit_softcapping=3.0),
    "gemma4_text": dict(final_logit_softcapping=3.0),
    "gemma4": dict(final_logit_softcapping=3.0),
    "granite": dict(logits_scaling=2.5),
    "mixtral": dict(output_router_logits=True, router_aux_loss_coef=0.1),
    "qwen3_vl_moe": dict(output_router_logits=True, router_aux_loss_coef=0.1),  # the coefficient on the text config
}


def loss_only_pair(model_type: str, **overrides):
    """(baseline, copy patched with the fused loss only), both in training mode."""
    case = FAMILY_CASES.get(model_type)  # the rows that share another's layout (Mistral, Qwen2) have no case
    config_overrides = {**(case.overrides if case else {}), **HEAD_OVERRIDES.get(model_type, {}), **overrides}
    baseline = tiny(model_type, **config_overrides).train()
    patched = copy.deepcopy(baseline)
    report = apply(patched, rms_norm=False, rope=False, swiglu=False)
    assert report.applied == {"fused_linear_cross_entropy": 1}
    return baseline, patched


def assert_same_grads(patched, baseline, batch, labels, bound: float = 1e-5):
    """Every gradient within `bound` of transformers', or where not, no farther from float64
    (`assert_same_gradients`)."""
    assert_same_gradients(baseline, patched, bound, lambda: float64_gradients(baseline, batch, labels))


@pytest.mark.parametrize("model_type", family_params(FAMILY_CASES))
def test_loss_and_grads_match_transformers_without_logits(model_type):
    baseline, patched = loss_only_pair(model_type)
    batch = torch.randint(0, VOCAB, (2, 11))
    labels = batch.clone()
    labels[0, :4] = -100  # a prompt that carries no loss
    failure = own_failure(baseline, batch)
    if failure is not None:  # the fused loss neither hides nor changes transformers' own error
        with pytest.raises(type(failure), match=re.escape(str(failure))):
            patched(input_ids=batch, labels=labels)
        return
    expected = baseline(input_ids=batch, labels=labels)
    got = patched(input_ids=batch, labels=labels)
    assert got.logits is None and type(got) is type(expected)
    assert abs(got.loss.item() - expected.loss.item()) < 1e-6 * max(1.0, expected.loss.item())
    if model_type in ("mixtral", "qwen3_vl_moe"):
        assert got.aux_loss is not None and torch.equal(got.aux_loss, expected.aux_loss)
    expected.loss.backward()
    got.loss.backward()
    assert_same_grads(patched, baseline, batch, labels)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_logits_are_the_models_own_without_labels_or_in_eval(model_type):
    baseline, patched = loss_only_pair(model_type)
    batch = torch.randint(0, VOCAB, (2, 7))
    assert torch.equal(patched(input_ids=batch).logits, baseline(input_ids=batch).logits)
    patched.eval(), baseline.eval()
    got, expected = patched(input_ids=batch, labels=batch), baseline(input_ids=batch, labels=batch)
    assert torch.equal(got.logits, expected.logits) and torch.equal(got.loss, expected.loss)
    fused = patched(input_ids=batch, labels=batch, skip_logits=True)  # forced, e.g. for an eval loss
    assert fused.logits is None and abs(fused.loss.item() - expected.loss.item()) < 1e-6


def test_num_items_in_batch_accumulation_equals_one_big_batch():
    baseline, patched = loss_only_pair("llama")
    batch = torch.randint(0, VOCAB, (4, 9))
    labels = batch.clone()
    labels[:2, :5] = -100  # the micro-batches hold different numbers of label tokens
    items = int((labels[:, 1:] != -100).sum())
    for half in (slice(0, 2), slice(2, 4)):
        loss = patched(input_ids=batch[half], labels=labels[half], num_items_in_batch=torch.tensor(items)).loss
        loss.backward()
    baseline(input_ids=batch, labels=labels).loss.backward()
    assert_same_grads(patched, baseline, batch, labels)


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "granite"])
def test_loss_positions_project_only_those_positions(model_type):
    """The head projects only the positions given: the loss and every gradient are transformers' with every other
    position's label dropped (so prompts, whose labels are dropped anyway, cost no head work)."""
    baseline, patched = loss_only_pair(model_type)
    batch = torch.randint(0, VOCAB, (3, 10))
    labels = batch.clone()
    labels[0, :6] = labels[2, 3:] = -100
    shifted_has_loss = torch.nn.functional.pad(labels[:, 1:] != -100, (0, 1), value=False).flatten()
    positions = shifted_has_loss.nonzero().squeeze(1)
    expected = baseline(input_ids=batch, labels=labels, num_items_in_batch=7)
    got = patched(input_ids=batch, labels=labels, num_items_in_batch=7, loss_positions=positions)
    assert abs(got.loss.item() - expected.loss.item()) < 1e-6 * max(1.0, expected.loss.item())
    expected.loss.backward()
    got.loss.backward()
    assert_same_grads(patched, baseline, batch, labels)
    fewer = positions[positions % 10 < 5]  # some positions with a label left out: their loss is left out too
    restricted = torch.full_like(labels, -100).flatten()
    restricted[fewer + 1] = labels.flatten()[fewer + 1]
    restricted = restricted.view_as(labels)
    got = patched(input_ids=batch, labels=labels, loss_positions=fewer).loss
    assert abs(got.item() - baseline(input_ids=batch, labels=restricted).loss.item()) < 1e-6 * max(1.0, got.item())
    patched.eval(), baseline.eval()  # the logits path computes every position's loss, as transformers does
    assert torch.equal(
        patched(input_ids=batch, labels=labels, loss_positions=fewer).loss,
        baseline(input_ids=batch, labels=labels).loss,
    )


LOSS_ROWS_FAMILIES = [name for name, family in FAMILIES.items() if family.loss_rows_layer]
ROWS_NEED_5 = pytest.mark.skipif(
    TRANSFORMERS_4, reason="transformers 4's decoder layers are left whole (some lines return tuples from them)"
)


@ROWS_NEED_5
@pytest.mark.parametrize("model_type", family_params(LOSS_ROWS_FAMILIES))
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_last_layer_computes_only_the_rows_the_loss_reads(model_type, checkpointing):
    """Given the positions with a loss, the last decoder layer's MLP runs on those rows only, the others' on every
    row, and the loss and every gradient are transformers' (under gradient checkpointing too)."""
    baseline, patched = loss_only_pair(model_type)
    if checkpointing:
        baseline.gradient_checkpointing_enable(), patched.gradient_checkpointing_enable()
    batch = torch.randint(0, VOCAB, (3, 10))
    labels = batch.clone()
    labels[0, :6] = labels[1, :3] = labels[2, 4:] = -100
    positions = torch.nn.functional.pad(labels[:, 1:] != -100, (0, 1), value=False).flatten().nonzero().squeeze(1)
    rows_seen = {}
    layers = decoder_of(patched).layers
    for index in (0, len(layers) - 1):
        layers[index].mlp.register_forward_pre_hook(
            lambda module, args, index=index: rows_seen.update({index: tuple(args[0].shape[:-1])})
        )
    expected = baseline(input_ids=batch, labels=labels)
    got = patched(input_ids=batch, labels=labels, loss_positions=positions)
    assert rows_seen == {0: (3, 10), len(layers) - 1: (1, len(positions))}
    assert abs(got.loss.item() - expected.loss.item()) < 1e-6 * max(1.0, expected.loss.item())
    expected.loss.backward()
    got.loss.backward()
    assert_same_grads(patched, baseline, batch, labels)


@ROWS_NEED_5
def test_an_moe_last_layer_keeps_every_row_while_router_logits_count_them():
    """The auxiliary loss averages the routers' choices over every row, so with router logits output the last layer
    computes them all; the loss and auxiliary loss are transformers'."""
    baseline, patched = loss_only_pair("qwen3_moe", output_router_logits=True, router_aux_loss_coef=0.1)
    batch = torch.randint(0, VOCAB, (2, 9))
    labels = batch.clone()
    labels[:, :5] = -100
    positions = torch.nn.functional.pad(labels[:, 1:] != -100, (0, 1), value=False).flatten().nonzero().squeeze(1)
    rows_seen = []
    decoder_of(patched).layers[-1].mlp.register_forward_pre_hook(
        lambda module, args: rows_seen.append(tuple(args[0].shape[:-1]))
    )
    got = patched(input_ids=batch, labels=labels, loss_positions=positions)
    expected = baseline(input_ids=batch, labels=labels)
    assert rows_seen == [(2, 9)]
    assert torch.equal(got.aux_loss, expected.aux_loss)
    assert abs(got.loss.item() - expected.loss.item()) < 1e-6 * max(1.0, expected.loss.item())


@ROWS_NEED_5
def test_apply_to_builds_layers_that_compute_only_the_rows_the_loss_reads(restore_modeling):
    baseline = tiny("qwen3").train()
    tigon.kernels.apply_to("qwen3", rms_norm=False, rope=False, swiglu=False)
    patched = tiny("qwen3").train()
    patched.load_state_dict(baseline.state_dict())
    assert last_layer_takes_rows(patched.model)
    batch = torch.randint(0, VOCAB, (2, 9))
    labels = batch.clone()
    labels[:, :5] = -100
    positions = torch.nn.functional.pad(labels[:, 1:] != -100, (0, 1), value=False).flatten().nonzero().squeeze(1)
    got = patched(input_ids=batch, labels=labels, loss_positions=positions).loss
    assert abs(got.item() - baseline(input_ids=batch, labels=labels).loss.item()) < 1e-6 * max(1.0, got.item())


def test_has_fused_loss_looks_through_wrappers():
    baseline, patched = loss_only_pair("llama")
    wrapper = torch.nn.Module()
    wrapper.module = patched  # as DDP and DeepSpeed's engine hold the model
    assert has_fused_loss(patched) and has_fused_loss(wrapper)
    assert not has_fused_loss(baseline) and not has_fused_loss(torch.nn.Linear(2, 2))
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj"])
    assert has_fused_loss(peft.get_peft_model(patched, config))


def test_call_forms_match_transformers():
    baseline, patched = loss_only_pair("qwen3")
    batch = torch.randint(0, VOCAB, (2, 8))
    # logits_to_keep with labels: the loss covers the kept positions only, as in transformers.
    expected = baseline(input_ids=batch, labels=batch[:, -5:], logits_to_keep=5).loss
    assert abs(patched(input_ids=batch, labels=batch[:, -5:], logits_to_keep=5).loss.item() - expected.item()) < 1e-6
    # labels passed positionally and a tuple output: the loss first, no logits.
    expected = baseline(batch, None, None, None, None, batch).loss
    got = patched(batch, None, None, None, None, batch, return_dict=False)
    assert isinstance(got, tuple) and abs(got[0].item() - expected.item()) < 1e-6
    assert all(not (torch.is_tensor(part) and part.shape[-1] == VOCAB) for part in got[1:])
    # shift_labels (already shifted, as sequence-parallel trainers pass them) and requested hidden states.
    shifted = torch.nn.functional.pad(batch, (0, 1), value=-100)[:, 1:].contiguous()
    expected = baseline(input_ids=batch, labels=batch, shift_labels=shifted, output_hidden_states=True)
    got = patched(input_ids=batch, labels=batch, shift_labels=shifted, output_hidden_states=True)
    assert abs(got.loss.item() - expected.loss.item()) < 1e-6
    assert len(got.hidden_states) == len(expected.hidden_states)
    assert patched(input_ids=batch, labels=batch).hidden_states is None
    with pytest.raises(ValueError, match="skip_logits=True .* needs labels"):
        patched(input_ids=batch, skip_logits=True)


def test_generate_is_unchanged():
    baseline, patched = loss_only_pair("llama")
    prompt = torch.randint(1, VOCAB, (1, 4))
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(patched.eval().generate(prompt, **kwargs), baseline.eval().generate(prompt, **kwargs))


def test_lora_on_the_head_falls_back_to_the_transformers_loss(caplog):
    peft = pytest.importorskip("peft")
    baseline, _ = loss_only_pair("llama")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], init_lora_weights=False)
    torch.manual_seed(1)
    wrapped = peft.get_peft_model(copy.deepcopy(baseline), config)
    patched = copy.deepcopy(wrapped)
    assert apply(patched, rms_norm=False, rope=False, swiglu=False).applied == {"fused_linear_cross_entropy": 1}
    batch = torch.randint(0, VOCAB, (2, 6))
    with caplog.at_level(logging.WARNING, logger="tigon.kernels"):
        got = patched(input_ids=batch, labels=batch)
    assert "not a plain nn.Linear" in caplog.text and got.logits is not None
    assert torch.equal(got.loss, wrapped(input_ids=batch, labels=batch).loss)


def test_lora_elsewhere_keeps_the_fused_loss():
    peft = pytest.importorskip("peft")
    baseline, _ = loss_only_pair("llama")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    wrapped = peft.get_peft_model(copy.deepcopy(baseline), config)
    patched = copy.deepcopy(wrapped)
    assert apply(patched).applied["fused_linear_cross_entropy"] == 1
    batch = torch.randint(0, VOCAB, (2, 6))
    got, expected = patched(input_ids=batch, labels=batch), wrapped(input_ids=batch, labels=batch)
    assert got.logits is None and abs(got.loss.item() - expected.loss.item()) < 1e-5
    got.loss.backward()
    expected.loss.backward()
    assert_same_grads(patched, wrapped, batch, batch, bound=1e-4)
