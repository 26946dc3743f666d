"""The runtime's entry point: `train` runs (or resumes) one run with the configured trainer.

    result = train(load_config("examples/demo.yaml"))

It holds the run directory's lock (and the object store's lease), keeps a resumed run's global batch on another
number of processes (`tigon.runtime.run.keep_global_batch`), applies the planner's settings (`training.plan:
auto`), and hands the run to the plain PyTorch trainer (`tigon.runtime.torch_trainer`), the
Hugging Face Trainer adapter (`tigon.runtime.hf_trainer`) or the Lightning adapter
(`tigon.runtime.lightning_trainer`); each imports its framework only when it runs. The pieces the three share
live below them (`tigon.runtime.run`, `tigon.runtime.evaluation`, `tigon.runtime.adapters`), so imports point
one way: this module, then the trainers, then what they share.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tigon.runtime import checkpoint as ckpt
from tigon.runtime import planner, storage
from tigon.runtime.config import RunConfig
from tigon.runtime.distributed import configure_allocator, env_from_environ, shutdown, wait_for_idle_process_groups
from tigon.runtime.hf_trainer import train_with_hf
from tigon.runtime.lightning_trainer import train_with_lightning
from tigon.runtime.lock import RunDirLock
from tigon.runtime.run import TrainResult, keep_global_batch, prepare
from tigon.runtime.torch_trainer import train_prepared


def train(config: RunConfig, datasets: str | Path | None = None) -> TrainResult:
    """Run (or resume) one training run as configured; returns what it did. Call on every rank.

    `datasets`: pre-packed data (`tigon.runtime.packed`) to train on instead of tokenizing `config.data`.
    """
    configure_allocator()  # before the planner reads the GPU, which initializes CUDA
    config = keep_global_batch(config, env_from_environ().world_size)  # a resume on another number of processes
    if config.training.plan == "auto":
        config = planner.planned_config(config)
    # DeepSpeed's ZeRO-3 swaps in its own torch.nn.functional.linear for the rest of the process; a later run in
    # this process (a notebook, a sweep) would then save every linear layer's input, frozen weights' too.
    functional_linear = torch.nn.functional.linear
    main = env_from_environ().is_main
    lock = RunDirLock(config.logging.run_dir).acquire() if main else None  # one run per run directory
    lease = None
    failure = None
    try:
        if main:
            if config.checkpoint.remote_dir:  # and per object-store prefix
                lease = storage.RunLease(storage.RunStorage(config.checkpoint.remote_dir)).acquire()
            ckpt.clean_temporaries(config.logging.run_dir)
        if config.trainer == "hf":
            result = train_with_hf(config, datasets)
        elif config.trainer == "lightning":
            result = train_with_lightning(config, datasets)
        else:
            result = train_prepared(config, prepare(config, datasets))
        wait_for_idle_process_groups()  # a run, or the process, that follows meets idle gloo threads
        return result
    except torch.OutOfMemoryError as error:  # answered with the planner's setting for this GPU
        failure = planner.out_of_memory_error(config, error)
        raise failure from error
    except Exception as error:
        failure = error
        raise
    finally:
        torch.nn.functional.linear = functional_linear
        shutdown(failure)
        if lease is not None:
            lease.release()
        if lock is not None:
            lock.release()
