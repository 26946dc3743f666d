"""Swap tigon's kernels into Hugging Face models, driven by one table keyed on `model_type`.

Norms, MLPs and MoE experts are replaced per instance (sharing parameters and Linear layers); RoPE is
the module-level `apply_rotary_pos_emb` of the family's modeling file, so it applies to every model
of that family in the process. Vision-language rows patch the language tower and the LM head's loss,
and the vision tower's norms and gated MLPs where a tigon op computes the same function; the report
names what each family leaves as transformers wrote it, and why.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from tigon.kernels import functional
from tigon.kernels.modules import (
    GatedExpertMLP,
    GatedExperts,
    GatedMLP,
    GemmaRMSNorm,
    LayerNorm,
    OffsetLayerNorm,
    PackedGatedMLP,
    ReLUSquared,
    RMSNorm,
)
from tigon.kernels.patching.causal_lm import (
    CHECK_TARGETS,
    LOSS_CHUNK_TOKENS,
    fused_class,
    fused_forward,
    keep_last_hidden_state,
)
from tigon.kernels.patching.last_layer import FIRST_TRANSFORMERS, loss_rows_class
from tigon.kernels.utils import check_chunk_size

logger = logging.getLogger("tigon.kernels")


class PatchTargetMissing(RuntimeError):
    """A table entry names a class or function the installed transformers no longer has."""


@dataclass(frozen=True)
class Family:
    """What tigon swaps in one model family: the modeling module and the classes to replace.

    The gated MLPs come in four layouts, one field each (`MLP_SWAPS` says what replaces them):
    `mlp` has separate gate_proj/up_proj/down_proj Linear layers (GatedMLP), `packed_mlp` one fused
    gate_up_proj Linear (PackedGatedMLP; Phi-3, GLM-4), `experts` the transformers 5.x MoE experts'
    3-D gate_up_proj/down_proj parameters (GatedExperts), `expert_mlp` one expert with Mixtral's w1/w3/w2
    Linear layers (GatedExpertMLP; transformers 4.x).

    `in_place_norm_backward` lets the norms write their input gradient over the incoming one.
    That is safe when every norm opens a branch (pre-norm blocks: the gradient reaching it is
    a fresh sum from the projections); a family with norms whose output joins the residual
    stream directly (Gemma 2/3 and OLMo 2 post-norms, GLM-4's) must set it False.

    `norm_casting` is "gemma" for norms that scale in float32 and cast once at the end.
    `centered_norm` lists RMSNorm classes that scale by `1 + weight` in float32 (Gemma's form, GemmaRMSNorm) beside
    the row's other `rms_norm` classes (MUSE Glimmer's decoder norms beside its plain final and weightless ones).
    `offset_layer_norm` lists LayerNorm classes that scale by `1 + weight` (Nemotron's), swapped for tigon's
    OffsetLayerNorm under the norm switch and reported as `layer_norm`.
    `activations` lists transformers' activation classes (`transformers.activations`, built through `ACT2FN`)
    whose instances `apply` swaps for tigon's under the MLP switch (`ACTIVATION_SWAPS`: Nemotron's squared ReLU).
    `rope` is False where the family's `apply_rotary_pos_emb` is not the Llama rotate-half form;
    `partial_rope` routes calls whose `cos` covers only part of the head dim to the original;
    `mlp_width(config, layer_idx)` is the width of the row's `mlp` classes where transformers builds them from
    `(config, layer_idx)` (Gemma 4's double-wide MLP): `apply_to`'s classes then take those arguments.
    `rope_one_tensor` marks a family whose `apply_rotary_pos_emb(x, cos, sin, unsqueeze_dim)` rotates one tensor
    (Gemma 4 rotates queries and keys in separate calls).
    `unfit` lists `(kernel, reason)` for parts of the family no tigon kernel fits; the report
    names them whenever that kernel is requested.
    `before` lists `(version, fields)`: on a transformers older than `version`, the `(field, value)` pairs of
    `fields` replace this row's (classes an older line lays out differently, a head quirk it did not have yet;
    see `Family.installed`).
    The fused linear cross entropy replaces the forward of the `causal_lm` class (`*ForCausalLM`, or a
    vision-language model's `*ForConditionalGeneration`); `final_logit_softcapping`, `logits_scaling` and
    `logits_multiplier` name the family's head quirks, read from the text config (Gemma 2/3 and PaliGemma
    softcap the logits, Granite divides them; `logits_multiplier` names the config field the logits are multiplied
    by, before any softcap: Falcon-H1's `lm_head_multiplier`, MUSE Glimmer's `output_multiplier`).
    `loss_rows_layer` names the decoder layer class of a family whose layers are Llama's pre-norm block, or Gemma's
    with a norm after each branch too, and whose decoder ends in its norm: with the fused loss, the last layer
    computes past its attention only the rows the loss reads (`tigon.kernels.patching.last_layer`; in an MoE row
    only while no router logits are output, as their auxiliary loss counts every row).

    Vision-language rows: `vision_mlp` lists the vision tower's gated MLPs (built from `config.vision_config`,
    so `apply` swaps them and `apply_to` leaves them), `layer_norm` swaps every affine `torch.nn.LayerNorm`
    (the vision tower's and projector's; the language tower has RMSNorms) for tigon's under the norm switch,
    and `language_model` marks a row whose language tower is whatever model `text_config.model_type` names
    (Llava, PaliGemma, InternVL, Mistral 3): `apply` also applies that family's row to it. Such a row's vision tower
    may be a model with a row of its own too, a vision encoder's (`causal_lm=None`: Pixtral's, in Llava and
    Mistral 3), which `apply` then applies; `vision_unfit` lists what the row's usual vision tower leaves, reported
    where the built model's tower has no row.
    """

    modeling: str
    rms_norm: tuple[str, ...]
    mlp: tuple[str, ...] = ()
    packed_mlp: tuple[str, ...] = ()
    experts: tuple[str, ...] = ()
    expert_mlp: tuple[str, ...] = ()
    gemma_norm: bool = False
    centered_norm: tuple[str, ...] = ()
    in_place_norm_backward: bool = True
    norm_casting: str = "llama"
    offset_layer_norm: tuple[str, ...] = ()
    activations: tuple[str, ...] = ()
    rope: bool = True
    partial_rope: bool = False
    rope_one_tensor: bool = False
    mlp_width: Callable[[object, int], int] | None = None
    unfit: tuple[tuple[str, str], ...] = ()
    vision_mlp: tuple[str, ...] = ()
    layer_norm: bool = False
    language_model: bool = False
    vision_unfit: tuple[tuple[str, str], ...] = ()
    causal_lm: str | None = field(kw_only=True)
    final_logit_softcapping: bool = False
    logits_scaling: bool = False
    logits_multiplier: str | None = None
    loss_rows_layer: str | None = None
    before: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()

    def installed(self) -> Family:
        """This row for the installed transformers: with the `before` fields of every version newer than it,
        the oldest version's last (so the nearest line's layout wins)."""
        installed = _transformers_release()
        if not self.before or installed is None:
            return self
        from packaging.version import Version  # transformers' own dependency

        fields: dict[str, object] = {}
        for version, replaced in sorted(self.before, key=lambda entry: Version(entry[0]), reverse=True):
            if installed < Version(version):
                fields.update(replaced)
        return dataclasses.replace(self, before=(), **fields)


# Table field -> the tigon module that replaces its classes (`from_module(module, config)`, and the HF
# constructor for `apply_to`) and the report's name for the swap.
MLP_SWAPS: dict[str, tuple[type, str]] = {
    "mlp": (GatedMLP, "gated_mlp"),
    "packed_mlp": (PackedGatedMLP, "gated_mlp"),
    "experts": (GatedExperts, "gated_experts"),
    "expert_mlp": (GatedExpertMLP, "gated_mlp"),
}


ACTIVATION_SWAPS: dict[str, tuple[type, str]] = {"ReLUSquaredActivation": (ReLUSquared, "relu_squared")}


def _models(name: str) -> str:
    return f"transformers.models.{name}.modeling_{name}"


# transformers 4.x keeps MoE experts as one MLP module per expert: the Qwen MoE ones are the family's `mlp`
# class, Mixtral's is MixtralBlockSparseTop2MLP (w1/w3/w2).
_EXPERTS_4X = (("experts", ()),)
# What no tigon kernel computes, shared by several rows: (kernel, reason) for the report.
_VISION_FC_MLP = (
    "swiglu",
    "the vision tower's MLP is fc1, an activation, fc2 with no gate: no tigon kernel computes it",
)
_VISION_ROPE = ("rope", "the vision tower's 2-D RoPE (apply_rotary_pos_emb_vision) keeps transformers' function")
_MROPE_4X = (
    "rope",
    "transformers 4.x applies the multimodal RoPE in apply_multimodal_rotary_pos_emb, slicing cos/sin per "
    "mrope_section; tigon's RoPE is the 1-D form (transformers 5 folds the sections into cos/sin first)",
)
_QWEN2_VL_UNFIT_4X = (_MROPE_4X, _VISION_ROPE, _VISION_FC_MLP)
_QWEN3_VL_MOE_4X = (
    "swiglu",
    "transformers 4.x keeps Qwen3VLMoeTextExperts transposed ([E, H, 2I]) and runs them as a bmm",
)
_DEEPSEEK_V3_ROPE = (
    "rope",
    "DeepSeek-V3's attention rotates interleaved pairs (apply_rotary_pos_emb_interleave, under config.rope_interleave, "
    "its default); tigon's RoPE is rotate-half",
)
_LLAMA4_TEXT = (
    ("rope", "Llama 4's apply_rotary_emb rotates interleaved pairs as complex numbers; tigon's RoPE is rotate-half"),
    (
        "swiglu",
        "Llama 4's experts run every expert on router-scaled inputs as one dense bmm; tigon's experts are routed top-k",
    ),
    ("rms_norm", "Llama 4's weightless QK L2 norm (Llama4TextL2Norm) stays"),
)


def _gemma4_mlp_width(config, layer_idx: int) -> int:
    """Gemma4TextMLP's width: twice `intermediate_size` in the layers that reuse another layer's keys and values,
    under `use_double_wide_mlp`."""
    double = config.use_double_wide_mlp and config.kv_sharing_modes[layer_idx] == "reuse"
    return config.intermediate_size * (2 if double else 1)


# Gemma 4: a gated MLP no module holds, and the audio tower's ungated one.
_GEMMA4_PER_LAYER = (
    "swiglu",
    "Gemma 4's per-layer embeddings (hidden_size_per_layer_input) gate act(per_layer_input_gate(h)) * "
    "per_layer_input inside the decoder layer's forward, not in a module tigon swaps",
)
_GEMMA4_AUDIO_MLP = (
    "swiglu",
    "the audio tower's feed-forward is ffw_layer_1, an activation, ffw_layer_2 with no gate: no tigon kernel "
    "computes it",
)
# GLM-4V / GLM-4.5V: the vision patch merger's gated MLP.
_GLM4V_MERGER = (
    "swiglu",
    "the vision patch merger runs its gated MLP inside its own forward, after a projection, a LayerNorm and a "
    "GELU: no module of its own for tigon to swap",
)


def _gated_deltanet_norm(name: str) -> tuple[str, str]:
    """Qwen3-Next's and Qwen 3.5's unfit gated norm, the Gated DeltaNet layers' output norm `name`."""
    return (
        "rms_norm",
        f"the Gated DeltaNet layers' {name} norms in the input dtype, then multiplies by silu(gate) in float32: "
        "no tigon kernel computes that gated norm",
    )


FAMILIES: dict[str, Family] = {
    "llama": Family(
        _models("llama"),
        ("LlamaRMSNorm",),
        ("LlamaMLP",),
        causal_lm="LlamaForCausalLM",
        loss_rows_layer="LlamaDecoderLayer",
    ),
    "mistral": Family(
        _models("mistral"),
        ("MistralRMSNorm",),
        ("MistralMLP",),
        causal_lm="MistralForCausalLM",
        loss_rows_layer="MistralDecoderLayer",
    ),
    "mixtral": Family(
        _models("mixtral"),
        ("MixtralRMSNorm",),
        experts=("MixtralExperts",),
        before=(("5.0", (*_EXPERTS_4X, ("expert_mlp", ("MixtralBlockSparseTop2MLP",)))),),
        causal_lm="MixtralForCausalLM",
    ),
    "deepseek_v3": Family(
        _models("deepseek_v3"),
        ("DeepseekV3RMSNorm",),  # the decoder's and the attention's query and key/value latent norms
        # the shared experts and dense (first_k_dense_replace) layers; on transformers 4.x every expert
        ("DeepseekV3MLP",),
        experts=("DeepseekV3Experts",),
        rope=False,
        unfit=(_DEEPSEEK_V3_ROPE,),
        before=(("5.0", _EXPERTS_4X),),
        causal_lm="DeepseekV3ForCausalLM",
        loss_rows_layer="DeepseekV3DecoderLayer",
    ),
    "deepseek_v2": Family(
        _models("deepseek_v2"),
        ("DeepseekV2RMSNorm",),  # the decoder's and the attention's query and key/value latent norms
        # the shared experts and dense (first_k_dense_replace) layers; on transformers 4.x every expert
        ("DeepseekV2MLP",),
        experts=("DeepseekV2Experts",),
        rope=False,
        unfit=(
            (
                "rope",
                "DeepSeek-V2's apply_rotary_emb rotates interleaved pairs as complex numbers; tigon's RoPE is "
                "rotate-half",
            ),
        ),
        before=(("5.0", _EXPERTS_4X),),
        causal_lm="DeepseekV2ForCausalLM",
        loss_rows_layer="DeepseekV2DecoderLayer",
    ),
    "hunyuan_v1_moe": Family(
        _models("hunyuan_v1_moe"),
        ("HunYuanMoEV1RMSNorm",),  # the decoder's and the attention's query/key norms (applied after RoPE)
        ("HunYuanMoEV1MLP",),  # the shared MLP; on transformers 4.x every expert
        experts=("HunYuanMoEV1Experts",),
        before=(("5.0", _EXPERTS_4X),),
        causal_lm="HunYuanMoEV1ForCausalLM",
        loss_rows_layer="HunYuanMoEV1DecoderLayer",
    ),
    "ministral": Family(
        _models("ministral"),
        ("MinistralRMSNorm",),
        ("MinistralMLP",),
        causal_lm="MinistralForCausalLM",
        loss_rows_layer="MinistralDecoderLayer",
    ),
    "qwen2": Family(
        _models("qwen2"),
        ("Qwen2RMSNorm",),
        ("Qwen2MLP",),
        causal_lm="Qwen2ForCausalLM",
        loss_rows_layer="Qwen2DecoderLayer",
    ),
    "qwen2_moe": Family(
        _models("qwen2_moe"),
        ("Qwen2MoeRMSNorm",),
        ("Qwen2MoeMLP",),  # the shared expert and dense (mlp_only) layers; on transformers 4.x every expert
        experts=("Qwen2MoeExperts",),
        before=(("5.0", _EXPERTS_4X),),
        causal_lm="Qwen2MoeForCausalLM",
        loss_rows_layer="Qwen2MoeDecoderLayer",
    ),
    "qwen3": Family(
        _models("qwen3"),
        ("Qwen3RMSNorm",),
        ("Qwen3MLP",),
        causal_lm="Qwen3ForCausalLM",
        loss_rows_layer="Qwen3DecoderLayer",
    ),
    "qwen3_moe": Family(
        _models("qwen3_moe"),
        ("Qwen3MoeRMSNorm",),
        ("Qwen3MoeMLP",),  # dense (mlp_only) layers; on transformers 4.x every expert
        experts=("Qwen3MoeExperts",),
        before=(("5.0", _EXPERTS_4X),),
        causal_lm="Qwen3MoeForCausalLM",
        loss_rows_layer="Qwen3MoeDecoderLayer",
    ),
    "qwen3_next": Family(
        _models("qwen3_next"),
        ("Qwen3NextRMSNorm",),  # 1 + weight, float32 throughout, as Gemma's; not the Gated DeltaNet's gated norm
        ("Qwen3NextMLP",),  # the shared expert and dense (mlp_only) layers; on transformers 4.x every expert
        experts=("Qwen3NextExperts",),
        gemma_norm=True,
        partial_rope=True,  # partial_rotary_factor 0.25 in its members
        unfit=(_gated_deltanet_norm("Qwen3NextRMSNormGated"),),
        before=(("5.0", _EXPERTS_4X),),
        causal_lm="Qwen3NextForCausalLM",
    ),
    "qwen3_5": Family(
        _models("qwen3_5"),
        ("Qwen3_5RMSNorm",),
        ("Qwen3_5MLP",),
        gemma_norm=True,
        partial_rope=True,  # partial_rotary_factor 0.25, the multimodal sections folded into cos/sin
        layer_norm=True,
        unfit=(_gated_deltanet_norm("Qwen3_5RMSNormGated"), _VISION_ROPE, _VISION_FC_MLP),
        causal_lm="Qwen3_5ForConditionalGeneration",
    ),
    "qwen3_5_moe": Family(
        _models("qwen3_5_moe"),
        ("Qwen3_5MoeRMSNorm",),
        ("Qwen3_5MoeMLP",),  # the shared expert
        experts=("Qwen3_5MoeExperts",),
        gemma_norm=True,
        partial_rope=True,
        layer_norm=True,
        unfit=(_gated_deltanet_norm("Qwen3_5MoeRMSNormGated"), _VISION_ROPE, _VISION_FC_MLP),
        causal_lm="Qwen3_5MoeForConditionalGeneration",
    ),
    "exaone4": Family(
        _models("exaone4"),
        ("Exaone4RMSNorm",),  # post-norms: the attention's and MLP's outputs are normed before the residual add
        ("Exaone4MLP",),
        in_place_norm_backward=False,
        causal_lm="Exaone4ForCausalLM",
    ),
    "hunyuan_v1_dense": Family(
        _models("hunyuan_v1_dense"),
        ("HunYuanDenseV1RMSNorm",),  # with the query and key norms, applied after RoPE
        ("HunYuanDenseV1MLP",),
        causal_lm="HunYuanDenseV1ForCausalLM",
        loss_rows_layer="HunYuanDenseV1DecoderLayer",
    ),
    "gemma": Family(
        _models("gemma"),
        ("GemmaRMSNorm",),
        ("GemmaMLP",),
        gemma_norm=True,
        causal_lm="GemmaForCausalLM",
        loss_rows_layer="GemmaDecoderLayer",
    ),
    "gemma2": Family(
        _models("gemma2"),
        ("Gemma2RMSNorm",),
        ("Gemma2MLP",),
        gemma_norm=True,
        in_place_norm_backward=False,
        final_logit_softcapping=True,
        causal_lm="Gemma2ForCausalLM",
        loss_rows_layer="Gemma2DecoderLayer",
    ),
    "gemma3_text": Family(
        _models("gemma3"),
        ("Gemma3RMSNorm",),
        ("Gemma3MLP",),
        gemma_norm=True,
        in_place_norm_backward=False,
        final_logit_softcapping=True,
        causal_lm="Gemma3ForCausalLM",
        loss_rows_layer="Gemma3DecoderLayer",
    ),
    "gemma4_text": Family(
        _models("gemma4"),
        ("Gemma4RMSNorm",),  # scales by weight, not 1 + weight; with_scale=False (value, router norms): no weight
        ("Gemma4TextMLP",),  # use_double_wide_mlp: the key-sharing layers' MLP is twice as wide, the same GeGLU
        experts=("Gemma4TextExperts",),
        in_place_norm_backward=False,
        norm_casting="gemma",
        rope_one_tensor=True,  # proportional RoPE's cos/sin span the head dim (1 and 0 past the rotated part)
        mlp_width=_gemma4_mlp_width,
        final_logit_softcapping=True,
        unfit=(_GEMMA4_PER_LAYER,),
        causal_lm="Gemma4ForCausalLM",
    ),
    "phi3": Family(
        _models("phi3"),
        ("Phi3RMSNorm",),
        packed_mlp=("Phi3MLP",),
        partial_rope=True,
        causal_lm="Phi3ForCausalLM",
    ),
    "olmo2": Family(
        _models("olmo2"),
        ("Olmo2RMSNorm",),
        ("Olmo2MLP",),
        in_place_norm_backward=False,
        norm_casting="gemma",
        causal_lm="Olmo2ForCausalLM",
    ),
    "glm4": Family(
        _models("glm4"),
        ("Glm4RMSNorm",),
        packed_mlp=("Glm4MLP",),
        in_place_norm_backward=False,
        rope=False,
        unfit=(("rope", "Glm4 apply_rotary_pos_emb is interleaved and partial; tigon's RoPE is rotate-half"),),
        causal_lm="Glm4ForCausalLM",
    ),
    "granite": Family(
        _models("granite"), ("GraniteRMSNorm",), ("GraniteMLP",), logits_scaling=True, causal_lm="GraniteForCausalLM"
    ),
    "nemotron": Family(
        _models("nemotron"),
        (),
        offset_layer_norm=("NemotronLayerNorm1P",),
        activations=("ReLUSquaredActivation",),
        partial_rope=True,  # partial_rotary_factor 0.5 in its members: such calls keep transformers' function
        unfit=(
            (
                "swiglu",
                "Nemotron's MLP is up_proj, squared ReLU, down_proj with no gate: its activation is tigon's "
                "relu_squared, its Linear layers stay",
            ),
        ),
        causal_lm="NemotronForCausalLM",
    ),
    "deepseek_v4": Family(
        _models("deepseek_v4"),
        # the decoder's and the final norm; the attention's query latent and key/value norms, the compressors' and the
        # indexer's
        ("DeepseekV4RMSNorm",),
        in_place_norm_backward=False,
        norm_casting="gemma",  # float32 weights, multiplied in float32 and cast once
        rope=False,
        unfit=(
            (
                "rope",
                "DeepSeek-V4 rotates interleaved pairs of each head's trailing slice, from half-width cos/sin tables, "
                "one tensor per call; tigon's RoPE is rotate-half over full-width tables",
            ),
            (
                "swiglu",
                "DeepSeek-V4's experts and shared experts clamp gate and up (config.swiglu_limit) before "
                "silu(gate) * up; tigon's SwiGLU does not clamp",
            ),
            (
                "rms_norm",
                "the weightless norms (DeepseekV4UnweightedRMSNorm: the hyper-connections', the query heads') "
                "multiply x in its own dtype by its reciprocal RMS cast to that dtype: no tigon norm rounds so",
            ),
        ),
        before=(("5.20", (("norm_casting", "llama"),)),),  # older lines multiply the weight after the cast
        causal_lm="DeepseekV4ForCausalLM",
    ),
    "smollm3": Family(
        _models("smollm3"),
        ("SmolLM3RMSNorm",),
        ("SmolLM3MLP",),
        causal_lm="SmolLM3ForCausalLM",
        loss_rows_layer="SmolLM3DecoderLayer",
    ),
    "olmo3": Family(
        _models("olmo3"),
        ("Olmo3RMSNorm",),
        ("Olmo3MLP",),
        in_place_norm_backward=False,
        norm_casting="gemma",
        causal_lm="Olmo3ForCausalLM",
    ),
    "glm4_moe": Family(
        _models("glm4_moe"),
        ("Glm4MoeRMSNorm",),
        (
            "Glm4MoeMLP",
        ),  # the shared experts and dense (first_k_dense_replace) layers; on transformers 4.x every expert
        experts=("Glm4MoeExperts",),
        partial_rope=True,
        before=(("5.0", _EXPERTS_4X),),
        causal_lm="Glm4MoeForCausalLM",
        loss_rows_layer="Glm4MoeDecoderLayer",
    ),
    "gpt_oss": Family(
        _models("gpt_oss"),
        ("GptOssRMSNorm",),
        norm_casting="gemma",
        rope=False,
        unfit=(
            (
                "rope",
                "GPT-OSS's apply_rotary_pos_emb takes half-width cos/sin tables; tigon's RoPE takes full-width ones",
            ),
            (
                "swiglu",
                "GPT-OSS experts interleave gate and up, clamp both and compute (up + 1) * gate * "
                "sigmoid(1.702 * gate) with biases; tigon's SwiGLU is silu(gate) * up",
            ),
        ),
        causal_lm="GptOssForCausalLM",
    ),
    "falcon_h1": Family(
        _models("falcon_h1"),
        ("FalconH1RMSNorm",),
        ("FalconH1MLP",),  # config.mlp_multipliers go into the activation kernel
        logits_multiplier="lm_head_multiplier",
        unfit=(
            (
                "rms_norm",
                "the Mamba mixer's FalconH1RMSNormGated (config.mamba_rms_norm) norms x * silu(gate) in groups",
            ),
        ),
        causal_lm="FalconH1ForCausalLM",
    ),
    "llama4_text": Family(
        _models("llama4"),
        ("Llama4TextRMSNorm",),
        ("Llama4TextMLP",),  # the shared expert and dense layers
        rope=False,
        unfit=_LLAMA4_TEXT,
        causal_lm="Llama4ForCausalLM",
    ),
    "llama4": Family(
        _models("llama4"),
        ("Llama4TextRMSNorm",),
        ("Llama4TextMLP",),
        rope=False,
        layer_norm=True,
        unfit=(*_LLAMA4_TEXT, _VISION_FC_MLP),
        causal_lm="Llama4ForConditionalGeneration",
    ),
    "qwen2_vl": Family(
        _models("qwen2_vl"),
        ("Qwen2VLRMSNorm",),
        ("Qwen2MLP",),
        layer_norm=True,
        unfit=(_VISION_ROPE, _VISION_FC_MLP),
        before=(("5.0", (("rms_norm", ("Qwen2RMSNorm",)), ("rope", False), ("unfit", _QWEN2_VL_UNFIT_4X))),),
        causal_lm="Qwen2VLForConditionalGeneration",
    ),
    "qwen2_5_vl": Family(
        _models("qwen2_5_vl"),
        ("Qwen2_5_VLRMSNorm",),  # the language and the vision tower's
        ("Qwen2MLP",),
        vision_mlp=("Qwen2_5_VLMLP",),
        unfit=(_VISION_ROPE,),
        before=(("5.0", (("rms_norm", ("Qwen2RMSNorm",)), ("rope", False), ("unfit", (_MROPE_4X, _VISION_ROPE)))),),
        causal_lm="Qwen2_5_VLForConditionalGeneration",
    ),
    "qwen3_vl": Family(
        _models("qwen3_vl"),
        ("Qwen3VLTextRMSNorm",),
        ("Qwen3VLTextMLP",),
        layer_norm=True,
        unfit=(_VISION_ROPE, _VISION_FC_MLP),
        causal_lm="Qwen3VLForConditionalGeneration",
    ),
    "qwen3_vl_moe": Family(
        _models("qwen3_vl_moe"),
        ("Qwen3VLMoeTextRMSNorm",),
        ("Qwen3VLMoeTextMLP",),
        experts=("Qwen3VLMoeTextExperts",),
        layer_norm=True,
        unfit=(_VISION_ROPE, _VISION_FC_MLP),
        before=(("5.0", (("experts", ()), ("unfit", (_QWEN3_VL_MOE_4X, _VISION_ROPE, _VISION_FC_MLP)))),),
        causal_lm="Qwen3VLMoeForConditionalGeneration",
    ),
    "gemma3": Family(
        _models("gemma3"),
        ("Gemma3RMSNorm",),  # the language tower's and the projector's
        ("Gemma3MLP",),
        gemma_norm=True,
        in_place_norm_backward=False,
        layer_norm=True,
        unfit=(_VISION_FC_MLP,),
        causal_lm="Gemma3ForConditionalGeneration",  # no final_logit_softcapping here, unlike Gemma3ForCausalLM
        loss_rows_layer="Gemma3DecoderLayer",
    ),
    "gemma4": Family(
        _models("gemma4"),
        ("Gemma4RMSNorm",),  # the language, vision and audio towers' and the multimodal embedders'
        ("Gemma4TextMLP",),
        experts=("Gemma4TextExperts",),
        vision_mlp=("Gemma4VisionMLP",),  # its clipped Linear layers stay, clamps included
        in_place_norm_backward=False,
        norm_casting="gemma",
        rope_one_tensor=True,  # the vision tower's 2-D RoPE calls the same function once per axis
        mlp_width=_gemma4_mlp_width,
        layer_norm=True,  # the audio tower's subsampling projection's
        final_logit_softcapping=True,
        unfit=(_GEMMA4_PER_LAYER, _GEMMA4_AUDIO_MLP),
        causal_lm="Gemma4ForConditionalGeneration",
    ),
    "mllama": Family(
        _models("mllama"),
        ("MllamaTextRMSNorm",),
        ("MllamaTextMLP",),
        layer_norm=True,
        unfit=(_VISION_FC_MLP,),
        causal_lm="MllamaForConditionalGeneration",
    ),
    "phi4_multimodal": Family(
        _models("phi4_multimodal"),
        ("Phi4MultimodalRMSNorm",),
        packed_mlp=("Phi4MultimodalMLP",),
        partial_rope=True,
        layer_norm=True,
        unfit=(
            _VISION_FC_MLP,
            ("swiglu", "the audio encoder's MLP packs up before gate, the reverse of tigon's packed SwiGLU"),
        ),
        causal_lm="Phi4MultimodalForCausalLM",
    ),
    "llava": Family(
        _models("llava"),
        (),
        rope=False,  # the language tower's row applies RoPE
        layer_norm=True,
        language_model=True,
        vision_unfit=(_VISION_FC_MLP,),  # CLIP's or SigLIP's; a Pixtral tower has its own row
        causal_lm="LlavaForConditionalGeneration",
    ),
    "paligemma": Family(
        _models("paligemma"),
        (),
        rope=False,  # the language tower's row applies RoPE
        layer_norm=True,
        language_model=True,
        final_logit_softcapping=True,  # read from the text config: PaliGemma 2's Gemma 2 softcaps
        before=(("5.23", (("final_logit_softcapping", False),)),),  # older lines' head ignores the text config's cap
        unfit=(_VISION_FC_MLP,),
        causal_lm="PaliGemmaForConditionalGeneration",
    ),
    "internvl": Family(
        _models("internvl"),
        ("InternVLVisionRMSNorm",),  # where the vision config's norm_type is rms_norm; else nn.LayerNorm
        rope=False,  # the language tower's row applies RoPE
        layer_norm=True,
        language_model=True,
        unfit=(_VISION_FC_MLP,),
        causal_lm="InternVLForConditionalGeneration",
    ),
    "mistral3": Family(
        _models("mistral3"),
        ("Mistral3RMSNorm",),  # the projector's
        rope=False,  # the language tower's row applies RoPE, the Pixtral vision tower's row its own
        language_model=True,
        causal_lm="Mistral3ForConditionalGeneration",
    ),
    "glm4v": Family(
        _models("glm4v"),
        ("Glm4vRMSNorm",),  # the language and the vision tower's
        packed_mlp=("Glm4vTextMLP",),
        vision_mlp=("Glm4VisionMlp",),
        in_place_norm_backward=False,  # the decoder's post_self_attn and post_mlp norms join the residual stream
        rope=False,
        layer_norm=True,  # the patch merger's
        unfit=(
            (
                "rope",
                "GLM-4V's apply_rotary_pos_emb rotates interleaved pairs over the first part of the head; tigon's "
                "RoPE is rotate-half",
            ),
            _VISION_ROPE,
            _GLM4V_MERGER,
        ),
        causal_lm="Glm4vForConditionalGeneration",
    ),
    "glm4v_moe": Family(
        _models("glm4v_moe"),
        ("Glm4vMoeTextRMSNorm", "Glm4vMoeRMSNorm"),  # the decoder's; the text model's final and the vision tower's
        ("Glm4vMoeTextMLP",),  # the shared experts and dense (first_k_dense_replace) layers; on 4.x every expert
        experts=("Glm4vMoeTextExperts",),
        vision_mlp=("Glm4vMoeisionMlp",),  # sic: transformers' name for the vision block's MLP
        in_place_norm_backward=False,  # the vision tower's post_conv_layernorm feeds its residual stream
        partial_rope=True,  # partial_rotary_factor 0.5 by default: such calls keep transformers' function
        layer_norm=True,  # the patch merger's
        unfit=(_VISION_ROPE, _GLM4V_MERGER),
        before=(("5.0", (*_EXPERTS_4X, ("rope", False), ("unfit", (_MROPE_4X, _VISION_ROPE, _GLM4V_MERGER)))),),
        causal_lm="Glm4vMoeForConditionalGeneration",
    ),
    "pixtral": Family(
        _models("pixtral"),
        ("PixtralRMSNorm",),
        vision_mlp=("PixtralMLP",),
        in_place_norm_backward=False,  # ln_pre norms the patch embeddings that start the residual stream
        causal_lm=None,  # a vision encoder: Llava's and Mistral 3's rows apply this one to their Pixtral tower
    ),
    "smolvlm": Family(
        _models("smolvlm"),
        (),
        rope=False,  # the language tower's row applies RoPE
        layer_norm=True,
        language_model=True,
        unfit=(_VISION_FC_MLP,),
        causal_lm="SmolVLMForConditionalGeneration",
    ),
    "muse_glimmer": Family(
        _models("muse_glimmer"),
        ("MuseGlimmerRMSNorm",),  # the final norm (scales by weight) and the weightless query/key and embedding norms
        ("MuseGlimmerTextMLP",),
        centered_norm=("MuseGlimmerTextCenteredRMSNorm",),  # the decoder's four, scaling by 1 + weight
        in_place_norm_backward=False,  # post-norms: their output joins the residual stream
        norm_casting="gemma",
        layer_norm=True,  # the vision tower's
        final_logit_softcapping=True,
        logits_multiplier="output_multiplier",
        unfit=(_VISION_FC_MLP, _VISION_ROPE),
        causal_lm="MuseGlimmerForConditionalGeneration",
    ),
}


@dataclass
class PatchReport:
    """What `apply` changed, for logs and tests."""

    model_type: str
    applied: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        done = ", ".join(f"{name} x{count}" for name, count in self.applied.items()) or "nothing"
        return f"tigon kernels on {self.model_type}: applied {done}" + (
            f"; not applied: {', '.join(self.skipped)}" if self.skipped else ""
        )


def _transformers_version() -> str:
    try:
        import transformers
    except ImportError:
        return "not installed"
    return transformers.__version__


def _transformers_release():
    """The installed transformers' release as a `packaging` Version (5.23.0 for 5.23.0.dev0); None when it is not
    installed."""
    if _transformers_version() == "not installed":
        return None
    from packaging.version import Version

    return Version(Version(_transformers_version()).base_version)


def _takes_loss_rows(family: Family) -> bool:
    release = _transformers_release()
    return family.loss_rows_layer is not None and release is not None and release.major >= FIRST_TRANSFORMERS


def _swapped_classes(family: Family) -> dict[str, tuple[type, str]]:
    """Class name -> (tigon module, report name) for every MLP-like class the row swaps."""
    return {name: swap for field_name, swap in MLP_SWAPS.items() for name in getattr(family, field_name)}


def modeling_module(model_type: str, family: Family | None = None):
    """Import the family's modeling module and check every name the table swaps still exists there.

    Raises `PatchTargetMissing`, naming the class or function and the transformers version,
    when the installed transformers renamed or removed one: a patch that no longer fits fails
    loudly instead of silently leaving the model unpatched.
    """
    family = (family or FAMILIES[model_type]).installed()
    try:
        module = importlib.import_module(family.modeling)
    except ImportError as error:
        raise PatchTargetMissing(
            f"tigon: {model_type}: cannot import {family.modeling} from transformers {_transformers_version()}"
        ) from error
    targets = [*family.rms_norm, *family.centered_norm, *family.offset_layer_norm, *_swapped_classes(family)]
    targets += family.vision_mlp
    targets += [family.causal_lm] if family.causal_lm else []
    targets += [family.loss_rows_layer] if family.loss_rows_layer else []
    targets += ["apply_rotary_pos_emb"] if family.rope else []
    missing = [name for name in targets if not hasattr(module, name)]
    activations = importlib.import_module("transformers.activations")
    missing += [name for name in family.activations if not hasattr(activations, name)]
    if missing:
        raise PatchTargetMissing(
            f"tigon: {model_type}: {family.modeling} has no {', '.join(missing)} in transformers "
            f"{_transformers_version()}; the kernel table entry no longer fits this version"
        )
    return module


def _unfit(unfit: tuple[tuple[str, str], ...], wanted: dict[str, bool]) -> list[str]:
    return [f"{kernel} ({reason})" for kernel, reason in unfit if wanted.get(kernel)]


def _rope_function(family: Family, module):
    """tigon's RoPE, or for partial-rotary families a wrapper that leaves partial calls to the original."""
    if family.rope_one_tensor:
        return functional.apply_rotary_pos_emb_one
    if not family.partial_rope:
        return functional.apply_rotary_pos_emb
    current = module.apply_rotary_pos_emb
    original = getattr(current, "__tigon_original__", current)

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        if cos.shape[-1] != q.shape[-1]:
            return original(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
        return functional.apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim)

    apply_rotary_pos_emb.__tigon_original__ = original
    return apply_rotary_pos_emb


def _unsupported(report: PatchReport, wanted: dict[str, bool]) -> PatchReport:
    report.skipped = [name for name, on in wanted.items() if on]
    logger.warning(
        "tigon: model_type %r has no kernel table entry (supported: %s); nothing was applied",
        report.model_type,
        ", ".join(sorted(FAMILIES)),
    )
    return report


def _language_row(config) -> tuple[str, Family | None]:
    """For a `language_model` row: the model_type of its language tower and that family's row (None if untabled)."""
    language_type = config.get_text_config().model_type
    language = FAMILIES.get(language_type)
    if language is None or language.language_model:
        return language_type, None
    return language_type, language.installed()


_NO_LM_HEAD = "fused_linear_cross_entropy ({} is a vision encoder: it has no LM head)"


def _vision_row(config) -> tuple[str, Family | None]:
    """For a `language_model` row: the model_type of its vision tower and that vision encoder's row (None if the
    tower has none)."""
    vision_type = getattr(getattr(config, "vision_config", None), "model_type", None)
    vision = FAMILIES.get(vision_type)
    if vision is None or vision.causal_lm is not None:
        return vision_type, None
    return vision_type, vision.installed()


def _swap_modules(model: nn.Module, family: Family, config, report: PatchReport, rms_norm: bool, swiglu: bool) -> None:
    """Replace the row's norms, gated MLPs and experts in `model`, counting them in `report`."""
    mlp_swaps = _swapped_classes(family)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    norm_class = GemmaRMSNorm if family.gemma_norm else RMSNorm
    norm_options = {"in_place_backward": family.in_place_norm_backward}
    if not family.gemma_norm:
        norm_options["casting"] = family.norm_casting

    def count(swap: str) -> None:
        report.applied[swap] = report.applied.get(swap, 0) + 1

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            if rms_norm and kind in family.rms_norm:
                setattr(parent, name, norm_class.from_module(child, **norm_options))
                count("rms_norm")
            elif rms_norm and kind in family.centered_norm:
                setattr(parent, name, GemmaRMSNorm.from_module(child, in_place_backward=family.in_place_norm_backward))
                count("rms_norm")
            elif rms_norm and kind in family.offset_layer_norm:
                setattr(parent, name, OffsetLayerNorm.from_module(child, family.in_place_norm_backward))
                count("layer_norm")
            elif rms_norm and family.layer_norm and type(child) is nn.LayerNorm and child.weight is not None:
                setattr(parent, name, LayerNorm.from_module(child))
                count("layer_norm")
            elif swiglu and kind in mlp_swaps:
                replacement, swap = mlp_swaps[kind]
                setattr(parent, name, replacement.from_module(child, text_config))
                count(swap)
            elif swiglu and kind in family.activations:
                replacement, swap = ACTIVATION_SWAPS[kind]
                setattr(parent, name, replacement())
                count(swap)
            elif swiglu and kind in family.vision_mlp:
                setattr(parent, name, GatedMLP.from_module(child, getattr(config, "vision_config", config)))
                count("gated_mlp")


def apply(
    model: nn.Module,
    rms_norm: bool = True,
    rope: bool = True,
    swiglu: bool = True,
    fused_linear_cross_entropy: bool = True,
    loss_chunk_tokens: int | None = None,
    check_targets: bool = True,
) -> PatchReport:
    """Apply tigon's kernels to a built transformers model (or a PEFT wrapper of one) in place.

    `fused_linear_cross_entropy` makes the `*ForCausalLM` forward compute the loss without logits when
    training with labels (see `tigon.kernels.patching.causal_lm`); `loss_chunk_tokens` sets that loss's
    tokens per chunk (None: the op's own rule), and `check_targets=False` drops its check that every label lies in
    the vocabulary (a device sync a forward, which keeps the host from running ahead of the GPU): for callers that
    check their labels on the host, as tigon's runtime does. Returns what was swapped; its `skipped` names each part of
    the family a requested kernel leaves as transformers wrote it, with the reason.
    """
    check_chunk_size("loss_chunk_tokens", loss_chunk_tokens, "tokens")
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", type(model).__name__)
    report = PatchReport(model_type)
    family = FAMILIES.get(model_type)
    wanted = {
        "rms_norm": rms_norm,
        "rope": rope,
        "swiglu": swiglu,
        "fused_linear_cross_entropy": fused_linear_cross_entropy,
    }
    if family is None:
        return _unsupported(report, wanted)
    family = family.installed()
    rows = [(family, modeling_module(model_type, family))]
    skipped = []
    if family.language_model:
        language_type, language = _language_row(config)
        if language is None:
            skipped += [
                f"{kernel} (the language model is {language_type!r}, which has no kernel table entry)"
                for kernel in ("rms_norm", "rope", "swiglu")
                if wanted[kernel]
            ]
        else:
            rows.append((language, modeling_module(language_type, language)))
        vision_type, vision = _vision_row(config)
        if vision is None:
            skipped += _unfit(family.vision_unfit, wanted)
        else:
            rows.append((vision, modeling_module(vision_type, vision)))
    for row, module in rows:
        _swap_modules(model, row, config, report, rms_norm, swiglu)
        if rope and row.rope:
            module.apply_rotary_pos_emb = _rope_function(row, module)
            report.applied["rope"] = 1
        skipped += _unfit(row.unfit, wanted)
    if fused_linear_cross_entropy:
        for causal_lm in model.modules():
            if type(causal_lm).__name__ == family.causal_lm:
                original = getattr(type(causal_lm), "__tigon_original__", type(causal_lm))
                causal_lm.__class__ = fused_class(original, family)
                causal_lm.__dict__[LOSS_CHUNK_TOKENS] = loss_chunk_tokens
                causal_lm.__dict__[CHECK_TARGETS] = check_targets
                keep_last_hidden_state(causal_lm)  # the hook exists before any torch.compile trace
                report.applied["fused_linear_cross_entropy"] = 1
        if _takes_loss_rows(family):
            for layer in model.modules():
                if type(layer).__name__ == family.loss_rows_layer:
                    layer.__class__ = loss_rows_class(type(layer))
    report.skipped = skipped
    if fused_linear_cross_entropy and family.causal_lm is None:
        report.skipped.append(_NO_LM_HEAD.format(model_type))
    elif fused_linear_cross_entropy and "fused_linear_cross_entropy" not in report.applied:
        report.skipped.append(
            f"fused_linear_cross_entropy ({type(model).__name__} has no {family.causal_lm}: the fused loss replaces "
            "a causal LM head's loss over the vocabulary; other heads keep their own)"
        )
    logger.info("%s", report)
    return report


def _norm_class(family: Family, original: type) -> type:
    """A tigon norm with the HF constructor (`hidden_size` or `dim`, `eps`, Gemma 4's `with_scale`) and the HF
    class name."""
    base = GemmaRMSNorm if family.gemma_norm else RMSNorm
    options = {"in_place_backward": family.in_place_norm_backward}
    if not family.gemma_norm:
        options["casting"] = family.norm_casting

    def __init__(self, hidden_size=None, eps=1e-6, dim=None, with_scale=True):
        weightless = {} if with_scale else {"with_weight": False}
        base.__init__(self, hidden_size if hidden_size is not None else dim, eps, **options, **weightless)

    return _hf_class(base, original, __init__)


def _hf_class(base: type, original: type, init: Callable) -> type:
    """A subclass of tigon's `base` under the HF class's name, built by `init` (the HF constructor's arguments), that
    remembers the class it replaces (`__tigon_original__`, which a second `apply_to` restores from)."""
    return type(original.__name__, (base,), {"__init__": init, "__module__": __name__, "__tigon_original__": original})


def _offset_norm_class(family: Family, original: type) -> type:
    """tigon's OffsetLayerNorm with the HF constructor (torch's LayerNorm's) and the HF class name."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None, dtype=None):
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        if len(shape) != 1 or not elementwise_affine:
            raise ValueError(
                f"tigon's {original.__name__} norms the last dimension with a weight, not normalized_shape="
                f"{normalized_shape} with elementwise_affine={elementwise_affine}; build it unpatched "
                "(apply_to(..., rms_norm=False))"
            )
        OffsetLayerNorm.__init__(self, shape[0], eps, bias, family.in_place_norm_backward)
        self.to(device=device, dtype=dtype)

    return _hf_class(OffsetLayerNorm, original, __init__)


def _mlp_class(base: type, original: type, width: Callable[[object, int], int] | None = None) -> type:
    """A tigon MLP or experts module with the HF constructor and the HF class name.

    It takes the arguments the HF class takes (`config`, then optional sizes, or a layer index the class only stores,
    as transformers 4.x's HunYuanMoEV1MLP); with `width`, `(config, layer_idx)`, and its width from `width`."""
    if width is not None:

        def __init__(self, config, layer_idx: int):
            base.__init__(self, config, width(config, layer_idx))

    else:
        signature = inspect.signature(original.__init__)

        def __init__(self, *args, **kwargs):
            arguments = signature.bind(self, *args, **kwargs).arguments
            config = list(arguments.values())[1]
            hidden_size = arguments.get("hidden_size")
            if hidden_size not in (None, config.hidden_size):
                raise ValueError(
                    f"tigon's {original.__name__} runs at config.hidden_size={config.hidden_size}, not "
                    f"hidden_size={hidden_size}; build this module unpatched (apply_to(..., swiglu=False))"
                )
            base.__init__(self, config, intermediate_size=arguments.get("intermediate_size"))

    return _hf_class(base, original, __init__)


def apply_to(
    model_type: str,
    rms_norm: bool = True,
    rope: bool = True,
    swiglu: bool = True,
    fused_linear_cross_entropy: bool = True,
) -> PatchReport:
    """Swap tigon's classes and RoPE into the family's modeling module, so models built afterwards use them.

    For code that builds the model itself; affects every model of the family built later in
    the process (the fused loss replaces the `*ForCausalLM` class's `forward`, so it also reaches
    models already built). The swapped classes keep the HF names and constructors (and parameter names,
    so checkpoints load unchanged).
    """
    report = PatchReport(model_type)
    family = FAMILIES.get(model_type)
    wanted = {
        "rms_norm": rms_norm,
        "rope": rope,
        "swiglu": swiglu,
        "fused_linear_cross_entropy": fused_linear_cross_entropy,
    }
    if family is None:
        return _unsupported(report, wanted)
    family = family.installed()
    module = modeling_module(model_type, family)
    swaps = []
    if rms_norm:
        swaps += [(name, "rms_norm", _norm_class) for name in family.rms_norm]
        centered = dataclasses.replace(family, gemma_norm=True)
        swaps += [
            (name, "rms_norm", lambda _, original: _norm_class(centered, original)) for name in family.centered_norm
        ]
        swaps += [(name, "layer_norm", _offset_norm_class) for name in family.offset_layer_norm]
    if swiglu:
        for name, (base, swap) in _swapped_classes(family).items():
            width = family.mlp_width if name in family.mlp else None
            swaps.append((name, swap, lambda _, original, base=base, width=width: _mlp_class(base, original, width)))
    for name, kernel, make in swaps:
        current = getattr(module, name)
        original = getattr(current, "__tigon_original__", current)
        setattr(module, name, make(family, original))
        report.applied[kernel] = report.applied.get(kernel, 0) + 1
    if fused_linear_cross_entropy and family.causal_lm is not None:
        causal_lm = getattr(module, family.causal_lm)
        causal_lm.forward = fused_forward(causal_lm.forward, family)
        report.applied["fused_linear_cross_entropy"] = 1
        if _takes_loss_rows(family):
            setattr(module, family.loss_rows_layer, loss_rows_class(getattr(module, family.loss_rows_layer)))
    if rope and family.rope:
        module.apply_rotary_pos_emb = _rope_function(family, module)
        report.applied["rope"] = 1
    report.skipped = _unfit(family.unfit, wanted) + _unfit(family.vision_unfit, wanted)
    if fused_linear_cross_entropy and family.causal_lm is None:
        report.skipped.append(_NO_LM_HEAD.format(model_type))
    report.skipped += _left_to_apply(family, wanted)
    logger.info("%s", report)
    return report


def _left_to_apply(family: Family, wanted: dict[str, bool]) -> list[str]:
    """What only `apply` can swap: instances of torch's LayerNorm, vision MLPs and the language tower's family."""
    left = []
    if wanted["rms_norm"] and family.layer_norm:
        left.append("layer_norm (torch.nn.LayerNorm is not the family's class: apply() swaps its instances)")
    if wanted["swiglu"] and family.activations:
        left.append(
            "relu_squared (transformers builds the activation from ACT2FN, which every family shares: apply() swaps "
            "its instances)"
        )
    if wanted["swiglu"] and family.vision_mlp:
        left.append("swiglu (the vision tower's gated MLPs take the vision config: apply() swaps them)")
    if family.language_model:
        left.append(
            "language model (its family comes from a built model's text_config, and a vision tower's with a row of "
            "its own from its vision_config: apply(), or apply_to(their model_type))"
        )
    return left


class AutoModelForCausalLM:
    """`transformers.AutoModelForCausalLM` that applies every tigon kernel that fits the built model.

    Kernel switches (`rms_norm`, `rope`, `swiglu`, `fused_linear_cross_entropy`) are taken from the keyword
    arguments; the rest go to transformers. The `PatchReport` is left on the model as `tigon_patch_report`.
    """

    _KERNEL_OPTIONS = ("rms_norm", "rope", "swiglu", "fused_linear_cross_entropy")

    def __init__(self, *args, **kwargs) -> None:
        raise OSError("use tigon.kernels.AutoModelForCausalLM.from_pretrained(...) or .from_config(...)")

    @classmethod
    def _patched(cls, model, options: dict) -> nn.Module:
        model.tigon_patch_report = apply(model, **options)
        return model

    @classmethod
    def _split(cls, kwargs: dict) -> dict:
        return {name: kwargs.pop(name) for name in cls._KERNEL_OPTIONS if name in kwargs}

    @classmethod
    def from_pretrained(cls, path_or_config, *args, **kwargs) -> nn.Module:
        """Build from a checkpoint path / hub name, or from a config object, then apply the kernels."""
        import transformers

        options = cls._split(kwargs)
        if isinstance(path_or_config, transformers.PretrainedConfig):
            model = transformers.AutoModelForCausalLM.from_config(path_or_config, *args, **kwargs)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(path_or_config, *args, **kwargs)
        return cls._patched(model, options)

    @classmethod
    def from_config(cls, config, *args, **kwargs) -> nn.Module:
        """Build a freshly initialized model from a config, then apply the kernels."""
        import transformers

        options = cls._split(kwargs)
        return cls._patched(transformers.AutoModelForCausalLM.from_config(config, *args, **kwargs), options)
