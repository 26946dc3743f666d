"""Preference objectives (DPO, ORPO, SimPO, CPO, KTO) through tigon's fused linear ops, in every trainer; the
frozen-model plumbing and the per-step code distillation shares (`tigon.runtime.distill`).

    check_objective(config)                                              # settings that cannot run, with the fix
    loss, metrics = preference_loss(model, batch, config, device, env)   # the fused op's loss and TRL's metrics
    metrics = evaluate_objective(model, dataset, config, env, device)

The trainers run a step through `tigon.runtime.post_training` (the reference, one step), which picks this module
or distillation by `objective.type`.

The model runs with no logit positions kept (`logits_to_keep` = an empty index); a forward hook on its decoder
hands the final hidden states to the fused op (`tigon.kernels.functional.fused_linear_dpo`, ...), which reads
the head's weight directly: the `(tokens, vocabulary)` logits never exist. The op takes the chosen rows then the
rejected rows (as TRL orders them), cut to the longest sequence; the model runs them so, or with `data.packing: true`
as one packed row whose hidden states are gathered into those rows (`tigon.runtime.preference_batch`).

Under FSDP2 the fused op runs inside the root module's forward (`in_root_forward`), where lm_head's weight is
whole, as tigon's fused next-token loss does inside the patched forward; under DeepSpeed ZeRO-3 it runs as the
head's own forward (`on_head`), whose hooks gather the partitioned weight and partition its gradient, as the
fused next-token loss does there.

The reference log-probs (DPO, KTO) come from `objective.reference`: `model`, a frozen copy of the starting model
run beside the policy in the same fused pass (`ref_hidden`; under FSDP2 sharded as the policy is, under ZeRO-3
partitioned by an engine of its own, with no optimizer in either case); `precomputed`, one pass over the training data
before the first step that stores each sequence's summed completion log-probs; `none`, zero (reference-free DPO).

Normalization: each op averages over the pairs (KTO: sequences) it is given, so a micro-batch's loss is
weighted by its share of the global batch's pairs; with equal micro-batches that is the mean over micro-batches
and ranks, as TRL's trainers (HF's gradient accumulation) compute it. The metrics are TRL's names
(`rewards/chosen`, `rewards/margins`, `logps/chosen`, ...), averaged over the global batch.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from tigon.runtime.batches import autocast, collate, eval_batches
from tigon.runtime.config import ConfigError, RunConfig
from tigon.runtime.data import DataError, token_multiple
from tigon.runtime.deepspeed_engine import frozen_engine
from tigon.runtime.distributed import DistEnv, all_reduce_sum
from tigon.runtime.distributed import unwrap as unwrap_ddp
from tigon.runtime.parallel import shard_model
from tigon.runtime.preference_batch import PreferenceRows, preference_rows, rows

IGNORE_INDEX = -100
T = TypeVar("T")
STATE = "_tigon_objective"  # the unwrapped model's __dict__ key of its ObjectiveState (not a submodule)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper or a DeepSpeed engine (whose forward runs the model's)."""
    module = unwrap_ddp(model)
    deepspeed = sys.modules.get("deepspeed")
    return module.module if deepspeed is not None and isinstance(module, deepspeed.DeepSpeedEngine) else module


@dataclass
class ObjectiveState:
    """What a preference or distillation run keeps beside the model: the frozen reference (or teacher), the
    precomputed teacher's head weight (`distill.precompute_teacher`), and the last step's metrics."""

    reference: nn.Module | None = None
    teacher_weight: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def state_of(model: nn.Module) -> ObjectiveState:
    """The model's ObjectiveState (made on first use); kept out of its modules, parameters and state dict."""
    module = unwrap(model)
    if STATE not in module.__dict__:
        module.__dict__[STATE] = ObjectiveState()
    return module.__dict__[STATE]


def check_objective(config: RunConfig) -> None:
    """Settings a preference objective cannot run with, named with the fix."""
    objective = config.objective
    if not objective.preference:
        return
    name = f"objective.type {objective.type!r}"
    if config.data.format != "text":
        raise ConfigError(
            f"{name} reads TRL's preference records (prompt/chosen/rejected; kto: prompt/completion/label), as text "
            f"or chat messages, so data.format {config.data.format!r} does not apply; remove data.format"
        )
    if "exact_match" in config.eval.metrics:
        raise ConfigError(f"{name} evaluates the preference loss and rewards; set eval.metrics: [loss]")
    if config.lora.enabled and objective.reference_source == "model":
        raise ConfigError(
            f"{name} with LoRA: a frozen reference copy would duplicate the base weights; set objective.reference: "
            "precomputed (one pass before training)"
        )


def final_hidden(
    model: nn.Module, inputs: dict[str, torch.Tensor], direct: bool = False, rows: torch.Tensor | None = None
) -> torch.Tensor:
    """The decoder's last hidden states `(B, T, H)` from a forward (through any DDP wrapper) that keeps no logits.

    `direct`: call the model's forward method itself, not through its hooks (inside `in_root_forward`, where the
    FSDP2 root's hooks already ran). `rows`: the positions a loss reads, which a family's last layer may compute
    alone (`tigon.kernels.patching.causal_lm.last_hidden_state`)."""
    from tigon.kernels.patching.causal_lm import last_hidden_state

    module = unwrap(model)
    forward = functools.partial(type(module).forward, module) if direct else model
    return last_hidden_state(forward, module, rows, **inputs)


def in_root_forward(model: nn.Module, function: Callable[[bool], T]) -> T:
    """`function(direct)` run as the FSDP2 root's forward when `model` is sharded, else `function(False)`.

    The fused losses read lm_head's weight outside the decoder: run inside the root's forward (its pre-forward
    hook unshards the root's parameters, lm_head's among them), they see the whole weight, and its gradient is
    reduce-scattered with the others', as tigon's fused next-token loss is inside the patched forward.
    `direct=True` tells `function` to call the model's forward method itself (the hooks have run)."""
    from tigon.kernels.patching.causal_lm import run_as_forward

    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and isinstance(model, fsdp.FSDPModule):
        # an argument for FSDP2's root pre-forward, which on a GPU moves the call's arguments and fails on none
        placeholder = torch.zeros(())
        return run_as_forward(model, lambda _: function(True), placeholder)
    return function(False)


def freeze(model: nn.Module, config: RunConfig, env: DistEnv, device: torch.device) -> nn.Module:
    """A frozen model run beside the trained one (a reference or a teacher): eval mode, no gradients; under FSDP2
    sharded as the trained model is (`parallel.shard_model`, with no optimizer), under DeepSpeed ZeRO-3 partitioned
    by an inference engine of its own (`deepspeed_engine.frozen_engine`), so it fits where the trained model fits."""
    model.eval()
    model.requires_grad_(False)
    parallelism = config.parallelism
    if parallelism.strategy == "fsdp":
        shard_model(model, config, env, device, frozen=True)
    elif parallelism.strategy == "deepspeed" and parallelism.stage == 3:
        return frozen_engine(model, config, env, device)
    return model


def head(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """lm_head's weight and bias, for a head the fused ops compute exactly (a plain linear map); as the strategy
    keeps them (a shard, or a ZeRO-3 partition: see `on_head` and `frozen_head` for the whole weight)."""
    config = unwrap(model).config
    quirks = [name for name in ("final_logit_softcapping", "logits_scaling") if getattr(config, name, None)]
    if quirks:
        raise ConfigError(
            f"the fused preference and distillation losses compute a plain linear head, and this model's head "
            f"applies {' and '.join(quirks)} (e.g. Gemma 2/3, Granite); train it with objective.type 'sft', or set "
            f"{quirks[0]} to null in model.config_overrides if the model was trained without it"
        )
    module = unwrap(model).get_output_embeddings()
    if not isinstance(module, nn.Linear):
        raise ConfigError(
            f"the fused loss reads lm_head's weight, but lm_head is a {type(module).__name__}; keep "
            "adapters (lora.target_modules) off lm_head"
        )
    return module.weight, module.bias


def on_head(model: nn.Module, function: Callable[..., T], hidden: torch.Tensor) -> T:
    """`function(hidden, weight, bias)` on the trained model's head, with `hidden` and the head in the compute dtype
    (`in_compute_dtype`). Where the weight is whole only inside the head's own forward (DeepSpeed ZeRO-3), it runs
    as that forward (`causal_lm.run_as_forward`, as tigon's fused next-token loss does): the hooks gather the
    partitioned weight around it, and its gradient flows back into the partition."""
    from tigon.kernels.patching.causal_lm import gathered_in_own_forward, run_as_forward

    head(model)  # the checks, before the module is used
    module = unwrap(model).get_output_embeddings()

    def call(hidden: torch.Tensor) -> T:
        return function(*in_compute_dtype(hidden, module.weight, module.bias))

    return run_as_forward(module, call, hidden) if gathered_in_own_forward(module) else call(hidden)


@contextlib.contextmanager
def frozen_head(model: nn.Module) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """A frozen model's lm_head weight and bias, whole while the context is open, without gradient: FSDP2's shards
    gathered (`full_tensor`); ZeRO-3's partitions gathered in place (`deepspeed.zero.GatheredParameters`, a
    collective) and partitioned again on exit. The fused ops keep only gradients for their backward, never the
    frozen weight, so nothing reads it after the context."""
    from tigon.kernels.utils import gather_dtensors

    weight, bias = head(model)
    if not hasattr(weight, "ds_id"):
        with torch.no_grad():
            weight, bias = gather_dtensors(weight, bias)
        yield weight, bias
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters([t for t in (weight, bias) if t is not None]):
        yield weight, bias


def in_compute_dtype(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Under autocast the head runs in the autocast dtype, as nn.Linear would."""
    if not torch.is_autocast_enabled(tensors[0].device.type):
        return list(tensors)
    dtype = torch.get_autocast_dtype(tensors[0].device.type)
    return [t.to(dtype) if t is not None else None for t in tensors]


def run_layout(batch: dict[str, torch.Tensor], config: RunConfig, device: torch.device) -> PreferenceRows:
    """A micro-batch's rows as the run lays them out: padded or packed (`data.packing`), for its attention, its
    tokens a multiple of what its precision's matrix products need, the op's rows without the prompts
    (kernels.skip_unlabelled)."""
    return preference_rows(
        batch,
        config.data.packing,
        config.model.attn_implementation,
        device,
        token_multiple(config.training.precision),
        skip_prompts=config.kernels.skip_unlabelled,
    )


def preference_loss(
    model: nn.Module, batch: dict[str, torch.Tensor], config: RunConfig, device: torch.device, env: DistEnv | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The objective's loss (averaged over the micro-batch's pairs or sequences) and the op's metrics. `env`: the
    ranks KTO's reference point is averaged over (None: this rank's own, where ranks run different batch counts)."""
    objective = config.objective
    layout = run_layout(batch, config, device)
    target = layout.target
    reference: dict[str, torch.Tensor] = {}
    source = objective.reference_source if objective.type in ("dpo", "kto") else None
    with contextlib.ExitStack() as stack:
        if source == "model":
            frozen = state_of(model).reference
            with torch.no_grad():
                ref_hidden = layout.op_layout(final_hidden(frozen, layout.inputs, rows=layout.read))
            ref_weight, ref_bias = stack.enter_context(frozen_head(frozen))  # whole until the policy's op is done
            ref_hidden, ref_weight, ref_bias = in_compute_dtype(ref_hidden, ref_weight, ref_bias)
            reference = {"ref_hidden": ref_hidden, "ref_weight": ref_weight, "ref_bias": ref_bias}
        elif source == "precomputed":
            reference = {"ref_logps": rows(batch["ref_logps"]).to(device, non_blocking=True)}
        elif source == "none":
            reference = {"ref_logps": torch.zeros(target.shape[0], dtype=torch.float64, device=device)}
        return in_root_forward(
            model, lambda direct: policy_loss(model, layout, reference, batch, config, device, env, direct)
        )


def policy_loss(
    model: nn.Module,
    layout: PreferenceRows,
    reference: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    config: RunConfig,
    device: torch.device,
    env: DistEnv | None,
    direct: bool,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The fused preference op on the trained model's final hidden states and head (`direct`: see final_hidden)."""
    hidden = layout.op_layout(final_hidden(model, layout.inputs, direct, layout.read))
    op = functools.partial(preference_op, target=layout.target, reference=reference, batch=batch, config=config)
    return on_head(model, functools.partial(op, device=device, env=env), hidden)


def preference_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    reference: dict[str, torch.Tensor],
    batch: dict[str, torch.Tensor],
    config: RunConfig,
    device: torch.device,
    env: DistEnv | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The objective's fused op on the final hidden states and lm_head's whole weight and bias."""
    from tigon.kernels import functional as F

    objective = config.objective
    beta = objective.resolved_beta
    if objective.type == "dpo":
        return F.fused_linear_dpo(
            hidden, weight, target, bias, beta=beta, label_smoothing=objective.label_smoothing,
            loss_type=objective.loss_types, loss_weights=objective.loss_weights, rpo_alpha=objective.rpo_alpha,
            **reference,
        )  # fmt: skip
    if objective.type == "cpo":
        return F.fused_linear_cpo(
            hidden, weight, target, bias, beta=beta, alpha=objective.resolved_alpha,
            label_smoothing=objective.label_smoothing,
        )  # fmt: skip
    if objective.type == "simpo":
        return F.fused_linear_simpo(
            hidden, weight, target, bias, beta=beta, gamma=objective.gamma, alpha=objective.resolved_alpha,
            label_smoothing=objective.label_smoothing,
        )  # fmt: skip
    if objective.type == "orpo":
        return F.fused_linear_orpo(hidden, weight, target, bias, beta=beta)
    n = target.shape[0] // 2  # the completions, then the mismatched (KL) sequences
    kl = kto_reference_point(hidden[n:], weight, bias, target[n:], reference, n, env)
    reference = {name: value[:n] if name in ("ref_hidden", "ref_logps") else value for name, value in reference.items()}
    return F.fused_linear_kto(
        hidden[:n], weight, target[:n], rows(batch["desirable"]).to(device), bias, beta=beta, kl=kl,
        desirable_weight=objective.desirable_weight, undesirable_weight=objective.undesirable_weight, **reference,
    )  # fmt: skip


def kto_reference_point(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    reference: dict[str, torch.Tensor],
    n: int,
    env: DistEnv | None,
) -> torch.Tensor:
    """KTO's reference point as TRL estimates it: the mean of policy minus reference log-probs of the mismatched
    sequences, averaged over the ranks (`env`; None: this rank's), at least 0; no gradient."""
    from tigon.kernels import functional as F

    with torch.no_grad():
        logps = F.sequence_logps(hidden.detach(), weight.detach(), target, bias)
        if "ref_logps" in reference:
            ref = reference["ref_logps"][n:]
        else:
            ref = F.sequence_logps(reference["ref_hidden"][n:], reference["ref_weight"], target, reference["ref_bias"])
        kl = (logps - ref).mean().reshape(1)
        if env is not None:
            kl = all_reduce_sum(kl, env) / env.world_size
    return kl.clamp(min=0).reshape(())


def _metric_sums(objective: str, metrics: dict[str, torch.Tensor], batch: dict, device) -> dict[str, torch.Tensor]:
    """Sums (and counts) of TRL's metrics over one micro-batch, to be averaged over the global batch. Nothing here
    waits for the GPU (no boolean-mask indexing, no tensor copied from the host): it runs between the forward and
    the backward, and a wait there would leave the GPU idle while the backward is launched."""
    if objective == "kto":
        desirable = batch["desirable"].reshape(-1).to(device)
        rewards, logps = metrics["rewards"].double(), metrics["logps"].double()
        return {
            "rewards/chosen": torch.where(desirable, rewards, 0.0).sum(),
            "rewards/rejected": torch.where(desirable, 0.0, rewards).sum(),
            "logps/chosen": torch.where(desirable, logps, 0.0).sum(),
            "logps/rejected": torch.where(desirable, 0.0, logps).sum(),
            "count/chosen": desirable.sum().double(),
            "count/rejected": (~desirable).sum().double(),
            "kl": metrics["kl"].double().reshape(()) * desirable.numel(),
            "count/sequences": torch.full((), float(desirable.numel()), dtype=torch.float64, device=device),
        }
    chosen, rejected = metrics["chosen_rewards"].double(), metrics["rejected_rewards"].double()
    sums = {
        "rewards/chosen": chosen.sum(),
        "rewards/rejected": rejected.sum(),
        "rewards/accuracies": (chosen > rejected).double().sum(),
        "rewards/margins": (chosen - rejected).sum(),
        "logps/chosen": metrics["chosen_logps"].double().sum(),
        "logps/rejected": metrics["rejected_logps"].double().sum(),
        "count/pairs": torch.full((), float(chosen.numel()), dtype=torch.float64, device=device),
    }
    for name in ("nll_loss", "log_odds_ratio", "log_odds_chosen"):  # ORPO's and CPO's extra metrics, TRL's names
        if name in metrics:
            sums[name] = metrics[name].double().sum() * (chosen.numel() if metrics[name].dim() == 0 else 1)
    return sums


def _averages(sums: dict[str, torch.Tensor], objective: str) -> dict[str, float]:
    """Global-batch averages from summed metrics: per pair, or (KTO) per desirable / undesirable completion."""
    if objective == "kto":
        averages = {}
        for name in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
            count = float(sums["count/" + name.split("/")[1]])
            if count > 0:
                averages[name] = float(sums[name]) / count
        if "rewards/chosen" in averages and "rewards/rejected" in averages:
            averages["rewards/margins"] = averages["rewards/chosen"] - averages["rewards/rejected"]
        averages["kl"] = float(sums["kl"]) / float(sums["count/sequences"])
        return averages
    pairs = float(sums["count/pairs"])
    return {name: float(value) / pairs for name, value in sums.items() if not name.startswith("count/")}


def global_pairs(micro_batches: list[dict], env: DistEnv, device: torch.device) -> tuple[float, int]:
    """(pairs, or KTO completions, in the global batch; tokens processed), summed over ranks."""
    counts = torch.tensor(
        [
            sum(batch["input_ids"].shape[0] for batch in micro_batches),
            sum(int(batch["attention_mask"].sum()) for batch in micro_batches),
        ],
        dtype=torch.float64,
        device=device,
    )
    all_reduce_sum(counts, env)
    return float(counts[0]), int(counts[1])


def flags_on_device(batch: dict, device: torch.device) -> dict:
    """The batch with KTO's desirable flags copied to the GPU once, before the forward is queued (the op and the
    metrics read them there; a blocking copy between forward and loss would wait for the GPU)."""
    if "desirable" not in batch:
        return batch
    return {**batch, "desirable": batch["desirable"].to(device, non_blocking=True)}


def preference_micro_batch(
    model: nn.Module, batch: dict, config: RunConfig, env: DistEnv, device: torch.device, pairs: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A micro-batch's loss to backpropagate (its share of the global batch's `pairs`, times the world size: data
    parallelism averages the gradients over the ranks) and its sums of the step's metrics, `loss` among them."""
    batch = flags_on_device(batch, device)
    loss, metrics = preference_loss(model, batch, config, device, env)
    share = batch["input_ids"].shape[0] / pairs
    sums = _metric_sums(config.objective.type, metrics, batch, device)
    sums["loss"] = loss.detach().double() * share
    return loss.float() * (share * env.world_size), sums


def preference_result(sums: dict[str, torch.Tensor], config: RunConfig, pairs: float) -> tuple[float, dict]:
    """The step's loss and TRL's metrics from the metric sums of all its micro-batches on all ranks."""
    sums = dict(sums)
    return float(sums.pop("loss")), _averages(sums, config.objective.type)


def sequence_reference_logps(model: nn.Module, batch: dict, config: RunConfig, device: torch.device) -> torch.Tensor:
    """Summed completion log-probs `(B, R)` float64 of a batch of items under `model`, without gradient, with the
    rows laid out as training lays them (`data.packing`)."""
    from tigon.kernels import functional as F

    layout = run_layout(batch, config, device)
    with torch.no_grad(), autocast(device, config.training.precision):
        hidden = layout.op_layout(final_hidden(model, layout.inputs, rows=layout.read))
        with frozen_head(model) as (weight, bias):
            hidden, weight, bias = in_compute_dtype(hidden, weight, bias)
            logps = F.sequence_logps(hidden, weight, layout.target, bias)
    return logps.reshape(batch["input_ids"].shape[1], -1).transpose(0, 1)


def precompute_reference(model: nn.Module, dataset, config: RunConfig, env: DistEnv, device: torch.device) -> None:
    """Fill `dataset.ref_logps` with the starting model's log-probs: each rank scores its share (under FSDP2 rank 0
    scores all, before the model is sharded), summed over ranks."""

    n, width = len(dataset), dataset.input_ids.shape[1]
    values = torch.zeros((n, width), dtype=torch.float64, device=device)
    indices = list(range(env.rank, n, env.world_size))
    if config.parallelism.strategy == "fsdp":  # before sharding only rank 0 holds the weights (the others: meta)
        indices = list(range(n)) if env.is_main else []
    size = config.training.micro_batch_size
    was_training = model.training
    model.eval()
    for start in range(0, len(indices), size):
        chunk = indices[start : start + size]
        batch = collate([dataset[i] for i in chunk])
        values[chunk] = sequence_reference_logps(model, batch, config, device)
    model.train(was_training)
    dataset.ref_logps = all_reduce_sum(values, env).cpu()


def evaluate_objective(model: nn.Module, dataset, config: RunConfig, env: DistEnv, device) -> dict[str, float]:
    """The preference loss and TRL's metrics over the held-out examples (this rank's share, summed over ranks)."""

    batches = eval_batches(dataset, config, env)
    if not any(batches):
        raise DataError(
            f"data.eval: {len(dataset)} held-out examples leave rank {env.rank} of {env.world_size} none to evaluate; "
            "add examples to data.eval, or drop it"
        )
    sums: dict[str, torch.Tensor] = {}
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for chunk in batches:
        batch = flags_on_device(collate([dataset[i] for i in chunk or [0]]), device)
        with autocast(device, config.training.precision):
            loss, metrics = preference_loss(model, batch, config, device, None)
        if not chunk:
            continue
        loss_sum += loss.double() * len(chunk)
        for name, value in _metric_sums(config.objective.type, metrics, batch, device).items():
            sums[name] = sums.get(name, 0) + value
    names = sorted(sums)
    count = torch.tensor(float(sum(len(c) for c in batches)), dtype=torch.float64, device=device)
    stacked = all_reduce_sum(torch.stack([sums[name] for name in names] + [loss_sum, count]), env)
    averages = _averages(dict(zip(names, stacked[:-2], strict=True)), config.objective.type)
    return {"loss": float(stacked[-2] / stacked[-1]), **averages}
