"""The Lightning adapter: the torch trainer's pieces inside a LightningModule.

    result = train(config)  # with config.trainer == "lightning"

Shared with the torch trainer: `prepare`, `build_optimizer`, `build_scheduler`, the data order
(`GlobalBatchSampler`), the loss (`token_loss_sum`) and its normalization, and its checkpoints
(`AdapterCheckpoints`: every N steps, last K kept, atomic; resume continues exactly). Optimization is
manual: Lightning's automatic accumulation divides each micro-batch's loss by the number of
micro-batches, which is not the torch trainer's "sum over label tokens of the step / their count" when
micro-batches hold different numbers of label tokens. So one Lightning batch is one rank's share of a
global batch (a list of micro-batches), and `training_step` runs the accumulation, clipping and update
itself. Under torchrun Lightning's DDP strategy runs over the process group `prepare` created; each
rank takes the torch trainer's micro-batches for its rank.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import torch

from tigon.runtime.config import ConfigError, RunConfig
from tigon.runtime.distributed import DistEnv, all_reduce_sum
from tigon.runtime.hf_trainer import AdapterCheckpoints, finish_adapter_run, make_reporter, prepare_adapter
from tigon.runtime.reporting import memory_bytes
from tigon.runtime.trainer import (
    Evaluation,
    GlobalBatchSampler,
    TrainResult,
    build_optimizer,
    build_scheduler,
    collate,
    global_token_counts,
    plan_steps,
    token_loss_sum,
)


class GlobalBatches(torch.utils.data.Sampler):
    """One item per optimizer step: the indices of this rank's micro-batches of it, in the torch trainer's order."""

    def __init__(self, sampler: GlobalBatchSampler, steps: list[tuple[int, int]]):
        self.order, self.steps = sampler, steps

    def __iter__(self):
        for epoch, batch in self.steps:
            yield [index for micro in self.order.micro_batches(epoch, batch) for index in micro]

    def __len__(self) -> int:
        return len(self.steps)


def lightning_devices(env: DistEnv) -> tuple[int, int]:
    """(devices per node, nodes) of a torchrun / PyTorchJob launch, as Lightning's DDP strategy wants them."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    if per_node < 1 or env.world_size % per_node:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE={per_node} does not divide WORLD_SIZE={env.world_size}; launch with torchrun "
            "(--nnodes N --nproc_per_node P starts the same number of processes on every node)"
        )
    return per_node, env.world_size // per_node


def train_with_lightning(config: RunConfig, datasets: str | Path | None = None) -> TrainResult:
    """Train (or resume) as configured with a Lightning `Trainer` (DDP under torchrun); returns what the torch
    trainer would. `datasets`: pre-packed data (`tigon.runtime.packed`), as for the torch trainer."""
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    prepared = prepare_adapter(config, datasets)
    training, device, env = config.training, prepared.device, prepared.env
    total_steps, per_epoch = plan_steps(config, len(prepared.train_dataset), env.world_size)
    checkpoints = AdapterCheckpoints(config, env, per_epoch)
    steps = checkpoints.remaining(total_steps)
    dataset = prepared.train_dataset
    order = GlobalBatchSampler(
        len(dataset),
        training.micro_batch_size,
        training.gradient_accumulation_steps,
        env.world_size,
        env.rank,
        training.seed,
    )
    reporter = make_reporter(config, total_steps, device, enabled=env.is_main, initial_step=checkpoints.state.step)
    evaluation = Evaluation(config, prepared, checkpoints.state, reporter)
    optimizer = build_optimizer(prepared.model, training)
    scheduler = build_scheduler(optimizer, training, total_steps)
    clock = {"seconds": 0.0, "tokens": 0}

    class TigonModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.model = prepared.model

        def configure_optimizers(self):
            return [optimizer], [scheduler]

        def training_step(self, micro_batches, batch_index):
            checkpoints.restore(prepared.model, optimizer, scheduler)  # the first step of a resumed run
            started = time.perf_counter()
            n_label, n_tokens = global_token_counts(micro_batches, env, device, checkpoints.state.step + 1)
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            for index, batch in enumerate(micro_batches):
                last = index == len(micro_batches) - 1
                strategy = self.trainer.strategy
                # DDP averages gradients over the ranks: all-reduce once, on the last micro-batch
                sync = strategy.block_backward_sync() if env.distributed and not last else contextlib.nullcontext()
                with sync:
                    summed = token_loss_sum(
                        self.model, batch, config.model.attn_implementation, self.device, training.precision
                    )
                    self.manual_backward(summed * (env.world_size / n_label))
                loss_sum += summed.detach()
            params = [p for p in self.model.parameters() if p.requires_grad]
            max_norm = training.max_grad_norm if training.max_grad_norm is not None else float("inf")
            torch.nn.utils.clip_grad_norm_(params, max_norm)
            lr = optimizer.param_groups[0]["lr"]
            self.optimizers().step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            all_reduce_sum(loss_sum, env)
            loss = float(loss_sum) / n_label
            clock["seconds"] += time.perf_counter() - started
            clock["tokens"] += n_tokens
            checkpoints.advance(loss, n_tokens)
            reporter.step(
                checkpoints.state.step,
                {
                    "loss": loss,
                    "lr": lr,
                    "tokens_per_second": clock["tokens"] / max(clock["seconds"], 1e-9),
                    "memory_bytes": memory_bytes(device),
                    "tokens_seen": checkpoints.state.tokens_seen,
                },
            )
            evaluation.step_done(total_steps)
            checkpoints.save_if_due(total_steps, prepared.model, optimizer, scheduler)

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
        strategy=DDPStrategy(process_group_backend=torch.distributed.get_backend()) if env.distributed else "auto",
        devices=devices,
        num_nodes=nodes,
        max_steps=len(steps),
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,  # tigon's checkpoints (AdapterCheckpoints) instead
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        deterministic=False,
    )
    try:
        evaluation.start()
        if steps:  # a run resumed from its last checkpoint has nothing left to train
            trainer.fit(TigonModule(), train_dataloaders=loader)
        checkpoints.restore(prepared.model, optimizer, scheduler)  # the final evaluation and export use its weights
        evaluation.finish()
    finally:
        reporter.close()
    return finish_adapter_run(config, prepared, checkpoints, reporter, clock["seconds"], clock["tokens"])
