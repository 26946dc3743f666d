"""The Hugging Face `Trainer` adapter: the torch trainer's pieces driven by transformers' loop.

    result = train(config)  # with config.trainer == "hf"

Shared with the torch trainer: `prepare` (model, tokenizer, packed data), `build_optimizer` and
`build_scheduler` (the Trainer's `create_optimizer` / `create_scheduler`), the data order
(`GlobalBatchSampler`), `evaluate`, and the parallelism's checkpoints and export (a strategy of
`tigon.runtime.parallel` constructed around what the Trainer built). The loss is the model's own
causal-LM loss, which transformers (5.x) sums over label tokens and divides by `num_items_in_batch`:
the label tokens (after the shift) of all micro-batches of the step, exactly the torch trainer's
normalization. HF's own checkpointing stays off: `AdapterCheckpoints` writes the torch trainer's
checkpoints (every N steps, last K kept, atomic) from a callback and resumes from them exactly. The
per-step losses go through tigon's Reporter; HF's own logging reports, under `hf/`, to the same
TensorBoard directory and wandb and MLflow runs (`logging.trackers`).

The preference objectives and distillation use the torch trainer's step (`post_training.ObjectiveStep`):
`get_batch_samples` counts the step's pairs or completion tokens over the ranks, and `compute_loss` returns
each micro-batch's share of the step's loss, already normalized (HF's division by the accumulation steps
stays off); the step's metrics (TRL's names, or distillation's two terms) go to the Reporter and, averaged
over HF's logging interval, to HF's own logs.

Parallelism under torchrun: `ddp`, accelerate wraps the model in DDP; `deepspeed`,
`TrainingArguments(deepspeed=...)` with the config `deepspeed_engine.deepspeed_config` builds from the
run, so accelerate creates the engine around tigon's optimizer and HF steps tigon's schedule; `fsdp`,
tigon shards the model itself (`parallel.shard_model`: the torch trainer's decoder-layer units, fp32
gradient reduction, rank 0's weights) and hands it to the Trainer as already wrapped (`ShardedModel`),
so accelerate neither wraps it in DDP nor shards it again. In every case `epoch_order` deals the
micro-batches of each global batch to the ranks as the torch trainer does, and each step's loss is
summed over the ranks. `AdapterCheckpoints` and `finish_adapter_run` (`tigon.runtime.adapters`) are shared
with the Lightning adapter.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from pathlib import Path
from statistics import mean

import torch
from torch import nn

from tigon.runtime.adapters import AdapterCheckpoints, finish_adapter_run, prepare_adapter
from tigon.runtime.batches import GlobalBatchSampler, autocast, balancing_costs, collate, static_shapes
from tigon.runtime.collector import QuietCollector
from tigon.runtime.config import RunConfig
from tigon.runtime.data import model_inputs
from tigon.runtime.deepspeed_engine import deepspeed_config, import_deepspeed, trainable_elements
from tigon.runtime.distributed import DistEnv, all_reduce_sum
from tigon.runtime.evaluation import Evaluation
from tigon.runtime.objectives import state_of
from tigon.runtime.optim import build_optimizer, build_scheduler
from tigon.runtime.parallel import DDPStrategy, shard_model
from tigon.runtime.post_training import ObjectiveStep, prepare_objective
from tigon.runtime.reporting import make_reporter, memory_bytes
from tigon.runtime.run import Prepared, TrainResult, plan_steps
from tigon.runtime.strategies import strategy_class
from tigon.runtime.torch_trainer import train_prepared


def epoch_order(config: RunConfig, dataset, world_size: int = 1, log: bool = False) -> GlobalBatchSampler:
    """The torch trainer's order as one stream of micro-batches, global batch after global batch.

    With W ranks, dealing micro-batch k of the stream to rank k % W (what accelerate's BatchSamplerShard
    does under DDP) gives rank r micro-batches r, r + W, ... of each global batch: the torch trainer's split,
    balanced micro-batches included (`balancing_costs`, which says so where `log`).
    """
    training = config.training
    slots = training.gradient_accumulation_steps * world_size
    return GlobalBatchSampler(
        len(dataset),
        training.micro_batch_size,
        slots,
        1,
        0,
        training.seed,
        balancing_costs(config, dataset, slots, log),
    )


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


class ShardedModel(nn.Module):
    """A model `shard_model` sharded with FSDP2, as the Trainer's wrapped model.

    The Trainer asks accelerate to prepare only a model it has not wrapped itself, so accelerate neither wraps
    this one in DDP nor shards it again (accelerate's own FSDP2 runs on GPUs only, with other units and bf16
    gradient reduction). Between the micro-batches of a step accelerate enters the wrapped model's `no_sync`,
    DDP's name for deferring the gradient reduction: here FSDP2's reduce-scatter waits for the last micro-batch,
    unless `accumulate_sharded` (`parallelism.accumulate_sharded`) has it run after every one.
    """

    def __init__(self, module: nn.Module, accumulate_sharded: bool = False):
        super().__init__()
        self.module = module
        self.accumulate_sharded = accumulate_sharded

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        if self.accumulate_sharded:
            yield
            return
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)


def deepspeed_arguments(config: RunConfig, env: DistEnv, device: torch.device, model: nn.Module) -> dict:
    """`TrainingArguments(deepspeed=...)`: the config `deepspeed_config` builds from the run and `model`, without its
    optimizer section (the Trainer hands DeepSpeed tigon's optimizer); none unless the strategy is deepspeed."""
    if config.parallelism.strategy != "deepspeed":
        return {}
    import_deepspeed(device, config.training.precision)  # DeepSpeed's CPU accelerator on a CPU, before transformers
    trainable = trainable_elements(model)
    return {"deepspeed": deepspeed_config(config, env.world_size, trainable, optimizer_section=False)}


@contextlib.contextmanager
def trainer_process_state():
    """Leave behind none of the process-wide state a Trainer sets: accelerate's shared state and the ACCELERATE_*
    variables it adds (the next Trainer in this process would inherit this one's parallelism, e.g. DeepSpeed), and
    transformers' ZeRO-3 flag (every model built under it is partitioned with `deepspeed.zero.Init`, a collective:
    the export's plain copy on rank 0 too, so it is cleared before the export)."""
    from accelerate.state import AcceleratorState
    from transformers.integrations import unset_hf_deepspeed_config

    saved = {name: value for name, value in os.environ.items() if name.startswith("ACCELERATE_")}
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        unset_hf_deepspeed_config()
        for name in [name for name in os.environ if name.startswith("ACCELERATE_") and name not in saved]:
            del os.environ[name]
        os.environ.update(saved)


def framework_trackers(config: RunConfig, env: DistEnv) -> list:
    """HF's TensorBoard and MLflow callbacks, writing into the run's TensorBoard directory and MLflow run (rank 0).

    HF's MLflow callback is set up as is the run tigon opened: tigon logged the config as parameters already,
    and HF's own would clash with them on resume (the Trainer then runs only the remaining steps, so its
    `max_steps` differs, and MLflow refuses to change a parameter). wandb needs nothing: HF's callback finds
    tigon's run in `wandb.run` (`report_to`)."""
    names = config.logging.active_trackers
    if not env.is_main:
        return []
    callbacks = []
    if "tensorboard" in names:
        from torch.utils.tensorboard import SummaryWriter
        from transformers.integrations import TensorBoardCallback

        callbacks.append(
            TensorBoardCallback(tb_writer=SummaryWriter(str(Path(config.logging.run_dir) / "tensorboard")))
        )
    if "mlflow" in names:
        from transformers.integrations import MLflowCallback

        class RunMLflowCallback(MLflowCallback):
            def setup(self, args, state, model):
                self._async_log, self._initialized = False, True

        callbacks.append(RunMLflowCallback())
    return callbacks


def training_arguments(config: RunConfig, env: DistEnv, device: torch.device, max_steps: int, model: nn.Module):
    """The Trainer's arguments: the run's batch shape, clipping, precision and parallelism; HF's own checkpoints and
    evaluation off (tigon's instead). HF's own logging reports to the run's trackers, its metrics under `hf/`
    (wandb here; TensorBoard and MLflow through `framework_trackers`). `model` sizes DeepSpeed's reduction bucket."""
    from transformers import TrainingArguments

    training = config.training
    report_to = ["wandb"] if "wandb" in config.logging.active_trackers else []  # the others: framework_trackers
    logs = bool(config.logging.active_trackers)
    return TrainingArguments(
        output_dir=str(Path(config.logging.run_dir) / "hf"),
        per_device_train_batch_size=training.micro_batch_size,
        gradient_accumulation_steps=training.gradient_accumulation_steps,
        max_steps=max_steps,
        max_grad_norm=training.max_grad_norm or 0.0,  # 0 turns HF's clipping off
        seed=training.seed,
        bf16=training.precision == "bf16",
        fp16=training.precision == "fp16",
        use_cpu=device.type == "cpu",
        report_to=report_to or "none",
        run_name=config.name,
        save_strategy="no",  # tigon's checkpoints (AdapterCheckpoints) instead
        eval_strategy="no",
        logging_strategy="steps" if logs else "no",
        logging_steps=config.logging.every_steps,
        disable_tqdm=True,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        **deepspeed_arguments(config, env, device, model),
    )


def attached_strategy(trainer, prepared: Prepared, config: RunConfig) -> DDPStrategy:
    """The run's strategy around what the Trainer prepared (once `train` has wrapped the model), for the checkpoints
    and the export: the model (sharded in place, or inside DeepSpeed's engine), tigon's optimizer and schedule."""
    module, env, device = prepared.model, prepared.env, prepared.device
    optimizer, scheduler = trainer.tigon_optimizer, trainer.lr_scheduler
    if config.parallelism.strategy == "deepspeed":
        engine = trainer.model_wrapped
        return strategy_class(config)(module, engine, engine.optimizer, scheduler, config, env, device)
    scaler = getattr(trainer.accelerator, "scaler", None)  # fp16 on a GPU: its loss scale is checkpointed too
    return strategy_class(config)(module, module, optimizer, scheduler, config, env, device, scaler)


def train_with_hf(config: RunConfig, datasets: str | Path | None = None) -> TrainResult:
    """Train (or resume) as configured with transformers' `Trainer`; returns what the torch trainer would.
    `datasets`: pre-packed data (`tigon.runtime.packed`), as for the torch trainer."""
    from transformers import PrinterCallback, Trainer, TrainerCallback

    from tigon.kernels.patching.causal_lm import has_fused_loss

    prepared = prepare_adapter(config, datasets)
    training, device, env = config.training, prepared.device, prepared.env
    total_steps, per_epoch = plan_steps(config, len(prepared.train_dataset), env.world_size, env.is_main)
    checkpoints = AdapterCheckpoints(config, env, per_epoch)
    steps = checkpoints.remaining(total_steps)
    if not steps:  # resumed at its last step: load that checkpoint, evaluate and export as the torch trainer does
        return train_prepared(config, prepared)
    objective = config.objective.type != "sft"  # a preference objective or distillation: `ObjectiveStep`'s loss
    prepare_objective(config, prepared)  # the reference or the teacher, before the model is sharded or wrapped
    sharded = config.parallelism.strategy == "fsdp"
    if sharded:
        shard_model(prepared.model, config, env, device)  # the torch trainer's FSDP2 units and mixed precision
    order = OrderSampler(epoch_order(config, prepared.train_dataset, env.world_size, log=env.is_main), steps)
    attn = config.model.attn_implementation
    positions = config.kernels.skip_unlabelled and has_fused_loss(prepared.model)
    whole_rows = static_shapes(config, prepared.train_dataset)

    def collator(items: list[dict]) -> dict:
        if objective:  # the objective's code picks the model's inputs (pairs as rows, the labels as targets)
            return collate(items)
        inputs = model_inputs(collate(items), attn, loss_positions=positions, whole_rows=whole_rows)
        return {**inputs, "use_cache": False}

    class TigonHFTrainer(Trainer):
        step_loss = 0.0
        step_tokens = 0
        tigon_optimizer = None  # the optimizer tigon built (the Trainer's may be accelerate's wrapper of it)
        objective_step: ObjectiveStep | None = None  # the objective's step in progress

        def log(self, logs, start_time=None):
            if "loss" in logs and unlogged:  # a training log: the objective's metrics, averaged as HF's loss is
                names = sorted({name for step in unlogged for name in step})  # KTO's: the kinds a step held
                logs = {**logs, **{name: mean(step[name] for step in unlogged if name in step) for name in names}}
                unlogged.clear()
            # HF's own values go to the same trackers as tigon's, under hf/ so that neither overwrites the other
            super().log({f"hf/{name}": value for name, value in logs.items()}, start_time)

        def get_batch_samples(self, epoch_iterator, num_batches, device):
            if not objective:
                return super().get_batch_samples(epoch_iterator, num_batches, device)
            # The step's micro-batches, counted over the ranks: the count HF hands each compute_loss
            batches = list(itertools.islice(epoch_iterator, num_batches))
            self.objective_step = ObjectiveStep(batches, config, env, device, checkpoints.state.step + 1)
            return batches, self.objective_step.count

        def _prepare_inputs(self, inputs):
            # An objective's batch stays as collated: its code moves it (HF's DeepSpeed path would cast the float64
            # reference log-probs to the engine's dtype)
            return inputs if objective else super()._prepare_inputs(inputs)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if not objective:
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            # the torch trainer's loss for this micro-batch, normalized over the step (under FSDP2: the sharded root)
            return self.objective_step.loss(model.module if isinstance(model, ShardedModel) else model, inputs)

        def _get_train_sampler(self, train_dataset=None):
            return order

        def _wrap_model(self, model, training=True, dataloader=None):
            if sharded and training and not isinstance(model, ShardedModel):
                return ShardedModel(model, config.parallelism.accumulate_sharded)
            return super()._wrap_model(model, training, dataloader)

        def _move_model_to_device(self, model, device):
            if not sharded:  # the shards are in place already (on the CPU under cpu_offload: `.to` would move them)
                super()._move_model_to_device(model, device)

        def create_optimizer(self, model=None):
            if self.optimizer is None:
                self.optimizer = self.tigon_optimizer = build_optimizer(self.model, training)
            return self.optimizer

        def create_scheduler(self, num_training_steps: int, optimizer=None):
            if self.lr_scheduler is None:
                self.lr_scheduler = build_scheduler(self.tigon_optimizer, training, total_steps)
            return self.lr_scheduler

        def autocast_smart_context_manager(self, cache_enabled: bool | None = True):
            # The torch trainer's autocast around each forward, whatever wraps the model (accelerate adds its own
            # under DDP only; an FSDP2 or DeepSpeed model would otherwise run without it).
            return autocast(device, training.precision)

        def training_step(self, model, inputs, num_items_in_batch=None):
            # `num_items_in_batch` makes each micro-batch's loss sum / (label tokens of the whole step), so
            # the step's loss is the sum of the micro-batch values, as in the torch trainer.
            if num_items_in_batch is None:
                raise RuntimeError("transformers did not pass num_items_in_batch; the loss would be mis-normalized")
            loss = super().training_step(model, inputs, num_items_in_batch)
            if not objective:
                self.step_loss += float(loss)
                self.step_tokens += int(inputs["input_ids"].numel())
            return loss

        def finish_step(self) -> tuple[float, int, dict[str, float]]:
            """The step's loss over the global batch, its tokens and the objective's metrics (on every rank)."""
            if objective:
                loss, metrics = self.objective_step.finish()
                return loss, self.objective_step.tokens, metrics
            # Each rank's share is (its token loss sum / the step's label tokens on all ranks) x world size (HF
            # scales it so that the gradient mean over the ranks comes out right): the step's loss is the sum / W.
            totals = torch.tensor([self.step_loss, self.step_tokens], dtype=torch.float64, device=device)
            all_reduce_sum(totals, env)
            self.step_loss, self.step_tokens = 0.0, 0
            return float(totals[0]) / env.world_size, int(totals[1]), {}

    reporter = make_reporter(config, total_steps, device, enabled=env.is_main, initial_step=checkpoints.state.step)
    evaluation = Evaluation(config, prepared, checkpoints.state, reporter)
    clock = {"started": time.perf_counter(), "seconds": 0.0, "tokens": 0}
    collector = QuietCollector(config.training.freeze_gc, device)
    unlogged: list[dict[str, float]] = []  # the objective's metrics of the steps since HF last logged
    attached: dict[str, DDPStrategy] = {}

    class RecordLosses(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            attached["strategy"] = attached_strategy(trainer, prepared, config)
            collector.start()

        def on_step_begin(self, args, state, control, **kwargs):
            checkpoints.restore(attached["strategy"])  # the first step of a resumed run
            clock["started"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            clock["seconds"] += time.perf_counter() - clock["started"]
            loss, tokens, metrics = trainer.finish_step()
            clock["tokens"] += tokens
            lr = trainer.lr_scheduler.get_last_lr()[0]
            checkpoints.advance(loss, tokens)
            if objective:
                state_of(prepared.model).metrics = metrics
                if args.logging_strategy != "no":
                    unlogged.append(metrics)
            reporter.step(
                checkpoints.state.step,
                {
                    "loss": loss,
                    "lr": lr,
                    "tokens_per_second": clock["tokens"] / max(clock["seconds"], 1e-9),
                    "memory_bytes": memory_bytes(device),
                    "tokens_seen": checkpoints.state.tokens_seen,
                    **metrics,
                },
            )
            evaluation.step_done(total_steps)
            collector.step_done()
            checkpoints.save_if_due(total_steps, attached["strategy"])

    with trainer_process_state():
        args = training_arguments(config, env, device, len(steps), prepared.model)
        trainer = TigonHFTrainer(
            model=prepared.model,
            args=args,
            train_dataset=prepared.train_dataset,
            data_collator=collator,
            callbacks=[RecordLosses(), *framework_trackers(config, env)],
        )
        if objective:  # compute_loss normalizes over the step's global batch: HF must not divide by accumulation
            trainer.model_accepts_loss_kwargs = True
        trainer.remove_callback(PrinterCallback)  # tigon's Reporter prints the run's progress
        try:
            evaluation.start()
            trainer.train()
            evaluation.finish()
        finally:
            collector.close()
            reporter.close()
    seconds, tokens = clock["seconds"], clock["tokens"]
    return finish_adapter_run(config, prepared, checkpoints, reporter, seconds, tokens, attached["strategy"])
