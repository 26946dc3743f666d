"""FSDP2's all-gathers through the GPUs' copy engines (`parallelism.copy_engine_gathers`).

NCCL runs a collective as kernels that hold SMs for as long as it lasts, and a matrix product that runs beside one
takes longer: on two H200s the Llama-3-8B step's products lost 117 ms (4.2% of the step) that way
(docs/benchmarks.md, "Where the planner's step goes"). Gathering a layer's weights is a copy, which the GPUs' copy
engines can do over NVLink without an SM: each rank puts its shard in a symmetric-memory workspace that every GPU
of the group maps, the ranks meet at a barrier, each reads the others' shards into its gathered buffer with copy
engines (`cudaMemcpyAsync`), and they meet again before the workspace is reused. The bytes are the same, so
training is bit for bit the same as with NCCL's gathers.

Needs every rank of a shard group on one node (peer-mapped memory) and torch's symmetric memory; the reduce-scatter
(a sum) stays NCCL's.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist

from tigon.runtime.config import ConfigError
from tigon.runtime.distributed import DistEnv


class CopyEngineAllGather:
    """FSDP2's all-gather comm (`FSDPModule.set_custom_all_gather`): the other ranks' shards read by copy engines
    out of the group's symmetric-memory workspace, in place into FSDP2's gathered buffer."""

    def __init__(self) -> None:
        self.groups: set[str] = set()  # the groups whose symmetric memory is set up

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        if group.group_name not in self.groups:
            enable_symmetric_memory(group.group_name)
            self.groups.add(group.group_name)
        shard_bytes = input_tensor.numel() * input_tensor.element_size()
        workspace = symm_mem.get_symm_mem_workspace(group.group_name, shard_bytes)
        rank, world = workspace.rank, workspace.world_size
        workspace.get_buffer(rank, input_tensor.shape, input_tensor.dtype).copy_(input_tensor)
        workspace.barrier()
        chunks = output_tensor.chunk(world)  # FSDP2's input is this rank's chunk of the output already
        for step in range(1, world):
            peer = (rank + step) % world
            chunks[peer].copy_(workspace.get_buffer(peer, input_tensor.shape, input_tensor.dtype))
        workspace.barrier()  # no rank overwrites its shard before every other has read it
        return None


def enable_symmetric_memory(group_name: str) -> None:
    """Register the group with torch's symmetric memory: needed before torch 2.12, a deprecated no-op since."""
    from torch.distributed import _symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            enable(group_name)


def check_copy_engine_gathers(shard: int, env: DistEnv, device: torch.device, module: torch.nn.Module) -> None:
    """Refuse `parallelism.copy_engine_gathers` where it cannot run, naming the fix."""
    if device.type != "cuda":
        raise ConfigError(
            f"parallelism.copy_engine_gathers copies between GPUs' memories and this run is on {device.type}; set "
            "it to false"
        )
    if env.local_world_size % shard:
        raise ConfigError(
            f"parallelism.copy_engine_gathers needs each shard group ({shard} ranks) on one node, which has "
            f"{env.local_world_size} processes; set parallelism.shard_size: node, or copy_engine_gathers: false"
        )
    if not hasattr(module, "set_custom_all_gather"):
        raise ConfigError(
            f"parallelism.copy_engine_gathers: torch {torch.__version__} cannot replace FSDP2's all-gather "
            "(FSDPModule.set_custom_all_gather); upgrade torch, or set copy_engine_gathers: false"
        )


def use_copy_engine_gathers(units: list) -> None:
    """Every FSDP2 unit of `units` gathers its weights with copy engines."""
    comm = CopyEngineAllGather()
    for unit in units:
        unit.set_custom_all_gather(comm)
