"""Batches of the training and held-out data, shared by the trainers and the objectives: the data order
(`GlobalBatchSampler`, `train_order`), collation, autocast, a micro-batch's next-token loss (`token_loss_sum`), and
the global batch's token counts."""

from __future__ import annotations

import contextlib
import heapq
import logging
import math
from collections.abc import Sequence

import torch
from torch import nn

from tigon.runtime.attention import resolve
from tigon.runtime.config import RunConfig
from tigon.runtime.data import IGNORE_INDEX, PackedDataset, model_inputs, token_multiple
from tigon.runtime.distributed import DistEnv, all_reduce_sum

logger = logging.getLogger("tigon.runtime")

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}  # fp8: outside FP8 matmuls


class GlobalBatchSampler:
    """This rank's micro-batches of each global batch; which items form a global batch does not depend on how it is
    split over ranks and micro-batches.

    Without `costs` the global batch's items are dealt in their shuffled order. With `costs` (an item's compute, in
    tokens) they are dealt so that every micro-batch's summed cost is about the same (`balanced_slots`): ranks
    synchronize at every micro-batch, so the costliest one sets the pace. The step trains the same items either
    way.
    """

    def __init__(
        self,
        n_items: int,
        micro_batch: int,
        accumulation: int,
        world_size: int,
        rank: int,
        seed: int,
        costs: Sequence[int] | None = None,
    ):
        if costs is not None and len(costs) != n_items:
            raise ValueError(f"costs has {len(costs)} entries for {n_items} items; give one per item")
        self.n_items, self.micro_batch, self.accumulation = n_items, micro_batch, accumulation
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.costs = costs
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
        start = batch * self.global_batch
        items = self.order(epoch)[start : start + self.global_batch].tolist()
        slots = self.accumulation * self.world_size
        if self.costs is None:
            dealt = [items[slot * self.micro_batch : (slot + 1) * self.micro_batch] for slot in range(slots)]
        else:
            dealt = balanced_slots(items, self.costs, slots, self.micro_batch)
        return [dealt[micro * self.world_size + self.rank] for micro in range(self.accumulation)]


SWAP_PARTNERS = 4  # the least loaded groups the costliest one tries swaps with (bounds the work at many ranks)


def balanced_slots(items: list[int], costs: Sequence[int], slots: int, size: int) -> list[list[int]]:
    """`items` dealt into `slots` groups of `size` whose summed `costs` are close to equal, each group in the
    items' order.

    The costliest item goes first, each to the group with the least cost that has room (longest processing time
    first); then, while it lowers the costliest group, one of its items swaps with a cheaper one of one of the least
    loaded groups. Deterministic: every rank deals the same groups.
    """
    if len(items) != slots * size:
        raise ValueError(f"{len(items)} items cannot fill {slots} groups of {size}")
    groups: list[list[int]] = [[] for _ in range(slots)]
    totals = [0] * slots
    open_groups = [(0, slot) for slot in range(slots)]  # (total, group) of the groups with room
    for item in sorted(items, key=lambda i: -costs[i]):
        total, slot = heapq.heappop(open_groups)
        groups[slot].append(item)
        totals[slot] = total + costs[item]
        if len(groups[slot]) < size:
            heapq.heappush(open_groups, (totals[slot], slot))
    for _ in range(2 * slots):
        by_total = sorted(range(slots), key=totals.__getitem__)
        heavy = by_total[-1]
        best = None  # (the two groups' higher total after the swap, other group, its item, heavy's item, cost moved)
        for other in by_total[:SWAP_PARTNERS]:
            if other == heavy:
                continue
            for mine in groups[heavy]:
                for theirs in groups[other]:
                    moved = costs[mine] - costs[theirs]
                    peak = max(totals[heavy] - moved, totals[other] + moved)
                    if moved > 0 and peak < totals[heavy] and (best is None or peak < best[0]):
                        best = (peak, other, theirs, mine, moved)
        if best is None:
            break
        _, other, theirs, mine, moved = best
        groups[heavy][groups[heavy].index(mine)] = theirs
        groups[other][groups[other].index(theirs)] = mine
        totals[heavy] -= moved
        totals[other] += moved
    position = {item: index for index, item in enumerate(items)}
    return [sorted(group, key=position.__getitem__) for group in groups]


def item_costs(config: RunConfig, dataset) -> list[int] | None:
    """Each training item's compute in tokens where it can differ between items, else None.

    Under varlen attention a packed row's padding is dropped (`tigon.runtime.data.model_inputs`), so a row costs
    the tokens up to its last labelled one; under other attention every row computes all of its tokens.
    `data.balance_micro_batches: false` turns balancing off.
    """
    if not config.data.balance_micro_batches or resolve(config.model.attn_implementation) != "varlen":
        return None
    if not isinstance(dataset, PackedDataset):
        return None
    return dataset.row_tokens()


def balancing_costs(config: RunConfig, dataset, slots: int, log: bool) -> list[int] | None:
    """`item_costs`, saying so (`log`) where a global batch has more than one micro-batch slot to deal them to."""
    costs = item_costs(config, dataset)
    if costs is not None and log and slots > 1:
        logger.info("micro-batches balanced: each global batch's rows dealt by their unpadded tokens")
    return costs


def train_order(config: RunConfig, dataset, world_size: int, rank: int) -> GlobalBatchSampler:
    """The run's data order over `dataset`: `world_size` ranks, the run's micro-batch and accumulation, balanced
    micro-batches where items' costs differ (`item_costs`)."""
    training = config.training
    costs = balancing_costs(config, dataset, training.gradient_accumulation_steps * world_size, log=rank == 0)
    return GlobalBatchSampler(
        len(dataset),
        training.micro_batch_size,
        training.gradient_accumulation_steps,
        world_size,
        rank,
        training.seed,
        costs,
    )


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


def token_loss_sum(
    model: nn.Module,
    batch: dict,
    attn_implementation: str,
    device: torch.device,
    precision: str,
    skip_unlabelled: bool = False,
):
    """Sum (not mean) of the next-token cross-entropy over label tokens, in float32. `skip_unlabelled`
    (kernels.skip_unlabelled): a model training with tigon's fused loss projects only the positions with a loss."""
    return inputs_loss_sum(
        model, loss_inputs(model, batch, attn_implementation, device, precision, skip_unlabelled), device, precision
    )


#: `training.static_shapes: auto` keeps rows whole where their padding is under this fraction of their tokens
STATIC_PADDING_LIMIT = 0.02


def static_shapes(config: RunConfig, dataset: PackedDataset) -> bool:
    """Whether every training micro-batch feeds the model its rows whole (`training.static_shapes`). Only varlen
    attention drops padding, so only it needs to; auto turns it on for compiled layers, whose graphs otherwise
    follow every new token count, where the rows are nearly full."""
    setting = config.training.static_shapes
    sft = config.objective.type == "sft"
    if not sft or resolve(config.model.attn_implementation) != "varlen" or setting is False or not len(dataset):
        return False
    padding = 1 - sum(dataset.row_tokens()) / (len(dataset) * config.data.max_seq_len)
    if setting == "auto" and (not config.training.compile or padding >= STATIC_PADDING_LIMIT):
        return False
    logger.info(
        "static shapes: every micro-batch feeds its rows whole (%d tokens; %.1f%% of the rows is padding)",
        config.training.micro_batch_size * config.data.max_seq_len,
        100 * padding,
    )
    return True


def loss_inputs(
    model: nn.Module,
    batch: dict,
    attn_implementation: str,
    device: torch.device,
    precision: str,
    skip_unlabelled: bool = False,
    whole_rows: bool = False,
) -> dict:
    """The model's keyword arguments for `token_loss_sum` of a collated CPU `batch`, copied to `device` without
    waiting for it (so a step's inputs can be made while the previous step runs); `whole_rows`: `static_shapes`."""
    from tigon.kernels.patching.causal_lm import has_fused_loss

    positions = skip_unlabelled and model.training and has_fused_loss(model)
    inputs = model_inputs(
        batch, attn_implementation, device, token_multiple(precision), loss_positions=positions, whole_rows=whole_rows
    )
    inputs["use_cache"] = False
    return inputs


def inputs_loss_sum(model: nn.Module, inputs: dict, device: torch.device, precision: str):
    """`token_loss_sum` of the inputs `loss_inputs` made."""
    # The model's own shifted loss as a sum (num_items_in_batch=1); the caller normalizes over the global
    # batch. A model patched with tigon's fused linear cross entropy computes it without logits in training.
    with autocast(device, precision):
        return model(**inputs, num_items_in_batch=1).loss.float()


def global_token_counts(micro_batches: list[dict], env: DistEnv, device: torch.device, step: int) -> tuple[float, int]:
    """(label tokens, all tokens) of the global batch, summed over ranks; an error if no token carries a label. In
    one process the counts stay on the CPU: reading them then waits for no GPU work."""
    counts = torch.tensor(
        [
            sum(label_tokens(batch["labels"]) for batch in micro_batches),
            sum(batch["input_ids"].numel() for batch in micro_batches),
        ],
        dtype=torch.float64,
        device=device if env.distributed else "cpu",
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
