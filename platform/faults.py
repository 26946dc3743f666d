"""Which training failures are worth a retry.

Flyte retries a task only when it raises `FlyteRecoverableException`; torch elastic restarts workers
(up to `max_restarts`) whatever they raised. A retry helps when the fault is in the machines or the
network, not in the run: a lost peer or node, a closed or refused connection, a gloo/NCCL
communication error or timeout. It does not help for a config or data error, a diverging loss or
running out of memory with the same settings: those fail at once, with their own message.

`is_retryable` judges what a worker raised; `lost_worker` judges torch elastic's report of a worker
that did not raise at all because a signal ended it (eviction, preemption, a lost node).
"""

from __future__ import annotations

#: substrings of torch.distributed / gloo / NCCL / CUDA messages that name a machine or network fault
RETRYABLE_MESSAGES = (
    "connection closed by peer",
    "connection reset by peer",
    "connection refused",
    "broken pipe",
    "connectfullmesh",
    "gloo/transport",
    "nccl communicator was aborted",
    "ncclremoteerror",
    "ncclsystemerror",
    "ncclinternalerror",
    "nccl error",
    "watchdog caught collective operation timeout",
    "timed out",
    "uncorrectable ecc error",
    "gpu has fallen off the bus",
)


def _never_retryable() -> tuple[type[BaseException], ...]:
    """The run's own errors: retrying repeats them."""
    import torch
    from pydantic import ValidationError

    from tigon.runtime.config import ConfigError
    from tigon.runtime.data import DataError

    return (
        ConfigError,
        DataError,
        ValidationError,
        FloatingPointError,
        torch.OutOfMemoryError,
        FileNotFoundError,
        PermissionError,
    )


def _retryable_types() -> tuple[type[BaseException], ...]:
    import torch.distributed as dist

    return (dist.DistNetworkError, dist.DistStoreError, ConnectionError, TimeoutError)


def is_retryable(error: BaseException) -> bool:
    """True when `error` (or an exception it was raised from) is a machine or network fault, not the run's own."""
    never, retryable = _never_retryable(), _retryable_types()
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, never):
            return False
        if isinstance(current, retryable):
            return True
        message = str(current).lower()
        if isinstance(current, (RuntimeError, OSError)) and any(text in message for text in RETRYABLE_MESSAGES):
            return True
        current = current.__cause__ or current.__context__
    return False


#: signals that end a worker from outside: preemption or eviction (SIGTERM), a kill or a lost node (SIGKILL)
LOST_WORKER_SIGNALS = ("SIGKILL", "SIGTERM", "SIGBUS")


def lost_worker(error: BaseException) -> str | None:
    """For torch elastic's ChildFailedError whose first failed worker was killed by a signal from outside
    (restarts exhausted): a description of it; None for any other error (the worker raised, or exited)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if not isinstance(error, ChildFailedError):
        return None
    rank, failure = error.get_first_failure()
    if failure.exitcode >= 0 or failure.signal_name() not in LOST_WORKER_SIGNALS:
        return None
    return f"worker rank {rank} (pid {failure.pid}) was ended by {failure.signal_name()}"
