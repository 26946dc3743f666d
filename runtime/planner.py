"""The memory planner: estimate a run's peak GPU memory and pick the fastest setting that fits.

    plan = make_plan(config, gpu_memory=80 * GB, world_size=1)
    print(plan.table())               # the chosen setting, its estimate, and every alternative
    config = apply_plan(config, plan) # what `training.plan: auto` does at the start of train()

The estimate (bytes, per GPU) is the largest of four moments of a steady-state training step:

    persistent  = weights + optimizer states (AdamW: 2 per trainable parameter, in its dtype; DeepSpeed below)
                  + overhead
    loss        = persistent + activations of every layer + head + loss-backward buffers
    layer top   = persistent + activations of every layer + head + grad(lm_head) + backward of one layer
    (with gradient accumulation, the earlier micro-batches' gradients are there too: all gradients)
    layer bottom= persistent + one layer's activations + all gradients + backward of one layer
    optimizer   = persistent + all gradients (+ DDP's gradient buckets; DeepSpeed: + the step's float32 gradient
                  and AdamW buffer)

Activations, per token of a micro-batch (B x T tokens), in bytes, with h hidden, i intermediate,
q = heads x head_dim, kv = kv_heads x head_dim, c the compute dtype's size (2 under bf16/fp16,
else the weights' size) and r the residual stream's size (the weights' dtype):

- RMSNorm, Hugging Face eager: the float32 copy of its input (4h), 1/rms (4) and the normalized
  input in its own dtype (r h; only when the norm weight trains). tigon: the input itself (r h) and 1/rms (4).
- A Linear saves its input (c h, or c i for down_proj) when its weight trains. A frozen one (LoRA's base, in
  4 bits or not) saves nothing; its LoRA adapter saves its input and its rank-wide output. peft keeps the
  adapters in float32 and casts its input to float32, and autocast casts that back to bf16/fp16 for the
  adapter's matmul, so each adapter saves a copy of its own (c x its input width, `Workload.lora_copy_bytes`):
  q, k and v keep three copies of the normed input, o_proj one of the attention output beside attention's own.
  Only where the adapters compute in the activations' dtype (all float32, or FSDP2's and DeepSpeed's bf16/fp16
  parameters) do they share the projection's input (c h once, as a trained Linear saves it).
- Attention, SDPA with the packed (B, 1, T, T) mask (memory-efficient kernel): q, and k and v
  repeated to all heads (3 c q), the output, which o_proj reads without a copy (c q), the log-sum-exp
  (4 x heads) and the mask as an additive bias in the compute dtype (c T per token, every layer).
  varlen (the default on a GPU, `model.attn_implementation: auto`), flex_attention, flash_attention_2, and
  SDPA without packing (one document per row, so no mask unless a sliding window is shorter than the
  sequence: plain causal attention with k and v unrepeated): q (c q), k and v (2 c kv), the output once
  (c q), the log-sum-exp; no mask, neither per layer nor kept by the checkpoints.
  eager: as SDPA plus the float32 softmax and its compute-dtype copy (4 + c) x heads x T, and with Gemma 2's
  attention softcapping tanh's output (c x heads x T).
- Gated MLP, Hugging Face eager: gate (saved by SiLU), SiLU(gate) and up (saved by the product)
  (3 c i). tigon's SwiGLU saves gate and up only and recomputes SiLU (2 c i).
- RoPE saves only cos and sin, shared by the layers (either implementation).
- MoE block (Mixtral, Qwen2-MoE, Qwen3-MoE; k experts a token, each i wide; `moe_bytes`): the router's input
  (c h), float32 probabilities (4 x experts), top-k indices (8 k), with renormalized top-k also their float32
  values and sum (4 k + 4). Per token-expert pair, transformers' grouped_mm experts keep three int64 index
  vectors (24), the gathered input and the expert's output (2 c h), gate_up, SiLU's output and the product
  (4 c i) and the routing weight (c; 4 for Mixtral's float32 weights); tigon's moe_experts keeps gate_up and
  its int64 sort position (2 c i + 8) and the routing weights (c k; 4 k for Mixtral's float32 weights).
  Qwen2-MoE's shared expert saves a gated MLP's
  activations and, for its sigmoid gate, the gate (c) and its output (c h).

With gradient checkpointing a layer keeps only its input (r h per token); during the backward one
layer is recomputed at a time, so one layer's full activations come back transiently. Checkpointing the
first N of L layers keeps N inputs and L - N layers' full activations.

Once per micro-batch: the final norm, the ids, labels and positions (24 per token), cos and sin
(2 r head_dim). The loss (`token_loss_sum`: the model's own loss with labels): Hugging Face's
`ForCausalLMLoss` keeps lm_head's input (c h) and makes the logits (c V per token), their float32
copy and log-softmax (4 V each); log-softmax's output stays for the backward, whose buffers peak at
12 V per token; Gemma 2's logit softcapping saves one more (tanh's output, c V). With the kernels on,
tigon's fused linear cross entropy replaces it (`Workload.fused_loss`): the logits never exist; its
forward already computes the hidden states' gradient (c h per token) and lm_head's weight gradient
(V h in the weight's dtype), the per-token losses and logsumexps (8) and one chunk of logits at a time (the
op's own `max_chunk_tokens` x V: hidden/4 tokens, at least 1024; or the runtime's larger `loss_chunk_tokens`
where the step peaks elsewhere). A chunk whose logits take at most a quarter of the head's gradient lives in
that gradient's memory; then the loss's own buffer is the stripe that fills those rows at the end, hidden/4
columns for every token (`logits_buffer_bytes`).

Backward of one layer (transient): the MLP's gradients, 3 c i per token eager (the product's, SiLU's
and up's), c i with tigon's in-place SwiGLU backward (i the config's intermediate_size, for MoE models
too; compiled layers, `training.compile`, run it out of place: 3 c i); attention's are 3 c q + 4 q, and for
eager attention also the scores' gradient in float32 and the softmax's input gradient (8 x heads x T); the
larger counts. With LoRA adapters that copy their input, the widest one's forward can be larger
(`adapter_forward_bytes`: down_proj's input and its float32 cast, (c + 4) i, and the outputs, 3 c h); it runs
in the top layer with every layer's activations live, or in a checkpoint's recompute.

LoRA's adapters (`Workload.adapter_bytes`, float32 under peft) add their weights, gradients and AdamW states in
that dtype; under autocast, also its bf16/fp16 copies of the adapter weights (cached for the forward, so every
layer's at the loss; kept for the backward by the layers that are not checkpointed, `adapter_cast_bytes`).

A frozen model beside the trained one (`FrozenModel`: DPO's and KTO's reference copy under `reference: model`,
distillation's teacher) adds its weights as loaded to every moment (sharded over the ranks under FSDP2 and
DeepSpeed ZeRO-3, which shard and partition it too), its final hidden states (its compute dtype x its width per
token) and, sharded, its gathered head to the loss moment, whose fused op reads them, and a moment of its own
before the trained model's forward: its no-grad forward's transient buffers (`frozen_bytes`). A precomputed
teacher (`objective.teacher.precompute`) keeps only its head, whole, in the compute dtype, and the loss reads the
micro-batch's stored hidden states; its pass over the data before training is a moment of its own, the teacher as
it would run beside the student (`teacher_pass_bytes`).

Preference objectives (`Workload.loss` "pairs" or "kto"): a micro-batch of N items is 2N sequences (`Workload.tokens`),
as padded rows or, with `data.packing: true`, one packed row, whose mask and scores under sdpa and eager span the
whole row (`Workload.rows`); the fused preference op replaces the cross entropy (`preference_loss_bytes`), and
`reference: precomputed` adds a moment before training, the whole model scoring the data (`reference_pass_bytes`).
Distillation holds the fused cross entropy's and the fused JSD's gradients (`distill_loss_bytes`).

Parallelism: DDP keeps everything per GPU plus gradient buckets (one more gradient copy). FSDP2 shards
weights, gradients and states over the world size (under hybrid sharding, over a shard group:
`Workload.shards`) and gathers two layers (and the embedding and head) at a time; with gradient accumulation
it reduce-scatters once a step, so between micro-batches every rank keeps the whole model's gradients
unsharded, in float32 (FSDP2's reduce dtype), or, accumulating sharded (`parallelism.accumulate_sharded`), only its
shard of them in the weights' dtype. DeepSpeed ZeRO, on one GPU as on several (`zero_bytes`): float32
master weights and AdamW's two float32 moments (12 bytes a trainable parameter) partitioned at every stage, a
gradient partition and a reduce bucket in the weights' dtype, the weights whole (stages 1, 2) or partitioned (3,
with two layers gathered); the optimizer step converts one group (ZeRO-3: one sub-group) of gradients to float32
beside foreach AdamW's buffer (8 bytes an element); ZeRO-3's reduce-scatter copies a bucket, and a tied head's
whole gradient waits for the embedding's backward.
CPU offload moves states (and, for FSDP / ZeRO-3, weights) off the GPU.

Choosing: every setting that keeps the global batch (micro-batch x accumulation) is a candidate: micro-
batch among its divisors, gradient checkpointing of none, every, or any number of the layers, tigon's
kernels on and off. The ones whose estimate stays under FIT_FRACTION of the usable memory (the GPU's
memory minus CUDA_CONTEXT) are ranked by a relative step-time model: checkpointing recomputes the
forward of its layers (x 4/3 for all of them, in proportion for some), the kernels save KERNEL_TIME of a
step, a micro-batch of n tokens runs at n / (n + HALF_EFFICIENCY_TOKENS) of the GPU's rate, and under
sharded weights (FSDP2, ZeRO-3) each micro-batch gathers them again, costing the time of `gather_tokens` more
tokens, and accumulating sharded reduce-scatters each micro-batch's gradients (`sharded_accumulation_tokens`); the
planner tries that only where the shards accumulate in float32 (`sharded_accumulation_allowed`). The model ranks
settings; it does not predict tokens/s.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Literal

from tigon.runtime.config import ConfigError, RunConfig, parse_memory
from tigon.runtime.distributed import DistEnv, shard_ranks
from tigon.runtime.hub import config_json
from tigon.runtime.model_types import text_overrides
from tigon.runtime.tokenizer import load_tokenizer

#: LoRA: bytes of an adapter parameter. peft keeps adapters in float32 (`get_peft_model`'s
#: autocast_adapter_dtype upcasts bf16/fp16 ones); DeepSpeed's bf16/fp16 modes cast the whole module to theirs
ADAPTER_BYTES = 4

#: QLoRA: bytes a 4-bit weight takes with its block's scale, by `lora.double_quant`: half a byte, plus an fp32
#: scale per 64 weights, or with double quantization an 8-bit scale per 64 and an fp32 one per 256 of those
QUANTIZED_BYTES = {True: 0.5 + 1 / 64 + 4 / (64 * 256), False: 0.5 + 4 / 64}

GB = 10**9
GiB = 2**30
MiB = 2**20

CUDA_CONTEXT = 1 * GiB  # CUDA context, cuDNN/cuBLAS handles: on the GPU but outside PyTorch's allocator
FIT_FRACTION = 0.92  # headroom for the allocator's fragmentation
OVERHEAD = 64 * MiB  # inside the allocator: cuBLAS workspaces, RNG state, small buffers
CHECKPOINT_TIME = 4 / 3  # recomputing the forward costs about one more forward (fwd:bwd = 1:2)
SELECTIVE_TIME = 1.03  # recomputing norms, RoPE and the activation: memory-bound passes over a layer's activations
KERNEL_TIME = 0.9  # tigon's kernels on: a step takes about this fraction of the eager step
HALF_EFFICIENCY_TOKENS = 512  # a micro-batch of this many tokens runs at half the GPU's rate
#: an FP8 run's extra cost per micro-batch, in tokens of its compute: every Linear casts its weight (and the
#: transpose its backward reads) to FP8 each micro-batch, and FP8's faster matrix products leave the fixed costs a
#: larger share of the step. Fitted to FP8 settings measured on 4 x H200 (docs/planner.md, "FP8 runs").
FP8_MICRO_BATCH_TOKENS = 1400
#: a GPU's bf16 matrix-product rate over the bandwidth of its share of an all-gather (H100 / H200: about
#: 990 TFLOP/s over 450 GB/s of NVLink): FLOPs a GPU could have done in the time it receives a byte
GATHER_FLOPS_PER_BYTE = 2200
LOSS_CHUNK_LIMIT = 4096  # the largest fused-loss chunk the runtime picks; beyond, the head gradient's re-reads are few
LOSS_CHUNK_MARGIN = 0.95  # ... and only while the loss's moment stays this far under the step's estimated peak

#: DeepSpeed ZeRO (`zero_bytes`), with DeepSpeed's defaults where the runtime's config (deepspeed_engine) leaves them
REDUCE_BUCKET_SIZE = 500_000_000  # reduce_bucket_size in elements; the runtime caps it at the trainable count
ZERO_SUB_GROUP = 1_000_000_000  # ZeRO-3's sub_group_size: partition elements AdamW steps at a time
PERSISTENCE_THRESHOLD = 100_000  # ZeRO-3's param_persistence_threshold: smaller parameters stay whole on every rank
MASTER_AND_MOMENTS = 12  # a trainable parameter's float32 master weight and AdamW's two float32 moments
#: AdamW's step over a float32 partition of N elements allocates 8 N: its float32 gradient (converted from the
#: gradient partition) and foreach AdamW's sqrt(exp_avg_sq) (torch's default on CUDA)
STEP_BYTES = 8

logger = logging.getLogger("tigon.runtime")

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class PlanError(ConfigError):
    """No setting fits the GPU; the message names the smallest one and what it needs."""


# ---------------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class MoeKeys:
    """Where a transformers MoE family's config keeps its expert sizes, and how its router rounds."""

    experts: str  # the number of experts
    intermediate: str  # each expert's intermediate size
    shared: str | None = None  # a shared expert's intermediate size (Qwen2-MoE), its output gated by a sigmoid
    normalized: bool | None = None  # the top-k probabilities renormalized; None: the config's norm_topk_prob
    float32_weights: bool = False  # the routing weights stay float32 (kept as such for the backward)


MOE_FAMILIES = {
    "mixtral": MoeKeys("num_local_experts", "intermediate_size", normalized=True, float32_weights=True),
    "qwen2_moe": MoeKeys("num_experts", "moe_intermediate_size", shared="shared_expert_intermediate_size"),
    "qwen3_moe": MoeKeys("num_experts", "moe_intermediate_size"),
    "qwen3_5_moe_text": MoeKeys(
        "num_experts", "moe_intermediate_size", shared="shared_expert_intermediate_size", normalized=True
    ),
}


@dataclass(frozen=True)
class MoeShape:
    """A Mixture-of-Experts block's sizes: a router over `experts`, each a gated MLP, `top_k` of them a token."""

    experts: int
    intermediate: int  # each expert's
    top_k: int
    layers: int  # decoder layers with this block (the others have the dense MLP)
    shared: int = 0  # the shared expert's intermediate size, 0 for none
    normalized: bool = False
    float32_weights: bool = False

    @classmethod
    def from_text_config(cls, text) -> MoeShape | None:
        """The MoE block of a config of a family in MOE_FAMILIES; None for any other (dense) model."""
        keys = MOE_FAMILIES.get(text.model_type)
        experts = getattr(text, keys.experts, 0) if keys else 0
        if not experts:
            return None
        step, dense = getattr(text, "decoder_sparse_step", 1) or 1, set(getattr(text, "mlp_only_layers", None) or ())
        layers = sum(i not in dense and (i + 1) % step == 0 for i in range(text.num_hidden_layers))
        normalized = keys.normalized if keys.normalized is not None else bool(getattr(text, "norm_topk_prob", False))
        shared = (getattr(text, keys.shared, 0) or 0) if keys.shared else 0
        return cls(
            experts,
            getattr(text, keys.intermediate),
            text.num_experts_per_tok,
            layers,
            shared,
            normalized,
            keys.float32_weights,
        )

    def params(self, hidden: int) -> int:
        """The block's parameters: router, experts' gate/up/down, the shared expert and its gate."""
        shared = 3 * hidden * self.shared + hidden if self.shared else 0
        return self.experts * hidden + 3 * self.experts * hidden * self.intermediate + shared


def ties_head(hf_config, text) -> bool:
    """Whether transformers ties the model's head to its embedding: from 5.0 the top-level config's flag (a
    vision-language model's own), before it the text config's (default true)."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__).major < 5:
        return bool(getattr(text, "tie_word_embeddings", True))
    return bool(getattr(hf_config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))


def layer_value(text, key: str, default=None):
    """`text.<key>` (`default` where unset), or the first decoder layer's where the config keeps that field per layer
    (transformers 5.2x's heterogeneous configs: Gemma 4's global layers have wider heads, so reading its `head_dim`
    from the config itself is an error). The planner models every layer as the first."""
    if key in (getattr(text, "per_layer_attributes", None) or ()):
        text = text.per_layer_config[0]
    return getattr(text, key, default)


@dataclass(frozen=True)
class ModelShape:
    """The sizes the estimate needs, read from a transformers config (no weights are made)."""

    model_type: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    params: int  # all parameters, tied ones once
    layer_params: int  # one decoder layer
    attention_softcap: bool = False  # Gemma 2: cap * tanh(scores / cap), one more (heads, T, T) tensor saved
    logit_softcap: bool = False  # Gemma 2: the same on the logits, one more logits tensor saved
    sliding_window: int | None = None  # layers that attend to this many tokens back (Gemma 3, Phi-3)
    linear_names: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    moe: MoeShape | None = None  # Mixtral, Qwen2-MoE, Qwen3-MoE: the MLP of `moe.layers` layers is this block

    @classmethod
    def from_hf_config(cls, hf_config) -> ModelShape:
        """Sizes of a Llama-like decoder (attention + gated MLP, or MoE block, per layer) from its transformers
        config."""
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        hidden, layers = text.hidden_size, text.num_hidden_layers
        inter = getattr(text, "intermediate_size", 0)  # none where every layer is an MoE block (Qwen 3.5 MoE)
        heads = text.num_attention_heads
        kv_heads = layer_value(text, "num_key_value_heads") or heads
        head_dim = layer_value(text, "head_dim") or hidden // heads
        vocab = text.vocab_size
        tied = ties_head(hf_config, text)
        q, kv = heads * head_dim, kv_heads * head_dim
        bias = hidden + 2 * kv + hidden if getattr(text, "attention_bias", False) else 0
        bias = q + 2 * kv if getattr(text, "qkv_bias", False) else bias  # Qwen2-MoE: q, k and v only
        attention = hidden * (2 * q + 2 * kv) + 2 * hidden + bias
        moe = MoeShape.from_text_config(text)
        dense, sparse = 3 * hidden * inter, moe.params(hidden) if moe else 0
        sparse_layers = moe.layers if moe else 0
        layer = attention + (sparse if sparse_layers else dense)  # one layer: an MoE one where there are any
        blocks = sparse_layers * sparse + (layers - sparse_layers) * dense
        params = vocab * hidden * (1 if tied else 2) + layers * attention + blocks + hidden
        return cls(
            text.model_type,
            hidden,
            inter,
            layers,
            heads,
            kv_heads,
            head_dim,
            vocab,
            tied,
            params,
            layer,
            attention_softcap=getattr(text, "attn_logit_softcapping", None) is not None,
            logit_softcap=getattr(text, "final_logit_softcapping", None) is not None,
            sliding_window=getattr(text, "sliding_window", None) if getattr(text, "use_sliding_window", True) else None,
            moe=moe,
        )

    def counts(self, params: int) -> bool:
        """Whether this shape is the model of `params` parameters: the counts agree within 2%. The shape is a
        Llama-like decoder (with the MoE block of MOE_FAMILIES); where a model has other parts (latent attention,
        hyper-connections, a vision tower) it counts other parameters, and estimates made from it are not the
        model's."""
        return abs(self.params - params) <= 0.02 * params

    def linear_shape(self, name: str) -> tuple[int, int]:
        """(in_features, out_features) of a decoder layer's projection."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes = {
            "q_proj": (self.hidden, q),
            "k_proj": (self.hidden, kv),
            "v_proj": (self.hidden, kv),
            "o_proj": (q, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }
        return shapes[name]


@dataclass(frozen=True)
class FrozenModel:
    """A model run beside the trained one without gradient: DPO's and KTO's frozen reference copy (`reference:
    model`), or distillation's teacher."""

    shape: ModelShape
    weight_bytes: int  # its weights' dtype as loaded
    compute_bytes: int  # its forward's: 2 under bf16/fp16 autocast (or FSDP2's bf16/fp16 parameters), else weight_bytes
    precomputed: bool = False  # a teacher run once before training: during it only its head is on the GPU


@dataclass(frozen=True)
class Workload:
    """What the run fixes (model, sequence, precision, adapters, parallelism); the planner varies the rest."""

    shape: ModelShape
    seq_len: int
    weight_bytes: int
    compute_bytes: int
    autocast: bool  # the forward runs under autocast to a narrower dtype than the weights
    # sdpa_causal: unpacked SDPA, no mask; varlen, flex_attention: packed documents without a dense mask
    attention: Literal["sdpa", "sdpa_causal", "flash_attention_2", "eager", "varlen", "flex_attention"]
    lora_rank: int = 0  # 0: full fine-tuning
    lora_targets: tuple[str, ...] = ()
    quantized_bytes: float = 0.0  # QLoRA: bytes per decoder Linear weight in 4 bits with its scales; 0: not quantized
    adapter_bytes: int = ADAPTER_BYTES  # LoRA: an adapter parameter's (its gradient's, AdamW states') bytes
    # LoRA: bytes an element of the copy of its input each adapter saves (adapter_copy_bytes); 0: none, the
    # adapters share the projection's input
    lora_copy_bytes: int = 0
    strategy: Literal["ddp", "fsdp", "deepspeed"] = "ddp"
    zero_stage: int = 2
    cpu_offload: bool = False
    world_size: int = 1
    shard_size: int | None = None  # fsdp: ranks each parameter is sharded over (`parallelism.shard_size`); None: all
    accumulate_sharded: bool = False  # the config accumulates FSDP2's gradients sharded (in any weight dtype)
    copy_engine_gathers: bool = False  # FSDP2 gathers out of a symmetric-memory workspace (copy_engine_gathers)
    fused_loss: bool = True  # with the kernels on, the loss uses tigon's fused linear cross entropy (no logits)
    kernels_fit: bool = True  # tigon's kernel table covers this model family
    frozen: FrozenModel | None = None  # a reference model or teacher run beside it (see frozen_model)
    # the objective's loss (loss_bytes): next-token, a paired preference op (dpo, orpo, simpo, cpo), kto's, distill's
    loss: Literal["cross_entropy", "pairs", "kto", "distill"] = "cross_entropy"
    sequences: int = 1  # sequences per item of a micro-batch: 2 for a pair (KTO: a completion, a mismatched one)
    packed_rows: bool = False  # a preference micro-batch's sequences end to end in one row (`data.packing: true`)
    reference_pass: bool = False  # `reference: precomputed`: a no-grad pass over the data before the first step

    @property
    def shards(self) -> int:
        """Ranks a sharded parameter is split over: FSDP2's shard group under hybrid sharding, else every rank."""
        return self.shard_size if self.strategy == "fsdp" and self.shard_size else self.world_size

    def tokens(self, micro_batch: int) -> int:
        """Tokens of a micro-batch at full length: its sequences x seq_len (the fused preference op's layout)."""
        return micro_batch * self.sequences * self.seq_len

    def rows(self, micro_batch: int) -> Workload:
        """The workload as attention sees a micro-batch: packed preference rows are one row of all its tokens, so
        a mask or eager's scores span that row (`seq_len` is the row's length)."""
        if not self.packed_rows:
            return self
        return dataclasses.replace(self, seq_len=self.tokens(micro_batch), packed_rows=False)

    compiled: bool = False  # training.compile: compiled layers run tigon's gated activations out of place
    fp8: bool = False  # training.precision fp8: the decoder's Linear layers in FP8 (compiled)

    @property
    def linear_params(self) -> int:
        """The decoder layers' Linear weights (what QLoRA stores in 4 bits)."""
        return self.shape.layers * sum(a * b for a, b in map(self.shape.linear_shape, self.shape.linear_names))

    @property
    def trainable(self) -> int:
        if not self.lora_rank:
            return self.shape.params
        per_layer = sum(sum(self.shape.linear_shape(n)) for n in self.lora_targets if n in self.shape.linear_names)
        return self.lora_rank * per_layer * self.shape.layers


@dataclass(frozen=True)
class Setting:
    """One point the planner can choose: batch split, gradient checkpointing, tigon's kernels."""

    micro_batch: int
    accumulation: int
    checkpointing: bool
    kernels: bool
    checkpoint_layers: int | None = None  # with checkpointing: the first N decoder layers only; None: every one
    selective_layers: int = 0  # after those, this many recompute only their element-wise work
    accumulate_sharded: bool = False  # FSDP2: reduce-scatter every micro-batch (`parallelism.accumulate_sharded`)

    def describe(self) -> str:
        return (
            f"micro-batch {self.micro_batch} x accumulation {self.accumulation_text()}, checkpointing "
            f"{self.checkpointing_text()}, kernels {'on' if self.kernels else 'off'}"
        )

    def accumulation_text(self) -> str:
        """'4', or '4 sharded' where the gradients accumulate in each rank's shard."""
        return f"{self.accumulation}{' sharded' if self.accumulate_sharded else ''}"

    def checkpointed_layers(self, layers: int) -> int:
        """How many of the model's `layers` decoder layers recompute their activations."""
        if not self.checkpointing:
            return 0
        return layers if self.checkpoint_layers is None else min(self.checkpoint_layers, layers)

    def selective_count(self, layers: int) -> int:
        """How many of the model's `layers` decoder layers recompute only their element-wise work."""
        return min(self.selective_layers, layers - self.checkpointed_layers(layers))

    def checkpointing_text(self) -> str:
        """'on', 'off', 'N layers', 'M selective' or 'N + M selective'."""
        if self.selective_layers:
            full = self.checkpoint_layers if self.checkpointing else 0
            return f"{full} + {self.selective_layers} selective" if full else f"{self.selective_layers} selective"
        if self.checkpointing and self.checkpoint_layers is not None:
            return f"{self.checkpoint_layers} layers"
        return "on" if self.checkpointing else "off"


def detect_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def model_shape(config: RunConfig) -> ModelShape:
    """The run's model sizes, from `model.path`'s config.json or `model.config_name` + overrides."""
    from transformers import CONFIG_MAPPING, AutoConfig

    if config.model.path is not None:
        raw = config_json(config.model)
        try:
            return ModelShape.from_hf_config(AutoConfig.for_model(**raw))
        except (ValueError, KeyError) as error:
            raise ConfigError(f"model.path: cannot read a config from {config.model.path}: {error}") from None
    overrides = copy.deepcopy(dict(config.model.config_overrides))
    if config.model.config_name in CONFIG_MAPPING:  # a vision-language model's vocabulary is its text_config's
        text, _ = text_overrides(CONFIG_MAPPING[config.model.config_name], overrides)
    else:
        text = overrides
    if "vocab_size" not in text:
        text["vocab_size"] = len(load_tokenizer(config.model))
    try:
        return ModelShape.from_hf_config(AutoConfig.for_model(config.model.config_name, **overrides))
    except (ValueError, KeyError) as error:
        raise ConfigError(f"model.config_name / config_overrides: {error}") from None


def frozen_model(config: RunConfig, shape: ModelShape) -> FrozenModel | None:
    """The objective's frozen model: distill's teacher (its own config and dtype), or DPO's and KTO's reference copy
    of the trained model (`reference: model`); None for the others."""
    objective = config.objective
    narrow = config.training.precision != "fp32"  # bf16, fp16, or fp8 (bf16 outside its matmuls)
    if objective.type == "distill":
        teacher = objective.teacher.as_model(config.model)
        size = DTYPE_BYTES[teacher.dtype]
        shape = model_shape(config.model_copy(update={"model": teacher}))
        return FrozenModel(shape, size, 2 if narrow else size, objective.teacher.precompute)
    if objective.reference_source == "model":
        size = DTYPE_BYTES[config.model.dtype]
        return FrozenModel(shape, size, 2 if narrow else size)
    return None


def workload(config: RunConfig, world_size: int | None = None, shape: ModelShape | None = None) -> Workload:
    """The fixed part of a run, from its config; `world_size` defaults to $WORLD_SIZE (1)."""
    from tigon.kernels.patching import FAMILIES

    shape = shape or model_shape(config)
    world_size = world_size or detect_world_size()
    weight_bytes = DTYPE_BYTES[config.model.dtype]
    narrow = config.training.precision != "fp32"  # bf16, fp16, or fp8 (bf16 outside its matmuls)
    lora, objective = config.lora, config.objective
    return Workload(
        shape=shape,
        seq_len=config.data.max_seq_len,
        weight_bytes=weight_bytes,
        compute_bytes=2 if narrow else weight_bytes,
        autocast=narrow and weight_bytes == 4,
        attention=attention_path(config, shape),
        lora_rank=lora.r if lora.enabled else 0,
        lora_targets=tuple(lora.target_modules) if lora.enabled else (),
        quantized_bytes=QUANTIZED_BYTES[lora.double_quant] if lora.quantize_base else 0.0,
        adapter_bytes=2 if config.parallelism.strategy == "deepspeed" and adapters_in_precision(config) else 4,
        lora_copy_bytes=adapter_copy_bytes(config) if lora.enabled else 0,
        strategy=config.parallelism.strategy,
        zero_stage=config.parallelism.stage,
        cpu_offload=config.parallelism.cpu_offload,
        world_size=world_size,
        shard_size=shard_group(config, world_size),
        accumulate_sharded=config.parallelism.accumulate_sharded,
        copy_engine_gathers=config.parallelism.copy_engine_gathers,
        fused_loss=shape.model_type in FAMILIES,  # the kernels patch every table family's *ForCausalLM forward
        kernels_fit=shape.model_type in FAMILIES,
        frozen=frozen_model(config, shape),
        loss=loss_kind(config),
        sequences=2 if objective.preference else 1,
        packed_rows=objective.preference and config.data.packing,
        reference_pass=objective.preference and objective.reference_source == "precomputed",
        compiled=config.training.compile,
        fp8=config.training.precision == "fp8",
    )


def shard_group(config: RunConfig, world_size: int) -> int | None:
    """`parallelism.shard_size` in ranks, as the job resolves it (`distributed.shard_ranks`); 'node' is
    $LOCAL_WORLD_SIZE (torchrun's ranks on this node), or the whole world where that is unset (a plan made away from
    the job: one node). None without a shard size."""
    if config.parallelism.shard_size is None:
        return None
    node = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    return shard_ranks(config, DistEnv(world_size=world_size, local_world_size=node))


def adapter_copy_bytes(config: RunConfig) -> int:
    """Bytes an element of the copy of its input each LoRA adapter saves: peft casts an adapter's input to the
    adapter weights' dtype (float32) and autocast casts it back to bf16/fp16 for the matmul (2), or without
    autocast the adapter computes on the float32 copy (4, bf16/fp16 weights); 0 where the adapters compute in
    the activations' dtype: float32 throughout, or FSDP2's and DeepSpeed's bf16/fp16 parameters."""
    if adapters_in_precision(config):
        return 0
    if config.training.precision != "fp32":
        return 2
    return 0 if config.model.dtype == "float32" else 4


def adapters_in_precision(config: RunConfig) -> bool:
    """Whether the LoRA adapters are in the run's bf16/fp16 in the forward, not float32: FSDP2's mixed precision
    gathers its parameters so, DeepSpeed's bf16/fp16 modes cast the module."""
    strategy, precision = config.parallelism.strategy, config.training.precision
    return (strategy == "fsdp" and precision != "fp32") or (strategy == "deepspeed" and precision in ("bf16", "fp16"))


def loss_kind(config: RunConfig) -> str:
    """The Workload.loss of a run's objective: dpo, orpo, simpo and cpo run the paired op."""
    return {"sft": "cross_entropy", "kto": "kto", "distill": "distill"}.get(config.objective.type, "pairs")


def setting_of(config: RunConfig) -> Setting:
    training = config.training
    return Setting(
        training.micro_batch_size,
        training.gradient_accumulation_steps,
        training.gradient_checkpointing,
        config.kernels.enabled,
        training.checkpoint_layers if training.gradient_checkpointing else None,
        training.selective_layers,
        config.parallelism.accumulate_sharded,
    )


# ---------------------------------------------------------------------------------------------------- estimate


@dataclass
class Estimate:
    """Peak bytes per GPU for one setting, with the parts that make it up."""

    setting: Setting
    peak: int
    moment: str  # which moment of the step peaks
    parts: dict[str, int] = field(default_factory=dict)
    moments: dict[str, int] = field(default_factory=dict)  # every moment's total


def linear_input_bytes(work: Workload) -> int:
    """Bytes per element of a saved Linear layer's input: the compute dtype's, or one under FP8, whose compiled
    layers keep the FP8 cast their matmul's backward reads instead of the bf16 input."""
    return 1 if work.fp8 else work.compute_bytes


def _saves_input(work: Workload, name: str) -> bool:
    """Whether a projection's input itself is saved: its weight trains, or its LoRA adapter reads it without a
    copy (an adapter's own copy counts in `_adapter_bytes`)."""
    return not work.lora_rank or (name in work.lora_targets and not work.lora_copy_bytes)


def norm_bytes(work: Workload, kernels: bool) -> float:
    """Bytes per token one RMSNorm saves for its backward."""
    h, r = work.shape.hidden, work.weight_bytes
    if kernels:
        return r * h + 4
    return 4 * h + 4 + (r * h if not work.lora_rank else 0)  # float32 input, 1/rms, normalized input


def _adapter_bytes(work: Workload, names: tuple[str, ...]) -> float:
    """Bytes per token LoRA adapters on these projections save: each one's rank-wide output and, where it makes
    one (`Workload.lora_copy_bytes`), its own copy of its input, both in the dtype its matmul runs in."""
    size = work.lora_copy_bytes or work.compute_bytes
    widths = [work.shape.linear_shape(n)[0] for n in names if n in work.lora_targets]
    return size * work.lora_rank * len(widths) + (work.lora_copy_bytes * sum(widths))


def adapter_cast_bytes(work: Workload) -> int:
    """Bytes per decoder layer of autocast's bf16/fp16 copies of its float32 LoRA adapter weights (made when the
    adapters copy their input in bf16/fp16, `lora_copy_bytes` 2; saved for the backward, and cached while the
    forward's autocast lasts)."""
    if work.lora_copy_bytes != 2:
        return 0
    return 2 * work.trainable // work.shape.layers


def _widest_adapter(work: Workload) -> tuple[int, int]:
    """(in_features, out_features) of the adapted projection with the widest input (down_proj's, when adapted)."""
    shapes = [work.shape.linear_shape(n) for n in work.lora_targets if n in work.shape.linear_names]
    return max(shapes, default=(0, 0))


def adapter_forward_bytes(work: Workload, recompute: bool) -> float:
    """Transient bytes per token beside a layer's saved bytes while its widest LoRA adapter runs its forward (0
    where the adapters make no copy of their input).

    Input side: the projection's input, which nothing else keeps (down_proj's is the gated product), c per
    element, and under autocast the float32 cast peft makes of it, 4, beside the saved bf16/fp16 copy. Output side:
    the base layer's output (c), the adapter's (its matmul's dtype) and that times the LoRA scale (the same), per
    output feature. A checkpoint's recompute (`recompute`) stops as soon as the layer's last tensor is saved, the
    adapter's rank-wide input, so before the scaled copy is made."""
    if not work.lora_copy_bytes:
        return 0
    c, copy = work.compute_bytes, work.lora_copy_bytes
    width_in, width_out = _widest_adapter(work)
    inputs = c + (4 if copy != 4 else 0)
    outputs = c + copy * (1 if recompute else 2)
    return width_in * inputs + width_out * outputs


UNMASKED = ("flash_attention_2", "sdpa_causal", "varlen", "flex_attention")


def attention_path(config: RunConfig, shape: ModelShape) -> str:
    """The attention the run takes on a GPU ("auto" is "varlen" there): unpacked SDPA rows are one document each,
    so they need no mask, unless the model's sliding window is shorter than the sequence (then transformers
    builds a (B, 1, T, T) mask) or they are padded preference rows (their padding mask becomes one)."""
    attention = "varlen" if config.model.attn_implementation == "auto" else config.model.attn_implementation
    window = shape.sliding_window
    short_window = window is not None and window < config.data.max_seq_len
    padded_pairs = config.objective.preference  # padded preference rows go with their padding mask
    if attention == "sdpa" and not config.data.packing and not short_window and not padded_pairs:
        return "sdpa_causal"
    return attention


def attention_bytes(work: Workload) -> float:
    """Bytes per token one attention block saves: q/k/v input, the attention kernel's, o_proj's input."""
    s, c = work.shape, work.compute_bytes
    h, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    x = linear_input_bytes(work)
    total = x * h if any(_saves_input(work, n) for n in ("q_proj", "k_proj", "v_proj")) else 0
    if work.attention in UNMASKED:
        total += c * (2 * q + 2 * kv) + 4 * s.heads  # o_proj reads the kernel's output itself
    else:
        # q, k and v repeated to every head, the output (o_proj reads it: its (B, T, H, d) memory needs no copy),
        # the log-sum-exp, and the packed mask as an additive bias
        total += c * 4 * q + 4 * s.heads + c * work.seq_len
        if work.attention == "eager":
            total += eager_scores_bytes(work)
    return total + _adapter_bytes(work, ("q_proj", "k_proj", "v_proj", "o_proj"))


def eager_scores_bytes(work: Workload) -> float:
    """Bytes per token eager attention saves of its (heads, T, T) scores: the float32 softmax, its copy in the
    compute dtype, and with softcapping (Gemma 2) tanh's output."""
    c = work.compute_bytes
    return (4 + c + (c if work.shape.attention_softcap else 0)) * work.shape.heads * work.seq_len


def mlp_bytes(work: Workload, kernels: bool) -> float:
    """Bytes per token one gated MLP saves: its input, gate/up (and SiLU's output, eager), down_proj's input."""
    c, h, i, x = work.compute_bytes, work.shape.hidden, work.shape.intermediate, linear_input_bytes(work)
    total = x * h if any(_saves_input(work, n) for n in ("gate_proj", "up_proj")) else 0
    total += c * i * (2 if kernels else 3)
    total += x * i if _saves_input(work, "down_proj") else 0
    return total + _adapter_bytes(work, ("gate_proj", "up_proj", "down_proj"))


def moe_bytes(work: Workload, kernels: bool) -> float:
    """Bytes per token one MoE block saves (full fine-tuning): the router's input, float32 probabilities and
    top-k, each token-expert pair's (tigon's experts op: gate_up and its sort position; transformers'
    grouped_mm: three int64 index vectors, the gathered input, gate_up, gate's activation, the product,
    the routing weight and the expert's output), and the shared expert's. Beyond these, 4 bytes an expert."""
    s, moe, c = work.shape, work.shape.moe, work.compute_bytes
    h, k, i = s.hidden, moe.top_k, moe.intermediate
    weight = 4 if moe.float32_weights else c
    total = c * h + 4 * moe.experts + 8 * k + (4 + 4 * k if moe.normalized else 0)
    if kernels:  # tigon's moe_experts keeps the routing weights and, a pair, gate_up and its sort position
        total += k * (weight + 2 * c * i + 8)
    else:  # transformers' grouped_mm: index vectors, gathered input and output, gate_up, SiLU's output, product
        total += k * (24 + 2 * c * h + 4 * c * i + weight)
    if moe.shared:  # a gated MLP on the router's input, its sigmoid gate and output, both saved by the product
        total += (3 if kernels else 4) * c * moe.shared + c + c * h
    return total


def layer_bytes(work: Workload, kernels: bool) -> float:
    """Bytes per token one decoder layer saves for its backward, without checkpointing (see the module doc);
    for an MoE model, a layer with the MoE block."""
    mlp = moe_bytes(work, kernels) if work.shape.moe else mlp_bytes(work, kernels)
    return 2 * norm_bytes(work, kernels) + attention_bytes(work) + mlp


def selective_layer_bytes(work: Workload) -> float:
    """Bytes per token a selectively recomputed decoder layer keeps (`tigon.runtime.recompute`): its input, the
    q/k/v, o_proj, gate and up projections' outputs, and the attention kernel's output and log-sum-exp."""
    s, c = work.shape, work.compute_bytes
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return work.weight_bytes * s.hidden + c * (2 * q + 2 * kv + s.hidden + 2 * s.intermediate) + 4 * s.heads


def selective_allowed(work: Workload) -> bool:
    """Whether the planner offers selective layers (dense layers, one attention kernel, no 4-bit base; see
    `tigon.runtime.recompute`)."""
    refused = work.shape.moe or work.quantized_bytes
    return not refused and work.attention not in ("eager", "flex_attention")


def layer_backward_bytes(work: Workload, kernels: bool) -> float:
    """Transient bytes per token while one layer runs its backward (gradients of its activations)."""
    s, c = work.shape, work.compute_bytes
    q = s.heads * s.head_dim
    mlp = c * s.intermediate * (1 if kernels and not work.compiled else 3)  # compiled code never writes in place
    attention = 3 * c * q + 4 * q
    if work.attention == "eager":  # the scores' gradient in float32, and the softmax's input gradient
        attention += 8 * s.heads * work.seq_len
    return max(mlp, attention)


def loss_bytes(work: Workload, micro_batch: int, fused: bool, chunk_tokens: int | None = None) -> int:
    """Peak bytes of the loss's own buffers (logits, their float32 copy, log-softmax, gradients) while it runs;
    `chunk_tokens`: the fused loss's tokens per chunk (None: the op's own rule). The preference and distillation
    objectives always run their fused ops (`preference_loss_bytes`, `distill_loss_bytes`)."""
    s, c = work.shape, work.compute_bytes
    tokens = work.tokens(micro_batch)
    if work.loss in ("pairs", "kto"):
        return preference_loss_bytes(work, micro_batch)
    if work.loss == "distill":
        return distill_loss_bytes(work, micro_batch)
    if fused:
        from tigon.kernels.ops.fused_linear_cross_entropy import logits_buffer_bytes, max_chunk_tokens

        chunk = chunk_tokens or max_chunk_tokens(s.vocab, s.hidden, c)
        grad_itemsize = None if work.lora_rank else c  # a frozen head has no gradient to hold the logits
        logits = logits_buffer_bytes(tokens, chunk, s.vocab, s.hidden, c, grad_itemsize)
        head_grad = 0 if work.lora_rank else work.weight_bytes * s.vocab * s.hidden
        return c * tokens * s.hidden + head_grad + 8 * tokens + logits
    softcap = c * tokens * s.vocab if s.logit_softcap else 0  # tanh's output, saved for its backward
    return 12 * tokens * s.vocab + softcap  # the forward's c + 4 + 4 bytes per logit stay under the backward's 12


def preference_pass_bytes(work: Workload, sequences: int, group: int, grads: bool) -> int:
    """Bytes one chunked pass of `tigon.kernels.ops.fused_linear_preference` holds over `sequences` rows of seq_len
    tokens in groups of `group` (pairs: 2): one chunk of logits in the compute dtype and its float32 token losses;
    with `grads`, the hidden states' gradient (c h per token) and, for a trained head, its weight's (V h, in the
    compute dtype the op reads the head in), both computed in the forward and kept for the backward."""
    from tigon.kernels.ops.fused_linear_preference import groups_per_chunk

    s, c, length = work.shape, work.compute_bytes, work.seq_len
    per_chunk = groups_per_chunk(sequences, length, group, s.vocab, s.hidden, c, chunk_rule_device())
    chunk_tokens = min(per_chunk * group, sequences) * length
    total = chunk_tokens * (c * s.vocab + 4)
    if grads:
        total += c * s.hidden * sequences * length + (0 if work.lora_rank else c * s.vocab * s.hidden)
    return total


def chunk_rule_device():
    """The device the kernels' chunk rules are asked about: a CPU (no free-memory cap, as on a fresh GPU)."""
    import torch

    return torch.device("cpu")


def preference_loss_bytes(work: Workload, micro_batch: int) -> int:
    """Peak bytes of a preference objective's loss for a micro-batch of `micro_batch` items: the fused op over the
    pairs' 2N sequences (KTO: over its N completions, after a no-grad pass over the N mismatched ones that frees its
    chunk first), the targets (int64), and with packed rows the final hidden states gathered into the op's rows
    beside the model's packed ones, with the gather's int64 index."""
    s, c = work.shape, work.compute_bytes
    tokens = work.tokens(micro_batch)
    sequences = micro_batch * work.sequences
    if work.loss == "kto":
        op = preference_pass_bytes(work, sequences // 2, 1, grads=True)
    else:
        op = preference_pass_bytes(work, sequences, 2, grads=True)
    packed = (c * s.hidden + 8) * tokens if work.packed_rows else 0
    return op + 8 * tokens + packed


def distill_loss_bytes(work: Workload, micro_batch: int) -> int:
    """Peak bytes of distillation's loss: the fused cross entropy's kept gradients (hidden states c h per token, the
    head's V h, per-token results 8) while the fused JSD runs with its own (the same two gradients, float32 per-token
    losses) and one chunk of both heads' logits (`fused_linear_jsd.choose_chunk_size`)."""
    from tigon.kernels.ops.fused_linear_jsd import choose_chunk_size

    s, c, tokens = work.shape, work.compute_bytes, work.tokens(micro_batch)
    teacher_c = work.frozen.compute_bytes if work.frozen is not None else c
    head_grad = 0 if work.lora_rank else c * s.vocab * s.hidden
    cross_entropy = c * s.hidden * tokens + head_grad + 8 * tokens
    chunk = choose_chunk_size(tokens, s.vocab, s.hidden, c + teacher_c, chunk_rule_device())
    jsd = c * s.hidden * tokens + head_grad + 4 * tokens + chunk * s.vocab * (c + teacher_c)
    return cross_entropy + jsd


def reference_pass_bytes(work: Workload, micro_batch: int, weights: int) -> int:
    """`reference: precomputed`'s pass before the first step: the model's `weights` as loaded (under FSDP2 whole,
    on the rank that scores the data before sharding), no optimizer states or gradients yet, and a no-grad forward
    over a micro-batch: its transient buffers (the residual stream, its normed copy and the attention output 4 h,
    one MLP's gate, up and product 3 i, per token), the final hidden states (h; packed, also their gathered copy)
    and one chunk of `sequence_logps`."""
    s, c, tokens = work.shape, work.compute_bytes, work.tokens(micro_batch)
    hidden = c * s.hidden * tokens * (2 if work.packed_rows else 1)
    forward = (4 * s.hidden + 3 * s.intermediate) * c * tokens
    logps = preference_pass_bytes(work, micro_batch * work.sequences, 1, grads=False)
    return weights + OVERHEAD + forward + hidden + logps + 8 * tokens


def teacher_pass_bytes(work: Workload, tokens: int, weights: int) -> int:
    """`objective.teacher.precompute`'s pass before the first step: the student's `weights` as loaded, the teacher
    as it would run beside it (`frozen_bytes`: its weights, forward buffers, hidden states and gathered head) and
    the round's hidden states of every rank's micro-batch, summed over the ranks."""
    beside = dataclasses.replace(work, frozen=dataclasses.replace(work.frozen, precomputed=False))
    rows = work.frozen.compute_bytes * work.frozen.shape.hidden * tokens * work.world_size
    return weights + OVERHEAD + sum(frozen_bytes(beside, tokens)) + rows


def frozen_bytes(work: Workload, tokens: int) -> tuple[int, int, int]:
    """(weights, what the loss reads, forward buffers) of the frozen model for a micro-batch of `tokens`, per GPU.

    Weights as loaded, sharded over the ranks under FSDP2 and partitioned under ZeRO-3, which shard and partition
    it as they do the trained model (none on the GPU with cpu_offload). Its forward runs under no_grad, so it saves
    nothing: the buffers are transient, the residual stream, its normed copy and the attention output (4 h) and one
    MLP's gate, up and product (3 i) per token, plus, sharded, the two layers and the embedding and head it
    gathers. The fused loss reads its final hidden states (h per token) and, sharded, its head gathered whole
    (V h). Precomputed: its head whole in the compute dtype, and the micro-batch's stored hidden states."""
    frozen, n = work.frozen, work.shards
    if frozen is None:
        return 0, 0, 0
    s, c = frozen.shape, frozen.compute_bytes
    if frozen.precomputed:
        return s.vocab * s.hidden * c, c * s.hidden * tokens, 0
    weights = s.params * frozen.weight_bytes
    gathered = 0
    zero3 = work.strategy == "deepspeed" and work.zero_stage == 3
    if (work.strategy == "fsdp" or zero3) and n > 1:
        weights = 0 if work.cpu_offload else weights // n
        gathered = (2 * s.layer_params + s.vocab * s.hidden * (1 if s.tied else 2)) * c
    forward = (4 * s.hidden + 3 * s.intermediate) * c * tokens + gathered
    head = s.vocab * s.hidden * c if gathered else 0
    return weights, c * s.hidden * tokens + head, forward


@dataclass(frozen=True)
class ZeroBytes:
    """What DeepSpeed ZeRO holds on each GPU besides activations, in bytes (`zero_bytes`)."""

    weights: int  # the 16-bit (or float32) weights: whole under ZeRO-1/2; under ZeRO-3 a partition + small ones whole
    states: int  # float32 master weights and AdamW's two float32 moments, partitioned
    grads: int  # the gradient partition, in the weights' dtype
    bucket: int  # the reduce bucket, in the weights' dtype
    step: int  # the optimizer step's transient: float32 gradient and AdamW's buffer for the largest group it steps
    gathered: int  # ZeRO-3: two decoder layers' weights gathered whole in the forward and backward
    head: int  # ZeRO-3: the head's weight gathered whole for the loss
    head_grad: int  # a tied head's whole gradient, from the loss until the embedding's backward


def trainable_groups(work: Workload) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The elements of each trainable parameter of AdamW's two groups (`optim.param_groups`), in the model's order:
    the matrices (the embedding, each layer's projections, a MoE layer's as one block, an untied head; with LoRA
    the adapters' A and B) and the norms (frozen under LoRA)."""
    s = work.shape
    if work.lora_rank:
        shapes = [s.linear_shape(n) for n in work.lora_targets if n in s.linear_names]
        adapters = [size for a, b in shapes for size in (work.lora_rank * a, b * work.lora_rank)]
        return tuple(adapters * s.layers), ()
    layer = [s.layer_params - 2 * s.hidden]
    if s.moe is None:
        layer = [a * b for a, b in map(s.linear_shape, s.linear_names)]
    head = [] if s.tied else [s.vocab * s.hidden]
    return (s.vocab * s.hidden, *layer * s.layers, *head), (s.hidden,) * (2 * s.layers + 1)


@functools.lru_cache(maxsize=256)
def partition_gradients(sizes: tuple[int, ...], ranks: int) -> tuple[int, ...]:
    """ZeRO-1/2's gradient partition of a parameter group on each rank, in elements: the group's flat buffer split in
    equal partitions, each holding the gradients of the parameters that overlap it whole (one that straddles two
    ranks' partitions is held by both)."""
    part = -(-sum(sizes) // ranks)
    held, start = [0] * ranks, 0
    for size in sizes:
        for rank in range(start // part, min(ranks, -(-(start + size) // part))):
            held[rank] += size
        start += size
    return tuple(held)


def optimizer_group(work: Workload) -> int:
    """Partition elements of the largest group that DeepSpeed hands AdamW at once. ZeRO-1/2: a parameter group's
    partition. ZeRO-3 splits each group into sub-groups: parameters in order, each partitioned (ceil(numel /
    ranks)), until the sub-group reaches ZERO_SUB_GROUP elements."""
    n = work.world_size
    groups = trainable_groups(work)
    if work.zero_stage < 3:
        return max(-(-sum(group) // n) for group in groups)
    largest = 0
    for group in groups:
        current = 0
        for size in group:
            current += -(-size // n)
            if current >= ZERO_SUB_GROUP:
                largest, current = max(largest, current), 0
        largest = max(largest, current)
    return largest


def zero_bytes(work: Workload, weights: int, trained: int) -> ZeroBytes:
    """DeepSpeed ZeRO's bytes per GPU for `weights` (bytes as loaded) with trainable parameters of `trained` bytes,
    on any number of ranks (one rank runs the same optimizer).

    Every stage keeps float32 master weights and AdamW's two float32 moments, 12 bytes a trainable parameter,
    partitioned over the ranks, and a gradient partition in the weights' dtype (ZeRO-1 and ZeRO-2 alike: with
    16-bit gradients both reduce through the bucket into a partition). ZeRO-3 partitions the weights too; parameters
    under PERSISTENCE_THRESHOLD elements (the norms, small LoRA matrices) stay whole on every rank of several as
    well. The reduce bucket holds min(trainable, REDUCE_BUCKET_SIZE) elements (the runtime's cap). ZeRO-1/2's
    gradient partition is the largest rank's (`partition_gradients`). The optimizer steps one group at a time
    (`optimizer_group`), allocating STEP_BYTES an element. CPU offload keeps states, gradient partitions and the
    step in host memory, and ZeRO-3's weights too."""
    s, n, w = work.shape, work.world_size, work.weight_bytes
    trainable = work.trainable
    small = (2 * s.layers + 1) * s.hidden * w  # the norms
    if work.lora_rank:
        small += sum(size for size in trainable_groups(work)[0] if size < PERSISTENCE_THRESHOLD) * trained
    zero3 = work.zero_stage == 3
    partitioned = -(-weights // n) + (small if n > 1 else 0) if zero3 else weights  # one rank: one copy of each
    states = MASTER_AND_MOMENTS * -(-trainable // n)
    grads = -(-trainable // n) * trained
    if not zero3:
        per_rank = zip(*(partition_gradients(group, n) for group in trainable_groups(work) if group), strict=True)
        grads = max(map(sum, per_rank)) * trained
    step = STEP_BYTES * optimizer_group(work)
    if work.cpu_offload:
        states = grads = step = 0
        partitioned = small if zero3 else partitioned
    return ZeroBytes(
        weights=partitioned,
        states=states,
        grads=grads,
        bucket=min(trainable, REDUCE_BUCKET_SIZE) * trained,
        step=step,
        gathered=2 * s.layer_params * work.compute_bytes if zero3 else 0,
        head=s.vocab * s.hidden * work.compute_bytes if zero3 else 0,
        head_grad=s.vocab * s.hidden * w if s.tied and not work.lora_rank else 0,
    )


def zero_moments(work: Workload, zero: ZeroBytes, accumulation: int) -> tuple[dict, dict, dict, dict]:
    """The gradient-side parts of DeepSpeed's moments: (every moment, loss, backward, optimizer).

    ZeRO-3 allocates the gradient partition and the bucket when it builds the optimizer; its reduce-scatter copies a
    full bucket's gradients into one buffer (`reduce_scatter_coalesced`), which may fall in any layer's backward, so
    the backward moments count it; the loss gathers the head. ZeRO-1/2 allocate the bucket at each backward and the
    gradient partition at its first reduction, kept until the step (through accumulation). A tied head's gradient
    waits, whole, for the embedding's backward (autograd accumulates the two uses of the one parameter before
    DeepSpeed's hook sees it); an untied head's is reduced as the backward starts."""
    held = {"gradient partition": zero.grads, "reduce bucket": zero.bucket}
    if work.zero_stage == 3:
        backward = {"gradients": zero.head_grad, "reduce copy": zero.bucket}
        return held, {"gathered head": zero.head}, backward, {"optimizer step": zero.step}
    loss = {"gradient partition": zero.grads if accumulation > 1 else 0}
    backward = {**held, "gradients": zero.head_grad}
    return {}, loss, backward, {"gradient partition": zero.grads, "optimizer step": zero.step}


def estimate(work: Workload, setting: Setting, loss_chunk_tokens: int | None = None) -> Estimate:
    """Peak GPU bytes per device of one training step of `work` under `setting` (see the module doc), with the
    fused loss in chunks of `loss_chunk_tokens` tokens (None: the op's own rule)."""
    s = work.shape
    kernels = setting.kernels and work.kernels_fit
    n = work.shards
    tokens = work.tokens(setting.micro_batch)
    rows = work.rows(setting.micro_batch)  # attention's view: packed preference rows are one long row
    w, r, c = work.weight_bytes, work.weight_bytes, work.compute_bytes
    trainable = work.trainable

    weights = s.params * w
    if work.quantized_bytes:
        weights -= int(work.linear_params * (w - work.quantized_bytes))
    trained = w  # a trainable parameter's bytes, its gradient's and each AdamW state's
    if work.lora_rank:  # the adapters, beside the base model's parameters
        trained = work.adapter_bytes
        weights += trainable * trained
    loaded = weights  # before any sharding
    grads = trainable * trained
    states = 2 * trainable * trained
    gathered = 0
    if work.strategy == "fsdp" and n > 1:
        weights, grads, states = weights // n, grads // n, states // n
        gathered = (2 * s.layer_params + s.vocab * s.hidden * (1 if s.tied else 2)) * c
        if work.copy_engine_gathers:  # the workspace holds the largest shard: a layer's, or the embedding's and head's
            gathered += max(s.layer_params, s.vocab * s.hidden * (1 if s.tied else 2)) * c // n
        if work.cpu_offload:
            weights, states = 0, 0
    elif work.strategy == "deepspeed":
        zero = zero_bytes(work, weights, trained)
        weights, states, grads, gathered = zero.weights, zero.states, zero.grads, zero.gathered
    buckets = grads if work.strategy == "ddp" and n > 1 else 0
    # layers in order: `checkpointed` recompute whole, then `selective` their element-wise work, then the rest keep
    # everything; the top layer is one of the first kinds only when no layer of the later kinds is left
    checkpointed = setting.checkpointed_layers(s.layers)
    selective = setting.selective_count(s.layers)
    kept_layers = s.layers - checkpointed - selective
    casts = 0
    if work.autocast:  # autocast's compute-dtype copies of the Linear weights live from forward to backward
        # (a 4-bit layer dequantizes inside its own matmul, forward and backward, and keeps no copy)
        kept = 0 if work.quantized_bytes else kept_layers
        casts = (s.vocab * s.hidden + kept * (s.layer_params - 2 * s.hidden)) * c
    # autocast's copies of float32 adapter weights: cached for the whole forward (the loss runs inside it), then
    # kept by the layers that keep their activations
    adapter_casts = adapter_cast_bytes(work)
    loss_casts = casts + s.layers * adapter_casts
    casts += kept_layers * adapter_casts

    layer = layer_bytes(rows, kernels) * tokens
    layer_input = r * s.hidden * tokens
    partial = selective_layer_bytes(rows) * tokens if selective else 0
    first_kept = layer_input if checkpointed else partial if selective else layer
    first_recomputed = layer if checkpointed else layer - partial if selective else 0
    top_recomputed = 0 if kept_layers else layer - partial if selective else layer
    per_batch = 24 * tokens + 2 * r * s.head_dim * tokens
    masked = (checkpointed or selective) and work.attention not in UNMASKED  # checkpoints keep the bool mask
    mask = tokens * rows.seq_len if masked else 0  # (rows, 1, T, T) booleans
    fused = (kernels and work.fused_loss) or work.loss != "cross_entropy"  # the other objectives' ops read the head
    head = (norm_bytes(work, kernels) + (0 if work.lora_rank or fused else c * s.hidden)) * tokens
    backward = layer_backward_bytes(rows, kernels)
    # the top layer runs its forward (or, when no layer keeps everything, its recompute) with every layer's
    # activations live; a recomputed first layer runs its recompute beside the gradients
    top_transient = max(backward, adapter_forward_bytes(work, recompute=not kept_layers)) * tokens
    first_transient = max(backward, adapter_forward_bytes(work, recompute=True) if first_recomputed else 0) * tokens
    loss_peak = loss_bytes(work, setting.micro_batch, fused, loss_chunk_tokens)
    head_grad = s.vocab * s.hidden * w if not work.lora_rank else 0
    if work.strategy == "fsdp" and n > 1:
        head_grad //= n

    fixed = {"weights": weights, "optimizer states": states, "overhead": OVERHEAD + gathered}
    frozen_weights, frozen_read, frozen_forward = frozen_bytes(work, tokens)
    if work.frozen is not None:
        fixed["frozen model"] = frozen_weights
    activations = checkpointed * layer_input + selective * partial + kept_layers * layer + head + per_batch + mask
    carried = grads if setting.accumulation > 1 else 0  # earlier micro-batches' gradients stay during the next
    if work.strategy == "fsdp" and setting.accumulation > 1 and not setting.accumulate_sharded:
        carried = trainable * 4  # unsharded float32 until the last micro-batch reduce-scatters them
    loss_grads = {"gradients": carried}
    top_grads, first_grads = {"gradients": max(carried, head_grad)}, {"gradients": grads}
    step = {"gradients": grads + buckets}
    if work.strategy == "deepspeed":
        held, loss_grads, top_grads, step = zero_moments(work, zero, setting.accumulation)
        fixed.update(held)
        first_grads = top_grads
    loss = {**fixed, "activations": loss_casts + activations, "loss and logits": loss_peak, **loss_grads}
    if work.frozen is not None:
        loss["frozen hidden states and head"] = frozen_read
    moments = {
        "loss": loss,
        "backward (top layer)": {
            **fixed,
            "activations": casts + activations,
            "backward buffers": top_recomputed + top_transient,
            **top_grads,
        },
        "backward (first layer)": {
            **fixed,
            "activations": first_kept + per_batch + mask,
            "backward buffers": first_recomputed + first_transient,
            **first_grads,
        },
        "optimizer": {**fixed, **step},
    }
    if work.frozen is not None and work.frozen.precomputed:  # before training: the teacher scores the data
        moments["teacher pass"] = {"teacher pass": teacher_pass_bytes(work, tokens, loaded)}
    elif work.frozen is not None:  # before the trained model's forward: no activations yet
        moments["frozen forward"] = {**fixed, "frozen forward": frozen_forward, "gradients": carried}
    if work.reference_pass:  # before training: the whole model, scoring the data without gradient
        moments["reference pass"] = {"reference pass": reference_pass_bytes(work, setting.micro_batch, loaded)}
    totals = {name: int(sum(parts.values())) for name, parts in moments.items()}
    moment = max(totals, key=totals.get)
    return Estimate(setting, totals[moment], moment, {name: int(v) for name, v in moments[moment].items()}, totals)


def loss_chunk_tokens(work: Workload, setting: Setting) -> int | None:
    """The fused loss's tokens per chunk that spend memory the step holds anyway: the largest power of two up to
    LOSS_CHUNK_LIMIT whose loss moment stays under LOSS_CHUNK_MARGIN of the estimated peak with the op's own rule
    (the backward's, in a long sequence). None (the op's own rule) when no larger chunk fits so, or without it.

    Each chunk re-reads and re-writes the head's weight gradient, so fewer, larger chunks save time (see
    `tigon.kernels.ops.fused_linear_cross_entropy`), but they raise the loss's own peak, which the op's rule
    keeps low for any step.
    """
    if not (setting.kernels and work.kernels_fit and work.fused_loss) or work.loss != "cross_entropy":
        return None
    from tigon.kernels.ops.fused_linear_cross_entropy import max_chunk_tokens

    s, c = work.shape, work.compute_bytes
    tokens = work.tokens(setting.micro_batch)
    own = min(tokens, max_chunk_tokens(s.vocab, s.hidden, c))
    budget = LOSS_CHUNK_MARGIN * estimate(work, setting).peak
    best = None
    chunk = 1 << own.bit_length()  # the next power of two above the op's own chunk
    while chunk <= LOSS_CHUNK_LIMIT and own < tokens:
        chunk = min(chunk, tokens)
        if estimate(work, setting, loss_chunk_tokens=chunk).moments["loss"] > budget:
            break
        best, own = chunk, chunk
        chunk *= 2
    return best


# ---------------------------------------------------------------------------------------------------- plan


def gather_tokens(work: Workload) -> float:
    """The cost of gathering sharded weights once a micro-batch, counted in tokens of a micro-batch's compute.

    FSDP2 and ZeRO-3 gather every weight before its forward and again before its backward, each micro-batch:
    2 x compute bytes x (n - 1) / n bytes a parameter arrive at each of the n ranks it is sharded over, against 6
    FLOPs a parameter a token of compute, so a micro-batch of T tokens spends the time of this many more tokens on
    them where they are not hidden. Without sharded weights (DDP, ZeRO-1/2, one GPU), 0.
    """
    n = work.shards
    sharded = work.strategy == "fsdp" or (work.strategy == "deepspeed" and work.zero_stage == 3)
    if n == 1 or not sharded:
        return 0.0
    return 2 * work.compute_bytes * (n - 1) / n * GATHER_FLOPS_PER_BYTE / 6


def sharded_accumulation_tokens(work: Workload, setting: Setting) -> float:
    """With `accumulate_sharded`, the cost of the reduce-scatters that accumulation adds, per micro-batch and in
    the units of `gather_tokens`: each of a step's micro-batches but the last reduce-scatters the float32
    gradients (FSDP2's reduce dtype, 4 bytes a parameter) as the last one does anyway."""
    n = work.shards
    if not setting.accumulate_sharded or n == 1:
        return 0.0
    extra = (setting.accumulation - 1) / setting.accumulation
    return extra * 4 * (n - 1) / n * GATHER_FLOPS_PER_BYTE / 6


def relative_step_time(work: Workload, setting: Setting) -> float:
    """Step time relative to the ideal (checkpointing off, kernels on, saturating micro-batches); ranks only."""
    tokens = work.tokens(setting.micro_batch)
    fixed = HALF_EFFICIENCY_TOKENS + (FP8_MICRO_BATCH_TOKENS if work.fp8 else 0)
    time = (tokens + fixed + gather_tokens(work) + sharded_accumulation_tokens(work, setting)) / tokens
    layers = work.shape.layers
    time *= 1 + (CHECKPOINT_TIME - 1) * setting.checkpointed_layers(layers) / layers
    time *= 1 + (SELECTIVE_TIME - 1) * setting.selective_count(layers) / layers
    if not (setting.kernels and work.kernels_fit):
        time /= KERNEL_TIME
    return time * KERNEL_TIME


def sharded_accumulation_allowed(work: Workload) -> bool:
    """Whether the planner may accumulate FSDP2's gradients sharded: several shards, and float32 weights, whose
    shards accumulate in float32 as the unsharded gradients would, or a config that accumulates sharded already
    (bf16/fp16 weights accumulate in their own dtype: a change of numerics the planner leaves to the config).
    Under hybrid sharding only where the config says so: every micro-batch would then also all-reduce the shards
    across the replicas, between nodes, which the time model does not price."""
    if work.strategy != "fsdp" or work.shards == 1 or work.cpu_offload:
        return False
    return work.accumulate_sharded or (work.shards == work.world_size and work.weight_bytes == 4)


def candidates(work: Workload, current: Setting) -> list[Setting]:
    """Every setting with the current global batch: micro-batch x accumulation, checkpointing of none, some or
    every layer, kernels; where layers can recompute selectively, also any number of them selective, or the first
    ones whole and every other one selective (selective layers save a third of a layer's bytes for a few percent
    of its time, so they go first and whole layers only where they are not enough); under FSDP2 with accumulation
    (`sharded_accumulation_allowed`), each of those with the gradients accumulated sharded too."""
    global_batch = current.micro_batch * current.accumulation
    kernel_options = (True, False) if work.kernels_fit else (False,)
    layers = work.shape.layers
    checkpointing = [(False, None, 0), *((True, n, 0) for n in range(1, layers)), (True, None, 0)]
    if selective_allowed(work):
        checkpointing += [(False, None, m) for m in range(1, layers + 1)]
        checkpointing += [(True, n, layers - n) for n in range(1, layers)]
    sharded = (False, True) if sharded_accumulation_allowed(work) else (False,)
    options = [
        Setting(micro, global_batch // micro, on, kernels, full, selective, accumulate)
        for micro in range(1, global_batch + 1)
        if global_batch % micro == 0
        for on, full, selective in checkpointing
        for kernels in kernel_options
        for accumulate in (sharded if micro < global_batch else (False,))
    ]
    return options if current in options else [*options, current]


@dataclass
class Plan:
    """The chosen setting, the budget it was chosen against, and every alternative's estimate."""

    chosen: Estimate | None
    current: Estimate
    budget: int
    gpu_memory: int
    work: Workload
    alternatives: list[Estimate]
    limited: bool = False  # gpu_memory is the config's training.gpu_memory, less than the GPU's

    def table(self) -> str:
        """A readable table: the plan first, then each alternative, fitting or not."""
        s, w = self.work.shape, self.work
        accum_width = 13 if sharded_accumulation_allowed(w) or self.current.setting.accumulate_sharded else 5
        lines = [
            f"model {s.model_type}: {_count(s.params)} parameters ({_count(w.trainable)} trainable), "
            f"{s.layers} layers, hidden {s.hidden}, vocab {s.vocab}",
            f"sequence {w.seq_len}{_rows_text(w)}, weights {_dtype(w.weight_bytes)}, compute "
            f"{_dtype(w.compute_bytes)}{' (decoder Linear layers fp8)' if w.fp8 else ''}, attention {w.attention}, "
            f"{w.strategy} x {w.world_size}{_groups_text(w)}, "
            "loss from " + _loss_text(w),
            f"GPU memory {_gib(self.gpu_memory)}{' (training.gpu_memory)' if self.limited else ''}, budget "
            f"{_gib(self.budget)} "
            f"({FIT_FRACTION:.0%} of it less {_gib(CUDA_CONTEXT)} CUDA context)",
            "",
            f"{'':2}{'micro':>5} {'accum':>{accum_width}} {'ckpt':>16} {'kernels':>7} {'estimate':>10} {'fits':>4} "
            f"{'rel. time':>9}  peaks at",
        ]
        for item in sorted(self.shown(), key=lambda e: (e.peak > self.budget, self.rank(e))):
            st = item.setting
            mark = "->" if self.chosen is not None and item.setting == self.chosen.setting else "  "
            mark = "=>" if mark == "->" and item.setting == self.current.setting else mark
            lines.append(
                f"{mark}{st.micro_batch:5d} {st.accumulation_text():>{accum_width}} {st.checkpointing_text():>16} "
                f"{'on' if st.kernels and w.kernels_fit else 'off':>7} {_gib(item.peak):>10} "
                f"{'yes' if item.peak <= self.budget else 'no':>4} {self.rank(item):9.2f}  {item.moment}"
                + ("   (current)" if item.setting == self.current.setting else "")
            )
        if self.chosen is not None:
            parts = ", ".join(f"{name} {_gib(value)}" for name, value in self.chosen.parts.items())
            lines += ["", f"plan: {self.chosen.setting.describe()}: {_gib(self.chosen.peak)} ({parts})"]
            changes = config_changes(self.current.setting, self.chosen.setting)
            lines.append("set: " + (" ".join(f"--set {c}" for c in changes) if changes else "nothing to change"))
            chunk = loss_chunk_tokens(self.work, self.chosen.setting)
            if chunk is not None:
                lines.append(
                    f"loss: {chunk}-token chunks of the fused loss with kernels.loss_chunk_tokens: auto (the step "
                    f"peaks at the {self.chosen.moment}, so the loss has room)"
                )
        return "\n".join(lines)

    def rank(self, item: Estimate) -> float:
        return relative_step_time(self.work, item.setting)

    def shown(self) -> list[Estimate]:
        """The table's rows: checkpointing off and on for each micro-batch and kernel choice; where off does not fit
        and on does, the fastest partial recomputation that fits (some layers whole, some selective); the chosen
        and the current setting."""
        rows, fastest, off_fits = [], {}, set()
        for item in self.alternatives:
            st = item.setting
            whole = st.checkpoint_layers is None and not st.selective_layers
            key = (st.micro_batch, st.kernels, st.accumulate_sharded)
            if whole or st in (self.current.setting, getattr(self.chosen, "setting", None)):
                rows.append(item)
                if not st.checkpointing and not st.selective_layers and item.peak <= self.budget:
                    off_fits.add(key)
            if not whole and item.peak <= self.budget:
                if key not in fastest or self.rank(item) < self.rank(fastest[key]):
                    fastest[key] = item
        return rows + [item for key, item in fastest.items() if key not in off_fits and item not in rows]


def _rows_text(work: Workload) -> str:
    """What a micro-batch item is, for the preference objectives: its sequences, padded or packed."""
    if work.sequences == 1:
        return ""
    item = "pair" if work.loss == "pairs" else "completion and its mismatched sequence"
    layout = "packed into one row" if work.packed_rows else "padded rows"
    return f" ({work.sequences} sequences an item, a {item}, {layout})"


def _groups_text(work: Workload) -> str:
    return f" (shard groups of {work.shards})" if work.shards < work.world_size else ""


def _loss_text(work: Workload) -> str:
    if work.loss in ("pairs", "kto"):
        return "the fused preference op"
    if work.loss == "distill":
        return "the fused cross entropy and JSD"
    return f"{'fused linear cross entropy with the kernels, else ' if work.fused_loss else ''}full logits"


def _gib(count: float) -> str:
    return f"{count / GiB:.2f} GiB" if abs(count) >= GiB / 10 else f"{count / MiB:.1f} MiB"


def _count(number: int) -> str:
    return f"{number / 1e9:.2f}B" if number >= 10**8 else f"{number / 1e6:.2f}M"


def _dtype(size: int) -> str:
    return {2: "bf16/fp16", 4: "fp32"}[size]


def detect_gpu_memory(config: RunConfig | None = None) -> int:
    """The memory a run may use on this process's CUDA device: the device's, or `training.gpu_memory` where that
    is less (which needs no device); a clear error where neither is known."""
    import torch

    limit = parse_memory(config.training.gpu_memory) if config is not None and config.training.gpu_memory else None
    if not torch.cuda.is_available():
        if limit is not None:
            return limit
        raise ConfigError(
            "no CUDA GPU here to plan for: pass --gpu-memory (e.g. --gpu-memory 80GB) or set training.gpu_memory"
        )
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return total if limit is None else min(total, limit)


def is_memory_limit(config: RunConfig, gpu_memory: int) -> bool:
    """Whether `gpu_memory` is the run's `training.gpu_memory` (less than the GPU's own)."""
    return config.training.gpu_memory is not None and gpu_memory == parse_memory(config.training.gpu_memory)


def make_plan(
    config: RunConfig, gpu_memory: int | None = None, world_size: int | None = None, work: Workload | None = None
) -> Plan:
    """Estimate every candidate setting and choose the fastest that fits; PlanError when none does."""
    work = work or workload(config, world_size)
    detected = gpu_memory is None
    gpu_memory = detect_gpu_memory(config) if detected else gpu_memory
    limited = detected and is_memory_limit(config, gpu_memory)
    if gpu_memory <= CUDA_CONTEXT:
        raise PlanError(f"GPU memory {_gib(gpu_memory)}: less than the CUDA context alone ({_gib(CUDA_CONTEXT)})")
    budget = int((gpu_memory - CUDA_CONTEXT) * FIT_FRACTION)
    current = setting_of(config)
    if current.checkpoint_layers is not None and current.checkpoint_layers >= work.shape.layers:
        current = dataclasses.replace(current, checkpoint_layers=None)  # every layer
    current = dataclasses.replace(current, selective_layers=current.selective_count(work.shape.layers))
    if current.accumulation == 1:  # nothing to accumulate: one reduce-scatter a step either way
        current = dataclasses.replace(current, accumulate_sharded=False)
    alternatives = [estimate(work, setting) for setting in candidates(work, current)]
    fitting = [item for item in alternatives if item.peak <= budget]
    if not fitting:
        smallest = min(alternatives, key=lambda e: e.peak)
        raise PlanError(
            f"nothing fits in {_gib(gpu_memory)} of GPU memory ({_gib(budget)} usable): the smallest setting "
            f"({smallest.setting.describe()}) needs {_gib(smallest.peak)}. Shorten data.max_seq_len "
            f"(now {work.seq_len}), train LoRA adapters (lora.enabled: true), shard over more GPUs "
            "(parallelism.strategy: fsdp), or use a GPU with more memory" + sharded_accumulation_hint(work, smallest)
        )
    chosen = min(fitting, key=lambda e: (relative_step_time(work, e.setting), e.peak))
    current_estimate = next(item for item in alternatives if item.setting == current)
    return Plan(chosen, current_estimate, budget, gpu_memory, work, alternatives, limited)


def sharded_accumulation_hint(work: Workload, smallest: Estimate) -> str:
    """Where FSDP2 holds whole float32 gradients between micro-batches and the planner does not try sharded ones
    (bf16/fp16 weights, `sharded_accumulation_allowed`): what accumulating them sharded would need."""
    setting = smallest.setting
    if work.strategy != "fsdp" or work.shards == 1 or setting.accumulation == 1 or setting.accumulate_sharded:
        return ""
    sharded = estimate(work, dataclasses.replace(setting, accumulate_sharded=True))
    return (
        f"; or accumulate the gradients sharded (parallelism.accumulate_sharded: true, {_gib(sharded.peak)} for "
        f"that setting; the shards accumulate in {_dtype(work.weight_bytes)})"
    )


def config_changes(current: Setting, chosen: Setting) -> list[str]:
    """The `key=value` config changes that turn `current` into `chosen`."""
    keys = {
        "training.micro_batch_size": (current.micro_batch, chosen.micro_batch),
        "training.gradient_accumulation_steps": (current.accumulation, chosen.accumulation),
        "training.gradient_checkpointing": (current.checkpointing, chosen.checkpointing),
        "training.checkpoint_layers": (current.checkpoint_layers, chosen.checkpoint_layers),
        "training.selective_layers": (current.selective_layers, chosen.selective_layers),
        "kernels.enabled": (current.kernels, chosen.kernels),
        "parallelism.accumulate_sharded": (current.accumulate_sharded, chosen.accumulate_sharded),
    }
    return [f"{key}={'null' if new is None else str(new).lower()}" for key, (old, new) in keys.items() if old != new]


def apply_plan(config: RunConfig, plan: Plan) -> RunConfig:
    """A copy of `config` with the plan's setting (micro-batch, accumulation, checkpointing, kernels, and whether
    FSDP2 accumulates the gradients sharded)."""
    chosen = plan.chosen.setting
    training = config.training.model_copy(
        update={
            "micro_batch_size": chosen.micro_batch,
            "gradient_accumulation_steps": chosen.accumulation,
            "gradient_checkpointing": chosen.checkpointing,
            "checkpoint_layers": chosen.checkpoint_layers,
            "selective_layers": chosen.selective_layers,
        }
    )
    kernels = config.kernels.model_copy(update={"enabled": chosen.kernels})
    parallelism = config.parallelism.model_copy(update={"accumulate_sharded": chosen.accumulate_sharded})
    return config.model_copy(update={"training": training, "kernels": kernels, "parallelism": parallelism})


def oom_advice(config: RunConfig, gpu_memory: int, world_size: int | None = None) -> str:
    """What to change after a CUDA out-of-memory error: the planner's setting for this GPU, as config keys."""
    work = workload(config, world_size)
    current = estimate(work, setting_of(config))
    where = (
        f"within {_gib(gpu_memory)} of GPU memory (training.gpu_memory)"
        if is_memory_limit(config, gpu_memory)
        else f"on a {_gib(gpu_memory)} GPU"
    )
    head = (
        f"CUDA out of memory: the planner estimates this run's peak at {_gib(current.peak)} per GPU "
        f"({setting_of(config).describe()}) {where}."
    )
    try:
        plan = make_plan(config, gpu_memory, world_size, work)
    except PlanError as error:
        return f"{head} {error}"
    chosen = plan.chosen.setting
    changes = config_changes(setting_of(config), chosen)
    if not changes:
        return (
            f"{head} The planner expected this setting to fit ({_gib(plan.budget)} usable); memory held by "
            "other processes on the GPU, or fragmentation, may be the cause: check nvidia-smi, or set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
        )
    return (
        f"{head} The fastest setting that fits is {chosen.describe()} ({_gib(plan.chosen.peak)}). "
        f"Set training.plan: auto to apply it, or change the config: {', '.join(changes)} "
        f"(tigon train CONFIG {' '.join('--set ' + c for c in changes)}); `tigon plan CONFIG` shows the alternatives"
    )


class TrainingOutOfMemory(RuntimeError):
    """A CUDA out-of-memory error during training, with the planner's advice in its message."""


def allocator_account(error: BaseException) -> str:
    """torch's account of a failed CUDA allocation (what was asked for, what was free, allocated and reserved but
    unallocated), without its advice: whether the memory was used or fragmented."""
    text = " ".join(str(error).split()).removeprefix("CUDA out of memory.").strip()
    return text.split(" If reserved but unallocated")[0]


def out_of_memory_error(config: RunConfig, error: BaseException) -> TrainingOutOfMemory:
    """The error train() raises in place of torch.OutOfMemoryError: the planner's advice for this GPU, then
    torch's account of the allocation that failed."""
    try:
        advice = oom_advice(config, detect_gpu_memory(config))
    except (ConfigError, OSError, ValueError) as planning:  # the advice must not hide the out-of-memory error
        return TrainingOutOfMemory(f"CUDA out of memory ({error}); the planner could not estimate this run: {planning}")
    account = allocator_account(error)
    return TrainingOutOfMemory(f"{advice} (torch: {account})" if account else advice)


def planned_config(config: RunConfig) -> RunConfig:
    """`training.plan: auto`: the config with the planner's setting for this process's GPU (logged as a table)."""
    import torch

    if not torch.cuda.is_available():
        logger.warning(
            "training.plan: auto plans for a CUDA GPU and none is present; training with the configured setting (%s)",
            setting_of(config).describe(),
        )
        return config
    plan = make_plan(config)
    if int(os.environ.get("RANK", "0") or 0) == 0:
        logger.info("memory plan (training.plan: auto):\n%s", plan.table())
    return apply_plan(config, plan)
