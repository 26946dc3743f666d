"""Rows of packed documents, as `PackedDataset` makes them, for the attention tests."""

from __future__ import annotations

import torch

DOCUMENTS = [[1, 7, 13], [3, 11, 5, 4], [23]]  # per row: document lengths (odd, 1-token ones too)


def packed_batch(rows=DOCUMENTS, vocab=97, seed=0) -> dict[str, torch.Tensor]:
    """input_ids, labels and position_ids of rows of documents, as PackedDataset makes them: position ids restart
    at 0 per document, whose first token has label -100; a shorter row's padding (label -100) goes on counting the
    last document's positions."""
    generator = torch.Generator().manual_seed(seed)
    length = max(sum(row) for row in rows)
    positions = torch.tensor(
        [[p for n in row[:-1] for p in range(n)] + list(range(length - sum(row[:-1]))) for row in rows]
    )
    ids = torch.randint(0, vocab, positions.shape, generator=generator)
    labels = torch.where(positions == 0, -100, ids)  # no document's first token is predicted
    for number, row in enumerate(rows):
        labels[number, sum(row) :] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": positions}
