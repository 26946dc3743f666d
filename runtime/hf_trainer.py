"""The Hugging Face `Trainer` adapter: the torch trainer's pieces driven by transformers' loop.

    result = train(config)  # with config.trainer == "hf"

Shared with the torch trainer: `prepare` (model, tokenizer, packed data), `build_optimizer` and
`build_scheduler` (passed as `optimizers=`), the data order (`GlobalBatchSampler`), `evaluate`.
The loss is the model's own causal-LM loss, which transformers (5.x) sums over label tokens and
divides by `num_items_in_batch`: the label tokens (after the shift) of all micro-batches of the
step, exactly the torch trainer's normalization. HF's checkpointing and reporting stay off; the
per-step losses go through tigon's Reporter. `finish_adapter_run` is shared with the Lightning one.
Under torchrun the HF adapter runs DDP (accelerate wraps the model): `epoch_order` deals the
micro-batches of each global batch to the ranks as the torch trainer does, and each step's loss is
summed over the ranks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from tigon.runtime.config import ConfigError, RunConfig
from tigon.runtime.distributed import all_reduce_sum, barrier, check_strategy, env_from_environ
from tigon.runtime.reporting import Reporter, memory_bytes, summary_text, write_summary
from tigon.runtime.trainer import (
    GlobalBatchSampler,
    Prepared,
    TrainResult,
    build_optimizer,
    build_scheduler,
    collate,
    evaluate,
    generation_examples,
    plan_steps,
    prepare,
)


def validate_for_adapter(config: RunConfig, name: str) -> None:
    """What neither adapter honours (yet), named with the fix; the rest is checked as for the torch trainer."""
    check_strategy(config)  # fsdp and deepspeed need trainer 'torch'
    if env_from_environ().distributed and name != "hf":
        raise ConfigError(
            f"trainer: {name!r} runs one process only in this build; use trainer 'torch' (DDP, FSDP, DeepSpeed) "
            "or 'hf' (DDP) under torchrun"
        )
    if config.checkpoint.every_steps > 0:
        raise ConfigError(
            f"checkpoint.every_steps: trainer {name!r} does not write tigon checkpoints (resume needs them); "
            "set checkpoint.every_steps: 0 or use trainer 'torch'"
        )
    if config.eval.every_steps > 0:
        raise ConfigError(
            f"eval.every_steps: trainer {name!r} evaluates only at the end; set eval.every_steps: 0 or use 'torch'"
        )


def prepare_adapter(config: RunConfig, name: str) -> Prepared:
    validate_for_adapter(config, name)
    # `prepare` checks everything else the torch trainer checks; only the trainer name differs.
    return prepare(config.model_copy(update={"trainer": "torch"}))


def epoch_order(config: RunConfig, n_items: int, world_size: int = 1) -> GlobalBatchSampler:
    """The torch trainer's order as one stream of micro-batches, global batch after global batch.

    With W ranks, dealing micro-batch k of the stream to rank k % W (what accelerate's BatchSamplerShard
    does under DDP) gives rank r micro-batches r, r + W, ... of each global batch: the torch trainer's split.
    """
    training = config.training
    return GlobalBatchSampler(
        n_items, training.micro_batch_size, training.gradient_accumulation_steps * world_size, 1, 0, training.seed
    )


class OrderSampler(torch.utils.data.Sampler):
    """The torch trainer's data order, flattened: the micro-batches of each full global batch of the epoch."""

    def __init__(self, sampler: GlobalBatchSampler):
        self.sampler, self.epoch = sampler, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def batches(self):
        for batch in range(self.sampler.batches_per_epoch):
            yield from self.sampler.micro_batches(self.epoch, batch)

    def __iter__(self):
        for micro in self.batches():
            yield from micro

    def __len__(self) -> int:
        return self.sampler.batches_per_epoch * self.sampler.global_batch


def finish_adapter_run(
    config: RunConfig, prepared: Prepared, losses: list[float], train_seconds: float, tokens: int
) -> TrainResult:
    """Evaluate once at the end, export, and write the summary as the torch trainer does."""
    from tigon.runtime import checkpoint as ckpt

    run_dir = Path(config.logging.run_dir)
    model, device = prepared.model, prepared.device
    eval_history = []
    if prepared.eval_dataset is not None and config.eval.metrics:
        examples = generation_examples(config, prepared.tokenizer) if "exact_match" in config.eval.metrics else None
        metrics = evaluate(model, prepared.eval_dataset, prepared.tokenizer, config, prepared.env, device, examples)
        eval_history.append({"step": len(losses), **metrics})
    export_dir = None
    if config.checkpoint.export:
        if prepared.env.is_main:
            export_dir = str(
                ckpt.export_model(
                    model, prepared.tokenizer, run_dir / ckpt.EXPORT, merge_lora=config.checkpoint.merge_lora
                )
            )
        barrier(prepared.env)
    patch = getattr(model, "tigon_patch_report", None)
    result = TrainResult(
        run_dir=str(run_dir),
        steps=len(losses),
        losses=list(losses),
        final_loss=losses[-1] if losses else None,
        eval_metrics={k: v for k, v in (eval_history[-1] if eval_history else {}).items() if k != "step"},
        export_dir=export_dir,
        tokens_per_second=tokens / train_seconds if train_seconds > 0 else 0.0,
        peak_memory_bytes=memory_bytes(device),
        eval_history=eval_history,
        device=str(device),
        world_size=prepared.env.world_size,
        tensorboard_dir=str(run_dir / "tensorboard") if config.logging.tensorboard else None,
        train_seconds=train_seconds,
        kernels=str(patch) if patch is not None else None,
    )
    config_json = json.loads(config.model_dump_json())
    if prepared.env.is_main:
        ckpt.atomic_write_text(run_dir / "config.json", json.dumps(config_json, indent=2) + "\n")
        write_summary(run_dir, {**result.__dict__, "config": config_json})
        print(summary_text(result), flush=True)
    return result


def make_reporter(config: RunConfig, total_steps: int, device: torch.device, enabled: bool = True) -> Reporter:
    return Reporter(
        config.logging.run_dir,
        total_steps,
        enabled=enabled,
        progress_bar=config.logging.progress_bar,
        tensorboard=config.logging.tensorboard,
        log_every=config.logging.every_steps,
        device=device,
    )


def train_with_hf(config: RunConfig) -> TrainResult:
    """Train as configured with transformers' `Trainer`; returns what the torch trainer would."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from tigon.runtime.data import model_inputs

    prepared = prepare_adapter(config, "hf")
    training, device, env = config.training, prepared.device, prepared.env
    total_steps, _ = plan_steps(config, len(prepared.train_dataset), env.world_size)
    optimizer = build_optimizer(prepared.model, training)
    scheduler = build_scheduler(optimizer, training, total_steps)
    order = OrderSampler(epoch_order(config, len(prepared.train_dataset), env.world_size))
    attn = config.model.attn_implementation

    def collator(items: list[dict]) -> dict:
        return {**model_inputs(collate(items), attn), "use_cache": False}

    class TigonHFTrainer(Trainer):
        step_loss = 0.0
        step_tokens = 0

        def _get_train_sampler(self, train_dataset=None):
            return order

        def training_step(self, model, inputs, num_items_in_batch=None):
            # `num_items_in_batch` makes each micro-batch's loss sum / (label tokens of the whole step), so
            # the step's loss is the sum of the micro-batch values, as in the torch trainer.
            if num_items_in_batch is None:
                raise RuntimeError("transformers did not pass num_items_in_batch; the loss would be mis-normalized")
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.step_loss += float(loss)
            self.step_tokens += int(inputs["input_ids"].numel())
            return loss

    losses: list[float] = []
    reporter = make_reporter(config, total_steps, device, enabled=env.is_main)
    clock = {"started": time.perf_counter(), "seconds": 0.0, "tokens": 0}

    class RecordLosses(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock["started"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            clock["seconds"] += time.perf_counter() - clock["started"]
            # Under DDP each rank's share is (its token loss sum / the step's label tokens on all ranks) x world
            # size (HF scales it so that DDP's gradient mean comes out right): the step's loss is the sum / W.
            totals = torch.tensor([trainer.step_loss, trainer.step_tokens], dtype=torch.float64, device=device)
            all_reduce_sum(totals, env)
            loss, trainer.step_loss, trainer.step_tokens = float(totals[0]) / env.world_size, 0.0, 0
            clock["tokens"] += int(totals[1])
            losses.append(loss)
            reporter.step(
                state.global_step,
                {
                    "loss": loss,
                    "lr": scheduler.get_last_lr()[0],
                    "tokens_per_second": clock["tokens"] / max(clock["seconds"], 1e-9),
                    "memory_bytes": memory_bytes(device),
                },
            )

    args = TrainingArguments(
        output_dir=str(Path(config.logging.run_dir) / "hf"),
        per_device_train_batch_size=training.micro_batch_size,
        gradient_accumulation_steps=training.gradient_accumulation_steps,
        max_steps=total_steps,
        max_grad_norm=training.max_grad_norm or 0.0,  # 0 turns HF's clipping off
        seed=training.seed,
        bf16=training.precision == "bf16",
        fp16=training.precision == "fp16",
        use_cpu=device.type == "cpu",
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
    )
    trainer = TigonHFTrainer(
        model=prepared.model,
        args=args,
        train_dataset=prepared.train_dataset,
        data_collator=collator,
        optimizers=(optimizer, scheduler),
        callbacks=[RecordLosses()],
    )
    try:
        trainer.train()
    finally:
        reporter.close()
    return finish_adapter_run(config, prepared, losses, clock["seconds"], clock["tokens"])
