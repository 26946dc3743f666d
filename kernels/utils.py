"""Shared plumbing for the ops: where a kernel runs, input checks, launch sizes."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")

logger = logging.getLogger("tigon.kernels")

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Every launch asks for floating-point fusion (a * b + c as one fused multiply-add) by name: the kernels were
# tested and measured with it, Triton 3.10 turns it off by default, and Triton 3.9 warns about that change at
# the first compile of any kernel that leaves it unset.
LAUNCH_OPTIONS = {"enable_fp_fusion": True}

# Triton compiles a kernel again for an integer argument's new class (divisible by 16 or not, equal to 1 or not) the
# first time a value lands in it. A count that changes with the data (a packed micro-batch's tokens, a loss chunk's
# rows) would compile a second variant mid-run, a stall of about a second on each rank. The kernels that take one of
# these names leave it unspecialized (`do_not_specialize`): there it only bounds loops, masks rows and indexes a
# token's position. On an H200 RoPE, cross entropy and the packed SwiGLU ran as fast either way (the JSD, KL and
# MoE kernels use their counts the same way; not timed). The norms keep their row counts specialized: their
# kernels ran 8% (RMSNorm) and 20% (LayerNorm) faster on a count divisible by 16, which micro-batches of whole rows
# (8 rows of 4096, say) always have. So does the FP8 cast: the rows of its transposed layout are n_rows long, whose
# divisibility lets its stores be wide, and a micro-batch that trains in FP8 has tokens in multiples of 16.
DATA_COUNTS = ("n_rows", "rows_per_program", "n_blocks", "seq_len", "stride_pb")


def interpreter_active() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def _announce_reference(op: str) -> None:
    logger.warning(
        "tigon.kernels.%s: CPU tensors and no TRITON_INTERPRET=1, so the pure-PyTorch reference "
        "runs instead of the Triton kernel (same results, no speed-up).",
        op,
    )


def eager_under_compile(function: Callable[P, R]) -> Callable[P, R]:
    """Run `function` eagerly inside `torch.compile`d code, behind a graph break.

    For the ops that are not registered as custom ops: Inductor fails to build the JSD kernels from the
    traced graph, and under the Triton interpreter Dynamo would trace the interpreter's numpy code. The
    custom ops (norms, RoPE, activations, fused linear cross entropy) compile without a break instead.
    """
    return torch.compiler.disable(function)


def use_triton(op: str, tensor: torch.Tensor) -> bool:
    """Whether `op` should launch its Triton kernel for `tensor`; logs once when it cannot."""
    if tensor.is_cuda or interpreter_active():
        return True
    _announce_reference(op)
    return False


def is_dtensor(tensor: object) -> bool:
    """Whether `tensor` is a torch.distributed DTensor (e.g. an FSDP2 parameter outside its module's forward)."""
    module = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor can exist
    return module is not None and isinstance(tensor, module.DTensor)


def gather_dtensors(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """Each DTensor as its whole value on every rank (`full_tensor()`, differentiable: the gradient goes back
    to this rank's shard as DTensor autograd does), other tensors unchanged."""
    return tuple(t.full_tensor() if is_dtensor(t) else t for t in tensors)


def autocast_operands(*tensors: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    """The operands of a fused op's matrix products as `nn.Linear` gets them: under an enabled `torch.autocast` for
    the first tensor's device type, each floating tensor cast (differentiably, so that each input's gradient comes
    back in its own dtype) to the autocast dtype; otherwise unchanged."""
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    if first is None or not torch.is_autocast_enabled(first.device.type):
        return tensors
    dtype = torch.get_autocast_dtype(first.device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors)


def reject_dtensor(op: str, **tensors: torch.Tensor | None) -> None:
    """A clear error for a DTensor argument of an op that takes plain tensors only."""
    for name, tensor in tensors.items():
        if is_dtensor(tensor):
            raise TypeError(
                f"tigon {op}: {name} is a DTensor (a sharded parameter, e.g. FSDP2 outside the module's "
                f"forward); pass {name}.full_tensor(), or call it inside the FSDP module's forward where the "
                "parameters are whole"
            )


def check_float(name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} has dtype {tensor.dtype}; tigon kernels take float32, bfloat16 or float16 "
            f"(cast it first, e.g. {name}.to(torch.bfloat16))"
        )


def check_same_device(reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, tensor in others.items():
        if tensor is not None and tensor.device != reference.device:
            raise ValueError(
                f"{name} is on {tensor.device} but {reference_name} is on {reference.device}; "
                f"move it with {name}.to({reference_name}.device)"
            )


def check_vector(name: str, vector: torch.Tensor | None, size: int, what: str) -> None:
    """A per-feature parameter (weight, bias) must be 1-D with `size` elements."""
    if vector is None:
        return
    check_float(name, vector)
    if vector.dim() != 1 or vector.numel() != size:
        raise ValueError(
            f"{name} has shape {tuple(vector.shape)} but {what} is {size}; it must be a 1-D tensor of {size} elements"
        )


def check_chunk_size(name: str, value: int | None, unit: str) -> None:
    """A chunked op's chunk size: None (the op's own rule) or a positive int of `unit` per chunk."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name}={value!r} must be a positive int ({unit} per chunk) or None for the op's own rule")


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """`x` as a (rows, features) matrix whose last dimension is contiguous (copies only if needed)."""
    if x.dim() == 0:
        raise ValueError("expected a tensor with a feature dimension, got a scalar")
    matrix = x.reshape(-1, x.shape[-1])
    if matrix.shape[-1] > 1 and matrix.stride(-1) != 1:
        matrix = matrix.contiguous()
    return matrix


def _cuda_index(device: torch.device) -> int:
    """The index of a CUDA device, the current one for a bare "cuda"."""
    return device.index if device.index is not None else torch.cuda.current_device()


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors on a GPU; a small fixed count under the interpreter."""
    if device.type == "cuda":
        return _cuda_multiprocessors(_cuda_index(device))
    return 4


@functools.cache
def _cuda_multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def gpu_name(device: torch.device) -> str | None:
    """The GPU's name as the driver reports it ("NVIDIA H200"); None under the interpreter."""
    if device.type != "cuda":
        return None
    return _cuda_name(_cuda_index(device))


@functools.cache
def _cuda_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (plain integer math: launch settings sit on the hot path)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def warps_for(block: int) -> int:
    """Warps for a program that owns `block` elements of a row."""
    return max(1, min(16, block // 256))


def persistent_grid(
    n_rows: int, block_m: int, programs_per_sm: int, device: torch.device, column_blocks: int = 1
) -> tuple[int, int]:
    """(programs, rows_per_program) for a grid where each program walks a band of whole row blocks; with
    `column_blocks`, the bands of each of that many column blocks, the programs shared among them. No rows: no
    programs."""
    if n_rows == 0:
        return 0, block_m
    programs = min(-(-n_rows // block_m), -(-multiprocessor_count(device) * programs_per_sm // column_blocks))
    rows_per_program = -(-n_rows // programs)
    rows_per_program = -(-rows_per_program // block_m) * block_m
    return -(-n_rows // rows_per_program), rows_per_program


@dataclass(frozen=True)
class RowKernelShapes:
    """Launch shapes of a row-wise kernel pair (the norms) by row width, measured with benchmarks/tune.py.

    forward: BLOCK_N -> (rows per program, warps); backward: BLOCK_N -> (rows per step, warps,
    programs per multiprocessor, software-pipelining stages). Widths past the tables take `wide_*`
    (`wide_backward` None: the op has its own kernels for rows past the backward table); rows under 1024
    wide are stacked so one program holds `narrow_elements` elements.
    """

    forward: dict[int, tuple[int, int]]
    backward: dict[int, tuple[int, int, int, int]]
    wide_forward: tuple[int, int]
    wide_backward: tuple[int, int, int, int] | None = None
    narrow_forward_elements: int = 1024
    narrow_backward_elements: int = 1024

    def forward_config(self, n_cols: int) -> tuple[int, int, int]:
        """(BLOCK_M, BLOCK_N, num_warps) of the forward kernel."""
        block_n = next_power_of_2(n_cols)
        if block_n < 1024:
            block_m = self.narrow_forward_elements // block_n
            return block_m, block_n, warps_for(block_m * block_n)
        block_m, warps = self.forward.get(block_n, self.wide_forward)
        return block_m, block_n, warps

    def backward_config(self, n_rows: int, n_cols: int, device: torch.device) -> tuple[int, int, int, int, int, int]:
        """(BLOCK_M, BLOCK_N, num_warps, num_stages, programs, rows_per_program) of the backward kernel."""
        block_n = next_power_of_2(n_cols)
        if block_n < 1024:
            block_m, warps, per_sm, stages = self.narrow_backward_elements // block_n, 4, 4, 1
        else:
            shape = self.backward.get(block_n, self.wide_backward)
            if shape is None:
                raise ValueError(
                    f"no backward launch shape for rows {n_cols} wide: the op's wide-row kernels take them"
                )
            block_m, warps, per_sm, stages = shape
        programs, rows_per_program = persistent_grid(n_rows, block_m, per_sm, device)
        return block_m, block_n, warps, stages, programs, rows_per_program
