"""End-to-end training benchmark (issue 5): tokens/s and peak memory through the runtime's own step.

    python -m benchmarks.end_to_end --out e2e.json                    # GPU: seq 4096 and 8192, every variant
    python -m benchmarks.end_to_end --longest --out longest.json      # GPU: the longest sequence each fits
    python -m benchmarks.end_to_end --tiny --variants eager,tigon --out /tmp/e2e.json   # CPU smoke run

A Llama-3.2-1B-shaped model (random init from its config: hidden 2048, intermediate 8192, 16 layers,
32 heads, 8 KV heads, vocab 128256, tied embeddings, rope_theta 500000 with llama3 scaling) in
bf16 with AdamW, micro-batch 8, gradient checkpointing on, trained on random tokens by the torch
trainer's own `_optimizer_step` and strategy (its loss, clipping and AdamW step). Variants:

- eager:   Hugging Face modules (kernels.enabled: false)
- liger:   HF + Liger-Kernel (`apply_liger_kernel_to_llama` on the built model; GPU machine only)
- tigon:   tigon's kernels (kernels.enabled: true)
- planner: the memory planner's choice for this GPU (`training.plan: auto`), same global batch

Every variant runs in a fresh subprocess so peaks do not mix; warm-up steps are not timed. The
planner's estimate is recorded next to each measured peak (the planner models eager and tigon;
Liger's rows have none). The trainer's loss is the model's own, called with labels: HF eager computes
`ForCausalLMLoss` from the full logits; Liger's and tigon's patched forwards use their fused linear
cross entropy, so neither materializes the (tokens x vocab) logits.
Results: JSON to --out, a markdown table to --md (default: --out with .md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30

LLAMA_32_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "max_position_embeddings": 131072,
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}
VARIANTS = ("eager", "liger", "tigon", "planner")


# ---------------------------------------------------------------------------------------------------- one run


def bench_config(spec: dict, cuda: bool):
    """The RunConfig of one measurement (data is random tokens, so data.train is never read)."""
    from tigon.runtime.config import parse_config

    shape = dict(spec["shape"])
    shape["max_position_embeddings"] = max(shape.get("max_position_embeddings", 0), spec["seq"])
    raw = {
        "name": f"e2e-{spec['variant']}",
        "model": {
            "config_name": "llama",
            "config_overrides": shape,
            "tokenizer": "char",
            "dtype": "bfloat16" if cuda else "float32",
            "attn_implementation": "sdpa",
        },
        "data": {"train": "random-tokens", "max_seq_len": spec["seq"], "packing": False},
        "training": {
            "max_steps": spec["warmup"] + spec["steps"],
            "learning_rate": 1e-4,
            "lr_schedule": "constant",
            "micro_batch_size": spec["micro_batch"],
            "gradient_accumulation_steps": 1,
            "gradient_checkpointing": spec["checkpointing"],
            "precision": "bf16" if cuda else "fp32",
            "plan": "auto" if spec["variant"] == "planner" else "manual",
        },
        "kernels": {"enabled": spec["variant"] in ("tigon", "planner")},
        "checkpoint": {"export": False, "resume": False},
        "logging": {"run_dir": "runs/e2e", "tensorboard": False, "progress_bar": False},
    }
    return parse_config(raw, f"end_to_end {spec['variant']}")


def random_dataset(n_items: int, seq: int, vocab: int, seed: int) -> list[dict]:
    """Packed-dataset items of random tokens, one document per sequence."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n_items, seq), generator=generator)
    positions = torch.arange(seq)
    return [{"input_ids": row, "labels": row.clone(), "position_ids": positions} for row in ids]


def run_steps(config, steps: int, warmup: int, liger: bool = False) -> dict:
    """Build the model on the device and run warm-up + timed optimizer steps through the torch trainer's step."""
    import torch

    from tigon.runtime import checkpoint as ckpt
    from tigon.runtime import trainer
    from tigon.runtime.distributed import DistEnv
    from tigon.runtime.model import build_model
    from tigon.runtime.parallel import build_strategy

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    training = config.training
    vocab = config.model.config_overrides["vocab_size"]
    if cuda:
        torch.zeros((), device=device)  # initializes CUDA: resetting the peak before that is an error
        torch.cuda.reset_peak_memory_stats(device)
    trainer.seed_everything(training.seed)
    with device:
        model = build_model(config, vocab)
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
    env = DistEnv()
    strategy = build_strategy(model, config, env, device, steps + warmup)  # one process: the model, AdamW
    strategy.model.train()
    global_batch = training.micro_batch_size * training.gradient_accumulation_steps
    dataset = random_dataset(global_batch * (steps + warmup), config.data.max_seq_len, vocab, training.seed)
    sampler = trainer.GlobalBatchSampler(
        len(dataset), training.micro_batch_size, training.gradient_accumulation_steps, 1, 0, training.seed
    )
    state = ckpt.TrainState()
    losses, seconds, tokens = [], 0.0, 0
    for step in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        loss, _, n_tokens = trainer._optimizer_step(strategy, sampler, dataset, state, config, env, device)
        if cuda:
            torch.cuda.synchronize(device)
        state.batches_in_epoch += 1
        losses.append(loss)
        if step >= warmup:
            seconds += time.perf_counter() - started
            tokens += n_tokens
    return {
        "tokens_per_second": tokens / seconds,
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "losses": losses,
    }


def worker(spec: dict) -> dict:
    """One variant at one shape, in this (fresh) process; returns what it measured, or that it ran out of memory."""
    import torch

    from tigon.runtime import planner

    cuda = torch.cuda.is_available()
    if spec["variant"] == "liger" and not cuda:
        raise SystemExit("the liger variant needs a CUDA GPU and liger-kernel; leave it out with --variants")
    config = bench_config(spec, cuda)
    work = planner.workload(config, world_size=1)
    if spec["variant"] == "planner":
        memory = planner.parse_memory(spec["gpu_memory"]) if spec.get("gpu_memory") else None
        try:
            plan = planner.make_plan(config, memory, 1, work)
        except planner.PlanError as error:  # nothing fits: reported like an out-of-memory run
            return {"variant": "planner", "seq": spec["seq"], "oom": True, "plan_error": str(error)}
        print(plan.table(), file=sys.stderr, flush=True)
        config = planner.apply_plan(config, plan)
    setting = planner.setting_of(config)
    result = {
        **{key: spec[key] for key in ("variant", "seq")},
        "micro_batch": setting.micro_batch,
        "accumulation": setting.accumulation,
        "checkpointing": setting.checkpointing,
        "kernels": setting.kernels,
        "estimate_bytes": None if spec["variant"] == "liger" else planner.estimate(work, setting).peak,
    }
    try:
        measured = run_steps(config, spec["steps"], spec["warmup"], liger=spec["variant"] == "liger")
    except torch.OutOfMemoryError:
        return {**result, "oom": True}
    return {**result, "oom": False, **measured}


# ---------------------------------------------------------------------------------------------------- driver


def run_in_subprocess(spec: dict, timeout: int) -> dict:
    """`worker(spec)` in a fresh interpreter; its JSON is the last line of its stdout."""
    command = [sys.executable, "-m", "benchmarks.end_to_end", "--worker", json.dumps(spec)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not done.stdout.strip():  # recorded, so one broken variant does not stop the rest
        print(f"{spec['variant']} at seq {spec['seq']} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
        return {"variant": spec["variant"], "seq": spec["seq"], "oom": False, "error": last}
    return json.loads(done.stdout.strip().splitlines()[-1])


def describe(result: dict) -> str:
    if "error" in result:
        return f"failed: {result['error']}"
    if result["oom"]:
        return "out of memory"
    peak = result["peak_bytes"]
    estimate = result["estimate_bytes"]
    memory = f", peak {peak / GiB:.2f} GiB" if peak is not None else ""
    if peak is not None and estimate is not None:
        memory += f" (estimate {estimate / GiB:.2f} GiB, {estimate / peak:.2f}x)"
    return f"{result['tokens_per_second']:,.0f} tokens/s{memory}, first loss {result['losses'][0]:.4f}"


def predicted_longest(base: dict, limit: int, step: int) -> int | None:
    """The longest multiple of `step` the planner expects this variant to fit; None without a memory figure.

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
    shape = planner.model_shape(bench_config({**base, "variant": variant, "seq": step}, cuda))
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


def longest_sequence(base: dict, start: int, limit: int, step: int, timeout: int) -> tuple[int | None, list[dict]]:
    """Probe from the planner's prediction (or `start`): up by `step` while it fits, else down until it does."""
    probes: list[dict] = []

    class Failed(Exception):
        """A probe failed for another reason than memory: the search stops."""

    def fits(seq: int) -> bool:
        result = run_in_subprocess({**base, "seq": seq}, timeout)
        probes.append(result)
        print(f"  {base['variant']} seq {seq}: {describe(result)}", flush=True)
        if "error" in result:
            raise Failed
        return not result["oom"]

    try:
        return _search(fits, predicted_longest(base, limit, step) or start, base["variant"], limit, step), probes
    except Failed:
        return None, probes


def _search(fits, guess: int, variant: str, limit: int, step: int) -> int | None:
    """From `guess`: up by `step` while it fits, else down until it does."""
    print(f"  {variant}: the planner predicts {guess}", flush=True)

    if fits(guess):
        good, seq = guess, guess + step
        while seq <= limit and fits(seq):
            good, seq = seq, seq + step
        return good
    seq = guess - step
    while seq >= step:
        if fits(seq):
            return seq
        seq -= step
    return None


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


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        f"End-to-end training, {report['model']}: {env.get('gpu') or 'CPU'}, torch {env['torch']}, "
        f"transformers {env['transformers']}"
        + (f", triton {env['triton']}" if env.get("triton") else "")
        + (f", liger-kernel {env['liger_kernel']}" if env.get("liger_kernel") else ""),
        "",
        "| variant | seq | micro x accum | checkpointing | kernels | tokens/s | peak GiB | planner estimate GiB |"
        " estimate / peak |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        if "error" in r or "micro_batch" not in r:  # failed, or the planner found nothing that fits
            lines.append(f"| {r['variant']} | {r['seq']} | | | | {describe(r)} | | | |")
            continue
        peak, estimate = r.get("peak_bytes"), r.get("estimate_bytes")
        cells = [
            r["variant"],
            r["seq"],
            f"{r['micro_batch']} x {r['accumulation']}",
            "on" if r["checkpointing"] else "off",
            "on" if r["kernels"] else "off",
            "out of memory" if r["oom"] else f"{r['tokens_per_second']:,.0f}",
            f"{peak / GiB:.2f}" if peak else "-",
            f"{estimate / GiB:.2f}" if estimate else "-",
            f"{estimate / peak:.2f}" if estimate and peak else "-",
        ]
        lines.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    if report.get("longest"):
        micro = report["settings"]["micro_batch"]
        lines += ["", f"| variant | longest sequence that fits (global batch {micro}) |", "|---|---|"]
        lines += [f"| {name} | {seq if seq else 'none'} |" for name, seq in report["longest"].items()]
    lines += [
        "",
        "Loss: the model's own with labels (HF eager: full logits; Liger and tigon: fused linear cross entropy).",
    ]
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=False, help="JSON results file")
    parser.add_argument("--md", help="markdown table file (default: --out with .md)")
    parser.add_argument("--variants", default="eager,liger,tigon,planner", help=f"comma-separated, of {VARIANTS}")
    parser.add_argument("--seqs", default=None, help="sequence lengths (default 4096,8192; --tiny: 64,128)")
    parser.add_argument("--micro-batch", type=int, default=None, help="sequences per step (default 8; --tiny 2)")
    parser.add_argument("--no-checkpointing", action="store_true", help="gradient checkpointing off (default on)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --tiny 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; --tiny 1)")
    parser.add_argument("--longest", action="store_true", help="search the longest sequence each variant fits")
    parser.add_argument("--longest-max", type=int, default=None, help="longest sequence probed (131072; --tiny 256)")
    parser.add_argument("--gpu-memory", help="planner variant: plan for this much memory (default: the GPU's)")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run that works on the CPU")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per subprocess")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    if not args.out:
        parser.error("--out is required")
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    tiny = args.tiny
    seqs = [int(s) for s in (args.seqs or ("64,128" if tiny else "4096,8192")).split(",")]
    base = {
        "shape": TINY if tiny else LLAMA_32_1B,
        "micro_batch": args.micro_batch or (2 if tiny else 8),
        "checkpointing": not args.no_checkpointing,
        "steps": args.steps or (2 if tiny else 10),
        "warmup": args.warmup if args.warmup is not None else (1 if tiny else 3),
        "gpu_memory": args.gpu_memory,
    }
    report = {
        "model": "tiny Llama" if tiny else "Llama-3.2-1B shape (random init)",
        "shape": base["shape"],
        "environment": environment(),
        "settings": {k: v for k, v in base.items() if k != "shape"},
        "runs": [],
    }
    out = Path(args.out)
    md = Path(args.md) if args.md else out.with_suffix(".md")

    def save() -> None:
        write_atomic(out, json.dumps(report, indent=2) + "\n")
        write_atomic(md, markdown(report))

    total = len(seqs) * len(variants)
    for index, (seq, variant) in enumerate(((s, v) for s in seqs for v in variants), start=1):
        print(f"[{index}/{total}] {variant} at seq {seq} x micro-batch {base['micro_batch']} ...", flush=True)
        result = run_in_subprocess({**base, "variant": variant, "seq": seq}, args.timeout)
        report["runs"].append(result)
        print(f"    {describe(result)}", flush=True)
        save()
    if args.longest:
        report["longest"], report["longest_probes"] = {}, []
        step = 16 if tiny else 1024
        for variant in variants:
            print(f"longest sequence for {variant}:", flush=True)
            limit = args.longest_max or (256 if tiny else 131072)
            probe = {**base, "variant": variant, "steps": 1, "warmup": 1}
            seq, probes = longest_sequence(probe, seqs[0], limit, step, args.timeout)
            failed = seq is None and probes and "error" in probes[-1]
            report["longest"][variant] = "failed (see longest_probes)" if failed else seq
            report["longest_probes"] += probes
            save()
    save()
    print(f"\n{markdown(report)}\nwrote {out} and {md}")


if __name__ == "__main__":
    main()
