"""Selective recomputation: decoder layers that keep their matrix products' and attention's outputs and recompute
only the element-wise work in the backward.

    enable_selective_recomputation(layers)   # after enable_activation_checkpointing, on the layers it left alone

Full checkpointing keeps a layer's input and recomputes its whole forward in the backward (about a third more work
for that layer). A selective layer is checkpointed too, but under PyTorch's selective activation checkpointing: the
outputs of the q, k, v, o, gate and up projections and of the attention kernel are kept, and the backward recomputes
only what is cheap to recompute from them: the norms, RoPE, the residual sums and the gated activation. That drops
the norms' outputs and the activation's output (down_proj's input), about a third of a Llama layer's saved bytes,
for a few percent of the layer's time. down_proj's own output is not kept: nothing in the backward needs it.

The projections are found by name in each layer (a LoRA-wrapped projection's base layer counts as it); their
matrix products are recognized while one of them runs, through forward hooks. Attention kernels are recognized by
name (SDPA's, PyTorch's varlen and flash-attention's ops), so eager and flex attention, which are not one op, are
refused, as are MoE layers (their experts run inside one op) and 4-bit base weights (their matmul is
bitsandbytes' own).

A compiled layer (`training.compile`, and so FP8) checkpoints inside its compiled forward, where hooks do not run
while the graph is traced: its policy keeps every matrix product's output (FP8's `_scaled_mm` too) and attention's,
and AOTAutograd's partitioner saves only those the backward reads. down_proj's output is read by nothing, so such a
layer keeps what an eager one keeps.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tigon.runtime.config import ConfigError
from tigon.runtime.planner import MoeShape

KEPT_PROJECTIONS = frozenset(
    {"q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "o_proj", "gate_proj", "up_proj", "gate_up_proj"}
)
MATMULS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default})
COMPILED_KEPT = MATMULS | {torch.ops.aten._scaled_mm.default}
ATTENTION_WORDS = ("attention", "attn")
REFUSED_ATTENTION = {"eager", "flex_attention"}


class KeptProjections:
    """Whether one of a layer's kept projections is running its forward (set by their forward hooks)."""

    def __init__(self) -> None:
        self.running = 0

    def enter(self, module: nn.Module, args) -> None:
        self.running += 1

    def leave(self, module: nn.Module, args, output) -> None:
        self.running -= 1


def is_attention(op) -> bool:
    """An attention kernel's op (SDPA's flash, memory-efficient, cuDNN or CPU kernel; varlen; flash-attention)."""
    name = op.name().lower()
    return any(word in name for word in ATTENTION_WORDS)


def policy(projections: KeptProjections):
    """The selective checkpointing policy: keep the kept projections' matmul outputs and attention's, recompute
    everything else."""

    def decide(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if (op in MATMULS and projections.running) or is_attention(op):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return decide


def selective_contexts(projections: KeptProjections):
    """`torch.utils.checkpoint.checkpoint`'s context_fn for one checkpointed call."""
    projections.running = 0  # an earlier forward that raised may have left a projection entered
    return create_selective_checkpoint_contexts(policy(projections))


def compiled_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The policy of a compiled layer: keep every matrix product's and attention's output, recompute the rest."""
    if op in COMPILED_KEPT or is_attention(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def compiled_contexts():
    """`checkpoint`'s context_fn inside a compiled layer."""
    return create_selective_checkpoint_contexts(compiled_policy)


def checkpointed_forward(forward, selective: bool = True):
    """`forward` checkpointed, under the compiled policy when `selective` (else whole): set as the layer's own
    forward before it is compiled, so the checkpoint is traced into the layer's graph and AOTAutograd's partitioner
    recomputes only what the backward reads. (transformers' own checkpointing wraps `__call__` on some releases,
    outside the compiled forward, whose recompute then runs all of it again: down_proj's product too.)"""
    options = {"context_fn": compiled_contexts} if selective else {}

    @functools.wraps(forward)
    def run(*args, **kwargs):
        return checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=False, **options)

    return run


def kept_projections(layer: nn.Module) -> list[nn.Linear]:
    """The layer's Linear layers whose outputs a selective layer keeps (a LoRA projection's base layer)."""
    found = []
    for name, module in layer.named_modules():
        parts = name.split(".")
        projection = parts[-2] if parts[-1] == "base_layer" and len(parts) > 1 else parts[-1]
        if isinstance(module, nn.Linear) and projection in KEPT_PROJECTIONS:
            found.append(module)
    return found


def check_model(model: nn.Module) -> None:
    """Refuse, with the fix, the models whose layers selective recomputation cannot keep the right outputs of."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    attention = getattr(config, "_attn_implementation", None)
    if attention in REFUSED_ATTENTION:
        raise ConfigError(
            f"training.selective_layers: {attention} attention is not one kernel whose output a layer can keep; set "
            "model.attn_implementation to auto, varlen or sdpa, or use gradient_checkpointing instead"
        )
    if text is not None and MoeShape.from_text_config(text) is not None:
        raise ConfigError(
            "training.selective_layers: MoE layers run their experts inside one op, which selective recomputation "
            "would recompute whole; use gradient_checkpointing with checkpoint_layers instead"
        )


def enable_selective_recomputation(layers: list[nn.Module], compiled: bool = False) -> int:
    """Checkpoint `layers` selectively (see the module doc), for compiling them afterwards when `compiled`;
    returns how many."""
    for layer in layers:
        kept = kept_projections(layer)
        if not kept:
            raise ConfigError(
                f"training.selective_layers: {type(layer).__name__} has none of the projections selective "
                f"recomputation keeps ({', '.join(sorted(KEPT_PROJECTIONS))}); use gradient_checkpointing instead"
            )
        if compiled:
            layer.forward = checkpointed_forward(layer.forward)
            continue
        projections = KeptProjections()
        for module in kept:
            module.register_forward_pre_hook(projections.enter)
            module.register_forward_hook(projections.leave)
        layer._gradient_checkpointing_func = functools.partial(
            checkpoint, use_reentrant=False, context_fn=functools.partial(selective_contexts, projections)
        )
        layer.gradient_checkpointing = True
    return len(layers)
