"""DPO (Rafailov et al., 2023) and its variants, fused with the linear head: TRL's DPO `loss_type`s.

With target log-probs ``logp`` of the policy and ``ref`` of the reference model (summed over the target
tokens, or with ``average_log_prob`` averaged over them), per pair of a chosen sequence ``c`` and its rejected
partner ``r`` with ``n`` target tokens each: ``x_c = logp_c - ref_c``, ``x_r = logp_r - ref_r``,
``d = x_c - x_r``, ``z = beta * d``, ``eps = label_smoothing``, and the per-pair loss of each ``loss_type``:

    sigmoid       -(1 - eps) log sigmoid(z) - eps log sigmoid(-z)        (eps > 0: conservative DPO)
    hinge         relu(1 - z)
    ipo           (x_c / n_c - x_r / n_r - 1 / (2 beta))^2                (TRL's length-normalized IPO)
    exo_pair      sigmoid(z) (log sigmoid(z) - log(1 - eps)) + sigmoid(-z) (log sigmoid(-z) - log eps)   (eps > 0)
    nca_pair      -log sigmoid(beta x_c) - log sigmoid(-beta x_c) / 2 - log sigmoid(-beta x_r) / 2
    robust        (-(1 - eps) log sigmoid(z) + eps log sigmoid(-z)) / (1 - 2 eps)
    bco_pair      -log sigmoid(beta x_c) - log sigmoid(-beta x_r)
    sppo_hard     (x_c - 1 / (2 beta))^2 + (x_r + 1 / (2 beta))^2
    apo_zero      1 - sigmoid(beta x_c) + sigmoid(beta x_r)
    apo_down      sigmoid(beta x_c) + 1 - sigmoid(z)
    discopop      -log sigmoid(z) (1 - sigmoid(z / tau)) + exp(-z) sigmoid(z / tau)   (tau = discopop_tau)
    sigmoid_norm  -log sigmoid(beta (x_c / n_c - x_r / n_r))
    aot           the sigmoid loss of d = sort(logp_c - logp_r) - sort(ref_c - ref_r), sorted over the batch
    aot_unpaired  the sigmoid loss of d = sort(x_c) - sort(x_r), sorted over the batch
    sft           the chosen tokens' mean negative log-likelihood (not per pair)

The loss is the mean over pairs, and with several loss types the sum of each mean times its weight
(``loss_weights``, TRL's). ``rpo_alpha`` adds ``rpo_alpha`` times the chosen tokens' mean negative
log-likelihood (RPO). Every one of these but the two ``aot`` types is a sum over pairs (the NLL a sum over
tokens), so the chunked pass computes it chunk by chunk; ``aot`` and ``aot_unpaired`` (the alignment-via-optimal-
transport losses) pair the batch's sorted log-ratios, so with either among the types the whole loss is computed
once from every sequence's log-probs (``batch_loss``: one more forward matmul per chunk).
Metrics, as TRL logs them: ``chosen_rewards = beta * x_c``, ``rejected_rewards = beta * x_r``,
``chosen_logps``, ``rejected_logps`` (one value per pair, averaged with ``average_log_prob``), and
``chosen_logits_mean``/``rejected_logits_mean`` (the mean logit over the target tokens and the vocabulary),
plus ``nll_loss`` where the NLL term is used; detached, float32. The batch holds the chosen sequences then their
rejected partners; see `fused_linear_preference` for the chunked pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from tigon.kernels import reference
from tigon.kernels.ops.fused_linear_preference import (
    Batch,
    ChunkLoss,
    PassResult,
    PreferenceLoss,
    check_positive,
    check_unit_interval,
    chosen_nll,
    fused_linear_preference,
    metric_logps,
    paired_metrics,
    safe_average,
)
from tigon.kernels.utils import eager_under_compile, use_triton

DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "apo_zero", "apo_down",
    "discopop", "sigmoid_norm", "aot", "aot_unpaired", "sft",
)  # fmt: skip
SORTED_TYPES = ("aot", "aot_unpaired")  # they pair the batch's sorted log-ratios: the whole batch at once


def sigmoid_preference(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """Per-pair `-(1 - eps) * log sigmoid(z) - eps * log sigmoid(-z)` (DPO, CPO, SimPO)."""
    return -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


def pair_losses(
    loss_type: str,
    x_c: torch.Tensor,
    x_r: torch.Tensor,
    n_c: torch.Tensor,
    n_r: torch.Tensor,
    beta: float,
    label_smoothing: float,
    discopop_tau: float,
) -> torch.Tensor:
    """Per-pair loss of one pairwise `loss_type` (the module docstring) from the log-ratios and token counts."""
    z = beta * (x_c - x_r)
    eps = label_smoothing
    if loss_type == "sigmoid":
        return sigmoid_preference(z, eps)
    if loss_type == "hinge":
        return torch.relu(1 - z)
    if loss_type == "ipo":
        return (safe_average(x_c, n_c) - safe_average(x_r, n_r) - 1 / (2 * beta)) ** 2
    if loss_type == "exo_pair":
        return torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps)) + torch.sigmoid(-z) * (
            F.logsigmoid(-z) - math.log(eps)
        )
    if loss_type == "nca_pair":
        return -F.logsigmoid(beta * x_c) - 0.5 * F.logsigmoid(-beta * x_c) - 0.5 * F.logsigmoid(-beta * x_r)
    if loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * x_c) - F.logsigmoid(-beta * x_r)
    if loss_type == "sppo_hard":
        return (x_c - 0.5 / beta) ** 2 + (x_r + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * x_c) + torch.sigmoid(beta * x_r)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * x_c) + 1 - torch.sigmoid(z)
    if loss_type == "discopop":
        mix = torch.sigmoid(z / discopop_tau)
        return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix
    if loss_type == "sigmoid_norm":
        return -F.logsigmoid(beta * (safe_average(x_c, n_c) - safe_average(x_r, n_r)))
    raise ValueError(f"loss_type={loss_type!r} is not a pairwise DPO loss")


def sorted_losses(
    loss_type: str, logp_c: torch.Tensor, logp_r: torch.Tensor, ref_c: torch.Tensor, ref_r: torch.Tensor, beta: float,
    label_smoothing: float,
) -> torch.Tensor:  # fmt: skip
    """Per-rank loss of `aot` or `aot_unpaired` (the module docstring) over the whole batch's pairs."""
    if loss_type == "aot":
        delta = torch.sort(logp_c - logp_r).values - torch.sort(ref_c - ref_r).values
    else:
        delta = torch.sort(logp_c - ref_c).values - torch.sort(logp_r - ref_r).values
    return sigmoid_preference(beta * delta, label_smoothing)


def check_dpo_options(
    loss_type: str | Sequence[str], loss_weights: Sequence[float] | None, label_smoothing: float, discopop_tau: float,
    rpo_alpha: float | None,
) -> tuple[tuple[str, ...], tuple[float, ...]]:  # fmt: skip
    """The loss types and their weights as tuples; raise naming the problem and the fix."""
    types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
    if not types:
        raise ValueError("loss_type is empty; pass one of TRL's DPO loss types, e.g. 'sigmoid'")
    for name in types:
        if name not in DPO_LOSS_TYPES:
            raise ValueError(f"loss_type={name!r} is not one of {DPO_LOSS_TYPES}")
    weights = tuple(float(w) for w in loss_weights) if loss_weights is not None else (1.0,) * len(types)
    if len(weights) != len(types):
        raise ValueError(f"loss_weights has {len(weights)} entries for {len(types)} loss types; give one per type")
    if "exo_pair" in types and not 0.0 < label_smoothing < 1.0:
        raise ValueError("loss_type='exo_pair' needs 0 < label_smoothing < 1 (the EXO paper suggests 1e-3)")
    if "robust" in types and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"loss_type='robust' needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
    if "discopop" in types:
        check_positive("discopop_tau", discopop_tau)
    if rpo_alpha is not None and not 0.0 <= rpo_alpha < float("inf"):
        raise ValueError(f"rpo_alpha={rpo_alpha} must be a finite number >= 0, or None for no NLL term")
    return types, weights


@dataclass(frozen=True)
class DPO(PreferenceLoss):
    """DPO's options; its formula and metrics are the module docstring's."""

    beta: float
    label_smoothing: float
    loss_type: str | Sequence[str]
    loss_weights: Sequence[float] | None
    average_log_prob: bool
    rpo_alpha: float | None
    discopop_tau: float

    NAME = "fused_linear_dpo"
    REFERENCE = staticmethod(reference.fused_linear_dpo)
    NEEDS_REF = True

    @cached_property
    def weighted_types(self) -> tuple[tuple[str, ...], tuple[float, ...]]:
        """The loss types and their weights as tuples, checked."""
        return check_dpo_options(
            self.loss_type, self.loss_weights, self.label_smoothing, self.discopop_tau, self.rpo_alpha
        )

    def check(self, batch: Batch) -> None:
        check_positive("beta", self.beta)
        types, _ = self.weighted_types
        check_unit_interval("label_smoothing", self.label_smoothing, 0.5 if "sigmoid" in types else 1.0)

    def batch_loss(self, batch: Batch) -> ChunkLoss | None:
        """The whole loss at once when a sorted type is among the types (they rank the whole batch)."""
        return self.chunk_loss(batch) if set(SORTED_TYPES) & set(self.weighted_types[0]) else None

    def chunk_loss(self, batch: Batch) -> ChunkLoss:
        types, weights = self.weighted_types
        beta, label_smoothing, discopop_tau = self.beta, self.label_smoothing, self.discopop_tau
        average_log_prob = self.average_log_prob
        pairs = batch.pairs
        nll_weight = sum(w for t, w in zip(types, weights, strict=True) if t == "sft") + (self.rpo_alpha or 0.0)
        chosen_tokens = batch.chosen_tokens

        def loss_fn(
            logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None, rows: torch.Tensor
        ) -> torch.Tensor:
            k = logps.shape[0] // 2
            if average_log_prob:
                logps_seen, ref_seen = safe_average(logps, counts), safe_average(ref, counts)
            else:
                logps_seen, ref_seen = logps, ref
            ratios = logps_seen - ref_seen
            loss = -logps[:k].sum() / chosen_tokens * nll_weight
            for name, type_weight in zip(types, weights, strict=True):
                if name in SORTED_TYPES:
                    losses = sorted_losses(
                        name, logps_seen[:k], logps_seen[k:], ref_seen[:k], ref_seen[k:], beta, label_smoothing
                    )
                    loss = loss + losses.sum() / pairs * type_weight
                elif name != "sft":
                    losses = pair_losses(
                        name, ratios[:k], ratios[k:], counts[:k], counts[k:], beta, label_smoothing, discopop_tau
                    )
                    loss = loss + losses.sum() / pairs * type_weight
            return loss

        return loss_fn

    def metrics(self, batch: Batch, result: PassResult) -> dict[str, torch.Tensor]:
        logps, ref = metric_logps(batch, result, self.average_log_prob)
        metrics = paired_metrics(batch, result, logps, self.beta * (logps - ref))
        if "sft" in self.weighted_types[0] or self.rpo_alpha is not None:
            metrics["nll_loss"] = chosen_nll(batch, result)
        return metrics


@eager_under_compile
def fused_linear_dpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ref_logps: torch.Tensor | None = None,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    average_log_prob: bool = False,
    rpo_alpha: float | None = None,
    discopop_tau: float = 0.05,
    ignore_index: int = -100,
    check_targets: bool = True,
    accumulate_in_fp32: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO loss of `hidden @ weight.T + bias` (see the module docstring) and its metrics, without the full logits.

    hidden `(2P, T, H)` holds P chosen sequences then their P rejected partners, target `(2P, T)` the
    next tokens (`ignore_index` on prompt and padding). The reference log-probs are `ref_logps` `(2P,)`
    (summed, same order), or computed in the same chunked pass from `ref_hidden` with `ref_weight` and
    `ref_bias` (no gradient). `loss_type` is one of TRL's DPO loss types or a list of them summed with
    `loss_weights`; `average_log_prob` averages the policy's and the reference's log-probs over each sequence's
    target tokens; `rpo_alpha` adds the chosen tokens' NLL (RPO). `chunk_size` is pairs per chunk. Returns
    `(loss, metrics)`; one backward per forward.
    """
    loss = DPO(beta, label_smoothing, loss_type, loss_weights, average_log_prob, rpo_alpha, discopop_tau)
    return fused_linear_preference(
        loss, hidden, weight, target, bias, ref_logps=ref_logps, ref_hidden=ref_hidden, ref_weight=ref_weight,
        ref_bias=ref_bias, ignore_index=ignore_index, check_targets=check_targets,
        accumulate_in_fp32=accumulate_in_fp32, chunk_size=chunk_size, use_triton=use_triton,
    )  # fmt: skip
