"""The plain PyTorch trainer: one loop over the pieces every trainer shares.

    result = train_prepared(config, prepare(config))   # tigon.runtime.trainer.train(config) picks this trainer

The pieces it shares with the HF Trainer and Lightning adapters live below it: `tigon.runtime.run` (`prepare`,
resuming, `finish`), `tigon.runtime.evaluation`, the optimizer and schedule in `tigon.runtime.optim`, the data
order (`GlobalBatchSampler`), the batches and the loss (`token_loss_sum`) in `tigon.runtime.batches`, the
parallelism in `tigon.runtime.strategies`. The Lightning adapter runs each step through `run_global_batch`.

Loss normalization: a step's loss is the sum of token losses over all its micro-batches and
ranks divided by the number of label tokens among them, as if the whole global batch were one
forward pass; so gradient accumulation and DDP change nothing but rounding.

Data order: each epoch is a seeded permutation of the training sequences, cut into global
batches of micro_batch_size x gradient_accumulation_steps x world_size; inside a global batch,
micro-batch m of rank r takes chunk m * world_size + r. The order is therefore the same for
1 x 4, 2 x 2 and 2 ranks x 2, and the data position (epoch, batches consumed) resumes exactly.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tigon.runtime import checkpoint as ckpt
from tigon.runtime import post_training, storage
from tigon.runtime.batches import (
    GlobalBatchSampler,
    collate,
    global_token_counts,
    inputs_loss_sum,
    loss_inputs,
    static_shapes,
    train_order,
)
from tigon.runtime.collector import QuietCollector
from tigon.runtime.config import ConfigError, RunConfig
from tigon.runtime.distributed import DistEnv, all_reduce_sum, barrier
from tigon.runtime.evaluation import Evaluation
from tigon.runtime.files import atomic_write_text
from tigon.runtime.model import count_parameters
from tigon.runtime.objectives import state_of
from tigon.runtime.post_training import prepare_objective
from tigon.runtime.profiling import profile_step
from tigon.runtime.reporting import PROFILE_FILE, PROFILE_TRACE, Reporter, make_reporter, memory_bytes
from tigon.runtime.run import (
    LoopResult,
    Prepared,
    TrainResult,
    check_resumable,
    finish,
    non_finite_loss_message,
    plan_steps,
    start_over,
)
from tigon.runtime.strategies import build_strategy

logger = logging.getLogger("tigon.runtime")


def train_prepared(config: RunConfig, prepared: Prepared) -> TrainResult:
    """The torch trainer's run on what `prepare` built: resume (or start over), the step loop, then export and
    report. The adapters finish a run that has no step left to train (resumed at its last step) here too: it
    loads the checkpoint they wrote, evaluates and exports."""
    env, device = prepared.env, prepared.device
    total_steps, per_epoch = plan_steps(config, len(prepared.train_dataset), env.world_size, env.is_main)
    if config.logging.profile_step is not None and config.logging.profile_step > total_steps:
        raise ConfigError(
            f"logging.profile_step: {config.logging.profile_step} is past the run's last step ({total_steps})"
        )

    trainable, total_params = count_parameters(prepared.model)  # before ZeRO-3 partitions the weights
    prepare_objective(config, prepared)
    strategy = build_strategy(prepared.model, config, env, device, total_steps)  # ddp, fsdp or deepspeed
    sampler = train_order(config, prepared.train_dataset, env.world_size, env.rank)
    if env.is_main:
        logger.info(
            "training %s parameters (%s total) on %s x %d: %d steps of %d sequences x %d tokens (%d steps per epoch)",
            f"{trainable:,}",
            f"{total_params:,}",
            device,
            env.world_size,
            total_steps,
            sampler.global_batch,
            config.data.max_seq_len,
            per_epoch,
        )
    remote = storage.run_storage(config.checkpoint.remote_dir)
    state, resumed_from = resume_or_start_over(config, strategy, env, remote, total_steps)
    config_json = config.model_dump_json(indent=2)
    run_dir = Path(config.logging.run_dir)
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "config.json", config_json + "\n")
    reporter = make_reporter(config, total_steps, device, enabled=env.is_main, initial_step=state.step)
    run = train_loop(config, prepared, strategy, sampler, state, remote, reporter, total_steps, per_epoch)
    return finish(config, prepared, strategy, state, remote, reporter, run, resumed_from, config_json)


def resume_or_start_over(config: RunConfig, strategy, env: DistEnv, remote, total_steps: int):
    """(the train state, the step resumed from or None): the latest checkpoint's, when `checkpoint.resume` finds
    one, or a fresh state with the run directory cleared of an earlier run's files."""
    run_dir = Path(config.logging.run_dir)
    state = ckpt.TrainState(world_size=env.world_size, global_batch=config.training.global_batch(env.world_size))
    resumed_from = None
    latest = storage.resume_point(config.checkpoint.remote_dir, run_dir, env) if config.checkpoint.resume else None
    if latest is not None:
        check_resumable(latest, config)
        state = strategy.load_checkpoint(latest)
        resumed_from = state.step
        state.world_size, state.global_batch = env.world_size, config.training.global_batch(env.world_size)
        if env.is_main:
            logger.info("resumed from %s (step %d, epoch %d)", latest, state.step, state.epoch)
            if state.step > total_steps:
                logger.warning(
                    "%s is at step %d, past this run's %d steps: nothing is trained, the run is evaluated and "
                    "exported as it stands; to train a new run, use another logging.run_dir or set "
                    "checkpoint.resume: false",
                    latest,
                    state.step,
                    total_steps,
                )
    else:
        torch.manual_seed(config.training.seed + env.rank)  # per-rank randomness (dropout) from here on
        start_over(config, env, remote)
    barrier(env)
    return state, resumed_from


def train_loop(
    config: RunConfig,
    prepared: Prepared,
    strategy,
    sampler: GlobalBatchSampler,
    state: ckpt.TrainState,
    remote,
    reporter: Reporter,
    total_steps: int,
    per_epoch: int,
) -> LoopResult:
    """Optimizer steps from `state.step` to `total_steps`: metrics to the reporter (closed at the end), evaluations
    and checkpoints on their schedule, the profiled step where `logging.profile_step` asks."""
    env, device = prepared.env, prepared.device
    run_dir = Path(config.logging.run_dir)
    config_json = config.model_dump_json(indent=2)  # each checkpoint records the run's config
    evaluation = Evaluation(config, prepared, state, reporter)
    evaluation.start()
    every_ckpt = config.checkpoint.every_steps

    train_seconds, tokens_this_run, profile = 0.0, 0, None
    profile_at = config.logging.profile_step
    saving = None  # the checkpoint being written in the background (checkpoint.async_save)
    ahead = inputs_ahead(strategy, sampler, prepared.train_dataset, config, device)
    one_step = functools.partial(train_step, strategy, ahead, state, config, env, device, total_steps, per_epoch)
    strategy.model.train()
    collector = QuietCollector(config.training.freeze_gc, device)
    try:
        collector.start()
        while state.step < total_steps:
            if state.batches_in_epoch >= per_epoch:
                state.epoch, state.batches_in_epoch = state.epoch + 1, 0
            started = time.perf_counter()
            lr = strategy.lr()
            if state.step + 1 == profile_at:
                trace = run_dir / PROFILE_TRACE if env.is_main else None
                (loss, grad_norm, tokens), profile = profile_step(one_step, device.type == "cuda", trace)
                if env.is_main:
                    atomic_write_text(run_dir / PROFILE_FILE, json.dumps(profile, indent=2) + "\n")
            else:
                loss, grad_norm, tokens = one_step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            train_seconds += time.perf_counter() - started
            tokens_this_run += tokens
            state.step += 1
            state.batches_in_epoch += 1
            state.tokens_seen += tokens
            state.losses.append(loss)
            if not math.isfinite(loss):
                raise FloatingPointError(non_finite_loss_message(loss, state.step, config))
            reporter.step(
                state.step,
                {
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "epoch": state.epoch + state.batches_in_epoch / per_epoch,
                    "tokens_per_second": tokens_this_run / max(train_seconds, 1e-9),
                    "memory_bytes": memory_bytes(device),
                    "tokens_seen": state.tokens_seen,
                    **state_of(strategy.model).metrics,
                },
            )
            evaluation.step_done(total_steps)
            collector.step_done()
            if every_ckpt > 0 and (state.step % every_ckpt == 0 or state.step == total_steps):
                if saving is not None:  # one checkpoint in flight at a time
                    saving.finish()
                saving = strategy.begin_checkpoint(run_dir, state, config.checkpoint.keep_last, config_json, remote)
                if not config.checkpoint.async_save:
                    saving.finish()
                    saving = None
        if saving is not None:
            saving.finish()
        evaluation.finish()
    finally:
        collector.close()
        reporter.close()
    return LoopResult(train_seconds, tokens_this_run, profile)


Position = tuple[int, int]  # (epoch, global batches consumed in it)


@dataclass
class StepInputs:
    """This rank's micro-batches of one optimizer step, collated on the CPU, and for the next-token loss the model's
    inputs made from them, on the device (a preference objective or distillation makes its own: None)."""

    micro_batches: list[dict]
    inputs: list[dict] | None


@dataclass
class LaunchedStep:
    """An optimizer step whose work is queued on the device; `read` waits for it."""

    loss: torch.Tensor | float  # over the whole global batch
    grad_norm: torch.Tensor | float  # before clipping
    tokens: int  # processed on all ranks

    def read(self) -> tuple[float, float, int]:
        return float(self.loss), float(self.grad_norm), self.tokens


class InputsAhead:
    """The next optimizer step's inputs, made while the device still runs the current step.

    Collating, unpadding and copying a step's micro-batches takes the host milliseconds; made after the previous
    step's loss is read (which waits for the device), they leave the device idle at every step's start."""

    def __init__(self, make: Callable[[Position], StepInputs]):
        self.make = make
        self.held: tuple[Position, StepInputs] | None = None

    def take(self, position: Position) -> StepInputs:
        """The inputs at `position`: those made ahead, else made now."""
        held, self.held = self.held, None
        return held[1] if held is not None and held[0] == position else self.make(position)

    def make_ahead(self, position: Position) -> None:
        self.held = (position, self.make(position))


def inputs_ahead(strategy, sampler: GlobalBatchSampler, dataset, config: RunConfig, device) -> InputsAhead:
    """`InputsAhead` of the global batches `sampler` deals from `dataset` (`step_inputs_at`), their rows whole where
    `training.static_shapes` asks."""
    whole_rows = static_shapes(config, dataset)
    return InputsAhead(functools.partial(step_inputs_at, strategy, sampler, dataset, config, device, whole_rows))


def next_position(position: Position, per_epoch: int) -> Position:
    epoch, batch = position
    return (epoch + 1, 0) if batch + 1 >= per_epoch else (epoch, batch + 1)


def train_step(
    strategy,
    ahead: InputsAhead,
    state: ckpt.TrainState,
    config: RunConfig,
    env: DistEnv,
    device,
    total_steps: int,
    per_epoch: int,
) -> tuple[float, float, int]:
    """One optimizer step at the run's position (`state`, which the caller advances); the next step's inputs are
    made before this one's loss is read. Returns (the step's loss over the whole global batch, the gradient norm
    before clipping, tokens processed)."""
    position = (state.epoch, state.batches_in_epoch)
    launched = launch_step(strategy, ahead.take(position), config, env, device, state.step + 1)
    if state.step + 1 < total_steps:
        ahead.make_ahead(next_position(position, per_epoch))
    return launched.read()


def step_inputs_at(
    strategy,
    sampler: GlobalBatchSampler,
    dataset,
    config: RunConfig,
    device,
    whole_rows: bool,
    position: Position,
) -> StepInputs:
    """`step_inputs` of this rank's micro-batches of the global batch at `position`."""
    chunks = sampler.micro_batches(*position)
    micro_batches = [collate([dataset[i] for i in chunk]) for chunk in chunks]
    return step_inputs(strategy, micro_batches, config, device, whole_rows)


def step_inputs(strategy, micro_batches: list[dict], config: RunConfig, device, whole_rows: bool = False) -> StepInputs:
    """`StepInputs` of this rank's collated micro-batches; the model's inputs are queued for the device.
    `whole_rows`: `tigon.runtime.batches.static_shapes`."""
    if config.objective.type != "sft":
        return StepInputs(micro_batches, None)
    make = functools.partial(
        loss_inputs,
        strategy.model,
        attn_implementation=config.model.attn_implementation,
        device=device,
        precision=config.training.precision,
        skip_unlabelled=config.kernels.skip_unlabelled,
        whole_rows=whole_rows,
    )
    return StepInputs(micro_batches, [make(batch) for batch in micro_batches])


def launch_step(strategy, prepared: StepInputs, config: RunConfig, env: DistEnv, device, step: int) -> LaunchedStep:
    """Forward and backward over this rank's micro-batches of one global batch, then the update (`strategy.step`),
    all queued on the device; `step` (1-based) names the step in errors."""
    if prepared.inputs is None:  # a preference objective or distillation
        return LaunchedStep(
            *post_training.run_global_batch(strategy, prepared.micro_batches, config, env, device, step)
        )
    n_label, n_tokens = global_token_counts(prepared.micro_batches, env, device, step)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for index, inputs in enumerate(prepared.inputs):
        with strategy.accumulating(last=index == len(prepared.inputs) - 1):
            summed = inputs_loss_sum(strategy.model, inputs, device, config.training.precision)
            strategy.backward(summed * (env.world_size / n_label))  # gradients are averaged over the ranks
        loss_sum += summed.detach()
    grad_norm = strategy.step()
    all_reduce_sum(loss_sum, env)
    return LaunchedStep(loss_sum / n_label, grad_norm, n_tokens)


def run_global_batch(
    strategy,
    micro_batches: list[dict],
    config: RunConfig,
    env: DistEnv,
    device,
    step: int,
    whole_rows: bool = False,
):
    """One optimizer step over this rank's collated micro-batches of a global batch (`launch_step`), read.

    Shared with the Lightning adapter. Returns (the step's loss over the whole global batch, the gradient norm
    before clipping, tokens processed).
    """
    inputs = step_inputs(strategy, micro_batches, config, device, whole_rows)
    return launch_step(strategy, inputs, config, env, device, step).read()
