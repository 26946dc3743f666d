"""`nn.Module` wrappers with the signatures of the Hugging Face modules they replace.

Each can be built fresh or `from_module(...)` an existing HF module, sharing its parameters (and
its Linear layers, so LoRA adapters stay in place) rather than copying them.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable

import torch
from torch import nn

from tigon.kernels import functional as F
from tigon.kernels.ops.cpo import CPO
from tigon.kernels.ops.dpo import DPO
from tigon.kernels.ops.fused_linear_preference import PreferenceLoss
from tigon.kernels.ops.gated_activation import APPROXIMATIONS
from tigon.kernels.ops.kto import KTO
from tigon.kernels.ops.moe_experts import grouped_mm_available
from tigon.kernels.ops.orpo import ORPO
from tigon.kernels.ops.simpo import SimPO
from tigon.kernels.utils import FLOAT_DTYPES, autocast_operands, interpreter_active, is_dtensor

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


class OffsetLayerNorm(LayerNorm):
    """LayerNorm scaling by `1 + weight`: Nemotron's NemotronLayerNorm1P, whose weights are stored zero-centred.

    As transformers' class does, under an enabled CUDA autocast it casts the input, `1 + weight` and the bias to the
    autocast dtype and normalizes in it; otherwise (CPU autocast included) in the input's dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, bias: bool = True, in_place_backward: bool = False) -> None:
        super().__init__(hidden_size, eps, bias)
        self.in_place_backward = in_place_backward

    @classmethod
    def from_module(cls, module: nn.LayerNorm, in_place_backward: bool = False) -> OffsetLayerNorm:
        new = cls(module.weight.shape[0], eps=module.eps, bias=False, in_place_backward=in_place_backward)
        new.weight, new.bias = module.weight, module.bias
        return new

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        operands = (hidden_states, self.weight + 1.0, self.bias)
        if torch.is_autocast_enabled():  # transformers' check, which reads CUDA's autocast state
            dtype = torch.get_autocast_dtype(hidden_states.device.type)
            operands = tuple(None if tensor is None else tensor.to(dtype) for tensor in operands)
        hidden_states, weight, bias = operands
        with torch.autocast(hidden_states.device.type, enabled=False):
            return F.layer_norm(hidden_states, weight, bias, self.eps, self.in_place_backward)


class ReLUSquared(nn.Module):
    """`relu(x) ** 2`: drop-in for transformers' `ReLUSquaredActivation` (Nemotron's MLP activation, whose input is
    the up-projection's output, read by nothing else). Its backward writes the input's gradient over that input
    when it is contiguous."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu_squared(x, in_place_backward=x.is_contiguous())


class FP8Linear(nn.Linear):
    """nn.Linear whose matrix products run in FP8, one dynamic scale per tensor (`fp8_linear`): the input in
    the autocast dtype (bf16) as nn.Linear would take it, the weight in its own dtype. `keep_input` for a layer
    whose input its producer keeps anyway (an attention block's output projection)."""

    keep_input: bool = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, keep_input: bool = False) -> FP8Linear:
        """An FP8Linear on `linear`'s own parameters."""
        with torch.device("meta"):
            module = cls(linear.in_features, linear.out_features, bias=False)
        module.weight, module.bias = linear.weight, linear.bias
        module.keep_input = keep_input
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (x,) = autocast_operands(x)
        return F.fp8_linear(x, self.weight, self.bias, keep_input=self.keep_input)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8 tensorwise{', keep_input' if self.keep_input else ''}"


class _GatedLinears(nn.Module):
    """A gated MLP made of the Linear layers named in `LINEARS` and an activation read from the config."""

    LINEARS: tuple[str, ...] = ()

    @classmethod
    def from_module(cls, module: nn.Module, config) -> _GatedLinears:
        """Wrap an HF MLP, keeping its Linear layers (and any adapters on them)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        for name in cls.LINEARS:
            setattr(new, name, getattr(module, name))
        new.activation, new.approximate = gated_activation_for(config)
        return new


def mlp_multipliers(config) -> tuple[float, float]:
    """Falcon-H1's `config.mlp_multipliers` (gate, down), or (1.0, 1.0) for a config without them."""
    multipliers = tuple(float(m) for m in getattr(config, "mlp_multipliers", None) or (1.0, 1.0))
    if len(multipliers) != 2:
        raise ValueError(f"config.mlp_multipliers={multipliers} must be (gate_multiplier, down_multiplier)")
    return multipliers


class GatedMLP(_GatedLinears):
    """`down_proj(act(gate_proj(x)) * up_proj(x))`: drop-in for the Llama, Mistral, Qwen and Gemma MLPs.

    The activation comes from `config.hidden_activation` or `config.hidden_act`. Its backward
    recomputes the activation and writes its gradients over the two projections' outputs,
    which only it reads, so the MLP holds no extra activation-sized buffer. A config with Falcon-H1's
    `mlp_multipliers` `(gate, down)` gives `down_proj(up * act(gate * m_gate)) * m_down`, both multipliers
    inside the activation kernel (the down multiplier moved before the linear `down_proj`).
    """

    LINEARS = ("gate_proj", "up_proj", "down_proj")

    def __init__(self, config, intermediate_size: int | None = None) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, intermediate_size or config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.activation, self.approximate = gated_activation_for(config)
        self.multipliers = mlp_multipliers(config)

    @classmethod
    def from_module(cls, module: nn.Module, config) -> GatedMLP:
        """Wrap an HF MLP, keeping its Linear layers (and any adapters on them)."""
        new = super().from_module(module, config)
        new.multipliers = mlp_multipliers(config)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(_gated(gate, up, self.activation, self.approximate, self.multipliers))


def _gated(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    approximate: str | None,
    multipliers: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """act(gate * m_g) * up * m_o with the in-place backward: the two projections' outputs are read by nothing
    else."""
    gate_multiplier, output_multiplier = multipliers
    if activation == "swiglu":
        return F.swiglu(
            gate, up, in_place_backward=True, gate_multiplier=gate_multiplier, output_multiplier=output_multiplier
        )
    return F.geglu(
        gate,
        up,
        approximate=approximate,
        in_place_backward=True,
        gate_multiplier=gate_multiplier,
        output_multiplier=output_multiplier,
    )


def _gated_packed(gate_up: torch.Tensor, activation: str, approximate: str | None, in_place: bool) -> torch.Tensor:
    if activation == "swiglu":
        return F.swiglu_packed(gate_up, in_place_backward=in_place)
    return F.geglu_packed(gate_up, approximate=approximate, in_place_backward=in_place)


class PackedGatedMLP(_GatedLinears):
    """`down_proj(act(gate) * up)` with `gate, up = gate_up_proj(x).chunk(2, -1)`: drop-in for Phi3MLP and Glm4MLP.

    The packed kernel reads the fused projection's output once; its backward writes d(gate_up) over
    that output, which only it reads, as the one tensor the fused Linear's backward takes.
    """

    LINEARS = ("gate_up_proj", "down_proj")

    def __init__(self, config, intermediate_size: int | None = None) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_up_proj = nn.Linear(hidden, 2 * inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.activation, self.approximate = gated_activation_for(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = _gated_packed(self.gate_up_proj(x), self.activation, self.approximate, in_place=True)
        return self.down_proj(hidden)


class GatedExpertMLP(_GatedLinears):
    """`w2(act(w1(x)) * w3(x))`: drop-in for one expert of transformers 4.x's Mixtral
    (`MixtralBlockSparseTop2MLP`), GatedMLP with Mixtral's projection names (w1 gate, w3 up, w2 down)."""

    LINEARS = ("w1", "w2", "w3")

    def __init__(self, config, intermediate_size: int | None = None) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, intermediate_size or config.intermediate_size
        self.w1 = nn.Linear(hidden, inner, bias=False)
        self.w2 = nn.Linear(inner, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inner, bias=False)
        self.activation, self.approximate = gated_activation_for(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.w2(_gated(self.w1(hidden_states), self.w3(hidden_states), self.activation, self.approximate))


def _transformers_experts_function(implementation: str):
    """transformers' experts forward registered under `implementation` (only models it built name one)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    try:
        return ALL_EXPERTS_FUNCTIONS[implementation]
    except KeyError:
        raise ValueError(
            f"config._experts_implementation={implementation!r} is not an experts implementation transformers "
            f"has registered ({', '.join(ALL_EXPERTS_FUNCTIONS)}, or 'eager')"
        ) from None


class GatedExperts(nn.Module):
    """Drop-in for the transformers 5.x MoE experts with 3-D parameters (MixtralExperts, Qwen2MoeExperts,
    Qwen3MoeExperts, DeepseekV3Experts, ...): `gate_up_proj` [E, 2I, H] (gate rows first), `down_proj` [E, H, I],
    called as `forward(hidden_states, top_k_index, top_k_weights)` on (tokens, H) states and (tokens, top-k) routing.

    It computes what transformers computes, with tigon's packed activation in place of `act(gate) * up`.
    Under the "eager" experts implementation it runs transformers' loop over the hit experts (same
    routing, each expert's weighted output `index_add_`ed into an output of the input's dtype, expert by
    expert). Under "grouped_mm", transformers' default where it can run, it runs tigon's `moe_experts`:
    transformers' grouped_mm forward with each token's weighted sum in one pass, whose backward keeps only the
    gate/up projection's output (24 of 100 KiB a token at Qwen3-30B-A3B's sizes) and recomputes the rest. It
    calls transformers' own function instead where that op cannot run (expert parallelism, torch.compile,
    DTensor parameters, routing weights wider than float32, no grouped GEMM on the device, CPU tensors without
    TRITON_INTERPRET=1) and under any other implementation ("batched_mm", ...); those apply this module's
    `_apply_gate` to the gate/up projection's output, whose backward writes over that output under
    "grouped_mm" and "batched_mm", where only the activation reads it.
    """

    # The layout flags transformers' experts functions read (its `use_experts_implementation` decorator's).
    has_gate, has_bias, is_transposed, is_concatenated, has_post_expert_norm = True, False, False, True, False
    IN_PLACE_IMPLEMENTATIONS = (None, "eager", "grouped_mm", "batched_mm")

    def __init__(self, config, num_experts: int | None = None, intermediate_size: int | None = None) -> None:
        super().__init__()
        self.config = config
        # transformers' experts classes read num_local_experts (Mixtral, DeepSeek-V3, GLM-4-MoE) or num_experts
        self.num_experts = num_experts or getattr(config, "num_local_experts", None) or config.num_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = (
            intermediate_size or getattr(config, "moe_intermediate_size", None) or config.intermediate_size
        )
        experts, hidden, inner = self.num_experts, self.hidden_dim, self.intermediate_dim
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inner))
        self.activation, self.approximate = gated_activation_for(config)
        self._is_expert_parallel = False

    @classmethod
    def from_module(cls, module: nn.Module, config) -> GatedExperts:
        """Wrap a transformers experts module, sharing its two Parameters and its config (so a later
        `model.set_experts_implementation(...)` reaches this module too)."""
        layout = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")
        gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
        fits = (
            all(getattr(module, flag, getattr(cls, flag)) == getattr(cls, flag) for flag in layout)
            and isinstance(gate_up, torch.Tensor)
            and isinstance(down, torch.Tensor)
            and gate_up.dim() == 3
            and down.dim() == 3
            and gate_up.shape == (down.shape[0], 2 * down.shape[2], down.shape[1])
        )
        if not fits:
            shapes = [tuple(p.shape) if isinstance(p, torch.Tensor) else None for p in (gate_up, down)]
            flags = {flag: getattr(module, flag) for flag in layout if hasattr(module, flag)}
            raise ValueError(
                f"{type(module).__name__} does not have the layout GatedExperts replaces: gate_up_proj [E, 2I, H] "
                f"(gate first) and down_proj [E, H, I], no bias, not transposed, no post-expert norm; it has "
                f"gate_up_proj {shapes[0]}, down_proj {shapes[1]}, {flags}"
            )
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.config = getattr(module, "config", config)
        new.num_experts = getattr(module, "num_experts", down.shape[0])
        new.hidden_dim, new.intermediate_dim = down.shape[1], down.shape[2]
        new.gate_up_proj, new.down_proj = gate_up, down
        new.activation, new.approximate = gated_activation_for(new.config)
        new._is_expert_parallel = getattr(module, "_is_expert_parallel", False)
        return new

    def _implementation(self) -> str | None:
        return getattr(self.config, "_experts_implementation", None)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`act(gate) * up` of a (tokens, 2I) projection output: what transformers' experts functions call."""
        in_place = self._implementation() in self.IN_PLACE_IMPLEMENTATIONS
        return _gated_packed(gate_up, self.activation, self.approximate, in_place)

    def _runs_moe_experts(self, hidden_states: torch.Tensor, top_k_weights: torch.Tensor) -> bool:
        """Whether tigon's grouped experts op can stand in for transformers' grouped_mm function here."""
        tensors = (hidden_states, self.gate_up_proj, self.down_proj)
        dtype = self.gate_up_proj.dtype
        return (
            not self._is_expert_parallel
            and not torch.compiler.is_compiling()
            and hidden_states.dim() == 2
            and hidden_states.shape[0] > 0
            and not any(is_dtensor(tensor) for tensor in tensors)
            and dtype in FLOAT_DTYPES
            and self.down_proj.dtype == dtype
            and torch.promote_types(top_k_weights.dtype, dtype) in (dtype, torch.float32)  # float32 routers too
            and (hidden_states.is_cuda or interpreter_active())
            and grouped_mm_available(self.gate_up_proj, self.down_proj)
        )

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        implementation = self._implementation()
        if implementation == "grouped_mm" and self._runs_moe_experts(hidden_states, top_k_weights):
            activation = "silu" if self.activation == "swiglu" else APPROXIMATIONS[self.approximate]
            dtype = self.gate_up_proj.dtype  # transformers too computes in it (autocast: fp32 weights)
            out = F.moe_experts(
                hidden_states.to(dtype),
                self.gate_up_proj,
                self.down_proj,
                top_k_index,
                top_k_weights.to(torch.promote_types(top_k_weights.dtype, dtype)),
                activation,
            )
            return out.to(hidden_states.dtype)
        if implementation not in (None, "eager"):
            return _transformers_experts_function(implementation)(self, hidden_states, top_k_index, top_k_weights)
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:  # expert-parallel sentinel: a token routed to another rank
                continue
            top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
            gate_up = nn.functional.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx])
            current_hidden_states = nn.functional.linear(self._apply_gate(gate_up), self.down_proj[expert_idx])
            current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
            final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
        return final_hidden_states

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}, "
            f"activation={self.activation}"
        )


class _PreferenceLoss(nn.Module):
    """A fused linear preference loss as a module: options at construction, tensors at call time.

    The options are the loss's own (the fields of `LOSS`, in order) then `ignore_index` and `chunk_size`, taken by
    position or name with the defaults of `FUNCTION`, the op the module calls.
    """

    FUNCTION: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    LOSS: type[PreferenceLoss]
    OPTIONS: inspect.Signature

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        parameters = inspect.signature(cls.FUNCTION).parameters
        names = [field.name for field in dataclasses.fields(cls.LOSS)] + ["ignore_index", "chunk_size"]
        cls.OPTIONS = inspect.Signature(
            [parameters[name].replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names]
        )

    def __init__(self, *args, **options) -> None:
        super().__init__()
        bound = self.OPTIONS.bind(*args, **options)
        bound.apply_defaults()
        self.options = dict(bound.arguments)

    def forward(self, hidden, weight, target, *tensors, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.FUNCTION(hidden, weight, target, *tensors, **inputs, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in self.options.items())


class FusedLinearDPOLoss(_PreferenceLoss):
    """`F.fused_linear_dpo`; call with `(hidden, weight, target, bias=None, ref_logps=... or ref_hidden=..., ...)`."""

    FUNCTION, LOSS = staticmethod(F.fused_linear_dpo), DPO


class FusedLinearCPOLoss(_PreferenceLoss):
    """`F.fused_linear_cpo`; call with `(hidden, weight, target, bias=None)`."""

    FUNCTION, LOSS = staticmethod(F.fused_linear_cpo), CPO


class FusedLinearSimPOLoss(_PreferenceLoss):
    """`F.fused_linear_simpo`; call with `(hidden, weight, target, bias=None)`."""

    FUNCTION, LOSS = staticmethod(F.fused_linear_simpo), SimPO


class FusedLinearORPOLoss(_PreferenceLoss):
    """`F.fused_linear_orpo`; call with `(hidden, weight, target, bias=None, nll_target=None)`."""

    FUNCTION, LOSS = staticmethod(F.fused_linear_orpo), ORPO

    def forward(
        self, hidden, weight, target, bias=None, nll_target=None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return F.fused_linear_orpo(hidden, weight, target, bias, nll_target=nll_target, **self.options)


class FusedLinearKTOLoss(_PreferenceLoss):
    """`F.fused_linear_kto`; call with `(hidden, weight, target, desirable, bias=None, ref_*=..., kl=...)`."""

    FUNCTION, LOSS = staticmethod(F.fused_linear_kto), KTO


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
