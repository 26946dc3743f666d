"""TRL's trainers computing their losses with tigon's fused linear ops: the `compute_loss` each one gets from
`tigon.kernels.integrations.use_tigon`.

Every loss here runs the model with no logit positions kept (`logits_to_keep` = an empty index), takes the final
hidden states from a forward hook on the decoder, and hands them with the head's weight to a fused op: SFT to
`fused_linear_cross_entropy`, DPO to `fused_linear_dpo`, KTO to `fused_linear_kto`, ORPO to `fused_linear_orpo`,
CPO to `fused_linear_cpo` and SimPO (CPO's `loss_type="simpo"`) to `fused_linear_simpo`. The `(tokens, vocabulary)`
logits never exist. The metrics keep TRL's names and definitions, except those the ops do not compute (`entropy`,
and DPO's `mean_token_accuracy`), which are not logged. A setting the ops cannot compute exactly raises
`UnsupportedByTigon` when `use_tigon` is called, naming the setting and the fix; nothing falls back silently.

TRL is imported only here, and this module only when `use_tigon` meets a TRL trainer.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn

from tigon.kernels import functional as F
from tigon.kernels.patching.causal_lm import LOSS_CHUNK_TOKENS, last_hidden_state

IGNORE_INDEX = -100


class UnsupportedByTigon(ValueError):
    """A trainer setting tigon's fused losses cannot compute exactly."""


def _refuse(setting: str, fix: str) -> None:
    raise UnsupportedByTigon(f"use_tigon: {setting} is not computed by tigon's fused losses; {fix}")


def causal_lm(trainer, model: nn.Module) -> nn.Module:
    """The transformers `*ForCausalLM` inside `model` (through accelerate's wrappers and a PEFT model)."""
    module = trainer.accelerator.unwrap_model(model)
    return module.get_base_model() if hasattr(module, "get_base_model") else module


def policy_hidden_and_head(trainer, model: nn.Module, model_inputs: dict) -> tuple:
    """(the causal LM, its last hidden states from a forward that projects no logits, lm_head's weight and bias)."""
    inner = causal_lm(trainer, model)
    weight, bias = plain_head(inner)
    return inner, last_hidden_state(model, inner, **model_inputs), weight, bias


def plain_head(inner: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """lm_head's weight and bias, for a head the fused ops compute exactly: a plain linear map."""
    config = inner.config.get_text_config()
    for quirk in ("final_logit_softcapping", "logits_scaling", "logit_scale"):
        if getattr(config, quirk, None):
            _refuse(f"a head with {quirk} (e.g. Gemma 2/3, Granite)", "train this model without use_tigon")
    head = inner.get_output_embeddings()
    if type(head) is not nn.Linear:
        _refuse(f"an lm_head of type {type(head).__name__}", "keep adapters (PEFT target_modules) off lm_head")
    return head.weight, head.bias


def chunk_tokens(inner: nn.Module) -> int | None:
    """The loss's tokens per chunk set with `use_tigon(trainer, loss_chunk_tokens=...)` (None: each op's own rule)."""
    return inner.__dict__.get(LOSS_CHUNK_TOKENS)


def groups_per_chunk(inner: nn.Module, target: torch.Tensor, group: int) -> int | None:
    """`loss_chunk_tokens` as a preference op's chunk size: whole groups (pairs or sequences), at least one."""
    tokens = chunk_tokens(inner)
    return None if tokens is None else max(1, tokens // (group * target.shape[1]))


def next_token_target(labels: torch.Tensor) -> torch.Tensor:
    """`labels` shifted left by one position, the last position ignored: the target each hidden state predicts."""
    return nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def check_common(trainer) -> None:
    """Settings no fused loss here computes: MoE auxiliary losses, encoder-decoder models, Liger-Kernel beside."""
    if getattr(trainer, "aux_loss_enabled", False):
        _refuse("the MoE router auxiliary loss", "set router_aux_loss_coef=0.0 in the config, or drop use_tigon")
    if getattr(trainer, "is_encoder_decoder", False):
        _refuse("an encoder-decoder model", "use_tigon trains decoder-only causal language models")
    if getattr(trainer.args, "use_liger_kernel", False):
        _refuse("use_liger_kernel=True together with use_tigon", "set use_liger_kernel=False")
    plain_head(causal_lm(trainer, trainer.model))


def _gathered_mean(trainer, values: torch.Tensor) -> float:
    return trainer.accelerator.gather_for_metrics(values.detach().reshape(-1)).float().mean().item()


def _gathered_ratio(trainer, total: torch.Tensor, count: torch.Tensor) -> float:
    """sum(total) / sum(count) over the ranks (0 without a count)."""
    total = trainer.accelerator.gather_for_metrics(total.detach().double().reshape(1)).sum()
    count = trainer.accelerator.gather_for_metrics(count.detach().double().reshape(1)).sum()
    return (total / count).item() if count > 0 else 0.0


def _count_tokens(trainer, mode: str, attention_mask: torch.Tensor) -> None:
    if mode == "train":
        tokens = trainer.accelerator.gather_for_metrics(attention_mask.sum()).sum().item()
        trainer._total_train_tokens += tokens // trainer._tp_size
    trainer._metrics[mode]["num_tokens"] = [trainer._total_train_tokens]


def _logits_outputs(model: nn.Module, model_inputs: dict, loss: torch.Tensor, return_outputs: bool):
    """`loss`, or with `return_outputs` (evaluation asking for predictions) the model's logits from one more forward."""
    if not return_outputs:
        return loss
    with torch.no_grad():
        return loss, model(**model_inputs)


# SFT


def check_sft(trainer) -> None:
    args = trainer.args
    if trainer.compute_loss_func is not None:
        _refuse("a compute_loss_func (it needs the logits)", "drop compute_loss_func, or drop use_tigon")
    if trainer.label_smoother is not None:
        _refuse("label_smoothing_factor > 0", "set label_smoothing_factor=0.0, or drop use_tigon")
    if args.loss_type not in ("nll", "dft"):
        _refuse(f"SFTConfig.loss_type={args.loss_type!r}", "use loss_type 'nll' or 'dft'")
    parallelism = trainer.accelerator.parallelism_config
    if parallelism is not None and getattr(parallelism, "sp_enabled", False):
        _refuse("sequence parallelism", "turn sequence parallelism off, or drop use_tigon")


def sft_compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
    """SFTTrainer's loss (`nll`, or `dft` as token scaling) and `mean_token_accuracy` from the fused cross entropy."""
    mode = "train" if self.model.training else "eval"
    model_inputs = {name: value for name, value in inputs.items() if name not in ("labels", "shift_labels")}
    inner, hidden, weight, bias = policy_hidden_and_head(self, model, model_inputs)
    target = inputs["shift_labels"] if "shift_labels" in inputs else next_token_target(inputs["labels"])
    out = F.fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        target.reshape(-1).to(hidden.device),
        bias,
        num_items_in_batch=num_items_in_batch,
        use_token_scaling=self.args.loss_type == "dft",
        return_token_accuracy=True,
        chunk_size=chunk_tokens(inner),
    )
    loss = out.loss
    if self.args.average_tokens_across_devices and num_items_in_batch is not None:
        loss = loss * (self.accelerator.num_processes // self.get_tp_size())
    valid = (target != IGNORE_INDEX).sum()
    self._metrics[mode]["mean_token_accuracy"].append(_gathered_ratio(self, out.token_accuracy * valid, valid))
    if "attention_mask" in inputs:
        _count_tokens(self, mode, inputs["attention_mask"])
    else:  # padding-free: one row of packed tokens
        _count_tokens(self, mode, torch.tensor(inputs["position_ids"].shape[1], device=hidden.device))
    return _logits_outputs(model, model_inputs, loss, return_outputs)


# DPO and KTO: a reference model, or log-probs stored before training


def _reference(trainer) -> tuple[nn.Module, contextlib.AbstractContextManager]:
    """The reference model to run, and the context it runs in (a PEFT model's base: its adapter disabled)."""
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import use_adapter

    context = contextlib.ExitStack()
    context.enter_context(torch.no_grad())
    context.enter_context(disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs))
    if trainer.ref_model is not None:
        return trainer.ref_model, context
    peft_model = trainer.accelerator.unwrap_model(trainer.model)
    context.enter_context(use_adapter(peft_model, adapter_name="ref" if "ref" in peft_model.peft_config else None))
    return trainer.model, context


def _reference_inputs(trainer, model_inputs: dict) -> dict[str, torch.Tensor]:
    """`ref_hidden`, `ref_weight`, `ref_bias` of the reference model over `model_inputs`, without gradient."""
    reference, context = _reference(trainer)
    with context:
        inner = causal_lm(trainer, reference)
        ref_hidden = last_hidden_state(reference, inner, **model_inputs)
    ref_weight, ref_bias = plain_head(inner)
    return {"ref_hidden": ref_hidden, "ref_weight": ref_weight.detach(), "ref_bias": ref_bias}


DPO_FORBIDDEN = {
    "ld_alpha": (None, "set ld_alpha=None"),
    "f_divergence_type": ("reverse_kl", "set f_divergence_type='reverse_kl'"),
    "use_weighting": (False, "set use_weighting=False"),
    "padding_free": (False, "set padding_free=False (the fused loss reads chosen rows, then rejected rows)"),
}


def check_dpo(trainer) -> None:
    from tigon.kernels.ops.dpo import check_dpo_options

    for name, (allowed, fix) in DPO_FORBIDDEN.items():
        if getattr(trainer, name) != allowed:
            _refuse(f"DPOConfig.{name}={getattr(trainer, name)!r}", fix)
    try:
        check_dpo_options(
            trainer.loss_types, trainer.loss_weights, _dpo_smoothing(trainer), trainer.args.discopop_tau, None
        )
    except ValueError as error:
        raise UnsupportedByTigon(f"use_tigon: {error}") from None


def _dpo_smoothing(trainer) -> float:
    """TRL's DPO reads label_smoothing in 'exo_pair' and 'robust' only; with 'sigmoid' beside them it cannot hold."""
    if not {"exo_pair", "robust"} & set(trainer.loss_types):
        return 0.0
    if "sigmoid" in trainer.loss_types and trainer.label_smoothing > 0:
        _refuse(
            "label_smoothing with loss_type 'sigmoid' beside 'exo_pair' or 'robust' (TRL's sigmoid ignores it)",
            "train the sigmoid loss in a run of its own",
        )
    return trainer.label_smoothing


def dpo_compute_loss(self, model, inputs, return_outputs):
    """DPOTrainer's loss (every loss type, and their weighted sums) and its metrics."""
    mode = "train" if self.model.training else "eval"
    skip = ("completion_mask", "ref_chosen_logps", "ref_rejected_logps")
    model_inputs = {name: value for name, value in inputs.items() if name not in skip}
    target = next_token_target(inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, IGNORE_INDEX))
    inner, hidden, weight, bias = policy_hidden_and_head(self, model, model_inputs)
    if self.precompute_ref_logps:
        reference = {"ref_logps": torch.cat([inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]])}
    else:
        reference = _reference_inputs(self, model_inputs)
    loss, metrics = F.fused_linear_dpo(
        hidden, weight, target, bias, beta=self.beta, label_smoothing=_dpo_smoothing(self), loss_type=self.loss_types,
        loss_weights=self.loss_weights, discopop_tau=self.args.discopop_tau,
        chunk_size=groups_per_chunk(inner, target, 2), **reference,
    )  # fmt: skip
    for name, value in pair_metrics(self, metrics, target).items():
        self._metrics[mode][name].append(value)
    _count_tokens(self, mode, inputs["attention_mask"])
    return _logits_outputs(model, model_inputs, loss, return_outputs)


def pair_metrics(trainer, metrics: dict[str, torch.Tensor], target: torch.Tensor) -> dict[str, float]:
    """TRL's reward, log-prob and mean-logit metrics of a paired batch, over the ranks."""
    chosen, rejected = metrics["chosen_rewards"], metrics["rejected_rewards"]
    tokens = (target != IGNORE_INDEX).sum(1)
    chosen_tokens, rejected_tokens = tokens.chunk(2)
    values = {
        "rewards/chosen": _gathered_mean(trainer, chosen),
        "rewards/rejected": _gathered_mean(trainer, rejected),
        "rewards/accuracies": _gathered_mean(trainer, (chosen > rejected).float()),
        "rewards/margins": _gathered_mean(trainer, chosen - rejected),
        "logps/chosen": _gathered_mean(trainer, metrics["chosen_logps"]),
        "logps/rejected": _gathered_mean(trainer, metrics["rejected_logps"]),
        "logits/chosen": _gathered_ratio(
            trainer, metrics["chosen_logits_mean"] * chosen_tokens.sum(), chosen_tokens.sum()
        ),
        "logits/rejected": _gathered_ratio(
            trainer, metrics["rejected_logits_mean"] * rejected_tokens.sum(), rejected_tokens.sum()
        ),
    }
    return values


def check_kto(trainer) -> None:
    if trainer.loss_type not in ("kto", "apo_zero_unpaired"):
        _refuse(f"KTOConfig.loss_type={trainer.loss_type!r}", "use 'kto' or 'apo_zero_unpaired'")


def kto_compute_loss(self, model, inputs, return_outputs):
    """KTOTrainer's loss ('kto' with TRL's KL estimate, or 'apo_zero_unpaired') and its metrics."""
    mode = "train" if self.model.training else "eval"
    batch = {name: (v.to(self.accelerator.device) if isinstance(v, torch.Tensor) else v) for name, v in inputs.items()}
    skip = ("completion_mask", "label", "ref_logps", "ref_KL_logps")
    model_inputs = {k: v for k, v in batch.items() if k not in skip and not k.startswith("KL_")}
    target = next_token_target(batch["input_ids"].masked_fill(batch["completion_mask"] == 0, IGNORE_INDEX))
    desirable = torch.as_tensor(batch["label"], dtype=torch.bool, device=target.device)
    inner, hidden, weight, bias = policy_hidden_and_head(self, model, model_inputs)
    kl_inputs = {
        **model_inputs,
        "input_ids": batch.get("KL_input_ids"),
        "attention_mask": batch.get("KL_attention_mask"),
    }
    if self.precompute_ref_logps:
        reference = {"ref_logps": batch["ref_logps"]}
    else:
        reference = _reference_inputs(self, model_inputs)
    kl, per_chunk = None, groups_per_chunk(inner, target, 1)
    if self.calculate_KL:
        kl_target = next_token_target(batch["KL_input_ids"].masked_fill(batch["KL_completion_mask"] == 0, IGNORE_INDEX))
        with torch.no_grad():
            kl_hidden = last_hidden_state(model, inner, **kl_inputs)
            kl_logps = F.sequence_logps(kl_hidden, weight.detach(), kl_target, bias, chunk_size=per_chunk)
        if self.precompute_ref_logps:
            ref_kl_logps = batch["ref_KL_logps"]
        else:
            ref = _reference_inputs(self, kl_inputs)
            ref_kl_logps = F.sequence_logps(
                ref["ref_hidden"], ref["ref_weight"], kl_target, ref["ref_bias"], chunk_size=per_chunk
            )
        kl = (kl_logps - ref_kl_logps).mean().detach()
        kl = self.accelerator.gather_for_metrics(kl).mean().clamp(min=0)
    loss, metrics = F.fused_linear_kto(
        hidden, weight, target, desirable, bias, beta=self.beta, kl=kl, loss_type=self.loss_type,
        desirable_weight=self.desirable_weight, undesirable_weight=self.undesirable_weight,
        chunk_size=per_chunk, **reference,
    )  # fmt: skip
    _log_kto_metrics(self, mode, metrics, desirable, target)
    _count_tokens(self, mode, batch["attention_mask"])
    return _logits_outputs(model, model_inputs, loss, return_outputs)


def _log_kto_metrics(trainer, mode: str, metrics: dict[str, torch.Tensor], desirable: torch.Tensor, target) -> None:
    """KTO's metrics as TRL logs them: sums over the ranks per desirable (undesirable) sequence, the mean logits per
    target token of each side."""
    logged = trainer._metrics[mode]
    logged["kl"].append(metrics["kl"].item())
    tokens = (target != IGNORE_INDEX).sum(1)
    sides = {"chosen": desirable, "rejected": ~desirable}
    for side, rows in sides.items():
        logits_sum = (metrics["logits_mean"][rows].double() * tokens[rows]).sum()
        if trainer.accelerator.gather_for_metrics(tokens[rows].sum()).sum().item() > 0:
            logged[f"logits/{side}"].append(_gathered_ratio(trainer, logits_sum, tokens[rows].sum()))
    for side, rows in sides.items():
        count = trainer.accelerator.gather_for_metrics(rows.sum()).sum().item()
        for name in ("rewards", "logps") if count > 0 else ():
            total = trainer.accelerator.gather_for_metrics(metrics[name][rows].sum()).sum().item()
            logged[f"{name}/{side}"].append(total / count)
    if all(trainer.accelerator.gather_for_metrics(rows.sum()).sum().item() > 0 for rows in sides.values()):
        logged["rewards/margins"].append(logged["rewards/chosen"][-1] - logged["rewards/rejected"][-1])


# ORPO and CPO (SimPO): TRL's experimental trainers, whose batches hold chosen_* and rejected_* tensors


def check_cpo(trainer) -> None:
    if trainer.loss_type not in ("sigmoid", "simpo"):
        _refuse(f"CPOConfig.loss_type={trainer.loss_type!r}", "use loss_type 'sigmoid' (CPO) or 'simpo'")
    if trainer.alpha != 0.0:
        _refuse(f"CPOConfig.alpha={trainer.alpha} (AlphaPO's reward)", "set alpha=0.0")


def _prefixed(metrics: dict[str, float], train_eval: str) -> dict[str, float]:
    return {("eval_" if train_eval == "eval" else "") + name: value for name, value in metrics.items()}


def _paired_batch(trainer, batch: dict, padding_value: int) -> tuple[dict, torch.Tensor]:
    """The chosen rows then the rejected rows, padded to one length: (model inputs, labels)."""
    joined = trainer.concatenated_inputs(
        batch, is_encoder_decoder=False, padding_value=padding_value, device=trainer.accelerator.device
    )
    model_inputs = {
        "input_ids": joined["concatenated_input_ids"],
        "attention_mask": joined["concatenated_attention_mask"],
    }
    return model_inputs, joined["concatenated_labels"]


def orpo_batch_loss_metrics(self, model, batch, train_eval="train"):
    """ORPOTrainer's loss (the NLL over the chosen prompt and completion, as TRL takes it) and its metrics."""
    model_inputs, labels = _paired_batch(self, batch, self.padding_value)
    inner, hidden, weight, bias = policy_hidden_and_head(self, model, model_inputs)
    target = next_token_target(labels)
    whole = model_inputs["input_ids"].masked_fill(model_inputs["attention_mask"] == 0, IGNORE_INDEX)
    loss, metrics = F.fused_linear_orpo(
        hidden, weight, target, bias, beta=self.beta, nll_target=next_token_target(whole),
        chunk_size=groups_per_chunk(inner, target, 2),
    )  # fmt: skip
    logged = pair_metrics(self, metrics, target)
    for name in ("nll_loss", "log_odds_ratio", "log_odds_chosen"):
        logged[name] = _gathered_mean(self, metrics[name])
    return loss, _prefixed(logged, train_eval)


def cpo_batch_loss_metrics(self, model, batch, train_eval="train"):
    """CPOTrainer's loss ('sigmoid': CPO, 'simpo': SimPO, each with the `cpo_alpha` NLL term) and its metrics."""
    model_inputs, labels = _paired_batch(self, batch, self.pad_token_id)
    inner, hidden, weight, bias = policy_hidden_and_head(self, model, model_inputs)
    target = next_token_target(labels)
    options = {
        "beta": self.beta,
        "alpha": self.cpo_alpha,
        "label_smoothing": self.label_smoothing,
        "chunk_size": groups_per_chunk(inner, target, 2),
    }
    if self.loss_type == "simpo":
        loss, metrics = F.fused_linear_simpo(hidden, weight, target, bias, gamma=self.simpo_gamma, **options)
    else:
        loss, metrics = F.fused_linear_cpo(hidden, weight, target, bias, **options)
    logged = pair_metrics(self, metrics, target)
    nll = metrics["nll_loss"] if self.cpo_alpha != 0 else torch.zeros((), device=hidden.device)  # as TRL logs it
    logged["nll_loss"] = _gathered_mean(self, nll)
    return loss, _prefixed(logged, train_eval)


def install(trainer) -> str:
    """Check `trainer`'s settings and give it tigon's loss; returns the trainer's kind ('sft', 'dpo', ...)."""
    import trl
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    kinds = [
        (trl.DPOTrainer, "dpo", check_dpo, "_compute_loss", dpo_compute_loss),
        (trl.KTOTrainer, "kto", check_kto, "_compute_loss", kto_compute_loss),
        (trl.SFTTrainer, "sft", check_sft, "compute_loss", sft_compute_loss),
        (ORPOTrainer, "orpo", None, "get_batch_loss_metrics", orpo_batch_loss_metrics),
        (CPOTrainer, "cpo", check_cpo, "get_batch_loss_metrics", cpo_batch_loss_metrics),
    ]
    for trainer_class, kind, check, method, replacement in kinds:
        if isinstance(trainer, trainer_class):
            check_common(trainer)
            if check is not None:
                check(trainer)
            setattr(trainer, method, types.MethodType(replacement, trainer))
            return kind
    raise UnsupportedByTigon(
        f"use_tigon: {type(trainer).__name__} is a TRL trainer tigon has no fused loss for; tigon's losses run in "
        "SFTTrainer, DPOTrainer, KTOTrainer, ORPOTrainer and CPOTrainer. Apply the kernels alone with "
        "tigon.kernels.integrations.apply_to_trainer(trainer)"
    )
