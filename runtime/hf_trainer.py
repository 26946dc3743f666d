"""The Hugging Face `Trainer` adapter: the torch trainer's pieces driven by transformers' loop.

    result = train(config)  # with config.trainer == "hf"

Shared with the torch trainer: `prepare` (model, tokenizer, packed data), `build_optimizer` and
`build_scheduler` (passed as `optimizers=`), the data order (`GlobalBatchSampler`), `evaluate`.
The loss is the model's own causal-LM loss, which transformers (5.x) sums over label tokens and
divides by `num_items_in_batch`: the label tokens (after the shift) of all micro-batches of the
step, exactly the torch trainer's normalization. HF's own checkpointing and reporting stay off:
`AdapterCheckpoints` writes the torch trainer's checkpoints (every N steps, last K kept, atomic) from a
callback and resumes from them exactly, and the per-step losses go through tigon's Reporter. Under
torchrun the HF adapter runs DDP (accelerate wraps the model): `epoch_order` deals the micro-batches
of each global batch to the ranks as the torch trainer does, and each step's loss is summed over the
ranks. `AdapterCheckpoints`, `OrderSampler` and `finish_adapter_run` are shared with the Lightning one.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

import torch
from torch import nn

from tigon.runtime import checkpoint as ckpt
from tigon.runtime.config import RunConfig
from tigon.runtime.distributed import DistEnv, all_reduce_sum, barrier
from tigon.runtime.reporting import Reporter, memory_bytes, summary_text, write_summary
from tigon.runtime.trainer import (
    Evaluation,
    GlobalBatchSampler,
    Prepared,
    TrainResult,
    build_optimizer,
    build_scheduler,
    check_config,
    check_resumable,
    collate,
    plan_steps,
    prepare,
)

logger = logging.getLogger("tigon.runtime")


def prepare_adapter(config: RunConfig, datasets: str | Path | None = None) -> Prepared:
    """`prepare` for an adapter (pre-packed `datasets` too), after the checks for this adapter's config."""
    check_config(config)
    return prepare(config.model_copy(update={"trainer": "torch"}), datasets)


def epoch_order(config: RunConfig, n_items: int, world_size: int = 1) -> GlobalBatchSampler:
    """The torch trainer's order as one stream of micro-batches, global batch after global batch.

    With W ranks, dealing micro-batch k of the stream to rank k % W (what accelerate's BatchSamplerShard
    does under DDP) gives rank r micro-batches r, r + W, ... of each global batch: the torch trainer's split.
    """
    training = config.training
    return GlobalBatchSampler(
        n_items, training.micro_batch_size, training.gradient_accumulation_steps * world_size, 1, 0, training.seed
    )


def positions(state: ckpt.TrainState, per_epoch: int, steps: int) -> list[tuple[int, int]]:
    """(epoch, global batch) of the next `steps` optimizer steps after `state`, as the torch trainer walks them."""
    epoch, batch, result = state.epoch, state.batches_in_epoch, []
    for _ in range(steps):
        if batch >= per_epoch:
            epoch, batch = epoch + 1, 0
        result.append((epoch, batch))
        batch += 1
    return result


class OrderSampler(torch.utils.data.Sampler):
    """The torch trainer's data order from a run's position on: the micro-batches of the given global batches."""

    def __init__(self, sampler: GlobalBatchSampler, steps: list[tuple[int, int]]):
        self.sampler, self.steps = sampler, steps

    def batches(self):
        for epoch, batch in self.steps:
            yield from self.sampler.micro_batches(epoch, batch)

    def __iter__(self):
        for micro in self.batches():
            yield from micro

    def __len__(self) -> int:
        return len(self.steps) * self.sampler.global_batch


class AdapterCheckpoints:
    """The torch trainer's checkpoints for an adapter: where the run stands, resume, and `step-N` every N steps.

    Construct on every rank before training: it finds the newest checkpoint (or clears stale ones when not
    resuming). `restore` loads its model, optimizer, schedule and RNG states just before the first step;
    `advance` records each optimizer step, and `save_if_due` writes a checkpoint when one is due (on every rank).
    """

    def __init__(self, config: RunConfig, env: DistEnv, per_epoch: int):
        from tigon.runtime import storage

        self.config, self.env, self.per_epoch = config, env, per_epoch
        self.run_dir = Path(config.logging.run_dir)
        self.remote = storage.run_storage(config.checkpoint.remote_dir)
        self.config_json = config.model_dump_json(indent=2)
        self.state = ckpt.TrainState(world_size=env.world_size)
        self.latest: Path | None = None
        if config.checkpoint.resume:
            storage.fetch_for_resume(config.checkpoint.remote_dir, self.run_dir, env.local_rank, lambda: barrier(env))
            self.latest = ckpt.latest_checkpoint(self.run_dir)
        if self.latest is not None:
            check_resumable(self.latest, config)
            self.state = ckpt.TrainState(**json.loads((self.latest / ckpt.STATE_FILE).read_text()))
            self.state.world_size = env.world_size
        else:
            stale = ckpt.checkpoint_root(self.run_dir)
            if env.is_main and stale.is_dir():
                logger.warning("starting over (no resume): removing the earlier run's checkpoints in %s", stale)
                shutil.rmtree(stale)
            if env.is_main and self.remote is not None:
                self.remote.clear_checkpoints()
        barrier(env)
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.atomic_write_text(self.run_dir / "config.json", self.config_json + "\n")
        self.resumed_from = self.state.step if self.latest is not None else None
        self.pending = self.latest is not None  # states still to load before the first step

    def remaining(self, total_steps: int) -> list[tuple[int, int]]:
        return positions(self.state, self.per_epoch, max(0, total_steps - self.state.step))

    def restore(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, scaler=None) -> None:
        """Load the checkpoint's states once; call right before the first step (after any data loader started,
        which draws from the RNG)."""
        if self.pending:
            self.pending = False
            ckpt.load_checkpoint(self.latest, model, optimizer, scheduler, self.env, scaler)
            if self.env.is_main:
                logger.info("resumed from %s (step %d, epoch %d)", self.latest, self.state.step, self.state.epoch)

    def advance(self, loss: float, tokens: int) -> None:
        """Record an optimizer step: the position, the tokens and the loss."""
        state = self.state
        if state.batches_in_epoch >= self.per_epoch:
            state.epoch, state.batches_in_epoch = state.epoch + 1, 0
        state.step += 1
        state.batches_in_epoch += 1
        state.tokens_seen += tokens
        state.losses.append(loss)

    def save_if_due(self, total_steps: int, model: nn.Module, optimizer, scheduler, scaler=None) -> None:
        """Write `step-N` when `checkpoint.every_steps` (or the last step) says so; call on every rank."""
        state = self.state
        every, keep = self.config.checkpoint.every_steps, self.config.checkpoint.keep_last
        if every > 0 and (state.step % every == 0 or state.step == total_steps):
            saved = ckpt.save_checkpoint(
                self.run_dir, state, model, optimizer, scheduler, self.env, keep, scaler, self.config_json
            )
            if self.env.is_main and self.remote is not None:
                self.remote.upload_checkpoint(saved, keep)


def finish_adapter_run(
    config: RunConfig,
    prepared: Prepared,
    checkpoints: AdapterCheckpoints,
    reporter: Reporter,
    train_seconds: float,
    tokens: int,
) -> TrainResult:
    """Export, and write the loss curve and summary as the torch trainer does (after `Evaluation.finish`)."""
    run_dir = Path(config.logging.run_dir)
    model, device, state = prepared.model, prepared.device, checkpoints.state
    losses, eval_history = state.losses, state.eval_history
    export_dir = export_url = None
    if config.checkpoint.export:
        if prepared.env.is_main:
            export_dir = str(
                ckpt.export_model(
                    model, prepared.tokenizer, run_dir / ckpt.EXPORT, merge_lora=config.checkpoint.merge_lora
                )
            )
            if checkpoints.remote is not None:
                export_url = checkpoints.remote.upload_export(export_dir)
        barrier(prepared.env)
    latest = ckpt.latest_checkpoint(run_dir)
    patch = getattr(model, "tigon_patch_report", None)
    result = TrainResult(
        run_dir=str(run_dir),
        steps=state.step,
        losses=list(losses),
        final_loss=losses[-1] if losses else None,
        eval_metrics={k: v for k, v in (eval_history[-1] if eval_history else {}).items() if k != "step"},
        export_dir=export_dir,
        tokens_per_second=tokens / train_seconds if train_seconds > 0 else 0.0,
        peak_memory_bytes=memory_bytes(device),
        resumed_from_step=checkpoints.resumed_from,
        eval_history=eval_history,
        device=str(device),
        world_size=prepared.env.world_size,
        checkpoint_dir=str(latest) if latest is not None else None,
        tensorboard_dir=str(run_dir / "tensorboard") if config.logging.tensorboard else None,
        train_seconds=train_seconds,
        kernels=str(patch) if patch is not None else None,
        export_url=export_url,
        data_manifest=prepared.data_manifest,
    )
    if prepared.env.is_main:
        reporter.plot(result.losses, result.eval_history)
        write_summary(run_dir, {**result.__dict__, "config": json.loads(checkpoints.config_json)})
        print(summary_text(result), flush=True)
    return result


def make_reporter(
    config: RunConfig, total_steps: int, device: torch.device, enabled: bool = True, initial_step: int = 0
) -> Reporter:
    return Reporter(
        config.logging.run_dir,
        total_steps,
        enabled=enabled,
        progress_bar=config.logging.progress_bar,
        tensorboard=config.logging.tensorboard,
        log_every=config.logging.every_steps,
        initial_step=initial_step,
        device=device,
    )


def train_with_hf(config: RunConfig, datasets: str | Path | None = None) -> TrainResult:
    """Train (or resume) as configured with transformers' `Trainer`; returns what the torch trainer would.
    `datasets`: pre-packed data (`tigon.runtime.packed`), as for the torch trainer."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from tigon.runtime.data import model_inputs

    prepared = prepare_adapter(config, datasets)
    training, device, env = config.training, prepared.device, prepared.env
    total_steps, per_epoch = plan_steps(config, len(prepared.train_dataset), env.world_size)
    checkpoints = AdapterCheckpoints(config, env, per_epoch)
    steps = checkpoints.remaining(total_steps)
    optimizer = build_optimizer(prepared.model, training)
    scheduler = build_scheduler(optimizer, training, total_steps)
    order = OrderSampler(epoch_order(config, len(prepared.train_dataset), env.world_size), steps)
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

    reporter = make_reporter(config, total_steps, device, enabled=env.is_main, initial_step=checkpoints.state.step)
    evaluation = Evaluation(config, prepared, checkpoints.state, reporter)
    clock = {"started": time.perf_counter(), "seconds": 0.0, "tokens": 0}

    def scaler():
        return getattr(trainer.accelerator, "scaler", None)  # fp16 on a GPU: its loss scale is resumed too

    class RecordLosses(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            checkpoints.restore(prepared.model, optimizer, scheduler, scaler())  # the first step of a resumed run
            clock["started"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            clock["seconds"] += time.perf_counter() - clock["started"]
            # Under DDP each rank's share is (its token loss sum / the step's label tokens on all ranks) x world
            # size (HF scales it so that DDP's gradient mean comes out right): the step's loss is the sum / W.
            totals = torch.tensor([trainer.step_loss, trainer.step_tokens], dtype=torch.float64, device=device)
            all_reduce_sum(totals, env)
            loss, trainer.step_loss, trainer.step_tokens = float(totals[0]) / env.world_size, 0.0, 0
            clock["tokens"] += int(totals[1])
            lr = scheduler.get_last_lr()[0]
            checkpoints.advance(loss, int(totals[1]))
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
            checkpoints.save_if_due(total_steps, prepared.model, optimizer, scheduler, scaler())

    args = TrainingArguments(
        output_dir=str(Path(config.logging.run_dir) / "hf"),
        per_device_train_batch_size=training.micro_batch_size,
        gradient_accumulation_steps=training.gradient_accumulation_steps,
        max_steps=len(steps),
        max_grad_norm=training.max_grad_norm or 0.0,  # 0 turns HF's clipping off
        seed=training.seed,
        bf16=training.precision == "bf16",
        fp16=training.precision == "fp16",
        use_cpu=device.type == "cpu",
        report_to="none",
        save_strategy="no",  # tigon's checkpoints (AdapterCheckpoints) instead
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
        evaluation.start()
        if steps:  # a run resumed from its last checkpoint has nothing left to train
            trainer.train()
        checkpoints.restore(prepared.model, optimizer, scheduler)  # the final evaluation and export use its weights
        evaluation.finish()
    finally:
        reporter.close()
    return finish_adapter_run(config, prepared, checkpoints, reporter, clock["seconds"], clock["tokens"])
