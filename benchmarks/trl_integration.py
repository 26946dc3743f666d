"""TRL's trainers three ways: TRL alone, TRL with `use_liger_kernel=True`, and TRL with `use_tigon(trainer)`.

    python -m benchmarks.trl_integration --out trl.json        # GPU: Llama-3.2-1B shape, bf16, seq 1024, DPO and SFT
    python -m benchmarks.trl_integration --shape llama-3-8b --trainers dpo --batch 2 --out trl-8b.json   # GPU: 8B
    python -m benchmarks.trl_integration --tiny --out /tmp/trl.json   # CPU rehearsal (no Liger-Kernel there)

The model is randomly initialized from Llama-3.2-1B's config (`benchmarks.presets.PRESETS["llama"]`; `--tiny`: its
small shape) in bf16 on the GPU (float32 on the CPU); DPO's reference model is a copy of it. The data are random
characters through tigon's character tokenizer (the head still projects onto the whole vocabulary): prompts and
completions of half the sequence each, so every sequence is `--seq` tokens. Each trainer runs `--warmup` untimed
optimizer steps, then `--steps` timed ones, micro-batch `--batch` (pairs for DPO, sequences for SFT), no gradient
accumulation, TRL's other defaults (its gradient checkpointing included). Tokens per second counts TRL's
`num_tokens` (the attention mask's tokens, chosen and rejected) over the timed steps' wall time (GPU synchronized at
each step's start and end); peak memory is `torch.cuda.max_memory_allocated` over the training, model included.

Variants: `trl` (TRL's own trainer: in TRL 1.16 its SFT, DPO and KTO trainers compute the loss with a chunked LM
head of their own), `liger` (`use_liger_kernel=True`: Liger-Kernel's RMSNorm, RoPE and SwiGLU; TRL 1.16 keeps its
own head there, as it refuses Liger's fused linear cross entropy), `tigon` (`use_tigon(trainer)`: tigon's kernels
and its fused linear loss), `runtime` (no TRL: `tigon train` with `objective: dpo` (reference: a frozen copy) or
SFT on the same records, shape, micro-batch and settings, gradient checkpointing on; its tokens count every
sequence's `--seq` tokens, chosen and rejected). Each run is a subprocess of its own (Liger-Kernel patches
transformers' modules in place, and each peak is its own process's); a variant that cannot run here
(Liger-Kernel without a GPU or its package) is recorded as unavailable. JSON goes to --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from pathlib import Path

from benchmarks.end_to_end_runner import liger_function, run_worker
from benchmarks.harness import write_json_atomic
from benchmarks.presets import LLAMA_3_8B, LLAMA_32_1B, PRESETS, TINY

ROOT = Path(__file__).resolve().parents[1]
TRAINERS = ("dpo", "sft")
VARIANTS = ("trl", "liger", "tigon", "runtime")
SHAPES = {"llama-3.2-1b": LLAMA_32_1B, "llama-3-8b": LLAMA_3_8B}


def records(trainer: str, count: int, seq: int, seed: int) -> list[dict]:
    """Random text whose prompt and completion(s) take `seq` tokens together under the character tokenizer (its
    BOS before the prompt and EOS after each completion included)."""
    import random

    generator = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz0123456789 "
    prompt, completion = seq // 2 - 1, seq - seq // 2 - 1

    def text(n: int) -> str:
        return "".join(generator.choice(letters) for _ in range(n))

    if trainer == "dpo":
        return [
            {"prompt": text(prompt), "chosen": text(completion), "rejected": text(completion)} for _ in range(count)
        ]
    return [{"prompt": text(prompt), "completion": text(completion)} for _ in range(count)]


def runtime_worker(spec: dict, head: dict) -> dict:
    """`tigon train` on the same records and model: the runtime's own DPO (or SFT) step, measured from its
    metrics (each step's end time) and summary (peak memory)."""
    import torch

    from tigon.runtime.config import parse_config
    from tigon.runtime.trainer import train

    cuda = torch.cuda.is_available()
    steps = spec["warmup"] + spec["steps"]
    root = Path(tempfile.mkdtemp())
    data = root / "train.jsonl"
    rows = records(spec["trainer"], spec["batch"] * steps, spec["seq"], seed=0)
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = parse_config(
        {
            "model": {
                "config_name": "llama",
                "config_overrides": spec["shape"],
                "tokenizer": "char",
                "dtype": "bfloat16" if cuda else "float32",
            },
            "data": {"train": str(data), "max_seq_len": spec["seq"], "packing": False},
            "objective": {"type": "dpo", "beta": 0.1, "reference": "model"} if spec["trainer"] == "dpo" else {},
            "training": {
                "max_steps": steps,
                "learning_rate": 1e-6,
                "lr_schedule": "constant",
                "micro_batch_size": spec["batch"],
                "gradient_checkpointing": True,
                "precision": "bf16" if cuda else "fp32",
            },
            "checkpoint": {"every_steps": 0, "export": False, "resume": False},
            "logging": {
                "run_dir": str(root / "run"),
                "every_steps": 1,
                "tensorboard": False,
                "progress_bar": False,
                "profile_step": spec.get("profile_step"),
            },
            "eval": {"metrics": ["loss"]},
        },
        "trl_integration runtime",
    )
    train(config)
    metrics = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines() if line]
    logged = [m for m in metrics if m.get("tokens_per_second")]
    ends = [m["tokens_seen"] / m["tokens_per_second"] for m in logged]  # seconds of training at each step's end
    seconds = ends[-1] - (ends[spec["warmup"] - 1] if spec["warmup"] else 0.0)
    sequences = 2 if spec["trainer"] == "dpo" else 1
    summary = json.loads((root / "run" / "summary.json").read_text())
    profile = root / "run" / "profile.json"
    return {
        **({"profile": json.loads(profile.read_text())} if profile.is_file() else {}),
        **head,
        "tokens_per_second": sequences * spec["batch"] * spec["seq"] * spec["steps"] / seconds,
        "peak_bytes": summary["peak_memory_bytes"] if cuda else None,
        "losses": [m["loss"] for m in logged],
        "gradient_checkpointing": True,
    }


def worker(spec: dict) -> dict:
    """One trainer and variant: build, train `warmup + steps` optimizer steps, measure."""
    import datasets
    import torch
    import transformers
    import trl

    from tigon.kernels.integrations import use_tigon
    from tigon.runtime.tokenizer import build_char_tokenizer

    cuda = torch.cuda.is_available()
    head = {"trainer": spec["trainer"], "variant": spec["variant"]}
    if spec["variant"] == "runtime":
        return runtime_worker(spec, head)
    if spec["variant"] == "liger":
        _, why = liger_function("llama", cuda)
        if why is not None:
            return {**head, "unavailable": why}
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    tokenizer = build_char_tokenizer()
    special = {name: getattr(tokenizer, name) for name in ("pad_token_id", "bos_token_id", "eos_token_id")}
    config = transformers.LlamaConfig(**{**spec["shape"], **special})
    torch.manual_seed(0)
    with device:
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16 if cuda else torch.float32)
    steps = spec["warmup"] + spec["steps"]
    data = datasets.Dataset.from_list(records(spec["trainer"], spec["batch"] * steps, spec["seq"], seed=0))
    settings = {
        "output_dir": tempfile.mkdtemp(),
        "per_device_train_batch_size": spec["batch"],
        "max_steps": steps,
        "learning_rate": 1e-6,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "max_length": spec["seq"],
        "bf16": cuda,
        "use_cpu": not cuda,
        "use_liger_kernel": spec["variant"] == "liger",
        "report_to": "none",
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
    }
    if spec["trainer"] == "dpo":
        trainer = trl.DPOTrainer(
            model=model, ref_model=copy.deepcopy(model), args=trl.DPOConfig(**settings), train_dataset=data,
            processing_class=tokenizer,
        )  # fmt: skip
    else:
        trainer = trl.SFTTrainer(
            model=model, args=trl.SFTConfig(**settings), train_dataset=data, processing_class=tokenizer
        )
    if spec["variant"] == "tigon":
        use_tigon(trainer)
    timer = StepTimer(cuda)
    trainer.add_callback(timer)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    tokens = logged[-1]["num_tokens"] - logged[spec["warmup"] - 1]["num_tokens"] if spec["warmup"] else None
    seconds = sum(timer.seconds[spec["warmup"] :])
    return {
        **head,
        "tokens_per_second": (tokens if tokens is not None else logged[-1]["num_tokens"]) / seconds,
        "step_seconds": timer.seconds,
        "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "losses": [entry["loss"] for entry in logged],
        "gradient_checkpointing": trainer.args.gradient_checkpointing,
    }


class StepTimer:
    """Wall time of each optimizer step (the GPU synchronized at its start and end); a `TrainerCallback`."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.seconds, self.started = cuda, [], 0.0

    def _sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        self._sync()
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        self._sync()
        self.seconds.append(time.perf_counter() - self.started)

    def __getattr__(self, name: str):  # the Trainer calls every event; the others do nothing
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def run_in_subprocess(spec: dict, timeout: float) -> dict:
    """`worker(spec)` in a fresh interpreter (`run_worker`)."""
    return run_worker(
        "benchmarks.trl_integration", spec, {"trainer": spec["trainer"], "variant": spec["variant"]}, timeout
    )


def describe(result: dict) -> str:
    if "unavailable" in result:
        return f"not available: {result['unavailable']}"
    if "error" in result:
        return f"error: {result['error']}"
    peak = f"{result['peak_bytes'] / 2**30:.2f} GiB" if result["peak_bytes"] is not None else "n/a (CPU)"
    return f"{result['tokens_per_second']:,.0f} tokens/s, peak {peak}, losses {result['losses']}"


def versions() -> dict:
    import importlib.metadata

    import torch

    found = {name: importlib.metadata.version(name) for name in ("torch", "transformers", "trl", "triton")}
    try:
        found["liger-kernel"] = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        found["liger-kernel"] = None
    found["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="JSON results file")
    parser.add_argument("--trainers", default="dpo,sft", help=f"comma-separated, of {TRAINERS}")
    parser.add_argument("--variants", default="trl,liger,tigon", help=f"comma-separated, of {VARIANTS}")
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024; --tiny 64)")
    parser.add_argument(
        "--batch", type=int, default=None, help="pairs (DPO) or sequences (SFT) a step (default 4; --tiny 2)"
    )
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10; --tiny 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2; --tiny 1)")
    parser.add_argument("--tiny", action="store_true", help="the small Llama shape: a rehearsal that runs on the CPU")
    parser.add_argument("--shape", default="llama-3.2-1b", choices=SHAPES, help="the model's config (random weights)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per subprocess")
    parser.add_argument(
        "--profile-step", type=int, default=None, help="the runtime variant: profile this step (logging.profile_step)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    trainers, variants = args.trainers.split(","), args.variants.split(",")
    unknown = [name for name in trainers if name not in TRAINERS] + [name for name in variants if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown trainers or variants {unknown}; trainers: {TRAINERS}, variants: {VARIANTS}")
    spec = {
        "shape": TINY if args.tiny else SHAPES[args.shape],
        "seq": args.seq or (64 if args.tiny else 1024),
        "batch": args.batch or (2 if args.tiny else 4),
        "steps": args.steps or (2 if args.tiny else 10),
        "warmup": args.warmup if args.warmup is not None else (1 if args.tiny else 2),
        "profile_step": args.profile_step,
    }
    model = PRESETS["llama"].describe(tiny=True) if args.tiny else f"{args.shape} shape (random weights)"
    print(f"TRL trainers on {model}, seq {spec['seq']}, micro-batch {spec['batch']}, {spec['steps']} timed steps")
    results = []
    for trainer in trainers:
        for variant in variants:
            result = run_in_subprocess({**spec, "trainer": trainer, "variant": variant}, args.timeout)
            print(f"{trainer} {variant}: {describe(result)}", flush=True)
            results.append(result)
    report = {
        "model": model,
        **{k: v for k, v in spec.items() if k != "shape"},
        "versions": versions(),
        "runs": results,
    }
    if args.out:
        write_json_atomic(args.out, report)


if __name__ == "__main__":
    main()
