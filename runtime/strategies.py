"""The configured parallelism's strategy: DDP and FSDP2 (`tigon.runtime.parallel`) or DeepSpeed
(`tigon.runtime.deepspeed_engine`, which builds on them); DeepSpeed itself is imported only when a run uses it.

    strategy = build_strategy(model, config, env, device, total_steps)
"""

from __future__ import annotations

import torch
from torch import nn

from tigon.runtime.config import RunConfig
from tigon.runtime.deepspeed_engine import DeepSpeedStrategy
from tigon.runtime.distributed import DistEnv
from tigon.runtime.parallel import DDPStrategy, FSDPStrategy


def strategy_class(config: RunConfig) -> type[DDPStrategy]:
    """The class of the configured strategy."""
    strategy = config.parallelism.strategy
    if strategy == "fsdp":
        return FSDPStrategy
    if strategy == "deepspeed":
        return DeepSpeedStrategy
    return DDPStrategy


def build_strategy(module: nn.Module, config: RunConfig, env: DistEnv, device: torch.device, total_steps: int):
    """The configured strategy around `module` (already on its device), with its optimizer and schedule."""
    return strategy_class(config).build(module, config, env, device, total_steps)
