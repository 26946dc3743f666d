"""What the HF Trainer and Lightning adapters share beyond the torch trainer's pieces: their preparation, the torch
trainer's checkpoints written and resumed from a framework's loop (`AdapterCheckpoints`), and the run's finish.

    prepared = prepare_adapter(config, datasets)
    checkpoints = AdapterCheckpoints(config, prepared.env, per_epoch)   # resume, or start over
    ...                                                                  # the framework's loop
    return finish_adapter_run(config, prepared, checkpoints, reporter, seconds, tokens, strategy)
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from tigon.runtime import checkpoint as ckpt
from tigon.runtime import storage
from tigon.runtime.config import RunConfig
from tigon.runtime.distributed import DistEnv, barrier
from tigon.runtime.parallel import DDPStrategy
from tigon.runtime.reporting import Reporter
from tigon.runtime.run import (
    LoopResult,
    Prepared,
    TrainResult,
    check_config,
    check_resumable,
    finish,
    non_finite_loss_message,
    prepare,
    start_over,
)

logger = logging.getLogger("tigon.runtime")


def prepare_adapter(config: RunConfig, datasets: str | Path | None = None) -> Prepared:
    """`prepare` for an adapter (pre-packed `datasets` too), after the checks for this adapter's config."""
    check_config(config)
    return prepare(config.model_copy(update={"trainer": "torch"}), datasets)


def positions(state: ckpt.TrainState, per_epoch: int, steps: int) -> list[tuple[int, int]]:
    """(epoch, global batch) of the next `steps` optimizer steps after `state`, as the torch trainer walks them."""
    epoch, batch, result = state.epoch, state.batches_in_epoch, []
    for _ in range(steps):
        if batch >= per_epoch:
            epoch, batch = epoch + 1, 0
        result.append((epoch, batch))
        batch += 1
    return result


class AdapterCheckpoints:
    """The torch trainer's checkpoints for an adapter: where the run stands, resume, and `step-N` every N steps.

    Construct on every rank before training: it finds the newest checkpoint (or clears stale ones when not
    resuming). `restore` loads its model, optimizer, schedule and RNG states just before the first step;
    `advance` records each optimizer step, and `save_if_due` writes a checkpoint when one is due (on every rank).
    """

    def __init__(self, config: RunConfig, env: DistEnv, per_epoch: int):
        self.config, self.env, self.per_epoch = config, env, per_epoch
        self.run_dir = Path(config.logging.run_dir)
        self.remote = storage.run_storage(config.checkpoint.remote_dir)
        self.config_json = config.model_dump_json(indent=2)
        self.state = ckpt.TrainState(
            world_size=env.world_size, global_batch=config.training.global_batch(env.world_size)
        )
        self.latest: Path | None = None
        if config.checkpoint.resume:
            self.latest = storage.resume_point(config.checkpoint.remote_dir, self.run_dir, env)
        if self.latest is not None:
            check_resumable(self.latest, config)
            self.state = ckpt.TrainState(**json.loads((self.latest / ckpt.STATE_FILE).read_text()))
            self.state.world_size = env.world_size
            self.state.global_batch = config.training.global_batch(env.world_size)
        else:
            start_over(config, env, self.remote)
        barrier(env)
        if env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.atomic_write_text(self.run_dir / "config.json", self.config_json + "\n")
        self.resumed_from = self.state.step if self.latest is not None else None
        self.pending = self.latest is not None  # states still to load before the first step

    def remaining(self, total_steps: int) -> list[tuple[int, int]]:
        return positions(self.state, self.per_epoch, max(0, total_steps - self.state.step))

    def restore(self, strategy: DDPStrategy) -> None:
        """Load the checkpoint's states into `strategy` (the parallelism's model, optimizer, schedule) once; call
        right before the first step (after any data loader started, which draws from the RNG)."""
        if self.pending:
            self.pending = False
            strategy.load_checkpoint(self.latest)
            if self.env.is_main:
                logger.info("resumed from %s (step %d, epoch %d)", self.latest, self.state.step, self.state.epoch)

    def advance(self, loss: float, tokens: int) -> None:
        """Record an optimizer step: the position, the tokens and the loss."""
        state = self.state
        if not math.isfinite(loss):
            raise FloatingPointError(non_finite_loss_message(loss, state.step + 1, self.config))
        if state.batches_in_epoch >= self.per_epoch:
            state.epoch, state.batches_in_epoch = state.epoch + 1, 0
        state.step += 1
        state.batches_in_epoch += 1
        state.tokens_seen += tokens
        state.losses.append(loss)

    def save_if_due(self, total_steps: int, strategy: DDPStrategy) -> None:
        """Write `step-N` (in `strategy`'s format) when `checkpoint.every_steps` or the last step says so; call on
        every rank."""
        state = self.state
        every, keep = self.config.checkpoint.every_steps, self.config.checkpoint.keep_last
        if every > 0 and (state.step % every == 0 or state.step == total_steps):
            strategy.save_checkpoint(self.run_dir, state, keep, self.config_json, self.remote)


def finish_adapter_run(
    config: RunConfig,
    prepared: Prepared,
    checkpoints: AdapterCheckpoints,
    reporter: Reporter,
    train_seconds: float,
    tokens: int,
    strategy: DDPStrategy,
) -> TrainResult:
    """Export through `strategy` (a sharded one gathers the weights to rank 0), and write the loss curve and summary
    as the torch trainer does (after `Evaluation.finish`); call on every rank."""
    run = LoopResult(train_seconds, tokens, profile=None)
    state, remote, config_json = checkpoints.state, checkpoints.remote, checkpoints.config_json
    return finish(config, prepared, strategy, state, remote, reporter, run, checkpoints.resumed_from, config_json)
