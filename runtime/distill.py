"""Distillation (`objective.type: distill`) in every trainer: a frozen teacher beside the student.

    teacher = load_teacher(config, model, tokenizer, env, device)   # checked, loaded, frozen (sharded: fsdp, zero3)
    precompute_teacher(config, prepared)    # objective.teacher.precompute: its hidden states stored, its layers freed
    loss, sums = distill_micro_batch(model, batch, config, env, device, n_label)   # through post_training.ObjectiveStep

The data are the next-token run's (`data.format` text, instruction or chat, packed or not); the completion tokens
are those with a label. On each micro-batch both models run with no logit positions kept, and two fused linear
ops read the final hidden states and the heads' weights: `fused_linear_jsd` (the generalized JSD of the student
against the teacher at `objective.temperature`, `objective.beta` 0: forward KL, 1: reverse KL) and
`fused_linear_cross_entropy` (the hard labels). Neither model's `(tokens, vocabulary)` logits ever exist.

    loss = alpha * cross_entropy + (1 - alpha) * distillation      (alpha = objective.alpha)

Each term is summed over the global batch's completion tokens and divided by their number, as the next-token
loss is, so gradient accumulation and ranks change nothing but rounding. The step's `ce_loss` and
`distill_loss` are the two terms' per-token means; they are logged beside `loss`.

With `objective.teacher.precompute: true` the teacher runs once, before training, over the training and held-out
data: each item keeps the teacher's final hidden states at its completion tokens (on the host, in the compute
dtype), the student keeps the teacher's head weight, and the teacher's layers are freed. A micro-batch's stored
rows are placed at its completion tokens and read by the same `fused_linear_jsd`, so the losses are those of the
teacher run beside the student, up to the rounding of the teacher's forward over other batches.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn

from tigon.runtime.batches import autocast, collate, eval_batches, label_tokens
from tigon.runtime.config import ConfigError, LoraConfig, RunConfig
from tigon.runtime.data import MODEL_INPUTS, model_inputs, token_multiple
from tigon.runtime.distributed import DistEnv, all_reduce_sum, unwrap
from tigon.runtime.hub import config_json, fetch_model
from tigon.runtime.model import build_model
from tigon.runtime.objectives import (
    IGNORE_INDEX,
    final_hidden,
    freeze,
    frozen_head,
    head,
    in_compute_dtype,
    in_root_forward,
    on_head,
    state_of,
)
from tigon.runtime.tokenizer import load_tokenizer

logger = logging.getLogger("tigon.runtime")


def check_vocabulary(config: RunConfig, tokenizer, vocab_rows: int) -> None:
    """The teacher's tokenizer and head must be the student's: the JSD compares the two distributions token by
    token. Read from the teacher's files before its weights are loaded."""
    teacher = config.objective.teacher.as_model(config.model)
    where = f"objective.teacher.path {teacher.path}"
    raw = config_json(teacher)
    rows = raw.get("vocab_size", raw.get("text_config", {}).get("vocab_size"))
    if rows != vocab_rows:
        raise ConfigError(
            f"{where} has a vocabulary of {rows} tokens and the student's head {vocab_rows}: distillation compares the "
            "two distributions token by token, so teacher and student must share the tokenizer; pick a teacher of "
            "the student's family (same tokenizer), or a student whose model.path or model.tokenizer is the teacher's"
        )
    try:
        teacher_tokenizer = load_tokenizer(teacher)
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"{where}: its tokenizer could not be loaded ({error}); save it beside the weights "
            "(tokenizer.save_pretrained) so the vocabulary can be checked against the student's"
        ) from None
    if teacher_tokenizer.get_vocab() != tokenizer.get_vocab():
        differing = sorted(set(teacher_tokenizer.get_vocab().items()) ^ set(tokenizer.get_vocab().items()))[:3]
        raise ConfigError(
            f"{where} has another tokenizer than the student (token/id pairs in one only: {differing}); teacher and "
            "student must share the tokenizer vocabulary: set model.tokenizer to the teacher's, or pick a teacher "
            "of the student's family"
        )


def load_teacher(config: RunConfig, model: nn.Module, tokenizer, env: DistEnv, device: torch.device) -> nn.Module:
    """The teacher, fetched, checked and loaded by the code that loads the student (`hub.fetch_model`,
    `model.build_model`: revision, trust_remote_code, object stores), frozen, in eval mode, on `device`; under
    FSDP2 sharded like the student (rank 0 loads, the others receive its weights), under DeepSpeed ZeRO-3
    partitioned by an inference engine of its own (`objectives.freeze`), with no optimizer."""
    teacher_model = config.objective.teacher.as_model(config.model)
    fetch_model(teacher_model, env)
    vocab_rows = unwrap(model).get_output_embeddings().weight.shape[0]
    check_vocabulary(config, tokenizer, vocab_rows)
    teacher_config = config.model_copy(
        update={
            "model": teacher_model,
            "lora": LoraConfig(),
            "training": config.training.model_copy(update={"gradient_checkpointing": False, "compile": False}),
        }
    )
    meta = config.parallelism.strategy == "fsdp" and env.distributed and not env.is_main
    teacher = build_model(teacher_config, len(tokenizer), tokenizer, meta=meta, device=device)
    if not meta:
        teacher = teacher.to(device)
    rows = head_weight(teacher, "the teacher").shape[0]
    if rows != vocab_rows:  # a config.json whose vocab_size is not the head's (a remote-code model)
        raise ConfigError(
            f"objective.teacher.path {teacher_model.path}: its head has {rows} rows and the student's {vocab_rows}; "
            "teacher and student must share the tokenizer vocabulary"
        )
    if env.is_main:
        logger.info("distill: teacher %s loaded (%s parameters)", teacher_model.path, f"{teacher.num_parameters():,}")
    return freeze(teacher, config, env, device)


def head_weight(model: nn.Module, who: str) -> torch.Tensor:
    """The lm_head weight the fused JSD reads (as the strategy keeps it); a head with a bias is refused."""
    weight, bias = head(model)
    if bias is not None:
        raise ConfigError(
            f"objective.type 'distill': {who}'s lm_head has a bias, and the fused linear JSD computes a head without "
            "one; distill with models whose head has no bias (as Llama, Qwen, Mistral, Gemma)"
        )
    return weight


def distill_inputs(
    batch: dict, config: RunConfig, device: torch.device, skip_prompts: bool = False
) -> tuple[dict, torch.Tensor, torch.Tensor | None]:
    """Both models' inputs for a micro-batch, on `device`; its flat next-token targets (-100: no completion); and
    with `skip_prompts` (kernels.skip_unlabelled) the positions the heads project (`positions_with_loss`; None: all),
    the targets then at those positions only."""
    inputs = model_inputs(
        {name: batch[name] for name in MODEL_INPUTS},
        config.model.attn_implementation,
        device,
        token_multiple(config.training.precision),
        loss_positions=skip_prompts,
    )
    labels, positions = inputs.pop("labels"), inputs.pop("loss_positions", None)
    target = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    return inputs, target if positions is None else target[positions], positions


@contextlib.contextmanager
def teacher_outputs(
    model: nn.Module,
    batch: dict,
    inputs: dict,
    target: torch.Tensor,
    positions: torch.Tensor | None,
    config: RunConfig,
    device: torch.device,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The teacher's final hidden states at the positions of `target` (`positions`, None: every one) and its head
    weight in the compute dtype, whole while the context is open: the teacher run beside the student, or precomputed
    (its stored rows placed at the completion tokens, zeros elsewhere, which the JSD ignores as it ignores their
    target -100)."""
    state = state_of(model)
    if config.objective.teacher.precompute:
        weight = state.teacher_weight
        rows = batch["teacher_hidden"].to(device, non_blocking=True)
        hidden = weight.new_zeros((target.shape[0], weight.shape[1]))
        yield hidden.masked_scatter_((target != IGNORE_INDEX)[:, None], rows), weight
        return
    teacher = state.reference
    head_weight(teacher, "the teacher")
    with torch.no_grad():
        hidden = final_hidden(teacher, inputs, rows=positions)
    with frozen_head(teacher) as (weight, _):  # whole until the student's ops are done
        hidden, weight = in_compute_dtype(hidden, weight)
        yield at_positions(hidden, positions), weight


def at_positions(hidden: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """Hidden states `(..., H)` flattened to rows, only those at `positions` (sorted; None: every row). States with
    as many rows as positions are those rows already (`final_hidden`'s `rows`), or every row, which they name."""
    rows = hidden.reshape(-1, hidden.shape[-1])
    return rows if positions is None or len(rows) == len(positions) else rows.index_select(0, positions)


def distill_sums(
    model: nn.Module, batch: dict, config: RunConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross entropy, summed distillation loss) over the micro-batch's completion tokens, float32."""
    from tigon.kernels import functional as F

    objective = config.objective
    inputs, target, positions = distill_inputs(batch, config, device, config.kernels.skip_unlabelled)
    head_weight(model, "the student")
    alpha = objective.resolved_alpha
    with teacher_outputs(model, batch, inputs, target, positions, config, device) as (teacher_hidden, teacher_weight):

        def op(hidden: torch.Tensor, weight: torch.Tensor, _bias: None) -> tuple[torch.Tensor, torch.Tensor]:
            with torch.set_grad_enabled(torch.is_grad_enabled() and alpha > 0):
                ce = F.fused_linear_cross_entropy(hidden, weight, target, reduction="sum")
            with torch.set_grad_enabled(torch.is_grad_enabled() and alpha < 1):
                jsd = F.fused_linear_jsd(
                    hidden, weight, teacher_hidden, teacher_weight, target, beta=objective.resolved_beta,
                    temperature=objective.temperature, reduction="sum",
                )  # fmt: skip
            return ce.float(), jsd.float()

        def losses(direct: bool) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = final_hidden(model, inputs, direct=direct, rows=positions)
            return on_head(model, op, at_positions(hidden, positions))

        return in_root_forward(model, losses)


def precompute_teacher(config: RunConfig, prepared) -> None:
    """`objective.teacher.precompute`, before the student is wrapped (`prepared`: run.Prepared): the teacher, loaded
    as `load_teacher` loads it, scores the training and held-out data once; each dataset keeps its final hidden
    states at the completion tokens on the host (`PackedDataset.teacher_hidden`), the student's state keeps its
    head weight whole on the device, and the teacher itself is dropped."""
    model, env, device = prepared.model, prepared.env, prepared.device
    teacher = load_teacher(config, model, prepared.tokenizer, env, device)
    with autocast(device, config.training.precision), frozen_head(teacher) as (weight, _):
        weight = in_compute_dtype(weight.detach().to(device, copy=True))[0]
    datasets = [dataset for dataset in (prepared.train_dataset, prepared.eval_dataset) if dataset is not None]
    for dataset in datasets:
        dataset.teacher_hidden = teacher_hidden_states(teacher, weight, dataset, config, env, device)
    state_of(model).teacher_weight = weight
    del teacher
    if env.is_main:
        rows = [dataset.teacher_hidden[0] for dataset in datasets]
        logger.info(
            "distill: teacher hidden states precomputed at %s completion tokens of %s items (%.1f MiB on the host); "
            "the teacher's layers are freed, its head kept (%.1f MiB)",
            f"{sum(r.shape[0] for r in rows):,}", f"{sum(len(d) for d in datasets):,}",
            sum(r.nbytes for r in rows) / 2**20, weight.nbytes / 2**20,
        )  # fmt: skip


def teacher_hidden_states(
    teacher: nn.Module, weight: torch.Tensor, dataset, config: RunConfig, env: DistEnv, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's final hidden states at every item's completion tokens, end to end on the host in `weight`'s
    dtype, and each item's first row (N + 1 offsets). The items go in rounds of one micro-batch per rank, each rank
    scoring its own and the rounds summed over the ranks; a rank with none left scores item 0 and drops it (with
    sharded parameters every forward is a collective)."""
    offsets = nn.functional.pad((dataset.labels[:, 1:] != IGNORE_INDEX).sum(1).cumsum(0), (1, 0))
    stored = torch.empty((int(offsets[-1]), weight.shape[1]), dtype=weight.dtype)
    size, n = config.training.micro_batch_size, len(dataset)
    for start in range(0, n, size * env.world_size):
        end = min(start + size * env.world_size, n)
        mine = list(range(min(start + env.rank * size, end), min(start + (env.rank + 1) * size, end)))
        inputs, target, _ = distill_inputs(collate([dataset[i] for i in mine or [0]]), config, device)
        with torch.no_grad(), autocast(device, config.training.precision):
            hidden = in_compute_dtype(final_hidden(teacher, inputs))[0]
        rows = torch.zeros((int(offsets[end] - offsets[start]), weight.shape[1]), dtype=weight.dtype, device=device)
        if mine:
            first, last = int(offsets[mine[0]] - offsets[start]), int(offsets[mine[-1] + 1] - offsets[start])
            rows[first:last] = hidden.reshape(-1, hidden.shape[-1])[target != IGNORE_INDEX]
        stored[offsets[start] : offsets[end]] = all_reduce_sum(rows, env).cpu()
    return stored, offsets


def distill_micro_batch(
    model: nn.Module, batch: dict, config: RunConfig, env: DistEnv, device: torch.device, n_label: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A micro-batch's loss to backpropagate (its terms summed over its completion tokens, divided by the global
    batch's `n_label`, times the world size: data parallelism averages the gradients over the ranks) and its sums
    of the two terms (`post_training.ObjectiveStep` runs it)."""
    alpha = config.objective.resolved_alpha
    ce, jsd = distill_sums(model, batch, config, device)
    sums = {"ce_loss": ce.detach().double(), "distill_loss": jsd.detach().double()}
    return (alpha * ce + (1 - alpha) * jsd) * (env.world_size / n_label), sums


def distill_result(sums: dict[str, torch.Tensor], config: RunConfig, n_label: float) -> tuple[float, dict]:
    """The step's loss and its two terms per completion token, from the sums over all micro-batches and ranks."""
    alpha = config.objective.resolved_alpha
    ce_loss, distill_loss = float(sums["ce_loss"]) / n_label, float(sums["distill_loss"]) / n_label
    return alpha * ce_loss + (1 - alpha) * distill_loss, {"ce_loss": ce_loss, "distill_loss": distill_loss}


def evaluate_distill(model: nn.Module, dataset, config: RunConfig, env: DistEnv, device) -> dict[str, float]:
    """The distillation loss, its cross entropy and its distillation term per completion token over the held-out
    sequences (this rank's share, summed over ranks)."""
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for chunk in eval_batches(dataset, config, env):
        batch = collate([dataset[i] for i in chunk or [0]])
        with autocast(device, config.training.precision):
            ce, jsd = distill_sums(model, batch, config, device)
        if chunk:
            totals += torch.tensor(
                [float(ce), float(jsd), label_tokens(batch["labels"])], dtype=torch.float64, device=device
            )
    ce_sum, jsd_sum, n_label = (float(value) for value in all_reduce_sum(totals, env))
    if n_label == 0:
        return {"loss": float("nan")}
    alpha = config.objective.resolved_alpha
    ce_loss, distill_loss = ce_sum / n_label, jsd_sum / n_label
    return {"loss": alpha * ce_loss + (1 - alpha) * distill_loss, "ce_loss": ce_loss, "distill_loss": distill_loss}
