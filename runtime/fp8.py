"""FP8 matrix products for `training.precision: fp8`.

    names = convert_to_fp8(model, config, layers)  # before compile and FSDP2, as torchao asks

The decoder layers' Linear layers compute their products in FP8 with dynamic scales (per tensor or per row,
`training.fp8_scaling`) on the GPU's FP8 tensor cores. Everything else (embeddings, norms, RoPE, the gated
activation, attention, the head and the fused loss) runs under bf16 autocast, as in `precision: bf16`. The head
stays a plain Linear because the fused loss reads its weight directly. FP8 matmuls need both dimensions to be
multiples of 16, so other layers are skipped.

With tensorwise scaling the layers become tigon's `FP8Linear` (`tigon.kernels.ops.fp8_linear`): torchao's
numbers, with casts that write each operand and its transpose in one pass and keep the input's FP8 transpose for
the backward (the attention output projection keeps its input, which attention keeps anyway). Rowwise scaling,
and tensorwise under FSDP2, take torchao's `Float8Linear`: under FSDP2 it casts the weights to FP8 before the
all-gather (half the bytes of bf16), and `precompute_scales` computes every weight's scale in one all-reduce
after the optimizer step. `training.fp8_layers` picks either everywhere (tigon's all-gather bf16 weights).

`TIGON_FP8_EMULATE=1` is for tests only: it lets a machine without an FP8 GPU run FP8 (torchao emulates its
matmuls in higher precision; tigon's run on the CPU's own `torch._scaled_mm`).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
from torch import nn

from tigon.kernels.modules import FP8Linear
from tigon.runtime.config import ConfigError, RunConfig

logger = logging.getLogger("tigon.runtime")

EMULATE_VARIABLE = "TIGON_FP8_EMULATE"
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores
#: projections that read the attention kernel's output, which the kernel keeps for its own backward: their FP8 layer
#: keeps that input too, not an FP8 copy of it (the planner counts no copy)
ATTENTION_OUTPUT_PROJECTIONS = {"o_proj", "out_proj"}


def emulated() -> bool:
    """Whether FP8 matmuls are emulated (tests on machines without an FP8 GPU)."""
    return os.environ.get(EMULATE_VARIABLE) == "1"


def check_device() -> None:
    """Fail, with the fix, where FP8 matmuls cannot run: no CUDA GPU of compute capability 8.9 or higher."""
    if emulated():
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            "training.precision: fp8 needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or higher: "
            "Ada, Hopper or later) and this machine has none; use precision: bf16"
        )
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        raise ConfigError(
            f"training.precision: fp8 needs FP8 tensor cores (compute capability 8.9 or higher: Ada, Hopper or "
            f"later); {torch.cuda.get_device_name()} has {capability[0]}.{capability[1]}; use precision: bf16"
        )


def float8_config(config: RunConfig):
    """torchao's Float8LinearConfig for the run: the scaling recipe, FP8 all-gather under FSDP2 (tensorwise only)."""
    from torchao.float8 import Float8LinearConfig

    recipe = Float8LinearConfig.from_recipe_name(config.training.resolved_fp8_scaling)
    return dataclasses.replace(recipe, enable_fsdp_float8_all_gather=fp8_all_gather(config), emulate=emulated())


def fp8_all_gather(config: RunConfig) -> bool:
    """Whether FSDP2 all-gathers FP8 weights: torchao's layers with tensorwise scaling under FSDP2."""
    return (
        config.parallelism.strategy == "fsdp"
        and config.training.resolved_fp8_scaling == "tensorwise"
        and uses_torchao(config)
    )


def decoder_linear_names(model: nn.Module, layers: list[nn.Module]) -> list[str]:
    """Names of the Linear layers inside the decoder `layers` whose dimensions are multiples of 16."""
    layer_ids = {id(layer) for layer in layers}
    names = []
    for prefix, layer in model.named_modules():
        if id(layer) not in layer_ids:
            continue
        for name, module in layer.named_modules(prefix=prefix):
            if type(module) is nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0:
                names.append(name)
    return names


def uses_torchao(config: RunConfig) -> bool:
    """Whether the FP8 layers are torchao's (`training.fp8_layers`): asked for, or under `auto` with rowwise
    scaling or FSDP2 (FP8 all-gather); tigon's otherwise."""
    training = config.training
    if training.fp8_layers != "auto":
        return training.fp8_layers == "torchao"
    return training.resolved_fp8_scaling == "rowwise" or config.parallelism.strategy == "fsdp"


def convert_to_fp8(model: nn.Module, config: RunConfig, layers: list[nn.Module]) -> list[str]:
    """Swap the Linear layers of the decoder `layers` for FP8 ones in place (tigon's FP8Linear, or torchao's
    Float8Linear where `uses_torchao`); returns their names."""
    check_device()
    names = decoder_linear_names(model, layers)
    if not names:
        raise ConfigError(
            f"training.precision: fp8 found no Linear layer with dimensions that are multiples of 16 in "
            f"{type(model).__name__}'s decoder layers; use precision: bf16"
        )
    torchao = uses_torchao(config)
    if torchao:
        from torchao.float8 import convert_to_float8_training

        chosen = set(names)
        convert_to_float8_training(model, config=float8_config(config), module_filter_fn=lambda _, name: name in chosen)
    else:
        for name in names:
            parent, _, child = name.rpartition(".")
            owner = model.get_submodule(parent)
            keep_input = child in ATTENTION_OUTPUT_PROJECTIONS
            setattr(owner, child, FP8Linear.from_linear(getattr(owner, child), keep_input=keep_input))
    logger.info(
        "fp8 (%s scaling, %s): %d Linear layers of the decoder layers",
        config.training.resolved_fp8_scaling,
        "torchao" if torchao else "tigon's casts",
        len(names),
    )
    return names


def precompute_scales(model: nn.Module, config: RunConfig) -> None:
    """After the optimizer step, where FSDP2 all-gathers torchao's FP8 weights: every FP8 weight's scale in one
    all-reduce (torchao's recommendation), instead of one per layer in the next forward."""
    if config.training.precision == "fp8" and fp8_all_gather(config):
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
