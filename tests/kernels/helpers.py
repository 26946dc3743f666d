"""Comparison helpers shared by the kernel tests (docs/architecture.md, "Exactness")."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 5e-3}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str, scale: float = 1.0) -> None:
    """||out - ref|| / ||ref|| under the dtype's tolerance (times `scale`); NaN never passes."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in output (an unwritten or poisoned element)"
    error = relative_error(out, ref)
    bound = TOLERANCE[dtype] * scale
    assert error < bound, f"{what}: relative error {error:.3e} >= {bound:.1e} ({dtype})"


def leaf(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype).detach().requires_grad_(True)


def as_float64(tensor: torch.Tensor) -> torch.Tensor:
    """A float64 leaf copy of a low-precision input, for the reference."""
    return tensor.detach().double().requires_grad_(True)


def saved_bytes(run, exclude: list[torch.Tensor]) -> int:
    """Bytes autograd keeps for the backward of `run()`: each saved storage once, those of `exclude` left out."""
    excluded = {tensor.untyped_storage().data_ptr() for tensor in exclude}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in excluded:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        run()
    return sum(storages.values())


def peak_bytes(run, exclude: list[torch.Tensor]) -> int:
    """The most bytes of storage `run()` makes that are alive at once (each storage counted from the operation that
    returns it until it is freed), those of `exclude` (parameters, inputs made before) left out."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    excluded = {id(tensor.untyped_storage()) for tensor in exclude}
    alive: dict[int, int] = {}
    peak = 0

    def free(key: int) -> None:
        del alive[key]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal peak
            out = func(*args, **(kwargs or {}))
            for tensor in tree_leaves(out):
                if not isinstance(tensor, torch.Tensor):
                    continue
                storage = tensor.untyped_storage()
                key = id(storage)
                if key not in excluded and key not in alive and storage.nbytes():
                    alive[key] = storage.nbytes()
                    weakref.finalize(storage, free, key)
                    peak = max(peak, sum(alive.values()))
            return out

    with Count():
        run()
    return peak


def installed_modeling(name: str) -> ModuleType | None:
    """The modeling module `name`, or None where the installed transformers predates its family."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return None


IGNORE = -100  # the ignored target of the preference tests


def make_inputs(sequences, tokens, hidden, vocab, dtype, device, seed, with_bias=True, ignore_index=IGNORE):
    """hidden (B, T, H), head weight and bias, targets with the first token (prompt) and some others ignored."""
    torch.manual_seed(seed)
    h = torch.randn(sequences, tokens, hidden, device=device).to(dtype)
    w = (torch.randn(vocab, hidden, device=device) * 1.5 / hidden**0.5).to(dtype)
    b = (torch.randn(vocab, device=device) * 0.2).to(dtype) if with_bias else None
    target = torch.randint(0, vocab, (sequences, tokens), device=device)
    target[:, 0] = ignore_index
    target[torch.rand(sequences, tokens, device=device) < 0.2] = ignore_index
    return h, w, b, target


def leaves(*tensors, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).clone().requires_grad_(True) for t in tensors]
