"""Copies of a batch's CPU tensors to the GPU that never wait for it."""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` (on the CPU) on `device`, its copy queued behind the work already there without the host waiting.

    On CUDA the tensor is pinned first: a copy from pageable memory goes through the driver's staging buffer,
    and one larger than it holds the host until the GPU has drained the work queued before it, which would undo
    preparing a step's inputs while the previous step runs."""
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)
