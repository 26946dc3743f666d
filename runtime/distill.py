"""Distillation (`objective.type: distill`) in every trainer: a frozen teacher beside the student.

    teacher = load_teacher(config, model, tokenizer, env, device)   # checked, loaded, frozen (sharded: fsdp, zero3)
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
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tigon.runtime.batches import autocast, collate, eval_batches, label_tokens
from tigon.runtime.config import ConfigError, LoraConfig, RunConfig
from tigon.runtime.data import model_inputs, token_multiple
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


def distill_sums(
    model: nn.Module, teacher: nn.Module, batch: dict, config: RunConfig, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross entropy, summed distillation loss) over the micro-batch's completion tokens, float32."""
    from tigon.kernels import functional as F

    objective = config.objective
    batch = {name: value.to(device, non_blocking=True) for name, value in batch.items()}
    inputs = model_inputs(
        batch, config.model.attn_implementation, token_multiple=token_multiple(config.training.precision)
    )
    labels = inputs.pop("labels")
    target = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    head_weight(model, "the student")
    head_weight(teacher, "the teacher")
    with torch.no_grad():
        teacher_hidden = final_hidden(teacher, inputs)
    alpha = objective.resolved_alpha
    with frozen_head(teacher) as (teacher_weight, _):  # whole until the student's ops are done
        teacher_hidden, teacher_weight = in_compute_dtype(teacher_hidden, teacher_weight)
        teacher_hidden = teacher_hidden.reshape(-1, teacher_hidden.shape[-1])

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
            hidden = final_hidden(model, inputs, direct=direct)
            return on_head(model, op, hidden.reshape(-1, hidden.shape[-1]))

        return in_root_forward(model, losses)


def distill_micro_batch(
    model: nn.Module, batch: dict, config: RunConfig, env: DistEnv, device: torch.device, n_label: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A micro-batch's loss to backpropagate (its terms summed over its completion tokens, divided by the global
    batch's `n_label`, times the world size: data parallelism averages the gradients over the ranks) and its sums
    of the two terms (`post_training.ObjectiveStep` runs it)."""
    alpha = config.objective.resolved_alpha
    ce, jsd = distill_sums(model, state_of(model).reference, batch, config, device)
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

    teacher = state_of(model).reference
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for chunk in eval_batches(dataset, config, env):
        batch = collate([dataset[i] for i in chunk or [0]])
        with autocast(device, config.training.precision):
            ce, jsd = distill_sums(model, teacher, batch, config, device)
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
