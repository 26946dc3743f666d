"""DeepSpeed ZeRO 1, 2 and 3 as a strategy of the torch trainer (imported only when chosen).

The DeepSpeed config is built from the run's config (`deepspeed_config`): micro-batch and
accumulation from `training`, clipping from `training.max_grad_norm`, bf16, fp16 (DeepSpeed's
dynamic loss scaling, from 2^16 as torch's GradScaler) or fp32 from `training.precision`, AdamW
with the runtime's betas, eps and weight decay (matrices only, as `optim.param_groups`), and the
runtime's learning-rate schedule as the engine's scheduler. ZeRO stage and CPU offload come from
`parallelism`. The loop keeps its loss normalization: each
micro-batch's loss already carries the global-batch token count, so `engine.backward` does not
divide by the accumulation steps again. On a CPU machine `DS_ACCELERATOR=cpu` is set before
DeepSpeed is imported; DeepSpeed then JIT-builds a small communication op (and CPU Adam for
ZeRO-Offload) with g++ and ninja (cached under ~/.cache/torch_extensions).

Checkpoints are DeepSpeed's own (`engine.save_checkpoint`, every rank writes its partition)
inside the runtime's atomic `step-N` directory, under `deepspeed/`. The learning-rate schedule is
kept in DeepSpeed's client state, since an engine that the HF Trainer creates does not own it (HF
steps the schedule itself); so the torch trainer's engine loads the adapters' checkpoints too.
Export gathers the weights to rank 0: ZeRO-3 through `_zero3_consolidated_16bit_state_dict` (the
parameters in their training dtype; `stage3_gather_16bit_weights_on_model_save` is on), stages 1 and
2 from the module.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from torch import nn

from tigon.runtime import checkpoint as ckpt
from tigon.runtime.config import ConfigError, RunConfig
from tigon.runtime.distributed import DistEnv
from tigon.runtime.optim import build_scheduler, load_schedule, param_groups
from tigon.runtime.parallel import DDPStrategy, ShardedExport
from tigon.runtime.planner import REDUCE_BUCKET_SIZE

TAG = "deepspeed"  # the sub-directory of a step-N checkpoint that holds DeepSpeed's files
SCHEDULE = "tigon_schedule"  # the client-state key of the learning-rate schedule's state
ADAMW_BETAS = (0.9, 0.95)  # as optim.build_optimizer
ADAMW_EPS = 1e-8


def trainable_elements(module: nn.Module) -> int:
    """The elements of the module's trainable parameters, whole under ZeRO-3 partitioning (`ds_numel`)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters() if p.requires_grad)


def deepspeed_config(
    config: RunConfig, world_size: int, trainable: int = REDUCE_BUCKET_SIZE, optimizer_section: bool = True
) -> dict:
    """The DeepSpeed JSON config equivalent to the run's training and parallelism sections.

    `trainable` (`trainable_elements` of the model) caps ZeRO's gradient reduction bucket: DeepSpeed allocates the
    bucket whole at each micro-step (2 GB in fp32 at its default), and a bucket that holds every gradient reduces
    them in the same single pass as a larger one. `optimizer_section=False` leaves the optimizer out, for a caller
    that hands DeepSpeed its own: the HF adapter gives the Trainer `optim.build_optimizer`'s AdamW, which
    accelerate turns into DeepSpeed's CPU Adam over the same groups under ZeRO-Offload, as this config's optimizer
    section does."""
    training, parallelism = config.training, config.parallelism
    stage = parallelism.stage
    zero: dict = {"stage": stage, "reduce_bucket_size": max(1, min(trainable, REDUCE_BUCKET_SIZE))}
    if stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    optimizer = {
        "lr": training.learning_rate,
        "betas": list(ADAMW_BETAS),
        "eps": ADAMW_EPS,
        "weight_decay": training.weight_decay,
    }
    if parallelism.cpu_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    else:
        optimizer["torch_adam"] = True  # torch's AdamW (FusedAdam would need a CUDA build); offload uses CPU Adam
    built = {
        "train_micro_batch_size_per_gpu": training.micro_batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation_steps,
        "train_batch_size": training.global_batch(world_size),
        "gradient_clipping": training.max_grad_norm or 0.0,
        "bf16": {"enabled": training.precision == "bf16"},
        "fp16": {"enabled": training.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16},
        "optimizer": {"type": "AdamW", "params": optimizer},
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if not optimizer_section:
        del built["optimizer"]
    return built


PRECISION_SUPPORT = {"fp16": "is_fp16_supported", "bf16": "is_bf16_supported"}  # the accelerator's own checks


def import_deepspeed(device: torch.device, precision: str | None = None):
    """deepspeed, on the CPU accelerator when the run is on the CPU; a clear error when it is missing, or when its
    accelerator cannot run `precision` on this machine (DeepSpeed itself would refuse it inside `initialize`)."""
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError:
        raise ConfigError(
            "parallelism.strategy: 'deepspeed' needs the deepspeed package; pip install 'tigon[deepspeed]'"
        ) from None
    forget_destroyed_world_group()
    if precision is not None and not supports_precision(deepspeed, precision):
        other = "bf16" if precision == "fp16" else "fp16"
        raise ConfigError(
            f"training.precision: {precision} with parallelism.strategy 'deepspeed': DeepSpeed's "
            f"{deepspeed.get_accelerator().device_name()} accelerator cannot run {precision} on this machine (on a "
            f"CPU it needs oneDNN's native {precision}, e.g. AVX512-FP16 for fp16); use precision {other} or fp32, "
            "or parallelism.strategy 'ddp' or 'fsdp'"
        )
    return deepspeed


def supports_precision(deepspeed, precision: str) -> bool:
    """Whether DeepSpeed's accelerator runs `precision` ("fp32", "fp16", "bf16") on this machine."""
    check = PRECISION_SUPPORT.get(precision)
    return check is None or bool(getattr(deepspeed.get_accelerator(), check)())


def forget_destroyed_world_group() -> None:
    """Drop DeepSpeed's cached clone of the world group when its process group no longer exists.

    DeepSpeed clones the world group once per process and keeps it in a module global. A second run in
    the same process (a notebook, a test session) starts after the first run destroyed its process
    group, and DeepSpeed's first broadcast then fails on the stale clone ("Group ... is not registered").
    """
    from deepspeed.utils import groups
    from torch.distributed.distributed_c10d import _world

    if groups._WORLD_GROUP is not None and groups._WORLD_GROUP not in _world.pg_group_ranks:
        groups._WORLD_GROUP = None


class DeepSpeedStrategy(ShardedExport, DDPStrategy):
    """A DeepSpeed engine (ZeRO `parallelism.zero_stage`) around the model, its optimizer and schedule; `model` is
    the engine."""

    @classmethod
    def build(cls, module: nn.Module, config: RunConfig, env: DistEnv, device: torch.device, total_steps: int):
        """`deepspeed.initialize` with the run's DeepSpeed config, AdamW over `optim.param_groups`, the schedule."""

        deepspeed = import_deepspeed(device, config.training.precision)
        training = config.training
        groups = param_groups(module, training.weight_decay)
        if not groups:
            raise ConfigError("the model has no trainable parameters (check lora.target_modules)")
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=module,
            model_parameters=groups,
            config=deepspeed_config(config, env.world_size, trainable_elements(module)),
            lr_scheduler=lambda optimizer: build_scheduler(optimizer, training, total_steps),
            dist_init_required=False,
        )
        return cls(module, engine, optimizer, scheduler, config, env, device)

    @property
    def engine(self):
        return self.model

    def accumulating(self, last: bool):
        self.engine.set_gradient_accumulation_boundary(last)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss, scale_wrt_gas=False)  # the loss is already normalized over the global batch

    def step(self) -> float:
        """Clipping, the update and the schedule happen inside `engine.step` (one call per optimizer step)."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def lr(self) -> float:
        return self.engine.get_lr()[0]

    def write_state(self, directory: Path) -> None:
        schedule = {SCHEDULE: self.scheduler.state_dict()}
        self.engine.save_checkpoint(str(directory), tag=TAG, client_state=schedule, save_latest=False)

    def checkpoint_estimate(self) -> int:
        """The module's weights plus fp32 master weights and Adam's two moments (12 bytes) per trainable parameter;
        ZeRO-3's partitioned parameters count whole (`ds_numel`)."""
        total = 0
        for parameter in self.module.parameters():
            numel = getattr(parameter, "ds_numel", parameter.numel())
            total += numel * (parameter.element_size() + (12 if parameter.requires_grad else 0))
        return total

    def read_state(self, directory: Path) -> None:
        ckpt.require_layout(directory, TAG, "deepspeed")
        loaded, client_state = self.engine.load_checkpoint(str(directory), tag=TAG, load_lr_scheduler_states=False)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint in {directory / TAG}")
        if SCHEDULE not in client_state:
            raise RuntimeError(
                f"{directory / TAG} holds no learning-rate schedule (written by an older tigon); set "
                "checkpoint.resume: false to start over"
            )
        load_schedule(self.scheduler, client_state[SCHEDULE])

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        if self.config.parallelism.stage == 3:
            return self.engine._zero3_consolidated_16bit_state_dict()  # collective; a dict on rank 0 only
        if not self.env.is_main:
            return None
        return {name: tensor.detach().cpu() for name, tensor in self.module.state_dict().items()}


def frozen_engine(module: nn.Module, config: RunConfig, env: DistEnv, device: torch.device):
    """A frozen model (a preference objective's reference copy, distillation's teacher) partitioned as ZeRO-3
    partitions the trained one: DeepSpeed's engine without an optimizer, as TRL prepares its reference model. Its
    hooks gather each submodule's weights for its forward, so each rank keeps 1/world of the weights (none on the GPU
    under cpu_offload, which offloads its parameters too). The run's DeepSpeed config without the optimizer and its
    offload, which an engine without one would try to build."""
    deepspeed = import_deepspeed(device, config.training.precision)
    built = deepspeed_config(config, env.world_size, trainable_elements(module), optimizer_section=False)
    built["zero_optimization"].pop("offload_optimizer", None)
    engine, *_ = deepspeed.initialize(model=module, config=built, dist_init_required=False)
    engine.eval()
    return engine


def build_cpu_ops() -> None:
    """JIT-build the ops DeepSpeed's CPU accelerator loads (once; cached on disk): the communication op it loads at
    start, and CPU Adam, which ZeRO-Offload steps with."""
    if torch.cuda.is_available():
        return
    import_deepspeed(torch.device("cpu"))
    from deepspeed.accelerator import get_accelerator

    for builder in ("ShareMemCommBuilder", "CPUAdamBuilder"):
        get_accelerator().create_op_builder(builder).load()


if __name__ == "__main__":  # scripts/setup-venv.sh: build the ops before the tests need them
    build_cpu_ops()
