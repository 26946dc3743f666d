"""Processes and devices: rank, world size and rendezvous from the environment, DDP wrapping.

The same entry point runs one process or many: `torchrun` and a Kubeflow PyTorchJob both set
RANK, WORLD_SIZE, LOCAL_RANK (torchrun), MASTER_ADDR and MASTER_PORT. A process group is
created when WORLD_SIZE > 1, or in one process for the sharded strategies (fsdp, deepspeed):
gloo on CPUs, NCCL on GPUs (`parallelism.backend`). The strategies themselves live in
tigon.runtime.parallel.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from tigon.runtime.config import ConfigError, RunConfig, parse_memory

logger = logging.getLogger("tigon.runtime")


_owns_process_group = False  # True when init_distributed created the group (so shutdown may destroy it)
_added_environ: list[str] = []  # launcher variables init_distributed set for a one-process group


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    group_rank: int = 0  # the node, numbered as torchrun's GROUP_RANK
    local_world_size: int = 1  # processes on this node

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_node_leader(self) -> bool:
        """The first process of its node: the one that handles the node's own disk."""
        return self.local_rank == 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _int_var(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} must be an integer (set by torchrun)") from None


def env_from_environ(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read the torchrun / PyTorchJob variables; a bare `python` process is rank 0 of 1."""
    environ = os.environ if environ is None else environ
    world_size = _int_var(environ, "WORLD_SIZE", 1)
    rank = _int_var(environ, "RANK", 0)
    local_rank = _int_var(environ, "LOCAL_RANK", 0)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"RANK={rank} and WORLD_SIZE={world_size} are inconsistent: need 0 <= RANK < WORLD_SIZE")
    if local_rank < 0 or local_rank > rank:
        raise ConfigError(f"LOCAL_RANK={local_rank} must be between 0 and RANK={rank}")
    port = environ.get("MASTER_PORT")
    env = DistEnv(
        rank,
        world_size,
        local_rank,
        environ.get("MASTER_ADDR"),
        int(port) if port else None,
        group_rank=_int_var(environ, "GROUP_RANK", 0),
        local_world_size=_int_var(environ, "LOCAL_WORLD_SIZE", 1),
    )
    if env.distributed and (env.master_addr is None or env.master_port is None):
        raise ConfigError(
            f"WORLD_SIZE={world_size} but MASTER_ADDR/MASTER_PORT are not set; "
            "launch with torchrun (e.g. torchrun --nproc_per_node 2 -m tigon.runtime train CONFIG)"
        )
    return env


def check_strategy(config: RunConfig) -> None:
    """Fail early, with the fix, on a parallelism setting this trainer and precision cannot run."""
    if config.training.precision == "fp16" and config.parallelism.strategy == "fsdp" and config.trainer == "hf":
        raise ConfigError(
            "training.precision: fp16 with trainer 'hf' and parallelism.strategy 'fsdp' is not supported: "
            "accelerate's gradient scaler would let the ranks disagree on which steps overflowed; use bf16, "
            "trainer 'torch' or 'lightning', or strategy 'deepspeed'"
        )


def select_device(env: DistEnv) -> torch.device:
    """cuda:LOCAL_RANK when GPUs are present, else the CPU."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        if env.local_rank >= count:
            raise ConfigError(f"LOCAL_RANK={env.local_rank} but only {count} GPU(s) are visible on this node")
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


ALLOCATOR_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"
ALLOCATOR_DEFAULT = "expandable_segments:True"


def configure_allocator() -> None:
    """PyTorch's CUDA allocator with expandable segments, unless PYTORCH_CUDA_ALLOC_CONF is set or CUDA is already
    initialized (the allocator reads its settings then). A training step allocates buffers of many sizes (compiled
    graphs, FP8 casts, FSDP2's gathers); in fixed segments their freed blocks fragment, and a run whose tensors
    fit can still fail with memory reserved but unallocated. Expandable segments grow one mapping per stream. The
    setting is this process's environment variable, so processes it starts later inherit it."""
    if ALLOCATOR_VARIABLE in os.environ or not torch.cuda.is_available() or torch.cuda.is_initialized():
        return
    os.environ[ALLOCATOR_VARIABLE] = ALLOCATOR_DEFAULT
    logger.info("CUDA allocator: %s (set %s to choose otherwise)", ALLOCATOR_DEFAULT, ALLOCATOR_VARIABLE)


def cap_gpu_memory(config: RunConfig, device: torch.device) -> None:
    """`training.gpu_memory`: PyTorch's allocator on `device` stops there, so the run raises out-of-memory (with
    the planner's advice) rather than take memory it was not given."""
    if config.training.gpu_memory is None:
        return
    fraction = parse_memory(config.training.gpu_memory) / torch.cuda.get_device_properties(device).total_memory
    if fraction < 1:
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        logger.info("GPU memory capped at %s (training.gpu_memory)", config.training.gpu_memory)


def resolve_backend(config: RunConfig, device: torch.device) -> str:
    backend = config.parallelism.backend
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("parallelism.backend: 'nccl' needs GPUs; on CPUs use 'gloo' or 'auto'")
    return backend


def init_distributed(config: RunConfig, environ: Mapping[str, str] | None = None) -> tuple[DistEnv, torch.device]:
    """Read the environment, pick the device and join the process group (WORLD_SIZE > 1, or fsdp/deepspeed)."""
    check_strategy(config)
    env = env_from_environ(environ)
    device = select_device(env)
    if device.type == "cuda":
        configure_allocator()
        torch.cuda.set_device(device)
        cap_gpu_memory(config, device)
    global _owns_process_group
    if config.parallelism.strategy != "ddp" and not env.distributed and not dist.is_initialized():
        # FSDP2 and DeepSpeed shard over a process group even in one process (e.g. to offload to the CPU).
        # DeepSpeed reads torchrun's variables; they are set for the run and removed again by `shutdown`.
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            if name not in os.environ:
                os.environ[name] = "1" if name == "WORLD_SIZE" else "0"
                _added_environ.append(name)
        dist.init_process_group(
            backend=resolve_backend(config, device),
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=device if device.type == "cuda" else None,
        )
        _owns_process_group = True
    if env.distributed and not dist.is_initialized():
        backend = resolve_backend(config, device)
        rendezvous_timeout = datetime.timedelta(minutes=30)  # the other ranks' processes may still be starting
        store, _, _ = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=rendezvous_timeout))
        # Keys of this restart only: a torch elastic restart can hand the new workers a store that still
        # holds the previous worker group's addresses, and gloo would dial those dead peers.
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore(f"tigon/restart-{restart}", store),
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(minutes=config.parallelism.collective_timeout_minutes),
            device_id=device if device.type == "cuda" else None,
        )
        _owns_process_group = True
        logger.info("rank %d/%d joined the %s process group on %s", env.rank, env.world_size, backend, device)
    return env, device


def wait_for_idle_process_groups() -> None:
    """A barrier on every process group of this process (the default one and those FSDP2 or DeepSpeed made), at
    the end of a run that finished on every rank, also in a group the caller created.

    A gloo worker thread releases a finished collective's tensors after the caller has moved on, and that
    release takes the GIL. If the process exits meanwhile, the thread meets an interpreter that is finalizing
    and the process aborts (std::terminate), so torchrun reports a finished run as failed (seen in 1 of 5
    two-rank CPU runs). A group's barrier waits for all its earlier work with the GIL released and holds no
    tensor itself; each group has its own threads. Call on every rank, never after a failure: a lost peer
    would never reach the barrier.
    """
    if not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d

    for group in list(distributed_c10d._world.pg_map):  # in creation order, the same on every rank
        dist.barrier(group=group)


def shutdown(failure: BaseException | None = None) -> None:
    """Leave the process group if `init_distributed` created it (a caller's own group is left alone).

    After a `failure` on this rank, the error is logged first, so it is in the log however the other ranks,
    which may sit in a collective this rank will never join, come to an end; and an NCCL group is aborted
    instead of destroyed: destroying it waits for the collectives this rank had queued, which the other ranks
    will never match, so the process would hang until NCCL's timeout instead of exiting and letting torchrun
    stop the job. torch's abort is `_abort_process_group` (experimental, NCCL only); other backends' groups are
    destroyed."""
    global _owns_process_group
    world_size = os.environ.get("WORLD_SIZE", "1")
    if failure is not None and world_size.strip() not in ("", "1"):  # as is: the failure may be about these
        logger.error("rank %s of %s failed: %s", os.environ.get("RANK", "?"), world_size, failure)
    if _owns_process_group and dist.is_initialized():
        if failure is not None and dist.get_backend() == "nccl":
            from torch.distributed import distributed_c10d

            distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    _owns_process_group = False
    while _added_environ:
        os.environ.pop(_added_environ.pop(), None)


def wrap_model(model: nn.Module, config: RunConfig, env: DistEnv, device: torch.device) -> nn.Module:
    """DistributedDataParallel when WORLD_SIZE > 1, the model itself otherwise."""
    check_strategy(config)
    if not env.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()


def all_reduce_sum(values: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a tensor over all ranks (in place, returned); a no-op in one process."""
    if env.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def all_gather_object(value, env: DistEnv) -> list:
    """Every rank's value, in rank order, on every rank."""
    if not env.distributed:
        return [value]
    gathered = [None] * env.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def broadcast_object(value, env: DistEnv, src: int = 0):
    """Rank `src`'s value on every rank."""
    if not env.distributed:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def shard_ranks(config: RunConfig, env: DistEnv) -> int:
    """How many ranks each parameter is sharded over: `parallelism.shard_size` ('node': the ranks of a node),
    else, or where it is at least the number of ranks, every rank."""
    size = config.parallelism.shard_size
    if size is None:
        return env.world_size
    size = min(env.local_world_size if size == "node" else size, env.world_size)
    if env.world_size % size:
        raise ConfigError(
            f"parallelism.shard_size {config.parallelism.shard_size!r} is {size} ranks, which does not divide the "
            f"{env.world_size} ranks of this job into equal groups; set a divisor of {env.world_size}, or 'node' on "
            "nodes of equal size"
        )
    return size
