"""QLoRA: the frozen base model's decoder Linear layers in 4 bits (bitsandbytes), LoRA adapters trained on top.

    lora: {enabled: true, quantize_base: nf4}

`quantize_base` swaps every `nn.Linear` of the model except the output head for a bitsandbytes `Linear4bit`
holding the same weights quantized (NF4 or FP4, blocks of 64, the blocks' scales quantized again with
`double_quant`), on the device the run trains on. Embeddings, norms and the head stay in `model.dtype`, so
tigon's kernels (RMSNorm, RoPE, the gated MLP's activation, the fused linear cross entropy on the head) run as
they do without quantization; each 4-bit layer dequantizes its weight block by block inside its own matmul.
peft then wraps the targeted layers with adapters. Working on the built model rather than through
`from_pretrained(quantization_config=...)` makes one path for Hub models and for models built from a config.

The merged export (`checkpoint.merge_lora`) is dense: each base weight is dequantized and its adapter's update
added in `model.dtype` (`merge_into_dense`); merging into the 4-bit weights would round most of the update away.
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from tigon.runtime.config import ConfigError, RunConfig
from tigon.runtime.dtypes import torch_dtype

logger = logging.getLogger("tigon.runtime")

BLOCK = 64  # weights per 4-bit block, each with its own scale


def check_quantized_base(config: RunConfig) -> None:
    """A 4-bit base runs under DDP (or one process) with bitsandbytes installed."""
    if not config.lora.quantize_base:
        return
    if config.parallelism.strategy != "ddp":
        raise ConfigError(
            f"lora.quantize_base with parallelism.strategy {config.parallelism.strategy!r}: a 4-bit base is "
            "replicated, not sharded (it is already a quarter of its bf16 size); use strategy 'ddp'"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(
            "lora.quantize_base needs bitsandbytes: pip install 'tigon[qlora]' (or bitsandbytes), or drop quantize_base"
        )


def compute_dtype(config: RunConfig) -> torch.dtype:
    """The dtype a 4-bit layer computes in: the autocast dtype under bf16/fp16 precision, else the model's."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.training.precision) or torch_dtype(
        config.model.dtype
    )


def _parent(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (model.get_submodule(path) if path else model), leaf


def quantize_base(model: nn.Module, config: RunConfig, device: torch.device | None = None) -> int:
    """Swap the model's Linear layers (all but the output head) for 4-bit ones, quantized on `device` (default:
    where each weight is); returns how many."""
    import bitsandbytes as bnb

    head = model.get_output_embeddings()
    names = [name for name, module in model.named_modules() if type(module) is nn.Linear and module is not head]
    for name in names:
        linear = model.get_submodule(name)
        where = torch.device(device) if device is not None else linear.weight.device
        if where.type == "cpu" and linear.in_features % BLOCK:
            raise ConfigError(
                f"lora.quantize_base on the CPU: {name} has {linear.in_features} inputs, not a multiple of "
                f"{BLOCK}, and bitsandbytes' CPU kernels quantize rows in whole blocks of {BLOCK} (they would "
                "return wrong weights); train on a GPU, or drop quantize_base"
            )
        quantized = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=compute_dtype(config),
            compress_statistics=config.lora.double_quant,
            quant_type=config.lora.quantize_base,
            device="meta",
        )
        quantized.weight = bnb.nn.Params4bit(
            linear.weight.detach(),
            requires_grad=False,
            compress_statistics=config.lora.double_quant,
            quant_type=config.lora.quantize_base,
            module=quantized,
        )._quantize(where)
        if linear.bias is not None:
            quantized.bias = nn.Parameter(linear.bias.detach().to(where), requires_grad=False)
        parent, leaf = _parent(model, name)
        setattr(parent, leaf, quantized)
    logger.info("QLoRA: %d Linear layers stored in 4 bits (%s)", len(names), config.lora.quantize_base)
    return len(names)


def is_quantized(model: nn.Module) -> bool:
    """Whether any layer of the model holds 4-bit weights."""
    return any(type(p).__name__ == "Params4bit" for p in model.parameters())


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """A Linear layer's weight in full precision: dequantized for a 4-bit one."""
    weight = linear.weight
    if type(weight).__name__ != "Params4bit":
        return weight.detach()
    import bitsandbytes as bnb

    return bnb.functional.dequantize_4bit(weight.data, weight.quant_state)


def merge_into_dense(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The peft model's base with every adapter merged into dequantized weights, as plain `nn.Linear` layers in
    `dtype` (in place; call after training). Returns the base transformers model."""
    base = model.get_base_model()
    for name, module in list(base.named_modules()):
        if not hasattr(module, "base_layer") or not hasattr(module, "get_delta_weight"):
            continue
        weight = dense_weight(module.base_layer).float()
        for adapter in module.active_adapters:
            weight = weight + module.get_delta_weight(adapter).float()
        parent, leaf = _parent(base, name)
        setattr(parent, leaf, _dense_linear(weight, module.base_layer.bias, dtype))
    for name, module in list(base.named_modules()):
        if type(getattr(module, "weight", None)).__name__ == "Params4bit":
            parent, leaf = _parent(base, name)
            setattr(parent, leaf, _dense_linear(dense_weight(module).float(), module.bias, dtype))
    return base


def _dense_linear(weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().to(dtype), requires_grad=False)
    return linear
