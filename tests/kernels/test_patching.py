"""Patching a whole Hugging Face model: same loss and gradients, and a clear report."""

import copy
import dataclasses
import importlib
import logging
import re

import pytest
import torch

import tigon.kernels
from tests.kernels.families import (
    FAMILY_CASES,
    TRANSFORMERS_4,
    VISION,
    Swaps,
    assert_lora_adapters_kept,
    assert_same_training_step,
    family_params,
    own_failure,
    rope_functions,
    rope_functions_set,
    tiny,
)
from tests.kernels.helpers import relative_error
from tigon.kernels import modules, patching
from tigon.kernels.patching import FAMILIES, apply
from tigon.kernels.patching.causal_lm import decoder_of

transformers = pytest.importorskip("transformers")


# transformers 4.x has no 3-D experts: each expert is its own MLP, so every expert (and Qwen2-MoE's shared
# one) is a GatedMLP, or for Mixtral (w1/w3/w2) a GatedExpertMLP; Qwen3-VL-MoE's experts are transposed there.
# Its Qwen2-VL and Qwen2.5-VL apply the multimodal RoPE sections in a function of their own, which keeps them.
_MROPE_4X = ["rope (transformers 4.x"]
CASES_4X = {
    "mixtral": Swaps(2 * 4, 0, True, []),
    "qwen2_moe": Swaps(2 * (4 + 1), 0, True, []),
    "qwen3_moe": Swaps(1 + 4, 0, True, []),
    "glm4_moe": Swaps(1 + 4 + 1, 0, True, []),
    "qwen3_next": Swaps(1 + 4 + 1, 0, True, ["rms_norm (the Gated DeltaNet"]),
    "deepseek_v3": Swaps(1 + 4 + 1, 0, False, ["rope (DeepSeek-V3"]),
    "deepseek_v2": Swaps(1 + 4 + 1, 0, False, ["rope (DeepSeek-V2"]),
    "hunyuan_v1_moe": Swaps(2 * (4 + 1), 0, True, []),
    "qwen3_vl_moe": Swaps(0, 0, True, ["swiglu (transformers 4.x", "rope (the vision", "swiglu (the vision"]),
    "qwen2_vl": Swaps(2, 0, False, [*_MROPE_4X, "rope (the vision", "swiglu (the vision"]),
    "qwen2_5_vl": Swaps(2 + 1, 0, False, [*_MROPE_4X, "rope (the vision"]),
    "glm4v_moe": Swaps(1 + 4 + 1 + 1, 0, False, [*_MROPE_4X, "rope (the vision", "swiglu (the vision patch"]),
}
MLP_MODULES = (modules.GatedMLP, modules.PackedGatedMLP, modules.GatedExpertMLP)


def expected_swaps(model_type: str) -> Swaps:
    """What patching the family's tiny model swaps and skips, on the installed transformers line."""
    if TRANSFORMERS_4 and model_type in CASES_4X:
        return CASES_4X[model_type]
    return FAMILY_CASES[model_type].swaps


@pytest.mark.parametrize("model_type", family_params(FAMILY_CASES))
def test_patched_model_matches_eager(model_type, restore_rope):
    overrides = FAMILY_CASES[model_type].overrides
    mlps, experts, rope, skipped = expected_swaps(model_type)
    baseline = tiny(model_type, **overrides)
    patched = copy.deepcopy(baseline)
    ropes = rope_functions()  # transformers' own: the baseline runs them, not tigon's module-wide RoPE
    report = apply(patched)
    batch = torch.randint(0, 131, (2, 19))
    with rope_functions_set(ropes):
        failure = own_failure(baseline, batch)
    if failure is None:
        assert_same_training_step(baseline, patched, batch, baseline_ropes=ropes)
    else:  # the kernels neither hide nor change transformers' own error
        with pytest.raises(type(failure), match=re.escape(str(failure))):
            patched(input_ids=batch, labels=batch)

    layers = baseline.config.get_text_config().num_hidden_layers
    offset_norms = sum(type(module).__name__ in FAMILIES[model_type].offset_layer_norm for module in baseline.modules())
    assert report.applied.get("gated_mlp", 0) == mlps and report.applied.get("rope", 0) == int(rope)
    assert report.applied.get("gated_experts", 0) == experts
    activations = FAMILIES[model_type].activations
    assert report.applied.get("relu_squared", 0) == sum(type(m).__name__ in activations for m in baseline.modules())
    assert not any(type(module).__name__ in activations for module in patched.modules())
    assert report.applied.get("rms_norm", 0) + offset_norms >= 2 * layers + 1
    assert report.applied["fused_linear_cross_entropy"] == 1
    assert len(report.skipped) == len(skipped)
    for prefix, entry in zip(skipped, report.skipped, strict=True):
        assert entry.startswith(prefix), report.skipped
    vision_norms = sum(type(module) is torch.nn.LayerNorm for module in baseline.modules())
    assert report.applied.get("layer_norm", 0) == vision_norms + offset_norms
    assert sum(type(module) is torch.nn.LayerNorm for module in patched.modules()) == 0
    decoder = decoder_of(patched)
    decoder = getattr(decoder, "text_model", decoder)  # transformers 4.x SmolVLM: get_decoder() is the whole model
    norms = (modules.RMSNorm, modules.OffsetLayerNorm)
    norm = next(module for module in decoder.layers[0].modules() if isinstance(module, norms))
    # GLM-4V's decoder norms its sublayers' outputs; GLM-4.5V's vision tower norms the patch embeddings it adds to
    post_norms = (
        "gemma2",
        "gemma3_text",
        "gemma3",
        "gemma4_text",
        "gemma4",
        "paligemma",
        "olmo2",
        "olmo3",
        "glm4",
        "exaone4",
        "glm4v",
        "glm4v_moe",
        "deepseek_v4",  # its hyper-connections: out-of-place, as the post-norm families
        "muse_glimmer",
    )
    assert norm.in_place_backward is (model_type not in post_norms)
    assert sum(isinstance(module, MLP_MODULES) for module in patched.modules()) == mlps
    assert sum(isinstance(module, modules.GatedExperts) for module in patched.modules()) == experts
    assert patched.state_dict().keys() == baseline.state_dict().keys()


def test_vision_language_model_with_an_image_matches_eager(restore_rope):
    """Qwen2-VL fed an image: the vision tower's LayerNorms (tigon's) train, and the multimodal RoPE's temporal,
    height and width positions differ, so on transformers 5.x tigon's RoPE rotates by per-section cos/sin."""
    tokens = dict(vision_start_token_id=4, image_token_id=5, video_token_id=6)
    baseline = tiny("qwen2_vl", outer=tokens, **FAMILY_CASES["qwen2_vl"].overrides)
    patched = copy.deepcopy(baseline)
    ropes = rope_functions()
    report = apply(patched)
    assert report.applied["layer_norm"] == 3 and report.applied.get("rope", 0) == int(not TRANSFORMERS_4)
    batch = torch.tensor([[7, 8, 4, 5, 5, 5, 5, 9, 10, 11, 12]])  # a 4 x 4 patch image merged into 4 tokens
    image = dict(pixel_values=torch.randn(16, 3 * 2 * 2 * 2), image_grid_thw=torch.tensor([[1, 4, 4]]))
    if not TRANSFORMERS_4:  # transformers 5 finds the image tokens by type, 4.x by the vision start token
        image["mm_token_type_ids"] = (batch == 5).int()
    positions, _ = baseline.model.get_rope_index(batch, **{k: v for k, v in image.items() if k != "pixel_values"})
    assert not torch.equal(positions[1], positions[2])  # height and width positions differ inside the image
    assert_same_training_step(baseline, patched, batch, baseline_ropes=ropes, **image)
    norm = patched.model.visual.blocks[0].norm1
    assert isinstance(norm, modules.LayerNorm) and norm.weight.grad is not None


def test_llava_with_a_pixtral_vision_tower_and_an_image_matches_eager(restore_rope):
    """Pixtral 12B's layout: Llava around a Mistral language model and a Pixtral vision tower. Fed an image, the
    vision tower trains through Pixtral's row (tigon's RMSNorm, gated MLP and RoPE on its (S, D) 2-D tables), the
    language tower through Mistral's; no CLIP-style MLP is left to report."""
    vision = dict(VISION, model_type="pixtral", head_dim=16)
    outer = dict(image_token_index=5, vision_feature_layer=-1, vision_feature_select_strategy="full")
    baseline = tiny("llava", outer=outer, vision=vision, model_type="mistral")
    patched = copy.deepcopy(baseline)
    ropes = rope_functions()
    report = apply(patched)
    assert report.skipped == []
    assert report.applied == {"rms_norm": 3 + 5, "gated_mlp": 1 + 2, "rope": 1, "fused_linear_cross_entropy": 1}
    batch = torch.tensor([[7, 8, *[5] * 16, 9, 10, 11]])  # an 8 x 8 image: 4 x 4 patches of 2, one token each
    image = dict(pixel_values=torch.randn(1, 3, 8, 8), image_sizes=torch.tensor([[8, 8]]))
    assert_same_training_step(baseline, patched, batch, baseline_ropes=ropes, **image)
    layer = patched.model.vision_tower.transformer.layers[0]
    assert isinstance(layer.feed_forward, modules.GatedMLP) and layer.feed_forward.gate_proj.weight.grad is not None
    assert isinstance(layer.attention_norm, modules.RMSNorm) and layer.attention_norm.weight.grad is not None
    assert type(patched.model.language_model.layers[0].mlp) is modules.GatedMLP
    assert [entry.split(" (")[0] for entry in apply(tiny("llava")).skipped] == ["swiglu"]  # CLIP's fc1, fc2


def test_a_pixtral_vision_encoder_alone_is_patched_and_has_no_loss(restore_rope):
    """model_type "pixtral" is the vision encoder alone: its parts are swapped, the report says it has no LM head."""
    config = transformers.AutoConfig.for_model("pixtral", **VISION, head_dim=16)
    torch.manual_seed(0)
    baseline = transformers.AutoModel.from_config(config)
    patched = copy.deepcopy(baseline)
    ropes = rope_functions()
    report = apply(patched)
    assert report.applied == {"rms_norm": 3, "gated_mlp": 1, "rope": 1}
    assert report.skipped == ["fused_linear_cross_entropy (pixtral is a vision encoder: it has no LM head)"]
    pixels, sizes = torch.randn(1, 3, 8, 8), torch.tensor([[8, 8]])
    with rope_functions_set(ropes):
        expected = baseline(pixels, image_sizes=sizes).last_hidden_state
    got = patched(pixels, image_sizes=sizes).last_hidden_state
    assert relative_error(got, expected) < 1e-5


def test_lora_adapters_stay_on_the_fused_gate_up_mlp(restore_rope):
    """PEFT LoRA on Phi-3's fused gate_up_proj Linear survives the swap to PackedGatedMLP."""
    assert_lora_adapters_kept("phi3", dict(target_modules=["gate_up_proj", "down_proj"]))


def test_partial_rotary_calls_fall_back_to_the_original(restore_rope):
    baseline = tiny("phi3", partial_rotary_factor=0.5)
    patched = copy.deepcopy(baseline)
    assert apply(patched).applied["rope"] == 1
    assert_same_training_step(baseline, patched, torch.randint(0, 131, (1, 7)))


def test_loss_chunk_tokens_reaches_the_fused_loss(monkeypatch, restore_rope):
    """`apply(loss_chunk_tokens=N)`: the loss runs in chunks of N tokens (several here) with the same result."""
    from tigon.kernels.ops import fused_linear_cross_entropy as fused_module

    baseline = tiny("llama")
    patched = copy.deepcopy(baseline)
    apply(patched, loss_chunk_tokens=7)

    def own_rule(*args, **kwargs):
        raise AssertionError("the op's own chunk rule ran although apply() set the chunk size")

    monkeypatch.setattr(fused_module, "choose_chunk_size", own_rule)
    assert_same_training_step(baseline, patched, torch.randint(0, 131, (2, 19)))  # 36 tokens: 6 chunks
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        apply(tiny("llama"), loss_chunk_tokens=0)


def test_only_requested_kernels_are_applied(restore_rope):
    model = tiny("llama")
    report = apply(model, rope=False, swiglu=False, fused_linear_cross_entropy=False)
    assert set(report.applied) == {"rms_norm"}
    assert type(model).forward is transformers.LlamaForCausalLM.forward
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"


def test_unsupported_model_type_warns_and_names_what_was_not_applied(caplog):
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)
    model = transformers.GPT2LMHeadModel(config)
    with caplog.at_level(logging.WARNING, logger="tigon.kernels"):
        report = apply(model)
    assert report.applied == {} and report.skipped == ["rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"]
    assert "'gpt2' has no kernel table entry" in caplog.text
    assert "not applied: rms_norm, rope, swiglu, fused_linear_cross_entropy" in str(report)


def test_demo_runs_on_cpu(capsys, restore_rope):
    from tigon.kernels import demo

    demo.main(["--steps", "1"])
    printed = capsys.readouterr().out
    assert "Triton's interpreter" in printed and "losses agree" in printed


def test_apply_to_patches_models_built_afterwards(restore_modeling):
    baseline = tiny("qwen3")
    report = tigon.kernels.apply_to("qwen3")
    assert report.applied == {"rms_norm": 1, "gated_mlp": 1, "rope": 1, "fused_linear_cross_entropy": 1}
    assert report.skipped == []
    patched = tiny("qwen3")
    patched.load_state_dict(baseline.state_dict())
    assert type(patched.model.layers[0].self_attn.q_norm).__name__ == "Qwen3RMSNorm"
    assert isinstance(patched.model.layers[0].self_attn.q_norm, modules.RMSNorm)
    assert isinstance(patched.model.layers[0].mlp, modules.GatedMLP)
    assert type(patched).forward.__tigon_original__.__module__.startswith("transformers")
    assert_same_training_step(baseline, patched, torch.randint(0, 131, (1, 7)))
    again = tigon.kernels.apply_to("qwen3")  # idempotent: wraps the HF originals, not its own classes
    assert importlib.import_module(
        patching.FAMILIES["qwen3"].modeling
    ).Qwen3MLP.__tigon_original__.__module__.startswith("transformers")
    assert again.applied == report.applied


@pytest.mark.parametrize("model_type", family_params(["nemotron"]))
def test_apply_to_builds_nemotron_with_its_offset_layer_norms(model_type, restore_modeling):
    overrides = FAMILY_CASES[model_type].overrides
    baseline = tiny(model_type, **overrides)
    for name, parameter in baseline.named_parameters():
        if "layernorm" in name or name == "model.norm.weight":  # zero-centred, as Nemotron stores them
            torch.nn.init.normal_(parameter, std=0.3)
    report = tigon.kernels.apply_to(model_type)
    assert report.applied == {"layer_norm": 1, "fused_linear_cross_entropy": 1, "rope": 1}
    assert [entry.split(" (")[0] for entry in report.skipped] == ["swiglu", "relu_squared"]
    patched = tiny(model_type, **overrides)
    norm = patched.model.layers[0].input_layernorm
    assert type(norm).__name__ == "NemotronLayerNorm1P" and isinstance(norm, modules.OffsetLayerNorm)
    patched.load_state_dict(baseline.state_dict())
    assert_same_training_step(baseline, patched, torch.randint(0, 131, (1, 7)))
    modeling = importlib.import_module(patching.FAMILIES[model_type].modeling)
    with pytest.raises(ValueError, match="elementwise_affine=False"):
        modeling.NemotronLayerNorm1P(64, elementwise_affine=False)


@pytest.mark.parametrize("model_type", family_params(["gemma4_text"]))
def test_apply_to_builds_gemma4_with_its_weightless_norms(model_type, restore_modeling):
    """Gemma 4 builds its value norms with `with_scale=False`: the swapped class takes it and has no weight, and the
    double-wide MLP is built at its own width."""
    overrides = FAMILY_CASES[model_type].overrides
    baseline = tiny(model_type, **overrides)
    report = tigon.kernels.apply_to(model_type)
    assert report.applied == {
        "rms_norm": 1,
        "gated_mlp": 1,
        "gated_experts": 1,
        "fused_linear_cross_entropy": 1,
        "rope": 1,
    }
    patched = tiny(model_type, **overrides)
    assert patched.state_dict().keys() == baseline.state_dict().keys()
    patched.load_state_dict(baseline.state_dict())
    value_norm = patched.model.layers[0].self_attn.v_norm
    assert isinstance(value_norm, modules.RMSNorm) and value_norm.weight is None and value_norm.casting == "gemma"
    assert isinstance(patched.model.layers[2].mlp, modules.GatedMLP)
    assert patched.model.layers[2].mlp.up_proj.out_features == 2 * overrides.get("intermediate_size", 160)
    assert_same_training_step(baseline, patched, torch.randint(0, 131, (2, 9)))


@pytest.mark.parametrize("model_type", ["phi3", "mixtral"])
def test_apply_to_swaps_packed_mlps_and_experts(model_type, restore_modeling):
    """The fused gate_up MLP and the experts (3-D on transformers 5.x, per-expert w1/w3/w2 MLPs on 4.x) keep
    the HF constructor, class name and parameter names."""
    overrides = FAMILY_CASES[model_type].overrides
    baseline = tiny(model_type, **overrides)
    report = tigon.kernels.apply_to(model_type, rms_norm=False, rope=False, fused_linear_cross_entropy=False)
    mlps, experts, _, _ = expected_swaps(model_type)
    patched = tiny(model_type, **overrides)
    assert patched.state_dict().keys() == baseline.state_dict().keys()
    patched.load_state_dict(baseline.state_dict())
    assert sum(isinstance(module, MLP_MODULES) for module in patched.modules()) == mlps
    assert sum(isinstance(module, modules.GatedExperts) for module in patched.modules()) == experts
    assert report.applied == ({"gated_mlp": 1} if mlps else {"gated_experts": 1} if experts else {})
    swapped = next(module for module in patched.modules() if isinstance(module, (*MLP_MODULES, modules.GatedExperts)))
    assert type(swapped).__name__ == {"phi3": "Phi3MLP", "mixtral": "MixtralExperts"}[model_type] or (
        TRANSFORMERS_4 and type(swapped).__name__ == "MixtralBlockSparseTop2MLP"
    )
    if experts:
        assert swapped.config is patched.config
    assert_same_training_step(baseline, patched, torch.randint(0, 131, (1, 7)))


@pytest.mark.parametrize("model_type", family_params(["deepseek_v3", "glm4_moe", "hunyuan_v1_moe"]))
def test_apply_to_builds_shared_and_routed_experts(model_type, restore_modeling):
    """Families whose config names the expert count num_local_experts or n_routed_experts: the swapped experts class
    builds from the config alone, beside the shared experts' MLP, with transformers' parameter names."""
    overrides = FAMILY_CASES[model_type].overrides
    baseline = tiny(model_type, **overrides)
    report = tigon.kernels.apply_to(model_type, rms_norm=False, rope=False, fused_linear_cross_entropy=False)
    assert report.applied == ({"gated_mlp": 1, "gated_experts": 1} if not TRANSFORMERS_4 else {"gated_mlp": 1})
    patched = tiny(model_type, **overrides)
    assert patched.state_dict().keys() == baseline.state_dict().keys()
    patched.load_state_dict(baseline.state_dict())
    mlps, experts, _, _ = expected_swaps(model_type)
    assert sum(isinstance(module, MLP_MODULES) for module in patched.modules()) == mlps
    assert sum(isinstance(module, modules.GatedExperts) for module in patched.modules()) == experts
    assert_same_training_step(baseline, patched, torch.randint(0, 131, (1, 7)))


@pytest.mark.parametrize("model_type", family_params(["deepseek_v2"]))
def test_apply_to_mlp_takes_its_hf_arguments_and_refuses_another_width(model_type, restore_modeling):
    module = importlib.import_module(patching.FAMILIES[model_type].modeling)
    config = tiny(model_type, **FAMILY_CASES[model_type].overrides).config
    tigon.kernels.apply_to(model_type, rms_norm=False, rope=False, fused_linear_cross_entropy=False)
    mlp = module.DeepseekV2MLP(config, hidden_size=config.hidden_size, intermediate_size=24)
    assert isinstance(mlp, modules.GatedMLP) and mlp.up_proj.weight.shape == (24, config.hidden_size)
    with pytest.raises(ValueError, match="runs at config.hidden_size=64, not hidden_size=32; build this module"):
        module.DeepseekV2MLP(config, hidden_size=32)
    with pytest.raises(TypeError, match="unexpected keyword argument 'width'"):
        module.DeepseekV2MLP(config, width=24)


def test_apply_to_reports_unfit_parts_and_unknown_types(restore_modeling, caplog):
    report = tigon.kernels.apply_to("glm4")
    assert report.applied == {"rms_norm": 1, "gated_mlp": 1, "fused_linear_cross_entropy": 1}
    assert [entry.split(" ")[0] for entry in report.skipped] == ["rope"]
    with caplog.at_level(logging.WARNING, logger="tigon.kernels"):
        assert tigon.kernels.apply_to("gpt2").skipped == ["rms_norm", "rope", "swiglu", "fused_linear_cross_entropy"]
    assert "'gpt2' has no kernel table entry" in caplog.text


def test_apply_to_names_what_only_apply_reaches_in_vision_language_families(restore_modeling):
    """`apply_to` swaps a vision-language family's own classes and loss; torch's LayerNorm instances, the vision
    tower's gated MLPs and a wrapped language model's family need a built model, and its report says so."""
    report = tigon.kernels.apply_to("llava")
    assert report.applied == {"fused_linear_cross_entropy": 1}
    assert [entry.split(" (")[0] for entry in report.skipped] == ["swiglu", "layer_norm", "language model"]
    report = tigon.kernels.apply_to("qwen2_5_vl", rope=False)
    assert report.applied == {"rms_norm": 1, "gated_mlp": 1, "fused_linear_cross_entropy": 1}
    assert report.skipped[-1].startswith("swiglu (the vision tower's gated MLPs take the vision config")


def test_wrapped_language_model_outside_the_table_is_named(restore_rope):
    """Llava around a language model tigon has no row for: the vision tower and the loss are patched, the report
    names the language model's family."""
    baseline = tiny("llava")
    baseline.config.text_config.model_type = "gpt2"  # what a checkpoint with another language tower reports
    report = apply(baseline)
    assert report.applied == {"layer_norm": 4, "fused_linear_cross_entropy": 1}
    assert [entry.split(" (")[1][:32] for entry in report.skipped[:3]] == ["the language model is 'gpt2', wh"] * 3


def test_auto_model_from_config_applies_every_kernel_that_fits(restore_rope):
    config = tiny("llama").config
    model = tigon.kernels.AutoModelForCausalLM.from_config(config, swiglu=False, fused_linear_cross_entropy=False)
    assert model.tigon_patch_report.applied == {"rms_norm": 5, "rope": 1}
    assert isinstance(model.model.norm, modules.RMSNorm)
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    model = tigon.kernels.AutoModelForCausalLM.from_pretrained(config)
    assert model.tigon_patch_report.applied == {
        "rms_norm": 5,
        "gated_mlp": 2,
        "rope": 1,
        "fused_linear_cross_entropy": 1,
    }


def test_missing_patch_target_fails_loudly(monkeypatch):
    renamed = dataclasses.replace(patching.FAMILIES["llama"], rms_norm=("LlamaRMSNormRenamed",))
    monkeypatch.setitem(patching.FAMILIES, "llama", renamed)
    model = tiny("llama")
    message = f"LlamaRMSNormRenamed in transformers {transformers.__version__}"
    with pytest.raises(patching.PatchTargetMissing, match=message):
        apply(model)
    with pytest.raises(patching.PatchTargetMissing, match=message):
        tigon.kernels.apply_to("llama")
    gone = dataclasses.replace(renamed, modeling="transformers.models.llama.modeling_gone")
    monkeypatch.setitem(patching.FAMILIES, "llama", gone)
    with pytest.raises(patching.PatchTargetMissing, match="cannot import transformers.models.llama.modeling_gone"):
        apply(model)


@pytest.mark.parametrize("field", ["packed_mlp", "experts"])
def test_missing_mlp_or_experts_class_fails_loudly_on_the_line_that_needs_it(field, monkeypatch):
    """A renamed class in the new table fields fails loudly, except where the row's `before` replaces that field
    on the 4.x line (the 3-D experts classes exist from transformers 5 on)."""
    model_type = "phi3" if field == "packed_mlp" else "qwen3_moe"
    family = patching.FAMILIES[model_type]
    renamed = dataclasses.replace(family, **{field: ("RenamedClass",)})
    monkeypatch.setitem(patching.FAMILIES, model_type, renamed)
    line_4 = dict(dict(family.before).get("5.0", ()))
    if TRANSFORMERS_4 and field in line_4:
        assert patching.modeling_module(model_type) is not None
        assert getattr(renamed.installed(), field) == line_4[field]
    else:
        with pytest.raises(patching.PatchTargetMissing, match="has no RenamedClass in transformers"):
            patching.modeling_module(model_type)


@pytest.mark.parametrize(
    ("version", "softcap", "experts"),
    [("5.24.0", True, ("X",)), ("5.23.0.dev0", True, ("X",)), ("5.22.2", False, ("X",)), ("4.57.1", False, ())],
)
def test_a_row_takes_the_fields_of_the_lines_older_than_its_versions(version, softcap, experts, monkeypatch):
    """PaliGemma's head softcaps its logits from transformers 5.23 on, and the 4.x line lays experts out apart:
    a row's `before` entries apply on every older line, the oldest's over the newer's."""
    row = dataclasses.replace(
        patching.FAMILIES["paligemma"],
        experts=("X",),
        before=(("5.0", (("experts", ()), ("final_logit_softcapping", False))), *patching.FAMILIES["paligemma"].before),
    )
    monkeypatch.setattr(patching, "_transformers_version", lambda: version)
    installed = row.installed()
    assert (installed.final_logit_softcapping, installed.experts, installed.before) == (softcap, experts, ())


@pytest.mark.parametrize(
    ("version", "casting"), [("5.24.0", "gemma"), ("5.20.0", "gemma"), ("5.19.1", "llama"), ("5.17.0", "llama")]
)
def test_deepseek_v4_norm_casting_follows_the_installed_line(version, casting, monkeypatch):
    """DeepSeek-V4's RMSNorm multiplies its float32 weight before the one cast from transformers 5.20 on, after
    casting the normed input before that."""
    monkeypatch.setattr(patching, "_transformers_version", lambda: version)
    assert patching.FAMILIES["deepseek_v4"].installed().norm_casting == casting


@pytest.mark.parametrize("model_type", family_params(["deepseek_v4"]))
def test_deepseek_v4_norm_matches_on_bf16_inputs_with_float32_weights(model_type):
    """The row's casting is the installed line's: the same output dtype and values as DeepseekV4RMSNorm."""
    row = patching.FAMILIES[model_type].installed()
    theirs = importlib.import_module(row.modeling).DeepseekV4RMSNorm(48).to(torch.float32)
    torch.manual_seed(0)
    torch.nn.init.uniform_(theirs.weight, 0.5, 1.5)
    ours = modules.RMSNorm.from_module(copy.deepcopy(theirs), casting=row.norm_casting)
    x = torch.randn(5, 48, dtype=torch.bfloat16)
    expected, got = theirs(x), ours(x)
    assert got.dtype == expected.dtype
    assert relative_error(got.float(), expected.float()) < 1e-2


def test_import_tigon_kernels_stays_light():
    import subprocess
    import sys

    code = "import sys, tigon.kernels; assert 'transformers' not in sys.modules and 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert tigon.kernels.apply is apply
