"""Parallelism strategies behind one small interface, so the torch trainer runs one loop for all of them.

    strategy = build_strategy(model, config, env, device, total_steps)  # tigon.runtime.strategies
    with strategy.accumulating(last_micro_batch):
        strategy.backward(loss_of(strategy.model))
    grad_norm = strategy.step()  # clip, optimizer and schedule step, zero the gradients

- `ddp` (`DDPStrategy`): DistributedDataParallel over WORLD_SIZE > 1 processes (the model itself in
  one), torch AdamW, fp16 through a GradScaler; checkpoints are torch files written by rank 0.
- `fsdp` (`FSDPStrategy`): FSDP2 `fully_shard` on each decoder layer, then on the root, over every rank or, with
  `parallelism.shard_size`, over groups of ranks with the groups replicating each other (hybrid sharding); a
  MixedPrecisionPolicy (parameters in bf16 or fp16 per `training.precision`, gradients reduced in
  fp32; fp16 through a ShardedGradScaler); `parallelism.cpu_offload` adds a CPUOffloadPolicy. Under gradient
  accumulation the reduce-scatter waits for the step's last micro-batch (every rank holds the whole model's
  gradients until then), or with `parallelism.accumulate_sharded` runs after each one. Checkpoints are sharded
  torch.distributed.checkpoint directories (model and optimizer through get/set_state_dict).
- `deepspeed` (`tigon.runtime.deepspeed_engine.DeepSpeedStrategy`): ZeRO stage 1, 2 or 3.

Every strategy writes into the runtime's `step-N` checkpoint directory (`checkpoint.save_checkpoint`:
temporary name, barrier, rank 0 renames, last K kept; across nodes without a shared filesystem, through the
object store), and exports the whole model as a
`save_pretrained` directory: a sharded strategy gathers the full state dict to rank 0, which loads
it into a plain copy of the model and exports that (LoRA merged when asked).

`build` makes a strategy for the torch trainer (`tigon.runtime.strategies.build_strategy` picks the class): it
wraps the model and creates the optimizer and schedule. The HF Trainer and Lightning adapters let their framework
run the parallelism and construct the strategy around what the framework built (`Strategy(module, model,
optimizer, scheduler, ...)`), so that the three trainers share the sharding (`shard_model`), the checkpoints and
the export.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import torch
from torch import nn

from tigon.runtime import checkpoint as ckpt
from tigon.runtime.config import RunConfig
from tigon.runtime.distributed import DistEnv, barrier, shard_ranks, wrap_model
from tigon.runtime.fp8 import precompute_scales
from tigon.runtime.gathers import check_copy_engine_gathers, use_copy_engine_gathers
from tigon.runtime.model import build_model
from tigon.runtime.optim import build_optimizer, build_scheduler, load_schedule

logger = logging.getLogger("tigon.runtime")

FSDP_PARAM_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}  # MixedPrecisionPolicy


class DDPStrategy:
    """The replicated model: DDP across processes, the model itself in one process.

    `module` is the plain model, `model` what the forward runs through (DDP, the sharded module, the
    DeepSpeed engine); `scaler` is the fp16 gradient scaler (a disabled one when None).
    """

    def __init__(
        self,
        module: nn.Module,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler,
        config: RunConfig,
        env: DistEnv,
        device: torch.device,
        scaler: torch.amp.GradScaler | None = None,
    ):
        self.module, self.model, self.optimizer, self.scheduler = module, model, optimizer, scheduler
        self.config, self.env, self.device = config, env, device
        enabled = config.training.precision == "fp16"
        self.scaler = scaler if scaler is not None else self.new_scaler(device, enabled)
        self.params = [p for p in module.parameters() if p.requires_grad]

    @classmethod
    def build(cls, module: nn.Module, config: RunConfig, env: DistEnv, device: torch.device, total_steps: int):
        """The torch trainer's strategy: the model wrapped, then its optimizer and schedule."""

        model = cls.wrap(module, config, env, device)
        optimizer = build_optimizer(module, config.training, fused=cls.fused_optimizer(config))
        scheduler = build_scheduler(optimizer, config.training, total_steps)
        return cls(module, model, optimizer, scheduler, config, env, device)

    @staticmethod
    def wrap(module: nn.Module, config: RunConfig, env: DistEnv, device: torch.device) -> nn.Module:
        return wrap_model(module, config, env, device)

    @staticmethod
    def new_scaler(device: torch.device, enabled: bool) -> torch.amp.GradScaler:
        """fp16's loss scaler; DDP's gradients are whole on every rank, so each rank finds the same overflow."""
        return torch.amp.GradScaler(device.type, enabled=enabled)

    @staticmethod
    def fused_optimizer(config: RunConfig) -> bool:
        """Whether AdamW may take torch's fused kernel on the GPU."""
        return True

    def accumulating(self, last: bool):
        """The context of one micro-batch's forward and backward; gradients are synchronized on the last."""
        return contextlib.nullcontext() if last or not self.env.distributed else self.model.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def clip(self) -> torch.Tensor:
        """Clip the gradients; their norm before clipping, on the device (no wait for the GPU here)."""
        max_norm = self.config.training.max_grad_norm
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm is not None else float("inf"))

    def step(self) -> torch.Tensor | float:
        """Clip, update, advance the schedule, zero the gradients; the gradient norm before clipping, left on the
        device so that the update is queued behind the backward before anything waits for the GPU."""
        self.scaler.unscale_(self.optimizer)
        grad_norm = self.clip()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return grad_norm

    def lr(self) -> float:
        """The learning rate of the coming step."""
        return self.optimizer.param_groups[0]["lr"]

    def write_state(self, directory: Path) -> None:
        """Model and optimizer state into a checkpoint directory (called on every rank)."""
        ckpt.write_torch_state(directory, self.model, self.optimizer, self.scheduler, self.env, self.scaler)

    def read_state(self, directory: Path) -> None:
        ckpt.read_torch_state(directory, self.model, self.optimizer, self.scheduler, self.scaler)

    def checkpoint_estimate(self) -> int:
        """Bytes the first checkpoint will take, for the free-space check: the saved weights (only the trainable
        ones when part of the model is frozen) and the optimizer's state (sharded tensors count whole)."""
        parameters = list(self.module.parameters())  # local reads only: no collective (FSDP2's are DTensors)
        partial = any(not p.requires_grad for p in parameters)
        weights = [p for p in parameters if p.requires_grad or not partial]
        moments = [value for entry in self.optimizer.state.values() for value in entry.values()]
        tensors = [t for t in [*weights, *moments] if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def save_checkpoint(
        self, run_dir: Path, state: ckpt.TrainState, keep_last: int, config_json: str, remote=None
    ) -> Path:
        """Write `step-N` and wait until it is whole (and committed to `remote`, the run's RunStorage, if any)."""
        return self.begin_checkpoint(run_dir, state, keep_last, config_json, remote).finish()

    def begin_checkpoint(
        self, run_dir: Path, state: ckpt.TrainState, keep_last: int, config_json: str, remote=None
    ) -> ckpt.PendingCheckpoint:
        """Start `step-N`; it is whole once the returned checkpoint's `finish()` returns (call both on every rank)."""
        return ckpt.begin_checkpoint(
            run_dir,
            state,
            self.env,
            keep_last,
            self.write_state,
            config_json=config_json,
            estimated_bytes=self.checkpoint_estimate() if self.env.is_main else 0,
            remote=remote,
        )

    def load_checkpoint(self, path: Path) -> ckpt.TrainState:
        return ckpt.load_checkpoint(path, None, None, None, self.env, read_state=self.read_state)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict on rank 0 (None elsewhere); call on every rank."""
        return self.module.state_dict() if self.env.is_main else None

    def export(self, tokenizer, out_dir: Path, merge_lora: bool) -> Path | None:
        """`save_pretrained` the trained model on rank 0 (call on every rank); the directory on rank 0."""
        exported = None
        if self.env.is_main:
            exported = ckpt.export_model(self.module, tokenizer, out_dir, merge_lora=merge_lora)
        barrier(self.env)
        return exported


class ShardedExport:
    """Export for strategies that shard the weights: rank 0 loads the gathered state dict into a plain copy."""

    module: nn.Module
    config: RunConfig
    env: DistEnv

    def export(self, tokenizer, out_dir: Path, merge_lora: bool) -> Path | None:
        state_dict = self.full_state_dict()
        exported = None
        if self.env.is_main:
            exported = export_state_dict(state_dict, self.config, tokenizer, out_dir, merge_lora)
        barrier(self.env)
        return exported


def export_state_dict(state_dict: dict, config: RunConfig, tokenizer, out_dir: Path, merge_lora: bool) -> Path:
    """Build the run's model again on the CPU (kernels, LoRA), load `state_dict` into it and export it."""
    with torch.random.fork_rng():
        plain = build_model(config, len(tokenizer), tokenizer)
    dtype = next(plain.parameters()).dtype
    plain.load_state_dict({name: tensor.to(dtype) for name, tensor in state_dict.items()})
    return ckpt.export_model(plain, tokenizer, out_dir, merge_lora=merge_lora)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks FSDP shards one by one: modules named in a transformers model's `_no_split_modules`."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return [module for module in model.modules() if type(module).__name__ in names]


def shard_mesh(config: RunConfig, env: DistEnv, device: torch.device):
    """The device mesh of hybrid sharding, (replicas, shard ranks), consecutive ranks in one shard group (torchrun
    numbers a node's ranks consecutively); None to shard over every rank."""
    shard = shard_ranks(config, env)
    if shard == env.world_size:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (env.world_size // shard, shard), mesh_dim_names=("replicate", "shard"))


def shard_model(
    module: nn.Module, config: RunConfig, env: DistEnv, device: torch.device, frozen: bool = False
) -> nn.Module:
    """FSDP2 in place: each decoder layer, then the root, `fully_shard`ed over all ranks (or, with
    `parallelism.shard_size`, over each group of that many and replicated across the groups); returns `module`.

    `frozen`: a model that runs forward only (a reference or teacher): its root reshards after the forward too
    (FSDP2 otherwise keeps a root's parameters gathered for the backward, which never comes).

    The MixedPrecisionPolicy keeps parameters in bf16 or fp16 for the forward and backward, per
    `training.precision`, and reduces gradients in fp32; `parallelism.cpu_offload` adds a CPUOffloadPolicy.
    Ranks but 0 may hold the model on the meta device (`run.prepare`): they receive rank 0's weights once
    it is sharded.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    options: dict = {
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=FSDP_PARAM_DTYPES.get(config.training.precision), reduce_dtype=torch.float32
        )
    }
    if config.parallelism.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    mesh = shard_mesh(config, env, device) if env.distributed else None
    if mesh is not None:
        options["mesh"] = mesh
    started = time.perf_counter()
    full_state = module.state_dict() if env.is_main else {}  # rank 0's weights, for the other ranks
    layers = decoder_layers(module)
    if not layers:
        logger.warning("fsdp: no decoder layers found (no _no_split_modules); sharding the model as one unit")
    for layer in layers:
        fully_shard(layer, **options)
    fully_shard(module, **options, **({"reshard_after_forward": True} if frozen else {}))
    if config.parallelism.copy_engine_gathers:
        check_copy_engine_gathers(shard_ranks(config, env), env, device, module)
        use_copy_engine_gathers([*layers, module])
    if env.distributed:
        receive_rank0_weights(module, full_state, device)
    if not env.distributed and not frozen and not config.parallelism.cpu_offload:
        logger.warning(
            "fsdp on one process shards nothing, yet copies every weight through its all-gathers and keeps the "
            "gradients in float32: parallelism.strategy: ddp trains the model itself, without those copies and with "
            "gradients in the weights' dtype (docs/benchmarks.md, FP8 on instruction data, one GPU)"
        )
    if env.is_main:
        groups = "" if mesh is None else f" ({mesh.size(0)} replicas of {mesh.size(1)}-rank shard groups)"
        logger.info(
            "fsdp: %d decoder layers and the root sharded over %d ranks%s in %.1f s",
            len(layers),
            env.world_size,
            groups,
            time.perf_counter() - started,
        )
    return module


def receive_rank0_weights(module: nn.Module, full_state: dict[str, torch.Tensor], device: torch.device) -> None:
    """Every rank's shards and buffers from rank 0's model. The other ranks built theirs on the meta device
    (`prepare`), so no rank but 0 spends the time or memory of building the whole model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if any(tensor.is_meta for tensor in [*module.parameters(), *module.buffers()]):
        module.to_empty(device=device)  # FSDP2 moves the shards back to the CPU under cpu_offload
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(module, full_state, options=options)
    for buffer in module.buffers():  # not in the state dict when non-persistent (RoPE's inverse frequencies)
        torch.distributed.broadcast(buffer, src=0)


class FSDPStrategy(ShardedExport, DDPStrategy):
    """FSDP2: every decoder layer and then the root `fully_shard`ed over all ranks (`shard_model`)."""

    _async_group = None  # the background checkpoint writer's process group (`async_group`)
    _stager = None  # the background checkpoint writer's pinned host buffers (`stager`)

    @staticmethod
    def wrap(module: nn.Module, config: RunConfig, env: DistEnv, device: torch.device) -> nn.Module:
        return shard_model(module, config, env, device)

    @staticmethod
    def new_scaler(device: torch.device, enabled: bool) -> torch.amp.GradScaler:
        """Each rank holds a shard of the gradients: the sharded scaler all-reduces whether any shard overflowed,
        so every rank skips the same steps."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, enabled=enabled)

    @staticmethod
    def fused_optimizer(config: RunConfig) -> bool:
        """Not under fp16: the sharded scaler hands the fused step an overflow flag of shape [1] where it wants a
        scalar (torch 2.11-2.13: "output with shape [] doesn't match the broadcast shape [1]")."""
        return config.training.precision != "fp16"

    def accumulating(self, last: bool):
        """Gradients reduce-scatter once a step, after the last micro-batch; with `parallelism.accumulate_sharded`,
        after every one, into each rank's shard."""
        self.model.set_requires_gradient_sync(last or self.config.parallelism.accumulate_sharded)
        return contextlib.nullcontext()

    def step(self) -> torch.Tensor | float:
        """The update, then (fp8, tensorwise) every FP8 weight's scale for the next step's all-gather."""
        grad_norm = super().step()
        precompute_scales(self.module, self.config)
        return grad_norm

    def clip(self) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        max_norm = self.config.training.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm if max_norm is not None else float("inf"))
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def write_state(self, directory: Path):
        """Every rank's shards into `dcp/`, and the schedule (rank 0). With `checkpoint.async_save` the shards are
        copied to CPU memory here and written by a background thread: the Future it returns completes then."""
        import torch.distributed.checkpoint as dcp

        writing = None
        if self.config.checkpoint.async_save:
            stager = self.stager()
            writing = dcp.async_save(
                self._state(),
                checkpoint_id=directory / "dcp",
                process_group=self.async_group(),
                **({"async_stager": stager} if stager is not None else {}),
            )
        else:
            dcp.save(self._state(), checkpoint_id=directory / "dcp")
        if self.env.is_main:  # the scaler's state is the same on every rank: it all-reduces its overflow checks
            schedule = {"scheduler": self.scheduler.state_dict()}
            if self.scaler.is_enabled():
                schedule["scaler"] = self.scaler.state_dict()
            torch.save(schedule, directory / "scheduler.pt")
        return writing

    def stager(self):
        """Where a background save first copies the shards: pinned host buffers, allocated at the first save and
        reused by the next, so the copy that holds training runs at the host link's speed rather than through
        freshly allocated pageable memory. None on a torch without DCP's stagers (its default copy then)."""
        if self._stager is None:
            try:
                from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
            except ImportError:
                return None
            cuda = torch.cuda.is_available()
            options = StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=cuda
            )
            self._stager = DefaultStager(options)
        return self._stager

    def async_group(self):
        """A gloo group of all ranks for the background writer's own collectives, apart from training's (made
        once, by every rank at its first save)."""
        if self._async_group is None:
            self._async_group = torch.distributed.new_group(backend="gloo")
        return self._async_group

    def read_state(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        ckpt.require_layout(directory, "dcp", "fsdp")
        state = self._state()
        dcp.load(state, checkpoint_id=directory / "dcp")
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        schedule = torch.load(directory / "scheduler.pt", map_location="cpu", weights_only=True)
        load_schedule(self.scheduler, schedule["scheduler"])
        if self.scaler.is_enabled() and "scaler" in schedule:
            self.scaler.load_state_dict(schedule["scaler"])

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.model, options=options)
        return state if self.env.is_main else None
