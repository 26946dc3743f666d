"""One end-to-end measurement and the processes that run it (benchmarks/end_to_end.py drives them).

`worker` trains one variant at one shape in its own process: the RunConfig of the variant (`bench_config`),
warm-up and timed optimizer steps through the torch trainer's own step on random tokens (`run_steps`: tokens/s,
peak memory, optionally one profiled step), and the planner's estimate beside the measured peak. `run_worker`
starts such a process and reads its result; `longest_sequence` searches the longest sequence a variant fits, a
process per probe; `Budget` stops starting runs once the next would not end in time.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.end_to_end_report import count_text, describe
from benchmarks.presets import PRESETS, QLORA, text_shape

ROOT = Path(__file__).resolve().parents[1]


def bench_config(spec: dict, cuda: bool):
    """The RunConfig of one measurement (data is random tokens, so data.train is never read)."""
    from tigon.runtime.config import parse_config

    shape = copy.deepcopy(spec["shape"])
    text = text_shape(shape)
    text["max_position_embeddings"] = max(text.get("max_position_embeddings") or 0, spec["seq"])
    raw = {
        "name": f"e2e-{spec.get('family', 'llama')}-{spec['variant']}",
        "model": {
            "config_name": spec.get("family", "llama"),
            "config_overrides": shape,
            "tokenizer": "char",
            "dtype": "bfloat16" if cuda else "float32",
            "attn_implementation": spec.get("attention", "sdpa"),
        },
        "data": {"train": "random-tokens", "max_seq_len": spec["seq"], "packing": False},
        "training": {
            "max_steps": spec["warmup"] + spec["steps"],
            "learning_rate": 1e-4,
            "lr_schedule": "constant",
            "micro_batch_size": spec["micro_batch"],
            "gradient_accumulation_steps": 1,
            "gradient_checkpointing": spec["checkpointing"],
            "checkpoint_layers": spec.get("checkpoint_layers") if spec["checkpointing"] else None,
            "selective_layers": spec.get("selective_layers", 0),
            "compile": spec.get("compile", False),
            "precision": spec.get("precision") or ("bf16" if cuda else "fp32"),
            "plan": "auto" if spec["variant"] == "planner" else "manual",
        },
        "kernels": {"enabled": spec["variant"] in ("tigon", "planner")},
        "lora": QLORA if spec.get("qlora") else {"enabled": False},
        "checkpoint": {"export": False, "resume": False},
        "logging": {"run_dir": "runs/e2e", "tensorboard": False, "progress_bar": False},
    }
    return parse_config(raw, f"end_to_end {spec.get('family', 'llama')} {spec['variant']}")


def random_dataset(n_items: int, seq: int, vocab: int, seed: int) -> list[dict]:
    """Packed-dataset items of random tokens, one document per sequence."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n_items, seq), generator=generator)
    positions = torch.arange(seq)
    return [{"input_ids": row, "labels": row.clone(), "position_ids": positions} for row in ids]


def liger_function(family: str, cuda: bool):
    """(the family's `apply_liger_kernel_to_*`, None) or (None, why the Liger variant is not available)."""
    name = PRESETS[family].liger
    if name is None:
        return None, f"Liger-Kernel has no apply_liger_kernel_to_* function for {family}"
    if not cuda:
        return None, "Liger-Kernel needs a CUDA GPU"
    try:
        import liger_kernel.transformers as liger
    except ImportError as error:  # not installed here (the GPU machine carries its wheel)
        return None, f"liger-kernel is not installed ({error})"
    try:
        function = getattr(liger, name, None)
    except ImportError as error:  # its monkey_patch module refuses this transformers
        return None, f"liger-kernel cannot patch this transformers ({error})"
    if function is None:
        return None, f"the installed liger-kernel has no {name}"
    return function, None


class LigerUnsupported(RuntimeError):
    """Liger-Kernel's function for the family raised while patching the built model."""


def run_steps(config, steps: int, warmup: int, liger=None, profile: bool = False, trace: str | None = None) -> dict:
    """Build the model on the device and run warm-up + timed optimizer steps through the torch trainer's step.

    `liger`: an `apply_liger_kernel_to_*` function, applied to the built model. `profile`: one more step, under
    the profiler, whose time per kind of kernel is returned as "profile" (`tigon.runtime.profiling`); `trace`:
    where that step's Chrome trace goes.
    """
    import torch

    from tigon.runtime import batches, torch_trainer
    from tigon.runtime import checkpoint as ckpt
    from tigon.runtime.distributed import DistEnv
    from tigon.runtime.model import build_model
    from tigon.runtime.run import seed_everything
    from tigon.runtime.strategies import build_strategy

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    training = config.training
    vocab = text_shape(config.model.config_overrides)["vocab_size"]
    if cuda:
        torch.zeros((), device=device)  # initializes CUDA: resetting the peak before that is an error
        torch.cuda.reset_peak_memory_stats(device)
    seed_everything(training.seed)
    adapters = config.lora.enabled
    if liger is not None and adapters:
        liger()  # patches the classes: the model built next has Liger's modules under peft's adapters
    with device:
        model = build_model(config, vocab)
    if liger is not None and not adapters:
        try:
            liger(model=model)
        except Exception as error:  # its patch does not fit this model or this transformers
            raise LigerUnsupported(f"{type(error).__name__}: {error}") from error
    if cuda:  # the step's peak: a 4-bit base is built in model.dtype first and quantized layer by layer after
        torch.cuda.reset_peak_memory_stats(device)
    env = DistEnv()
    strategy = build_strategy(model, config, env, device, steps + warmup)  # one process: the model, AdamW
    strategy.model.train()
    global_batch = training.micro_batch_size * training.gradient_accumulation_steps
    dataset = random_dataset(global_batch * (steps + warmup + profile), config.data.max_seq_len, vocab, training.seed)
    sampler = batches.GlobalBatchSampler(
        len(dataset), training.micro_batch_size, training.gradient_accumulation_steps, 1, 0, training.seed
    )
    state = ckpt.TrainState()
    ahead = torch_trainer.inputs_ahead(strategy, sampler, dataset, config, device)
    total = steps + warmup + profile

    def one_step() -> tuple[float, int]:
        loss, _, n_tokens = torch_trainer.train_step(
            strategy, ahead, state, config, env, device, total, sampler.batches_per_epoch
        )
        state.step += 1
        state.batches_in_epoch += 1
        return loss, n_tokens

    losses, seconds, tokens = [], 0.0, 0
    for step in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        loss, n_tokens = one_step()
        if cuda:
            torch.cuda.synchronize(device)
        losses.append(loss)
        if step >= warmup:
            seconds += time.perf_counter() - started
            tokens += n_tokens
    result = {
        "tokens_per_second": tokens / seconds,
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "losses": losses,
    }
    if profile:
        from tigon.runtime.profiling import profile_step

        _, result["profile"] = profile_step(one_step, cuda, trace)
    return result


def count_parameters(config) -> int:
    """The run's base model's parameters (tied ones once), built on the meta device; LoRA adapters, the only
    parameters that train with LoRA, are left out (the planner's shape counts the base, its estimate the adapters
    apart)."""
    from tigon.runtime.model import build_model

    model = build_model(config, text_shape(config.model.config_overrides)["vocab_size"], meta=True)
    return sum(p.numel() for p in model.parameters() if not (config.lora.enabled and p.requires_grad))


def estimate_note(shape, params: int) -> str | None:
    """Why the planner's estimate is left out for a model of `params` parameters (`ModelShape.counts`): its shape
    counts others, so the estimate is not this model's; None where the counts agree."""
    if shape.counts(params):
        return None
    return (
        f"the planner's decoder shape counts {count_text(shape.params)} parameters, the model has {count_text(params)}"
    )


def worker(spec: dict) -> dict:
    """One variant at one shape, in this (fresh) process; returns what it measured, or that it ran out of memory."""
    import torch

    from tigon.runtime import planner

    cuda = torch.cuda.is_available()
    family = spec.get("family", "llama")
    head = {"family": family, "variant": spec["variant"], "seq": spec["seq"]}
    liger = None
    if spec["variant"] == "liger":
        liger, missing = liger_function(family, cuda)
        if missing:
            return {**head, "oom": False, "unavailable": missing}
    config = bench_config(spec, cuda)
    work = planner.workload(config, world_size=1)
    params = count_parameters(config)
    note = estimate_note(work.shape, params)
    if spec["variant"] == "planner":
        memory = planner.parse_memory(spec["gpu_memory"]) if spec.get("gpu_memory") else None
        try:
            plan = planner.make_plan(config, memory, 1, work)
        except planner.PlanError as error:  # nothing fits: reported like an out-of-memory run
            return {**head, "oom": True, "plan_error": str(error)}
        print(plan.table(), file=sys.stderr, flush=True)
        config = planner.apply_plan(config, plan)
    setting = planner.setting_of(config)
    result = {
        **head,
        "params": params,
        "micro_batch": setting.micro_batch,
        "accumulation": setting.accumulation,
        "checkpointing": setting.checkpointing,
        "checkpoint_layers": setting.checkpoint_layers,
        "recompute": setting.checkpointing_text(),
        "kernels": setting.kernels,
        "estimate_bytes": None if spec["variant"] == "liger" or note else planner.estimate(work, setting).peak,
    }
    if note:
        result["estimate_note"] = note
    try:
        trace = spec.get("trace_dir") and f"{spec['trace_dir']}/{family}-{spec['variant']}-{spec['seq']}.json"
        measured = run_steps(
            config, spec["steps"], spec["warmup"], liger=liger, profile=spec.get("profile", False), trace=trace
        )
    except torch.OutOfMemoryError:
        return {**result, "oom": True}
    except LigerUnsupported as error:
        return {**head, "oom": False, "unavailable": f"not supported by liger: {error}"}
    return {**result, "oom": False, **measured}


def run_worker(module: str, spec: dict, head: dict, timeout: float, label: str = "") -> dict:
    """`python -m <module> --worker <spec>` in a fresh interpreter; its result is the last line of its stdout
    (JSON), with `wall_seconds`. A timeout or a failure gives `head` with the error (a failure's stderr is printed,
    after `label` when given), so one broken run does not stop the rest."""
    command = [sys.executable, "-m", module, "--worker", json.dumps(spec)]
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        if label:
            print(f"{label} timed out after {timeout:.0f} s")
        return {**head, "error": f"timed out after {timeout:.0f} s", "wall_seconds": time.monotonic() - started}
    wall = time.monotonic() - started
    if done.returncode != 0 or not done.stdout.strip():
        if label:
            print(f"{label} failed (exit {done.returncode}):")
        print(done.stderr[-3000:])
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        return {**head, "error": last, "wall_seconds": wall}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_seconds": wall}


def run_in_subprocess(spec: dict, timeout: float) -> dict:
    """`worker(spec)` in a fresh interpreter (`run_worker`)."""
    head = {"family": spec.get("family", "llama"), "variant": spec["variant"], "seq": spec["seq"], "oom": False}
    label = f"{head['family']} {spec['variant']} at seq {spec['seq']}"
    return run_worker("benchmarks.end_to_end", spec, head, timeout, label)


def predicted_longest(base: dict, limit: int, step: int) -> int | None:
    """The longest multiple of `step` the planner expects this variant to fit; None without a memory figure,
    or for a model whose parameters the planner's shape does not count.

    Eager and tigon are compared with the GPU's memory less the CUDA context; the planner variant with the
    planner's own budget; Liger (not modeled) is predicted as tigon.
    """
    import torch

    from tigon.runtime import planner

    cuda = torch.cuda.is_available()
    if base.get("gpu_memory"):
        memory = planner.parse_memory(base["gpu_memory"])
    elif cuda:
        memory = planner.detect_gpu_memory()
    else:
        return None
    variant = "tigon" if base["variant"] == "liger" else base["variant"]
    first = bench_config({**base, "variant": variant, "seq": step}, cuda)
    shape = planner.model_shape(first)
    params = count_parameters(first)
    if estimate_note(shape, params):  # a shape the planner does not count
        return None
    usable = memory - planner.CUDA_CONTEXT
    if variant == "planner":
        usable = int(usable * planner.FIT_FRACTION)
    best = None
    for seq in range(step, limit + 1, step):
        config = bench_config({**base, "variant": variant, "seq": seq}, cuda)
        work, setting = planner.workload(config, 1, shape), planner.setting_of(config)
        settings = planner.candidates(work, setting) if variant == "planner" else [setting]
        if min(planner.estimate(work, s).peak for s in settings) > usable:
            break
        best = seq
    return best


def longest_sequence(base: dict, limit: int, step: int, timeout: int) -> tuple[int | None, list[dict]]:
    """The longest multiple of `step` up to `limit` that fits, searched from the planner's prediction (or
    `limit`, where the planner has none); each probe a fresh process, so none inherits another's fragments."""
    probes: list[dict] = []

    class Failed(Exception):
        """A probe failed for another reason than memory: the search stops."""

    def fits(seq: int) -> bool:
        result = run_in_subprocess({**base, "seq": seq}, timeout)
        probes.append(result)
        print(f"  {base.get('family', 'llama')} {base['variant']} seq {seq}: {describe(result)}", flush=True)
        if "error" in result or "unavailable" in result:
            raise Failed
        return not result["oom"]

    try:
        guess = predicted_longest(base, limit, step) or limit  # a prediction stops at `limit`
        return _search(fits, guess, base["variant"], limit, step), probes
    except Failed:
        return None, probes


def _search(fits, guess: int, variant: str, limit: int, step: int) -> int | None:
    """The longest multiple of `step` up to `limit` that fits, from `guess`: away from it in doubling strides
    until the answer is bracketed, then bisected; about log2 of the distance in probes, not the distance."""
    print(f"  {variant}: the planner predicts {guess}", flush=True)
    good, bad, stride = None, None, step
    if fits(guess):
        good = guess
        while bad is None and good < limit:
            seq = min(good + stride, limit)
            if fits(seq):
                good = seq
            else:
                bad = seq
            stride *= 2
    else:
        bad = guess
        while good is None and bad > step:
            seq = max(bad - stride, step)
            if fits(seq):
                good = seq
            else:
                bad = seq
            stride *= 2
    if good is None:
        return None
    while bad is not None and bad - good > step:
        seq = (good + bad) // 2 // step * step
        if fits(seq):
            good = seq
        else:
            bad = seq
    return good


def environment() -> dict:
    import torch
    import transformers

    info = {"torch": torch.__version__, "transformers": transformers.__version__}
    if torch.cuda.is_available():
        import triton

        info |= {"gpu": torch.cuda.get_device_name(0), "triton": triton.__version__}
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
        try:
            from importlib.metadata import version

            import liger_kernel  # noqa: F401

            info["liger_kernel"] = version("liger-kernel")
        except ImportError:
            info["liger_kernel"] = None
    else:
        info["gpu"] = None
    return info


class Budget:
    """`--time-budget`: a run starts only if it should end in time, judged by the longest run so far."""

    def __init__(self, seconds: float | None):
        self.seconds, self.started, self.longest = seconds, time.monotonic(), 0.0

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - (time.monotonic() - self.started)

    def allows_another(self) -> bool:
        return self.left() > self.longest

    def record(self, result: dict) -> None:
        self.longest = max(self.longest, result.get("wall_seconds", 0.0))

    def skipped(self) -> str:
        return f"time budget ({self.seconds:.0f} s) spent"
