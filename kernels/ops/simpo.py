"""SimPO (Meng et al., 2024), fused with the linear head: TRL's CPO trainer with `loss_type="simpo"`.

With length-normalized target log-probs ``avg = logp / n`` (``n`` target tokens; 0 for a sequence
without targets), per pair of a chosen sequence ``c`` and its rejected partner ``r``:

    z    = beta * (avg_c - avg_r) - gamma
    loss = mean over pairs of [-(1 - label_smoothing) * log sigmoid(z) - label_smoothing * log sigmoid(-z)]
           + alpha * NLL,   NLL = -sum of the chosen target log-probs / number of chosen target tokens

No reference model; ``alpha = 0`` (the default) is the paper's loss, ``alpha > 0`` TRL's CPO-SimPO.
Metrics: ``chosen_rewards = beta * avg_c``, ``rejected_rewards = beta * avg_r``, ``chosen_logps = avg_c``,
``rejected_logps = avg_r`` (per pair), ``nll_loss`` and ``chosen_logits_mean``/``rejected_logits_mean`` (the
mean logit over the target tokens and the vocabulary), detached, float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tigon.kernels import reference
from tigon.kernels.ops.dpo import sigmoid_preference
from tigon.kernels.ops.fused_linear_preference import (
    Batch,
    ChunkLoss,
    PassResult,
    PreferenceLoss,
    check_positive,
    check_unit_interval,
    chosen_nll,
    fused_linear_preference,
    paired_metrics,
    safe_average,
)
from tigon.kernels.utils import eager_under_compile, use_triton


@dataclass(frozen=True)
class SimPO(PreferenceLoss):
    """SimPO's options; its formula and metrics are the module docstring's."""

    beta: float
    gamma: float
    alpha: float
    label_smoothing: float

    NAME = "fused_linear_simpo"
    REFERENCE = staticmethod(reference.fused_linear_simpo)

    def check(self, batch: Batch) -> None:
        check_positive("beta", self.beta)
        check_unit_interval("label_smoothing", self.label_smoothing, 0.5)

    def chunk_loss(self, batch: Batch) -> ChunkLoss:
        beta, gamma, alpha, label_smoothing = self.beta, self.gamma, self.alpha, self.label_smoothing
        pairs, chosen_tokens = batch.pairs, batch.chosen_tokens

        def loss_fn(
            logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None, rows: torch.Tensor
        ) -> torch.Tensor:
            k = logps.shape[0] // 2
            average = safe_average(logps, counts)
            z = beta * (average[:k] - average[k:]) - gamma
            return sigmoid_preference(z, label_smoothing).sum() / pairs - alpha * logps[:k].sum() / chosen_tokens

        return loss_fn

    def metrics(self, batch: Batch, result: PassResult) -> dict[str, torch.Tensor]:
        average = safe_average(result.logps, batch.counts.to(torch.float64))
        return {**paired_metrics(batch, result, average, self.beta * average), "nll_loss": chosen_nll(batch, result)}


@eager_under_compile
def fused_linear_simpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    alpha: float = 0.0,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    check_targets: bool = True,
    accumulate_in_fp32: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SimPO loss of `hidden @ weight.T + bias` (see the module docstring) and its metrics, without the full logits.

    hidden `(2P, T, H)` holds P chosen sequences then their P rejected partners, target `(2P, T)` the next
    tokens (`ignore_index` elsewhere). `chunk_size` is pairs per chunk. Returns `(loss, metrics)`; one
    backward per forward.
    """
    return fused_linear_preference(
        SimPO(beta, gamma, alpha, label_smoothing), hidden, weight, target, bias, ignore_index=ignore_index,
        check_targets=check_targets, accumulate_in_fp32=accumulate_in_fp32, chunk_size=chunk_size,
        use_triton=use_triton,
    )  # fmt: skip
