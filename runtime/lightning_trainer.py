"""The Lightning adapter: the torch trainer's pieces inside a LightningModule.

    result = train(config)  # with config.trainer == "lightning"

Shared with the torch trainer: `prepare`, `build_optimizer`, `build_scheduler`, the data order
(`GlobalBatchSampler`), the loss (`token_loss_sum`) and its normalization. Optimization is manual:
Lightning's automatic accumulation divides each micro-batch's loss by the number of micro-batches,
which is not the torch trainer's "sum over label tokens of the step / their count" when
micro-batches hold different numbers of label tokens. So one Lightning batch is one global batch
(a list of micro-batches), and `training_step` runs the accumulation, clipping and update itself.
"""

from __future__ import annotations

import time

import torch

from tigon.runtime.config import ConfigError, RunConfig
from tigon.runtime.hf_trainer import OrderSampler, epoch_order, finish_adapter_run, make_reporter, prepare_adapter
from tigon.runtime.reporting import memory_bytes
from tigon.runtime.trainer import (
    TrainResult,
    build_optimizer,
    build_scheduler,
    collate,
    label_tokens,
    plan_steps,
    token_loss_sum,
)


class GlobalBatches(torch.utils.data.Sampler):
    """One item per optimizer step: the indices of its micro-batches, in the torch trainer's order."""

    def __init__(self, order: OrderSampler):
        self.sampler = order  # Lightning calls `batch_sampler.sampler.set_epoch` at each epoch

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        micro = list(self.sampler.batches())
        per_step = self.sampler.sampler.accumulation
        for start in range(0, len(micro), per_step):
            yield [index for batch in micro[start : start + per_step] for index in batch]

    def __len__(self) -> int:
        return self.sampler.sampler.batches_per_epoch


def train_with_lightning(config: RunConfig) -> TrainResult:
    """Train as configured with a Lightning `Trainer` (CPU or one GPU); returns what the torch trainer would."""
    import lightning as L

    if config.training.precision == "fp16":
        raise ConfigError(
            "training.precision: fp16 needs a gradient scaler, which trainer 'lightning' does not run in manual "
            "optimization here; use bf16 or fp32, or trainer 'torch'"
        )
    prepared = prepare_adapter(config, "lightning")
    training, device = config.training, prepared.device
    total_steps, _ = plan_steps(config, len(prepared.train_dataset), 1)
    dataset = prepared.train_dataset
    order = OrderSampler(epoch_order(config, len(dataset)))
    reporter = make_reporter(config, total_steps, device)
    losses: list[float] = []
    clock = {"seconds": 0.0, "tokens": 0}

    class TigonModule(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.model = prepared.model

        def configure_optimizers(self):
            optimizer = build_optimizer(self.model, training)
            return [optimizer], [build_scheduler(optimizer, training, total_steps)]

        def training_step(self, micro_batches, batch_index):
            started = time.perf_counter()
            optimizer, scheduler = self.optimizers(), self.lr_schedulers()
            n_label = sum(label_tokens(batch["labels"]) for batch in micro_batches)
            if n_label == 0:
                raise ValueError(f"step {len(losses) + 1}: no token in the global batch carries a label (all -100)")
            loss_sum = 0.0
            for batch in micro_batches:
                summed = token_loss_sum(
                    self.model, batch, config.model.attn_implementation, self.device, training.precision
                )
                self.manual_backward(summed / n_label)
                loss_sum += float(summed.detach())
            params = [p for p in self.model.parameters() if p.requires_grad]
            max_norm = training.max_grad_norm if training.max_grad_norm is not None else float("inf")
            torch.nn.utils.clip_grad_norm_(params, max_norm)
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            clock["seconds"] += time.perf_counter() - started
            clock["tokens"] += sum(batch["input_ids"].numel() for batch in micro_batches)
            losses.append(loss_sum / n_label)
            reporter.step(
                len(losses),
                {
                    "loss": losses[-1],
                    "lr": lr,
                    "tokens_per_second": clock["tokens"] / max(clock["seconds"], 1e-9),
                    "memory_bytes": memory_bytes(device),
                },
            )

    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=GlobalBatches(order),
        collate_fn=lambda items: [
            collate(items[i : i + training.micro_batch_size]) for i in range(0, len(items), training.micro_batch_size)
        ],
    )
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        max_steps=total_steps,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        deterministic=False,
    )
    try:
        trainer.fit(TigonModule(), train_dataloaders=loader)
    finally:
        reporter.close()
    return finish_adapter_run(config, prepared, losses, clock["seconds"], clock["tokens"])
