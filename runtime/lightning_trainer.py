"""The Lightning adapter: the torch trainer's pieces inside a LightningModule.

    result = train(config)  # with config.trainer == "lightning"

Shared with the torch trainer: `prepare`, `build_optimizer`, `build_scheduler`, the data order
(`GlobalBatchSampler`), the loss (`token_loss_sum`, or a preference objective's or distillation's through
`post_training.ObjectiveStep`) and its normalization, one global batch's forward, backward and update
(`run_global_batch`), the parallelism strategies, and its checkpoints
(`AdapterCheckpoints`: every N steps, last K kept, atomic; resume continues exactly). Optimization is
manual: Lightning's automatic accumulation divides each micro-batch's loss by the number of
micro-batches, which is not the torch trainer's "sum over label tokens of the step / their count" when
micro-batches hold different numbers of label tokens. So one Lightning batch is one rank's share of a
global batch (a list of micro-batches), and `training_step` runs the accumulation, clipping and update
through a strategy. Lightning's loggers (`framework_loggers`) write its values, under `lightning/`, to the
run's TensorBoard directory and wandb and MLflow runs (`logging.trackers`).

Parallelism under torchrun (`lightning_strategy`):
- `ddp`: Lightning's DDPStrategy over the process group `prepare` created (`LightningDDP`: backward
  through `manual_backward`, gradients all-reduced on the last micro-batch only).
- `fsdp` and `deepspeed`: Lightning's ModelParallelStrategy, the strategy for a module that applies its
  own parallelism. The torch trainer's strategy does it (`strategies.build_strategy`: FSDP2 through
  `shard_model`, or tigon's DeepSpeed engine) before `fit`, because the evaluation at step 0 runs on the
  sharded model then. Lightning's FSDPStrategy is FSDP1, and its DeepSpeedStrategy runs on CUDA only
  (it refuses a CPU accelerator) and wraps the LightningModule, whose name then prefixes every weight
  in the engine's checkpoints and 16-bit state dict.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch

from tigon.runtime.adapters import AdapterCheckpoints, finish_adapter_run, prepare_adapter
from tigon.runtime.batches import GlobalBatchSampler, collate, static_shapes, train_order
from tigon.runtime.collector import QuietCollector
from tigon.runtime.config import ConfigError, RunConfig
from tigon.runtime.distributed import DistEnv
from tigon.runtime.evaluation import Evaluation
from tigon.runtime.objectives import state_of
from tigon.runtime.optim import build_optimizer, build_scheduler
from tigon.runtime.parallel import DDPStrategy
from tigon.runtime.post_training import prepare_objective
from tigon.runtime.reporting import make_reporter, memory_bytes
from tigon.runtime.run import Prepared, TrainResult, plan_steps
from tigon.runtime.strategies import build_strategy
from tigon.runtime.torch_trainer import run_global_batch, train_prepared


class GlobalBatches(torch.utils.data.Sampler):
    """One item per optimizer step: the indices of this rank's micro-batches of it, in the torch trainer's order."""

    def __init__(self, sampler: GlobalBatchSampler, steps: list[tuple[int, int]]):
        self.order, self.steps = sampler, steps

    def __iter__(self):
        for epoch, batch in self.steps:
            yield [index for micro in self.order.micro_batches(epoch, batch) for index in micro]

    def __len__(self) -> int:
        return len(self.steps)


class LightningDDP(DDPStrategy):
    """DDP run by Lightning's DDPStrategy, which wraps the LightningModule `lightning`: backward through
    `manual_backward` (Lightning prepares DDP's reducer there), gradients all-reduced on the last micro-batch only,
    and the update through the LightningOptimizer (Lightning counts the steps)."""

    def __init__(self, lightning, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lightning = lightning

    def accumulating(self, last: bool):
        if last or not self.env.distributed:
            return contextlib.nullcontext()
        return self.lightning.trainer.strategy.block_backward_sync()

    def backward(self, loss: torch.Tensor) -> None:
        self.lightning.manual_backward(self.scaler.scale(loss))

    def step(self) -> torch.Tensor:
        """As DDPStrategy.step, through the LightningOptimizer: the scaler unscales and steps that one object (it
        shares the optimizer's parameter groups), and skips the update when fp16 gradients overflowed."""
        optimizer = self.lightning.optimizers()
        self.scaler.unscale_(optimizer)
        grad_norm = self.clip()
        self.scaler.step(optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return grad_norm


def lightning_devices(env: DistEnv) -> tuple[int, int]:
    """(devices per node, nodes) of a torchrun / PyTorchJob launch, as Lightning's DDP strategy wants them."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    if per_node < 1 or env.world_size % per_node:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE={per_node} does not divide WORLD_SIZE={env.world_size}; launch with torchrun "
            "(--nnodes N --nproc_per_node P starts the same number of processes on every node)"
        )
    return per_node, env.world_size // per_node


def tigon_strategy(config: RunConfig, prepared: Prepared, total_steps: int, lightning) -> DDPStrategy:
    """The strategy `training_step` drives: `LightningDDP` for ddp, else the torch trainer's (the model sharded, or
    inside DeepSpeed's engine, with its optimizer and schedule)."""
    module, env, device = prepared.model, prepared.env, prepared.device
    if config.parallelism.strategy != "ddp":
        return build_strategy(module, config, env, device, total_steps)
    optimizer = build_optimizer(module, config.training)
    scheduler = build_scheduler(optimizer, config.training, total_steps)
    return LightningDDP(lightning, module, module, optimizer, scheduler, config, env, device)


def lightning_strategy(config: RunConfig, env: DistEnv):
    """Lightning's strategy for the run: DDP across processes ("auto" in one), or ModelParallelStrategy when the
    tigon strategy shards the model itself (fsdp, deepspeed)."""
    from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
    from lightning.pytorch.strategies import ModelParallelStrategy

    class PlacedModelParallelStrategy(ModelParallelStrategy):
        def model_to_device(self) -> None:
            """The tigon strategy placed the model; `.to(root_device)` would take FSDP2's CPU-offloaded parameters
            off the CPU (FSDP2 then refuses to run)."""

    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
    if config.parallelism.strategy != "ddp":
        return PlacedModelParallelStrategy(
            data_parallel_size=env.world_size, tensor_parallel_size=1, process_group_backend=backend
        )
    return LightningDDPStrategy(process_group_backend=backend) if env.distributed else "auto"


def framework_loggers(config: RunConfig, env: DistEnv, reporter) -> list:
    """Lightning's loggers for the run's trackers, writing into the same TensorBoard directory and the same wandb
    and MLflow runs as tigon's Reporter (rank 0; Lightning logs from rank 0 only)."""
    if not env.is_main:
        return []
    from lightning.pytorch import loggers

    names, run_dir = config.logging.active_trackers, Path(config.logging.run_dir)
    chosen = []
    if "tensorboard" in names:
        chosen.append(loggers.TensorBoardLogger(save_dir=str(run_dir), name="tensorboard", version="", sub_dir=None))
    if reporter.trackers.wandb_run is not None:
        chosen.append(loggers.WandbLogger(experiment=reporter.trackers.wandb_run))
    if reporter.trackers.mlflow_run_id is not None:
        import mlflow

        chosen.append(
            loggers.MLFlowLogger(tracking_uri=mlflow.get_tracking_uri(), run_id=reporter.trackers.mlflow_run_id)
        )
    return chosen


def train_with_lightning(config: RunConfig, datasets: str | Path | None = None) -> TrainResult:
    """Train (or resume) as configured with a Lightning `Trainer`; returns what the torch trainer would.
    `datasets`: pre-packed data (`tigon.runtime.packed`), as for the torch trainer."""
    import lightning as L

    prepared = prepare_adapter(config, datasets)
    training, device, env = config.training, prepared.device, prepared.env
    total_steps, per_epoch = plan_steps(config, len(prepared.train_dataset), env.world_size, env.is_main)
    checkpoints = AdapterCheckpoints(config, env, per_epoch)
    steps = checkpoints.remaining(total_steps)
    if not steps:  # resumed at its last step: load that checkpoint, evaluate and export as the torch trainer does
        return train_prepared(config, prepared)
    prepare_objective(config, prepared)  # the reference or the teacher, before the model is sharded or wrapped
    dataset = prepared.train_dataset
    whole_rows = static_shapes(config, dataset)
    order = train_order(config, dataset, env.world_size, env.rank)
    reporter = make_reporter(config, total_steps, device, enabled=env.is_main, initial_step=checkpoints.state.step)
    evaluation = Evaluation(config, prepared, checkpoints.state, reporter)
    clock = {"seconds": 0.0, "tokens": 0}

    class TigonModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.model = prepared.model

        def configure_model(self):
            """Nothing to apply: `tigon_strategy` sharded the model (or made the DeepSpeed engine) before `fit`.
            ModelParallelStrategy requires this hook."""

        def configure_optimizers(self):
            if isinstance(strategy, LightningDDP):
                return [strategy.optimizer], [strategy.scheduler]
            return []  # the tigon strategy owns and steps the optimizer; Lightning is given none

        def training_step(self, micro_batches, batch_index):
            checkpoints.restore(strategy)  # the first step of a resumed run
            started = time.perf_counter()
            lr = strategy.lr()
            loss, grad_norm, n_tokens = run_global_batch(
                strategy, micro_batches, config, env, device, checkpoints.state.step + 1, whole_rows
            )
            clock["seconds"] += time.perf_counter() - started
            clock["tokens"] += n_tokens
            checkpoints.advance(loss, n_tokens)
            metrics = state_of(prepared.model).metrics  # a preference objective's or distillation's, else none
            reporter.step(
                checkpoints.state.step,
                {
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "tokens_per_second": clock["tokens"] / max(clock["seconds"], 1e-9),
                    "memory_bytes": memory_bytes(device),
                    "tokens_seen": checkpoints.state.tokens_seen,
                    **metrics,
                },
            )
            step = checkpoints.state.step
            if step % config.logging.every_steps == 0 or step == total_steps:  # Lightning's loggers: the same runs
                values = {"loss": loss, "lr": lr, **metrics}
                self.log_dict({**{f"lightning/{k}": v for k, v in values.items()}, "step": float(step)}, on_step=True)
            evaluation.step_done(total_steps)
            collector.step_done()
            checkpoints.save_if_due(total_steps, strategy)

    module = TigonModule()
    strategy = tigon_strategy(config, prepared, total_steps, module)  # sharded now: the step-0 evaluation needs it
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=GlobalBatches(order, steps),
        collate_fn=lambda items: [
            collate(items[i : i + training.micro_batch_size]) for i in range(0, len(items), training.micro_batch_size)
        ],
    )
    devices, nodes = lightning_devices(env) if env.distributed else (1, 1)
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        strategy=lightning_strategy(config, env),
        devices=devices,
        num_nodes=nodes,
        max_epochs=1,  # the loader holds exactly the steps left (Lightning counts no step it does not optimize)
        logger=framework_loggers(config, env, reporter) or False,
        log_every_n_steps=1,  # training_step logs every logging.every_steps steps itself
        enable_checkpointing=False,  # tigon's checkpoints (AdapterCheckpoints) instead
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        deterministic=config.training.deterministic or None,  # None: keeps what prepare set
    )
    collector = QuietCollector(training.freeze_gc, device)
    try:
        evaluation.start()
        prepared.model.train()  # as the torch trainer does: a model from from_pretrained comes in eval mode
        collector.start()
        trainer.fit(module, train_dataloaders=loader)
        if isinstance(strategy, LightningDDP):
            prepared.model.to(device)  # Lightning's teardown moved the module to the CPU; evaluate and export here
        evaluation.finish()
    finally:
        collector.close()
        reporter.close()
    return finish_adapter_run(config, prepared, checkpoints, reporter, clock["seconds"], clock["tokens"], strategy)
