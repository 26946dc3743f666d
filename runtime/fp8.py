"""FP8 matrix products for `training.precision: fp8`, through torchao's float8 training.

    names = convert_to_fp8(model, config, layers)  # before compile and FSDP2, as torchao asks

The decoder layers' Linear layers become torchao `Float8Linear`s: each matmul casts its input, weight and output
gradient to FP8 with dynamic scales (per tensor or per row, `training.fp8_scaling`) and runs on the GPU's FP8
tensor cores. Everything else (embeddings, norms, RoPE, the gated activation, attention, the head and the fused
loss) runs under bf16 autocast, as in `precision: bf16`. The head stays a plain Linear because the fused loss
reads its weight directly. FP8 matmuls need both dimensions to be multiples of 16, so other layers are skipped.

Under FSDP2 with tensorwise scaling, weights are cast to FP8 before the all-gather (half the bytes of bf16), and
`precompute_scales` computes every weight's scale in one all-reduce after the optimizer step. On the unsharded
model (DDP, or one process) with tensorwise scaling, each weight is cast once per optimizer step instead
(`Float8LinearCastOnce`, `cast_weights`): torchao casts it again in every micro-batch's forward and backward, and
the weights do not change between them. The cast is the same, so the step computes the same values.

`TIGON_FP8_EMULATE=1` is for tests only: torchao emulates the FP8 matmuls in higher precision, so a machine
without an FP8 GPU runs the same casts and scales (slowly).
"""

from __future__ import annotations

import dataclasses
import functools
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


def casts_weights_once(config: RunConfig) -> bool:
    """Whether each FP8 weight is cast once per optimizer step: tensorwise scaling on the unsharded model (under
    FSDP2 the all-gather casts it; a rowwise weight takes a different scale for the backward)."""
    return (
        config.training.precision == "fp8"
        and config.training.resolved_fp8_scaling == "tensorwise"
        and config.parallelism.strategy == "ddp"
    )


def convert_to_fp8(model: nn.Module, config: RunConfig, layers: list[nn.Module]) -> list[str]:
    """Swap the Linear layers of the decoder `layers` for torchao Float8Linear in place (`Float8LinearCastOnce`
    where `casts_weights_once`); returns their names."""
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
    if casts_weights_once(config):
        for name in names:
            model.get_submodule(name).__class__ = float8_linear_cast_once()  # adds behaviour, no state to build
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


@functools.cache
def float8_linear_cast_once() -> type[nn.Module]:
    """`Float8LinearCastOnce`, defined on first use: torchao is imported only by FP8 runs."""
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

    class PrecastWeight(torch.autograd.Function):
        """The weight's FP8 cast made before the step, in the place of the weight: the gradient passes to it
        unchanged, as through torchao's own cast."""

        @staticmethod
        def forward(ctx, weight_t, bits, scale, linear_mm_config):
            return Float8TrainingTensor(bits, scale, weight_t.dtype, linear_mm_config, GemmInputRole.WEIGHT, None)

        @staticmethod
        def backward(ctx, grad):
            return grad, None, None, None

    class Float8LinearCastOnce(Float8Linear):
        """torchao's Float8Linear that takes its weight's FP8 cast from `cast_weights` when one is there: one cast
        serves every micro-batch's forward and backward of an optimizer step. Without one it is Float8Linear."""

        weight_bits: torch.Tensor | None = None  # the FP8 bits of weight.t() (column-major), or None
        weight_scale: torch.Tensor | None = None

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if self.weight_bits is None:
                return super().forward(input)
            if torch.is_autocast_enabled():  # as Float8Linear: the output in the autocast dtype
                input = input.to(torch.get_autocast_dtype("cuda"))
            weight_t = PrecastWeight.apply(self.weight.t(), self.weight_bits, self.weight_scale, self.linear_mm_config)
            output = matmul_with_hp_or_float8_args.apply(input, weight_t, self.linear_mm_config, self.config)
            return output if self.bias is None else output + self.bias.to(output.dtype)

    return Float8LinearCastOnce


def cast_once_layers(model: nn.Module, config: RunConfig) -> list[nn.Module]:
    """The model's `Float8LinearCastOnce` layers, which `cast_weights` casts (none unless `casts_weights_once`)."""
    if not casts_weights_once(config):
        return []
    kind = float8_linear_cast_once()
    return [module for module in model.modules() if isinstance(module, kind)]


def _cast(
    weight_t: torch.Tensor, dtype: torch.dtype, round_scales_to_power_of_2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """torchao's tensorwise cast of a weight for its matmuls: the FP8 bits and the scale."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    cast = hp_tensor_to_float8_dynamic(
        weight_t,
        dtype,
        LinearMMConfig(),
        gemm_input_role=GemmInputRole.WEIGHT,
        round_scales_to_power_of_2=round_scales_to_power_of_2,
    )
    return cast._data, cast._scale


@functools.cache
def _compiled_cast(backend: str):
    """`_cast` compiled, so that the absolute maximum, the scale and the cast are fused as in the layers."""
    return torch.compile(_cast, backend=backend)


def cast_weights(layers: list[nn.Module], backend: str) -> None:
    """Cast every layer's weight to FP8 for the coming optimizer step, where not already cast (`layers` from
    `cast_once_layers`; `backend`: training.compile_backend). `drop_weight_casts` ends the step's casts."""
    if not layers or layers[0].weight_bits is not None:
        return
    cast = _compiled_cast(backend)
    with torch.no_grad():
        for layer in layers:
            config = layer.config
            layer.weight_bits, layer.weight_scale = cast(
                layer.weight.t(), config.cast_config_weight.target_dtype, config.round_scales_to_power_of_2
            )


def drop_weight_casts(layers: list[nn.Module]) -> None:
    """Forget the step's casts before the weights change: a layer without one casts its weight itself."""
    for layer in layers:
        layer.weight_bits = layer.weight_scale = None
