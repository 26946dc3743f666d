"""The last decoder layer computed past its attention only where the fused loss reads it.

When the fused loss projects only the positions whose next token carries a label (`loss_positions`: prompts and
padding skipped), the last decoder layer's output at every other position is read by nothing. Its attention still
runs over every position (the kept positions attend to all of them), and from the residual add on (the MLP's norm,
the MLP, then the decoder's final norm) it runs on the kept rows only: on instruction data, about half of the last
layer's matrix work. Exact: each kept row's value is the whole layer's.

A family takes it where its decoder layer is Llama's pre-norm block, or Gemma 2/3's with a norm after each branch
too (`Family.loss_rows_layer` names the class; an MoE family only while its router logits are not output, since
their auxiliary loss counts every row): the fused forward passes the positions down as a keyword (`LOSS_ROWS`),
which every swapped layer removes and the last one uses (the decoder's last, as `last_layer_takes_rows` marks it).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

LOSS_ROWS = "tigon_loss_rows"
TAKES_LOSS_ROWS = "__tigon_takes_loss_rows__"
LAST = "_tigon_last_layer"  # set on the last layer only: the other layers' compiled graphs stay one
FIRST_TRANSFORMERS = 5  # decoder layers return a tensor (4.x's returned a tuple on some lines)


def rows_of(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`(1, len(rows), H)`: the rows of the flattened `(B, T, H)` hidden states."""
    return hidden.flatten(0, 1).index_select(0, rows).unsqueeze(0)


def loss_rows_forward(original):
    """A pre-norm decoder layer's `forward(self, hidden_states, ...)` that, given `LOSS_ROWS` and being the last
    layer, returns the rows at those positions only."""

    @functools.wraps(original)
    def forward(self, hidden_states, *args, **kwargs):
        rows = kwargs.pop(LOSS_ROWS, None)
        if rows is None or args or not getattr(self, LAST, False):
            return original(self, hidden_states, *args, **kwargs)
        attended, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        residual, attended = rows_of(hidden_states, rows), rows_of(attended, rows)
        if hasattr(self, "pre_feedforward_layernorm"):  # Gemma's block: each branch's output is normed too
            hidden_states = residual + self.post_attention_layernorm(attended)
            return hidden_states + self.post_feedforward_layernorm(
                self.mlp(self.pre_feedforward_layernorm(hidden_states))
            )
        hidden_states = residual + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))

    return forward


@functools.cache
def loss_rows_class(original: type) -> type:
    """A subclass of the family's decoder layer with `loss_rows_forward`, keeping the class name."""
    original = getattr(original, "__tigon_original__", original)
    return type(
        original.__name__,
        (original,),
        {
            "forward": loss_rows_forward(original.forward),
            "__module__": original.__module__,
            "__qualname__": original.__qualname__,
            "__tigon_original__": original,
            TAKES_LOSS_ROWS: True,
        },
    )


def last_layer_takes_rows(decoder: nn.Module) -> bool:
    """Whether the decoder's last layer computes only the rows `LOSS_ROWS` names; marks it as the last."""
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0 or not getattr(layers[-1], TAKES_LOSS_ROWS, False):
        return False
    setattr(layers[-1], LAST, True)
    return True
