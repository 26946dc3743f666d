"""`nn.Module` wrappers with the signatures of the Hugging Face modules they replace.

Each can be built fresh or `from_module(...)` an existing HF module, sharing its parameters (and
its Linear layers, so LoRA adapters stay in place) rather than copying them.
"""

from __future__ import annotations

import torch
from torch import nn

from tigon.kernels import functional as F

GATED_ACTIVATIONS = {
    "silu": ("swiglu", None),
    "swish": ("swiglu", None),
    "gelu_pytorch_tanh": ("geglu", "tanh"),
    "gelu_new": ("geglu", "tanh"),
    "gelu": ("geglu", "none"),
}


class RMSNorm(nn.Module):
    """Llama-style RMSNorm (`LlamaRMSNorm`, `MistralRMSNorm`, `Qwen2RMSNorm`, ...)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        casting: str = "llama",
        init: float = 1.0,
        with_weight: bool = True,
        in_place_backward: bool = False,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((hidden_size,), init)) if with_weight else None
        self.variance_epsilon = eps
        self.offset, self.casting, self.in_place_backward = offset, casting, in_place_backward

    @classmethod
    def from_module(cls, module: nn.Module, **options) -> RMSNorm:
        """Wrap an HF RMSNorm, sharing its weight parameter."""
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
        weight = getattr(module, "weight", None)
        new = cls(weight.shape[0] if weight is not None else 1, eps=eps, with_weight=False, **options)
        new.weight = weight
        return new

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(
            hidden_states, self.weight, self.variance_epsilon, self.offset, self.casting, self.in_place_backward
        )

    def extra_repr(self) -> str:
        size = None if self.weight is None else tuple(self.weight.shape)
        return f"{size}, eps={self.variance_epsilon}, offset={self.offset}, casting={self.casting}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: `(1 + weight)` scale, float32 throughout, weight initialized to zero."""

    def __init__(self, dim: int, eps: float = 1e-6, in_place_backward: bool = False) -> None:
        super().__init__(dim, eps, offset=1.0, casting="gemma", init=0.0, in_place_backward=in_place_backward)

    @classmethod
    def from_module(cls, module: nn.Module, **options) -> GemmaRMSNorm:
        new = cls(module.weight.shape[0], eps=module.eps, **options)
        new.weight = module.weight
        return new


class FusedAddRMSNorm(RMSNorm):
    """`forward(hidden_states, residual) -> (rms_norm(hidden_states + residual), hidden_states + residual)`."""

    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.fused_add_rms_norm(
            hidden_states,
            residual,
            self.weight,
            self.variance_epsilon,
            self.offset,
            self.casting,
            self.in_place_backward,
        )


class LayerNorm(nn.Module):
    """`nn.LayerNorm` over the last dimension, with optional bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size)) if bias else None
        self.eps = eps

    @classmethod
    def from_module(cls, module: nn.LayerNorm) -> LayerNorm:
        new = cls(module.weight.shape[0], eps=module.eps, bias=False)
        new.weight, new.bias = module.weight, module.bias
        return new

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(hidden_states, self.weight, self.bias, self.eps)


class GatedMLP(nn.Module):
    """`down_proj(act(gate_proj(x)) * up_proj(x))`: drop-in for the Llama, Mistral, Qwen and Gemma MLPs.

    The activation comes from `config.hidden_activation` or `config.hidden_act`. Its backward
    recomputes the activation and writes its gradients over the two projections' outputs,
    which only it reads, so the MLP holds no extra activation-sized buffer.
    """

    def __init__(self, config, intermediate_size: int | None = None) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, intermediate_size or config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.activation, self.approximate = gated_activation_for(config)

    @classmethod
    def from_module(cls, module: nn.Module, config) -> GatedMLP:
        """Wrap an HF MLP, keeping its three Linear layers (and any adapters on them)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.gate_proj, new.up_proj, new.down_proj = module.gate_proj, module.up_proj, module.down_proj
        new.activation, new.approximate = gated_activation_for(config)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.activation == "swiglu":
            hidden = F.swiglu(gate, up, in_place_backward=True)
        else:
            hidden = F.geglu(gate, up, approximate=self.approximate, in_place_backward=True)
        return self.down_proj(hidden)


class _PreferenceLoss(nn.Module):
    """A fused linear preference loss as a module: options at construction, tensors at call time."""

    def __init__(self, **options) -> None:
        super().__init__()
        self.options = options

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in self.options.items())


class FusedLinearDPOLoss(_PreferenceLoss):
    """`F.fused_linear_dpo`; call with `(hidden, weight, target, bias=None, ref_logps=... or ref_hidden=..., ...)`."""

    def __init__(
        self, beta: float = 0.1, label_smoothing: float = 0.0, ignore_index: int = -100, chunk_size: int | None = None
    ) -> None:
        super().__init__(beta=beta, label_smoothing=label_smoothing, ignore_index=ignore_index, chunk_size=chunk_size)

    def forward(self, hidden, weight, target, bias=None, **reference) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return F.fused_linear_dpo(hidden, weight, target, bias, **reference, **self.options)


class FusedLinearCPOLoss(_PreferenceLoss):
    """`F.fused_linear_cpo`; call with `(hidden, weight, target, bias=None)`."""

    def __init__(
        self,
        beta: float = 0.1,
        alpha: float = 1.0,
        label_smoothing: float = 0.0,
        ignore_index: int = -100,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__(
            beta=beta, alpha=alpha, label_smoothing=label_smoothing, ignore_index=ignore_index, chunk_size=chunk_size
        )

    def forward(self, hidden, weight, target, bias=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return F.fused_linear_cpo(hidden, weight, target, bias, **self.options)


class FusedLinearSimPOLoss(_PreferenceLoss):
    """`F.fused_linear_simpo`; call with `(hidden, weight, target, bias=None)`."""

    def __init__(
        self,
        beta: float = 2.0,
        gamma: float = 0.5,
        alpha: float = 0.0,
        label_smoothing: float = 0.0,
        ignore_index: int = -100,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__(
            beta=beta,
            gamma=gamma,
            alpha=alpha,
            label_smoothing=label_smoothing,
            ignore_index=ignore_index,
            chunk_size=chunk_size,
        )

    def forward(self, hidden, weight, target, bias=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return F.fused_linear_simpo(hidden, weight, target, bias, **self.options)


class FusedLinearORPOLoss(_PreferenceLoss):
    """`F.fused_linear_orpo`; call with `(hidden, weight, target, bias=None)`."""

    def __init__(self, beta: float = 0.1, ignore_index: int = -100, chunk_size: int | None = None) -> None:
        super().__init__(beta=beta, ignore_index=ignore_index, chunk_size=chunk_size)

    def forward(self, hidden, weight, target, bias=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return F.fused_linear_orpo(hidden, weight, target, bias, **self.options)


class FusedLinearKTOLoss(_PreferenceLoss):
    """`F.fused_linear_kto`; call with `(hidden, weight, target, desirable, bias=None, ref_*=..., kl=...)`."""

    def __init__(
        self,
        beta: float = 0.1,
        desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0,
        ignore_index: int = -100,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__(
            beta=beta,
            desirable_weight=desirable_weight,
            undesirable_weight=undesirable_weight,
            ignore_index=ignore_index,
            chunk_size=chunk_size,
        )

    def forward(
        self, hidden, weight, target, desirable, bias=None, **inputs
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return F.fused_linear_kto(hidden, weight, target, desirable, bias, **inputs, **self.options)


class KLDivLoss(nn.Module):
    """Drop-in for `nn.KLDivLoss` on `F.kl_divergence`; call with `(input, target)` (student log-probs, teacher)."""

    def __init__(self, reduction: str = "mean", log_target: bool = False) -> None:
        super().__init__()
        self.reduction, self.log_target = reduction, log_target

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.kl_divergence(input, target, reduction=self.reduction, log_target=self.log_target)

    def extra_repr(self) -> str:
        return f"reduction={self.reduction!r}, log_target={self.log_target}"


class _DistillationLoss(nn.Module):
    """A distillation loss as a module: options at construction, tensors at call time."""

    def __init__(self, **options) -> None:
        super().__init__()
        self.options = options

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in self.options.items())


class JSDLoss(_DistillationLoss):
    """`F.jsd`; call with `(student, teacher, label=None)`."""

    def __init__(
        self,
        beta: float = 0.5,
        temperature: float = 1.0,
        ignore_index: int = -100,
        reduction: str = "batchmean",
        from_logits: bool = False,
    ) -> None:
        super().__init__(
            beta=beta, temperature=temperature, ignore_index=ignore_index, reduction=reduction, from_logits=from_logits
        )

    def forward(self, student, teacher, label=None) -> torch.Tensor:
        return F.jsd(student, teacher, label, **self.options)


class FusedLinearJSDLoss(_DistillationLoss):
    """`F.fused_linear_jsd`; call with `(student_hidden, student_weight, teacher_hidden, teacher_weight, label)`."""

    def __init__(
        self,
        beta: float = 0.5,
        temperature: float = 1.0,
        ignore_index: int = -100,
        reduction: str = "batchmean",
        accumulate_in_fp32: bool = False,
        chunk_size: int | None = None,
    ) -> None:
        super().__init__(
            beta=beta,
            temperature=temperature,
            ignore_index=ignore_index,
            reduction=reduction,
            accumulate_in_fp32=accumulate_in_fp32,
            chunk_size=chunk_size,
        )

    def forward(self, student_hidden, student_weight, teacher_hidden, teacher_weight, label=None) -> torch.Tensor:
        return F.fused_linear_jsd(student_hidden, student_weight, teacher_hidden, teacher_weight, label, **self.options)


def gated_activation_for(config) -> tuple[str, str | None]:
    """('swiglu', None) or ('geglu', 'tanh' | 'none') for a transformers config's activation name."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if name not in GATED_ACTIVATIONS:
        raise ValueError(f"activation {name!r} has no fused kernel; supported: {sorted(GATED_ACTIVATIONS)}")
    return GATED_ACTIVATIONS[name]
