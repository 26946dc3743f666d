"""The plain PyTorch trainer: one loop over pieces other trainers reuse.

    result = train(load_config("examples/demo.yaml"))

The pieces are functions, so an HF `Trainer` or Lightning adapter can share them:
`prepare` (process group, tokenizer, data, model), `token_loss_sum` (the loss), `evaluate`; the optimizer and
schedule live in `tigon.runtime.optim`, the data order (`GlobalBatchSampler`) and batches in
`tigon.runtime.batches`.

Loss normalization: a step's loss is the sum of token losses over all its micro-batches and
ranks divided by the number of label tokens among them, as if the whole global batch were one
forward pass; so gradient accumulation and DDP change nothing but rounding.

Data order: each epoch is a seeded permutation of the training sequences, cut into global
batches of micro_batch_size x gradient_accumulation_steps x world_size; inside a global batch,
micro-batch m of rank r takes chunk m * world_size + r. The order is therefore the same for
1 x 4, 2 x 2 and 2 ranks x 2, and the data position (epoch, batches consumed) resumes exactly.
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
from tigon.runtime.batches import GlobalBatchSampler, autocast, collate, eval_batches, global_token_counts, label_tokens
from tigon.runtime.config import ConfigError, RunConfig
from tigon.runtime.data import generation_examples
from tigon.runtime.distributed import (
    DistEnv,
    all_reduce_sum,
    barrier,
    broadcast_object,
    check_strategy,
    env_from_environ,
    init_distributed,
    shutdown,
    unwrap,
    wait_for_idle_process_groups,
)
from tigon.runtime.files import atomic_write_text
from tigon.runtime.lock import RunDirLock
from tigon.runtime.model import build_model, check_model_config, count_parameters
from tigon.runtime.objectives import check_objective, prepare_objective, state_of
from tigon.runtime.parallel import build_strategy
from tigon.runtime.profiling import profile_step
from tigon.runtime.quantization import check_quantized_base
from tigon.runtime.reporting import (
    PROFILE_FILE,
    PROFILE_TRACE,
    SUMMARY_FILE,
    Reporter,
    final_values,
    make_reporter,
    memory_bytes,
    summary_text,
    write_summary,
)

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


# ---------------------------------------------------------------- shared pieces


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


def token_loss_sum(model: nn.Module, batch: dict, attn_implementation: str, device: torch.device, precision: str):
    """Sum (not mean) of the next-token cross-entropy over label tokens, in float32."""
    from tigon.runtime.data import model_inputs

    inputs = model_inputs(batch, attn_implementation, device)
    inputs["use_cache"] = False
    # The model's own shifted loss as a sum (num_items_in_batch=1); the caller normalizes over the global
    # batch. A model patched with tigon's fused linear cross entropy computes it without logits in training.
    with autocast(device, precision):
        return model(**inputs, num_items_in_batch=1).loss.float()


# ---------------------------------------------------------------- evaluation


def eval_loss(model: nn.Module, dataset, config: RunConfig, env: DistEnv, device: torch.device) -> float:
    """Token-level cross-entropy over the held-out sequences (this rank's share, summed over ranks)."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for batch_indices in eval_batches(dataset, config, env):
        batch = collate([dataset[i] for i in batch_indices or [0]])
        summed = token_loss_sum(model, batch, config.model.attn_implementation, device, config.training.precision)
        if batch_indices:
            totals[0] += summed
            totals[1] += label_tokens(batch["labels"])
    all_reduce_sum(totals, env)
    return float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")


def exact_match_rate(
    model: nn.Module,
    tokenizer,
    examples: list[tuple[list[int], str]],
    config: RunConfig,
    env: DistEnv,
    device: torch.device,
    batch_size: int = 64,
) -> float:
    """Greedy-decode this rank's share of the prompts and score them; the fraction correct over all ranks.

    Prompts are batched by token length, so no padding (and no attention-mask subtleties) is involved.
    """
    from tigon.runtime.tasks import exact_match

    # Sharded weights: every forward is a collective, so each rank decodes all prompts (the same calls on every
    # rank); the all-reduced counts are then world_size times larger, which leaves the fraction unchanged.
    share = examples if config.parallelism.shards_parameters else examples[env.rank :: env.world_size]
    if config.eval.max_batches is not None:
        share = share[: config.eval.max_batches * config.training.micro_batch_size]
    encoded = [(list(ids), response) for ids, response in share]
    longest = max((len(tokenizer.encode(r, add_special_tokens=False)) for _, r in encoded), default=1) + 1
    by_length: dict[int, list[tuple[list[int], str]]] = {}
    for ids, response in encoded:
        by_length.setdefault(len(ids), []).append((ids, response))
    limit = getattr(unwrap(model).config, "max_position_embeddings", None)
    correct = 0
    for length, group in sorted(by_length.items()):
        new_tokens = longest if limit is None else max(1, min(longest, limit - length))
        for start in range(0, len(group), batch_size):
            chunk = group[start : start + batch_size]
            input_ids = torch.tensor([ids for ids, _ in chunk], device=device)
            # decoding runs compiled layers eagerly: each step changes the cache, which they would recompile for
            with autocast(device, config.training.precision), torch.compiler.set_stance("force_eager"):
                output = unwrap(model).generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id,
                    use_cache=True,
                )
            for row, (_, response) in zip(output[:, length:].tolist(), chunk, strict=True):
                if tokenizer.eos_token_id in row:
                    row = row[: row.index(tokenizer.eos_token_id)]
                correct += exact_match(tokenizer.decode(row, skip_special_tokens=True), response)
    totals = all_reduce_sum(torch.tensor([correct, len(share)], dtype=torch.float64, device=device), env)
    return float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")


def evaluate(
    model: nn.Module,
    dataset,
    tokenizer,
    config: RunConfig,
    env: DistEnv,
    device: torch.device,
    examples: list[tuple[list[int], str]] | None = None,
) -> dict[str, float]:
    """The configured metrics; random states are left as they were, so evaluating never changes training."""
    metrics: dict[str, float] = {}
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        if "loss" in config.eval.metrics and config.objective.preference:
            from tigon.runtime.objectives import evaluate_objective

            metrics.update(evaluate_objective(unwrap(model), dataset, config, env, device))
        elif "loss" in config.eval.metrics and config.objective.type == "distill":
            from tigon.runtime.distill import evaluate_distill

            metrics.update(evaluate_distill(unwrap(model), dataset, config, env, device))
        elif "loss" in config.eval.metrics:
            metrics["loss"] = eval_loss(unwrap(model), dataset, config, env, device)
        if "exact_match" in config.eval.metrics and examples:
            metrics["exact_match"] = exact_match_rate(model, tokenizer, examples, config, env, device)
    model.train(was_training)
    return metrics


class Evaluation:
    """The run's evaluation schedule, shared by the three trainers: at step 0 (when `eval.every_steps` is set, so
    the summary shows the metric move), every `eval.every_steps`, and at the last step. Each result goes to the
    run's `TrainState.eval_history` (so a checkpoint keeps it) and to the reporter."""

    def __init__(self, config: RunConfig, prepared: Prepared, state: ckpt.TrainState, reporter: Reporter):
        self.config, self.prepared, self.state, self.reporter = config, prepared, state, reporter
        self.enabled = prepared.eval_dataset is not None and bool(config.eval.metrics)
        self.examples = None
        if self.enabled and "exact_match" in config.eval.metrics:
            self.examples = prepared.eval_examples
            if self.examples is None:  # tokenized here, unless pre-packed data brought them
                self.examples = generation_examples(config, prepared.tokenizer)

    def run(self) -> None:
        if not self.enabled:
            return
        prepared = self.prepared
        metrics = evaluate(
            prepared.model, prepared.eval_dataset, prepared.tokenizer, self.config, prepared.env, prepared.device,
            self.examples,
        )  # fmt: skip
        self.state.eval_history.append({"step": self.state.step, **metrics})
        self.reporter.evaluation(self.state.step, metrics)

    def start(self) -> None:
        """Before the first step of a run that starts from scratch."""
        if self.state.step == 0 and self.config.eval.every_steps > 0:
            self.run()

    def step_done(self, total_steps: int) -> None:
        """After each optimizer step (`state.step` already advanced), before its checkpoint is written."""
        every = self.config.eval.every_steps
        if every > 0 and self.state.step % every == 0 and self.state.step != total_steps:
            self.run()

    def finish(self) -> None:
        """At the end: the last step's metrics, unless they were just taken."""
        history = self.state.eval_history
        if not history or history[-1]["step"] != self.state.step:
            self.run()


# ---------------------------------------------------------------- the run


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
    from tigon.runtime.data import build_datasets
    from tigon.runtime.hub import fetch_model
    from tigon.runtime.publish import check_push
    from tigon.runtime.tokenizer import load_tokenizer
    from tigon.runtime.trackers import check_trackers

    validate_for_torch_trainer(config)
    env, device = init_distributed(config)
    fetch_model(config.model, env)  # one download per node, before any model is built
    check_push(config)
    check_trackers(config)
    seed_everything(config.training.seed, config.training.deterministic)
    tokenizer = load_tokenizer(config.model)
    examples = manifest = None
    if datasets is not None:
        from tigon.runtime.packed import load_packed

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
        from tigon.runtime.preference_data import build_preference_datasets

        train_dataset, eval_dataset, data_summary = build_preference_datasets(config, tokenizer)
    else:
        train_dataset, eval_dataset, data_summary = build_datasets(config, tokenizer)
    if env.is_main:
        logger.info("data: %s", data_summary)
    # FSDP2: only rank 0 builds (or loads) the whole model; the others build its shapes on the meta device and
    # receive rank 0's weights once it is sharded (parallel.receive_rank0_weights).
    meta = config.parallelism.strategy == "fsdp" and env.distributed and not env.is_main
    started = time.perf_counter()
    model = build_model(config, len(tokenizer), tokenizer, meta=meta, device=device)
    if not meta:
        model = model.to(device)
    if env.is_main:
        logger.info("model: built on %s in %.1f s", device, time.perf_counter() - started)
    return Prepared(env, device, tokenizer, train_dataset, eval_dataset, data_summary, model, examples, manifest)


RESUME_SECTIONS = ("model", "data", "lora")
# Where downloads are cached, and which exact attention computes the same function, do not change a run: a resumed
# run may use another cache or attention implementation.
RESUME_IGNORED = {"model": {"cache_dir", "attn_implementation"}, "data": {"cache_dir"}}


def _resume_section(section: dict | None, name: str) -> dict | None:
    """A saved or current config section as resuming compares it: defaults filled in (a checkpoint written before a
    field existed has its default), download caches left out."""
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
    differing = [
        name
        for name in RESUME_SECTIONS
        if _resume_section(saved.get(name), name) != _resume_section(current[name], name)
    ]
    if differing:
        raise ConfigError(
            f"checkpoint.resume: {checkpoint_dir} belongs to a run with different {', '.join(differing)} settings; "
            "use another logging.run_dir, or set checkpoint.resume: false to start over there"
        )


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
    global_batch = training.micro_batch_size * training.gradient_accumulation_steps * world_size
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


def train(config: RunConfig, datasets: str | Path | None = None) -> TrainResult:
    """Run (or resume) one training run as configured; returns what it did. Call on every rank.

    `datasets`: pre-packed data (`tigon.runtime.packed`) to train on instead of tokenizing `config.data`.
    """
    from tigon.runtime import planner

    if config.training.plan == "auto":
        config = planner.planned_config(config)
    # DeepSpeed's ZeRO-3 swaps in its own torch.nn.functional.linear for the rest of the process; a later run in
    # this process (a notebook, a sweep) would then save every linear layer's input, frozen weights' too.
    functional_linear = torch.nn.functional.linear
    main = env_from_environ().is_main
    lock = RunDirLock(config.logging.run_dir).acquire() if main else None  # one run per run directory
    lease = None
    try:
        if main:
            if config.checkpoint.remote_dir:  # and per object-store prefix
                lease = storage.RunLease(storage.RunStorage(config.checkpoint.remote_dir)).acquire()
            ckpt.clean_temporaries(config.logging.run_dir)
        if config.trainer in ("hf", "lightning"):  # thin adapters over the pieces above, imported only when chosen
            if config.trainer == "hf":
                from tigon.runtime.hf_trainer import train_with_hf as adapter
            else:
                from tigon.runtime.lightning_trainer import train_with_lightning as adapter
            result = adapter(config, datasets)
        else:
            result = train_prepared(config, prepare(config, datasets))
        wait_for_idle_process_groups()  # a run, or the process, that follows meets idle gloo threads
        return result
    except torch.OutOfMemoryError as error:  # answered with the planner's setting for this GPU
        raise planner.out_of_memory_error(config, error) from error
    finally:
        torch.nn.functional.linear = functional_linear
        shutdown()
        if lease is not None:
            lease.release()
        if lock is not None:
            lock.release()


def train_prepared(config: RunConfig, prepared: Prepared) -> TrainResult:
    """The torch trainer's run on what `prepare` built: resume (or start over), the step loop, then export and
    report. The adapters finish a run that has no step left to train (resumed at its last step) here too: it
    loads the checkpoint they wrote, evaluates and exports."""
    env, device = prepared.env, prepared.device
    training = config.training
    total_steps, per_epoch = plan_steps(config, len(prepared.train_dataset), env.world_size, env.is_main)
    if config.logging.profile_step is not None and config.logging.profile_step > total_steps:
        raise ConfigError(
            f"logging.profile_step: {config.logging.profile_step} is past the run's last step ({total_steps})"
        )

    trainable, total_params = count_parameters(prepared.model)  # before ZeRO-3 partitions the weights
    prepare_objective(config, prepared)
    strategy = build_strategy(prepared.model, config, env, device, total_steps)  # ddp, fsdp or deepspeed
    sampler = GlobalBatchSampler(
        len(prepared.train_dataset),
        training.micro_batch_size,
        training.gradient_accumulation_steps,
        env.world_size,
        env.rank,
        training.seed,
    )
    if env.is_main:
        logger.info(
            "training %s parameters (%s total) on %s x %d: %d steps of %d sequences x %d tokens (%d steps per epoch)",
            f"{trainable:,}",
            f"{total_params:,}",
            device,
            env.world_size,
            total_steps,
            sampler.global_batch,
            config.data.max_seq_len,
            per_epoch,
        )
    remote = storage.run_storage(config.checkpoint.remote_dir)
    state, resumed_from = resume_or_start_over(config, strategy, env, remote, total_steps)
    config_json = config.model_dump_json(indent=2)
    run_dir = Path(config.logging.run_dir)
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_dir / "config.json", config_json + "\n")
    reporter = make_reporter(config, total_steps, device, enabled=env.is_main, initial_step=state.step)
    run = train_loop(config, prepared, strategy, sampler, state, remote, reporter, total_steps, per_epoch)
    return finish(config, prepared, strategy, state, remote, reporter, run, resumed_from, config_json)


def resume_or_start_over(config: RunConfig, strategy, env: DistEnv, remote, total_steps: int):
    """(the train state, the step resumed from or None): the latest checkpoint's, when `checkpoint.resume` finds
    one, or a fresh state with the run directory cleared of an earlier run's files."""
    run_dir = Path(config.logging.run_dir)
    state = ckpt.TrainState(world_size=env.world_size)
    resumed_from = None
    latest = storage.resume_point(config.checkpoint.remote_dir, run_dir, env) if config.checkpoint.resume else None
    if latest is not None:
        check_resumable(latest, config)
        state = strategy.load_checkpoint(latest)
        resumed_from = state.step
        state.world_size = env.world_size
        if env.is_main:
            logger.info("resumed from %s (step %d, epoch %d)", latest, state.step, state.epoch)
            if state.step > total_steps:
                logger.warning(
                    "%s is at step %d, past this run's %d steps: nothing is trained, the run is evaluated and "
                    "exported as it stands; to train a new run, use another logging.run_dir or set "
                    "checkpoint.resume: false",
                    latest,
                    state.step,
                    total_steps,
                )
    else:
        torch.manual_seed(config.training.seed + env.rank)  # per-rank randomness (dropout) from here on
        start_over(config, env, remote)
    barrier(env)
    return state, resumed_from


@dataclass
class LoopResult:
    """What the step loop measured, for the run's result."""

    train_seconds: float
    tokens: int
    profile: dict | None


def train_loop(
    config: RunConfig,
    prepared: Prepared,
    strategy,
    sampler: GlobalBatchSampler,
    state: ckpt.TrainState,
    remote,
    reporter: Reporter,
    total_steps: int,
    per_epoch: int,
) -> LoopResult:
    """Optimizer steps from `state.step` to `total_steps`: metrics to the reporter (closed at the end), evaluations
    and checkpoints on their schedule, the profiled step where `logging.profile_step` asks."""
    env, device = prepared.env, prepared.device
    run_dir = Path(config.logging.run_dir)
    config_json = config.model_dump_json(indent=2)  # each checkpoint records the run's config
    evaluation = Evaluation(config, prepared, state, reporter)
    evaluation.start()
    every_ckpt = config.checkpoint.every_steps

    train_seconds, tokens_this_run, profile = 0.0, 0, None
    profile_at = config.logging.profile_step
    saving = None  # the checkpoint being written in the background (checkpoint.async_save)
    one_step = functools.partial(_optimizer_step, strategy, sampler, prepared.train_dataset, state, config, env, device)
    strategy.model.train()
    try:
        while state.step < total_steps:
            if state.batches_in_epoch >= per_epoch:
                state.epoch, state.batches_in_epoch = state.epoch + 1, 0
            started = time.perf_counter()
            lr = strategy.lr()
            if state.step + 1 == profile_at:
                trace = run_dir / PROFILE_TRACE if env.is_main else None
                (loss, grad_norm, tokens), profile = profile_step(one_step, device.type == "cuda", trace)
                if env.is_main:
                    atomic_write_text(run_dir / PROFILE_FILE, json.dumps(profile, indent=2) + "\n")
            else:
                loss, grad_norm, tokens = one_step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            train_seconds += time.perf_counter() - started
            tokens_this_run += tokens
            state.step += 1
            state.batches_in_epoch += 1
            state.tokens_seen += tokens
            state.losses.append(loss)
            if not math.isfinite(loss):
                raise FloatingPointError(non_finite_loss_message(loss, state.step, config))
            reporter.step(
                state.step,
                {
                    "loss": loss,
                    "lr": lr,
                    "grad_norm": grad_norm,
                    "epoch": state.epoch + state.batches_in_epoch / per_epoch,
                    "tokens_per_second": tokens_this_run / max(train_seconds, 1e-9),
                    "memory_bytes": memory_bytes(device),
                    "tokens_seen": state.tokens_seen,
                    **state_of(strategy.model).metrics,
                },
            )
            evaluation.step_done(total_steps)
            if every_ckpt > 0 and (state.step % every_ckpt == 0 or state.step == total_steps):
                if saving is not None:  # one checkpoint in flight at a time
                    saving.finish()
                saving = strategy.begin_checkpoint(run_dir, state, config.checkpoint.keep_last, config_json, remote)
                if not config.checkpoint.async_save:
                    saving.finish()
                    saving = None
        if saving is not None:
            saving.finish()
        evaluation.finish()
    finally:
        reporter.close()
    return LoopResult(train_seconds, tokens_this_run, profile)


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
    from tigon.runtime.publish import data_fingerprint, publish

    fingerprint = data_fingerprint(prepared.train_dataset, prepared.data_manifest)
    result.hub_url = publish(config, result.export_dir, final_values(result), fingerprint)


def _optimizer_step(strategy, sampler, dataset, state, config, env, device):
    """One optimizer step over this rank's micro-batches of the global batch at the run's position (`state`).

    Returns (the step's loss over the whole global batch, the gradient norm before clipping, tokens processed).
    """
    micro_batches = [
        collate([dataset[i] for i in indices]) for indices in sampler.micro_batches(state.epoch, state.batches_in_epoch)
    ]
    return run_global_batch(strategy, micro_batches, config, env, device, state.step + 1)


def run_global_batch(strategy, micro_batches: list[dict], config: RunConfig, env: DistEnv, device, step: int):
    """Forward and backward over this rank's micro-batches of one global batch, then the update (`strategy.step`).

    Shared with the Lightning adapter. Returns (the step's loss over the whole global batch, the gradient norm
    before clipping, tokens processed); `step` (1-based) names the step in errors.
    """
    if config.objective.type != "sft":  # a preference objective or distillation
        from tigon.runtime import objectives

        return objectives.run_global_batch(strategy, micro_batches, config, env, device, step)
    training = config.training
    n_label, n_tokens = global_token_counts(micro_batches, env, device, step)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for index, batch in enumerate(micro_batches):
        with strategy.accumulating(last=index == len(micro_batches) - 1):
            summed = token_loss_sum(strategy.model, batch, config.model.attn_implementation, device, training.precision)
            strategy.backward(summed * (env.world_size / n_label))  # gradients are averaged over the ranks
        loss_sum += summed.detach()
    grad_norm = strategy.step()
    all_reduce_sum(loss_sum, env)
    return float(loss_sum) / n_label, float(grad_norm), n_tokens  # read last: each waits for the GPU
