"""Counting a process's tensor bytes on the CPU, where no allocator statistics exist: the storages an object holds
(`held_bytes`), and the storages operations create inside a block, live and at their peak (`NewStorages`)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

SCALAR_BYTES = 64  # storages this small are bookkeeping scalars (step counts, norms, flags), left out of the counts


def held_bytes(*roots: object) -> int:
    """Bytes of the distinct storages reachable from `roots` (tensors, their `.grad` and `ds_tensor`, containers,
    and the attributes of DeepSpeed's and torch's objects, modules excluded), scalars under SCALAR_BYTES left out."""
    storages: dict[int, int] = {}
    visited: set[int] = set()
    pending = list(roots)
    while pending:
        item = pending.pop()
        if id(item) in visited:
            continue
        visited.add(id(item))
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if item.device.type != "meta" and storage.nbytes() >= SCALAR_BYTES:
                storages[storage.data_ptr()] = storage.nbytes()
            pending += [getattr(item, "grad", None), getattr(item, "ds_tensor", None)]
        elif isinstance(item, dict):
            pending += [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple, set, frozenset)) or type(item).__name__ == "deque":
            pending += list(item)
        elif isinstance(item, torch.nn.Module):
            pending += list(item.parameters())
        elif hasattr(item, "__dict__") and type(item).__module__.split(".")[0] in ("deepspeed", "torch"):
            pending += list(vars(item).values())
    return sum(storages.values())


class NewStorages(TorchDispatchMode):
    """The storages operations allocate while the mode is active (outputs that alias no input), counted until
    they are freed: `live` bytes now and their `peak`."""

    def __init__(self):
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0

    def _freed(self, key: int) -> None:
        self.live -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(result.alias_info is not None for result in func._schema.returns):
            return out  # in place, out=, or a view: no new storage
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if storage.nbytes() and key not in self.sizes:
                self.sizes[key] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._freed, key)
        return out
