"""Checkpoints that resume exactly, and the exported model; everything lands atomically.

A checkpoint `<run_dir>/checkpoints/step-N/` holds

    model.pt          the model's state dict (only the trainable tensors when some are frozen, e.g. LoRA)
    optimizer.pt      the optimizer's state dict
    scheduler.pt      the learning-rate schedule (and the fp16 GradScaler, when one is used)
    rng-rank{R}.pt    python, numpy, torch and CUDA random states of each rank
    state.json        step, data position (epoch and batches consumed in it), the losses so far
    manifest.json     every other file with its size and SHA-256, written last

With `parallelism.strategy: fsdp` the model and optimizer are instead a sharded
torch.distributed.checkpoint directory `dcp/` (every rank writes its shard); with `deepspeed`
they are DeepSpeed's own checkpoint under `deepspeed/` (see tigon.runtime.parallel).

It is written into a temporary directory and renamed into place (`os.replace`), so a run killed
mid-write leaves no half checkpoint; only the newest `keep_last` are kept. With `checkpoint.remote_dir`
(the run's `RunStorage`) the finished checkpoint is then uploaded by rank 0 and committed there.

Nodes that share no filesystem. Each save checks whether every rank sees the temporary directory rank 0
made. When some do not, the nodes have separate disks: every node's first process (LOCAL_RANK 0) makes
the same temporary directory on its own disk, its ranks write their files there as usual (RNG states,
DCP shards: torch.distributed.checkpoint's FileSystemWriter names each rank's file apart), and after a
barrier each node uploads what it staged to `<remote_dir>/checkpoints/step-N/`. Rank 0 gathers every
node's file sizes and SHA-256 (hashed where the files are, by the node that wrote them), writes the
manifest of them all, uploads it and commits the checkpoint with the store's marker, last; then it
prunes the store to `keep_last`, and each node removes its staging directory (the store holds the
checkpoints). Per-node staging, rather than DCP's fsspec writer straight into the store, keeps one
layout for every strategy (the DDP torch files, DCP shards, DeepSpeed's partitions), lets the manifest
be hashed on local disks in parallel, and needs no rename in the store, which object stores lack. Without
`remote_dir` such a run stops at its first checkpoint, naming the fix. Resume
(`tigon.runtime.storage.resume_point`) downloads the picked checkpoint whole onto every node that lacks
it, so DCP can also reshard it for another world size.

Asynchronous saves (`checkpoint.async_save`, FSDP2): `begin_checkpoint` writes the RNG states and starts
the strategy's writer, which copies the shards to CPU memory and writes them in a background thread
(torch.distributed.checkpoint.async_save over its own gloo group); training goes on. `finish`, called
before the next save and at the end of the run, waits for the write and only then writes state.json and
the manifest, renames and uploads, so a run killed meanwhile resumes from the previous checkpoint.

Resume (`resume_checkpoint`) verifies the manifest of the newest checkpoint (sizes, then checksums)
and falls back to the newest one that verifies, naming what is wrong with each it skips; a skipped
checkpoint is renamed `damaged-step-N`, kept for inspection. Before writing, the free space is
checked against the previous checkpoint's size (or an estimate of the state), and with
`keep_last` of 2 or more the oldest checkpoint is removed first, so the run needs room for no more
than `keep_last` checkpoints.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tigon.runtime.distributed import DistEnv, all_gather_object, barrier, broadcast_object, unwrap
from tigon.runtime.files import atomic_write_text
from tigon.runtime.optim import load_schedule
from tigon.runtime.quantization import is_quantized, merge_into_dense

if TYPE_CHECKING:
    from tigon.runtime.storage import RunStorage

logger = logging.getLogger("tigon.runtime")

CHECKPOINTS = "checkpoints"
EXPORT = "export"
STATE_FILE = "state.json"
MANIFEST = "manifest.json"
DAMAGED_PREFIX = "damaged-"
GIB = 1024**3


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written (no space) or resumed from (damaged); the message names the fix."""


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
    global_batch: int = 0  # sequences an optimizer step trains (0: written before checkpoints recorded it)


# ---------------------------------------------------------------- atomic directories


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


# ---------------------------------------------------------------- manifests: what a whole checkpoint holds


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(8 * 1024 * 1024):
            digest.update(block)
    return digest.hexdigest()


def _digests(directory: Path, names: list[str]) -> dict[str, str]:
    """Checksums of several files at once (hashlib releases the GIL, so the threads share the cores)."""
    with ThreadPoolExecutor(max_workers=min(8, len(names) or 1)) as pool:
        return dict(zip(names, pool.map(lambda name: file_sha256(directory / name), names), strict=True))


def manifest_entries(directory: Path, names: list[str]) -> dict[str, dict]:
    """The manifest's entries for some files of a directory: each one's size and SHA-256."""
    digests = _digests(directory, names)
    return {name: {"size": (directory / name).stat().st_size, "sha256": digests[name]} for name in names}


def write_manifest(directory: Path) -> dict:
    """List every file of a checkpoint directory with its size and SHA-256 in `manifest.json` (call last)."""
    paths = [p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST]
    files = manifest_entries(directory, sorted(p.relative_to(directory).as_posix() for p in paths))
    manifest = {"files": files, "bytes": sum(entry["size"] for entry in files.values())}
    atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def read_manifest(directory: Path) -> dict:
    """The manifest of a checkpoint; CheckpointError when it is missing or unreadable."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{MANIFEST} is missing (a checkpoint never finished, or written before manifests)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict) or not all({"size", "sha256"} <= set(entry) for entry in files.values()):
            raise ValueError("an entry lacks its size or sha256")
        return manifest
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{MANIFEST} is damaged ({error})") from None


def verify_checkpoint(directory: str | Path) -> list[str]:
    """What is wrong with a checkpoint, one line per file (missing, truncated, resized, corrupted); [] when whole."""
    directory = Path(directory)
    try:
        files = read_manifest(directory)["files"]
    except CheckpointError as error:
        return [str(error)]
    problems, intact = [], []
    for name, entry in files.items():
        path = directory / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif (size := path.stat().st_size) < entry["size"]:
            problems.append(f"{name} is truncated ({size} of {entry['size']} bytes)")
        elif size != entry["size"]:
            problems.append(f"{name} has {size} bytes, its manifest says {entry['size']}")
        else:
            intact.append(name)
    for name, digest in _digests(directory, intact).items():
        if digest != files[name]["sha256"]:
            problems.append(f"{name} is corrupted (its SHA-256 differs from the manifest's)")
    return problems


def checkpoint_bytes(directory: Path) -> int:
    """Bytes a checkpoint takes on disk (its manifest's total, else the files' sizes)."""
    try:
        return int(read_manifest(directory)["bytes"])
    except (CheckpointError, KeyError, ValueError):
        return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


# ---------------------------------------------------------------- resume: the newest checkpoint that verifies


def clean_temporaries(run_dir: str | Path) -> list[Path]:
    """Remove what a run killed mid-write left behind: temporary checkpoint, download and export directories and
    temporary files. Call only while holding the run directory (tigon.runtime.lock); returns what was removed."""
    run_dir = Path(run_dir)
    stale = []
    root = checkpoint_root(run_dir)
    if root.is_dir():
        stale += [entry for entry in root.iterdir() if entry.name.startswith(".")]
    if run_dir.is_dir():
        stale += [
            entry
            for entry in run_dir.iterdir()
            if entry.name.startswith((".tmp-", ".old-")) or (entry.name.startswith(".") and entry.name.endswith(".tmp"))
        ]
    for entry in stale:
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    if stale:
        logger.warning("removed what an interrupted run left: %s", ", ".join(map(str, stale)))
    return stale


def _pick_checkpoint(run_dir: Path) -> tuple[Path | None, str | None]:
    """(the newest checkpoint that verifies, an error when checkpoints exist but none verifies); rank 0 only.

    Each damaged checkpoint newer than the one picked is renamed `damaged-step-N`, with a warning naming what is
    wrong, so that it is neither resumed from nor counted among the kept checkpoints. A checkpoint with no manifest
    at all was written before manifests existed (a checkpoint is renamed into place whole, manifest included): it is
    taken unverified, with a warning."""
    damaged = []
    for step, path in reversed(list_checkpoints(run_dir)):
        if not (path / MANIFEST).exists():  # renamed into place whole, by a version that wrote no manifest
            logger.warning(
                "%s has no %s (written before checkpoints had one); resuming from it unverified", path, MANIFEST
            )
            return path, None
        problems = verify_checkpoint(path)
        if not problems:
            if damaged:
                logger.warning("resuming from %s, the newest checkpoint that verifies", path)
            return path, None
        aside = path.with_name(f"{DAMAGED_PREFIX}{path.name}")
        shutil.rmtree(aside, ignore_errors=True)
        os.replace(path, aside)
        damaged.append(f"step {step}: {'; '.join(problems)}")
        logger.warning(
            "checkpoint %s is damaged (%s); moved it to %s (delete it once inspected)", path, "; ".join(problems), aside
        )
    if not damaged:
        return None, None
    return None, (
        f"no checkpoint in {checkpoint_root(run_dir)} verifies against its manifest: "
        + " | ".join(damaged)
        + f". They were renamed {DAMAGED_PREFIX}step-N. To start over, set checkpoint.resume: false; to resume, "
        "restore a whole checkpoint (e.g. from checkpoint.remote_dir) into that directory"
    )


def resume_checkpoint(run_dir: str | Path, env: DistEnv) -> Path | None:
    """The checkpoint to resume from, the same on every rank (call on all): rank 0 verifies the newest and falls
    back to older ones; None when the run directory holds none. Raises CheckpointError when none verifies."""
    picked, error = _pick_checkpoint(Path(run_dir)) if env.is_main else (None, None)
    name, error = broadcast_object((picked.name if picked else None, error), env)  # each node's own run_dir
    if error is not None:
        raise CheckpointError(error)
    return checkpoint_root(run_dir) / name if name else None


# ---------------------------------------------------------------- writing


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint: first renamed out of the listing (a dot name, which the next start removes), so a run
    killed while deleting it leaves no half checkpoint under a `step-N` name."""
    doomed = path.with_name(f".prune-{path.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def free_space_problem(directory: Path, needed: int) -> str | None:
    """Why `needed` bytes do not fit in `directory`'s filesystem, or None when they do."""
    free = shutil.disk_usage(directory).free
    if needed <= free:
        return None
    return (
        f"not enough disk space for a checkpoint in {directory}: it needs about {needed / GIB:.2f} GiB "
        f"({needed} bytes), {free / GIB:.2f} GiB ({free} bytes) is free; free space there, lower "
        "checkpoint.keep_last, or point logging.run_dir at a larger disk"
    )


def _disk_full(error: BaseException, directory: Path) -> bool:
    """True when a failed write ran out of space (torch's writer reports it as a RuntimeError without errno)."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return shutil.disk_usage(directory).free < 16 * 1024 * 1024


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
    write_state: Callable[[Path], Future | None] | None = None,
    estimated_bytes: int = 0,
    remote: RunStorage | None = None,
) -> Path:
    """Write `step-N` atomically on every rank's behalf (call on all ranks); prune to `keep_last`.

    `write_state(directory)` runs on every rank and writes the model and optimizer state there (a sharded
    strategy's own format); by default rank 0 writes the torch files of `write_torch_state`. Before writing, with
    `keep_last` >= 2, the oldest checkpoints are removed down to `keep_last - 1`, and the free space is checked
    against the newest checkpoint's size (`estimated_bytes` when there is none); CheckpointError when it lacks.
    With `remote` (the run's RunStorage) the checkpoint is also committed there (see the module docstring).
    """
    write = write_state or (lambda directory: write_torch_state(directory, model, optimizer, scheduler, env, scaler))
    pending = begin_checkpoint(run_dir, state, env, keep_last, write, config_json, estimated_bytes, remote)
    return pending.finish()


def begin_checkpoint(
    run_dir: str | Path,
    state: TrainState,
    env: DistEnv,
    keep_last: int,
    write_state: Callable[[Path], Future | None],
    config_json: str | None = None,
    estimated_bytes: int = 0,
    remote: RunStorage | None = None,
) -> PendingCheckpoint:
    """Start `step-N` (call on all ranks): prepare the temporary directory, write each rank's RNG state, and start
    `write_state`, which returns a Future when it writes in the background (`checkpoint.async_save`). The
    checkpoint exists once `finish()` returns; until then the previous one is the newest."""
    root = checkpoint_root(run_dir)
    temporary = root / f".tmp-step-{state.step}"
    problem = None
    if env.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temporary, ignore_errors=True)
        earlier = [path for step, path in list_checkpoints(run_dir) if step != state.step]
        if keep_last > 1:  # the newest stays until the new one is whole
            for old in earlier[: -(keep_last - 1)]:
                remove_checkpoint(old)
        needed = checkpoint_bytes(earlier[-1]) if earlier else estimated_bytes
        problem = free_space_problem(root, needed)
        if problem is None:
            temporary.mkdir()
    problem = broadcast_object(problem, env)
    if problem is not None:
        raise CheckpointError(problem)
    pending = PendingCheckpoint(run_dir, state, env, keep_last, config_json, remote)
    pending.node_local = _staging_is_node_local(pending, env, remote)
    try:
        torch.save(rng_state(), temporary / f"rng-rank{env.rank}.pt")
        pending.writing = write_state(temporary)
    except Exception as error:
        pending.fail(error)
    return pending


def ranks_not_seeing(path: Path, env: DistEnv) -> list[int]:
    """The ranks that do not see `path`, which rank 0 made before the call (call on all ranks); [] when the
    filesystem there is shared."""
    barrier(env)
    return [rank for rank, seen in enumerate(all_gather_object(path.exists(), env)) if not seen]


def _staging_is_node_local(pending: PendingCheckpoint, env: DistEnv, remote: RunStorage | None) -> bool:
    """Whether the nodes do not share the run directory: some rank does not see the temporary directory rank 0
    made. Then each node stages its ranks' files on its own disk and `remote` joins them; without one, the run
    stops with the fix."""
    if not env.distributed:
        return False
    temporary = pending.temporary
    blind = ranks_not_seeing(temporary, env)
    if not blind:
        return False
    if remote is None:
        if env.is_main:
            shutil.rmtree(temporary, ignore_errors=True)
        raise CheckpointError(
            f"ranks {blind} do not see {temporary.parent}, which rank 0 writes checkpoints to: the nodes share no "
            "filesystem there. Set checkpoint.remote_dir to an object store every node reaches (s3://, gs://, ...), "
            "which the nodes then write their checkpoint shards to and resume from, or put logging.run_dir on a "
            "filesystem every node mounts"
        )
    if env.is_node_leader and not env.is_main:
        root = temporary.parent
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-step-*"):  # what a killed run staged on this node
            shutil.rmtree(stale, ignore_errors=True)
        temporary.mkdir()
    barrier(env)
    return True


class PendingCheckpoint:
    """A checkpoint being written into its temporary directory; `finish` (on every rank) completes it."""

    def __init__(
        self,
        run_dir: str | Path,
        state: TrainState,
        env: DistEnv,
        keep_last: int,
        config_json: str | None,
        remote: RunStorage | None,
    ):
        self.run_dir, self.env, self.keep_last = run_dir, env, keep_last
        self.config_json, self.remote = config_json, remote
        self.step = state.step
        self.state_json = json.dumps(asdict(state), indent=1)  # as it stands now: training goes on meanwhile
        self.root = checkpoint_root(run_dir)
        self.temporary = self.root / f".tmp-step-{state.step}"
        self.final = self.root / f"step-{state.step}"
        self.node_local = False
        self.writing: Future | None = None

    def finish(self) -> Path:
        """Wait for the state's writes on every rank, then write state.json and the manifest (rank 0), rename the
        checkpoint into place, prune to `keep_last` and upload it: on the shared run directory, or, when the
        nodes share none, straight from each node's staging directory to the object store."""
        env = self.env
        try:
            if self.writing is not None:
                self.writing.result()
            barrier(env)
            if env.is_main:
                if self.config_json is not None:
                    atomic_write_text(self.temporary / "config.json", self.config_json)
                atomic_write_text(self.temporary / STATE_FILE, self.state_json)
            if self.node_local:
                self._commit_from_nodes()
            elif env.is_main:
                write_manifest(self.temporary)  # last: it vouches for every file above
        except Exception as error:
            self.fail(error)
        if self.node_local:
            barrier(env)
            return self.final
        if env.is_main:
            replace_dir(self.temporary, self.final)
            for _, old in list_checkpoints(self.run_dir)[: -self.keep_last]:
                remove_checkpoint(old)
            logger.info("checkpoint written: %s", self.final)
        barrier(env)
        if env.is_main and self.remote is not None:
            self.remote.upload_checkpoint(self.final, self.keep_last)
        return self.final

    def _commit_from_nodes(self) -> None:
        """Every node uploads the files it staged; rank 0 then writes the manifest of them all and commits the
        checkpoint in the store; each node removes its staging directory (the store holds the checkpoint)."""
        env, remote, parts = self.env, self.remote, (CHECKPOINTS, self.final.name)
        entries = {}
        if env.is_node_leader:
            names = sorted(p.relative_to(self.temporary).as_posix() for p in self.temporary.rglob("*") if p.is_file())
            entries = manifest_entries(self.temporary, names)
        merged: dict[str, dict] = {}
        for node_entries in all_gather_object(entries, env):
            for name, entry in node_entries.items():
                if merged.setdefault(name, entry) != entry:
                    raise CheckpointError(f"two nodes wrote {name} of checkpoint step-{self.step} with different bytes")
        self._on_all(env.is_main, lambda: remote.uncommit(*parts), "clearing")  # an earlier upload of this step
        self._on_all(
            env.is_node_leader, lambda: remote.upload_files(self.temporary, sorted(entries), *parts), "uploading"
        )
        self._on_all(env.is_main, lambda: self._commit_manifest(merged), "committing")
        if env.is_node_leader:
            shutil.rmtree(self.temporary, ignore_errors=True)
            for _, downloaded in list_checkpoints(self.run_dir):  # resume's copies: the store holds newer ones
                remove_checkpoint(downloaded)

    def _on_all(self, here: bool, call: Callable[[], object], doing: str) -> None:
        """`call()` on the ranks where `here` is true, then a CheckpointError on every rank if it failed on any
        (so that no rank waits forever for one that stopped)."""
        problem = None
        if here:
            try:
                call()
            except Exception as error:
                problem = f"node {self.env.group_rank}: {type(error).__name__}: {error}"
        problems = [entry for entry in all_gather_object(problem, self.env) if entry]
        if problems:
            raise CheckpointError(
                f"{doing} checkpoint step-{self.step} in {self.remote.url} failed: {'; '.join(problems)}"
            )

    def _commit_manifest(self, files: dict[str, dict]) -> None:
        """Rank 0: upload the manifest of every node's files, commit the checkpoint in the store, prune it."""
        remote, parts = self.remote, (CHECKPOINTS, self.final.name)
        manifest = {"files": files, "bytes": sum(entry["size"] for entry in files.values())}
        atomic_write_text(self.temporary / MANIFEST, json.dumps(manifest, indent=1))
        remote.upload_files(self.temporary, [MANIFEST], *parts)
        sizes = {name: entry["size"] for name, entry in files.items()}
        remote.commit({**sizes, MANIFEST: (self.temporary / MANIFEST).stat().st_size}, *parts)
        remote.prune_checkpoints(self.keep_last)
        logger.info("checkpoint written from every node to %s", remote.url)

    def fail(self, error: Exception) -> None:
        """Remove the temporary directory and raise: CheckpointError with the fix when the disk filled up."""
        if self.env.is_main or (self.node_local and self.env.is_node_leader):
            shutil.rmtree(self.temporary, ignore_errors=True)
        if _disk_full(error, self.root):
            raise CheckpointError(
                f"the disk of {self.root} filled up while writing checkpoint step-{self.step} "
                f"({shutil.disk_usage(self.root).free} bytes free); the partial checkpoint was removed. Free space "
                "there, lower checkpoint.keep_last, or point logging.run_dir at a larger disk"
            ) from error
        raise error


LAYOUTS = {"model.pt": "ddp", "dcp": "fsdp", "deepspeed": "deepspeed"}


def require_layout(directory: Path, entry: str, strategy: str) -> None:
    """Fail clearly when a checkpoint lacks the model state `strategy` reads (`entry`): written by another strategy
    (another layout is there), or damaged (nothing is)."""
    if (directory / entry).exists():
        return
    others = [f"{name} ({LAYOUTS[name]})" for name in LAYOUTS if name != entry and (directory / name).exists()]
    if others:
        raise CheckpointError(
            f"{directory} has no {entry}: it holds {', '.join(others)}, written by another parallelism.strategy; "
            "resume with that strategy, or set checkpoint.resume: false to start over"
        )
    raise CheckpointError(
        f"{directory} has no {entry} (parallelism.strategy {strategy}'s model state) and no other strategy's: the "
        "checkpoint is damaged; delete it to resume from an earlier one, or set checkpoint.resume: false to start over"
    )


def read_torch_state(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, scaler=None
) -> None:
    """Restore what `write_torch_state` wrote."""
    require_layout(directory, "model.pt", "ddp")
    saved = torch.load(directory / "model.pt", map_location="cpu", weights_only=True)
    target = unwrap(model)
    result = target.load_state_dict(saved["weights"], strict=not saved["partial"])
    if result.unexpected_keys:
        raise RuntimeError(
            f"checkpoint {directory} does not fit this model: unexpected keys {result.unexpected_keys[:5]}"
        )
    optimizer.load_state_dict(torch.load(directory / "optimizer.pt", map_location="cpu", weights_only=True))
    schedule = torch.load(directory / "scheduler.pt", map_location="cpu", weights_only=True)
    load_schedule(scheduler, schedule["scheduler"])
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
        if is_quantized(model):  # QLoRA: merged into dequantized weights, in the dtype of the unquantized ones
            model = merge_into_dense(model, model.get_input_embeddings().weight.dtype)
        else:
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
