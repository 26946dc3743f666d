"""DPO (Rafailov et al., 2023), fused with the linear head: TRL's `loss_type="sigmoid"`.

With summed target log-probs ``logp`` of the policy and ``ref`` of the reference model, per pair of a
chosen sequence ``c`` and its rejected partner ``r``:

    z    = beta * ((logp_c - logp_r) - (ref_c - ref_r))
    loss = mean over pairs of  -(1 - label_smoothing) * log sigmoid(z) - label_smoothing * log sigmoid(-z)

``label_smoothing`` > 0 is conservative DPO (cDPO). Metrics, as TRL logs them: ``chosen_rewards =
beta * (logp_c - ref_c)``, ``rejected_rewards = beta * (logp_r - ref_r)``, ``chosen_logps``,
``rejected_logps`` (one value per pair), and ``chosen_logits_mean``/``rejected_logits_mean`` (the mean
logit over the target tokens and the vocabulary), detached, float32. The batch holds the chosen sequences then
their rejected partners; see `fused_linear_preference` for the chunked pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tigon.kernels import reference
from tigon.kernels.ops.fused_linear_preference import (
    PassSettings,
    check_positive,
    check_preference_inputs,
    check_unit_interval,
    logits_mean,
    reference_source,
    run_preference,
)
from tigon.kernels.utils import autocast_operands, eager_under_compile, use_triton


def sigmoid_preference(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """Per-pair `-(1 - eps) * log sigmoid(z) - eps * log sigmoid(-z)` (DPO, CPO, SimPO)."""
    return -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


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
    ignore_index: int = -100,
    check_targets: bool = True,
    accumulate_in_fp32: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO loss of `hidden @ weight.T + bias` (see the module docstring) and its metrics, without the full logits.

    hidden `(2P, T, H)` holds P chosen sequences then their P rejected partners, target `(2P, T)` the
    next tokens (`ignore_index` on prompt and padding). The reference log-probs are `ref_logps` `(2P,)`
    (summed, same order), or computed in the same chunked pass from `ref_hidden` with `ref_weight` and
    `ref_bias` (no gradient). `chunk_size` is pairs per chunk. Returns `(loss, metrics)`; one backward per
    forward.
    """
    hidden, weight, bias, ref_hidden, ref_weight, ref_bias = autocast_operands(
        hidden, weight, bias, ref_hidden, ref_weight, ref_bias
    )
    settings = PassSettings(
        paired=True, ignore_index=ignore_index, chunk_size=chunk_size, accumulate_in_fp32=accumulate_in_fp32
    )
    check_preference_inputs(
        hidden, weight, target, bias, ref_logps, ref_hidden, ref_weight, ref_bias, settings, True, check_targets
    )
    check_positive("beta", beta)
    check_unit_interval("label_smoothing", label_smoothing, 0.5)
    if not use_triton("fused_linear_dpo", hidden):
        return reference.fused_linear_dpo(
            hidden,
            weight,
            target,
            bias,
            ref_logps=ref_logps,
            ref_hidden=ref_hidden,
            ref_weight=ref_weight,
            ref_bias=ref_bias,
            beta=beta,
            label_smoothing=label_smoothing,
            ignore_index=ignore_index,
        )
    pairs = hidden.shape[0] // 2

    def loss_fn(
        logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None, rows: torch.Tensor
    ) -> torch.Tensor:
        """This chunk's share of the loss; the chunked pass differentiates it with respect to `logps`."""
        k = logps.shape[0] // 2
        z = beta * ((logps[:k] - logps[k:]) - (ref[:k] - ref[k:]))
        return sigmoid_preference(z, label_smoothing).sum() / pairs

    source = reference_source(ref_logps, ref_hidden, ref_weight, ref_bias)
    result = run_preference(hidden, weight, bias, target, source, loss_fn, settings)
    logps, counts = result.logps, (target != ignore_index).sum(1)
    rewards = (beta * (logps - result.ref_logps)).float()
    metrics = {
        "chosen_rewards": rewards[:pairs],
        "rejected_rewards": rewards[pairs:],
        "chosen_logps": logps[:pairs].float(),
        "rejected_logps": logps[pairs:].float(),
        "chosen_logits_mean": logits_mean(result.logits_sums[:pairs], counts[:pairs], weight.shape[0]).float(),
        "rejected_logits_mean": logits_mean(result.logits_sums[pairs:], counts[pairs:], weight.shape[0]).float(),
    }
    return result.loss, metrics
