"""The run configuration: one YAML file, one pydantic model per concern, validated on load.

    config = load_config("examples/demo.yaml", overrides=["training.max_steps=20"])

Unknown keys and wrong types fail at load time with the key's dotted path and, for a misspelt
key, the closest valid name.
"""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

Text = Annotated[str, StringConstraints(min_length=1)]  # an empty name, path or field is always a mistake


def parse_memory(text: str) -> int:
    """'80GB' (10^9), '80GiB' (2^30), '81920MiB', '0.5TB' -> bytes; a bare number is GB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]i?[bB]?)?\s*", text)
    if not match:
        raise ConfigError(f"GPU memory {text!r}: write a size like 80GB, 80GiB or 81920MiB")
    value, unit = float(match.group(1)), (match.group(2) or "GB").upper().rstrip("B")
    scale = {"K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}
    return int(value * scale[unit])


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, types are strict (`true` is no number, `"8"` no
    integer), values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=True)


class ModelConfig(Section):
    """Which model to train: a Hub id, a local or object-store directory, or a config built from scratch."""

    path: Text | None = Field(
        None,
        description="what from_pretrained loads: a Hugging Face Hub id (org/name), a local directory with config.json, "
        "or an object-store URL of one (s3://, gs://)",
    )
    revision: Text | None = Field(
        None, description="branch, tag or commit of a Hub id in path and tokenizer (pin a commit for reproducibility)"
    )
    cache_dir: Text | None = Field(
        None, description="where Hub and object-store downloads go; default: the Hugging Face cache (HF_HOME)"
    )
    trust_remote_code: bool = Field(
        False, description="run modeling/tokenizer code shipped inside the model repository (off unless you trust it)"
    )
    config_name: Text | None = Field(
        None, description="transformers model_type to build from a config (random init), e.g. 'llama'"
    )
    config_overrides: dict[str, Any] = Field(
        default_factory=dict, description="config fields set inline, e.g. hidden_size, num_hidden_layers"
    )
    tokenizer: Text | None = Field(
        None,
        description="tokenizer Hub id, local or object-store directory; defaults to `path`; 'char' builds tigon's "
        "character tokenizer",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="dtype of the weights")
    attn_implementation: Literal["auto", "varlen", "sdpa", "eager", "flash_attention_2", "flex_attention"] = Field(
        "auto",
        description="auto: varlen on a CUDA GPU, else sdpa. varlen: packed documents through a variable-length "
        "kernel (cuDNN's on Hopper/Blackwell with nvidia-cudnn-frontend installed, else PyTorch's flash), no "
        "mask; sdpa / eager: a dense block-diagonal mask for packed rows; flash_attention_2 (the flash-attn "
        "package) and flex_attention (CUDA): documents from position ids",
    )

    @model_validator(mode="after")
    def _one_source(self) -> ModelConfig:
        if (self.path is None) == (self.config_name is None):
            raise ValueError(
                "set exactly one of model.path (a Hub id or a directory) or model.config_name (e.g. 'llama')"
            )
        if self.path is None and self.tokenizer is None:
            raise ValueError("a model built from a config needs model.tokenizer (a Hub id, a directory, or 'char')")
        return self


class DataConfig(Section):
    """Where the examples come from and how they become fixed-length training sequences."""

    train: Text = Field(
        description="a Hub dataset name (org/name), a JSONL, Parquet, CSV, Arrow or text file, a glob of them, a "
        "dataset directory, or a directory saved by datasets.save_to_disk; read with datasets.load_dataset"
    )
    eval: Text | None = Field(
        None, description="held-out examples in the same format; unset with eval_split set: data.train's eval_split"
    )
    split: Text = Field("train", description="the split of data.train, e.g. 'train' or 'train[:90%]'")
    eval_split: Text | None = Field(
        None, description="the split of data.eval (default 'train'), or of data.train when data.eval is unset"
    )
    subset: Text | None = Field(None, description="the dataset's configuration (load_dataset's name), e.g. 'main'")
    data_files: str | list[str] | dict[str, str | list[str]] | None = Field(
        None, description="files or globs inside data.train's dataset (load_dataset's data_files)"
    )
    revision: Text | None = Field(None, description="branch, tag or commit of a Hub dataset")
    cache_dir: Text | None = Field(None, description="datasets' cache; default HF_DATASETS_CACHE")
    format: Literal["text", "instruction", "chat"] = "text"
    text_field: Text = "text"
    prompt_field: Text = "instruction"
    response_field: Text = "response"
    messages_field: Text = "messages"
    max_seq_len: int = Field(512, gt=0)
    packing: bool = Field(
        True,
        description="pack documents into full sequences; positions restart per document. Preference objectives: "
        "a micro-batch's sequences laid end to end in one row without padding (unset: false, padded rows)",
    )
    packing_strategy: Literal["best_fit", "in_order"] = Field(
        "best_fit",
        description="how packing fills sequences: best_fit places the longest documents first, each into the "
        "fullest sequence it still fits (little padding); in_order fills one sequence at a time in the data's order",
    )
    balance_micro_batches: bool = Field(
        True,
        description="deal each global batch's rows to ranks and micro-batches so each micro-batch holds about as "
        "many tokens, where rows differ: varlen attention drops a row's padding, and ranks wait for the fullest "
        "micro-batch. The step trains the same rows either way",
    )
    long_documents: Literal["auto", "split", "truncate"] = Field(
        "auto",
        description="a document longer than max_seq_len: split it into pieces of max_seq_len tokens, each "
        "overlapping the last by one token so every token but the document's first is predicted once, or "
        "truncate it to its first max_seq_len tokens; auto: split for format text, truncate for instruction and "
        "chat (a response belongs with its prompt)",
    )
    skip_malformed: bool = Field(False, description="skip malformed records (and report how many) instead of failing")

    @property
    def splits_long_documents(self) -> bool:
        """Whether documents longer than max_seq_len are split into pieces (long_documents, auto resolved)."""
        return self.long_documents == "split" or (self.long_documents == "auto" and self.format == "text")

    @model_validator(mode="after")
    def _room_to_split(self) -> DataConfig:
        if self.splits_long_documents and self.max_seq_len < 2:
            raise ValueError(
                "data.max_seq_len 1 leaves a split document's pieces no token to predict: raise data.max_seq_len "
                "or set data.long_documents: truncate"
            )
        return self


class TrainingConfig(Section):
    """The optimization: length, learning rate and schedule, batch shape, precision."""

    max_steps: int | None = Field(None, gt=0, description="optimizer steps; set this or epochs")
    epochs: float | None = Field(None, gt=0)
    learning_rate: float = Field(3e-4, gt=0)
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    micro_batch_size: int = Field(8, gt=0, description="sequences per device per forward pass")
    gradient_accumulation_steps: int = Field(1, gt=0)
    max_grad_norm: float | None = Field(1.0, gt=0, description="clip the global gradient norm; null turns it off")
    seed: int = 0
    deterministic: bool = Field(
        False,
        description="deterministic GPU kernels: the same run gives the same per-step losses bit for bit (PyTorch's "
        "deterministic algorithms, no cuDNN attention); an op with no deterministic version stops the run with "
        "PyTorch's error naming it",
    )
    freeze_gc: bool | None = Field(
        None,
        description="collect Python's garbage before the first step and after it, then leave what is alive out of "
        "later collections (gc.freeze): a full pass over a loaded model's objects stalls a step 0.25-0.5 s, and on "
        "several GPUs every rank waits for it; null: on when training on GPUs",
    )
    gradient_checkpointing: bool = Field(False, description="recompute decoder layers' activations in the backward")
    checkpoint_layers: PositiveInt | None = Field(
        None,
        description="with gradient_checkpointing: only the first N decoder layers recompute, the rest keep their "
        "activations (faster where memory allows); unset: every layer",
    )
    selective_layers: int = Field(
        0,
        ge=0,
        description="decoder layers, after those gradient checkpointing recomputes whole, that keep their matrix "
        "products' and attention's outputs and recompute only the element-wise work in the backward (norms, RoPE, "
        "the MLP's activation): about a third less of those layers' saved bytes for a few percent of their time; "
        "more than the layers left means all of them",
    )
    compile: bool = Field(
        False,
        description="torch.compile each decoder layer (tigon's kernels inside as custom ops, no graph break); every "
        "trainer, under parallelism.strategy ddp, fsdp or deepspeed ZeRO 1 and 2",
    )
    static_shapes: bool | Literal["auto"] = Field(
        "auto",
        description="under varlen attention, every micro-batch feeds the model micro_batch_size x data.max_seq_len "
        "tokens: its packed rows whole, their padding computed, so compiled layers keep one graph of static shapes "
        "instead of one for any token count (FP8's casts gain most); auto: on under training.compile when the "
        "training rows' padding is under 2% of their tokens",
    )
    compile_backend: Literal["inductor", "aot_eager"] = Field(
        "inductor",
        description="with compile: the torch.compile backend; inductor generates fused kernels, aot_eager runs the "
        "traced graph on PyTorch's own ops (for debugging a compiled run)",
    )
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = Field(
        "fp32",
        description="autocast precision of the forward pass; fp8: the decoder layers' Linear layers in FP8 "
        "(torchao's float8 training recipe, a GPU of compute capability 8.9 or higher), everything else in bf16",
    )
    fp8_scaling: Literal["tensorwise", "rowwise"] | None = Field(
        None,
        description="with precision fp8: one scale per tensor (fastest; FP8 all-gather under FSDP2) or one per "
        "row (closer to bf16); unset: tensorwise",
    )
    fp8_layers: Literal["auto", "tigon", "torchao"] = Field(
        "auto",
        description="with precision fp8: auto takes tigon's FP8 layers (one-pass casts) for tensorwise scaling "
        "outside FSDP2 and torchao's Float8Linear elsewhere (rowwise; FSDP2's FP8 all-gather); tigon takes "
        "tigon's for tensorwise scaling everywhere (bf16 all-gather under FSDP2); torchao takes torchao's",
    )
    plan: Literal["manual", "auto"] = Field(
        "manual",
        description="auto: the memory planner picks micro-batch (same global batch), gradient checkpointing and "
        "kernels to fit this GPU (see `tigon plan`)",
    )
    gpu_memory: Text | None = Field(
        None,
        description="the GPU memory this run may use per GPU, e.g. 72GiB: the planner plans for it and PyTorch's "
        "allocator stops there (a GPU shared with another process, or a smaller card's setting); unset: the whole GPU",
    )

    @field_validator("gpu_memory")
    @classmethod
    def _gpu_memory_is_a_size(cls, value: str | None) -> str | None:
        if value is not None and parse_memory(value) <= 0:
            raise ValueError(f"{value!r} is no memory at all; write a size like 72GiB")
        return value

    def global_batch(self, world_size: int) -> int:
        """Sequences an optimizer step trains on `world_size` processes: micro-batch x accumulation x processes."""
        return self.micro_batch_size * self.gradient_accumulation_steps * world_size

    @property
    def resolved_fp8_scaling(self) -> str:
        """fp8_scaling, or tensorwise."""
        return self.fp8_scaling or "tensorwise"

    @model_validator(mode="after")
    def _one_length(self) -> TrainingConfig:
        if (self.max_steps is None) == (self.epochs is None):
            raise ValueError("set exactly one of training.max_steps or training.epochs")
        return self

    @model_validator(mode="after")
    def _selective_layers_left(self) -> TrainingConfig:
        if not self.selective_layers:
            return self
        if self.gradient_checkpointing and self.checkpoint_layers is None:
            raise ValueError(
                f"training.selective_layers: {self.selective_layers} with gradient_checkpointing on every layer: no "
                "layer is left to recompute selectively; set training.checkpoint_layers to the layers that recompute "
                "whole, or selective_layers: 0"
            )
        return self


class KernelsConfig(Section):
    """Which tigon kernels to apply to the model (see tigon.kernels.patching)."""

    enabled: bool = True
    rms_norm: bool = True
    rope: bool = True
    swiglu: bool = True
    fused_linear_cross_entropy: bool = Field(True, description="the training loss without materializing logits")
    skip_unlabelled: bool = Field(
        True,
        description="the fused losses (SFT's, the preference objectives' and distillation's) project only the "
        "positions whose next token has a label, skipping prompts and padding (the same loss and gradients, less "
        "work where prompts are masked); false projects every position",
    )
    loss_chunk_tokens: Literal["auto"] | PositiveInt = Field(
        "auto",
        description="tokens per chunk of the fused loss; auto: up to 4096 where the planner's estimate says the step's "
        "peak is elsewhere (fewer chunks, less time), else the op's own rule",
    )


class ParallelismConfig(Section):
    """How the model is spread over processes; rank and world size come from torchrun's environment."""

    strategy: Literal["ddp", "fsdp", "deepspeed"] = Field(
        "ddp", description="ddp: replicated model; fsdp: FSDP2 fully_shard; deepspeed: ZeRO (zero_stage)"
    )
    zero_stage: Literal[1, 2, 3] | None = Field(
        None,
        description="DeepSpeed ZeRO stage (strategy deepspeed only; default 2): 1 shards optimizer state, 2 also "
        "gradients, 3 also parameters",
    )
    cpu_offload: bool = Field(
        False,
        description="fsdp: parameters, gradients and optimizer step on the CPU; deepspeed: optimizer state and step "
        "on the CPU (ZeRO-3: parameters too)",
    )
    shard_size: int | Literal["node"] | None = Field(
        None,
        description="fsdp: shard each parameter over groups of this many ranks and replicate it across the groups "
        "(hybrid sharding): 'node' for the ranks of one node, so that only the gradients' once-a-step all-reduce "
        "crosses nodes; unset: over every rank",
    )
    accumulate_sharded: bool = Field(
        False,
        description="fsdp with gradient accumulation: reduce-scatter every micro-batch's gradients and accumulate "
        "each rank's shard, instead of holding the whole model's gradients unsharded in float32 until the step's "
        "last micro-batch; saves (1 - 1/shards) of those bytes for one reduce-scatter a micro-batch (the shards "
        "accumulate in model.dtype)",
    )
    copy_engine_gathers: bool = Field(
        False,
        description="fsdp on GPUs whose shard group sits on one node: gather the weights with the GPUs' copy "
        "engines out of symmetric memory instead of NCCL's kernels, which take SMs from the matrix products they "
        "overlap; the same bytes, so the same training",
    )
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: nccl on GPUs, gloo on CPUs")
    collective_timeout_minutes: float = Field(
        30,
        gt=0,
        description="how long a collective waits for the other ranks before the run fails: a rank that hangs (stuck "
        "I/O, a deadlock, a GPU that stopped answering) ends the job after this long, and a restart resumes from the "
        "newest checkpoint; keep it above the longest work one rank does while the others wait (rank 0's "
        "checkpoint checks and uploads)",
    )

    @model_validator(mode="after")
    def _zero_stage_with_deepspeed(self) -> ParallelismConfig:
        if self.zero_stage is not None and self.strategy != "deepspeed":
            raise ValueError(
                f"parallelism.zero_stage is a DeepSpeed setting and strategy is {self.strategy!r}, which would ignore "
                "it; set strategy: deepspeed, or remove zero_stage"
            )
        return self

    @model_validator(mode="after")
    def _shard_size_with_fsdp(self) -> ParallelismConfig:
        if self.shard_size is not None and self.strategy != "fsdp":
            raise ValueError(
                f"parallelism.shard_size is an FSDP2 setting and strategy is {self.strategy!r}, which would ignore "
                "it; set strategy: fsdp, or remove shard_size"
            )
        if isinstance(self.shard_size, int) and self.shard_size < 1:
            raise ValueError(f"parallelism.shard_size must be at least 1 (or 'node'), got {self.shard_size}")
        return self

    @model_validator(mode="after")
    def _accumulate_sharded_with_fsdp(self) -> ParallelismConfig:
        if self.accumulate_sharded and self.strategy != "fsdp":
            raise ValueError(
                f"parallelism.accumulate_sharded is an FSDP2 setting and strategy is {self.strategy!r}, which "
                "would ignore it (DeepSpeed ZeRO-2/3 always accumulate partitioned gradients; DDP keeps whole ones); "
                "set strategy: fsdp, or remove accumulate_sharded"
            )
        return self

    @model_validator(mode="after")
    def _copy_engine_gathers_with_fsdp(self) -> ParallelismConfig:
        if self.copy_engine_gathers and self.strategy != "fsdp":
            raise ValueError(
                f"parallelism.copy_engine_gathers replaces FSDP2's all-gathers and strategy is {self.strategy!r}; set "
                "strategy: fsdp, or remove copy_engine_gathers"
            )
        return self

    @model_validator(mode="after")
    def _offload_needs_sharding(self) -> ParallelismConfig:
        if self.cpu_offload and self.strategy == "ddp":
            raise ValueError(
                "parallelism.cpu_offload needs strategy 'fsdp' or 'deepspeed' (DDP keeps the whole model on each "
                "device); set one of those, or cpu_offload: false"
            )
        return self

    @property
    def stage(self) -> int:
        """The ZeRO stage DeepSpeed runs: `zero_stage`, else 2."""
        return self.zero_stage if self.zero_stage is not None else 2

    @property
    def shards_parameters(self) -> bool:
        """True when each rank holds only a shard of the weights, so every forward pass is a collective."""
        return self.strategy == "fsdp" or (self.strategy == "deepspeed" and self.stage == 3)


class LoraConfig(Section):
    """Low-rank adapters through peft; the base weights are frozen."""

    enabled: bool = False
    r: int = Field(8, gt=0)
    alpha: int = Field(16, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[Text] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    quantize_base: Literal["nf4", "fp4"] | None = Field(
        None,
        description="QLoRA: store the frozen base model's decoder Linear layers in 4 bits (bitsandbytes NF4 or FP4; "
        "embeddings, norms and the head stay in model.dtype); the adapters train in full precision",
    )
    double_quant: bool = Field(
        True, description="with quantize_base: quantize the 4-bit blocks' scales too (about 0.4 bits a weight less)"
    )

    @model_validator(mode="after")
    def _quantized_base_needs_adapters(self) -> LoraConfig:
        if self.quantize_base and not self.enabled:
            raise ValueError(
                f"lora.quantize_base: {self.quantize_base!r} freezes the base in 4 bits and trains LoRA adapters on "
                "it; set lora.enabled: true, or drop quantize_base"
            )
        return self


class HubPushConfig(Section):
    """Where the exported model goes on the Hugging Face Hub (the token comes from HF_TOKEN)."""

    repo_id: str = Field(description="the model repository, org/name; created if missing")
    private: bool = Field(True, description="create the repository private")
    revision: str | None = Field(None, description="branch to push to (created if missing); default main")


class CheckpointConfig(Section):
    """Full training state every N steps (atomic, last K kept), resume, and the exported model."""

    every_steps: int = Field(0, ge=0, description="0 turns periodic checkpoints off")
    keep_last: int = Field(2, gt=0)
    resume: bool = Field(
        True,
        description="continue from the newest checkpoint (that verifies) in the run directory, if any; false starts "
        "over, removing the earlier checkpoints",
    )
    overwrite: bool = Field(
        False,
        description="with resume: false, allow removing the checkpoints of a finished run (one that wrote "
        "summary.json, or whose export is in remote_dir); without it such a run directory is refused",
    )
    export: bool = Field(True, description="write the final model as a save_pretrained directory")
    merge_lora: bool = Field(True, description="merge LoRA adapters into the exported weights")
    remote_dir: Text | None = Field(
        None,
        description="fsspec URL (s3://, gs://, file://) that finished checkpoints and the export are copied to, "
        "and that resume fetches the newest checkpoint from; the workflow sets it on a cluster. Nodes that share "
        "no filesystem write their checkpoint shards there and resume from it",
    )
    async_save: bool = Field(
        False,
        description="write the sharded model and optimizer state in the background while training goes on "
        "(torch.distributed.checkpoint.async_save); needs parallelism.strategy fsdp and trainer torch",
    )
    push_to_hub: HubPushConfig | None = Field(
        None, description="push the export (a LoRA run's adapter too) with a model card to the Hub after training"
    )


class LoggingConfig(Section):
    """Where a run writes, and how often it reports."""

    run_dir: Text = Field("runs/default", description="checkpoints, metrics.jsonl, TensorBoard logs, loss curve")
    every_steps: int = Field(10, gt=0)
    tensorboard: bool = Field(True, description="TensorBoard logs in run_dir/tensorboard (when trackers is unset)")
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] | None = Field(
        None,
        description="experiment trackers every trainer logs to (config, metrics, loss plot, planner estimate); "
        "unset: tensorboard if logging.tensorboard",
    )
    project: str = Field("tigon", description="the wandb project and the MLflow experiment")
    mlflow_tracking_uri: str | None = Field(
        None, description="MLflow tracking server or store; default MLFLOW_TRACKING_URI, else MLflow's own default"
    )
    progress_bar: bool = True
    profile_step: int | None = Field(
        None,
        gt=0,
        description="profile this optimizer step (torch trainer): its time per kind of kernel in the summary and "
        "profile.json, and a Chrome trace (trace.json) in the run directory",
    )

    @property
    def active_trackers(self) -> list[str]:
        """The trackers a run logs to: `trackers`, else TensorBoard when `tensorboard` is on."""
        if self.trackers is not None:
            return list(dict.fromkeys(self.trackers))
        return ["tensorboard"] if self.tensorboard else []


class EvalConfig(Section):
    """Held-out evaluation during and after training."""

    every_steps: int = Field(0, ge=0, description="0: evaluate only at the end")
    max_batches: int | None = Field(None, gt=0)
    metrics: list[Literal["loss", "exact_match"]] = Field(default_factory=lambda: ["loss"])


class TeacherConfig(Section):
    """The frozen teacher of `objective.type: distill`, loaded as `model.path` is (a Hub id, a local or object-store
    directory); it must share the student's tokenizer vocabulary."""

    path: Text = Field(description="what from_pretrained loads: a Hub id (org/name), a local or object-store directory")
    revision: Text | None = Field(None, description="branch, tag or commit of a Hub id in path")
    cache_dir: Text | None = Field(None, description="where Hub and object-store downloads go; default: the HF cache")
    trust_remote_code: bool = Field(False, description="run modeling code shipped inside the teacher's repository")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="dtype of the teacher's weights; default model.dtype"
    )
    precompute: bool = Field(
        False,
        description="one pass of the teacher over the training and held-out data before training stores its final "
        "hidden states at the completion tokens and keeps only its head; training then reads them, so the teacher's "
        "layers never sit beside the student; costs host memory: completion tokens x hidden x 2 bytes (4 under "
        "training.precision fp32)",
    )

    def as_model(self, student: ModelConfig) -> ModelConfig:
        """The teacher as a `model` section: loaded, fetched and checked by the code that loads the student."""
        return ModelConfig(
            path=self.path,
            revision=self.revision,
            cache_dir=self.cache_dir,
            trust_remote_code=self.trust_remote_code,
            dtype=self.dtype or student.dtype,
            attn_implementation=student.attn_implementation,
        )


DpoLossType = Literal[
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero", "apo_down",
    "discopop", "sigmoid_norm", "aot", "aot_unpaired", "sft",
]  # fmt: skip
OBJECTIVE_SETTINGS = {  # objective setting -> the objectives it applies to
    "beta": ("dpo", "orpo", "simpo", "cpo", "kto", "distill"),
    "loss_type": ("dpo", "cpo", "simpo"),
    "loss_weights": ("dpo",),
    "rpo_alpha": ("dpo",),
    "label_smoothing": ("dpo", "cpo", "simpo"),
    "alpha": ("cpo", "simpo", "distill"),
    "temperature": ("distill",),
    "teacher": ("distill",),
    "gamma": ("simpo",),
    "desirable_weight": ("kto",),
    "undesirable_weight": ("kto",),
    "reference": ("dpo", "kto"),
}


class ObjectiveConfig(Section):
    """What the run optimizes: next-token prediction (sft), a preference loss on pairs (or KTO's labelled
    completions), or distillation from a frozen teacher (distill), computed by tigon's fused linear ops from the
    final hidden states."""

    type: Literal["sft", "dpo", "orpo", "simpo", "cpo", "kto", "distill"] = Field(
        "sft",
        description="sft: next-token loss on data.format; dpo/orpo/simpo/cpo: prompt/chosen/rejected pairs; "
        "kto: prompt/completion/label records; distill: objective.teacher's distribution on data.format's "
        "completion tokens, mixed with the next-token loss",
    )
    beta: float | None = Field(
        None,
        ge=0,
        description="preference objectives: the loss's temperature, default 0.1 (simpo: 2.0); distill: the "
        "generalized JSD's mix, 0 = KL(teacher || student) (forward KL), 1 = KL(student || teacher) (reverse KL), "
        "default 0.5; not for sft",
    )
    loss_type: DpoLossType | list[DpoLossType] = Field(
        "sigmoid",
        description="dpo: one of TRL's DPO loss types (sigmoid, hinge, ipo, exo_pair, nca_pair, robust, bco_pair, "
        "sppo_hard, apo_zero, apo_down, discopop, sigmoid_norm, aot, aot_unpaired, sft), or a list of them summed "
        "with loss_weights; "
        "cpo, simpo: sigmoid, -log sigmoid of the margin",
    )
    loss_weights: list[float] | None = Field(
        None, description="dpo: one weight per entry of a loss_type list (TRL's loss_weights); default 1 each"
    )
    rpo_alpha: float | None = Field(
        None, ge=0, description="dpo: adds rpo_alpha times the chosen completions' mean NLL (RPO, TRL's rpo_alpha)"
    )
    label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="dpo, cpo, simpo: conservative DPO's probability that a label is flipped (below 0.5); "
        "exo_pair's epsilon (between 0 and 1) and robust's (below 0.5)",
    )
    alpha: float | None = Field(
        None,
        ge=0,
        description="cpo, simpo: weight of the chosen completions' NLL (default cpo 1.0, simpo 0.0); distill: weight "
        "of the next-token cross entropy, the distillation loss weighs 1 - alpha (default 0.5)",
    )
    temperature: float = Field(1.0, gt=0, description="distill: both models' logits are divided by it before softmax")
    teacher: TeacherConfig | None = Field(None, description="distill: the frozen teacher model")
    gamma: float = Field(0.5, description="simpo: the target reward margin")
    desirable_weight: float = Field(1.0, ge=0, description="kto: weight of desirable completions' losses")
    undesirable_weight: float = Field(1.0, ge=0, description="kto: weight of undesirable completions' losses")
    reference: Literal["model", "precomputed", "none"] | None = Field(
        None,
        description="dpo, kto: the reference log-probs from a frozen copy of the starting model run beside it "
        "('model', the default), from one pass over the data before training ('precomputed'), or none (zero: "
        "reference-free DPO, TRL's reference_free)",
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, data: Any) -> Any:
        """`objective: dpo` is `objective: {type: dpo}`."""
        return {"type": data} if isinstance(data, str) else data

    @model_validator(mode="after")
    def _settings_of_the_objective(self) -> ObjectiveConfig:
        for name, applies in OBJECTIVE_SETTINGS.items():  # a default value is no setting (a dumped config has them all)
            if self.type not in applies and getattr(self, name) != type(self).model_fields[name].default:
                raise ValueError(
                    f"objective.{name} applies to {', '.join(applies)}, not to objective.type {self.type!r}; "
                    f"remove it or change the type"
                )
        self._check_loss_types()
        if self.type == "kto" and self.reference == "none":
            raise ValueError(
                "objective.reference: none is not available for kto (its loss needs reference log-probs); "
                "use 'model' or 'precomputed'"
            )
        if self.type == "distill" and self.teacher is None:
            raise ValueError("objective.type distill needs objective.teacher.path (a Hub id or a model directory)")
        if self.type == "distill" and self.resolved_beta > 1:
            raise ValueError(
                f"objective.beta {self.beta} mixes distill's two KL directions (0: forward, 1: reverse); set it "
                "between 0 and 1"
            )
        if self.type == "distill" and self.resolved_alpha > 1:
            raise ValueError(
                f"objective.alpha {self.alpha} weighs distill's cross entropy and 1 - alpha its distillation loss; "
                "set it between 0 and 1"
            )
        if self.type in ("dpo", "orpo", "simpo", "cpo", "kto") and self.beta == 0:
            raise ValueError(f"objective.beta must be greater than 0 for {self.type}")
        return self

    @property
    def loss_types(self) -> tuple[str, ...]:
        """loss_type as a tuple (one entry, or the list)."""
        return (self.loss_type,) if isinstance(self.loss_type, str) else tuple(self.loss_type)

    def _check_loss_types(self) -> None:
        """The loss types against the objective, their weights and label_smoothing, as the fused ops take them."""
        types = self.loss_types
        if not types:
            raise ValueError("objective.loss_type is an empty list; name one loss type, e.g. sigmoid")
        if self.type in ("cpo", "simpo") and types != ("sigmoid",):
            raise ValueError(
                f"objective.loss_type {self.loss_type!r}: {self.type} trains the sigmoid loss; other loss types "
                "are dpo's (objective.type: dpo)"
            )
        if self.loss_weights is not None and len(self.loss_weights) != len(types):
            raise ValueError(
                f"objective.loss_weights has {len(self.loss_weights)} entries for {len(types)} loss types; give one "
                "weight per entry of objective.loss_type"
            )
        smoothing = self.label_smoothing
        if "exo_pair" in types and not 0 < smoothing < 1:
            raise ValueError("objective.loss_type exo_pair needs 0 < label_smoothing < 1 (the EXO paper uses 1e-3)")
        if smoothing >= 0.5 and {"sigmoid", "robust"} & set(types):
            raise ValueError(
                f"objective.label_smoothing {smoothing}: the sigmoid and robust losses take a flip probability "
                "below 0.5"
            )

    @property
    def preference(self) -> bool:
        """True for the preference objectives: the data are preference records and the loss a fused preference op."""
        return self.type not in ("sft", "distill")

    @property
    def reference_source(self) -> str:
        """Where the reference log-probs come from: 'model', 'precomputed' or 'none'."""
        if self.type not in ("dpo", "kto"):
            return "none"
        return self.reference or "model"

    @property
    def resolved_beta(self) -> float:
        """beta, or the objective's default (SimPO's paper uses 2.0, distill TRL's GKD 0.5, the others TRL's 0.1)."""
        if self.beta is not None:
            return self.beta
        return {"simpo": 2.0, "distill": 0.5}.get(self.type, 0.1)

    @property
    def resolved_alpha(self) -> float:
        """alpha, or the objective's default (TRL's cpo_alpha 1.0 for cpo, 0.0 for simpo, 0.5 for distill)."""
        if self.alpha is not None:
            return self.alpha
        return {"cpo": 1.0, "distill": 0.5}.get(self.type, 0.0)


class RunConfig(Section):
    """Everything one training run needs."""

    name: Text = "run"
    model: ModelConfig
    data: DataConfig
    training: TrainingConfig
    kernels: KernelsConfig = Field(default_factory=KernelsConfig)
    trainer: Literal["torch", "hf", "lightning"] = "torch"
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)

    @model_validator(mode="after")
    def _profile_with_the_torch_trainer(self) -> RunConfig:
        if self.logging.profile_step is not None and self.trainer != "torch":
            raise ValueError(
                f"logging.profile_step profiles a step of the torch trainer, not trainer: {self.trainer!r}; set "
                "trainer: torch, or drop logging.profile_step and use the HF Trainer's or Lightning's own profiler"
            )
        return self

    @model_validator(mode="after")
    def _preference_rows_padded_unless_packing_is_set(self) -> RunConfig:
        """Preference pairs keep TRL's padded rows unless `data.packing: true` is written (the default packs SFT)."""
        if self.objective.preference and "packing" not in self.data.model_fields_set:
            self.data.packing = False
        return self

    @model_validator(mode="after")
    def _compile_without_zero3(self) -> RunConfig:
        if self.training.compile and self.parallelism.strategy == "deepspeed" and self.parallelism.stage == 3:
            raise ValueError(
                "training.compile with DeepSpeed ZeRO-3: its engine gathers each submodule's weights in hooks that "
                "torch.compile cannot trace, so every layer would break into pieces; set parallelism.strategy: "
                "fsdp (sharded weights, compiled layers), zero_stage 1 or 2, or training.compile: false"
            )
        return self

    @model_validator(mode="after")
    def _fp8_where_it_runs(self) -> RunConfig:
        training = self.training
        if training.precision != "fp8":
            for name, unset in (
                ("fp8_scaling", training.fp8_scaling is None),
                ("fp8_layers", training.fp8_layers == "auto"),
            ):
                if not unset:
                    raise ValueError(
                        f"training.{name} applies to precision fp8, not {training.precision!r}; set "
                        f"training.precision: fp8, or remove {name}"
                    )
            return self
        problems = {
            "training.fp8_layers tigon and fp8_scaling rowwise": (
                training.fp8_layers == "tigon" and training.resolved_fp8_scaling == "rowwise",
                "tigon's FP8 layers scale per tensor; set fp8_scaling: tensorwise, or fp8_layers: auto for torchao's "
                "rowwise layers",
            ),
            "lora.enabled": (self.lora.enabled, "FP8 trains full weights; LoRA's frozen base gains nothing"),
            "parallelism.strategy deepspeed": (
                self.parallelism.strategy == "deepspeed",
                "DeepSpeed's engine casts the model itself; use strategy ddp or fsdp",
            ),
            f"trainer {self.trainer!r}": (self.trainer != "torch", "FP8 runs in the torch trainer; set trainer: torch"),
            "model.dtype float16": (
                self.model.dtype == "float16",
                "everything outside the FP8 matmuls runs in bf16; set model.dtype: bfloat16 or float32",
            ),
            "training.compile false": (
                not training.compile,
                "FP8 layers run compiled (torchao's casts are fast only fused; q, k and v share one cast of their "
                "input only in a compiled graph); set training.compile: true",
            ),
            f"data.max_seq_len {self.data.max_seq_len}": (
                self.data.max_seq_len % 16 != 0,
                "FP8 matmuls take the tokens of a micro-batch in multiples of 16; set data.max_seq_len to a "
                "multiple of 16",
            ),
        }
        for setting, (present, fix) in problems.items():
            if present:
                raise ValueError(f"training.precision: fp8 with {setting}: {fix}")
        return self

    @model_validator(mode="after")
    def _selective_without_4_bits(self) -> RunConfig:
        if self.training.selective_layers and self.lora.quantize_base:
            raise ValueError(
                "training.selective_layers with lora.quantize_base: a 4-bit layer's matmul is bitsandbytes' own op, "
                "whose output selective recomputation cannot keep; use gradient_checkpointing instead"
            )
        return self

    @model_validator(mode="after")
    def _async_save_with_fsdp(self) -> RunConfig:
        if self.checkpoint.async_save and (self.parallelism.strategy != "fsdp" or self.trainer != "torch"):
            raise ValueError(
                "checkpoint.async_save writes FSDP2's sharded checkpoint in the background, which needs "
                f"parallelism.strategy: fsdp and trainer: torch (this run has strategy {self.parallelism.strategy!r}, "
                f"trainer {self.trainer!r}); set those, or checkpoint.async_save: false"
            )
        return self


class ConfigError(ValueError):
    """A config file that cannot be loaded; the message lists every problem with its key path."""


def _suggestion(location: tuple, model: type[BaseModel]) -> str:
    """' (did you mean X?)' for a misspelt key, found by walking the models along its path."""
    current: Any = model
    for part in location[:-1]:
        field = getattr(current, "model_fields", {}).get(part)
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        current = annotation
    names = list(getattr(current, "model_fields", {}))
    close = difflib.get_close_matches(str(location[-1]), names, n=1)
    return f" (did you mean '{close[0]}'?)" if close else f" (valid keys: {', '.join(names)})"


def format_errors(
    error: ValidationError, source: str, model: type[BaseModel] | None = None, what: str = "config"
) -> str:
    """Every validation problem on its own line, with its key path and, for unknown keys, a suggestion."""
    model = model or RunConfig
    lines = [f"invalid {what} {source}:"]
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            lines.append(f"  {path}: unknown key{_suggestion(item['loc'], model)}")
        else:
            lines.append(f"  {path}: {item['msg']} (got {item.get('input')!r})")
    return "\n".join(lines)


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe YAML 1.1, plus YAML 1.2's floats without a dot (`1e-4`), which 1.1 leaves as strings."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"), list("-+0123456789.")
)


def read_yaml(text: str) -> Any:
    """Parse YAML as config files are read (types are strict, so `learning_rate: 1e-4` must be a number)."""
    return yaml.load(text, Loader=_YamlLoader)


def apply_override(raw: dict, override: str) -> None:
    """Set `a.b.c=value` in a raw config dict; the value is parsed as YAML (numbers, booleans, lists)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like key.path=value, e.g. training.max_steps=20")
    key, value = override.split("=", 1)
    node = raw
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {part} is not a section")
    node[parts[-1]] = read_yaml(value)


def parse_config(raw: dict, source: str = "<dict>") -> RunConfig:
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as error:
        raise ConfigError(format_errors(error, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Read a YAML config, apply `key.path=value` overrides, and validate it."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config path {path} is a directory; give a YAML file in it (examples: examples/*.yaml)")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist (examples: examples/*.yaml)")
    try:
        raw = read_yaml(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    for override in overrides or []:
        apply_override(raw, override)
    return parse_config(raw, str(path))


def json_schema() -> str:
    """The JSON schema of the config file, for editors (`tigon schema > tigon.schema.json`)."""
    return json.dumps(RunConfig.model_json_schema(), indent=2)
