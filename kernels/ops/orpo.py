"""ORPO (Hong et al., 2024), fused with the linear head: TRL's ORPO trainer.

With length-normalized target log-probs ``avg = logp / n`` (``n`` target tokens), per pair of a chosen
sequence ``c`` and its rejected partner ``r``:

    log_odds = (avg_c - avg_r) - (log(1 - exp(avg_c)) - log(1 - exp(avg_r)))
    loss     = NLL - beta * mean over pairs of log sigmoid(log_odds)
    NLL      = -sum of the chosen target log-probs / number of chosen target tokens

``nll_target`` (the batch's shape; its chosen half is read) gives the NLL targets of their own (e.g. the whole
chosen sequence, prompt included), as Liger-Kernel's ORPO takes them; the odds keep ``target``. The chunked pass
then reads the chosen logits once more for the NLL and writes both terms' gradient in its one gradient pass.

``beta`` is the paper's lambda. A pair whose odds are undefined (a sequence without targets, or one of
probability 1, as with a one-token vocabulary) gets ``log_odds = 0`` and adds 0 to the sum. No
reference model. Metrics, as TRL logs them: ``chosen_rewards = beta * avg_c``, ``rejected_rewards =
beta * avg_r``, ``chosen_logps = avg_c``, ``rejected_logps = avg_r`` (per pair), ``nll_loss``,
``log_odds_ratio`` (mean of log sigmoid(log_odds)), ``log_odds_chosen`` (mean of log_odds) and
``chosen_logits_mean``/``rejected_logits_mean`` (the mean logit over the target tokens and the vocabulary),
detached, float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tigon.kernels import reference
from tigon.kernels.ops.fused_linear_preference import (
    Batch,
    ChunkLoss,
    PassResult,
    PreferenceLoss,
    check_positive,
    chosen_nll,
    chosen_token_count,
    fused_linear_preference,
    paired_metrics,
    safe_average,
)
from tigon.kernels.utils import eager_under_compile, use_triton


def log_odds_terms(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_odds, log sigmoid(log_odds)) per pair of average log-probs; both 0 where the odds are undefined."""
    defined = (chosen < 0) & (rejected < 0)
    c, r = torch.where(defined, chosen, -1.0), torch.where(defined, rejected, -1.0)
    log_odds = (c - r) - (torch.log(-torch.expm1(c)) - torch.log(-torch.expm1(r)))  # log(1 - exp(x)), exact near 0
    return torch.where(defined, log_odds, 0.0), torch.where(defined, F.logsigmoid(log_odds), 0.0)


@dataclass(frozen=True)
class ORPO(PreferenceLoss):
    """ORPO's options; its formula and metrics are the module docstring's."""

    beta: float

    NAME = "fused_linear_orpo"
    REFERENCE = staticmethod(reference.fused_linear_orpo)

    def check(self, batch: Batch) -> None:
        check_positive("beta", self.beta)

    def chunk_loss(self, batch: Batch) -> ChunkLoss:
        beta, pairs, chosen_tokens = self.beta, batch.pairs, batch.chosen_tokens
        nll_weight = 1.0 if batch.nll_target is None else 0.0  # with nll_target the chunked pass adds the NLL term

        def loss_fn(
            logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None, rows: torch.Tensor
        ) -> torch.Tensor:
            k = logps.shape[0] // 2
            average = safe_average(logps, counts)
            _, ratio = log_odds_terms(average[:k], average[k:])
            return -logps[:k].sum() / chosen_tokens * nll_weight - beta * ratio.sum() / pairs

        return loss_fn

    def metrics(self, batch: Batch, result: PassResult) -> dict[str, torch.Tensor]:
        pairs = batch.pairs
        average = safe_average(result.logps, batch.counts.to(torch.float64))
        log_odds, ratio = log_odds_terms(average[:pairs], average[pairs:])
        if batch.nll_target is None:
            nll_loss = chosen_nll(batch, result)
        else:
            nll_loss = (result.nll / chosen_token_count(batch.nll_target, batch.ignore_index)).float()
        return {
            **paired_metrics(batch, result, average, self.beta * average),
            "nll_loss": nll_loss,
            "log_odds_ratio": ratio.mean().float(),
            "log_odds_chosen": log_odds.mean().float(),
        }


@eager_under_compile
def fused_linear_orpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    nll_target: torch.Tensor | None = None,
    ignore_index: int = -100,
    check_targets: bool = True,
    accumulate_in_fp32: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """ORPO loss of `hidden @ weight.T + bias` (see the module docstring) and its metrics, without the full logits.

    hidden `(2P, T, H)` holds P chosen sequences then their P rejected partners, target `(2P, T)` the next
    tokens (`ignore_index` elsewhere); `nll_target` `(2P, T)`, if given, holds the NLL term's targets (its
    chosen half is read). `chunk_size` is pairs per chunk. Returns `(loss, metrics)`; one backward per forward.
    """
    return fused_linear_preference(
        ORPO(beta), hidden, weight, target, bias, nll_target=nll_target, ignore_index=ignore_index,
        check_targets=check_targets, accumulate_in_fp32=accumulate_in_fp32, chunk_size=chunk_size,
        use_triton=use_triton,
    )  # fmt: skip
