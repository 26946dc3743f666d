"""FP8 matrix products for `training.precision: fp8`, through torchao's float8 training.

    names = convert_to_fp8(model, config, layers)  # before compile and FSDP2, as torchao asks

The decoder layers' Linear layers become torchao `Float8Linear`s: each matmul casts its input, weight and output
gradient to FP8 with dynamic scales (per tensor or per row, `training.fp8_scaling`) and runs on the GPU's FP8
tensor cores. Everything else (embeddings, norms, RoPE, the gated activation, attention, the head and the fused
loss) runs under bf16 autocast, as in `precision: bf16`. The head stays a plain Linear because the fused loss
reads its weight directly. FP8 matmuls need both dimensions to be multiples of 16, so other layers are skipped.

Under FSDP2 with tensorwise scaling, weights are cast to FP8 before the all-gather (half the bytes of bf16), and
`precompute_scales` computes every weight's scale in one all-reduce after the optimizer step.

`TIGON_FP8_EMULATE=1` is for tests only: torchao emulates the FP8 matmuls in higher precision, so a machine
without an FP8 GPU runs the same casts and scales (slowly).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
from torch import nn

from tigon.runtime.config import ConfigError, RunConfig

logger = logging.getLogger("tigon.runtime")

EMULATE_VARIABLE = "TIGON_FP8_EMULATE"
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 tensor cores


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
    all_gather = config.parallelism.strategy == "fsdp" and config.training.resolved_fp8_scaling == "tensorwise"
    return dataclasses.replace(recipe, enable_fsdp_float8_all_gather=all_gather, emulate=emulated())


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


def convert_to_fp8(model: nn.Module, config: RunConfig, layers: list[nn.Module]) -> list[str]:
    """Swap the Linear layers of the decoder `layers` for torchao Float8Linear in place; returns their names."""
    from torchao.float8 import convert_to_float8_training

    check_device()
    names = decoder_linear_names(model, layers)
    if not names:
        raise ConfigError(
            f"training.precision: fp8 found no Linear layer with dimensions that are multiples of 16 in "
            f"{type(model).__name__}'s decoder layers; use precision: bf16"
        )
    chosen = set(names)
    convert_to_float8_training(model, config=float8_config(config), module_filter_fn=lambda _, name: name in chosen)
    logger.info(
        "fp8 (%s scaling): %d Linear layers of the decoder layers", config.training.resolved_fp8_scaling, len(names)
    )
    return names


def precompute_scales(model: nn.Module, config: RunConfig) -> None:
    """After the optimizer step, under FSDP2 with tensorwise scaling: every FP8 weight's scale in one all-reduce
    (torchao's recommendation), instead of one per layer in the next forward."""
    if config.training.precision == "fp8" and float8_config(config).enable_fsdp_float8_all_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
