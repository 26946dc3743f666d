"""End-to-end training benchmark: tokens/s and peak memory through the runtime's own step.

    python -m benchmarks.end_to_end --out e2e.json                    # GPU: Llama, seq 4096 and 8192, every variant
    python -m benchmarks.end_to_end --family all --seqs 4096 --out families.json   # GPU: every model family
    python -m benchmarks.end_to_end --longest --out longest.json      # GPU: the longest sequence each fits
    python -m benchmarks.end_to_end --tiny --family all --variants eager,tigon --out /tmp/e2e.json   # CPU smoke run
    python -m benchmarks.end_to_end --merge part1.json part2.json --out families.json   # one table and a plot
    python -m benchmarks.end_to_end --seqs 4096 --variants liger,tigon --profile --out e2e.json   # + time per kind

One model per family of tigon's kernel table (`--family`, default llama; `all`, or a comma-separated list),
randomly initialized from the config of a named public member, or transformers' defaults for the family
(`PRESETS`): a ~1B-4B model as it is, or for larger ones their real widths, heads and vocabulary with fewer
layers. `NOT_BENCHMARKED` names the table's families without a preset, and why. In bf16
with AdamW, micro-batch 8, gradient checkpointing on, trained on random tokens by the torch trainer's own
`_optimizer_step` and strategy (its loss, clipping and AdamW step). Variants:

- eager:   Hugging Face modules (kernels.enabled: false)
- liger:   HF + Liger-Kernel (the family's `apply_liger_kernel_to_*` on the built model; GPU machine only;
           "not available" for a family Liger-Kernel has no function for, or without liger-kernel, and
           "not supported by liger" where its function raises on the built model)
- tigon:   tigon's kernels (kernels.enabled: true)
- planner: the memory planner's choice for this GPU (`training.plan: auto`), same global batch

Every variant runs in a fresh subprocess so peaks do not mix; warm-up steps are not timed. The
planner's estimate is recorded next to each measured peak (the planner models eager and tigon;
Liger's rows have none, nor have models whose parameters the planner's shape does not count: a
Llama-like decoder, with Mixtral's, Qwen2-MoE's or Qwen3-MoE's MoE block). The trainer's loss is the
model's own, called with labels: HF eager computes `ForCausalLMLoss` from the full logits; Liger's and
tigon's patched forwards use their fused linear cross entropy, so neither materializes the
(tokens x vocab) logits (Liger's Granite patch has none: it keeps the logits and swaps in its cross
entropy).
`--tiny` shrinks every family's widths, layers and vocabulary but keeps its model_type and quirks
(softcapping, logit scaling, sliding windows, partial rotary, MoE routing, tied or untied head).
`--time-budget` stops starting runs once the next one would not finish in time; those rows say so.
Results: JSON to --out, a markdown table to --md (default: --out with .md). `--merge` joins reports of
several device calls (the last measured run of each family, variant and sequence wins) and also draws
tokens/s and peak memory against HF eager per family (--out with .png).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.headline import LLAMA_3_8B

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30


@dataclass(frozen=True)
class Preset:
    """One family's benchmark model: the config.json values of a named public member, and how it is run.

    `config` holds the values that set shapes and the family's quirks, at the member's real depth;
    `layers` shortens it (real widths, heads and vocabulary) where the family has no member of 1B-4B.
    `params` is the member's published parameter count (the preset test counts `config` against it).
    `liger` names the Liger-Kernel function for the family, None where Liger-Kernel has none.
    `tiny` holds family-specific `--tiny` values on top of `tiny_shape`'s generic shrink.
    `attention` is the run's `model.attn_implementation`.
    """

    family: str  # tigon's kernel table key, which is also the transformers model_type
    source: str  # the Hugging Face model whose config.json the values are from
    config: dict
    params: float
    liger: str | None
    layers: int | None = None
    tiny: dict = field(default_factory=dict)
    attention: str = "sdpa"

    def shape(self) -> dict:
        """The benchmark's `model.config_overrides`: `config`, shortened to `layers`."""
        return {**self.config, **({"num_hidden_layers": self.layers} if self.layers else {})}

    def tiny_shape(self) -> dict:
        """Small widths, 2 layers, vocabulary 512, no special tokens; the model_type and `config`'s quirks kept."""
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
        return shape | self.tiny

    def describe(self, tiny: bool = False) -> str:
        if tiny:
            return f"tiny {self.family} (2 layers, hidden 64, vocab 512; {self.source}'s quirks)"
        depth = self.config["num_hidden_layers"]
        if self.layers and self.layers < depth:
            return f"{self.source} widths and vocabulary, {self.layers} of its {depth} layers (random init)"
        return f"{self.source} (random init from its config)"


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
        {
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
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 131072,
        },
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
        tiny={"mamba_d_ssm": 32, "mamba_n_heads": 4, "mamba_d_head": 8, "mamba_d_state": 8, "mamba_chunk_size": 8},
    ),
}
# Families of tigon's kernel table with no preset here, and why.
NOT_BENCHMARKED = {
    family: "a vision-language model: the runtime builds a causal LM from a flat config (AutoModelForCausalLM)"
    for family in (
        "llama4",
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
        "qwen3_vl_moe",
        "gemma3",
        "mllama",
        "llava",
        "paligemma",
        "internvl",
        "mistral3",
    )
} | {
    "phi4_multimodal": "its vision and audio towers would be built at full size and carried unused by text training",
    "llama4_text": "one Llama 4 Scout layer (16 experts of 3 x 5120 x 8192) and its embeddings are 4.3B parameters, "
    "past what AdamW trains in bf16 beside the activations on one 80 GB GPU",
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


def count_text(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"


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


# ---------------------------------------------------------------------------------------------------- one run


def bench_config(spec: dict, cuda: bool):
    """The RunConfig of one measurement (data is random tokens, so data.train is never read)."""
    from tigon.runtime.config import parse_config

    shape = dict(spec["shape"])
    shape["max_position_embeddings"] = max(shape.get("max_position_embeddings") or 0, spec["seq"])
    raw = {
        "name": f"e2e-{spec.get('family', 'llama')}-{spec['variant']}",
        "model": {
            "config_name": spec.get("family", "llama"),
            "config_overrides": shape,
            "tokenizer": "char",
            "dtype": "bfloat16" if cuda else "float32",
            "attn_implementation": spec.get("attention", "sdpa"),
        },
        "data": {"train": "random-tokens", "max_seq_len": spec["seq"], "packing": False},
        "training": {
            "max_steps": spec["warmup"] + spec["steps"],
            "learning_rate": 1e-4,
            "lr_schedule": "constant",
            "micro_batch_size": spec["micro_batch"],
            "gradient_accumulation_steps": 1,
            "gradient_checkpointing": spec["checkpointing"],
            "checkpoint_layers": spec.get("checkpoint_layers") if spec["checkpointing"] else None,
            "precision": "bf16" if cuda else "fp32",
            "plan": "auto" if spec["variant"] == "planner" else "manual",
            "compile": spec.get("compile", False),
        },
        "kernels": {"enabled": spec["variant"] in ("tigon", "planner")},
        "lora": QLORA if spec.get("qlora") else {"enabled": False},
        "checkpoint": {"export": False, "resume": False},
        "logging": {"run_dir": "runs/e2e", "tensorboard": False, "progress_bar": False},
    }
    return parse_config(raw, f"end_to_end {spec.get('family', 'llama')} {spec['variant']}")


def random_dataset(n_items: int, seq: int, vocab: int, seed: int) -> list[dict]:
    """Packed-dataset items of random tokens, one document per sequence."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n_items, seq), generator=generator)
    positions = torch.arange(seq)
    return [{"input_ids": row, "labels": row.clone(), "position_ids": positions} for row in ids]


def liger_function(family: str, cuda: bool):
    """(the family's `apply_liger_kernel_to_*`, None) or (None, why the Liger variant is not available)."""
    name = PRESETS[family].liger
    if name is None:
        return None, f"Liger-Kernel has no apply_liger_kernel_to_* function for {family}"
    if not cuda:
        return None, "Liger-Kernel needs a CUDA GPU"
    try:
        import liger_kernel.transformers as liger
    except ImportError as error:  # not installed here (the GPU machine carries its wheel)
        return None, f"liger-kernel is not installed ({error})"
    try:
        function = getattr(liger, name, None)
    except ImportError as error:  # its monkey_patch module refuses this transformers
        return None, f"liger-kernel cannot patch this transformers ({error})"
    if function is None:
        return None, f"the installed liger-kernel has no {name}"
    return function, None


class LigerUnsupported(RuntimeError):
    """Liger-Kernel's function for the family raised while patching the built model."""


def run_steps(config, steps: int, warmup: int, liger=None, profile: bool = False, trace: str | None = None) -> dict:
    """Build the model on the device and run warm-up + timed optimizer steps through the torch trainer's step.

    `liger`: an `apply_liger_kernel_to_*` function, applied to the built model. `profile`: one more step, under
    the profiler, whose time per kind of kernel is returned as "profile" (`tigon.runtime.profiling`); `trace`:
    where that step's Chrome trace goes.
    """
    import torch

    from tigon.runtime import checkpoint as ckpt
    from tigon.runtime import trainer
    from tigon.runtime.distributed import DistEnv
    from tigon.runtime.model import build_model
    from tigon.runtime.parallel import build_strategy

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    training = config.training
    vocab = config.model.config_overrides["vocab_size"]
    if cuda:
        torch.zeros((), device=device)  # initializes CUDA: resetting the peak before that is an error
        torch.cuda.reset_peak_memory_stats(device)
    trainer.seed_everything(training.seed)
    adapters = config.lora.enabled
    if liger is not None and adapters:
        liger()  # patches the classes: the model built next has Liger's modules under peft's adapters
    with device:
        model = build_model(config, vocab)
    if liger is not None and not adapters:
        try:
            liger(model=model)
        except Exception as error:  # its patch does not fit this model or this transformers
            raise LigerUnsupported(f"{type(error).__name__}: {error}") from error
    if cuda:  # the step's peak: a 4-bit base is built in model.dtype first and quantized layer by layer after
        torch.cuda.reset_peak_memory_stats(device)
    env = DistEnv()
    strategy = build_strategy(model, config, env, device, steps + warmup)  # one process: the model, AdamW
    strategy.model.train()
    global_batch = training.micro_batch_size * training.gradient_accumulation_steps
    dataset = random_dataset(global_batch * (steps + warmup + profile), config.data.max_seq_len, vocab, training.seed)
    sampler = trainer.GlobalBatchSampler(
        len(dataset), training.micro_batch_size, training.gradient_accumulation_steps, 1, 0, training.seed
    )
    state = ckpt.TrainState()

    def one_step() -> tuple[float, int]:
        loss, _, n_tokens = trainer._optimizer_step(strategy, sampler, dataset, state, config, env, device)
        state.batches_in_epoch += 1
        return loss, n_tokens

    losses, seconds, tokens = [], 0.0, 0
    for step in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        loss, n_tokens = one_step()
        if cuda:
            torch.cuda.synchronize(device)
        losses.append(loss)
        if step >= warmup:
            seconds += time.perf_counter() - started
            tokens += n_tokens
    result = {
        "tokens_per_second": tokens / seconds,
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "losses": losses,
    }
    if profile:
        from tigon.runtime.profiling import profile_step

        _, result["profile"] = profile_step(one_step, cuda, trace)
    return result


def count_parameters(config) -> int:
    """The run's model's parameters (tied ones once), built on the meta device."""
    from tigon.runtime.model import build_model

    model = build_model(config, config.model.config_overrides["vocab_size"], meta=True)
    return sum(p.numel() for p in model.parameters())


def estimate_note(shape, params: int) -> str | None:
    """Why the planner's estimate is left out for a model of `params` parameters: its shape (a Llama-like
    decoder, with the MoE block of planner.MOE_FAMILIES) counts others, so the estimate is not this model's;
    None where the counts agree within 2%."""
    if abs(shape.params - params) <= 0.02 * params:
        return None
    return (
        f"the planner's decoder shape counts {count_text(shape.params)} parameters, the model has {count_text(params)}"
    )


def worker(spec: dict) -> dict:
    """One variant at one shape, in this (fresh) process; returns what it measured, or that it ran out of memory."""
    import torch

    from tigon.runtime import planner

    cuda = torch.cuda.is_available()
    family = spec.get("family", "llama")
    head = {"family": family, "variant": spec["variant"], "seq": spec["seq"]}
    liger = None
    if spec["variant"] == "liger":
        liger, missing = liger_function(family, cuda)
        if missing:
            return {**head, "oom": False, "unavailable": missing}
    config = bench_config(spec, cuda)
    work = planner.workload(config, world_size=1)
    params = count_parameters(config)
    note = estimate_note(work.shape, params)
    if spec["variant"] == "planner":
        memory = planner.parse_memory(spec["gpu_memory"]) if spec.get("gpu_memory") else None
        try:
            plan = planner.make_plan(config, memory, 1, work)
        except planner.PlanError as error:  # nothing fits: reported like an out-of-memory run
            return {**head, "oom": True, "plan_error": str(error)}
        print(plan.table(), file=sys.stderr, flush=True)
        config = planner.apply_plan(config, plan)
    setting = planner.setting_of(config)
    result = {
        **head,
        "params": params,
        "micro_batch": setting.micro_batch,
        "accumulation": setting.accumulation,
        "checkpointing": setting.checkpointing,
        "checkpoint_layers": setting.checkpoint_layers,
        "kernels": setting.kernels,
        "estimate_bytes": None if spec["variant"] == "liger" or note else planner.estimate(work, setting).peak,
    }
    if note:
        result["estimate_note"] = note
    try:
        trace = spec.get("trace_dir") and f"{spec['trace_dir']}/{family}-{spec['variant']}-{spec['seq']}.json"
        measured = run_steps(
            config, spec["steps"], spec["warmup"], liger=liger, profile=spec.get("profile", False), trace=trace
        )
    except torch.OutOfMemoryError:
        return {**result, "oom": True}
    except LigerUnsupported as error:
        return {**head, "oom": False, "unavailable": f"not supported by liger: {error}"}
    return {**result, "oom": False, **measured}


# ---------------------------------------------------------------------------------------------------- driver


def run_worker(module: str, spec: dict, head: dict, timeout: float, label: str = "") -> dict:
    """`python -m <module> --worker <spec>` in a fresh interpreter; its result is the last line of its stdout
    (JSON), with `wall_seconds`. A timeout or a failure gives `head` with the error (a failure's stderr is printed,
    after `label` when given), so one broken run does not stop the rest."""
    command = [sys.executable, "-m", module, "--worker", json.dumps(spec)]
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        if label:
            print(f"{label} timed out after {timeout:.0f} s")
        return {**head, "error": f"timed out after {timeout:.0f} s", "wall_seconds": time.monotonic() - started}
    wall = time.monotonic() - started
    if done.returncode != 0 or not done.stdout.strip():
        if label:
            print(f"{label} failed (exit {done.returncode}):")
        print(done.stderr[-3000:])
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        return {**head, "error": last, "wall_seconds": wall}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_seconds": wall}


def run_in_subprocess(spec: dict, timeout: float) -> dict:
    """`worker(spec)` in a fresh interpreter (`run_worker`)."""
    head = {"family": spec.get("family", "llama"), "variant": spec["variant"], "seq": spec["seq"], "oom": False}
    label = f"{head['family']} {spec['variant']} at seq {spec['seq']}"
    return run_worker("benchmarks.end_to_end", spec, head, timeout, label)


def describe(result: dict) -> str:
    if "unavailable" in result:
        return f"not available: {result['unavailable']}"
    if "skipped" in result:
        return f"not run: {result['skipped']}"
    if "error" in result:
        return f"failed: {result['error']}"
    if result["oom"]:
        return "out of memory"
    peak = result["peak_bytes"]
    estimate = result["estimate_bytes"]
    memory = f", peak {peak / GiB:.2f} GiB" if peak is not None else ""
    if peak is not None and estimate is not None:
        memory += f" (estimate {estimate / GiB:.2f} GiB, {estimate / peak:.2f}x)"
    return f"{result['tokens_per_second']:,.0f} tokens/s{memory}, first loss {result['losses'][0]:.4f}"


def predicted_longest(base: dict, limit: int, step: int) -> int | None:
    """The longest multiple of `step` the planner expects this variant to fit; None without a memory figure,
    or for a model whose parameters the planner's shape does not count.

    Eager and tigon are compared with the GPU's memory less the CUDA context; the planner variant with the
    planner's own budget; Liger (not modeled) is predicted as tigon.
    """
    import torch

    from tigon.runtime import planner

    cuda = torch.cuda.is_available()
    if base.get("gpu_memory"):
        memory = planner.parse_memory(base["gpu_memory"])
    elif cuda:
        memory = planner.detect_gpu_memory()
    else:
        return None
    variant = "tigon" if base["variant"] == "liger" else base["variant"]
    first = bench_config({**base, "variant": variant, "seq": step}, cuda)
    shape = planner.model_shape(first)
    params = count_parameters(first)
    if estimate_note(shape, params):  # a shape the planner does not count
        return None
    usable = memory - planner.CUDA_CONTEXT
    if variant == "planner":
        usable = int(usable * planner.FIT_FRACTION)
    best = None
    for seq in range(step, limit + 1, step):
        config = bench_config({**base, "variant": variant, "seq": seq}, cuda)
        work, setting = planner.workload(config, 1, shape), planner.setting_of(config)
        settings = planner.candidates(work, setting) if variant == "planner" else [setting]
        if min(planner.estimate(work, s).peak for s in settings) > usable:
            break
        best = seq
    return best


def longest_sequence(base: dict, limit: int, step: int, timeout: int) -> tuple[int | None, list[dict]]:
    """The longest multiple of `step` up to `limit` that fits, searched from the planner's prediction (or
    `limit`, where the planner has none); each probe a fresh process, so none inherits another's fragments."""
    probes: list[dict] = []

    class Failed(Exception):
        """A probe failed for another reason than memory: the search stops."""

    def fits(seq: int) -> bool:
        result = run_in_subprocess({**base, "seq": seq}, timeout)
        probes.append(result)
        print(f"  {base.get('family', 'llama')} {base['variant']} seq {seq}: {describe(result)}", flush=True)
        if "error" in result or "unavailable" in result:
            raise Failed
        return not result["oom"]

    try:
        guess = predicted_longest(base, limit, step) or limit  # a prediction stops at `limit`
        return _search(fits, guess, base["variant"], limit, step), probes
    except Failed:
        return None, probes


def _search(fits, guess: int, variant: str, limit: int, step: int) -> int | None:
    """The longest multiple of `step` up to `limit` that fits, from `guess`: away from it in doubling strides
    until the answer is bracketed, then bisected; about log2 of the distance in probes, not the distance."""
    print(f"  {variant}: the planner predicts {guess}", flush=True)
    good, bad, stride = None, None, step
    if fits(guess):
        good = guess
        while bad is None and good < limit:
            seq = min(good + stride, limit)
            if fits(seq):
                good = seq
            else:
                bad = seq
            stride *= 2
    else:
        bad = guess
        while good is None and bad > step:
            seq = max(bad - stride, step)
            if fits(seq):
                good = seq
            else:
                bad = seq
            stride *= 2
    if good is None:
        return None
    while bad is not None and bad - good > step:
        seq = (good + bad) // 2 // step * step
        if fits(seq):
            good = seq
        else:
            bad = seq
    return good


def environment() -> dict:
    import torch
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__}
    if torch.cuda.is_available():
        import triton

        info |= {"gpu": torch.cuda.get_device_name(0), "triton": triton.__version__}
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
        try:
            from importlib.metadata import version

            import liger_kernel  # noqa: F401

            info["liger_kernel"] = version("liger-kernel")
        except ImportError:
            info["liger_kernel"] = None
    else:
        info["gpu"] = None
    return info


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"End-to-end training: {env.get('gpu') or 'CPU'}, torch {env['torch']}, transformers {env['transformers']}"
        + (f", triton {env['triton']}" if env.get("triton") else "")
        + (f", liger-kernel {env['liger_kernel']}" if env.get("liger_kernel") else "")
        + (", decoder layers compiled (training.compile)" if report["settings"].get("compile") else ""),
        "",
        "| family | model | parameters | Liger-Kernel |",
        "|---|---|---|---|",
    ]
    for name, family in report["families"].items():
        params = next((r["params"] for r in report["runs"] if r.get("family") == name and r.get("params")), None)
        cells = [name, family["model"], count_text(params) if params else "-", family["liger"] or "none"]
        lines.append("| " + " | ".join(cells) + " |")
    if report["runs"]:
        lines += [
            "",
            "| family | variant | seq | micro x accum | checkpointing | kernels | tokens/s | peak GiB |"
            " planner estimate GiB | estimate / peak |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in report["runs"]:
        family = r.get("family", "llama")
        if "micro_batch" not in r:  # not available, not run, failed, or the planner found nothing that fits
            lines.append(f"| {family} | {r['variant']} | {r['seq']} | | | | {describe(r)} | | | |")
            continue
        peak, estimate = r.get("peak_bytes"), r.get("estimate_bytes")
        cells = [
            family,
            r["variant"],
            r["seq"],
            f"{r['micro_batch']} x {r['accumulation']}",
            f"{r['checkpoint_layers']} layers" if r.get("checkpoint_layers") else "on" if r["checkpointing"] else "off",
            "on" if r["kernels"] else "off",
            "out of memory" if r["oom"] else f"{r['tokens_per_second']:,.0f}",
            f"{peak / GiB:.2f}" if peak else "-",
            f"{estimate / GiB:.2f}" if estimate else "not modeled" if r.get("estimate_note") else "-",
            f"{estimate / peak:.2f}" if estimate and peak else "-",
        ]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    lines += profile_table(report["runs"])
    if report.get("longest"):
        micro = report["settings"]["micro_batch"]
        lines += [
            "",
            f"| family | variant | longest sequence that fits (micro-batch {micro}) | context length |"
            " tokens/s there | peak GiB there | probes |",
            "|---|---|---|---|---|---|---|",
        ]
        for family, variants in report["longest"].items():
            context = report["families"][family]["shape"].get("max_position_embeddings", "-")
            for name, seq in variants.items():
                probes = [p for p in report.get("longest_probes", []) if (p["family"], p["variant"]) == (family, name)]
                there = probe_at_longest(report, family, name)
                speed = f"{there['tokens_per_second']:,.0f}" if "tokens_per_second" in there else "-"
                peak = f"{there['peak_bytes'] / GiB:.2f}" if there.get("peak_bytes") else "-"
                cells = [family, name, seq if seq else "none", context, speed, peak, len(probes)]
                lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    lines += [
        "",
        "Loss: the model's own with labels (HF eager: full logits; Liger and tigon: fused linear cross entropy,"
        ' except Liger\'s Granite patch, which keeps the logits). Planner estimate "not modeled": the planner'
        " counts other parameters than this model's (a shape it does not model).",
    ]
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def merge_reports(reports: list[dict]) -> dict:
    """One report from several: families in PRESETS order; per (family, variant, seq) the last measured run, else
    the last outcome (not available, failed), else the record that it was not run."""
    families = {name: family for report in reports for name, family in report["families"].items()}

    def rank(run: dict) -> int:
        return 2 if "micro_batch" in run else 0 if "skipped" in run else 1

    runs: dict[tuple, dict] = {}
    for run in (run for report in reports for run in report["runs"]):
        key = (run.get("family", "llama"), run["variant"], run["seq"])
        if key not in runs or rank(run) >= rank(runs[key]):
            runs[key] = run
    order = list(PRESETS)
    merged = {
        "families": {name: families[name] for name in sorted(families, key=order.index)},
        "environment": reports[0]["environment"],
        "settings": reports[0]["settings"],
        "runs": sorted(runs.values(), key=lambda r: (order.index(r.get("family", "llama")), r["seq"])),
    }

    def found(outcome) -> int:  # a length (or None: nothing fits) beats not available / failed beats not run
        return 2 if outcome is None or isinstance(outcome, int) else 0 if outcome.startswith("not run") else 1

    longest: dict[str, dict] = {}
    for report in reports:
        for family, variants in report.get("longest", {}).items():
            for variant, outcome in variants.items():
                known = longest.setdefault(family, {})
                if variant not in known or found(outcome) >= found(known[variant]):
                    known[variant] = outcome
    if longest:
        merged["longest"] = {name: longest[name] for name in sorted(longest, key=order.index)}
        merged["longest_probes"] = [probe for report in reports for probe in report.get("longest_probes", [])]
    return merged


def profile_table(runs: list[dict]) -> list[str]:
    """Markdown lines: each profiled run's step split by kind of kernel (ms), busiest kinds first."""
    from tigon.runtime.profiling import KIND_NAMES

    profiled = [r for r in runs if r.get("profile")]
    if not profiled:
        return []
    kinds = KIND_NAMES
    lines = [
        "",
        "Where one profiled step's time goes (ms; kernels grouped by name, `runtime/profiling.py`):",
        "",
        "| family | variant | seq | step | busy | " + " | ".join(kinds) + " | waiting on the host |",
        "|---|---|---|---|---|" + "---|" * (len(kinds) + 1),
    ]
    for r in profiled:
        p = r["profile"]
        cells = [r.get("family", "llama"), r["variant"], r["seq"], f"{p['step_ms']:.1f}", f"{p['busy_ms']:.1f}"]
        cells += [f"{p['kinds_ms'].get(kind, 0.0):.1f}" for kind in kinds]
        cells.append(f"{max(0.0, p['step_ms'] - p['busy_ms']):.1f}")
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return lines


def plot_families(report: dict, path: Path) -> None:
    """Per family: tokens/s and peak memory of Liger-Kernel and tigon as multiples of HF eager's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = {(r["family"], r["variant"]): r for r in report["runs"] if r.get("tokens_per_second")}
    families = [f for f in report["families"] if (f, "eager") in measured]
    figure, axes = plt.subplots(2, 1, figsize=(11, 7), sharex=True)
    for offset, variant in ((-0.2, "liger"), (0.2, "tigon")):
        for axis, key in zip(axes, ("tokens_per_second", "peak_bytes"), strict=True):
            values = [
                measured[(f, variant)][key] / measured[(f, "eager")][key]
                if (f, variant) in measured and measured[(f, variant)][key]  # CPU runs have no peak
                else 0.0
                for f in families
            ]
            axis.bar([i + offset for i in range(len(families))], values, width=0.4, label=variant)
    axes[0].set_ylabel("tokens/s / HF eager's\n(higher is better)")
    axes[1].set_ylabel("peak memory / HF eager's\n(lower is better)")
    for axis in axes:
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.grid(axis="y", alpha=0.3)
        axis.legend()
    axes[1].set_xticks(range(len(families)), families, rotation=30, fontsize=9)
    settings, env = report["settings"], report["environment"]
    axes[0].set_title(
        f"One training step per family, bf16, AdamW, seq {report['runs'][0]['seq']} x micro-batch "
        f"{settings['micro_batch']}, checkpointing on, {env.get('gpu') or 'CPU'} (no bar: not measured)"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def probe_at_longest(report: dict, family: str, variant: str) -> dict:
    """The measured probe at the longest length `variant` of `family` fit; {} where none fit or it was not run."""
    seq = report["longest"][family].get(variant)
    probes = report.get("longest_probes", [])
    return next(
        (
            p
            for p in probes
            if (p["family"], p["variant"], p["seq"]) == (family, variant, seq) and not p["oom"] and "error" not in p
        ),
        {},
    )


def plot_longest(report: dict, path: Path) -> None:
    """Per family and variant: the peak memory at the longest sequence that fit, that length written on the bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = [v for v in VARIANTS if any(v in found for found in report["longest"].values())]
    families = list(report["longest"])
    figure, axis = plt.subplots(figsize=(12, 5))
    width = 0.8 / len(variants)
    for index, variant in enumerate(variants):
        for position, family in enumerate(families):
            probe = probe_at_longest(report, family, variant)
            if not probe.get("peak_bytes"):
                continue
            x = position - 0.4 + width * (index + 0.5)
            axis.bar(x, probe["peak_bytes"] / GiB, width=width, color=f"C{index}")
            axis.text(x, probe["peak_bytes"] / GiB, f"{probe['seq'] / 1024:g}K", ha="center", va="bottom", fontsize=7)
    handles = [plt.Rectangle((0, 0), 1, 1, color=f"C{i}") for i in range(len(variants))]
    axis.legend(handles, variants)
    axis.set_xticks(range(len(families)), families, rotation=30, fontsize=9)
    axis.set_ylabel("peak GiB at that length")
    axis.grid(axis="y", alpha=0.3)
    axis.set_title(
        f"Longest sequence that fits (on the bar, up to the model's context length) and its peak memory, micro-batch "
        f"{report['settings']['micro_batch']}, {report['environment'].get('gpu') or 'CPU'}",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


class Budget:
    """`--time-budget`: a run starts only if it should end in time, judged by the longest run so far."""

    def __init__(self, seconds: float | None):
        self.seconds, self.started, self.longest = seconds, time.monotonic(), 0.0

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - (time.monotonic() - self.started)

    def allows_another(self) -> bool:
        return self.left() > self.longest

    def record(self, result: dict) -> None:
        self.longest = max(self.longest, result.get("wall_seconds", 0.0))

    def skipped(self) -> str:
        return f"time budget ({self.seconds:.0f} s) spent"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=False, help="JSON results file")
    parser.add_argument("--md", help="markdown table file (default: --out with .md)")
    parser.add_argument("--family", default="llama", help=f"all, or comma-separated, of {', '.join(PRESETS)}")
    parser.add_argument("--variants", default="eager,liger,tigon,planner", help=f"comma-separated, of {VARIANTS}")
    parser.add_argument("--seqs", default=None, help="sequence lengths (default 4096,8192; --tiny: 64,128)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per step (default 8; --tiny 2)")
    parser.add_argument("--no-checkpointing", action="store_true", help="gradient checkpointing off (default on)")
    parser.add_argument("--checkpoint-layers", type=int, help="checkpoint the first N layers (default all)")
    parser.add_argument("--compile", action="store_true", help="training.compile: each decoder layer compiled")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --tiny 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --tiny 1)")
    parser.add_argument("--longest", action="store_true", help="search the longest sequence each variant fits")
    parser.add_argument(
        "--longest-only", action="store_true", help="the longest-sequence search alone, no timed runs first"
    )
    parser.add_argument(
        "--longest-max",
        type=int,
        default=None,
        help="longest sequence probed (default: each model's context length; --tiny 256)",
    )
    parser.add_argument("--gpu-memory", help="planner variant: plan for this much memory (default: the GPU's)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run that works on the CPU")
    parser.add_argument("--shape", choices=LARGER_SHAPES, help="--family llama only: this model's shape instead")
    parser.add_argument("--qlora", action="store_true", help="QLoRA: the base in 4 bits (NF4), LoRA adapters train")
    parser.add_argument("--profile", action="store_true", help="one more step per run, profiled: time per kernel kind")
    parser.add_argument("--trace-dir", help="with --profile: write each profiled step's Chrome trace into this folder")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per subprocess")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds for the whole run (default: none)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="join these reports into --out, with a plot")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    if not args.out:
        parser.error("--out is required")
    if args.merge:
        report = merge_reports([json.loads(Path(name).read_text()) for name in args.merge])
        out = Path(args.out)
        write_atomic(out, json.dumps(report, indent=2) + "\n")
        write_atomic(Path(args.md) if args.md else out.with_suffix(".md"), markdown(report))
        if any("tokens_per_second" in run for run in report["runs"]):
            plot_families(report, out.with_suffix(".png"))
        if report.get("longest"):
            plot_longest(report, out.with_name(out.stem + "-longest.png"))
        print(f"{markdown(report)}\nwrote {out}, its .md and the plots")
        return
    if args.trace_dir:
        if not args.profile:
            parser.error("--trace-dir writes the profiled step's trace: add --profile")
        Path(args.trace_dir).mkdir(parents=True, exist_ok=True)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    try:
        families = parse_families(args.family)
    except ValueError as error:
        parser.error(str(error))
    if args.shape and families != ["llama"]:
        parser.error("--shape replaces the llama preset's shape: use it with --family llama")
    tiny = args.tiny
    seqs = [int(s) for s in (args.seqs or ("64,128" if tiny else "4096,8192")).split(",")]
    settings = {
        "micro_batch": args.micro_batch or (2 if tiny else 8),
        "checkpointing": not args.no_checkpointing,
        "checkpoint_layers": args.checkpoint_layers,
        "compile": args.compile,
        "steps": args.steps or (2 if tiny else 10),
        "warmup": args.warmup if args.warmup is not None else (1 if tiny else 3),
        "profile": args.profile,
        "trace_dir": args.trace_dir,
        "gpu_memory": args.gpu_memory,
        "qlora": args.qlora,
    }
    environment_info = environment()
    cuda = environment_info["gpu"] is not None
    report = {
        "families": {
            name: {
                "model": PRESETS[name].describe(tiny),
                "source": PRESETS[name].source,
                "liger": PRESETS[name].liger,
                "attention": PRESETS[name].attention,
                "shape": PRESETS[name].tiny_shape() if tiny else LARGER_SHAPES.get(args.shape) or PRESETS[name].shape(),
            }
            for name in families
        },
        "environment": environment_info,
        "settings": settings | ({"time_budget_seconds": args.time_budget} if args.time_budget else {}),
        "runs": [],
    }
    out = Path(args.out)
    md = Path(args.md) if args.md else out.with_suffix(".md")
    budget = Budget(args.time_budget)

    def save() -> None:
        write_atomic(out, json.dumps(report, indent=2) + "\n")
        write_atomic(md, markdown(report))

    def base_of(family: str) -> dict:
        return {
            "family": family,
            "shape": report["families"][family]["shape"],
            "attention": PRESETS[family].attention,
            **settings,
        }

    timed_seqs = [] if args.longest_only else seqs
    total = len(families) * len(timed_seqs) * len(variants)
    jobs = ((f, s, v) for f in families for s in timed_seqs for v in variants)  # family by family: partials compare
    for index, (family, seq, variant) in enumerate(jobs, start=1):
        head = {"family": family, "variant": variant, "seq": seq, "oom": False}
        print(f"[{index}/{total}] {family} {variant} at seq {seq} x micro-batch {settings['micro_batch']} ...")
        if variant == "liger" and (PRESETS[family].liger is None or not cuda):
            result = {**head, "unavailable": liger_function(family, cuda)[1]}  # no process needed to know
        elif not budget.allows_another():
            result = {**head, "skipped": budget.skipped()}
        else:
            result = run_in_subprocess(
                {**base_of(family), "variant": variant, "seq": seq}, min(args.timeout, budget.left())
            )
            budget.record(result)
        report["runs"].append(result)
        print(f"    {describe(result)}", flush=True)
        save()
    if args.longest or args.longest_only:
        report["longest"], report["longest_probes"] = {}, []
        step = 16 if tiny else 1024
        for family in families:
            report["longest"][family] = {}
            limit = args.longest_max or (256 if tiny else PRESETS[family].config["max_position_embeddings"])
            for variant in variants:
                print(f"longest sequence for {family} {variant}:", flush=True)
                if variant == "liger" and (PRESETS[family].liger is None or not cuda):
                    report["longest"][family][variant] = f"not available: {liger_function(family, cuda)[1]}"
                    continue
                if not budget.allows_another():
                    report["longest"][family][variant] = f"not run: {budget.skipped()}"
                    continue
                probe = {**base_of(family), "variant": variant, "steps": 1, "warmup": 1}
                seq, probes = longest_sequence(probe, limit, step, min(args.timeout, budget.left()))
                for result in probes:
                    budget.record(result)
                failed = seq is None and probes and ("error" in probes[-1] or "unavailable" in probes[-1])
                report["longest"][family][variant] = "failed (see longest_probes)" if failed else seq
                report["longest_probes"] += probes
                save()
    save()
    print(f"\n{markdown(report)}\nwrote {out} and {md}")
    not_run = sorted({r["family"] for r in report["runs"] if "skipped" in r}, key=families.index)
    if not_run:
        print(f"not run within the time budget: --family {','.join(not_run)}")


if __name__ == "__main__":
    main()
