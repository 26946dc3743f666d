"""Fused linear cross entropy in a causal LM's `forward`: one wrapper for every family in the table.

With `labels` and `skip_logits` (default: `model.training`), the wrapped forward runs the family's
own forward with no logit positions kept (`logits_to_keep` = an empty index, so the head projects
nothing), takes the final hidden states from a forward hook on the decoder, and computes the loss
with `fused_linear_cross_entropy`: the `(tokens, vocabulary)` logits never exist. The output is the
family's own output class with `logits=None` (as Liger-Kernel returns), everything else (past key
values, MoE `aux_loss` and router logits, hidden states) unchanged. Without labels, or in eval mode,
the family's forward runs untouched, so generation and evaluation get their logits.

The loss is Hugging Face's `ForCausalLMLoss`: labels shifted left and padded with `ignore_index`,
`shift_labels` used as given, `num_items_in_batch` dividing the summed loss (gradient accumulation),
the family's head quirks from its table row, read from the text config (Gemma 2/3 and PaliGemma
`final_logit_softcapping`, Granite `logits_scaling`, Falcon-H1 `lm_head_multiplier`), the MoE auxiliary
loss added as the family does (its coefficient on the model, or on the text config for vision-language
MoEs). Under autocast the head runs in the autocast dtype, as `nn.Linear` would.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from typing import TYPE_CHECKING

import torch
from torch import nn

from tigon.kernels.patching.last_layer import LOSS_ROWS, last_layer_takes_rows

if TYPE_CHECKING:
    from collections.abc import Callable

    from tigon.kernels.patching import Family

logger = logging.getLogger("tigon.kernels")


def keep_positions(hidden: torch.Tensor, keep: int | torch.Tensor) -> torch.Tensor:
    """The positions HF's `logits_to_keep` selects: the last `keep` (all for 0), or the given indices."""
    return hidden[:, slice(-keep, None) if isinstance(keep, int) else keep, :]


@functools.cache
def _warn_head(kind: str) -> None:
    logger.warning(
        "tigon: lm_head is a %s, not a plain nn.Linear (an adapter on the head?); the fused linear cross "
        "entropy reads lm_head.weight directly and would skip it, so this model computes its loss the "
        "transformers way (full logits). Keep adapters off lm_head to get the fused loss.",
        kind,
    )


def causal_lm_loss(
    model: nn.Module,
    family: Family,
    hidden: torch.Tensor,
    labels: torch.Tensor | None,
    shift_labels: torch.Tensor | None = None,
    num_items_in_batch: int | float | torch.Tensor | None = None,
    ignore_index: int = -100,
    loss_positions: torch.Tensor | None = None,
    hidden_at_positions: bool = False,
) -> torch.Tensor:
    """`ForCausalLMLoss` of the head over `hidden` `(B, S, H)`, without the logits. `loss_positions` (indices into
    the flattened `(B * S)` positions, after the shift) limits the head and the loss to those positions: given every
    position with a label, the loss and gradients are unchanged, as the others add nothing to either.
    `hidden_at_positions`: `hidden` holds those positions' rows only (`tigon.kernels.patching.last_layer`)."""
    from tigon.kernels.functional import fused_linear_cross_entropy

    head = model.get_output_embeddings()
    weight, bias = head.weight, head.bias
    config = model.config.get_text_config()
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = shift_labels.reshape(-1).to(hidden.device)
    if loss_positions is not None:
        targets = targets.index_select(0, loss_positions)
        if not hidden_at_positions:
            hidden = hidden.index_select(0, loss_positions)
    if family.logits_scaling:
        hidden = hidden / config.logits_scaling
    if family.logits_multiplier:
        hidden = hidden * getattr(config, family.logits_multiplier)
    softcap = getattr(config, "final_logit_softcapping", None) if family.final_logit_softcapping else None
    return fused_linear_cross_entropy(
        hidden,
        weight,
        targets,
        bias,
        ignore_index=ignore_index,
        softcap=softcap,
        num_items_in_batch=num_items_in_batch,
        chunk_size=model.__dict__.get(LOSS_CHUNK_TOKENS),
        check_targets=model.__dict__.get(CHECK_TARGETS, True),
    )


LAST_HIDDEN = "_tigon_last_hidden_state"
LOSS_CHUNK_TOKENS = "_tigon_loss_chunk_tokens"  # the fused loss's tokens per chunk from `apply` (None: the op's rule)
CHECK_TARGETS = "_tigon_check_targets"  # whether the fused loss checks its labels on the device (`apply`'s flag)


def _store_last_hidden_state(decoder: nn.Module, args, output) -> None:
    box = decoder.__dict__[LAST_HIDDEN]
    if box:  # a fused forward is waiting for it
        box[-1] = output[0]


def decoder_of(causal_lm: nn.Module) -> nn.Module:
    """The decoder whose output is the final hidden states: `get_decoder()`, or where that lookup stops at a causal
    LM (a module with an LM head: Llama4ForCausalLM, alone or as Llama4ForConditionalGeneration's language model),
    that causal LM's `model`."""
    decoder = causal_lm.get_decoder()
    return decoder.model if decoder.get_output_embeddings() is not None else decoder


def has_fused_loss(model: nn.Module) -> bool:
    """Whether `model`'s forward reaches a causal LM with tigon's fused-loss forward, through the wrappers that pass
    keywords on (DDP, DeepSpeed and Lightning's `module`, PEFT's base model), so it takes `loss_positions`."""
    while not hasattr(type(model).forward, "__tigon_original__"):
        inner = getattr(model, "module", None)
        if inner is None and hasattr(model, "get_base_model"):
            inner = model.get_base_model()
        if not isinstance(inner, nn.Module) or inner is model:
            return False
        model = inner
    return True


def keep_last_hidden_state(causal_lm: nn.Module) -> list:
    """The list the decoder's forward hook fills with its `last_hidden_state` (installed once per model).

    A hook, not `output_hidden_states=True`: transformers' output capturing breaks torch.compile graphs.
    """
    decoder = decoder_of(causal_lm)
    if LAST_HIDDEN not in decoder.__dict__:
        decoder.__dict__[LAST_HIDDEN] = []
        decoder.register_forward_hook(_store_last_hidden_state)
    return decoder.__dict__[LAST_HIDDEN]


def takes_loss_rows(causal_lm: nn.Module, kwargs: dict) -> bool:
    """Whether a forward of `causal_lm` with these keyword arguments may have its last decoder layer compute only
    the rows a loss reads (`tigon.kernels.patching.last_layer`): the family's layer takes them, and no router
    logits are output (their auxiliary loss counts every row)."""
    config = causal_lm.config.get_text_config()
    routed = kwargs.get("output_router_logits", getattr(config, "output_router_logits", False))
    return not routed and last_layer_takes_rows(decoder_of(causal_lm))


def last_hidden_state(model: nn.Module, inner: nn.Module, rows: torch.Tensor | None = None, **inputs) -> torch.Tensor:
    """The decoder's last hidden states `(B, T, H)` from a forward of `model` (`inner`, or a wrapper of it) that
    keeps no logit positions, so the head projects nothing. `rows` (sorted positions of the flattened `(B, T)`):
    where the family's last layer takes them (`takes_loss_rows`), it computes only those rows past its attention,
    and the states come back as `(1, len(rows), H)`."""
    if rows is not None and takes_loss_rows(inner, inputs):
        inputs[LOSS_ROWS] = rows
    box = keep_last_hidden_state(inner)
    box.append(None)
    device = inner.get_output_embeddings().weight.device
    inputs.update(use_cache=False, logits_to_keep=torch.empty(0, dtype=torch.long, device=device))
    try:
        model(**inputs)
        return box[-1]
    finally:
        box.pop()


def gathered_in_own_forward(head: nn.Module) -> bool:
    """Whether the head's weight is whole only inside its own forward: its own FSDP2 unit, or ZeRO-3."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return (fsdp is not None and isinstance(head, fsdp.FSDPModule)) or hasattr(head.weight, "ds_id")


def run_as_forward(module: nn.Module, function: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """`function(*args)` run as `module`'s forward, so the module's hooks gather its sharded weight around it
    (FSDP2 unshard and gradient reduce-scatter, ZeRO-3 gather and partitioned gradients)."""
    module.forward = function
    try:
        return module(*args)
    finally:
        del module.forward


def fused_forward(original, family: Family):
    """A `forward(self, ...)` that computes the loss with the fused op when it skips the logits.

    `skip_logits` (keyword only, tigon's) forces the choice; by default the logits are skipped when
    training with labels. `loss_positions` (keyword only, tigon's; `causal_lm_loss`) lets the fused loss project only
    the positions with a label, where prompts carry none, and a family's last decoder layer compute only those rows
    past its attention (`tigon.kernels.patching.last_layer`); the logits path ignores it (its loss is the same).
    """
    original = getattr(original, "__tigon_original__", original)
    names = [name for name in inspect.signature(original).parameters][1:]

    @functools.wraps(original)
    def forward(self, *args, skip_logits: bool | None = None, loss_positions: torch.Tensor | None = None, **kwargs):
        kwargs.update(zip(names[: len(args)], args, strict=True))
        labels = kwargs.get("labels")
        if skip_logits is None:
            skip_logits = self.training and labels is not None
        if not skip_logits:
            return original(self, **kwargs)
        if labels is None:
            raise ValueError("skip_logits=True computes the loss without logits, so it needs labels; pass labels=")
        head = self.get_output_embeddings()
        if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:  # FSDPLinear passes
            _warn_head(type(head).__name__)
            return original(self, **kwargs)
        del kwargs["labels"]
        keep = kwargs.pop("logits_to_keep", 0)
        return_dict = kwargs.pop("return_dict", None)
        box = keep_last_hidden_state(self)
        box.append(None)
        no_positions = torch.empty(0, dtype=torch.long, device=head.weight.device)
        if loss_positions is not None and keep == 0 and takes_loss_rows(self, kwargs):
            kwargs[LOSS_ROWS] = loss_positions  # the last layer computes only the rows the loss reads
        out = original(self, **kwargs, logits_to_keep=no_positions, return_dict=True)
        hidden = keep_positions(box.pop(), keep)
        # only those rows, unless the decoder ran fewer layers than it holds (config.num_hidden_layers)
        rows = LOSS_ROWS in kwargs and hidden.shape[:2] == (1, loss_positions.numel())
        loss_of = functools.partial(
            causal_lm_loss,
            self,
            family,
            labels=labels,
            shift_labels=kwargs.get("shift_labels"),
            num_items_in_batch=kwargs.get("num_items_in_batch"),
            ignore_index=kwargs.get("ignore_index", -100),
            loss_positions=loss_positions,
            hidden_at_positions=rows,
        )
        loss = run_as_forward(head, loss_of, hidden) if gathered_in_own_forward(head) else loss_of(hidden)
        if getattr(out, "aux_loss", None) is not None:
            coefficient = (
                getattr(self, "router_aux_loss_coef", None) or self.config.get_text_config().router_aux_loss_coef
            )
            loss = loss + coefficient * out.aux_loss.to(loss.device)
        fields = {name: value for name, value in out.items() if name not in ("logits", "loss")}
        result = type(out)(loss=loss, **fields)
        if return_dict is False or (return_dict is None and not getattr(self.config, "return_dict", True)):
            return result.to_tuple()
        return result

    forward.__tigon_original__ = original
    return forward


@functools.cache
def fused_class(original: type, family: Family) -> type:
    """A subclass of the family's `*ForCausalLM` with the fused-loss forward, keeping the class name."""
    return type(
        original.__name__,
        (original,),
        {
            "forward": fused_forward(original.forward, family),
            "__module__": original.__module__,
            "__qualname__": original.__qualname__,
            "__tigon_original__": original,
        },
    )
