"""The post-training objectives as the three trainers run them, whichever the config names: a preference
objective (`tigon.runtime.objectives`) or distillation (`tigon.runtime.distill`).

    prepare_objective(config, prepared)              # the reference or the teacher, before any wrapping
    step = ObjectiveStep(micro_batches, config, env, device, number)   # one step: each micro-batch's loss, metrics
    loss, grad_norm, tokens = run_global_batch(strategy, micro_batches, config, env, device, step)

The torch and Lightning trainers run a step through `run_global_batch`; the HF Trainer adapter calls
`ObjectiveStep.loss` from its `compute_loss`, so the three compute the same loss and metrics.
"""

from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from tigon.runtime import distill
from tigon.runtime.batches import autocast, global_token_counts
from tigon.runtime.config import RunConfig
from tigon.runtime.distill import load_teacher, precompute_teacher
from tigon.runtime.distributed import DistEnv, all_reduce_sum
from tigon.runtime.objectives import (
    freeze,
    global_pairs,
    precompute_reference,
    preference_micro_batch,
    preference_result,
    state_of,
    unwrap,
)

logger = logging.getLogger("tigon.runtime")


def prepare_objective(config: RunConfig, prepared) -> None:
    """Before the strategy wraps the model (`prepared`: run.Prepared): the frozen reference copy or the teacher
    (sharded under FSDP2), or the reference log-probs or the teacher's hidden states stored in the data."""
    objective, model, env, device = config.objective, prepared.model, prepared.env, prepared.device
    if objective.type == "distill":
        if objective.teacher.precompute:
            precompute_teacher(config, prepared)
        else:
            state_of(model).reference = load_teacher(config, model, prepared.tokenizer, env, device)
        return
    if not objective.preference:
        return
    source = objective.reference_source
    if source == "model":
        state_of(model).reference = freeze(copy.deepcopy(unwrap(model)), config, env, device)
    elif source == "precomputed":
        for dataset in (prepared.train_dataset, prepared.eval_dataset):
            if dataset is not None:
                precompute_reference(model, dataset, config, env, device)
        if env.is_main:
            logger.info("reference log-probs precomputed for %d training examples", len(prepared.train_dataset))


class ObjectiveStep:
    """One optimizer step of a preference objective or of distillation, as the three trainers run it.

        step = ObjectiveStep(micro_batches, config, env, device, number)  # this rank's micro-batches of the step
        for batch in micro_batches:
            backward(step.loss(model, batch))       # under the run's autocast; adds the batch's metrics
        loss, metrics = step.finish()               # summed over the ranks

    The micro-batches are counted over the ranks first (pairs, KTO completions, or distillation's completion
    tokens), so that each micro-batch's loss is its exact share of the global batch's, as the next-token loss is
    normalized. `tokens`: the tokens the step processes on all ranks."""

    def __init__(self, micro_batches: list[dict], config: RunConfig, env: DistEnv, device: torch.device, number: int):
        self.config, self.env, self.device = config, env, device
        self.sums: dict[str, torch.Tensor] = {}
        if config.objective.type == "distill":
            self.count, self.tokens = global_token_counts(micro_batches, env, device, number)
            self.micro_batch, self.result = distill.distill_micro_batch, distill.distill_result
        else:
            self.count, self.tokens = global_pairs(micro_batches, env, device)
            self.micro_batch, self.result = preference_micro_batch, preference_result

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """The micro-batch's loss to backpropagate (`model`: as the strategy wraps it, through DDP or DeepSpeed)."""
        loss, sums = self.micro_batch(model, batch, self.config, self.env, self.device, self.count)
        for name, value in sums.items():
            self.sums[name] = self.sums.get(name, 0) + value
        return loss

    def finish(self) -> tuple[float, dict[str, float]]:
        """The step's loss and metrics over the global batch (a collective: call on every rank)."""
        names = sorted(self.sums)
        stacked = all_reduce_sum(torch.stack([self.sums[name] for name in names]), self.env)
        return self.result(dict(zip(names, stacked, strict=True)), self.config, self.count)


def run_global_batch(strategy, micro_batches: list[dict], config: RunConfig, env: DistEnv, device, step: int):
    """The objective's counterpart of `torch_trainer.run_global_batch` (the torch and Lightning trainers): forward and
    backward over this rank's micro-batches, then the update. Returns (the step's loss, the gradient norm before
    clipping, tokens); the step's metrics land in the model's `ObjectiveState.metrics`."""

    objective_step = ObjectiveStep(micro_batches, config, env, device, step)
    for index, batch in enumerate(micro_batches):
        with strategy.accumulating(last=index == len(micro_batches) - 1):
            with autocast(device, config.training.precision):
                loss = objective_step.loss(strategy.model, batch)
            strategy.backward(loss)
    grad_norm = strategy.step()
    loss, state_of(strategy.model).metrics = objective_step.finish()
    return loss, float(grad_norm), objective_step.tokens
