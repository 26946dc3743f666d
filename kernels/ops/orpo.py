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

import torch
import torch.nn.functional as F

from tigon.kernels import reference
from tigon.kernels.ops.fused_linear_preference import (
    PassSettings,
    check_positive,
    check_preference_inputs,
    check_sequence_target,
    chosen_token_count,
    logits_mean,
    run_preference,
    safe_average,
)
from tigon.kernels.reference import check_target_range
from tigon.kernels.utils import autocast_operands, eager_under_compile, use_triton


def log_odds_terms(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_odds, log sigmoid(log_odds)) per pair of average log-probs; both 0 where the odds are undefined."""
    defined = (chosen < 0) & (rejected < 0)
    c, r = torch.where(defined, chosen, -1.0), torch.where(defined, rejected, -1.0)
    log_odds = (c - r) - (torch.log(-torch.expm1(c)) - torch.log(-torch.expm1(r)))  # log(1 - exp(x)), exact near 0
    return torch.where(defined, log_odds, 0.0), torch.where(defined, F.logsigmoid(log_odds), 0.0)


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
    hidden, weight, bias = autocast_operands(hidden, weight, bias)
    settings = PassSettings(
        paired=True, ignore_index=ignore_index, chunk_size=chunk_size, accumulate_in_fp32=accumulate_in_fp32,
        nll_target=nll_target.contiguous() if nll_target is not None else None, nll_weight=1.0,
    )  # fmt: skip
    check_preference_inputs(hidden, weight, target, bias, None, None, None, None, settings, False, check_targets)
    if nll_target is not None:
        check_sequence_target("nll_target", nll_target, "hidden", hidden)
        if check_targets:
            check_target_range(nll_target.reshape(-1), weight.shape[0], ignore_index)
    check_positive("beta", beta)
    if not use_triton("fused_linear_orpo", hidden):
        return reference.fused_linear_orpo(
            hidden, weight, target, bias, beta=beta, nll_target=nll_target, ignore_index=ignore_index
        )
    pairs = hidden.shape[0] // 2
    chosen_tokens = chosen_token_count(target, ignore_index)
    nll_weight = 1.0 if nll_target is None else 0.0  # with nll_target the chunked pass adds the NLL term itself

    def loss_fn(
        logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None, rows: torch.Tensor
    ) -> torch.Tensor:
        """This chunk's share of the loss; the chunked pass differentiates it with respect to `logps`."""
        k = logps.shape[0] // 2
        average = safe_average(logps, counts)
        _, ratio = log_odds_terms(average[:k], average[k:])
        return -logps[:k].sum() / chosen_tokens * nll_weight - beta * ratio.sum() / pairs

    result = run_preference(hidden, weight, bias, target, None, loss_fn, settings)
    logps, counts = result.logps, (target != ignore_index).sum(1)
    average = safe_average(logps, counts.to(torch.float64))
    log_odds, ratio = log_odds_terms(average[:pairs], average[pairs:])
    if nll_target is None:
        nll_loss = -logps[:pairs].sum() / chosen_tokens
    else:
        nll_loss = result.nll / chosen_token_count(nll_target, ignore_index)
    metrics = {
        "chosen_rewards": (beta * average[:pairs]).float(),
        "rejected_rewards": (beta * average[pairs:]).float(),
        "chosen_logps": average[:pairs].float(),
        "rejected_logps": average[pairs:].float(),
        "nll_loss": nll_loss.float(),
        "log_odds_ratio": ratio.mean().float(),
        "log_odds_chosen": log_odds.mean().float(),
        "chosen_logits_mean": logits_mean(result.logits_sums[:pairs], counts[:pairs], weight.shape[0]).float(),
        "rejected_logits_mean": logits_mean(result.logits_sums[pairs:], counts[pairs:], weight.shape[0]).float(),
    }
    return result.loss, metrics
