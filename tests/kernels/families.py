"""The model families' tiny test models and what patching each swaps (`FAMILY_CASES`), and the comparisons the
patching, loss, convergence, MoE and classification tests share."""

import contextlib
import copy
import importlib.util
from typing import NamedTuple

import pytest
import torch
from torch import nn

from tests.kernels.helpers import installed_modeling, relative_error
from tigon.kernels.patching import FAMILIES, apply

transformers = pytest.importorskip("transformers")


# A one-layer vision tower per vision-language family (its config's own names), and for the rows whose language
# tower is any model, the text model_type built here. The tests feed text only (the vision tower gets no gradient),
# except test_patching.py's `test_vision_language_model_with_an_image_matches_eager`.
VISION = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=8, patch_size=2
)
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=2)
# GLM-4V's vision MLP is out_hidden_size wide, which is also the language tower's hidden size.
GLM4V_VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=2)
MULTIMODAL = {
    "qwen2_vl": (dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=2), {}),
    "qwen2_5_vl": (dict(QWEN_VISION, window_size=4, fullatt_block_indexes=[0]), {}),
    "qwen3_vl": (dict(QWEN_VISION, num_position_embeddings=16, deepstack_visual_indexes=[0]), {}),
    "qwen3_vl_moe": (dict(QWEN_VISION, num_position_embeddings=16, deepstack_visual_indexes=[0]), {}),
    "qwen3_5": (dict(QWEN_VISION, num_position_embeddings=16), {}),
    "qwen3_5_moe": (dict(QWEN_VISION, num_position_embeddings=16), {}),
    "gemma3": (VISION, dict(mm_tokens_per_image=4)),
    "gemma4": (dict(VISION, head_dim=16, pooling_kernel_size=2), {}),
    "mllama": (
        dict(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_global_layers=1,
            attention_heads=2,
            image_size=8,
            patch_size=2,
            max_num_tiles=1,
            intermediate_layers_indices=[0],
            vision_output_dim=64,
            supported_aspect_ratios=[[1, 1]],
        ),
        {},
    ),
    "llama4": (
        dict(VISION, vision_output_dim=32, projector_input_dim=64, projector_output_dim=64, pixel_shuffle_ratio=0.5),
        {},
    ),
    "llava": (dict(VISION, projection_dim=32), dict(model_type="llama")),
    "paligemma": (dict(VISION, projection_dim=64), dict(model_type="gemma2")),
    "internvl": (dict(VISION, image_size=[8, 8], patch_size=[2, 2]), dict(model_type="qwen2")),
    "mistral3": (dict(VISION, head_dim=16), dict(model_type="mistral")),
    "glm4v": (GLM4V_VISION, {}),
    "glm4v_moe": (GLM4V_VISION, {}),
    "smolvlm": (VISION, dict(model_type="llama")),
    "muse_glimmer": (dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2), {}),
}
# Top-level sizes of a vision-language config that follow its tiny vision tower: MUSE Glimmer's vision adapter takes
# the tower's merged patches (2 x 2 of 32 wide).
OUTER = {"muse_glimmer": dict(out_hidden_size=128, projector_hidden_size=64)}
# Phi-4-multimodal keeps its text settings at the top of its config, beside its vision and audio towers'.
TOWERS = {
    "phi4_multimodal": dict(
        vision_config=dict(VISION, crop_size=8, image_token_id=3),
        audio_config=dict(
            hidden_size=32,
            intermediate_size=48,
            num_blocks=1,
            num_attention_heads=2,
            ext_pw_out_channel=32,
            depthwise_separable_out_channel=32,
            nemo_conv_channels=32,
            audio_token_id=4,
        ),
    )
}


def tiny(family: str, outer: dict | None = None, vision: dict | None = None, **overrides):
    """The family's tiny model; `overrides` go to the (text) config, `outer` to a vision-language config's top,
    `vision` (in place of MULTIMODAL's) to its vision_config."""
    common = dict(
        hidden_size=64,
        intermediate_size=160,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=131,
        max_position_embeddings=64,
        head_dim=16,
        pad_token_id=0,
    )
    common.update(overrides)
    torch.manual_seed(0)
    if family not in MULTIMODAL:
        config = transformers.AutoConfig.for_model(family, **common, **TOWERS.get(family, {}))
        return transformers.AutoModelForCausalLM.from_config(config)
    tower, text = MULTIMODAL[family]
    config = transformers.AutoConfig.for_model(
        family, text_config={**text, **common}, vision_config=vision or tower, **OUTER.get(family, {}), **(outer or {})
    )
    return transformers.AutoModelForImageTextToText.from_config(config)


MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# DeepSeek-V2/V3: multi-head latent attention (query and key/value latents, each RMS-normed; every head its own keys;
# the rotary part of a head is its head_dim), layer 0 dense, layer 1 routed experts beside a shared one
DEEPSEEK = dict(
    num_key_value_heads=4,
    n_routed_experts=4,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    head_dim=8,
    v_head_dim=16,
    **MOE,
)
# DeepSeek-V4: one key/value head, a query latent, grouped output projections, two residual streams mixed by
# hyper-connections; a heavily compressed attention layer with hash routing, then a compressed sparse one (its
# indexer) with top-k routing, each with routed experts beside a shared one
DEEPSEEK_V4 = dict(
    num_key_value_heads=1,
    head_dim=32,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=4,
    sliding_window=4,
    hc_mult=2,
    hc_sinkhorn_iters=3,
    n_routed_experts=4,
    layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
    mlp_layer_types=["hash_moe", "moe"],
    compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    **MOE,
)
GPT_OSS = dict(num_local_experts=4, num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"])
FALCON_H1 = dict(
    mamba_d_ssm=32,
    mamba_n_heads=4,
    mamba_d_head=8,
    mamba_d_state=8,
    mamba_chunk_size=8,
    mlp_multipliers=[0.5, 1.5],
    lm_head_multiplier=0.7,
)
# Layer 0 dense, layer 1 MoE (Llama4TextMLP as its shared expert); both layers with RoPE
LLAMA4 = dict(
    num_local_experts=2,
    intermediate_size=32,
    intermediate_size_mlp=160,
    moe_layers=[1],
    no_rope_layers=[1, 1],
    layer_types=["full_attention", "full_attention"],
)
# Gemma 4, three layers: the third shares the keys and values of the second (both full attention, whose heads are
# wider, with proportional RoPE) and has the double-wide MLP; per-layer embeddings on. Its multimodal row runs the
# MoE block beside each layer's MLP instead, without per-layer embeddings.
GEMMA4 = dict(
    num_hidden_layers=3,
    layer_types=["sliding_attention", "full_attention", "full_attention"],
    sliding_window=4,
    global_head_dim=32,
    num_kv_shared_layers=1,
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=1000,
    final_logit_softcapping=30.0,
)
GEMMA4_MOE = dict(
    global_head_dim=32,
    hidden_size_per_layer_input=0,
    enable_moe_block=True,
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=32,
    final_logit_softcapping=30.0,
)
# Qwen3-Next and Qwen 3.5: a Gated DeltaNet layer, then a full attention one (their gated queries, query and key norms,
# partial RoPE); Qwen 3.5's rotated half of the head dim (8 of 16) split into its three multimodal sections.
GATED_DELTANET = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)
QWEN3_NEXT = dict(GATED_DELTANET, num_experts=4, shared_expert_intermediate_size=48, mlp_only_layers=[1], **MOE)
QWEN3_5_ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[2, 1, 1])
TRANSFORMERS_4 = transformers.__version__.startswith("4.")
# transformers 5 names the RoPE settings rope_parameters (and requires rope_theta there), 4.x rope_scaling
ROPE_KEY = "rope_scaling" if TRANSFORMERS_4 else "rope_parameters"
MROPE = {ROPE_KEY: dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2])}
# GLM-4V rotates the whole head here (partial_rotary_factor defaults to 0.5), so tigon's RoPE runs where it fits
GLM4V_ROPE = {ROPE_KEY: dict(MROPE[ROPE_KEY], partial_rotary_factor=1.0), "partial_rotary_factor": 1.0}
GLM4V_MOE = dict(GLM4V_ROPE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, **MOE)


class Swaps(NamedTuple):
    """What `apply` swaps in a family's 2-layer tiny model, and what its report must skip."""

    mlps: int  # gated MLPs swapped (GatedMLP or PackedGatedMLP)
    experts: int  # MoE experts modules swapped (GatedExperts)
    rope: bool  # RoPE swapped
    skipped: list[str]  # the report's skipped entries start with these, in order


class FamilyCase(NamedTuple):
    """A family's tiny model (`tiny(model_type, **overrides)`) and what patching it swaps."""

    overrides: dict  # config overrides on top of `tiny`'s common sizes
    swaps: Swaps


def case(overrides: dict, mlps: int, experts: int, rope: bool, skipped: list[str]) -> FamilyCase:
    """One row of FAMILY_CASES, written flat."""
    return FamilyCase(overrides, Swaps(mlps, experts, rope, skipped))


FAMILY_CASES = {
    "llama": case({}, 2, 0, True, []),
    "qwen3": case({}, 2, 0, True, []),
    "gemma": case({}, 2, 0, True, []),
    "mixtral": case(dict(num_local_experts=4, num_experts_per_tok=2), 0, 2, True, []),
    "deepseek_v3": case(DEEPSEEK, 1 + 1, 1, False, ["rope (DeepSeek-V3"]),
    "deepseek_v2": case(DEEPSEEK, 1 + 1, 1, False, ["rope (DeepSeek-V2"]),
    "hunyuan_v1_moe": case(dict(num_experts=4, moe_topk=2), 2, 2, True, []),
    "ministral": case({}, 2, 0, True, []),
    "qwen2_moe": case(dict(num_experts=4, shared_expert_intermediate_size=48, **MOE), 2, 2, True, []),
    "qwen3_moe": case(dict(num_experts=4, mlp_only_layers=[1], **MOE), 1, 1, True, []),
    "qwen3_next": case(QWEN3_NEXT, 2, 1, True, ["rms_norm (the Gated DeltaNet"]),
    "qwen3_5": case(
        dict(GATED_DELTANET, **{ROPE_KEY: QWEN3_5_ROPE}),
        2,
        0,
        True,
        ["rms_norm (the Gated DeltaNet", "rope (the vision", "swiglu (the vision"],
    ),
    "qwen3_5_moe": case(
        dict(GATED_DELTANET, num_experts=4, shared_expert_intermediate_size=48, **{ROPE_KEY: QWEN3_5_ROPE}, **MOE),
        2,
        2,
        True,
        ["rms_norm (the Gated DeltaNet", "rope (the vision", "swiglu (the vision"],
    ),
    "exaone4": case({}, 2, 0, True, []),
    "hunyuan_v1_dense": case({}, 2, 0, True, []),
    "gemma2": case({}, 2, 0, True, []),
    "gemma3_text": case({}, 2, 0, True, []),
    "gemma4_text": case(GEMMA4, 3, 0, True, ["swiglu (Gemma 4's per-layer"]),
    "phi3": case({}, 2, 0, True, []),
    "olmo2": case({}, 2, 0, True, []),
    "glm4": case({}, 2, 0, False, ["rope (Glm4"]),
    "granite": case({}, 2, 0, True, []),
    # the whole head rotated here (its members rotate half, which keeps transformers' function), so tigon's RoPE runs
    "nemotron": case(dict(partial_rotary_factor=1.0), 0, 0, True, ["swiglu (Nemotron's MLP"]),
    "deepseek_v4": case(
        DEEPSEEK_V4, 0, 0, False, ["rope (DeepSeek-V4", "swiglu (DeepSeek-V4", "rms_norm (the weightless"]
    ),
    "smollm3": case({}, 2, 0, True, []),
    "olmo3": case({}, 2, 0, True, []),
    "glm4_moe": case(dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, **MOE), 2, 1, True, []),
    "gpt_oss": case(GPT_OSS, 0, 0, False, ["rope (GPT-OSS", "swiglu (GPT-OSS"]),
    "falcon_h1": case(FALCON_H1, 2, 0, True, ["rms_norm (the Mamba"]),
    "llama4_text": case(LLAMA4, 2, 0, False, ["rope (Llama 4", "swiglu (Llama 4", "rms_norm (Llama 4"]),
    "llama4": case(
        LLAMA4, 2, 0, False, ["rope (Llama 4", "swiglu (Llama 4", "rms_norm (Llama 4", "swiglu (the vision"]
    ),
    "qwen2_vl": case(MROPE, 2, 0, True, ["rope (the vision", "swiglu (the vision"]),
    "qwen2_5_vl": case(MROPE, 2 + 1, 0, True, ["rope (the vision"]),
    "qwen3_vl": case(MROPE, 2, 0, True, ["rope (the vision", "swiglu (the vision"]),
    "qwen3_vl_moe": case(dict(MROPE, num_experts=4, **MOE), 0, 2, True, ["rope (the vision", "swiglu (the vision"]),
    "gemma3": case({}, 2, 0, True, ["swiglu (the vision"]),
    "gemma4": case(GEMMA4_MOE, 2 + 1, 2, True, ["swiglu (Gemma 4's per-layer", "swiglu (the audio"]),
    "mllama": case(
        dict(cross_attention_layers=[1], **{ROPE_KEY: dict(rope_type="default", rope_theta=10000.0)}),
        2,
        0,
        True,
        ["swiglu (the vision"],
    ),
    "phi4_multimodal": case({}, 2, 0, True, ["swiglu (the vision", "swiglu (the audio"]),
    "llava": case({}, 2, 0, True, ["swiglu (the vision"]),
    "paligemma": case({}, 2, 0, True, ["swiglu (the vision"]),
    "internvl": case({}, 2, 0, True, ["swiglu (the vision"]),
    "mistral3": case({}, 2 + 1, 0, True, []),  # the Pixtral vision tower's gated MLP through Pixtral's row
    "glm4v": case(GLM4V_ROPE, 2 + 1, 0, False, ["rope (GLM-4V", "rope (the vision", "swiglu (the vision patch"]),
    "glm4v_moe": case(GLM4V_MOE, 2 + 1, 1, True, ["rope (the vision", "swiglu (the vision patch"]),
    "smolvlm": case({}, 2, 0, True, ["swiglu (the vision"]),
    # centered decoder norms beside plain and weightless ones; the logits scaled by output_multiplier, then softcapped
    # (0.5: the member's 0.196 under the softcap of 20 keeps a tiny model's loss from falling in the tests' 30 steps)
    "muse_glimmer": case(dict(output_multiplier=0.5), 2, 0, True, ["swiglu (the vision", "rope (the vision"]),
}


def shipped(model_type: str) -> bool:
    """Whether the installed transformers has the family's modeling module (older releases predate newer families)."""
    try:
        return importlib.util.find_spec(FAMILIES[model_type].modeling) is not None
    except ModuleNotFoundError:  # its model folder is missing too
        return False


def family_params(model_types) -> list:
    """One pytest param per family; a family the installed transformers predates is skipped, with the reason."""
    return [
        pytest.param(
            model_type,
            marks=pytest.mark.skipif(
                not shipped(model_type),
                reason=f"transformers {transformers.__version__} has no {FAMILIES[model_type].modeling}: "
                f"{model_type} needs a newer transformers",
            ),
        )
        for model_type in model_types
    ]


def rope_functions() -> dict:
    """Every table family's modeling module -> its module-level `apply_rotary_pos_emb` now."""
    modelings = {module for family in FAMILIES.values() if (module := installed_modeling(family.modeling))}
    return {module: module.apply_rotary_pos_emb for module in modelings if hasattr(module, "apply_rotary_pos_emb")}


@contextlib.contextmanager
def rope_functions_set(functions: dict | None):
    """The modules' `apply_rotary_pos_emb` set to `functions` (`rope_functions()` before `apply`) for the block;
    None leaves them. tigon's RoPE patch is module-wide (a vision-language model's language tower may be another
    family's), so without this an unpatched baseline built from the same family runs tigon's RoPE too."""
    saved = rope_functions()
    for module, function in (functions or {}).items():
        module.apply_rotary_pos_emb = function
    try:
        yield
    finally:
        for module, function in saved.items():
            module.apply_rotary_pos_emb = function


FLOAT64_BOUND = 1e-4  # how far from float64 a gradient that differs from transformers' may lie


def float64_gradients(baseline, batch, labels, baseline_ropes: dict | None = None, **inputs) -> dict:
    """Every parameter's gradient of the loss in a float64 copy of `baseline` (its MoE experts as eager loops)."""
    truth = copy.deepcopy(baseline).double()
    truth.zero_grad(set_to_none=True)
    if hasattr(truth, "set_experts_implementation"):
        truth.set_experts_implementation("eager")  # transformers' plain loop, in any dtype
    with rope_functions_set(baseline_ropes):
        truth(input_ids=batch, labels=labels, **inputs).loss.backward()
    return {name: parameter.grad for name, parameter in truth.named_parameters() if parameter.grad is not None}


def assert_same_gradients(baseline, patched, bound: float, float64_run) -> None:
    """Every parameter's gradient within `bound` (relative) of transformers' (a vision tower fed no image has none, in
    both models).

    A gradient that nearly cancels (Qwen 3.5's Gated DeltaNet decay parameters, `dt_bias` and `A_log`, about 1e-5
    where others are 1e-1) is mostly rounding: transformers' own fp32 one lies up to 1.2e-4 from float64 there, and
    the fused loss's rounding alone moves it 3.6e-5. Where ours and transformers' differ by more than `bound`, ours
    must be within FLOAT64_BOUND of the float64 gradients of `float64_run()`, or at most twice as far from them as
    transformers' fp32 one is."""
    apart = []
    for (name, theirs), (_, ours) in zip(baseline.named_parameters(), patched.named_parameters(), strict=True):
        assert (ours.grad is None) == (theirs.grad is None), name
        if theirs.grad is not None and relative_error(ours.grad, theirs.grad) >= bound:
            apart.append((name, theirs.grad, ours.grad))
    truth = float64_run() if apart else {}
    for name, theirs, ours in apart:
        ours_error, theirs_error = relative_error(ours, truth[name]), relative_error(theirs, truth[name])
        assert ours_error <= max(FLOAT64_BOUND, 2 * theirs_error), f"{name}: {ours_error:.2e} from float64"


def assert_same_training_step(baseline, patched, batch, baseline_ropes: dict | None = None, **inputs):
    """One forward and backward with labels: the same loss, eval logits and every gradient (`assert_same_gradients`).
    `baseline_ropes`: the RoPE functions the baseline runs (`rope_functions_set`)."""
    with rope_functions_set(baseline_ropes):
        expected = baseline(input_ids=batch, labels=batch, **inputs)
        expected.loss.backward()
        with torch.no_grad():
            expected_logits = baseline(input_ids=batch, **inputs).logits
    got = patched(input_ids=batch, labels=batch, **inputs)
    got.loss.backward()
    assert abs(got.loss.item() - expected.loss.item()) < 1e-5
    with torch.no_grad():
        assert relative_error(patched(input_ids=batch, **inputs).logits, expected_logits) < 1e-5
    assert_same_gradients(
        baseline, patched, 1e-4, lambda: float64_gradients(baseline, batch, batch, baseline_ropes, **inputs)
    )


def own_failure(model, batch) -> Exception | None:
    """The error transformers' own forward raises on a text batch with labels, or None when it runs (transformers
    5.24's Llama4ForConditionalGeneration reads `image_outputs`, which its language model's output lacks)."""
    try:
        model(input_ids=batch, labels=batch)
    except AttributeError as error:
        return error
    model.zero_grad(set_to_none=True)
    return None


def assert_lora_adapters_kept(model_type: str, targets: dict) -> None:
    """PEFT LoRA on a swapped module's parameters: the swapped module keeps the adapters, same gradients."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, init_lora_weights=False, **targets)
    wrapped = peft.get_peft_model(tiny(model_type, **FAMILY_CASES[model_type].overrides), config)
    patched = copy.deepcopy(wrapped)
    applied = apply(patched).applied
    assert applied.get("gated_mlp" if model_type == "phi3" else "gated_experts") == 2
    batch = torch.randint(0, 131, (2, 9))
    expected, got = wrapped(input_ids=batch, labels=batch), patched(input_ids=batch, labels=batch)
    expected.loss.backward()
    got.loss.backward()
    assert abs(got.loss.item() - expected.loss.item()) < 1e-5
    trained = [
        (name, p, q) for (name, p), (_, q) in zip(wrapped.named_parameters(), patched.named_parameters(), strict=True)
    ]
    trained = [entry for entry in trained if entry[1].requires_grad]
    assert any(".mlp." in name for name, _, _ in trained)
    for name, theirs, ours in trained:
        assert relative_error(ours.grad, theirs.grad) < 1e-4, name


def moe_experts(family: str, implementation: str):
    """A transformers 5.x experts module (3-D gate_up_proj/down_proj) with random weights, and its config."""
    import transformers

    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    name = {"mixtral": "MixtralExperts", "qwen2_moe": "Qwen2MoeExperts", "qwen3_moe": "Qwen3MoeExperts"}[family]
    assert hasattr(modeling, name), f"transformers {transformers.__version__} has no {name} (3-D experts are 5.x)"
    sizes = dict(hidden_size=48, intermediate_size=40, moe_intermediate_size=40, num_experts_per_tok=2)
    config = transformers.AutoConfig.for_model(family, num_experts=5, **sizes)
    config._experts_implementation = implementation
    experts = getattr(modeling, name)(config)
    nn.init.normal_(experts.gate_up_proj, std=0.2)
    nn.init.normal_(experts.down_proj, std=0.2)
    return experts, config
