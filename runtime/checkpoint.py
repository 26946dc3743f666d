"""Checkpoints that resume exactly, and the exported model; everything lands atomically.

A checkpoint `<run_dir>/checkpoints/step-N/` holds

    model.pt          the model's state dict (only the trainable tensors when some are frozen, e.g. LoRA)
    optimizer.pt      the optimizer's state dict
    scheduler.pt      the learning-rate schedule (and the fp16 GradScaler, when one is used)
    rng-rank{R}.pt    python, numpy, torch and CUDA random states of each rank
    state.json        step, data position (epoch and batches consumed in it), the losses so far

With `parallelism.strategy: fsdp` the model and optimizer are instead a sharded
torch.distributed.checkpoint directory `dcp/` (every rank writes its shard); with `deepspeed`
they are DeepSpeed's own checkpoint under `deepspeed/` (see tigon.runtime.parallel).

It is written into a temporary directory and renamed into place (`os.replace`), so a run killed
mid-write leaves no half checkpoint; only the newest `keep_last` are kept. With several nodes the
run directory must be on a filesystem every rank sees (each rank writes its own RNG file).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from tigon.runtime.distributed import DistEnv, barrier, unwrap

logger = logging.getLogger("tigon.runtime")

CHECKPOINTS = "checkpoints"
EXPORT = "export"
STATE_FILE = "state.json"


@dataclass
class TrainState:
    """Where a run is: the optimizer step and the data position, plus its history so far."""

    step: int = 0
    epoch: int = 0
    batches_in_epoch: int = 0  # global batches (optimizer steps) consumed in `epoch`
    losses: list[float] = field(default_factory=list)
    tokens_seen: int = 0
    eval_history: list[dict] = field(default_factory=list)
    world_size: int = 1


# ---------------------------------------------------------------- atomic files and directories


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write a whole file under a temporary name in the same directory, then rename it into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def replace_dir(source: Path, target: Path) -> None:
    """Move a finished directory to `target`, replacing any previous one without a moment of absence."""
    if target.exists():
        old = target.with_name(f".old-{target.name}-{os.getpid()}")
        os.replace(target, old)
        os.replace(source, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(source, target)


# ---------------------------------------------------------------- random states


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        kind, keys, position, has_gauss, gauss = numpy.random.get_state()
        state["numpy"] = (kind, keys.tolist(), position, has_gauss, gauss)
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        kind, keys, position, has_gauss, gauss = state["numpy"]
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), position, has_gauss, gauss))


# ---------------------------------------------------------------- checkpoints


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Finished checkpoints, oldest first (temporary directories are ignored)."""
    root = checkpoint_root(run_dir)
    found = []
    if root.is_dir():
        for entry in root.iterdir():
            name = entry.name
            if entry.is_dir() and name.startswith("step-") and name[5:].isdigit() and (entry / STATE_FILE).is_file():
                found.append((int(name[5:]), entry))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def model_state(model: nn.Module) -> tuple[dict, bool]:
    """(state dict, partial): only the trainable tensors when part of the model is frozen."""
    model = unwrap(model)
    state = model.state_dict()
    frozen = any(not p.requires_grad for p in model.parameters())
    if not frozen:
        return state, False
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name: tensor for name, tensor in state.items() if name in trainable}, True


def write_torch_state(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, env: DistEnv, scaler=None
) -> None:
    """Rank 0 writes model.pt, optimizer.pt and scheduler.pt (the DDP / one-process layout)."""
    if not env.is_main:
        return
    weights, partial = model_state(model)
    torch.save({"weights": weights, "partial": partial}, directory / "model.pt")
    torch.save(optimizer.state_dict(), directory / "optimizer.pt")
    schedule = {"scheduler": scheduler.state_dict()}
    if scaler is not None and scaler.is_enabled():
        schedule["scaler"] = scaler.state_dict()
    torch.save(schedule, directory / "scheduler.pt")


def save_checkpoint(
    run_dir: str | Path,
    state: TrainState,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler,
    env: DistEnv,
    keep_last: int,
    scaler=None,
    config_json: str | None = None,
    write_state: Callable[[Path], None] | None = None,
) -> Path:
    """Write `step-N` atomically on every rank's behalf (call on all ranks); prune to `keep_last`.

    `write_state(directory)` runs on every rank and writes the model and optimizer state there (a sharded
    strategy's own format); by default rank 0 writes the torch files of `write_torch_state`.
    """
    root = checkpoint_root(run_dir)
    final = root / f"step-{state.step}"
    temporary = root / f".tmp-step-{state.step}"
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
    barrier(env)
    torch.save(rng_state(), temporary / f"rng-rank{env.rank}.pt")
    if write_state is None:
        write_torch_state(temporary, model, optimizer, scheduler, env, scaler)
    else:
        write_state(temporary)
    barrier(env)
    if env.is_main:
        if config_json is not None:
            (temporary / "config.json").write_text(config_json)
        (temporary / STATE_FILE).write_text(json.dumps(asdict(state), indent=1))  # written last: marks it whole
        replace_dir(temporary, final)
        for _, old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("checkpoint written: %s", final)
    barrier(env)
    return final


def read_torch_state(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, scaler=None
) -> None:
    """Restore what `write_torch_state` wrote."""
    if not (directory / "model.pt").is_file():
        raise FileNotFoundError(
            f"{directory} has no model.pt: it was written by another parallelism.strategy (fsdp or deepspeed); "
            "resume with that strategy, or set checkpoint.resume: false to start over"
        )
    saved = torch.load(directory / "model.pt", map_location="cpu", weights_only=True)
    target = unwrap(model)
    result = target.load_state_dict(saved["weights"], strict=not saved["partial"])
    if result.unexpected_keys:
        raise RuntimeError(
            f"checkpoint {directory} does not fit this model: unexpected keys {result.unexpected_keys[:5]}"
        )
    optimizer.load_state_dict(torch.load(directory / "optimizer.pt", map_location="cpu", weights_only=True))
    schedule = torch.load(directory / "scheduler.pt", map_location="cpu", weights_only=True)
    scheduler.load_state_dict(schedule["scheduler"])
    if scaler is not None and "scaler" in schedule:
        scaler.load_state_dict(schedule["scaler"])


def load_checkpoint(
    path: str | Path,
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    scheduler,
    env: DistEnv,
    scaler=None,
    restore_rng: bool = True,
    read_state: Callable[[Path], None] | None = None,
) -> TrainState:
    """Restore everything `save_checkpoint` wrote into the given objects; returns the TrainState.

    `read_state(directory)` restores what the matching `write_state` wrote (call on every rank).
    """
    path = Path(path)
    state_file = path / STATE_FILE
    if not state_file.is_file():
        raise FileNotFoundError(f"{path} is not a finished checkpoint (no {STATE_FILE})")
    state = TrainState(**json.loads(state_file.read_text()))
    if read_state is None:
        read_torch_state(path, model, optimizer, scheduler, scaler)
    else:
        read_state(path)
    if restore_rng:
        rng_file = path / f"rng-rank{env.rank}.pt"
        if not rng_file.is_file():
            logger.warning("%s has no RNG state for rank %d (world size changed?); using rank 0's", path, env.rank)
            rng_file = path / "rng-rank0.pt"
        set_rng_state(torch.load(rng_file, map_location="cpu", weights_only=True))
    if state.world_size != env.world_size:
        logger.warning(
            "resuming a run saved with world size %d on %d processes: the data order continues by global batch",
            state.world_size,
            env.world_size,
        )
    return state


# ---------------------------------------------------------------- export


def export_model(model: nn.Module, tokenizer, out_dir: str | Path, merge_lora: bool = True) -> Path:
    """`save_pretrained` the final model (LoRA merged when asked) and the tokenizer, atomically.

    Call on rank 0 only, after training: merging LoRA modifies the model in place. Unmerged,
    the directory holds the peft adapter (load it with peft on top of the base model); merged, the adapter
    alone goes to `<out_dir>-adapter` beside it.
    """
    out_dir = Path(out_dir)
    model = unwrap(model)
    if hasattr(model, "peft_config") and merge_lora:
        export_model(model, None, out_dir.with_name(f"{out_dir.name}-adapter"), merge_lora=False)  # the adapter alone
        model = model.merge_and_unload()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".tmp-{out_dir.name}-", dir=out_dir.parent))
    try:
        model.save_pretrained(temporary)
        if tokenizer is not None:
            tokenizer.save_pretrained(temporary)
        replace_dir(temporary, out_dir)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    logger.info("exported the model to %s", out_dir)
    return out_dir
