"""A training run's pieces that every trainer shares: the checks, `prepare`, resuming or starting over, the
step plan, and `finish` (the export, the result, the summary and the Hub push).

    config = keep_global_batch(config, world_size)   # a resume on another number of processes
    prepared = prepare(config)                       # process group, tokenizer, data, model
    total_steps, per_epoch = plan_steps(config, len(prepared.train_dataset), prepared.env.world_size)
    result = finish(config, prepared, strategy, state, remote, reporter, loop, resumed_from, config_json)

The torch trainer (`tigon.runtime.torch_trainer`) and the HF Trainer and Lightning adapters build on these, so
the three check, prepare, resume and report a run alike.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import ValidationError
from torch import nn

from tigon.runtime import checkpoint as ckpt
from tigon.runtime import storage
from tigon.runtime.config import ConfigError, RunConfig, TrainingConfig
from tigon.runtime.data import build_datasets, check_labels
from tigon.runtime.distributed import (
    DistEnv,
    barrier,
    broadcast_object,
    check_strategy,
    init_distributed,
    shard_ranks,
)
from tigon.runtime.hub import fetch_model
from tigon.runtime.model import build_model, check_model_config
from tigon.runtime.objectives import check_objective, state_of
from tigon.runtime.packed import load_packed
from tigon.runtime.preference_data import build_preference_datasets
from tigon.runtime.publish import check_push, data_fingerprint, publish
from tigon.runtime.quantization import check_quantized_base
from tigon.runtime.reporting import SUMMARY_FILE, Reporter, final_values, memory_bytes, summary_text, write_summary
from tigon.runtime.tokenizer import load_tokenizer
from tigon.runtime.trackers import check_trackers

logger = logging.getLogger("tigon.runtime")


@dataclass
class TrainResult:
    """What a finished run did and where it wrote things."""

    run_dir: str
    steps: int
    losses: list[float]  # one per optimizer step, from step 1 (a resumed run includes the earlier steps)
    final_loss: float | None
    eval_metrics: dict[str, float]  # the last evaluation
    export_dir: str | None
    tokens_per_second: float
    peak_memory_bytes: int
    resumed_from_step: int | None = None
    eval_history: list[dict] = field(default_factory=list)
    device: str = "cpu"
    world_size: int = 1
    checkpoint_dir: str | None = None
    tensorboard_dir: str | None = None
    train_seconds: float = 0.0
    kernels: str | None = None
    data_manifest: dict | None = None  # the packed data's manifest when the run was given `datasets` (not tokenized)
    export_url: str | None = None  # the export's copy under checkpoint.remote_dir
    profile: dict | None = None  # logging.profile_step's step, by kind of kernel (tigon.runtime.profiling)
    hub_url: str | None = None  # the commit that checkpoint.push_to_hub made
    objective_metrics: dict | None = None  # a preference objective's last step: rewards/chosen, ... (TRL's names)


@dataclass
class Prepared:
    """Everything built before the first step; what another trainer adapter would start from."""

    env: DistEnv
    device: torch.device
    tokenizer: object
    train_dataset: object
    eval_dataset: object
    data_summary: object
    model: nn.Module  # unwrapped, on the device (on the meta device for FSDP2's ranks but 0, until sharded)
    eval_examples: list[tuple[list[int], str]] | None = None  # tokenized eval prompts, when given pre-packed data
    data_manifest: dict | None = None  # the pre-packed data's manifest (fingerprint, tokenizer)


def prepare(config: RunConfig, datasets: str | Path | None = None) -> Prepared:
    """Process group, seeded tokenizer, datasets and model (on its device).

    `datasets`: a directory written by `tigon.runtime.packed.save_packed`; its arrays are used as they are
    (checked against the run's tokenizer) instead of tokenizing and packing the data again.
    """
    validate_for_torch_trainer(config)
    env, device = init_distributed(config)
    shard_ranks(config, env)  # a shard size that does not divide the ranks fails before anything is built
    fetch_model(config.model, env)  # one download per node, before any model is built
    check_push(config)
    check_trackers(config)
    seed_everything(config.training.seed, config.training.deterministic)
    tokenizer = load_tokenizer(config.model)
    examples = manifest = None
    if datasets is not None:
        packed = load_packed(datasets, tokenizer)
        prepared_for = packed.manifest.get("objective", "sft")
        next_token = {prepared_for, config.objective.type} <= {"sft", "distill"}  # the same packed sequences
        if prepared_for != config.objective.type and not next_token:
            raise ConfigError(
                f"the data in {datasets} was prepared for objective.type {prepared_for!r}, not "
                f"{config.objective.type!r}; prepare it again with this config"
            )
        train_dataset, eval_dataset, data_summary = packed.train, packed.eval, packed.summary
        examples, manifest = packed.eval_examples, packed.manifest
    elif config.objective.preference:
        train_dataset, eval_dataset, data_summary = build_preference_datasets(config, tokenizer)
    else:
        train_dataset, eval_dataset, data_summary = build_datasets(config, tokenizer)
    if env.is_main:
        logger.info("data: %s", data_summary)
    # FSDP2: only rank 0 builds (or loads) the whole model; the others build its shapes on the meta device and
    # receive rank 0's weights once it is sharded (parallel.receive_rank0_weights).
    meta = config.parallelism.strategy == "fsdp" and env.distributed and not env.is_main
    started = time.perf_counter()
    model = build_model(config, len(tokenizer), tokenizer, meta=meta, device=device, labels_checked=True)
    if not meta:
        model = model.to(device)
    if env.is_main:
        logger.info("model: built on %s in %.1f s", device, time.perf_counter() - started)
    head = model.get_output_embeddings()
    check_labels((train_dataset, eval_dataset), len(tokenizer) if head is None else head.weight.shape[0])
    return Prepared(env, device, tokenizer, train_dataset, eval_dataset, data_summary, model, examples, manifest)


def validate_for_torch_trainer(config: RunConfig) -> None:
    """Settings the plain PyTorch trainer cannot honour, named with the fix."""
    if config.trainer != "torch":
        raise ConfigError(f"trainer: {config.trainer!r} is not yet available in this build; use 'torch'")
    check_config(config)


def check_config(config: RunConfig) -> None:
    """Settings that cannot run together, named with the fix: checked before anything is built, by every trainer
    and by `tigon submit` on the laptop (through `check_submission`)."""
    check_strategy(config)
    check_quantized_base(config)
    check_model_config(config)
    check_objective(config)
    if config.training.precision == "fp16" and config.model.dtype == "float16":
        raise ConfigError(
            "training.precision fp16 with model.dtype float16: the gradient scaler needs float32 master weights; "
            "set model.dtype: float32 (autocast runs the forward in fp16) or use bf16"
        )
    if "exact_match" in config.eval.metrics and config.data.format == "text":
        raise ConfigError(
            "eval.metrics: 'exact_match' needs data.format 'instruction' or 'chat' (a prompt to answer); "
            "with 'text' use ['loss']"
        )
    if config.data.eval is None and config.data.eval_split is None and config.eval.every_steps > 0:
        raise ConfigError(
            "eval.every_steps is set but data.eval is not: add held-out data (data.eval or data.eval_split) or set "
            "every_steps: 0"
        )


def non_finite_loss_message(loss: float, step: int, config: RunConfig) -> str:
    """Why a loss may have become NaN or infinite, for the precision the run uses, with the fixes."""
    advice = "lower training.learning_rate"
    if config.training.max_grad_norm is None:
        advice += ", set training.max_grad_norm (e.g. 1.0)"
    if config.training.precision == "fp16" or config.model.dtype == "float16":
        advice += ", or use bf16 instead of fp16 (its range is float32's)"
    else:
        advice += (
            f", raise training.warmup_steps (now {config.training.warmup_steps}), or check the data for extreme "
            "values; the run is not in fp16, so this is not an fp16 overflow"
        )
    return f"the loss became {loss} at step {step}; {advice}"


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed every generator; with `deterministic`, also choose PyTorch's deterministic kernels, so a resumed or
    repeated run on a GPU reproduces each step's loss (non-deterministic ones reduce in a varying order)."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS reduces in a fixed order with it
        torch.use_deterministic_algorithms(True)  # strict: flash attention's backward turns deterministic only so
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN attention's backward has no deterministic mode


RESUME_SECTIONS = ("model", "data", "lora")
# Where downloads are cached, which exact attention computes the same function, and how a global batch's rows are
# dealt to micro-batches do not change a run: a resumed run may change them.
RESUME_IGNORED = {"model": {"cache_dir", "attn_implementation"}, "data": {"cache_dir", "balance_micro_batches"}}
# Fields whose default changed: a checkpoint written before the field existed ran with the value given here.
EARLIER_DEFAULTS = {"data": {"packing_strategy": "in_order"}}


def _resume_section(section: dict | None, name: str) -> dict | None:
    """A saved or current config section as resuming compares it: defaults filled in (a checkpoint written before a
    field existed has its default, or the earlier one of EARLIER_DEFAULTS), download caches left out."""
    if isinstance(section, dict):
        section = {**EARLIER_DEFAULTS.get(name, {}), **section}
    try:
        section = RunConfig.model_fields[name].annotation.model_validate(section).model_dump(mode="json")
    except ValidationError:
        pass
    if isinstance(section, dict):
        section = {key: value for key, value in section.items() if key not in RESUME_IGNORED.get(name, ())}
    return section


def check_resumable(checkpoint_dir: Path, config: RunConfig) -> None:
    """Refuse to resume a checkpoint of a different run (another model, data or adapters) with a clear message."""
    saved_file = checkpoint_dir / "config.json"
    if not saved_file.is_file():
        return
    saved = json.loads(saved_file.read_text())
    current = json.loads(config.model_dump_json())
    differing, fields = [], []
    for name in RESUME_SECTIONS:
        before, now = _resume_section(saved.get(name), name), _resume_section(current[name], name)
        if before == now:
            continue
        differing.append(name)
        if isinstance(before, dict) and isinstance(now, dict):
            keys = sorted(key for key in before.keys() | now.keys() if before.get(key) != now.get(key))
            fields += [f"{name}.{key}: {before.get(key)!r} there, {now.get(key)!r} here" for key in keys]
    if differing:
        raise ConfigError(
            f"checkpoint.resume: {checkpoint_dir} belongs to a run with different {', '.join(differing)} settings; "
            "use another logging.run_dir, or set checkpoint.resume: false to start over there"
            + (f" ({'; '.join(fields)})" if fields else "")
        )


def saved_global_batch(config: RunConfig) -> tuple[int, int] | None:
    """(global batch, processes) of the run's newest checkpoint, in `logging.run_dir` or else in
    `checkpoint.remote_dir`; None without one. A checkpoint written before the global batch was recorded gives
    its processes times its config's micro-batch and accumulation."""
    local = ckpt.list_checkpoints(config.logging.run_dir)
    if local:
        directory = local[-1][1]
        check_resumable(directory, config)  # another run's checkpoint is named as such first

        def read(name: str) -> str | None:
            path = directory / name
            return path.read_text() if path.is_file() else None

    else:
        store = storage.run_storage(config.checkpoint.remote_dir)
        steps = store.checkpoint_steps() if store is not None else []
        if not steps:
            return None
        read = functools.partial(store.read_text, ckpt.CHECKPOINTS, f"step-{steps[-1]}")
    state = json.loads(read(ckpt.STATE_FILE) or "{}")
    world_size = state.get("world_size", 1)
    if state.get("global_batch"):
        return state["global_batch"], world_size
    saved = read("config.json")
    if saved is None:
        return None
    training = TrainingConfig.model_validate(json.loads(saved)["training"])
    return training.global_batch(world_size), world_size


def keep_global_batch(config: RunConfig, world_size: int) -> RunConfig:
    """`config` for a run that resumes a checkpoint written by another number of processes, with its gradient
    accumulation (and, where the accumulation alone cannot, its micro-batch) set so that a step trains the
    checkpoint's global batch: the data position counts global batches, so the run continues on the same
    sequences and steps, as the uninterrupted run would have. Unchanged when nothing is resumed or the global
    batch already matches; a ConfigError where the global batch does not split over `world_size` processes, where
    DeepSpeed's partitions cannot move, or where the config changed the global batch itself. Call on every rank,
    before the planner (which keeps the global batch it is given)."""
    saved = saved_global_batch(config) if config.checkpoint.resume else None
    training = config.training
    if saved is None or training.global_batch(world_size) == saved[0]:
        return config
    batch, saved_world = saved
    if saved_world == world_size:
        raise ConfigError(
            f"checkpoint.resume: the checkpoint in {config.logging.run_dir} trained global batches of {batch} "
            f"sequences, and this config's are {training.global_batch(world_size)} (training.micro_batch_size x "
            f"gradient_accumulation_steps x {world_size} processes); its data position counts global batches, so "
            f"set micro_batch_size x gradient_accumulation_steps to {batch // world_size}, or start a new run in "
            "another logging.run_dir"
        )
    if config.parallelism.strategy == "deepspeed":
        raise ConfigError(
            f"checkpoint.resume: the checkpoint in {config.logging.run_dir} was written by {saved_world} processes "
            f"and this run has {world_size}; DeepSpeed's ZeRO partitions of the optimizer state load only on the "
            f"number of processes that wrote them: resume on {saved_world} processes, or train with "
            "parallelism.strategy fsdp, whose checkpoints reshard to any number"
        )
    if batch % world_size:
        fits = [n for n in range(1, batch + 1) if batch % n == 0]
        raise ConfigError(
            f"checkpoint.resume: the checkpoint's global batch of {batch} sequences (written by {saved_world} "
            f"processes) does not split evenly over {world_size} processes; resume on one of {fits} processes"
        )
    per_rank = batch // world_size
    micro = max(n for n in range(1, min(training.micro_batch_size, per_rank) + 1) if per_rank % n == 0)
    accumulation = per_rank // micro
    logger.info(
        "resuming on %d processes a run written by %d: micro-batch %d x accumulation %d (was %d x %d) keeps its "
        "global batch of %d sequences",
        world_size,
        saved_world,
        micro,
        accumulation,
        training.micro_batch_size,
        training.gradient_accumulation_steps,
        batch,
    )
    kept = training.model_copy(update={"micro_batch_size": micro, "gradient_accumulation_steps": accumulation})
    return config.model_copy(update={"training": kept})


def start_over(config: RunConfig, env: DistEnv, remote) -> None:
    """Without resume: remove the run directory's (and remote_dir's) earlier checkpoints and summary, on rank 0.

    A finished run's (one that wrote summary.json, or whose export is in remote_dir) are removed only with
    checkpoint.overwrite; otherwise every rank raises a ConfigError saying so. Call on every rank."""
    run_dir = Path(config.logging.run_dir)
    stale = ckpt.checkpoint_root(run_dir)
    problem = None
    if env.is_main:
        held = ckpt.list_checkpoints(run_dir) or (remote is not None and remote.checkpoint_steps())
        finished = (run_dir / SUMMARY_FILE).is_file() or (remote is not None and remote.committed(ckpt.EXPORT))
        if held and finished and not config.checkpoint.overwrite:
            problem = (
                f"checkpoint.resume is false, but logging.run_dir {run_dir} holds a finished run's checkpoints, which "
                "starting over would delete: set checkpoint.resume: true to continue it, use another "
                "logging.run_dir, or set checkpoint.overwrite: true to delete them"
            )
    problem = broadcast_object(problem, env)
    if problem is not None:
        raise ConfigError(problem)
    if env.is_main:
        if stale.is_dir():
            logger.warning("starting over (checkpoint.resume: false): removing the earlier checkpoints in %s", stale)
            shutil.rmtree(stale)
        (run_dir / SUMMARY_FILE).unlink(missing_ok=True)
        if remote is not None:
            remote.clear_checkpoints()


def plan_steps(config: RunConfig, n_sequences: int, world_size: int, warn: bool = True) -> tuple[int, int]:
    """(optimizer steps in the run, global batches per epoch); `warn` (rank 0) logs a warmup longer than the run,
    which a shortened smoke run of a real config may mean on purpose."""
    training = config.training
    global_batch = training.global_batch(world_size)
    per_epoch = n_sequences // global_batch
    if per_epoch == 0:
        raise ConfigError(
            f"data.train: {n_sequences} training sequences of {config.data.max_seq_len} tokens fill no global batch of "
            f"{global_batch} (training.micro_batch_size x gradient_accumulation_steps x {world_size} processes); "
            "lower those, shorten data.max_seq_len, or add data"
        )
    total = max(1, training.max_steps if training.max_steps is not None else math.ceil(training.epochs * per_epoch))
    if warn and training.warmup_steps > total:
        logger.warning(
            "training.warmup_steps (%d) is longer than the run (%d steps): the learning rate ends at %.0f%% of "
            "training.learning_rate and never reaches it; lower warmup_steps to at most %d for a full schedule",
            training.warmup_steps,
            total,
            100 * total / training.warmup_steps,
            total,
        )
    return total, per_epoch


@dataclass
class LoopResult:
    """What the step loop measured, for the run's result."""

    train_seconds: float
    tokens: int
    profile: dict | None


def finish(
    config: RunConfig,
    prepared: Prepared,
    strategy,
    state: ckpt.TrainState,
    remote,
    reporter: Reporter,
    run: LoopResult,
    resumed_from: int | None,
    config_json: str,
) -> TrainResult:
    """Export (every rank), then the run's result, summary, plots and Hub push (rank 0)."""
    env, device, tokenizer = prepared.env, prepared.device, prepared.tokenizer
    run_dir = Path(config.logging.run_dir)
    train_seconds, tokens_this_run, profile = run.train_seconds, run.tokens, run.profile
    export_dir = export_url = None
    if config.checkpoint.export:
        exported = strategy.export(tokenizer, run_dir / ckpt.EXPORT, config.checkpoint.merge_lora)  # every rank
        if env.is_main:
            export_dir = str(exported)
            if remote is not None:
                export_url = remote.upload_export(export_dir)
        barrier(env)

    latest = ckpt.latest_checkpoint(run_dir)
    patch = getattr(prepared.model, "tigon_patch_report", None)
    result = TrainResult(
        run_dir=str(run_dir),
        steps=state.step,
        losses=list(state.losses),
        final_loss=state.losses[-1] if state.losses else None,
        eval_metrics={k: v for k, v in (state.eval_history[-1] if state.eval_history else {}).items() if k != "step"},
        export_dir=export_dir,
        tokens_per_second=tokens_this_run / train_seconds if train_seconds > 0 else 0.0,
        peak_memory_bytes=memory_bytes(device),
        resumed_from_step=resumed_from,
        eval_history=list(state.eval_history),
        device=str(device),
        world_size=env.world_size,
        checkpoint_dir=str(latest) if latest is not None else None,
        tensorboard_dir=str(run_dir / "tensorboard") if "tensorboard" in config.logging.active_trackers else None,
        train_seconds=train_seconds,
        kernels=str(patch) if patch is not None else None,
        data_manifest=prepared.data_manifest,
        export_url=export_url,
        profile=profile,
        objective_metrics=dict(state_of(strategy.model).metrics) or None,
    )
    if env.is_main:
        reporter.plot(result.losses, result.eval_history)
        write_summary(run_dir, {**result.__dict__, "config": json.loads(config_json)})
        reporter.finish(final_values(result))
        publish_result(config, prepared, result)
        print(summary_text(result), flush=True)
    return result


def publish_result(config: RunConfig, prepared: Prepared, result: TrainResult) -> None:
    """`checkpoint.push_to_hub`: push the export with its model card (rank 0, after the summary is written)."""
    if config.checkpoint.push_to_hub is None or result.export_dir is None:
        return
    fingerprint = data_fingerprint(prepared.train_dataset, prepared.data_manifest)
    result.hub_url = publish(config, result.export_dir, final_values(result), fingerprint)
