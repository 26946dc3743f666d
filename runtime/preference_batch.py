"""A micro-batch of preference items as the model runs it and as the fused preference ops read it.

    rows = preference_rows(batch, packing, config.model.attn_implementation, device)
    hidden = rows.op_layout(final_hidden(model, rows.inputs, rows=rows.read))  # (2N, T, H) for the fused op

The fused ops take one row per sequence, `(sequences, T, hidden)`: a micro-batch of N pairs (KTO: N completions and
their N mismatched sequences) is 2N rows, the first rows then the second rows of its items, cut to the longest
sequence. Padded (`data.packing: false`, the preference objectives' default), the model runs those rows as they
are, with their padding mask. Packed (`data.packing: true`), the model runs the 2N sequences laid end to end in one
row without padding, position ids restarting at 0 for each, and attention kept inside each sequence as for packed
SFT rows (`tigon.runtime.data.model_inputs`: varlen boundaries, or a block-diagonal mask for sdpa and eager); each
sequence's final hidden states are then gathered into the op's rows. Every token sees the same positions and the
same tokens in both layouts, so the ops receive the same completion log-probs up to floating-point rounding. With
`skip_prompts` the op's rows keep only the positions with a target (the completions), in either layout: the prompts
carry none, so the loss and metrics stay the same while the op's head projects fewer positions, and the model's last
layer computes past its attention only the positions the op reads (`read`; `tigon.kernels.patching.last_layer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tigon.runtime.data import IGNORE_INDEX, model_inputs, projected_count


def rows(tensor: torch.Tensor) -> torch.Tensor:
    """(B, R, ...) items -> (R * B, ...): every item's first row, then every item's second (chosen, then rejected)."""
    return tensor.transpose(0, 1).reshape(-1, *tensor.shape[2:])


@dataclass
class PreferenceRows:
    """The model's inputs for a micro-batch, the op's next-token targets `(2N, T)` (-100 on prompts and padding),
    and, packed, where each of the op's `(2N, T)` tokens sits in the packed row (`index`; past a sequence's end,
    one position beyond the row, which `op_layout` fills with zeros)."""

    inputs: dict[str, Any]
    target: torch.Tensor
    index: torch.Tensor | None = None
    read: torch.Tensor | None = None  # `positions_read`: the model's positions `index` reads
    read_index: torch.Tensor | None = None  # `index` into `read`'s rows

    def op_layout(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's final hidden states `(rows, length, H)`, or `(1, len(read), H)` at the positions `read`
        names, as the fused ops take them, `(2N, T, H)`."""
        if self.index is None:
            return hidden
        at_read = self.read is not None and hidden.shape[:2] == (1, len(self.read))  # else read is every position
        flat = torch.cat([hidden.flatten(0, 1), hidden.new_zeros(1, hidden.shape[-1])])
        return flat[self.read_index if at_read else self.index]


def positions_read(index: torch.Tensor, beyond: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The positions of the model's flattened output that `index` reads (all but `beyond`, the zero row), sorted,
    with as many unread ones as `projected_count` adds (to a multiple of 16, as FP8 layers need), and `index` into
    them (`beyond` becoming their count); None where too few positions are left unread to skip."""
    read = torch.zeros(beyond, dtype=torch.bool)
    read[index[index != beyond]] = True
    count = int(read.sum())
    kept = projected_count(count, beyond)
    if kept is None:
        return None
    read[(~read).nonzero().squeeze(1)[: kept - count]] = True
    positions = read.nonzero().squeeze(1)
    found = torch.searchsorted(positions, index.clamp(max=beyond - 1))
    return positions, torch.where(index == beyond, kept, found)


def completion_columns(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For targets `(rows, T)`, each row's columns with a target first, in order, `(rows, W)`, and which of them have
    one: W is `projected_count` of the most any row has; None where that finds nothing worth skipping."""
    with_target = target != IGNORE_INDEX
    counts = with_target.sum(-1)
    width = projected_count(int(counts.max()), target.shape[1])
    if width is None:
        return None
    order = torch.argsort((~with_target).to(torch.int8), dim=-1, stable=True)[:, :width]
    return order, torch.arange(width) < counts[:, None]


def preference_rows(
    batch: dict[str, torch.Tensor],
    packing: bool,
    attn_implementation: str,
    device: torch.device,
    token_multiple: int = 1,
    skip_prompts: bool = False,
) -> PreferenceRows:
    """A collated micro-batch of PreferenceDataset items, padded or packed (see the module docstring), its tokens a
    multiple of `token_multiple` (`tigon.runtime.data.token_multiple`): padded rows are cut a little longer, a
    packed row ends in a padding sequence of its own. With `skip_prompts` (kernels.skip_unlabelled) the op's rows
    hold only each sequence's positions with a target (`completion_columns`), so its head skips the prompts."""
    length = int(batch["attention_mask"].sum(-1).max())
    length = min(-(-length // token_multiple) * token_multiple, batch["attention_mask"].shape[-1])
    input_ids = rows(batch["input_ids"][..., :length])
    mask = rows(batch["attention_mask"][..., :length])
    labels = rows(batch["labels"][..., :length])
    target = nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    if not packing:
        inputs = {
            "input_ids": input_ids.to(device, non_blocking=True),
            "attention_mask": mask.to(device, non_blocking=True),
        }
        index, beyond = None, target.numel()  # beyond: the zero row `op_layout` adds after the model's positions
    else:
        keep = mask.bool()  # right padding: each row's tokens come first
        tokens = int(keep.sum())
        padding = -tokens % token_multiple
        index, beyond = torch.full(mask.shape, tokens + padding, dtype=torch.long), tokens + padding
        index[keep] = torch.arange(tokens)
        positions = torch.cat([torch.arange(length).expand_as(mask)[keep], torch.arange(padding)])[None]
        packed_ids = torch.cat([input_ids[keep], input_ids.new_zeros(padding)])[None]
        # every token counts as labelled, so varlen keeps the whole row; the model gets no labels
        packed = {"input_ids": packed_ids, "labels": packed_ids, "position_ids": positions}
        inputs = model_inputs(packed, attn_implementation, device)
        inputs.pop("labels")
    columns = completion_columns(target) if skip_prompts else None
    read = read_index = None
    if columns is not None:
        order, valid = columns
        every = index if index is not None else torch.arange(target.numel()).view_as(target)
        index = torch.where(valid, every.gather(1, order), beyond)
        target = torch.where(valid, target.gather(1, order), IGNORE_INDEX)
        read, read_index = positions_read(index, beyond) or (None, None)
    moved = (None if t is None else t.to(device, non_blocking=True) for t in (target, index, read, read_index))
    return PreferenceRows(inputs, *moved)
