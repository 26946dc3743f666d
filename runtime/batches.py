"""Batches of the training and held-out data, shared by the trainers and the objectives: the data order
(`GlobalBatchSampler`), collation, autocast, a micro-batch's next-token loss (`token_loss_sum`), and the global
batch's token counts."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from tigon.runtime.config import RunConfig
from tigon.runtime.data import IGNORE_INDEX, model_inputs, token_multiple
from tigon.runtime.distributed import DistEnv, all_reduce_sum

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}  # fp8: outside FP8 matmuls


class GlobalBatchSampler:
    """This rank's micro-batches of each global batch, in an order independent of how it is split."""

    def __init__(self, n_items: int, micro_batch: int, accumulation: int, world_size: int, rank: int, seed: int):
        self.n_items, self.micro_batch, self.accumulation = n_items, micro_batch, accumulation
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.global_batch = micro_batch * accumulation * world_size
        self._epoch, self._order = None, None

    @property
    def batches_per_epoch(self) -> int:
        return self.n_items // self.global_batch

    def order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._order = epoch, torch.randperm(self.n_items, generator=generator)
        return self._order

    def micro_batches(self, epoch: int, batch: int) -> list[list[int]]:
        """Indices of this rank's `accumulation` micro-batches in global batch `batch` of `epoch`."""
        if not 0 <= batch < self.batches_per_epoch:
            raise IndexError(f"global batch {batch} out of range (an epoch has {self.batches_per_epoch})")
        order = self.order(epoch)
        start = batch * self.global_batch
        result = []
        for micro in range(self.accumulation):
            chunk = start + (micro * self.world_size + self.rank) * self.micro_batch
            result.append(order[chunk : chunk + self.micro_batch].tolist())
        return result


JOINED = ("teacher_hidden",)  # items' rows of differing counts, joined end to end


def collate(items: list[dict]) -> dict[str, torch.Tensor]:
    """The items' tensors stacked, or for the keys in JOINED concatenated."""
    return {key: (torch.cat if key in JOINED else torch.stack)([item[key] for item in items]) for key in items[0]}


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def label_tokens(labels: torch.Tensor) -> int:
    """Tokens that carry loss after the causal shift."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def token_loss_sum(model: nn.Module, batch: dict, attn_implementation: str, device: torch.device, precision: str):
    """Sum (not mean) of the next-token cross-entropy over label tokens, in float32."""
    inputs = model_inputs(batch, attn_implementation, device, token_multiple(precision))
    inputs["use_cache"] = False
    # The model's own shifted loss as a sum (num_items_in_batch=1); the caller normalizes over the global
    # batch. A model patched with tigon's fused linear cross entropy computes it without logits in training.
    with autocast(device, precision):
        return model(**inputs, num_items_in_batch=1).loss.float()


def global_token_counts(micro_batches: list[dict], env: DistEnv, device: torch.device, step: int) -> tuple[float, int]:
    """(label tokens, all tokens) of the global batch, summed over ranks; an error if no token carries a label."""
    counts = torch.tensor(
        [
            sum(label_tokens(batch["labels"]) for batch in micro_batches),
            sum(batch["input_ids"].numel() for batch in micro_batches),
        ],
        dtype=torch.float64,
        device=device,
    )
    all_reduce_sum(counts, env)
    n_label, n_tokens = float(counts[0]), int(counts[1])
    if n_label == 0:
        raise ValueError(
            f"step {step}: no token in the global batch carries a label (all -100); check data.format "
            "and the prompt/response fields"
        )
    return n_label, n_tokens


def eval_batches(dataset, config: RunConfig, env: DistEnv) -> list[list[int]]:
    """This rank's held-out index chunks of micro_batch_size, at most eval.max_batches. With sharded parameters
    every forward is a collective, so each rank runs as many as rank 0: an empty chunk is a forward whose result
    is dropped (run on item 0)."""
    indices = list(range(env.rank, len(dataset), env.world_size))
    size = config.training.micro_batch_size
    batches = [indices[i : i + size] for i in range(0, len(indices), size)]
    if config.eval.max_batches is not None:
        batches = batches[: config.eval.max_batches]
    if config.parallelism.shards_parameters:
        most = math.ceil(math.ceil(len(dataset) / env.world_size) / size)
        batches += [[]] * (min(most, config.eval.max_batches or most) - len(batches))
    return batches
