"""Model building, shared by every trainer: load or build, kernels, gradient checkpointing, LoRA.

    model = build_model(config, vocab_size=len(tokenizer), tokenizer=tokenizer)

`model.path` loads a Hub id, a local `from_pretrained` directory or an object-store copy of one
(`tigon.runtime.hub`); `model.config_name` builds a randomly initialized model from a transformers config
(`config_overrides` inline). Then tigon's kernels are applied per `config.kernels` (the PatchReport is
logged and kept on `model.tigon_patch_report`), the base is stored in 4 bits for QLoRA
(`lora.quantize_base`, `tigon.runtime.quantization`), gradient checkpointing is turned on if asked, the decoder layers'
Linear layers train in FP8 under `training.precision: fp8` (`tigon.runtime.fp8`), LoRA
adapters are added through peft when `lora.enabled`, and each decoder layer is compiled when `training.compile`.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import importlib.util
import logging

import torch
from torch import nn

from tigon.runtime import planner
from tigon.runtime.attention import transformers_name
from tigon.runtime.config import ConfigError, RunConfig, TrainingConfig
from tigon.runtime.dtypes import torch_dtype
from tigon.runtime.fp8 import convert_to_fp8
from tigon.runtime.hub import model_directory
from tigon.runtime.mamba_scan import check_mamba_scan, fast_path_installed
from tigon.runtime.model_types import TEXT_CONFIG, auto_model_class, sub_config_class, text_overrides
from tigon.runtime.quantization import quantize_base
from tigon.runtime.recompute import check_model, checkpointed_forward, enable_selective_recomputation

logger = logging.getLogger("tigon.runtime")


def _check_attention(config: RunConfig) -> None:
    if config.model.attn_implementation == "flex_attention" and not torch.cuda.is_available():
        raise ConfigError(
            "model.attn_implementation: 'flex_attention' needs a CUDA GPU (PyTorch's flex attention has no "
            "backward on the CPU); use 'auto' or 'varlen'"
        )
    if config.model.attn_implementation != "flash_attention_2":
        return
    import importlib.util

    if not torch.cuda.is_available() or importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(
            "model.attn_implementation: 'flash_attention_2' needs a CUDA GPU and the flash-attn package; "
            "use 'sdpa' (PyTorch's fused attention) instead"
        )
    if config.model.dtype == "float32":
        raise ConfigError("model.attn_implementation: 'flash_attention_2' needs model.dtype bfloat16 or float16")


def _gpu_bytes() -> int | None:
    """The current GPU's memory, None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _special_token_ids(tokenizer) -> dict[str, int]:
    ids = {}
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if value is not None:
            ids[name] = value
    return ids


def load_pretrained(config: RunConfig, vocab_size: int, tokenizer=None, weights: bool = True) -> nn.Module:
    """`from_pretrained` on `model.path` (a Hub id, a local or object-store directory); the embeddings grow if
    the tokenizer is larger. A vision-language model loads as its `*ForConditionalGeneration` class
    (`tigon.runtime.model_types`).

    A Hub id or URL is resolved from the cache when `tigon.runtime.hub.fetch_model` fetched it already, else
    downloaded here. `weights=False` builds the model from its config without reading its weights (the shapes,
    for a rank that builds on the meta device and receives rank 0's weights).
    """
    from transformers import AutoConfig

    path = model_directory(config.model)
    trust = config.model.trust_remote_code
    options = dict(
        dtype=torch_dtype(config.model.dtype),
        attn_implementation=transformers_name(config.model.attn_implementation),
        trust_remote_code=trust,
    )
    try:
        model_config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
        auto_class = auto_model_class(model_config.model_type)
        if weights:
            model = auto_class.from_pretrained(path, config=model_config, **options)
        else:
            model = auto_class.from_config(model_config, **options)
    except ValueError as error:
        if "trust_remote_code" not in str(error):
            raise
        raise ConfigError(
            f"model.path: {config.model.path} ships its own modeling code; read it, then set "
            "model.trust_remote_code: true to run it"
        ) from None
    embeddings = model.get_input_embeddings().weight.shape[0]
    if vocab_size > embeddings:
        logger.info("resizing the embeddings from %d to the tokenizer's %d tokens", embeddings, vocab_size)
        model.resize_token_embeddings(vocab_size, mean_resizing=weights)  # the mean needs values
    return model


def config_fields(config_class: type) -> set[str]:
    """The fields a transformers config class knows: its and PretrainedConfig's arguments, its defaults' keys and
    its attribute aliases."""
    import inspect

    from transformers import PretrainedConfig

    known = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}))
    for cls in (config_class, PretrainedConfig):
        known |= {name for name in inspect.signature(cls.__init__).parameters if name not in ("self", "kwargs")}
    return known


def check_model_config(config: RunConfig) -> None:
    """Mistakes in `model.config_overrides` that transformers would take silently or report obscurely: a key close
    to a known field's name (a typo; transformers would keep it as an unused attribute), a language model's field
    outside the `text_config` of a config that nests one, and head counts that do not divide the widths. An unknown
    key unlike any field is kept, with a warning. The sub-configs given (`text_config`, `vision_config`) are checked
    alike."""
    name = config.model.config_name
    if name is None:
        return
    from transformers import CONFIG_MAPPING

    if name not in CONFIG_MAPPING:
        close = difflib.get_close_matches(name, list(CONFIG_MAPPING.keys()), n=1)
        hint = f"did you mean '{close[0]}'?" if close else "a transformers model_type such as 'llama'"
        raise ConfigError(f"model.config_name: unknown model type {name!r} ({hint})")
    config_class = CONFIG_MAPPING[name]
    overrides = config.model.config_overrides
    _check_overrides(config_class, overrides, "model.config_overrides")
    try:
        built = config_class(**copy.deepcopy(overrides))
    except Exception as error:  # transformers' own validation (strict dataclasses in 5.x), named with the key
        raise ConfigError(f"model.config_overrides: {config_class.__name__} rejects them: {error}") from None
    _warn_unknown(config_class, overrides, built, "model.config_overrides")


def _check_overrides(config_class: type, overrides: dict, where: str) -> None:
    """`check_model_config`'s errors for one config class's overrides, then for each sub-config given."""
    known = config_fields(config_class)
    sub_configs = getattr(config_class, "sub_configs", {})
    text_fields = set()
    if TEXT_CONFIG in sub_configs:
        text_fields = config_fields(sub_config_class(config_class, TEXT_CONFIG, overrides.get(TEXT_CONFIG) or {}))
    for key in overrides:
        if key not in known and key in text_fields:
            raise ConfigError(
                f"{where}.{key}: {config_class.__name__} keeps its language model's fields in {TEXT_CONFIG}; write "
                f"it as {where}.{TEXT_CONFIG}.{key}"
            )
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
        if key not in known and close:
            raise ConfigError(
                f"{where}.{key}: not a field of {config_class.__name__} (did you mean '{close[0]}'?); "
                "transformers would keep it as an attribute no layer reads"
            )
    values = {**config_class().to_dict(), **overrides}
    hidden, heads, kv_heads = (values.get(k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads"))
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and overrides.get("head_dim") is None:
        if hidden % heads:
            raise ConfigError(
                f"{where}: hidden_size {hidden} is not divisible by num_attention_heads {heads}, so "
                "the heads cannot split it; pick hidden_size = num_attention_heads x head size (e.g. "
                f"{heads * max(1, round(hidden / heads))}), or set head_dim"
            )
    if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 and heads % kv_heads:
        raise ConfigError(
            f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
            f"{kv_heads}; each key/value head must serve the same number of query heads"
        )
    for sub_name in sub_configs:
        sub = overrides.get(sub_name)
        if sub is not None and not isinstance(sub, dict):
            raise ConfigError(f"{where}.{sub_name}: a mapping of config fields, not {type(sub).__name__} ({sub!r})")
        if sub is not None:
            _check_overrides(sub_config_class(config_class, sub_name, sub), sub, f"{where}.{sub_name}")


def _warn_unknown(config_class: type, overrides: dict, built, where: str) -> None:
    """Warn of each override key that is no field and that transformers kept as a plain attribute, in the config and
    in each sub-config given."""
    known = config_fields(config_class)
    sub_configs = getattr(config_class, "sub_configs", {})
    for key, value in overrides.items():
        if key in sub_configs and isinstance(value, dict) and getattr(built, key, None) is not None:
            _warn_unknown(sub_config_class(config_class, key, value), value, getattr(built, key), f"{where}.{key}")
        elif key not in known and key in vars(built):  # kept as is, not taken up under another name (rope_theta)
            logger.warning(
                "%s.%s is not a field of %s; transformers keeps it as an attribute, which the model may not read",
                where,
                key,
                config_class.__name__,
            )


def build_from_config(config: RunConfig, vocab_size: int, tokenizer=None) -> nn.Module:
    """A randomly initialized model from `AutoConfig.for_model(config_name, **config_overrides)`: a causal LM, or
    a vision-language model's `*ForConditionalGeneration` (`tigon.runtime.model_types`), whose language model
    takes the tokenizer's vocabulary and special tokens in its `text_config`."""
    from transformers import CONFIG_MAPPING, AutoConfig

    name = config.model.config_name
    overrides = copy.deepcopy(dict(config.model.config_overrides))
    text, where = text_overrides(CONFIG_MAPPING[name], overrides) if name in CONFIG_MAPPING else (overrides, "")
    if text.get("vocab_size", vocab_size) < vocab_size:
        raise ConfigError(
            f"model.config_overrides{where}.vocab_size: {text['vocab_size']} is smaller than the tokenizer's "
            f"{vocab_size} tokens; remove it (the tokenizer's size is used) or raise it"
        )
    text.setdefault("vocab_size", vocab_size)
    for key, value in _special_token_ids(tokenizer).items():
        text.setdefault(key, value)
    try:
        model_config = AutoConfig.for_model(name, **overrides)
    except (ValueError, KeyError) as error:
        raise ConfigError(f"model.config_name / config_overrides: {error}") from None
    limit = getattr(model_config.get_text_config(), "max_position_embeddings", None)
    if limit is not None and config.data.max_seq_len > limit:
        raise ConfigError(
            f"data.max_seq_len: {config.data.max_seq_len} is longer than the model's max_position_embeddings "
            f"({limit}); lower it or set model.config_overrides{where}.max_position_embeddings"
        )
    return auto_model_class(model_config.model_type).from_config(
        model_config,
        dtype=torch_dtype(config.model.dtype),
        attn_implementation=transformers_name(config.model.attn_implementation),
    )


def apply_kernels(model: nn.Module, config: RunConfig, check_targets: bool = True):
    """tigon's kernels per `config.kernels`; returns the PatchReport (None when disabled). `check_targets=False`: the
    fused loss does not check its labels on the device (they were checked on the host)."""
    kernels = config.kernels
    if not kernels.enabled:
        logger.info("tigon kernels disabled (kernels.enabled: false)")
        return None
    from tigon.kernels.patching import apply

    return apply(  # logs its report
        model,
        rms_norm=kernels.rms_norm,
        rope=kernels.rope,
        swiglu=kernels.swiglu,
        fused_linear_cross_entropy=kernels.fused_linear_cross_entropy,
        loss_chunk_tokens=loss_chunk_tokens(model, config),
        check_targets=check_targets,
    )


def loss_chunk_tokens(model: nn.Module, config: RunConfig) -> int | None:
    """`kernels.loss_chunk_tokens`, with "auto" resolved by the planner for this model's shape (None: the op's rule)."""
    chunk = config.kernels.loss_chunk_tokens
    if chunk != "auto":
        return chunk
    from tigon.kernels.patching import FAMILIES

    if not config.kernels.fused_linear_cross_entropy or getattr(model.config, "model_type", None) not in FAMILIES:
        return None  # no fused loss to size (a family outside the kernel table keeps its own loss)
    shape = planner.ModelShape.from_hf_config(model.config)
    if not shape.counts(language_model_parameters(model)):
        return None  # the planner does not model this shape, so it cannot say where the step peaks
    work = planner.workload(config, shape=shape)
    chunk = planner.loss_chunk_tokens(work, planner.setting_of(config))
    if chunk is not None:
        logger.info("fused loss: %d-token chunks (the planner puts the step's peak elsewhere)", chunk)
    return chunk


def add_lora(model: nn.Module, config: RunConfig) -> nn.Module:
    """Wrap in a peft LoRA model; only the adapters train."""
    from peft import LoraConfig, get_peft_model

    lora = config.lora
    present = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [name for name in lora.target_modules if name not in present]
    if missing:
        raise ConfigError(
            f"lora.target_modules: {missing} not found in the model; some module names it has: "
            f"{sorted(n for n in present if n.endswith('proj'))[:12]}"
        )
    peft_config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, peft_config)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("LoRA r=%d: %d of %d parameters train (%.2f%%)", lora.r, trainable, total, 100 * trainable / total)
    return model


def enable_activation_checkpointing(model: nn.Module, layers: int | None = None) -> None:
    """Recompute decoder layers' activations in the backward (non-reentrant checkpointing): every layer, or the
    first `layers` of them (the others keep their activations: less recompute where memory allows)."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(
            f"training.gradient_checkpointing: {type(model).__name__} does not support it; set it to false"
        )
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if layers is None:
        return
    found = required_layers(model, "training.checkpoint_layers", "remove it to checkpoint every layer")
    for layer in found[layers:]:
        layer.gradient_checkpointing = False


def enable_selective_layers(model: nn.Module, training: TrainingConfig) -> None:
    """Recompute only the element-wise work of `training.selective_layers` decoder layers, those after the ones
    full checkpointing takes (`tigon.runtime.recompute`)."""
    check_model(model)
    layers = required_layers(model, "training.selective_layers", "set training.selective_layers: 0")
    first = training.checkpoint_layers if training.gradient_checkpointing else 0
    count = enable_selective_recomputation(layers[first : first + training.selective_layers], training.compile)
    logger.info("selective recomputation: %d decoder layers keep their matmul and attention outputs", count)


def checkpointable_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers: transformers' GradientCheckpointingLayer instances, in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def required_layers(model: nn.Module, setting: str, fix: str) -> list[nn.Module]:
    """`checkpointable_layers` for a `setting` that acts on decoder layers one by one; a ConfigError with `fix`
    where the model has none."""
    layers = checkpointable_layers(model)
    if not layers:
        raise ConfigError(
            f"{setting}: {type(model).__name__} has no decoder layers that transformers marks as such "
            f"(GradientCheckpointingLayer) in this version; {fix}"
        )
    return layers


def compile_decoder_layers(model: nn.Module, backend: str) -> int:
    """`torch.compile` each decoder layer in place (`nn.Module.compile`: parameter names and the state dict stay as
    they are); returns how many. One layer at a time, as torchtitan does: every layer of a model runs the same code,
    so one compiled graph serves them all, and the embeddings, the head and the loss stay eager. tigon's kernels
    are custom ops, so a patched layer compiles without a graph break. A checkpointed layer's checkpoint moves into
    its forward, inside the graph, on every transformers release (`recompute.checkpointed_forward`); FSDP2, applied
    after this, shards each compiled layer."""
    layers = required_layers(model, "training.compile", "set training.compile: false")
    if backend == "aot_eager" and has_gated_deltanet(model) and not softplus_backward_strides_agree():
        raise ConfigError(
            "training.compile_backend: aot_eager runs the traced graph on PyTorch's own kernels, and this PyTorch's "
            "compile-time softplus_backward lays its output out unlike its kernel, which fails the backward of "
            f"{model.config.get_text_config().model_type}'s Gated DeltaNet layers; set training.compile_backend: "
            "inductor (which generates that code itself) or training.compile: false"
        )
    for layer in layers:
        if layer.gradient_checkpointing:
            layer.gradient_checkpointing = False
            layer.forward = checkpointed_forward(layer.forward, selective=False)
        layer.compile(backend=backend)
    return len(layers)


def has_gated_deltanet(model: nn.Module) -> bool:
    """Whether the model's decoder has Gated DeltaNet (linear attention) layers: Qwen3-Next, Qwen3.5."""
    return "linear_attention" in (getattr(model.config.get_text_config(), "layer_types", None) or ())


def softplus_backward_strides_agree() -> bool:
    """Whether PyTorch's compile-time (fake) softplus_backward gives its output its kernel's strides when the
    gradient and the input are laid out differently, as in a Gated DeltaNet layer's backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    grad, x = torch.randn(2, 3, 4), torch.randn(2, 4, 3).transpose(1, 2)
    real = torch.ops.aten.softplus_backward(grad, x, 1.0, 20.0)
    with FakeTensorMode() as mode:
        fake = torch.ops.aten.softplus_backward(mode.from_tensor(grad), mode.from_tensor(x), 1.0, 20.0)
    return real.stride() == fake.stride()


def build_model(
    config: RunConfig,
    vocab_size: int,
    tokenizer=None,
    meta: bool = False,
    device: torch.device | None = None,
    labels_checked: bool = False,
) -> nn.Module:
    """The model a run trains, in `model.dtype`, on the CPU unless `device` or `meta` say otherwise.

    `device`: where a randomly initialized model is built and initialized (a pretrained one is still loaded
    on the CPU); on a GPU this takes a second where the CPU's one thread under `torchrun` takes minutes for
    billions of parameters. `meta=True` builds it on the meta device: shapes without memory or
    initialization, for the FSDP2 ranks that receive rank 0's weights once the model is sharded
    (`tigon.runtime.parallel.FSDPStrategy`). `labels_checked`: the caller checked every label of its data against
    the vocabulary on the host (`tigon.runtime.data.check_labels`), so the fused loss skips its own check, a device
    sync each forward that would keep the host from running ahead of the GPU.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    _check_attention(config)
    if meta:
        where = torch.device("meta")
    elif device is not None and config.model.path is None:
        where = torch.device(device)
    else:
        where = contextlib.nullcontext()
    with where:
        if config.model.path is not None:
            model = load_pretrained(config, vocab_size, tokenizer, weights=not meta)
        else:
            model = build_from_config(config, vocab_size, tokenizer)
        check_mamba_scan(model.config, config, _gpu_bytes(), _transformers_version(), fast_path_installed())
        model.tigon_patch_report = apply_kernels(model, config, check_targets=not labels_checked)
        if config.lora.quantize_base and not meta:
            quantize_base(model, config, device)
        if config.training.precision == "fp8":
            model.tigon_fp8_layers = convert_to_fp8(model, config, checkpointable_layers(model))
        if config.training.gradient_checkpointing:
            enable_activation_checkpointing(model, config.training.checkpoint_layers)
        if config.training.selective_layers:
            enable_selective_layers(model, config.training)
        if config.lora.enabled:
            model = add_lora(model, config)
        if config.training.compile:
            count = compile_decoder_layers(model, config.training.compile_backend)
            logger.info("torch.compile (%s): %d decoder layers", config.training.compile_backend, count)
        else:
            _hint_compile(model)
    return model


def _hint_compile(model: nn.Module) -> None:
    """Say so when a layer runs as separate eager operations that compiled layers would fuse: softcapped attention
    scores (Gemma 2), which SDPA does not take, and Gated DeltaNet layers without flash-linear-attention's kernels
    (transformers' PyTorch recurrence: Qwen3-Next, Qwen3.5)."""
    text = model.config.get_text_config()
    if getattr(text, "attn_logit_softcapping", None) and model.config._attn_implementation == "eager":
        logger.info(
            "%s: attention softcaps its scores and runs as separate eager operations; training.compile: true "
            "fuses them (1.5x the tokens/s at less memory for Gemma-2-2B on an H200, docs/benchmarks.md)",
            text.model_type,
        )
    if has_gated_deltanet(model) and importlib.util.find_spec("fla") is None:
        logger.info(
            "%s: its Gated DeltaNet layers run transformers' PyTorch recurrence (flash-linear-attention is not "
            "installed); training.compile: true fuses it (1.69x the tokens/s on Qwen3.5's default widths on an H200, "
            "at 23%% more memory, docs/benchmarks.md)",
            text.model_type,
        )


def language_model_parameters(model: nn.Module) -> int:
    """The parameters of the language model: its decoder and output head (a vision tower's left out), tied ones
    once; every parameter for a model without transformers' `get_decoder`."""
    if not hasattr(model, "get_decoder"):
        return sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings()
    parts = [*model.get_decoder().parameters(), *(head.parameters() if head is not None else ())]
    return sum(p.numel() for p in {id(p): p for p in parts}.values())


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())
