"""The optimizer and learning-rate schedule every trainer uses: AdamW with weight decay on matrices only, linear
warmup, then constant, linear or cosine decay."""

from __future__ import annotations

import math

import torch
from torch import nn

from tigon.runtime.config import ConfigError, TrainingConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: norms, biases (every tensor under 2-D) are not decayed."""
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        (no_decay if parameter.ndim < 2 or "norm" in name.lower() else decay).append(parameter)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def build_optimizer(model: nn.Module, training: TrainingConfig, fused: bool = True) -> torch.optim.Optimizer:
    """AdamW over `param_groups`; torch's fused kernel when every parameter is on the GPU, unless `fused` is False
    (FSDP2's fp16 scaler cannot drive the fused step: see FSDPStrategy.fused_optimizer)."""
    groups = param_groups(model, training.weight_decay)
    if not groups:
        raise ConfigError("the model has no trainable parameters (check lora.target_modules)")
    on_gpu = all(p.is_cuda for group in groups for p in group["params"])
    return torch.optim.AdamW(
        groups, lr=training.learning_rate, betas=(0.9, 0.95), eps=1e-8, fused=(fused and on_gpu) or None
    )


def lr_factor(step: int, training: TrainingConfig, total_steps: int) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based): linear warmup, then the schedule."""
    warmup = training.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if training.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if training.lr_schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, training: TrainingConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, training, total_steps))


def load_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, state: dict) -> None:
    """Restore a saved schedule's position (load the optimizer's state first). The next step's learning rate is
    this run's schedule at that position, not the rate the saved run had set: a run resumed with more steps, or
    another schedule, follows its own from its first step (with the same schedule the two are equal)."""
    scheduler.load_state_dict(state)
    pairs = zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)
    rates = [base * factor(scheduler.last_epoch) for factor, base in pairs]
    for group, rate in zip(scheduler.optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    scheduler._last_lr = rates
