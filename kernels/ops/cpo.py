"""CPO (Xu et al., 2024), fused with the linear head: TRL's CPO trainer with `loss_type="sigmoid"`.

With summed target log-probs ``logp``, per pair of a chosen sequence ``c`` and its rejected partner ``r``:

    z    = beta * (logp_c - logp_r)
    loss = mean over pairs of [-(1 - label_smoothing) * log sigmoid(z) - label_smoothing * log sigmoid(-z)]
           + alpha * NLL,   NLL = -sum of the chosen target log-probs / number of chosen target tokens

No reference model. Metrics, as TRL logs them: ``chosen_rewards = beta * logp_c``, ``rejected_rewards =
beta * logp_r``, ``chosen_logps``, ``rejected_logps`` (per pair), ``nll_loss`` and
``chosen_logits_mean``/``rejected_logits_mean`` (the mean logit over the target tokens and the
vocabulary), detached, float32.
"""

from __future__ import annotations

import torch

from tigon.kernels import reference
from tigon.kernels.ops.dpo import sigmoid_preference
from tigon.kernels.ops.fused_linear_preference import (
    PassSettings,
    check_positive,
    check_preference_inputs,
    check_unit_interval,
    chosen_token_count,
    logits_mean,
    run_preference,
)
from tigon.kernels.utils import autocast_operands, eager_under_compile, use_triton


@eager_under_compile
def fused_linear_cpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    alpha: float = 1.0,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    check_targets: bool = True,
    accumulate_in_fp32: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CPO loss of `hidden @ weight.T + bias` (see the module docstring) and its metrics, without the full logits.

    hidden `(2P, T, H)` holds P chosen sequences then their P rejected partners, target `(2P, T)` the next
    tokens (`ignore_index` elsewhere). `alpha` weighs the NLL term (TRL's `cpo_alpha`); `chunk_size` is
    pairs per chunk. Returns `(loss, metrics)`; one backward per forward.
    """
    hidden, weight, bias = autocast_operands(hidden, weight, bias)
    settings = PassSettings(
        paired=True, ignore_index=ignore_index, chunk_size=chunk_size, accumulate_in_fp32=accumulate_in_fp32
    )
    check_preference_inputs(hidden, weight, target, bias, None, None, None, None, settings, False, check_targets)
    check_positive("beta", beta)
    check_unit_interval("label_smoothing", label_smoothing, 0.5)
    if not use_triton("fused_linear_cpo", hidden):
        return reference.fused_linear_cpo(
            hidden,
            weight,
            target,
            bias,
            beta=beta,
            alpha=alpha,
            label_smoothing=label_smoothing,
            ignore_index=ignore_index,
        )
    pairs = hidden.shape[0] // 2
    chosen_tokens = chosen_token_count(target, ignore_index)

    def loss_fn(
        logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None, rows: torch.Tensor
    ) -> torch.Tensor:
        """This chunk's share of the loss; the chunked pass differentiates it with respect to `logps`."""
        k = logps.shape[0] // 2
        preference = sigmoid_preference(beta * (logps[:k] - logps[k:]), label_smoothing).sum() / pairs
        return preference - alpha * logps[:k].sum() / chosen_tokens

    result = run_preference(hidden, weight, bias, target, None, loss_fn, settings)
    logps, counts = result.logps, (target != ignore_index).sum(1)
    metrics = {
        "chosen_rewards": (beta * logps[:pairs]).float(),
        "rejected_rewards": (beta * logps[pairs:]).float(),
        "chosen_logps": logps[:pairs].float(),
        "rejected_logps": logps[pairs:].float(),
        "nll_loss": (-logps[:pairs].sum() / chosen_tokens).float(),
        "chosen_logits_mean": logits_mean(result.logits_sums[:pairs], counts[:pairs], weight.shape[0]).float(),
        "rejected_logits_mean": logits_mean(result.logits_sums[pairs:], counts[pairs:], weight.shape[0]).float(),
    }
    return result.loss, metrics
