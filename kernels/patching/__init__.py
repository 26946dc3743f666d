"""Swap tigon's kernels into Hugging Face models, driven by one table keyed on `model_type`.

Norms and MLPs are replaced per instance (sharing parameters and Linear layers); RoPE is the
module-level `apply_rotary_pos_emb` of the family's modeling file, so it applies to every model
of that family in the process.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field

from torch import nn

from tigon.kernels import functional
from tigon.kernels.modules import GatedMLP, GemmaRMSNorm, RMSNorm

logger = logging.getLogger("tigon.kernels")


@dataclass(frozen=True)
class Family:
    """What tigon swaps in one model family: the modeling module and the classes to replace.

    `in_place_norm_backward` lets the norms write their input gradient over the incoming one.
    That is safe when every norm opens a branch (pre-norm blocks: the gradient reaching it is
    a fresh sum from the projections); a family with norms whose output joins the residual
    stream directly (Gemma 2's post-norms) must set it False.
    """

    modeling: str
    rms_norm: tuple[str, ...]
    mlp: tuple[str, ...]
    gemma_norm: bool = False
    in_place_norm_backward: bool = True


FAMILIES: dict[str, Family] = {
    "llama": Family("transformers.models.llama.modeling_llama", ("LlamaRMSNorm",), ("LlamaMLP",)),
    "mistral": Family("transformers.models.mistral.modeling_mistral", ("MistralRMSNorm",), ("MistralMLP",)),
    "qwen2": Family("transformers.models.qwen2.modeling_qwen2", ("Qwen2RMSNorm",), ("Qwen2MLP",)),
    "qwen3": Family("transformers.models.qwen3.modeling_qwen3", ("Qwen3RMSNorm",), ("Qwen3MLP",)),
    "gemma": Family("transformers.models.gemma.modeling_gemma", ("GemmaRMSNorm",), ("GemmaMLP",), gemma_norm=True),
}


@dataclass
class PatchReport:
    """What `apply` changed, for logs and tests."""

    model_type: str
    applied: dict[str, int] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        done = ", ".join(f"{name} x{count}" for name, count in self.applied.items()) or "nothing"
        return f"tigon kernels on {self.model_type}: applied {done}" + (
            f"; not applied: {', '.join(self.skipped)}" if self.skipped else ""
        )


def apply(model: nn.Module, rms_norm: bool = True, rope: bool = True, swiglu: bool = True) -> PatchReport:
    """Apply tigon's kernels to a built transformers model in place; returns what was swapped."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", type(model).__name__)
    report = PatchReport(model_type)
    family = FAMILIES.get(model_type)
    if family is None:
        wanted = {"rms_norm": rms_norm, "rope": rope, "swiglu": swiglu}
        report.skipped = [name for name, on in wanted.items() if on]
        logger.warning(
            "tigon: model_type %r has no kernel table entry (supported: %s); nothing was applied",
            model_type,
            ", ".join(sorted(FAMILIES)),
        )
        return report

    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            kind = type(child).__name__
            if rms_norm and kind in family.rms_norm:
                norm_class = GemmaRMSNorm if family.gemma_norm else RMSNorm
                norm = norm_class.from_module(child, in_place_backward=family.in_place_norm_backward)
                setattr(parent, name, norm)
                report.applied["rms_norm"] = report.applied.get("rms_norm", 0) + 1
            elif swiglu and kind in family.mlp:
                setattr(parent, name, GatedMLP.from_module(child, text_config))
                report.applied["gated_mlp"] = report.applied.get("gated_mlp", 0) + 1
    if rope:
        importlib.import_module(family.modeling).apply_rotary_pos_emb = functional.apply_rotary_pos_emb
        report.applied["rope"] = 1
    logger.info("%s", report)
    return report
