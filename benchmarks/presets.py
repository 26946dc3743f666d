"""The end-to-end benchmark's models: data only, no code that runs them.

One preset per family of tigon's kernel table (`PRESETS`): the config.json values of a named public member (or
transformers' defaults for the family), shortened where the family has no member of 1B-4B; the table's families
without a preset and why (`NOT_BENCHMARKED`); `--shape`'s larger Llama (`LARGER_SHAPES`) and `--qlora`'s adapters
(`QLORA`). benchmarks/end_to_end.py runs them (docs/benchmarks.md); the TRL and packed-attention benchmarks take
their Llama from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Llama-3-8B's shape (random weights): end_to_end's `--shape llama-3-8b` and the multi-GPU headline runs
LLAMA_3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class VisionTower:
    """A vision-language preset's vision tower and its config's top-level values.

    `config` holds the vision_config values at the member's real depth, `depth` the ones that shorten it for the
    benchmark (its own key names: `depth` for Qwen's towers, `num_hidden_layers` for the others). `outer` holds the
    top-level values (tied head, image token ids). `tiny` is `--tiny`'s one-layer vision_config and `tiny_outer`
    the top-level values it needs beside it.
    """

    config: dict
    outer: dict
    tiny: dict
    depth: dict = field(default_factory=dict)
    tiny_outer: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Preset:
    """One family's benchmark model: the config.json values of a named public member, and how it is run.

    `config` holds the values that set shapes and the family's quirks, at the member's real depth (for a
    vision-language model, its language model's: config.json's `text_config`);
    `layers` shortens it (real widths, heads and vocabulary) where the family has no member of 1B-4B.
    `vision` is a vision-language model's vision tower (`VisionTower`): the model is then built as the family's
    `*ForConditionalGeneration` from `{**outer, "text_config": ..., "vision_config": ...}` and trained on text alone.
    `params` is the member's published parameter count (the preset test counts `config` against it).
    `liger` names the Liger-Kernel function for the family, None where Liger-Kernel has none.
    `tiny` holds family-specific `--tiny` values on top of `tiny_shape`'s generic shrink.
    `attention` is the run's `model.attn_implementation`.
    `micro_batch` caps the run's micro-batch where the family's model does not fit the default's (why: beside it).
    `layer_types` lists a hybrid family's layer kinds at the shortened depth, so a model shortened below its
    pattern's period keeps each kind of layer (Qwen3-Next: a Gated DeltaNet layer and an attention one).
    `reduced` holds config values the benchmark shape replaces besides the depth, where even one layer of the member
    does not fit (DeepSeek-V4: fewer experts); such a preset's benchmarked model is not the member's shape.
    """

    family: str  # tigon's kernel table key, which is also the transformers model_type
    source: str  # the Hugging Face model whose config.json the values are from
    config: dict
    params: float
    liger: str | None
    layers: int | None = None
    tiny: dict = field(default_factory=dict)
    attention: str = "sdpa"
    vision: VisionTower | None = None
    micro_batch: int | None = None
    layer_types: tuple[str, ...] = ()
    reduced: dict = field(default_factory=dict)

    def micro_batch_for(self, requested: int) -> int:
        """The micro-batch this preset runs at when `requested` is asked for: at most its cap."""
        return min(requested, self.micro_batch) if self.micro_batch else requested

    def shape(self) -> dict:
        """The benchmark's `model.config_overrides`: `config`, shortened to `layers`, with the vision tower."""
        text = {**self.config, **({"num_hidden_layers": self.layers} if self.layers else {})}
        text |= {"layer_types": list(self.layer_types)} if self.layer_types else {}
        text |= self.reduced
        return self._with_vision(text, {**self.vision.config, **self.vision.depth} if self.vision else {}, {})

    def full_shape(self) -> dict:
        """`config` at the member's real depth, text and vision (the shape `params` counts)."""
        return self._with_vision(dict(self.config), dict(self.vision.config) if self.vision else {}, {})

    def _with_vision(self, text: dict, vision: dict, outer: dict) -> dict:
        if self.vision is None:
            return text
        return {**self.vision.outer, **outer, "text_config": text, "vision_config": vision}

    def tiny_shape(self) -> dict:
        """Small widths, 2 layers, vocabulary 512, no special tokens; the model_type and `config`'s quirks kept (a
        vision-language model's vision tower: one small layer)."""
        config, shape = self.config, dict(self.config)
        heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads")
        shape |= {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}
        shape |= {"vocab_size": 512, "max_position_embeddings": 16384}  # past Llama 3 RoPE scaling's 8192
        shape |= {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}  # the members' are past 512
        if kv_heads is not None:  # multi-head, multi-query or grouped, as the member
            shape["num_key_value_heads"] = 4 if kv_heads == heads else 1 if kv_heads == 1 else 2
        shrink = {
            "head_dim": 16,
            "query_pre_attn_scalar": 16,  # the members scale by head_dim
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "num_experts": 8,  # 8 x 32 wide: the experts' parameters are not the dense MLP's 128
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        }
        shape |= {key: value for key, value in shrink.items() if key in config}
        if config.get("sliding_window"):
            shape["sliding_window"] = 16  # so the window acts at the smoke run's sequence lengths
        shape |= self.tiny
        if self.vision is None:
            return shape
        return self._with_vision(shape, dict(self.vision.tiny), self.vision.tiny_outer)

    def describe(self, tiny: bool = False) -> str:
        if tiny:
            return f"tiny {self.family} (2 layers, hidden 64, vocab 512; {self.source}'s quirks)"
        depth = self.config["num_hidden_layers"]
        vision = ""
        if self.vision is not None:
            vision = ", its vision tower shortened" if self.vision.depth else ", its vision tower"
            vision += " (trained on text)"
        reduced = "".join(f", {key}={value}" for key, value in self.reduced.items())
        if self.layers and self.layers < depth:
            return (
                f"{self.source} widths and vocabulary, {self.layers} of its {depth} layers{reduced}{vision} "
                "(random init)"
            )
        return f"{self.source} (random init from its config{vision})"


def text_shape(shape: dict) -> dict:
    """The language model's part of a benchmark shape: its `text_config` for a vision-language model."""
    return shape.get("text_config", shape)


#: --tiny: one-layer vision towers (their configs' own key names)
TINY_VISION = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "image_size": 8,
    "patch_size": 2,
}
#: --tiny: Qwen2-VL's multimodal RoPE sections for a 16-wide head (the members' 16, 24 and 24 take 128)
TINY_MROPE = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 2, 2]}
#: --tiny: special tokens within the 512-token vocabulary, for configs that take no null ones (Mllama's)
TINY_SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
#: GLM-4.1V's and GLM-4.5V's vision tower (transformers' defaults, the same in both)
GLM4V_VISION = {
    "depth": 24,
    "hidden_size": 1536,
    "intermediate_size": 13696,  # the patch merger's
    "num_heads": 12,
    "out_hidden_size": 4096,
    "patch_size": 14,
    "image_size": 336,
}
#: --tiny: GLM-4V's multimodal RoPE sections for a 16-wide head, half of it rotated (the members' 8, 12 and 12 take 64)
# GLM-4.5-Air's language model, which GLM-4.5V's is too (their MTP layer left out)
GLM45_AIR = {
    "hidden_size": 4096,
    "intermediate_size": 10944,  # the dense first layer's
    "moe_intermediate_size": 1408,
    "n_routed_experts": 128,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "num_hidden_layers": 46,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "vocab_size": 151552,
    "rms_norm_eps": 1e-5,
}
GLM4V_ROPE = {  # GLM-4.1V's and GLM-4.5V's config.json: M-RoPE over half of each head (transformers' defaults rotate
    # the whole head, which their [8, 12, 12] sections do not span)
    "rope_type": "default",
    "rope_theta": 10000.0,
    "mrope_section": [8, 12, 12],
    "partial_rotary_factor": 0.5,
}
GLM4V_TINY_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "mrope_section": [2, 1, 1],
    "partial_rotary_factor": 0.5,
}
QWEN_TINY_VISION = {
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 2,
    "out_hidden_size": 64,
    "patch_size": 2,
}

#: Qwen3-Next and Qwen 3.5's Gated DeltaNet layers (transformers' config defaults): 16 key heads and 32 value heads
#: of 128; three of every four layers, the fourth full attention with gated queries and partial RoPE
GATED_DELTANET = {
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}
#: --tiny: the Gated DeltaNet at tiny widths, one layer of it and one of attention
GATED_DELTANET_TINY = {
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "full_attention"],
}
#: --tiny: Qwen 3.5's multimodal RoPE sections over the rotated half of a 16-wide head at partial_rotary_factor 0.5
QWEN3_5_TINY_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "mrope_section": [2, 1, 1],
}
#: Qwen 3.5's vision tower (transformers' config defaults), its output as wide as the language model
QWEN3_5_VISION = {
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "num_position_embeddings": 2304,
    "patch_size": 16,
}

#: Llama 4 Scout's language model (transformers' Llama4TextConfig defaults): every layer MoE, every fourth without
#: RoPE, chunked attention past 8192 tokens
LLAMA4_SCOUT_TEXT = {
    "hidden_size": 5120,
    "intermediate_size": 8192,  # each expert's
    "intermediate_size_mlp": 16384,  # the dense layers' (none here)
    "num_local_experts": 16,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 1,
    "num_hidden_layers": 48,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 202048,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "attention_chunk_size": 8192,
    "use_qk_norm": True,
    "max_position_embeddings": 131072,
}
LLAMA4_TINY = {"intermediate_size_mlp": 160, "num_experts_per_tok": 1}
#: Gemma 4's language model (transformers' Gemma4TextConfig defaults): five sliding-window layers, then a global one
#: with wider heads, and per-layer input embeddings
GEMMA4_TEXT = {
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 30,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "vocab_size": 262144,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262144,
    "tie_word_embeddings": True,
    "sliding_window": 512,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "hidden_activation": "gelu_pytorch_tanh",
}
GEMMA4_TINY = {"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 512, "global_head_dim": 32}

# Each preset's values are those of its source's config.json (keys as config.json spells them, which the
# transformers 4.x and 5.x configs both take). Where a value was read from a copy that quoted only part of
# the file, or is transformers' default, the comment says so.
PRESETS: dict[str, Preset] = {
    "llama": Preset(
        "llama",
        "meta-llama/Llama-3.2-1B",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 128256,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "max_position_embeddings": 131072,
        },
        params=1.24e9,
        liger="apply_liger_kernel_to_llama",
    ),
    "mistral": Preset(
        "mistral",
        "mistralai/Mistral-7B-v0.3",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,  # head_dim 128 = 4096 / 32 (config.json has no head_dim)
            "vocab_size": 32768,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "max_position_embeddings": 32768,
        },
        params=7.25e9,
        liger="apply_liger_kernel_to_mistral",
        layers=8,  # no Mistral of 1B-4B: 8 of 32 layers, 2.0B parameters
    ),
    "mixtral": Preset(
        "mixtral",
        "mistralai/Mixtral-8x7B-v0.1",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,  # each expert's
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.02,
            "vocab_size": 32000,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "max_position_embeddings": 32768,
        },
        params=46.7e9,
        liger="apply_liger_kernel_to_mixtral",
        layers=2,  # 1.45B parameters a layer (8 experts of 3 x 4096 x 14336): 2 of 32 layers, 3.2B parameters
    ),
    "deepseek_v3": Preset(
        "deepseek_v3",
        "moonshotai/Moonlight-16B-A3B",
        {
            "hidden_size": 2048,
            "intermediate_size": 11264,  # the dense first layer's
            "moe_intermediate_size": 1408,
            "n_routed_experts": 64,
            "n_shared_experts": 2,
            "num_experts_per_tok": 6,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.446,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "q_lora_rank": None,  # queries projected directly; keys and values through a 512-wide latent
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "vocab_size": 163840,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "rope_theta": 50000.0,
            "max_position_embeddings": 8192,
        },
        params=16.0e9,
        liger="apply_liger_kernel_to_deepseek_v3",
        layers=4,  # the dense layer and three MoE layers (64 experts, 0.58B parameters each): 2.5B parameters
        tiny={
            "n_routed_experts": 8,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 16,
            "v_head_dim": 16,
        },
    ),
    "deepseek_v2": Preset(
        "deepseek_v2",
        "deepseek-ai/DeepSeek-Coder-V2-Lite-Instruct",
        {
            "hidden_size": 2048,
            "intermediate_size": 10944,  # the dense first layer's
            "moe_intermediate_size": 1408,
            "n_routed_experts": 64,
            "n_shared_experts": 2,
            "num_experts_per_tok": 6,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
            "topk_method": "greedy",
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "q_lora_rank": None,  # queries projected directly; keys and values through a 512-wide latent
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "vocab_size": 102400,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,  # the member's YaRN scaling (factor 40) left out: it sets no shape
            "max_position_embeddings": 163840,
        },
        params=15.7e9,
        liger="apply_liger_kernel_to_deepseek_v2",
        layers=4,  # the dense layer and three MoE layers (64 experts, 0.58B parameters each): 2.3B parameters
        tiny={
            "n_routed_experts": 8,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 16,
            "v_head_dim": 16,
        },
    ),
    "hunyuan_v1_moe": Preset(
        "hunyuan_v1_moe",
        "tencent/Hunyuan-A13B-Instruct",
        {
            "hidden_size": 4096,
            "intermediate_size": 3072,  # each expert's and the shared MLP's
            "num_experts": 64,
            "moe_topk": 8,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 128167,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-5,  # the member's dynamic-NTK RoPE scaling left out: it sets no shape
        },
        params=80e9,
        liger="apply_liger_kernel_to_hunyuan_v1_moe",
        layers=1,  # 2.5B parameters a layer (64 experts of 3 x 4096 x 3072): 1 of 32 layers, 3.0B parameters
        tiny={"moe_topk": 2},
    ),
    "ministral": Preset(
        "ministral",
        "mistralai/Ministral-8B-Instruct-2410",
        {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 131072,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "rope_theta": 100000000.0,
            "sliding_window": 32768,
            "max_position_embeddings": 32768,
        },
        params=8.02e9,
        liger="apply_liger_kernel_to_ministral",
        layers=10,  # no Ministral of 1B-4B: 10 of 36 layers, 3.0B parameters
    ),
    "qwen2": Preset(
        "qwen2",
        "Qwen/Qwen2.5-1.5B",
        {
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "use_sliding_window": False,
            "max_position_embeddings": 131072,  # Qwen2.5's 128K context; not in the copies checked
        },
        params=1.54e9,
        liger="apply_liger_kernel_to_qwen2",
    ),
    "qwen2_moe": Preset(
        "qwen2_moe",
        "Qwen/Qwen1.5-MoE-A2.7B",
        {
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "moe_intermediate_size": 1408,
            "shared_expert_intermediate_size": 5632,
            "num_experts": 60,
            "num_experts_per_tok": 4,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "router_aux_loss_coef": 0.001,
            "num_hidden_layers": 24,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "vocab_size": 151936,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "use_sliding_window": False,
            "max_position_embeddings": 32768,
        },
        params=14.3e9,
        liger=None,  # Liger-Kernel has no apply_liger_kernel_to_qwen2_moe
        layers=4,  # 0.57B parameters a layer (60 experts and a shared one): 4 of 24 layers, 2.9B parameters
    ),
    "qwen3": Preset(
        "qwen3",
        "Qwen/Qwen3-1.7B",
        {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "use_sliding_window": False,
            "max_position_embeddings": 40960,
        },
        params=1.7e9,
        liger="apply_liger_kernel_to_qwen3",
    ),
    "qwen3_moe": Preset(
        "qwen3_moe",
        "Qwen/Qwen3-30B-A3B",
        {
            "hidden_size": 2048,
            "intermediate_size": 6144,  # the dense MLP of mlp_only_layers (none here)
            "moe_intermediate_size": 768,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": 0.001,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 151936,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "use_sliding_window": False,
            "max_position_embeddings": 40960,
        },
        params=30.5e9,
        liger="apply_liger_kernel_to_qwen3_moe",
        layers=4,  # 0.62B parameters a layer (128 experts of 3 x 2048 x 768): 4 of 48 layers, 3.1B parameters
    ),
    "qwen3_next": Preset(
        "qwen3_next",
        "transformers' Qwen3NextConfig defaults (Qwen3-Next-80B-A3B)",
        {
            "hidden_size": 2048,
            "intermediate_size": 5632,  # the dense MLP of mlp_only_layers (none here)
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "num_experts": 512,
            "num_experts_per_tok": 10,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "num_hidden_layers": 48,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            **GATED_DELTANET,
            "vocab_size": 151936,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768,
        },
        params=79.7e9,
        liger="apply_liger_kernel_to_qwen3_next",
        layers=2,  # 1.6B parameters a layer (512 experts of 3 x 2048 x 512): 2 of 48 layers, 3.9B parameters
        layer_types=("linear_attention", "full_attention"),
        tiny=GATED_DELTANET_TINY,
    ),
    "qwen3_5": Preset(
        "qwen3_5",
        "transformers' Qwen3_5Config defaults",
        {
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 32,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 256,
            **GATED_DELTANET,
            "vocab_size": 248320,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768,
        },
        params=9.4e9,
        liger="apply_liger_kernel_to_qwen3_5",
        layers=4,  # 0.2B parameters a layer, 2B of embeddings: 4 of 32 layers (3 Gated DeltaNet, 1 attention)
        tiny={**GATED_DELTANET_TINY, "rope_parameters": QWEN3_5_TINY_ROPE},
        vision=VisionTower(
            {**QWEN3_5_VISION, "out_hidden_size": 4096},
            {"tie_word_embeddings": False},
            {**QWEN_TINY_VISION, "num_position_embeddings": 16},
        ),
    ),
    "qwen3_5_moe": Preset(
        "qwen3_5_moe",
        "transformers' Qwen3_5MoeConfig defaults",
        {
            "hidden_size": 2048,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "num_experts": 256,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 40,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            **GATED_DELTANET,
            "vocab_size": 248320,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 32768,
        },
        params=35.0e9,
        liger="apply_liger_kernel_to_qwen3_5_moe",
        layers=2,  # 0.8B parameters a layer (256 experts of 3 x 2048 x 512): 2 of 40 layers, 3.1B parameters
        layer_types=("linear_attention", "full_attention"),
        tiny={**GATED_DELTANET_TINY, "rope_parameters": QWEN3_5_TINY_ROPE},
        vision=VisionTower(
            {**QWEN3_5_VISION, "out_hidden_size": 2048},
            {"tie_word_embeddings": False},
            {**QWEN_TINY_VISION, "num_position_embeddings": 16},
        ),
    ),
    "exaone4": Preset(
        "exaone4",
        "transformers' Exaone4Config defaults",
        {
            "hidden_size": 4096,
            "intermediate_size": 16384,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 102400,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "sliding_window": 4096,
            "sliding_window_pattern": 4,
            "max_position_embeddings": 32768,  # the defaults' 2048 is below the benchmark's sequences
        },
        params=9.4e9,
        liger="apply_liger_kernel_to_exaone4",
        layers=8,  # 0.27B parameters a layer: 8 of 32 layers (6 sliding-window, 2 full attention), 3.0B parameters
    ),
    "hunyuan_v1_dense": Preset(
        "hunyuan_v1_dense",
        "transformers' HunYuanDenseV1Config defaults",
        {
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "head_dim": 128,  # the config's default is None, which its attention cannot build
            "vocab_size": 290943,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 32768,  # the defaults' 2048 is below the benchmark's sequences
        },
        params=8.8e9,
        liger="apply_liger_kernel_to_hunyuan_v1_dense",
        layers=4,  # 0.2B parameters a layer, 2.4B of embeddings: 4 of 32 layers, 3.2B parameters
    ),
    "gemma": Preset(
        "gemma",
        "google/gemma-2b",
        {
            "hidden_size": 2048,
            "intermediate_size": 16384,
            "num_hidden_layers": 18,
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "vocab_size": 256000,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,  # transformers' GemmaConfig default; not in the copies checked
            "max_position_embeddings": 8192,
            # hidden_activation: transformers' default gelu_pytorch_tanh (the 2B's config.json says "gelu")
        },
        params=2.51e9,
        liger="apply_liger_kernel_to_gemma",
    ),
    "gemma2": Preset(
        "gemma2",
        "google/gemma-2-2b",
        {
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "vocab_size": 256000,
            "tie_word_embeddings": True,
            "final_logit_softcapping": 30.0,
            "attn_logit_softcapping": 50.0,
            "sliding_window": 4096,  # every other layer
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "max_position_embeddings": 8192,
            "hidden_activation": "gelu_pytorch_tanh",
        },
        params=2.61e9,
        liger="apply_liger_kernel_to_gemma2",
        attention="eager",  # transformers refuses SDPA for Gemma 2 (its attention logits are softcapped)
    ),
    "gemma3_text": Preset(
        "gemma3_text",
        "google/gemma-3-1b-pt",
        {
            "hidden_size": 1152,
            "intermediate_size": 6912,
            "num_hidden_layers": 26,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "vocab_size": 262144,
            "tie_word_embeddings": True,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "sliding_window": 512,
            "sliding_window_pattern": 6,  # five sliding-window layers, then a global one
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            "rope_scaling": None,
            "max_position_embeddings": 32768,
            "hidden_activation": "gelu_pytorch_tanh",
        },
        params=1.0e9,
        liger="apply_liger_kernel_to_gemma3_text",
        tiny={"sliding_window_pattern": 2},  # one sliding-window layer and one global of the two
    ),
    "phi3": Preset(
        "phi3",
        "microsoft/Phi-3-mini-4k-instruct",
        {
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 32064,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "rope_scaling": None,
            "sliding_window": 2047,
            "max_position_embeddings": 4096,
            "original_max_position_embeddings": 4096,
        },
        params=3.82e9,
        liger="apply_liger_kernel_to_phi3",
    ),
    "olmo2": Preset(
        "olmo2",
        "allenai/OLMo-2-0425-1B",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "vocab_size": 100352,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "rms_norm_eps": 1e-6,
            "rope_theta": 500000.0,
            "max_position_embeddings": 4096,  # OLMo 2's 4096-token context; not in the copy checked
        },
        params=1.48e9,
        liger="apply_liger_kernel_to_olmo2",
    ),
    "glm4": Preset(
        "glm4",
        "THUDM/GLM-4-9B-0414",
        {
            "hidden_size": 4096,
            "intermediate_size": 13696,
            "num_hidden_layers": 40,
            "num_attention_heads": 32,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "partial_rotary_factor": 0.5,
            "attention_bias": True,
            "vocab_size": 151552,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": 32768,
        },
        params=9.4e9,
        liger="apply_liger_kernel_to_glm4",
        layers=8,  # no GLM-4 (glm4 model_type) of 1B-4B: 8 of 40 layers, 2.9B parameters
    ),
    "granite": Preset(
        "granite",
        "ibm-granite/granite-3.1-2b-base",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 40,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 49155,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-5,
            "rope_theta": 5000000.0,
            "max_position_embeddings": 131072,
            # The µP multipliers of IBM's 2B Granite configs, read from a copy of a later 2B's config, not
            # from granite-3.1-2b-base's own (attention_multiplier is 1 / head_dim 64).
            "embedding_multiplier": 12.0,
            "attention_multiplier": 0.015625,
            "residual_multiplier": 0.22,
            "logits_scaling": 8.0,
        },
        params=2.53e9,
        liger="apply_liger_kernel_to_granite",  # has no fused linear cross entropy: Liger's cross entropy on logits
    ),
    "nemotron": Preset(
        "nemotron",
        "nvidia/Minitron-4B-Base",
        {
            "hidden_size": 3072,
            "intermediate_size": 9216,
            "num_hidden_layers": 32,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 256000,
            "tie_word_embeddings": False,
            "norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "max_position_embeddings": 4096,
            "hidden_act": "relu2",
        },
        params=4.19e9,
        liger="apply_liger_kernel_to_nemotron",  # its squared ReLU and fused linear cross entropy; not the norms
        layers=16,  # 16 of 32 layers, 2.9B parameters
    ),
    # transformers' DeepseekV4Config defaults (DeepSeek-V4-Flash, 284B), not a member's config.json. One MoE layer's
    # 256 experts alone are 6.4B parameters, so the benchmark runs 16 of them (top-6): not the member's shape.
    "deepseek_v4": Preset(
        "deepseek_v4",
        "transformers' DeepseekV4Config defaults (DeepSeek-V4-Flash)",
        {
            "hidden_size": 4096,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 43,
            "num_attention_heads": 64,
            "num_key_value_heads": 1,
            "head_dim": 512,
            "q_lora_rank": 1024,
            "o_groups": 8,
            "o_lora_rank": 1024,
            "index_n_heads": 64,
            "index_head_dim": 128,
            "index_topk": 512,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 6,
            "hc_mult": 4,
            "sliding_window": 128,
            "swiglu_limit": 10.0,
            "vocab_size": 129280,
            "rms_norm_eps": 1e-6,
            # top-k routing in every layer: the first layers' hash routing reads a token -> experts table that only
            # a checkpoint fills (all zeros from a config: every token to expert 0); the same parameters
            "mlp_layer_types": ["moe"] * 43,
        },
        params=284.3e9,
        liger="apply_liger_kernel_to_deepseek_v4",  # its RMSNorm and fused linear cross entropy
        layers=4,
        reduced={"n_routed_experts": 16},  # 3.23B parameters
        attention="eager",  # transformers has no SDPA path for DeepSeek-V4
        tiny={
            "q_lora_rank": 32,
            "o_groups": 2,
            "o_lora_rank": 16,
            "index_n_heads": 2,
            "index_head_dim": 16,
            "index_topk": 4,
            "n_routed_experts": 8,
            "hc_mult": 2,
        },
    ),
    # The presets below are transformers' own config defaults for the family (the shape its config class builds
    # with no arguments; `params` is what that builds, counted by the preset test), written out in full.
    "smollm3": Preset(
        "smollm3",
        "transformers' SmolLM3Config defaults (SmolLM3-3B's shape)",
        {
            "hidden_size": 2048,
            "intermediate_size": 11008,
            "num_hidden_layers": 36,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "vocab_size": 128256,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6,
            "no_rope_layer_interval": 4,  # every fourth layer without RoPE
            "max_position_embeddings": 32768,
        },
        params=3.08e9,
        liger="apply_liger_kernel_to_smollm3",
    ),
    "olmo3": Preset(
        "olmo3",
        "transformers' Olmo3Config defaults",
        {
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 50304,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "sliding_window": 4096,
            "max_position_embeddings": 2048,
        },
        params=6.89e9,
        liger="apply_liger_kernel_to_olmo3",
        layers=12,  # 12 of 32 layers, 2.8B parameters
    ),
    "glm4_moe": Preset(
        "glm4_moe",
        "transformers' Glm4MoeConfig defaults (GLM-4.5-Air's widths, without its MTP layer)",
        {**GLM45_AIR, "tie_word_embeddings": False, "max_position_embeddings": 131072},
        params=103.5e9,
        liger="apply_liger_kernel_to_glm4_moe",
        layers=2,  # the dense layer and one MoE layer (128 experts, 2.2B parameters): 3.7B parameters
        tiny={"n_routed_experts": 8},
    ),
    "gpt_oss": Preset(
        "gpt_oss",
        "transformers' GptOssConfig defaults with 24 layers and 32 experts (gpt-oss-20b's shape)",
        {
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "num_hidden_layers": 24,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 201088,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "sliding_window": 128,
            "max_position_embeddings": 131072,
        },
        params=20.9e9,
        liger="apply_liger_kernel_to_gpt_oss",
        layers=3,  # 0.8B parameters a layer (32 experts of 3 x 2880 x 2880): 3 of 24 layers, 3.6B parameters
        attention="eager",  # its attention sinks: transformers runs them in eager attention (and flash kernels)
    ),
    "falcon_h1": Preset(
        "falcon_h1",
        "transformers' FalconH1Config defaults",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128000,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 8192,
        },
        params=8.51e9,
        liger="apply_liger_kernel_to_falcon_h1",
        layers=10,  # 10 of 32 layers (attention and Mamba-2 mixer in parallel), 3.4B parameters
        # Without mamba-ssm transformers runs the Mamba-2 mixer in PyTorch; before 5.18 that path builds a (chunks x
        # chunk x chunk x heads x state) float32 product, 128 GiB a 4096-token sequence at these widths: run the
        # family on transformers 5.18 or later (TF_LISTS in benchmarks/e2e_families_parallel.sh).
        tiny={"mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 8, "mamba_chunk_size": 8},
    ),
    # Vision-language models: built as the family's *ForConditionalGeneration (vision tower included) and trained on
    # text alone, as a text-only fine-tune of such a model runs; `config` is the language model's text_config.
    "qwen2_vl": Preset(
        "qwen2_vl",
        "Qwen/Qwen2-VL-2B-Instruct",
        {
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 32768,
        },
        params=2.21e9,
        liger="apply_liger_kernel_to_qwen2_vl",
        tiny={"rope_parameters": TINY_MROPE},
        vision=VisionTower(
            {"depth": 32, "embed_dim": 1280, "hidden_size": 1536, "num_heads": 16, "mlp_ratio": 4, "patch_size": 14},
            {"tie_word_embeddings": True},
            {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2, "patch_size": 2},
        ),
    ),
    "qwen2_5_vl": Preset(
        "qwen2_5_vl",
        "Qwen/Qwen2.5-VL-3B-Instruct",
        {
            "hidden_size": 2048,
            "intermediate_size": 11008,
            "num_hidden_layers": 36,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 128000,
        },
        params=3.75e9,
        liger="apply_liger_kernel_to_qwen2_5_vl",
        tiny={"rope_parameters": TINY_MROPE},
        vision=VisionTower(
            {
                "depth": 32,
                "hidden_size": 1280,
                "intermediate_size": 3420,
                "num_heads": 16,
                "out_hidden_size": 2048,
                "fullatt_block_indexes": [7, 15, 23, 31],
                "window_size": 112,
                "patch_size": 14,
            },
            {"tie_word_embeddings": True},
            {**QWEN_TINY_VISION, "window_size": 4, "fullatt_block_indexes": [0]},
        ),
    ),
    "qwen3_vl": Preset(
        "qwen3_vl",
        "Qwen/Qwen3-VL-2B-Instruct",
        {
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "rms_norm_eps": 1e-6,
            "rope_theta": 5000000.0,
            "max_position_embeddings": 262144,
        },
        params=2.13e9,
        liger="apply_liger_kernel_to_qwen3_vl",
        vision=VisionTower(
            {
                "depth": 24,
                "hidden_size": 1024,
                "intermediate_size": 4096,
                "num_heads": 16,
                "out_hidden_size": 2048,
                "deepstack_visual_indexes": [5, 11, 17],
                "num_position_embeddings": 2304,
                "patch_size": 16,
            },
            {"tie_word_embeddings": True},
            {**QWEN_TINY_VISION, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
        ),
    ),
    "qwen3_vl_moe": Preset(
        "qwen3_vl_moe",
        "Qwen/Qwen3-VL-30B-A3B-Instruct",
        {
            "hidden_size": 2048,
            "intermediate_size": 6144,  # the dense MLP of mlp_only_layers (none here)
            "moe_intermediate_size": 768,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "vocab_size": 151936,
            "rms_norm_eps": 1e-6,
            "rope_theta": 5000000.0,
            "max_position_embeddings": 262144,
        },
        params=31.1e9,
        liger="apply_liger_kernel_to_qwen3_vl_moe",
        layers=4,  # 0.62B parameters a layer (128 experts of 3 x 2048 x 768): 4 of 48 layers, 3.7B parameters
        vision=VisionTower(
            {
                "depth": 27,
                "hidden_size": 1152,
                "intermediate_size": 4304,
                "num_heads": 16,
                "out_hidden_size": 2048,
                "deepstack_visual_indexes": [8, 16, 24],
                "num_position_embeddings": 2304,
                "patch_size": 16,
            },
            {"tie_word_embeddings": False},
            {**QWEN_TINY_VISION, "num_position_embeddings": 16, "deepstack_visual_indexes": [0]},
        ),
    ),
    "gemma3": Preset(
        "gemma3",
        "google/gemma-3-4b-pt",
        {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": 34,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "query_pre_attn_scalar": 256,
            "vocab_size": 262208,
            "sliding_window": 1024,  # five sliding-window layers, then a global one
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 131072,
            # its global layers' RoPE scaling (linear, factor 8) is left out: it changes no shape or cost
        },
        params=4.30e9,
        liger="apply_liger_kernel_to_gemma3",
        layers=24,  # 24 of 34 layers, 3.4B parameters with the vision tower (4.3B whole: past 4B)
        vision=VisionTower(
            {
                "hidden_size": 1152,
                "intermediate_size": 4304,
                "num_hidden_layers": 27,
                "num_attention_heads": 16,
                "patch_size": 14,
                "image_size": 896,
            },
            {"tie_word_embeddings": True, "mm_tokens_per_image": 256},
            TINY_VISION,
            tiny_outer={"mm_tokens_per_image": 4},
        ),
    ),
    "mllama": Preset(
        "mllama",
        "transformers' MllamaConfig defaults (Llama-3.2-11B-Vision's shape)",
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 40,  # 32 self-attention layers and 8 cross-attention ones
            "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38],
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "max_position_embeddings": 131072,
        },
        params=10.6e9,
        liger="apply_liger_kernel_to_mllama",
        layers=8,  # 8 of 40 layers, the fourth a cross-attention one (skipped without an image): 3.7B parameters
        tiny={"cross_attention_layers": [1], **TINY_SPECIAL_TOKENS},
        vision=VisionTower(
            {
                "hidden_size": 1280,
                "intermediate_size": 5120,
                "num_hidden_layers": 32,
                "num_global_layers": 8,
                "attention_heads": 16,
                "vision_output_dim": 7680,
                "patch_size": 14,
                "image_size": 448,
            },
            {},
            {
                "hidden_size": 32,
                "intermediate_size": 48,
                "num_hidden_layers": 1,
                "num_global_layers": 1,
                "attention_heads": 2,
                "image_size": 8,
                "patch_size": 2,
                "max_num_tiles": 1,
                "intermediate_layers_indices": [0],
                "vision_output_dim": 64,
                "supported_aspect_ratios": [[1, 1]],
            },
        ),
    ),
    "llava": Preset(
        "llava",
        "transformers' LlavaConfig defaults (llava-1.5-7b's shape: Llama 2 7B and CLIP ViT-L/14 at 336)",
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 32000,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "max_position_embeddings": 2048,
        },
        params=7.06e9,
        liger="apply_liger_kernel_to_llava",
        layers=8,  # 8 of 32 layers, 2.2B parameters
        vision=VisionTower(
            {
                "model_type": "clip_vision_model",
                "hidden_size": 1024,
                "intermediate_size": 4096,
                "num_hidden_layers": 24,
                "num_attention_heads": 16,
                "projection_dim": 768,
                "patch_size": 14,
                "image_size": 336,
            },
            {"tie_word_embeddings": False},
            {"model_type": "clip_vision_model", **TINY_VISION, "projection_dim": 32},
        ),
    ),
    "paligemma": Preset(
        "paligemma",
        "transformers' PaliGemmaConfig defaults (paligemma-3b's shape: Gemma 2B and SigLIP So400m at 224)",
        {
            "model_type": "gemma",
            "hidden_size": 2048,
            "intermediate_size": 16384,
            "num_hidden_layers": 18,
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "vocab_size": 257152,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "max_position_embeddings": 8192,
        },
        params=2.93e9,
        liger="apply_liger_kernel_to_paligemma",
        vision=VisionTower(
            {
                "model_type": "siglip_vision_model",
                "hidden_size": 1152,
                "intermediate_size": 4096,
                "num_hidden_layers": 27,
                "num_attention_heads": 16,
                "projection_dim": 2048,
                "patch_size": 14,
                "image_size": 224,
            },
            {"tie_word_embeddings": True},
            {"model_type": "siglip_vision_model", **TINY_VISION, "projection_dim": 64},
        ),
    ),
    "internvl": Preset(
        "internvl",
        "transformers' InternVLConfig defaults (a Qwen2 7B-wide language model and InternViT-300M)",
        {
            "model_type": "qwen2",
            "hidden_size": 4096,
            "intermediate_size": 22016,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "use_sliding_window": False,
            "max_position_embeddings": 32768,
        },
        params=11.8e9,
        liger="apply_liger_kernel_to_internvl",
        layers=8,  # 8 of 32 layers, 3.7B parameters
        vision=VisionTower(
            {
                "hidden_size": 1024,
                "intermediate_size": 4096,
                "num_hidden_layers": 24,
                "num_attention_heads": 16,
                "patch_size": [14, 14],
                "image_size": [448, 448],
            },
            {"tie_word_embeddings": True},
            {**TINY_VISION, "image_size": [8, 8], "patch_size": [2, 2]},
        ),
    ),
    "mistral3": Preset(
        "mistral3",
        "transformers' Mistral3Config defaults (Mistral-Small-3.1-24B's shape)",
        {
            "model_type": "mistral",
            "hidden_size": 5120,
            "intermediate_size": 32768,
            "num_hidden_layers": 40,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 131072,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000000.0,
            "sliding_window": None,
            "max_position_embeddings": 131072,
        },
        params=24.0e9,
        liger=None,  # Liger-Kernel has no apply_liger_kernel_to_mistral3
        layers=3,  # 0.56B parameters a layer: 3 of 40 layers, 3.4B parameters
        vision=VisionTower(
            {
                "model_type": "pixtral",
                "hidden_size": 1024,
                "intermediate_size": 4096,
                "num_hidden_layers": 24,
                "num_attention_heads": 16,
                "head_dim": 64,
                "patch_size": 14,
                "image_size": 1540,
            },
            {"tie_word_embeddings": False},
            {"model_type": "pixtral", **TINY_VISION, "head_dim": 16},
        ),
    ),
    "llama4": Preset(
        "llama4",
        "transformers' Llama4Config defaults (Llama-4-Scout-17B-16E's text shape)",
        LLAMA4_SCOUT_TEXT,
        params=108.2e9,
        liger="apply_liger_kernel_to_llama4",
        layers=1,  # one MoE layer (2.2B: 16 experts of 3 x 5120 x 8192, a shared one), embeddings and head (2.1B)
        # transformers' Llama 4 MoE runs every token through all 16 experts (the router's weights zero the others), so
        # the layer's activations are 16 dense MLPs' of its width, beside the float32 logits of 202,048 tokens: half
        # the default micro-batch keeps HF eager's step well inside one H200
        micro_batch=2,
        tiny=LLAMA4_TINY,
        vision=VisionTower(
            {
                "hidden_size": 768,
                "intermediate_size": 5632,
                "num_hidden_layers": 34,
                "num_attention_heads": 16,
                "vision_output_dim": 7680,
                "projector_input_dim": 4096,
                "projector_output_dim": 4096,
                "patch_size": 14,
                "image_size": 448,
            },
            {"tie_word_embeddings": False},
            {
                **TINY_VISION,
                "vision_output_dim": 32,
                "projector_input_dim": 64,
                "projector_output_dim": 64,
                "pixel_shuffle_ratio": 0.5,
            },
            depth={"num_hidden_layers": 4},  # 4 of 34 vision layers: 4.4B parameters in all, not 4.7B
        ),
    ),
    "llama4_text": Preset(
        "llama4_text",
        "transformers' Llama4TextConfig defaults (Llama-4-Scout-17B-16E's text shape)",
        LLAMA4_SCOUT_TEXT,
        params=107.8e9,
        liger="apply_liger_kernel_to_llama4",
        layers=1,  # one MoE layer (2.2B: 16 experts of 3 x 5120 x 8192, a shared one), embeddings and head (2.1B): 4.3B
        # transformers' Llama 4 MoE runs every token through all 16 experts (the router's weights zero the others), so
        # the layer's activations are 16 dense MLPs' of its width, beside the float32 logits of 202,048 tokens: half
        # the default micro-batch keeps HF eager's step well inside one H200
        micro_batch=2,
        tiny=LLAMA4_TINY,
    ),
    "gemma4": Preset(
        "gemma4",
        "transformers' Gemma4Config defaults, with its vision tower's defaults",
        GEMMA4_TEXT,
        params=5.25e9,
        liger="apply_liger_kernel_to_gemma4",
        layers=12,  # 12 of 30 layers (each with its per-layer embeddings, 67M): 2.6B parameters
        tiny={**GEMMA4_TINY, **TINY_SPECIAL_TOKENS},  # its multimodal embedding pads with pad_token_id
        vision=VisionTower(
            {
                "hidden_size": 768,
                "intermediate_size": 3072,
                "num_hidden_layers": 16,
                "num_attention_heads": 12,
                "num_key_value_heads": 12,
                "head_dim": 64,
                "patch_size": 16,
                "pooling_kernel_size": 3,
            },
            {"tie_word_embeddings": True},
            {**TINY_VISION, "num_key_value_heads": 2, "head_dim": 16, "pooling_kernel_size": 2},
        ),
    ),
    "glm4v": Preset(
        "glm4v",
        "THUDM/GLM-4.1V-9B-Thinking",
        {
            "hidden_size": 4096,
            "intermediate_size": 13696,
            "num_hidden_layers": 40,
            "num_attention_heads": 32,
            "num_key_value_heads": 2,
            "vocab_size": 151552,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 65536,
            "attention_bias": True,
            "rope_parameters": GLM4V_ROPE,
        },
        params=10.29e9,
        liger="apply_liger_kernel_to_glm4v",
        layers=8,  # 8 of 40 layers, 3.8B parameters with the vision tower
        tiny={"rope_parameters": GLM4V_TINY_ROPE},
        vision=VisionTower(
            GLM4V_VISION,
            {"tie_word_embeddings": False},
            QWEN_TINY_VISION,
        ),
    ),
    "glm4v_moe": Preset(
        "glm4v_moe",
        "zai-org/GLM-4.5V (without its MTP layer)",
        {
            **GLM45_AIR,
            "head_dim": 128,
            "max_position_embeddings": 65536,
            "attention_bias": True,
            "rope_parameters": GLM4V_ROPE,
        },
        params=107.74e9,
        liger="apply_liger_kernel_to_glm4v_moe",
        layers=2,  # the dense layer and one MoE layer (128 experts, 2.2B parameters)
        tiny={"rope_parameters": GLM4V_TINY_ROPE, "n_routed_experts": 8},
        vision=VisionTower(
            GLM4V_VISION,
            {"tie_word_embeddings": False},
            QWEN_TINY_VISION,
            depth={"depth": 1},  # 1 of 24 vision layers: 4.1B parameters in all, not 4.7B
        ),
    ),
    "smolvlm": Preset(
        "smolvlm",
        "transformers' SmolVLMConfig defaults (a Llama 7B-wide language model and its SigLIP-style vision tower)",
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 32000,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 2048,
        },
        params=6.91e9,
        liger="apply_liger_kernel_to_smolvlm",
        layers=12,  # 12 of 32 layers, 2.9B parameters
        vision=VisionTower(
            {
                "hidden_size": 1152,
                "intermediate_size": 3072,
                "num_hidden_layers": 12,
                "num_attention_heads": 16,
                "patch_size": 32,
                "image_size": 224,
            },
            {"tie_word_embeddings": False},
            TINY_VISION,
        ),
    ),
    "gemma4_text": Preset(
        "gemma4_text",
        "transformers' Gemma4TextConfig defaults",
        GEMMA4_TEXT,
        params=5.1e9,
        liger="apply_liger_kernel_to_gemma4_text",
        layers=12,  # 12 of 30 layers (each with its per-layer embeddings, 67M): 2.4B parameters
        tiny=GEMMA4_TINY,
    ),
    "muse_glimmer": Preset(
        "muse_glimmer",
        "transformers' MuseGlimmerConfig defaults",
        {
            "hidden_size": 6656,
            "intermediate_size": 19968,
            "num_hidden_layers": 52,
            "num_attention_heads": 32,
            "num_key_value_heads": 2,
            "head_dim": 128,
            "vocab_size": 202048,
            "max_position_embeddings": 131072,
        },
        params=29.78e9,
        liger="apply_liger_kernel_to_muse_glimmer",
        layers=2,  # 2 of 52 layers (0.48B each, beside 2.7B of embeddings and head): 3.8B parameters
        layer_types=("sliding_attention", "full_attention"),  # every fourth layer attends in full
        vision=VisionTower(
            {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 50, "num_attention_heads": 16},
            {},
            {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2},
            depth={"num_hidden_layers": 1, "layer_types": ["full_attention"]},  # 1 of 50 vision layers
            tiny_outer={"out_hidden_size": 128, "projector_hidden_size": 64},  # the tiny tower's 2 x 2 merged patches
        ),
    ),
}
# Families of tigon's kernel table with no preset here, and why.
NOT_BENCHMARKED = {
    "phi4_multimodal": "its vision and audio towers would be built at full size and carried unused by text training",
    "pixtral": "a vision encoder with no LM head: mistral3's preset carries its vision tower (trained on text there)",
}
LLAMA_32_1B = PRESETS["llama"].shape()
TINY = PRESETS["llama"].tiny_shape()
#: --shape: a larger Llama than the preset's (Llama-3-8B, random weights)
LARGER_SHAPES = {"llama-3-8b": LLAMA_3_8B}
#: --qlora: the base in 4 bits (NF4, double quantization), rank-16 adapters on every projection
QLORA = {
    "enabled": True,
    "r": 16,
    "alpha": 32,
    "quantize_base": "nf4",
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
VARIANTS = ("eager", "liger", "tigon", "planner")


def parse_families(value: str) -> list[str]:
    """`all`, or a comma-separated list of `PRESETS` keys."""
    if value.strip() == "all":
        return list(PRESETS)
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in PRESETS]
    for name in names:
        if name in NOT_BENCHMARKED:
            raise ValueError(f"{name} has no benchmark preset: {NOT_BENCHMARKED[name]}")
    if unknown or not names:
        raise ValueError(f"unknown families {unknown}; choose from all, {', '.join(PRESETS)}")
    return names
