"""KTO (Ethayarajh et al., 2024), fused with the linear head: TRL's KTO trainer (`loss_type` "kto" and
"apo_zero_unpaired").

Unpaired: each sequence is flagged desirable or undesirable. With target log-probs ``logp`` of the policy
and ``ref`` of the reference model (summed over the target tokens, or with ``average_log_prob`` averaged over
them, the KL batch's too), ``x = logp - ref``, and the reference point ``kl``:

    desirable:    loss_i = desirable_weight   * (1 - sigmoid(beta * (x_i - kl)))
    undesirable:  loss_i = undesirable_weight * (1 - sigmoid(beta * (kl - x_i)))
    loss = mean over all sequences of loss_i

``loss_type="apo_zero_unpaired"`` (the unpaired APO-zero) has no reference point: ``1 - sigmoid(beta * x_i)``
for a desirable sequence and ``sigmoid(beta * x_i)`` for an undesirable one, weighted and averaged alike.

``kl`` is detached: passed in (a number or a one-element tensor; 0 turns the reference point off), or
computed as TRL does, ``clamp(mean(kl_logps - ref_kl_logps), min=0)``, from the mismatched
(prompt, completion) KL batch ``kl_hidden``/``kl_target`` under the policy head (no gradient) and
``ref_kl_logps`` or ``ref_kl_hidden`` under the reference head. Metrics: ``rewards = beta * x`` and
``logps`` and ``logits_mean`` (the mean logit over its target tokens and the vocabulary) per sequence
(split them with ``desirable`` for TRL's chosen/rejected logs) and ``kl``, detached, float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tigon.kernels import reference
from tigon.kernels.ops.fused_linear_preference import (
    Batch,
    ChunkLoss,
    PassResult,
    PreferenceLoss,
    check_head,
    check_per_sequence,
    check_positive,
    check_sequence_target,
    fused_linear_preference,
    metric_logps,
    safe_average,
    sequence_logps,
)
from tigon.kernels.reference import check_target_range
from tigon.kernels.utils import eager_under_compile, use_triton

KL_INPUTS = ("kl", "kl_hidden", "kl_target", "ref_kl_logps", "ref_kl_hidden")


def _check_kl_inputs(batch: Batch) -> None:
    """`kl`, or the KL batch to compute it from; raise naming the problem and the fix."""
    hidden, weight, ref_hidden, ignore_index = batch.hidden, batch.weight, batch.ref_hidden, batch.ignore_index
    kl, kl_hidden, kl_target, ref_kl_logps, ref_kl_hidden = (batch.inputs[name] for name in KL_INPUTS)
    if kl is not None:
        if kl_hidden is not None or kl_target is not None or ref_kl_logps is not None or ref_kl_hidden is not None:
            raise ValueError("pass either kl or the KL batch (kl_hidden, kl_target, ref_kl_*) to compute it, not both")
        if isinstance(kl, torch.Tensor) and kl.numel() != 1:
            raise ValueError(f"kl must be a number or a one-element tensor, got shape {tuple(kl.shape)}")
        return
    if kl_hidden is None or kl_target is None:
        raise ValueError(
            "KTO needs its reference point: pass kl= (a number; 0.0 for none), or kl_hidden and kl_target (the "
            "mismatched KL batch) with ref_kl_logps or ref_kl_hidden to compute it"
        )
    check_head("kl_hidden", kl_hidden, "weight", weight, "bias", None)
    if kl_hidden.dtype != hidden.dtype:
        raise TypeError(f"kl_hidden has dtype {kl_hidden.dtype} but hidden has {hidden.dtype}; cast it to hidden's")
    check_sequence_target("kl_target", kl_target, "kl_hidden", kl_hidden)
    if (ref_kl_logps is None) == (ref_kl_hidden is None):
        raise ValueError("the KL batch needs exactly one of ref_kl_logps or ref_kl_hidden (with ref_weight)")
    if ref_kl_logps is not None:
        check_per_sequence("ref_kl_logps", ref_kl_logps, kl_hidden.shape[0], hidden, floating=True)
    else:
        if ref_hidden is None:
            raise ValueError("ref_kl_hidden goes through the reference head: pass ref_hidden and ref_weight too")
        if ref_kl_hidden.shape != kl_hidden.shape or ref_kl_hidden.dtype != hidden.dtype:
            raise ValueError(
                f"ref_kl_hidden ({tuple(ref_kl_hidden.shape)}, {ref_kl_hidden.dtype}) must match kl_hidden's shape "
                f"{tuple(kl_hidden.shape[:2])} in tokens and hidden's dtype {hidden.dtype}"
            )
    if batch.check_targets:
        check_target_range(kl_target.reshape(-1), weight.shape[0], ignore_index)


@dataclass(frozen=True)
class KTO(PreferenceLoss):
    """KTO's options; its formula and metrics are the module docstring's. Its own inputs are `desirable` and the
    reference point: `kl`, or the KL batch `kl_hidden`, `kl_target` with `ref_kl_logps` or `ref_kl_hidden`."""

    beta: float
    desirable_weight: float
    undesirable_weight: float
    loss_type: str
    average_log_prob: bool

    NAME = "fused_linear_kto"
    REFERENCE = staticmethod(reference.fused_linear_kto)
    PAIRED = False
    NEEDS_REF = True
    OPERANDS = ("kl_hidden", "ref_kl_hidden")

    def check(self, batch: Batch) -> None:
        inputs, hidden = batch.inputs, batch.hidden
        desirable = inputs["desirable"]
        check_per_sequence("desirable", desirable, hidden.shape[0], hidden)
        if desirable.dtype != torch.bool:
            raise TypeError(f"desirable has dtype {desirable.dtype}; it must be a bool tensor (True = desirable)")
        if self.loss_type not in ("kto", "apo_zero_unpaired"):
            raise ValueError(f"loss_type={self.loss_type!r} is not one of ('kto', 'apo_zero_unpaired')")
        if self.loss_type == "kto":
            _check_kl_inputs(batch)
        elif any(inputs[name] is not None for name in KL_INPUTS):
            raise ValueError("loss_type='apo_zero_unpaired' has no reference point: drop kl and the KL batch (kl_*)")
        check_positive("beta", self.beta)
        if not (self.desirable_weight >= 0 and self.undesirable_weight >= 0):
            raise ValueError(
                f"desirable_weight={self.desirable_weight} and undesirable_weight={self.undesirable_weight} must be "
                ">= 0"
            )

    def prepare(self, batch: Batch) -> None:
        """Replace `kl` with the reference point as a float64 scalar: 0 for "apo_zero_unpaired", as given, or
        computed from the KL batch under the policy's and the reference's heads."""
        inputs, ignore_index = batch.inputs, batch.ignore_index
        kl = inputs["kl"]
        if self.loss_type == "apo_zero_unpaired":
            kl = 0.0
        elif kl is None:
            kl_target, ref_kl_logps = inputs["kl_target"], inputs["ref_kl_logps"]
            kl_logps = sequence_logps(
                inputs["kl_hidden"].detach(), batch.weight.detach(), kl_target, batch.bias, ignore_index=ignore_index
            )
            if ref_kl_logps is None:
                ref_kl_logps = sequence_logps(
                    inputs["ref_kl_hidden"], batch.ref_weight, kl_target, batch.ref_bias, ignore_index=ignore_index
                )
            kl_ratios = kl_logps - ref_kl_logps.to(torch.float64)
            if self.average_log_prob:
                kl_ratios = safe_average(kl_ratios, (kl_target != ignore_index).sum(1).to(torch.float64))
            kl = kl_ratios.mean().clamp(min=0)
        inputs["kl"] = torch.as_tensor(kl, dtype=torch.float64, device=batch.hidden.device).detach().reshape(())

    def chunk_loss(self, batch: Batch) -> ChunkLoss:
        beta, desirable_weight, undesirable_weight = self.beta, self.desirable_weight, self.undesirable_weight
        average_log_prob, desirable, kl = self.average_log_prob, batch.inputs["desirable"], batch.inputs["kl"]
        n_sequences = batch.hidden.shape[0]

        def loss_fn(
            logps: torch.Tensor, counts: torch.Tensor, ref: torch.Tensor | None, rows: torch.Tensor
        ) -> torch.Tensor:
            x = safe_average(logps - ref, counts) if average_log_prob else logps - ref
            losses = torch.where(
                desirable[rows],
                desirable_weight * (1 - torch.sigmoid(beta * (x - kl))),
                undesirable_weight * (1 - torch.sigmoid(beta * (kl - x))),
            )
            return losses.sum() / n_sequences

        return loss_fn

    def metrics(self, batch: Batch, result: PassResult) -> dict[str, torch.Tensor]:
        counts = batch.counts
        logps, ref = metric_logps(batch, result, self.average_log_prob)
        return {
            "rewards": (self.beta * (logps - ref)).float(),
            "logps": logps.float(),
            "logits_mean": (result.logits_sums / (counts * batch.vocab).clamp_min(1)).float(),
            "kl": batch.inputs["kl"].float(),
        }


@eager_under_compile
def fused_linear_kto(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    desirable: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ref_logps: torch.Tensor | None = None,
    ref_hidden: torch.Tensor | None = None,
    ref_weight: torch.Tensor | None = None,
    ref_bias: torch.Tensor | None = None,
    kl: float | torch.Tensor | None = None,
    kl_hidden: torch.Tensor | None = None,
    kl_target: torch.Tensor | None = None,
    ref_kl_logps: torch.Tensor | None = None,
    ref_kl_hidden: torch.Tensor | None = None,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
    average_log_prob: bool = False,
    ignore_index: int = -100,
    check_targets: bool = True,
    accumulate_in_fp32: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KTO loss of `hidden @ weight.T + bias` (see the module docstring) and its metrics, without the full logits.

    hidden `(B, T, H)`, target `(B, T)` (`ignore_index` on prompt and padding), `desirable` `(B,)` bool.
    The reference log-probs are `ref_logps` `(B,)` (summed) or computed in the same chunked pass from
    `ref_hidden` with `ref_weight`/`ref_bias` (no gradient). `loss_type` is "kto" or "apo_zero_unpaired" (which
    takes no `kl`); `average_log_prob` averages every log-prob over its sequence's target tokens. `chunk_size` is
    sequences per chunk. Returns `(loss, metrics)`; one backward per forward.
    """
    inputs = {
        "desirable": desirable, "kl": kl, "kl_hidden": kl_hidden, "kl_target": kl_target,
        "ref_kl_logps": ref_kl_logps, "ref_kl_hidden": ref_kl_hidden,
    }  # fmt: skip
    return fused_linear_preference(
        KTO(beta, desirable_weight, undesirable_weight, loss_type, average_log_prob), hidden, weight, target, bias,
        ref_logps=ref_logps, ref_hidden=ref_hidden, ref_weight=ref_weight, ref_bias=ref_bias, inputs=inputs,
        ignore_index=ignore_index, check_targets=check_targets, accumulate_in_fp32=accumulate_in_fp32,
        chunk_size=chunk_size, use_triton=use_triton,
    )  # fmt: skip
